#include "data/tfrecord/record_file.h"

#include <stdlib.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/event_file.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

std::string LittleEndian(uint64_t value, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
  return out;
}

// One record as TensorFlow frames it, from the format's definition.
std::string Frame(const std::string& data) {
  const std::string length = LittleEndian(data.size(), 8);
  return absl::StrCat(length, LittleEndian(MaskCrc32c(Crc32c(length)), 4), data,
                      LittleEndian(MaskCrc32c(Crc32c(data)), 4));
}

std::string Gzip(const std::string& bytes) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 9, Z_DEFLATED, MAX_WBITS + 16, 9, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, bytes.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

std::string Gunzip(const std::string& bytes) {
  z_stream z{};
  EXPECT_EQ(inflateInit2(&z, MAX_WBITS + 16), Z_OK);
  std::string out;
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  int rc = Z_OK;
  while (rc == Z_OK) {
    char chunk[65536];
    z.next_out = reinterpret_cast<Bytef*>(chunk);
    z.avail_out = sizeof(chunk);
    rc = inflate(&z, Z_NO_FLUSH);
    out.append(chunk, sizeof(chunk) - z.avail_out);
  }
  EXPECT_EQ(rc, Z_STREAM_END);
  inflateEnd(&z);
  return out;
}

std::string RandomBytes(std::mt19937* rng, size_t n) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>((*rng)());
  return out;
}

class RecordFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = absl::StrCat(::testing::TempDir(), "/tfrecord_XXXXXX");
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string WriteFile(const std::string& name, const std::string& contents) {
    const std::string path = absl::StrCat(dir_, "/", name);
    std::ofstream(path, std::ios::binary) << contents;
    return path;
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Every record of `path` through Next, or the first error.
  static absl::StatusOr<std::vector<std::string>> ReadAll(const std::string& path,
                                                          RecordReaderOptions options = {}) {
    absl::StatusOr<std::unique_ptr<RecordReader>> reader = RecordReader::Open(path, options);
    if (!reader.ok()) return reader.status();
    std::vector<std::string> records;
    std::string record;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->Next(&record);
      if (!more.ok()) return more.status();
      if (!*more) return records;
      records.push_back(record);
    }
  }

  std::string dir_;
};

// The bytes of a written record are those of the format's definition, and
// those TensorBoard's event files (common/event_file.h) hold.
TEST_F(RecordFileTest, WritesTheFramingTensorFlowWrites) {
  const std::string path = absl::StrCat(dir_, "/known.tfrecord");
  auto writer = RecordWriter::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE((*writer)->Write("hello").ok());
  ASSERT_TRUE((*writer)->Write("").ok());
  ASSERT_TRUE((*writer)->Close().ok());
  const std::string length5("\x05\0\0\0\0\0\0\0", 8);
  const std::string length0(8, '\0');
  const std::string expected = absl::StrCat(length5, LittleEndian(MaskCrc32c(Crc32c(length5)), 4),
                                            "hello", LittleEndian(MaskCrc32c(Crc32c("hello")), 4),
                                            length0, LittleEndian(MaskCrc32c(Crc32c(length0)), 4),
                                            "", LittleEndian(MaskCrc32c(Crc32c("")), 4));
  EXPECT_EQ(ReadFile(path), expected);
  EXPECT_EQ(ReadFile(path), FrameRecord("hello") + FrameRecord(""));
  EXPECT_EQ(ReadFile(path).size(), 16u + 5 + 16);
}

class RoundTripTest : public RecordFileTest,
                      public ::testing::WithParamInterface<RecordCompression> {};

// Many records of many lengths, an empty one and a 3 MB one, through Next,
// Skip and CountRecords; a gzip file is the gzip of the plain one's bytes.
TEST_P(RoundTripTest, ReadsWhatItWrote) {
  std::mt19937 rng(7);
  std::vector<std::string> records;
  for (int i = 0; i < 2000; ++i) records.push_back(RandomBytes(&rng, rng() % 300));
  records.insert(records.begin() + 10, "");
  records.insert(records.begin() + 500, RandomBytes(&rng, 3 << 20));
  records.push_back("");
  const std::string path = absl::StrCat(dir_, "/data.tfrecord");
  auto writer = RecordWriter::Open(path, GetParam());
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::string plain;
  for (const std::string& record : records) {
    ASSERT_TRUE((*writer)->Write(record).ok());
    plain += Frame(record);
  }
  ASSERT_TRUE((*writer)->Close().ok());
  const std::string bytes = ReadFile(path);
  EXPECT_EQ(GetParam() == RecordCompression::kGzip ? Gunzip(bytes) : bytes, plain);

  auto reader = RecordReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ((*reader)->compression(), GetParam());
  std::string record;
  int64_t offset = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    ASSERT_EQ((*reader)->offset(), offset);
    absl::StatusOr<bool> more = (*reader)->Next(&record);
    ASSERT_TRUE(more.ok() && *more) << i << " " << more.status();
    ASSERT_EQ(record, records[i]) << i;
    offset += 16 + static_cast<int64_t>(records[i].size());
  }
  EXPECT_EQ(*(*reader)->Next(&record), false);
  EXPECT_EQ(*(*reader)->Next(&record), false);
  EXPECT_EQ((*reader)->offset(), static_cast<int64_t>(plain.size()));
  EXPECT_EQ((*reader)->bad_records(), 0);
  EXPECT_EQ(*CountRecords(path), static_cast<int64_t>(records.size()));
}

// Skip moves past records without returning them; offset() follows.
TEST_P(RoundTripTest, SkipAndOffset) {
  const std::string path = absl::StrCat(dir_, "/skip.tfrecord");
  auto writer = RecordWriter::Open(path, GetParam());
  ASSERT_TRUE(writer.ok());
  const std::vector<std::string> records = {"zero", std::string(2 << 20, 'x'), "two", "", "four"};
  for (const std::string& record : records) ASSERT_TRUE((*writer)->Write(record).ok());
  ASSERT_TRUE((*writer)->Close().ok());

  auto reader = RecordReader::Open(path);
  ASSERT_TRUE(reader.ok());
  std::string record;
  EXPECT_TRUE(*(*reader)->Skip());
  EXPECT_EQ((*reader)->offset(), 16 + 4);
  EXPECT_TRUE(*(*reader)->Skip());  // the 2 MiB one: seeks in a plain file
  EXPECT_EQ((*reader)->offset(), 16 + 4 + 16 + (2 << 20));
  EXPECT_TRUE(*(*reader)->Next(&record));
  EXPECT_EQ(record, "two");
  EXPECT_TRUE(*(*reader)->Skip());
  EXPECT_TRUE(*(*reader)->Next(&record));
  EXPECT_EQ(record, "four");
  EXPECT_EQ((*reader)->offset(), 5 * 16 + 4 + (2 << 20) + 3 + 0 + 4);
  EXPECT_FALSE(*(*reader)->Skip());
  EXPECT_FALSE(*(*reader)->Next(&record));
}

TEST_P(RoundTripTest, EmptyFileHasNoRecords) {
  const std::string path = absl::StrCat(dir_, "/empty.tfrecord");
  auto writer = RecordWriter::Open(path, GetParam());
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Close().ok());
  EXPECT_EQ(ReadAll(path)->size(), 0u);
  EXPECT_EQ(*CountRecords(path), 0);
}

INSTANTIATE_TEST_SUITE_P(Compressions, RoundTripTest,
                         ::testing::Values(RecordCompression::kNone, RecordCompression::kGzip),
                         [](const ::testing::TestParamInfo<RecordCompression>& info) {
                           return info.param == RecordCompression::kGzip ? "Gzip" : "Plain";
                         });

// A gzip stream made by zlib directly (as TensorFlow's "GZIP" writer makes
// one), at another level than RecordWriter's, reads the same.
TEST_F(RecordFileTest, ReadsAnyGzipStream) {
  const std::string path = WriteFile("tf.tfrecord.gz", Gzip(Frame("a") + Frame("bc")));
  EXPECT_EQ(*ReadAll(path), (std::vector<std::string>{"a", "bc"}));
}

// A plain file whose first length begins with the gzip magic (0x8b1f bytes)
// is told apart by its length CRC.
TEST_F(RecordFileTest, PlainFileThatStartsLikeGzip) {
  const std::string big(0x8b1f, 'g');
  const std::string path = WriteFile("magic.tfrecord", Frame(big) + Frame("x"));
  ASSERT_EQ(ReadFile(path).substr(0, 2), "\x1f\x8b");
  auto reader = RecordReader::Open(path);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->compression(), RecordCompression::kNone);
  EXPECT_EQ(*ReadAll(path), (std::vector<std::string>{big, "x"}));
}

TEST_F(RecordFileTest, MissingFileIsNotFound) {
  const std::string path = absl::StrCat(dir_, "/no_such.tfrecord");
  auto reader = RecordReader::Open(path);
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reader.status().message(), absl::StrCat(path, ": no such file"));
  EXPECT_EQ(CountRecords(path).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(RecordReader::Open(dir_).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RecordFileTest, WriterErrors) {
  EXPECT_FALSE(RecordWriter::Open(absl::StrCat(dir_, "/no/such/dir/x.tfrecord")).ok());
  auto writer = RecordWriter::Open(absl::StrCat(dir_, "/w.tfrecord"));
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE((*writer)->Close().ok());
  EXPECT_EQ((*writer)->Write("late").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*writer)->Close().code(), absl::StatusCode::kFailedPrecondition);
}

// Files of records "a", "bb", "ccc" with the middle one damaged. Each gives
// one line naming the file and the damaged record's offset (20, after "a").
struct Damage {
  const char* name;
  std::string contents;
  absl::StatusCode code;
  std::string message;  // after "<path>: "
  // What skip_bad_records reads: "a" and "ccc" when only the data is bad,
  // else "a" and then the end.
  std::vector<std::string> skipping;
};

std::vector<Damage> Damages() {
  const std::string a = Frame("a"), b = Frame("bb"), c = Frame("ccc");
  std::string bad_length = b, bad_data = b, bad_crc = b;
  bad_length[0] ^= 0x01;  // a length of 3, which its CRC refuses
  bad_data[13] ^= 0x01;
  bad_crc[b.size() - 1] ^= 0x80;
  const std::string huge_length = LittleEndian(uint64_t{3} << 30, 8);
  const std::string huge = huge_length + LittleEndian(MaskCrc32c(Crc32c(huge_length)), 4) + "bb";
  const std::vector<std::string> skip_data = {"a", "ccc"}, lose_framing = {"a"};
  return {
      {"LengthCrc", a + bad_length + c, absl::StatusCode::kDataLoss,
       "corrupt record at offset 17: its length fails the CRC", lose_framing},
      {"DataCrc", a + bad_data + c, absl::StatusCode::kDataLoss,
       "corrupt record at offset 17: its data fails the CRC", skip_data},
      {"StoredDataCrc", a + bad_crc + c, absl::StatusCode::kDataLoss,
       "corrupt record at offset 17: its data fails the CRC", skip_data},
      {"TruncatedInLength", a + b.substr(0, 5), absl::StatusCode::kDataLoss,
       "truncated record at offset 17", lose_framing},
      {"TruncatedInLengthCrc", a + b.substr(0, 10), absl::StatusCode::kDataLoss,
       "truncated record at offset 17", lose_framing},
      {"TruncatedInData", a + b.substr(0, 13), absl::StatusCode::kDataLoss,
       "truncated record at offset 17", lose_framing},
      {"TruncatedInDataCrc", a + b.substr(0, b.size() - 1), absl::StatusCode::kDataLoss,
       "truncated record at offset 17", lose_framing},
      {"AbsurdLength", a + huge + c, absl::StatusCode::kInvalidArgument,
       "record at offset 17 is 3221225472 bytes, over the 2 GiB limit", lose_framing},
  };
}

// gtest names the case, not its bytes.
void PrintTo(const Damage& damage, std::ostream* os) { *os << damage.name; }

class DamageTest : public RecordFileTest, public ::testing::WithParamInterface<Damage> {};

TEST_P(DamageTest, ErrorNamesFileAndOffset) {
  const Damage& damage = GetParam();
  const std::string path = WriteFile("damaged.tfrecord", damage.contents);
  auto reader = RecordReader::Open(path);
  ASSERT_TRUE(reader.ok());
  std::string record;
  ASSERT_TRUE(*(*reader)->Next(&record));
  EXPECT_EQ(record, "a");
  absl::StatusOr<bool> more = (*reader)->Next(&record);
  EXPECT_EQ(more.status().code(), damage.code);
  EXPECT_EQ(more.status().message(), absl::StrCat(path, ": ", damage.message));
  // The error stays: the caller cannot read past it by accident.
  EXPECT_EQ((*reader)->Next(&record).status(), more.status());
}

TEST_P(DamageTest, SkipBadRecordsCountsThem) {
  const Damage& damage = GetParam();
  const std::string path = WriteFile("damaged.tfrecord", damage.contents);
  RecordReaderOptions options;
  options.skip_bad_records = true;
  auto reader = RecordReader::Open(path, options);
  ASSERT_TRUE(reader.ok());
  std::vector<std::string> records;
  std::string record;
  while (true) {
    absl::StatusOr<bool> more = (*reader)->Next(&record);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    records.push_back(record);
  }
  EXPECT_EQ(records, damage.skipping);
  EXPECT_EQ((*reader)->bad_records(), 1);
}

// Skip and CountRecords check the framing but not the data.
TEST_P(DamageTest, CountRecordsChecksTheFraming) {
  const Damage& damage = GetParam();
  const std::string path = WriteFile("damaged.tfrecord", damage.contents);
  const bool data_only = damage.skipping.size() == 2 && damage.skipping[1] == "ccc";
  absl::StatusOr<int64_t> count = CountRecords(path);
  if (data_only) {
    EXPECT_EQ(*count, 3);
  } else {
    EXPECT_EQ(count.status().code(), damage.code);
    EXPECT_EQ(count.status().message(), absl::StrCat(path, ": ", damage.message));
  }
  RecordReaderOptions options;
  options.skip_bad_records = true;
  EXPECT_EQ(*CountRecords(path, options), data_only ? 3 : 1);
}

INSTANTIATE_TEST_SUITE_P(Damages, DamageTest, ::testing::ValuesIn(Damages()),
                         [](const ::testing::TestParamInfo<Damage>& info) {
                           return std::string(info.param.name);
                         });

TEST_F(RecordFileTest, UncheckedDataCrcReadsTheRecord) {
  std::string b = Frame("bb");
  b[13] ^= 0x01;
  const std::string path = WriteFile("unchecked.tfrecord", Frame("a") + b);
  RecordReaderOptions options;
  options.check_data_crc = false;
  EXPECT_EQ(*ReadAll(path, options), (std::vector<std::string>{"a", "bc"}));
}

// A gzip stream cut short: the records before the cut read, then the record
// it cuts is truncated. Without its 8-byte trailer every record reads, and
// the end of the stream is reported where the next record would start.
TEST_F(RecordFileTest, TruncatedGzipStream) {
  std::mt19937 rng(3);
  const std::string big = RandomBytes(&rng, 100000);  // incompressible
  const std::string gz = Gzip(Frame("a") + Frame(big));
  const std::string cut = WriteFile("cut.tfrecord.gz", gz.substr(0, gz.size() / 2));
  std::string record;
  auto reader = RecordReader::Open(cut);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->compression(), RecordCompression::kGzip);
  ASSERT_TRUE(*(*reader)->Next(&record));
  EXPECT_EQ((*reader)->Next(&record).status().message(),
            absl::StrCat(cut, ": truncated record at offset 17"));

  const std::string no_trailer = WriteFile("trailer.tfrecord.gz", gz.substr(0, gz.size() - 8));
  reader = RecordReader::Open(no_trailer);
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(*(*reader)->Next(&record));
  ASSERT_TRUE(*(*reader)->Next(&record));
  EXPECT_EQ(record, big);
  EXPECT_EQ((*reader)->Next(&record).status().message(),
            absl::StrCat(no_trailer, ": truncated record at offset ", 17 + 16 + big.size()));

  RecordReaderOptions options;
  options.skip_bad_records = true;
  reader = RecordReader::Open(no_trailer, options);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(*CountRecords(no_trailer, options), 2);
}

TEST_F(RecordFileTest, CorruptGzipStreamIsDataLoss) {
  std::mt19937 rng(5);
  std::string gz = Gzip(Frame("a") + Frame(RandomBytes(&rng, 100000)));
  for (size_t i = gz.size() / 3; i < gz.size() / 3 + 64; ++i) gz[i] = static_cast<char>(rng());
  const std::string path = WriteFile("corrupt.tfrecord.gz", gz);
  absl::StatusOr<std::vector<std::string>> records = ReadAll(path);
  EXPECT_EQ(records.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(records.status().message().substr(0, path.size() + 2), path + ": ");
  EXPECT_EQ(records.status().message().find('\n'), absl::string_view::npos);
}

}  // namespace
}  // namespace psflow::data
