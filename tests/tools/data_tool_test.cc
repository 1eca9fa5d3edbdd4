// psflow-data: conversion of IDX files, image folders and CSV files to
// TFRecord shards, inspection of TFRecord files, and the binary's command line.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/thread_pool.h"
#include "data/csv/csv.h"
#include "data/image/image.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/data/idx_files.h"
#include "tests/tools/run_data_tool.h"
#include "tools/data/convert.h"
#include "tools/data/inspect.h"
#include "tools/data/sources.h"

namespace psflow::data_tool {
namespace {

namespace fs = std::filesystem;
using ::psflow::data::Example;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A fresh directory per test under testing::TempDir().
class DataToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        (fs::path(::testing::TempDir()) / absl::StrCat("data_tool_test_", info->name())).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = Path(name);
    fs::create_directories(fs::path(path).parent_path());
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // Every record of a TFRecord file, parsed.
  static std::vector<Example> ReadExamples(const std::string& path,
                                           data::RecordCompression* compression = nullptr) {
    std::vector<Example> examples;
    absl::StatusOr<std::unique_ptr<data::RecordReader>> reader = data::RecordReader::Open(path);
    EXPECT_TRUE(reader.ok()) << reader.status();
    if (!reader.ok()) return examples;
    if (compression != nullptr) *compression = (*reader)->compression();
    std::string record;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->Next(&record);
      EXPECT_TRUE(more.ok()) << more.status();
      if (!more.ok() || !*more) break;
      absl::StatusOr<Example> example = data::ParseExample(record);
      EXPECT_TRUE(example.ok()) << example.status();
      if (example.ok()) examples.push_back(*std::move(example));
    }
    return examples;
  }

  // The files of `dir`, sorted.
  static std::vector<std::string> Files(const std::string& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::StatusOr<ConvertSummary> Run(const ConvertOptions& options) {
    ThreadPool pool(options.threads - 1);
    return Convert(options, &pool);
  }

  std::string dir_;
};

std::string Bytes(const Example& e, const std::string& key) {
  absl::StatusOr<absl::string_view> v = data::OneBytes(e, key);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? std::string(*v) : "";
}

int64_t Int(const Example& e, const std::string& key) {
  absl::StatusOr<int64_t> v = data::OneInt64(e, key);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : -1;
}

// Writes <dir>/<prefix>-{images-idx3,labels-idx1}-ubyte of `count` images of
// 4x5 pixels; returns the pixels and the labels.
void WriteIdx(const std::string& dir, const std::string& prefix, uint32_t count, bool gzip,
              std::vector<uint8_t>* pixels, std::vector<uint8_t>* labels) {
  pixels->clear();
  labels->clear();
  for (uint32_t i = 0; i < count * 20; ++i) pixels->push_back(static_cast<uint8_t>(i * 37 + 11));
  for (uint32_t i = 0; i < count; ++i) labels->push_back(static_cast<uint8_t>((i * 7) % 10));
  fs::create_directories(dir);
  const std::string base = (fs::path(dir) / prefix).string();
  const auto images = data::idx_testing::IdxBytes(0x803, {count, 4, 5}, *pixels);
  const auto label_bytes = data::idx_testing::IdxBytes(0x801, {count}, *labels);
  if (gzip) {
    data::idx_testing::WriteGzip(base + "-images-idx3-ubyte.gz", images);
    data::idx_testing::WriteGzip(base + "-labels-idx1-ubyte.gz", label_bytes);
  } else {
    data::idx_testing::WritePlain(base + "-images-idx3-ubyte", images);
    data::idx_testing::WritePlain(base + "-labels-idx1-ubyte", label_bytes);
  }
}

TEST_F(DataToolTest, ShardNamesAreBuildImageDatas) {
  EXPECT_EQ(ShardName("train", 0, 3), "train-00000-of-00003");
  EXPECT_EQ(ShardName("validation", 127, 128), "validation-00127-of-00128");
}

TEST_F(DataToolTest, IdxToThreeShardsKeepsEveryRecordAndPixel) {
  std::vector<uint8_t> pixels, labels;
  WriteIdx(Path("idx"), "train", 10, /*gzip=*/false, &pixels, &labels);
  ConvertOptions o;
  o.from = "idx";
  o.input = Path("idx");
  o.output = Path("out");
  o.shards = 3;
  o.threads = 2;
  absl::StatusOr<ConvertSummary> summary = Run(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->records, 10);
  EXPECT_EQ(summary->shards, 3);
  EXPECT_THAT(Files(o.output),
              ElementsAre("train-00000-of-00003", "train-00001-of-00003", "train-00002-of-00003"));
  int64_t bytes = 0;
  std::vector<size_t> counts;
  int64_t i = 0;
  for (const std::string& name : Files(o.output)) {
    bytes += fs::file_size(fs::path(o.output) / name);
    const std::vector<Example> shard = ReadExamples(Path("out/" + name));
    counts.push_back(shard.size());
    for (const Example& e : shard) {
      EXPECT_EQ(Int(e, "image/class/label"), labels[i]) << i;
      EXPECT_EQ(Bytes(e, "image/format"), "PNG");
      EXPECT_EQ(Int(e, "image/height"), 4);
      EXPECT_EQ(Int(e, "image/width"), 5);
      EXPECT_EQ(Int(e, "image/channels"), 1);
      absl::StatusOr<data::Image> image = data::DecodeImage(Bytes(e, "image/encoded"), 1);
      ASSERT_TRUE(image.ok()) << image.status();
      EXPECT_EQ(image->pixels,
                std::vector<uint8_t>(pixels.begin() + i * 20, pixels.begin() + (i + 1) * 20))
          << i;
      ++i;
    }
  }
  // Contiguous ranges [s*n/N, (s+1)*n/N): 0-3, 3-6, 6-10, in input order.
  EXPECT_THAT(counts, ElementsAre(3, 3, 4));
  EXPECT_EQ(i, 10);
  EXPECT_EQ(summary->bytes, bytes);
  EXPECT_EQ(summary->other_files, 0);
  EXPECT_THAT(DescribeSummary(o, *summary), HasSubstr("wrote 10 records to 3 shards"));
  // Again into 2 shards: the 3 of the first run are still there, and said to be.
  o.shards = 2;
  summary = Run(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->other_files, 3);
  EXPECT_THAT(DescribeSummary(o, *summary),
              HasSubstr("; 3 other train-* files there are not of this run"));
}

TEST_F(DataToolTest, IdxTestSplitAsGzipJpegShards) {
  std::vector<uint8_t> pixels, labels, train_pixels, train_labels;
  WriteIdx(Path("idx"), "t10k", 5, /*gzip=*/true, &pixels, &labels);
  WriteIdx(Path("idx"), "train", 7, /*gzip=*/true, &train_pixels, &train_labels);
  ConvertOptions o;
  o.from = "idx";
  o.input = Path("idx");
  o.output = Path("out");
  o.split = data::Split::kTest;
  o.image_format = data::ImageFormat::kJpeg;
  o.compression = data::RecordCompression::kGzip;
  o.shards = 2;
  o.threads = 4;  // more than the shards
  absl::StatusOr<ConvertSummary> summary = Run(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->records, 5);
  EXPECT_THAT(Files(o.output), ElementsAre("test-00000-of-00002", "test-00001-of-00002"));
  data::RecordCompression compression = data::RecordCompression::kNone;
  std::vector<Example> all = ReadExamples(Path("out/test-00000-of-00002"), &compression);
  EXPECT_EQ(compression, data::RecordCompression::kGzip);
  for (const Example& e : ReadExamples(Path("out/test-00001-of-00002"))) all.push_back(e);
  ASSERT_EQ(all.size(), 5u);
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(Int(all[i], "image/class/label"), labels[i]);
    EXPECT_EQ(Bytes(all[i], "image/format"), "JPEG");
    const std::string encoded = Bytes(all[i], "image/encoded");
    EXPECT_EQ(data::SniffImage(encoded), data::ImageFormat::kJpeg);
    absl::StatusOr<data::Image> image = data::DecodeImage(encoded, 1);
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(image->pixels.size(), 20u);
  }
  EXPECT_EQ(data::CountRecords(Path("out/test-00001-of-00002")).value_or(-1), 3);
}

std::string Encoded(int height, int width, int channels, bool jpeg) {
  data::Image image;
  image.height = height;
  image.width = width;
  image.channels = channels;
  for (int i = 0; i < height * width * channels; ++i) image.pixels.push_back(i * 13);
  absl::StatusOr<std::string> bytes = jpeg ? data::EncodeJpeg(image, 90) : data::EncodePng(image);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.value_or("");
}

TEST_F(DataToolTest, ImageFolderKeepsTheFilesAndLabelsClassesBySortedName) {
  const std::string z = Encoded(6, 7, 3, /*jpeg=*/true);
  const std::string x = Encoded(3, 2, 4, /*jpeg=*/false);
  const std::string y = Encoded(8, 9, 1, /*jpeg=*/true);
  Write("root/b/z.JPEG", z);
  Write("root/b/notes.txt", "not an image");
  Write("root/a/y.jpg", y);
  Write("root/a/x.png", x);
  ConvertOptions o;
  o.from = "image_folder";
  o.input = Path("root");
  o.output = Path("out");
  o.name = "validation";
  absl::StatusOr<ConvertSummary> summary = Run(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_THAT(Files(o.output), ElementsAre("validation-00000-of-00001"));
  const std::vector<Example> all = ReadExamples(Path("out/validation-00000-of-00001"));
  ASSERT_EQ(all.size(), 3u);
  struct Want {
    std::string file, bytes, format, text;
    int64_t label, height, width, channels;
  };
  const std::vector<Want> want = {{"x.png", x, "PNG", "a", 0, 3, 2, 4},
                                  {"y.jpg", y, "JPEG", "a", 0, 8, 9, 1},
                                  {"z.JPEG", z, "JPEG", "b", 1, 6, 7, 3}};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(Bytes(all[i], "image/filename"), want[i].file);
    EXPECT_EQ(Bytes(all[i], "image/encoded"), want[i].bytes) << want[i].file;
    EXPECT_EQ(Bytes(all[i], "image/format"), want[i].format);
    EXPECT_EQ(Bytes(all[i], "image/class/text"), want[i].text);
    EXPECT_EQ(Int(all[i], "image/class/label"), want[i].label);
    EXPECT_EQ(Int(all[i], "image/height"), want[i].height);
    EXPECT_EQ(Int(all[i], "image/width"), want[i].width);
    EXPECT_EQ(Int(all[i], "image/channels"), want[i].channels) << want[i].file;
  }
}

TEST_F(DataToolTest, StoredChannelsReadsTheHeader) {
  EXPECT_EQ(StoredChannels(Encoded(4, 4, 1, true)).value_or(-1), 1);
  EXPECT_EQ(StoredChannels(Encoded(4, 4, 3, true)).value_or(-1), 3);
  EXPECT_EQ(StoredChannels(Encoded(4, 4, 1, false)).value_or(-1), 1);
  EXPECT_EQ(StoredChannels(Encoded(4, 4, 3, false)).value_or(-1), 3);
  EXPECT_EQ(StoredChannels(Encoded(4, 4, 4, false)).value_or(-1), 4);
  EXPECT_FALSE(StoredChannels("GIF89a").ok());
  EXPECT_FALSE(StoredChannels(Encoded(4, 4, 3, true).substr(0, 20)).ok());
}

TEST_F(DataToolTest, CsvRowsBecomeFeaturesOfTheirColumns) {
  std::string csv = "label,price,city,id,title,skip\n";
  for (int i = 0; i < 5; ++i) {
    absl::StrAppend(&csv, i % 2, ",", i == 3 ? "" : absl::StrCat(i, ".5"), ",city", i, ",",
                    i == 4 ? "" : "ff", ",\"t, ", i, "\",x\n");
  }
  ConvertOptions o;
  o.from = "csv";
  o.input = Write("in.csv", csv);
  o.output = Path("out");
  o.shards = 2;
  o.threads = 2;  // the second writer starts past the first's rows
  absl::StatusOr<data::CsvFormat> format = data::CsvFormatFromFlags(
      "", "label:label,price:numeric,city:categorical,id:hex,title:text,skip:ignore", ",", true);
  ASSERT_TRUE(format.ok()) << format.status();
  o.csv = *format;
  absl::StatusOr<ConvertSummary> summary = Run(o);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->records, 5);
  std::vector<Example> all = ReadExamples(Path("out/train-00000-of-00002"));
  EXPECT_EQ(all.size(), 2u);
  for (const Example& e : ReadExamples(Path("out/train-00001-of-00002"))) all.push_back(e);
  ASSERT_EQ(all.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(Int(all[i], "label"), i % 2);
    absl::StatusOr<absl::Span<const float>> price = data::Floats(all[i], "price", 1);
    ASSERT_TRUE(price.ok()) << price.status();
    EXPECT_EQ((*price)[0], i == 3 ? 0.0f : i + 0.5f);
    EXPECT_EQ(static_cast<uint64_t>(Int(all[i], "city")), data::HashId(absl::StrCat("city", i)));
    EXPECT_EQ(Int(all[i], "id"), i == 4 ? 0 : 0xff);
    EXPECT_EQ(Bytes(all[i], "title"), absl::StrCat("t, ", i));
    EXPECT_EQ(all[i].features().feature().count("skip"), 0u);
  }
}

TEST_F(DataToolTest, CsvFormatOfTheFlags) {
  absl::StatusOr<data::CsvFormat> criteo = data::CsvFormatFromFlags("criteo", "", ",", true);
  ASSERT_TRUE(criteo.ok());
  EXPECT_EQ(criteo->delimiter, '\t');
  EXPECT_FALSE(criteo->header);
  EXPECT_EQ(criteo->columns.size(), 40u);
  absl::StatusOr<data::CsvFormat> tab =
      data::CsvFormatFromFlags("", "y:label,*:numeric", "tab", false);
  ASSERT_TRUE(tab.ok());
  EXPECT_EQ(tab->delimiter, '\t');
  EXPECT_FALSE(tab->header);
  EXPECT_THAT(data::CsvFormatFromFlags("", "", ",", true).status().message(),
              HasSubstr("--csv_columns"));
  EXPECT_THAT(data::CsvFormatFromFlags("kaggle", "", ",", true).status().message(),
              HasSubstr("--csv_preset"));
  EXPECT_THAT(data::CsvFormatFromFlags("", "y:label", ";;", true).status().message(),
              HasSubstr("--csv_delimiter"));
}

TEST_F(DataToolTest, ACorruptInputLeavesNoShard) {
  for (int i = 0; i < 6; ++i) Write(absl::StrCat("root/a/", i, ".png"), Encoded(3, 3, 1, false));
  const std::string bad = Write("root/b/bad.jpg", "\xff\xd8\xff garbage");
  ConvertOptions o;
  o.from = "image_folder";
  o.input = Path("root");
  o.output = Path("out");
  o.shards = 3;  // the first shards are whole before the last one fails
  o.threads = 1;
  absl::StatusOr<ConvertSummary> summary = Run(o);
  ASSERT_FALSE(summary.ok());
  EXPECT_THAT(summary.status().message(), HasSubstr(bad));
  EXPECT_EQ(summary.status().ToString().find('\n'), std::string::npos);
  EXPECT_TRUE(Files(o.output).empty()) << Files(o.output).size();
}

TEST_F(DataToolTest, ConvertRefusesBadOptions) {
  ConvertOptions o;
  o.from = "idx";
  o.input = Path("missing");
  o.output = Path("out");
  EXPECT_THAT(Run(o).status().message(), HasSubstr("missing/train-images-idx3-ubyte"));
  o.from = "parquet";
  EXPECT_THAT(Run(o).status().message(), HasSubstr("--from 'parquet'"));
  o.from = "idx";
  o.shards = 0;
  EXPECT_THAT(Run(o).status().message(), HasSubstr("--shards=0"));
  o.shards = 1;
  o.jpeg_quality = 101;
  EXPECT_THAT(Run(o).status().message(), HasSubstr("--jpeg_quality=101"));
  o.jpeg_quality = 95;
  o.from = "image_folder";
  fs::create_directories(Path("empty/a"));
  o.input = Path("empty");
  EXPECT_THAT(Run(o).status().message(), HasSubstr("holds no .jpg"));
  EXPECT_FALSE(fs::exists(o.output));
}

// A file of 3 examples and a record that is not one.
std::string WriteInspected(const std::string& path) {
  auto writer = data::RecordWriter::Open(path);
  EXPECT_TRUE(writer.ok());
  for (int i = 0; i < 3; ++i) {
    Example e;
    data::AddInt64(&e, "label", i);
    data::AddBytes(&e, "image/encoded", std::string(10 + i, 'x'));
    std::string record;
    e.SerializeToString(&record);
    EXPECT_TRUE((*writer)->Write(record).ok());
  }
  EXPECT_TRUE((*writer)->Write("\xff\xff not a proto").ok());
  EXPECT_TRUE((*writer)->Close().ok());
  return path;
}

TEST_F(DataToolTest, InspectShowsTheFirstRecordsAndTheCount) {
  const std::string path = WriteInspected(Path("f.tfrecord"));
  std::ostringstream out;
  ASSERT_TRUE(InspectFile(path, 2, out).ok());
  const std::vector<std::string> lines = absl::StrSplit(out.str(), '\n');
  EXPECT_THAT(lines,
              ElementsAre(path + ": TFRecord, compression none", "record 0 at offset 0: 51 bytes",
                          "  image/encoded: bytes_list, 1 value (10 bytes)",
                          "  label: int64_list, 1 value", "record 1 at offset 67: 52 bytes",
                          "  image/encoded: bytes_list, 1 value (11 bytes)",
                          "  label: int64_list, 1 value", "records: 4", ""));
  std::ostringstream all;
  ASSERT_TRUE(InspectFile(path, 10, all).ok());
  EXPECT_THAT(all.str(), HasSubstr("record 3 at offset 204: 14 bytes\n  not a tf.Example"));
}

TEST_F(DataToolTest, InspectOfACorruptFilePrintsWhatItReadThenFails) {
  const std::string path = WriteInspected(Path("f.tfrecord"));
  fs::resize_file(path, 67 + 30);  // inside record 1
  std::ostringstream out;
  absl::Status status = InspectFile(path, 3, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(status.message(), HasSubstr(path + ": truncated record at offset 67"));
  EXPECT_THAT(out.str(), HasSubstr("record 0 at offset 0: 51 bytes"));
  EXPECT_THAT(out.str(), Not(HasSubstr("records:")));
  std::ostringstream missing;
  EXPECT_EQ(InspectFile(Path("none"), 3, missing).code(), absl::StatusCode::kNotFound);
}

// The binary: exit status, stdout and stderr of `args`.
TEST_F(DataToolTest, BinaryHelpAndOneLineErrors) {
  Ran help = RunBinary(dir_, "--help");
  EXPECT_EQ(help.status, 0);
  EXPECT_THAT(help.out, HasSubstr("psflow-data inspect FILE"));
  EXPECT_THAT(help.out, HasSubstr("--csv_preset"));
  EXPECT_THAT(help.out, HasSubstr("--records"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "give a subcommand"},
      {"shuffle", "unknown subcommand 'shuffle'"},
      {"inspect f --shards=2", "--shards is a flag of convert, not of inspect"},
      {"convert --records=2 --from=idx", "--records is a flag of inspect, not of convert"},
      {"convert --from=idx --input=/nonexistent --output=" + Path("o"), "/nonexistent"},
      {"inspect", "inspect needs a FILE"}};
  for (const auto& [args, message] : cases) {
    Ran ran = RunBinary(dir_, args);
    EXPECT_EQ(ran.status, 1) << args;
    EXPECT_THAT(ran.err, HasSubstr(message)) << args;
    EXPECT_EQ(std::count(ran.err.begin(), ran.err.end(), '\n'), 1) << args << ": " << ran.err;
  }
}

TEST_F(DataToolTest, BinaryConvertsAndInspects) {
  std::vector<uint8_t> pixels, labels;
  WriteIdx(Path("idx"), "train", 6, /*gzip=*/false, &pixels, &labels);
  Ran convert = RunBinary(
      dir_, absl::StrCat("convert --from=idx --input=", Path("idx"), " --output=", Path("out"),
                         " --shards=2 --threads=2 --compression=gzip"));
  EXPECT_EQ(convert.status, 0) << convert.err;
  EXPECT_THAT(convert.out, HasSubstr("wrote 6 records to 2 shards"));
  Ran inspect =
      RunBinary(dir_, absl::StrCat("inspect ", Path("out/train-00001-of-00002"), " --records=1"));
  EXPECT_EQ(inspect.status, 0) << inspect.err;
  EXPECT_THAT(inspect.out, HasSubstr("compression gzip"));
  EXPECT_THAT(inspect.out, HasSubstr("  image/class/label: int64_list, 1 value"));
  EXPECT_THAT(inspect.out, HasSubstr("records: 3"));
  fs::resize_file(Path("out/train-00001-of-00002"), 30);
  Ran corrupt = RunBinary(dir_, absl::StrCat("inspect ", Path("out/train-00001-of-00002")));
  EXPECT_EQ(corrupt.status, 1);
  EXPECT_THAT(corrupt.out, HasSubstr("compression gzip"));
  EXPECT_EQ(std::count(corrupt.err.begin(), corrupt.err.end(), '\n'), 1) << corrupt.err;
}

}  // namespace
}  // namespace psflow::data_tool
