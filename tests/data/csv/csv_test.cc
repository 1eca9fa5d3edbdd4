#include "data/csv/csv.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh directory per test under testing::TempDir().
class CsvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::path(::testing::TempDir()) / absl::StrCat("csv_test_", info->name())).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = (fs::path(dir_) / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // Every record's raw fields, or the first error's message.
  std::vector<std::vector<std::string>> ReadAll(const std::string& path, CsvFormat format,
                                                std::string* error = nullptr) {
    std::vector<std::vector<std::string>> rows;
    absl::StatusOr<std::unique_ptr<CsvReader>> reader = CsvReader::Open(path, std::move(format));
    if (!reader.ok()) {
      if (error != nullptr) *error = std::string(reader.status().message());
      return rows;
    }
    std::vector<std::string> fields;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->NextRow(&fields);
      if (!more.ok()) {
        if (error != nullptr) *error = std::string(more.status().message());
        return rows;
      }
      if (!*more) return rows;
      rows.push_back(fields);
    }
  }

  // The message of the first error Next returns reading path.
  std::string TypedError(const std::string& path, CsvFormat format) {
    absl::StatusOr<std::unique_ptr<CsvReader>> reader = CsvReader::Open(path, std::move(format));
    if (!reader.ok()) return std::string(reader.status().message());
    CsvRow row;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->Next(&row);
      if (!more.ok()) return std::string(more.status().message());
      if (!*more) return "no error";
    }
  }

  std::string dir_;
};

CsvFormat Untyped(char delimiter = ',') {
  CsvFormat format;
  format.delimiter = delimiter;
  format.header = false;
  return format;
}

CsvFormat Spec(const std::string& spec, bool header = false) {
  CsvFormat format;
  format.header = header;
  format.columns = *ParseColumns(spec);
  return format;
}

TEST(HashIdTest, KnownAnswers) {
  EXPECT_EQ(HashId(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(HashId("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(HashId("foobar"), 0x85944171f73967e8ULL);
  EXPECT_EQ(kFnv64OffsetBasis, 0xcbf29ce484222325ULL);
  EXPECT_EQ(kFnv64Prime, 0x100000001b3ULL);
}

TEST(ParseColumnsTest, TypesAndBareNames) {
  absl::StatusOr<std::vector<CsvColumn>> columns =
      ParseColumns("label:label, price:numeric,city:categorical,c1:hex,title:text,url:ignore,n");
  ASSERT_TRUE(columns.ok()) << columns.status();
  ASSERT_EQ(columns->size(), 7u);
  const ColumnType want[] = {ColumnType::kLabel,       ColumnType::kNumeric,
                             ColumnType::kCategorical, ColumnType::kCategoricalHex,
                             ColumnType::kText,        ColumnType::kIgnore,
                             ColumnType::kNumeric};
  const char* names[] = {"label", "price", "city", "c1", "title", "url", "n"};
  for (size_t i = 0; i < columns->size(); ++i) {
    EXPECT_EQ((*columns)[i].name, names[i]);
    EXPECT_EQ((*columns)[i].type, want[i]) << names[i];
  }
}

TEST(ParseColumnsTest, Errors) {
  auto message = [](absl::string_view spec) {
    return std::string(ParseColumns(spec).status().message());
  };
  EXPECT_EQ(message("y:label,x:float"),
            "column spec: unknown type \"float\" for column x (types: label, numeric, categorical, "
            "hex, text, ignore)");
  EXPECT_EQ(message("y:label,x,x:text"), "column spec: column x is named twice");
  EXPECT_EQ(message("x,z"), "column spec: 0 label columns, need exactly one");
  EXPECT_EQ(message("x:label,z:label"), "column spec: 2 label columns, need exactly one");
  EXPECT_EQ(message("y:label,,x"), "column spec: an empty entry");
  EXPECT_EQ(message("y:label,:text"), "column spec: a column has no name");
  EXPECT_EQ(message("y:numeric,*:label"), "column spec: \"*\" cannot be the label");
  EXPECT_TRUE(ParseColumns("y:label,*:ignore").ok());
}

TEST(CriteoFormatTest, Layout) {
  const CsvFormat format = CriteoFormat();
  EXPECT_EQ(format.delimiter, '\t');
  EXPECT_FALSE(format.header);
  ASSERT_EQ(format.columns.size(), 40u);
  EXPECT_EQ(format.columns[0].type, ColumnType::kLabel);
  EXPECT_EQ(format.columns[1].name, "I1");
  EXPECT_EQ(format.columns[13].name, "I13");
  EXPECT_EQ(format.columns[13].type, ColumnType::kNumeric);
  EXPECT_EQ(format.columns[14].name, "C1");
  EXPECT_EQ(format.columns[39].name, "C26");
  EXPECT_EQ(format.columns[39].type, ColumnType::kCategoricalHex);
}

TEST(ResolveHeaderTest, ListedColumnsAndTheRest) {
  CsvFormat format = Spec("city:categorical,y:label,*:ignore", true);
  absl::StatusOr<CsvFormat> resolved = ResolveHeader(format, {"id", "y", "note", "city"});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  ASSERT_EQ(resolved->columns.size(), 4u);
  EXPECT_EQ(resolved->columns[0].name, "id");
  EXPECT_EQ(resolved->columns[0].type, ColumnType::kIgnore);
  EXPECT_EQ(resolved->columns[1].type, ColumnType::kLabel);
  EXPECT_EQ(resolved->columns[2].type, ColumnType::kIgnore);
  EXPECT_EQ(resolved->columns[3].type, ColumnType::kCategorical);

  format = Spec("y:label,*:numeric", true);
  resolved = ResolveHeader(format, {"a", "y", "b"});
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->columns[2].type, ColumnType::kNumeric);
}

TEST(ResolveHeaderTest, Errors) {
  const CsvFormat format = Spec("y:label,price,city:categorical", true);
  EXPECT_EQ(ResolveHeader(format, {"y", "price", "city", "note", "id"}).status().message(),
            "the header's columns note, id are not in the column spec (list them, or add "
            "*:ignore to skip them)");
  EXPECT_EQ(ResolveHeader(format, {"y", "prices", "cty"}).status().message(),
            "the header lacks the spec's columns price, city");
  EXPECT_EQ(ResolveHeader(format, {"y", "price", "city", "price"}).status().message(),
            "the header names the spec's columns price twice");
}

TEST_F(CsvTest, OpenResolvesTheHeader) {
  const std::string path = Write("h.csv", "id,y,city\n7,1,Paris\n");
  absl::StatusOr<std::unique_ptr<CsvReader>> reader =
      CsvReader::Open(path, Spec("y:label,city:categorical,*:ignore", true));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_THAT((*reader)->header(), ElementsAre("id", "y", "city"));
  EXPECT_EQ((*reader)->format().columns[0].type, ColumnType::kIgnore);
  CsvRow row;
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ(row.label, 1);
  EXPECT_THAT(row.categorical, ElementsAre(HashId("Paris")));
  EXPECT_EQ((*reader)->line(), 2);
  EXPECT_FALSE(*(*reader)->Next(&row));

  EXPECT_EQ(CsvReader::Open(path, Spec("y:label,city:categorical", true)).status().message(),
            absl::StrCat(path,
                         ":1: the header's columns id are not in the column spec (list them, or "
                         "add *:ignore to skip them)"));
  EXPECT_EQ(CsvReader::Open(Write("e.csv", ""), Spec("y:label", true)).status().message(),
            absl::StrCat(dir_, "/e.csv: empty, but the format has a header"));
  EXPECT_EQ(CsvReader::Open(path, Spec("y:label,*:ignore")).status().message(),
            "column spec: \"*\" (the columns not listed) needs a header to name them");
}

TEST_F(CsvTest, QuotesDelimitersAndLineBreaks) {
  const std::string path = Write("q.csv",
                                 "plain,\"quoted\",\"with,comma\"\n"
                                 "\"say \"\"hi\"\"\",\"\"\"\",\"\"\n"
                                 "\"two\nlines\",\"crlf\r\ninside\",x\r\n"
                                 ",,\n"
                                 "last,\"\",");
  std::string error;
  const auto rows = ReadAll(path, Untyped(), &error);
  EXPECT_EQ(error, "");
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_THAT(rows[0], ElementsAre("plain", "quoted", "with,comma"));
  EXPECT_THAT(rows[1], ElementsAre("say \"hi\"", "\"", ""));
  EXPECT_THAT(rows[2], ElementsAre("two\nlines", "crlf\r\ninside", "x"));
  EXPECT_THAT(rows[3], ElementsAre("", "", ""));
  EXPECT_THAT(rows[4], ElementsAre("last", "", ""));
  EXPECT_EQ(*CountRows(path, Untyped()), 5);
}

TEST_F(CsvTest, CrlfLineEndsBlankLinesAndByteOrderMark) {
  const std::string path = Write("crlf.csv", "\xEF\xBB\xBFy,x\r\n1,a\r\n\r\n2,\"b\"\r\n\n3,c\r\n");
  const auto rows = ReadAll(path, Untyped());
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_THAT(rows[0], ElementsAre("y", "x"));
  EXPECT_THAT(rows[1], ElementsAre("1", "a"));
  EXPECT_THAT(rows[2], ElementsAre("2", "b"));
  EXPECT_THAT(rows[3], ElementsAre("3", "c"));
  // No final line break, CRLF or LF before it.
  EXPECT_THAT(ReadAll(Write("n.csv", "a,b\r\nc,d"), Untyped()),
              ElementsAre(ElementsAre("a", "b"), ElementsAre("c", "d")));
  EXPECT_THAT(ReadAll(Write("q.csv", "a\n\"c\""), Untyped()),
              ElementsAre(ElementsAre("a"), ElementsAre("c")));
}

TEST_F(CsvTest, LineCountsQuotedLineBreaks) {
  const std::string path = Write("l.csv", "y,t\n1,\"a\nb\nc\"\n\n2,d\n");
  absl::StatusOr<std::unique_ptr<CsvReader>> reader =
      CsvReader::Open(path, Spec("y:label,t:text", true));
  ASSERT_TRUE(reader.ok()) << reader.status();
  CsvRow row;
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ((*reader)->line(), 2);
  EXPECT_THAT(row.text, ElementsAre("a\nb\nc"));
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ((*reader)->line(), 6);
  EXPECT_EQ(row.label, 2);
  EXPECT_EQ(*CountRows(path, Spec("y:label,t:text", true)), 2);
}

TEST_F(CsvTest, CriteoTsvWithMissingValues) {
  std::string line1 = "1\t5\t\t-2.5";
  for (int i = 4; i <= 13; ++i) line1 += "\t";
  line1 += "\t68fd1e64\t";
  for (int i = 3; i <= 26; ++i) line1 += i == 26 ? "\tFFFFFFFF" : "\t";
  std::string line0 = "0";
  for (int i = 1; i <= 13; ++i) line0 += absl::StrCat("\t", i);
  for (int i = 1; i <= 26; ++i) line0 += "\t00000001";
  const std::string path = Write("day_0", line1 + "\n" + line0 + "\n");

  absl::StatusOr<std::unique_ptr<CsvReader>> reader = CsvReader::Open(path, CriteoFormat());
  ASSERT_TRUE(reader.ok()) << reader.status();
  CsvRow row;
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ(row.label, 1);
  ASSERT_EQ(row.numeric.size(), 13u);
  ASSERT_EQ(row.categorical.size(), 26u);
  EXPECT_EQ(row.numeric[0], 5.0f);
  EXPECT_EQ(row.numeric_missing[0], 0);
  EXPECT_EQ(row.numeric[1], 0.0f);
  EXPECT_EQ(row.numeric_missing[1], 1);
  EXPECT_EQ(row.numeric[2], -2.5f);
  EXPECT_EQ(row.numeric_missing[12], 1);
  EXPECT_EQ(row.categorical[0], 0x68fd1e64u);
  EXPECT_EQ(row.categorical[1], kMissingId);
  EXPECT_EQ(row.categorical[24], kMissingId);
  EXPECT_EQ(row.categorical[25], 0xffffffffu);
  EXPECT_TRUE(row.text.empty());

  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ(row.label, 0);
  EXPECT_EQ(row.numeric[12], 13.0f);
  EXPECT_THAT(row.numeric_missing, ::testing::Each(0));
  EXPECT_THAT(row.categorical, ::testing::Each(1u));
  EXPECT_FALSE(*(*reader)->Next(&row));
  EXPECT_EQ(*CountRows(path, CriteoFormat()), 2);
}

TEST_F(CsvTest, TypedColumns) {
  const std::string path = Write("t.csv",
                                 "y,price,city,title,url\n"
                                 "3, 1.5e2 ,NY,\"A, \"\"B\"\"\",http://x\n"
                                 "0,,,,\n");
  absl::StatusOr<std::unique_ptr<CsvReader>> reader =
      CsvReader::Open(path, Spec("y:label,price,city:categorical,title:text,url:ignore", true));
  ASSERT_TRUE(reader.ok()) << reader.status();
  CsvRow row;
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ(row.label, 3);
  EXPECT_THAT(row.numeric, ElementsAre(150.0f));
  EXPECT_THAT(row.numeric_missing, ElementsAre(0));
  EXPECT_THAT(row.categorical, ElementsAre(HashId("NY")));
  EXPECT_THAT(row.text, ElementsAre("A, \"B\""));
  ASSERT_TRUE(*(*reader)->Next(&row));
  EXPECT_EQ(row.label, 0);
  EXPECT_THAT(row.numeric, ElementsAre(0.0f));
  EXPECT_THAT(row.numeric_missing, ElementsAre(1));
  EXPECT_THAT(row.categorical, ElementsAre(kMissingId));
  EXPECT_THAT(row.text, ElementsAre(""));
}

TEST_F(CsvTest, ErrorsNameFileAndLine) {
  const std::string header = "y,x\n";
  const CsvFormat format = Spec("y:label,x:numeric", true);
  std::string rows;
  for (int i = 2; i < 17; ++i) rows += absl::StrCat(i % 2, ",", i, "\n");
  std::string path = Write("file.csv", header + rows + "1,2,3,4,5\n");
  EXPECT_EQ(TypedError(path, format), absl::StrCat(path, ":17: 5 fields, the columns say 2"));
  EXPECT_EQ(CountRows(path, format).status().message(), TypedError(path, format));
  std::string error;
  ReadAll(path, format, &error);
  EXPECT_EQ(error, TypedError(path, format));

  path = Write("unterminated.csv", header + "1,2\n1,\"3\n4,5\n");
  EXPECT_EQ(TypedError(path, format),
            absl::StrCat(path,
                         ":3: field 2: unterminated quote (the field runs to the end of "
                         "the file)"));
  path = Write("inner.csv", header + "1,2\n1,\"a\nb\"\n1,3\"4\n");
  EXPECT_EQ(TypedError(path, Spec("y:label,x:text", true)),
            absl::StrCat(path,
                         ":5: field 2: a quote inside an unquoted field (quote the whole field "
                         "and write the quote twice)"));
  path = Write("after.csv", header + "1,\"2\"x\n");
  EXPECT_EQ(TypedError(path, format),
            absl::StrCat(path,
                         ":2: field 2: a character after its closing quote (a quote inside a "
                         "quoted field is written twice)"));
  path = Write("after_cr.csv", header + "1,\"2\"\rx\n");
  EXPECT_THAT(TypedError(path, format), HasSubstr(":2: field 2: a character after its closing"));
  path = Write("numeric.csv", header + "1,2\n0,abc\n");
  EXPECT_EQ(TypedError(path, format),
            absl::StrCat(path, ":3: column x (numeric): \"abc\" is not a finite float"));
  EXPECT_EQ(TypedError(Write("inf.csv", header + "0,1e39\n"), format),
            absl::StrCat(dir_, "/inf.csv:2: column x (numeric): \"1e39\" is not a finite float"));
  EXPECT_THAT(TypedError(Write("sign.csv", header + "0,+-2\n"), format),
              HasSubstr(":2: column x (numeric): \"+-2\" is not a finite float"));
  EXPECT_THAT(TypedError(Write("minus.csv", header + "0,-\n"), format),
              HasSubstr(":2: column x (numeric): \"-\" is not a finite float"));
  path = Write("label.csv", header + "-1,2\n");
  EXPECT_EQ(TypedError(path, format),
            absl::StrCat(path, ":2: column y (label): \"-1\" is not a non-negative integer"));
  EXPECT_THAT(TypedError(Write("empty_label.csv", header + ",2\n"), format),
              HasSubstr(":2: column y (label): \"\" is not a non-negative integer"));
  EXPECT_THAT(TypedError(Write("frac_label.csv", header + "1.5,2\n"), format),
              HasSubstr(":2: column y (label): \"1.5\" is not a non-negative integer"));
  path = Write("hex.csv", "y,c\n1,zz\n");
  EXPECT_EQ(TypedError(path, Spec("y:label,c:hex", true)),
            absl::StrCat(path, ":2: column c (hex): \"zz\" is not an id of 1 to 16 hex digits"));
}

TEST_F(CsvTest, NumbersThatParse) {
  const std::string path =
      Write("n.csv", "y,x\n0,+2\n0,-0.25\n0,1e-50\n0,3.4e38\n0, 7\n0,-123456789\n0,16777217\n");
  absl::StatusOr<std::unique_ptr<CsvReader>> reader =
      CsvReader::Open(path, Spec("y:label,x", true));
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::vector<float> values;
  CsvRow row;
  while (*(*reader)->Next(&row)) values.push_back(row.numeric[0]);
  EXPECT_THAT(values, ElementsAre(2.0f, -0.25f, 0.0f, 3.4e38f, 7.0f, -123456789.0f, 16777216.0f));
}

TEST_F(CsvTest, UntypedReaderAndNext) {
  const std::string path = Write("u.csv", "a,b\n1\n1,2,3\n");
  EXPECT_THAT(ReadAll(path, Untyped()),
              ElementsAre(ElementsAre("a", "b"), ElementsAre("1"), ElementsAre("1", "2", "3")));
  EXPECT_EQ(*CountRows(path, Untyped()), 3);
  absl::StatusOr<std::unique_ptr<CsvReader>> reader = CsvReader::Open(path, Untyped());
  ASSERT_TRUE(reader.ok());
  CsvRow row;
  EXPECT_EQ((*reader)->Next(&row).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CsvReader::Open(dir_ + "/missing.csv", Untyped()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ParseRowTest, OneRecordInMemory) {
  const CsvFormat format = Spec("y:label,x,c:categorical,t:text");
  CsvRow row;
  ASSERT_TRUE(ParseRow("4,0.5,\"q\",\"l1\r\nl2\"\r\n", format, &row).ok());
  EXPECT_EQ(row.label, 4);
  EXPECT_THAT(row.numeric, ElementsAre(0.5f));
  EXPECT_THAT(row.categorical, ElementsAre(HashId("q")));
  EXPECT_THAT(row.text, ElementsAre("l1\r\nl2"));
  EXPECT_EQ(ParseRow("1,2,3", format, &row).message(), "3 fields, the columns say 4");
  EXPECT_EQ(ParseRow("1,2,3,4\n5,6,7,8", format, &row).message(),
            "more than one record (a line break outside quotes)");
  EXPECT_EQ(ParseRow("1,x,3,4", format, &row).message(),
            "column x (numeric): \"x\" is not a finite float");
}

// Fields of every length up to 20 bytes, tabs at every place in a word of 8.
TEST_F(CsvTest, DelimitersAtEveryOffset) {
  std::vector<std::vector<std::string>> want;
  std::string bytes;
  for (int fields = 1; fields <= 12; ++fields) {
    for (int length = 0; length <= 20; ++length) {
      std::vector<std::string> row;
      for (int f = 0; f < fields; ++f) row.push_back(std::string((length + f) % 21, 'a' + f));
      if (fields == 1 && row[0].empty()) continue;  // a blank line, skipped
      bytes += absl::StrJoin(row, "\t") + (length % 2 ? "\r\n" : "\n");
      want.push_back(row);
    }
  }
  EXPECT_EQ(ReadAll(Write("tabs.tsv", bytes), Untyped('\t')), want);
}

// Records cut by the reader's 4 MiB reads, quoted line breaks among them:
// every field comes back and CountRows agrees with the rows read.
TEST_F(CsvTest, LargeFileAcrossReads) {
  std::mt19937 rng(7);
  std::vector<std::vector<std::string>> want;
  std::string bytes;
  const std::string pieces[] = {"a", "b,c", "\"", "\n", "\r\n", "xyz", ""};
  while (bytes.size() < (size_t{10} << 20)) {
    std::vector<std::string> fields;
    for (int f = 0; f < 3; ++f) {
      std::string value;
      const int n = rng() % 6;
      for (int k = 0; k < n; ++k) value += pieces[rng() % 7];
      if (rng() % 64 == 0) value = std::string(rng() % 100000, 'w');
      fields.push_back(value);
      std::string quoted = "\"";
      for (char c : value) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
      const bool plain = value.find_first_of(",\"\r\n") == std::string::npos;
      bytes += (plain && rng() % 2 ? value : quoted + "\"") + (f < 2 ? "," : "");
    }
    bytes += rng() % 2 ? "\n" : "\r\n";
    want.push_back(fields);
  }
  const std::string path = Write("big.csv", bytes);
  std::string error;
  const auto rows = ReadAll(path, Spec("y:label,b:ignore,c:ignore"), &error);
  EXPECT_EQ(error, "");
  ASSERT_EQ(rows.size(), want.size());
  for (size_t i = 0; i < rows.size(); ++i) ASSERT_EQ(rows[i], want[i]) << "row " << i;
  EXPECT_EQ(*CountRows(path, Spec("y:label,b:ignore,c:ignore")), static_cast<int64_t>(want.size()));
}

// A stray quote in a large file stops the reader at kMaxCsvRecordBytes instead
// of holding the rest of the file.
TEST_F(CsvTest, RecordCapStopsAnUnterminatedQuote) {
  std::string bytes = "1,2\n1,\"x\n";
  const std::string line = "3,4\n";
  while (bytes.size() <= kMaxCsvRecordBytes + line.size()) bytes += line;
  const std::string path = Write("stray.csv", bytes);
  EXPECT_EQ(CountRows(path, Spec("y:label,x:text")).status().message(),
            absl::StrCat(path, ":2: a record of more than 64 MiB (an unterminated quote?)"));
}

}  // namespace
}  // namespace psflow::data
