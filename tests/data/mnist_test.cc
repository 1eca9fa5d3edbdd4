#include "data/mnist.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/data/idx_files.h"

namespace psflow::data {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using ::psflow::data::idx_testing::IdxBytes;
using ::psflow::data::idx_testing::WriteGzip;
using ::psflow::data::idx_testing::WritePlain;

std::vector<uint8_t> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void ExpectInvalid(const absl::Status& status, const std::string& substring) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

// A fresh directory per test under testing::TempDir().
class MnistFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::path(::testing::TempDir()) / absl::StrCat("mnist_test_", info->name())).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // `count` images of rows x cols with pixel (i, k) = (i * 7 + k) % 256,
  // and labels i % 10.
  static std::vector<uint8_t> Images(uint32_t count, uint32_t rows, uint32_t cols) {
    std::vector<uint8_t> pixels(size_t{count} * rows * cols);
    for (size_t j = 0; j < pixels.size(); ++j) {
      const size_t i = j / (rows * cols), k = j % (rows * cols);
      pixels[j] = static_cast<uint8_t>((i * 7 + k) % 256);
    }
    return IdxBytes(0x803, {count, rows, cols}, pixels);
  }
  static std::vector<uint8_t> Labels(uint32_t count) {
    std::vector<uint8_t> labels(count);
    for (uint32_t i = 0; i < count; ++i) labels[i] = static_cast<uint8_t>(i % 10);
    return IdxBytes(0x801, {count}, labels);
  }

  std::string dir_;
};

TEST_F(MnistFilesTest, ReadsPlainAndGzippedIdx) {
  const std::vector<uint8_t> bytes =
      IdxBytes(0x803, {2, 2, 3}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255});
  WritePlain(Path("plain"), bytes);
  // A gzipped file without a ".gz" name: detection is by content.
  WriteGzip(Path("zipped"), bytes);
  for (const char* name : {"plain", "zipped"}) {
    absl::StatusOr<IdxFile> idx = ReadIdxFile(Path(name));
    ASSERT_TRUE(idx.ok()) << idx.status();
    EXPECT_THAT(idx->dims, ElementsAre(2, 2, 3)) << name;
    EXPECT_THAT(idx->data, ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 255)) << name;
  }
  // Sanity: the gzipped file really is gzipped.
  const std::vector<uint8_t> raw = ReadAll(Path("zipped"));
  ASSERT_GE(raw.size(), 2u);
  EXPECT_EQ(raw[0], 0x1f);
  EXPECT_EQ(raw[1], 0x8b);
}

TEST_F(MnistFilesTest, LoadsPlainTrainSplit) {
  WritePlain(Path("train-images-idx3-ubyte"), Images(5, 3, 4));
  WritePlain(Path("train-labels-idx1-ubyte"), Labels(5));
  absl::StatusOr<Dataset> ds = LoadMnist(dir_, Split::kTrain);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 5);
  EXPECT_EQ(ds->channels, 1);
  EXPECT_EQ(ds->height, 3);
  EXPECT_EQ(ds->width, 4);
  EXPECT_EQ(ds->num_classes, 10);
  EXPECT_EQ(ds->example_floats(), 12);
  ASSERT_EQ(ds->images.size(), 60u);
  EXPECT_THAT(ds->labels, ElementsAre(0, 1, 2, 3, 4));
  EXPECT_FLOAT_EQ(ds->images[0], 0.0f);
  EXPECT_FLOAT_EQ(ds->images[12 * 2 + 5], ((2 * 7 + 5) % 256) / 255.0f);
  for (float v : ds->images) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LE(v, 1.0f);
  }
}

TEST_F(MnistFilesTest, LoadsGzippedTestSplit) {
  WriteGzip(Path("t10k-images-idx3-ubyte.gz"), Images(300, 28, 28));
  WriteGzip(Path("t10k-labels-idx1-ubyte.gz"), Labels(300));
  absl::StatusOr<Dataset> ds = LoadMnist(dir_, Split::kTest);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 300);
  EXPECT_EQ(ds->height, 28);
  EXPECT_EQ(ds->width, 28);
  EXPECT_EQ(ds->labels[299], 9);
  EXPECT_FLOAT_EQ(ds->images[784 * 299 + 1], ((299 * 7 + 1) % 256) / 255.0f);
  // The train split is not there.
  ExpectInvalid(LoadMnist(dir_, Split::kTrain).status(),
                absl::StrCat("no such file: ", Path("train-images-idx3-ubyte"), "[.gz]"));
}

TEST_F(MnistFilesTest, PrefersThePlainFile) {
  WritePlain(Path("train-images-idx3-ubyte"), Images(2, 1, 1));
  WriteGzip(Path("train-images-idx3-ubyte.gz"), Images(3, 1, 1));
  WritePlain(Path("train-labels-idx1-ubyte"), Labels(2));
  absl::StatusOr<Dataset> ds = LoadMnist(dir_, Split::kTrain);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->count, 2);
}

TEST_F(MnistFilesTest, MissingFile) {
  ExpectInvalid(ReadIdxFile(Path("nothing")).status(),
                absl::StrCat("no such file: ", Path("nothing")));
  WritePlain(Path("train-images-idx3-ubyte"), Images(2, 1, 1));
  ExpectInvalid(LoadMnist(dir_, Split::kTrain).status(),
                absl::StrCat("no such file: ", Path("train-labels-idx1-ubyte"), "[.gz]"));
}

TEST_F(MnistFilesTest, TruncatedPlain) {
  std::vector<uint8_t> bytes = Images(4, 2, 2);
  bytes.resize(bytes.size() - 3);
  WritePlain(Path("short"), bytes);
  ExpectInvalid(ReadIdxFile(Path("short")).status(), Path("short") + " is truncated");
  // Cut inside the header.
  WritePlain(Path("header"), std::vector<uint8_t>(bytes.begin(), bytes.begin() + 6));
  ExpectInvalid(ReadIdxFile(Path("header")).status(), Path("header") + " is truncated");
  WritePlain(Path("empty"), {});
  ExpectInvalid(ReadIdxFile(Path("empty")).status(), Path("empty") + " is truncated");
}

TEST_F(MnistFilesTest, TruncatedGzip) {
  // Incompressible-ish content so the cut lands inside the deflate stream.
  std::vector<uint8_t> pixels(4096);
  uint32_t x = 12345;
  for (auto& p : pixels) p = static_cast<uint8_t>((x = x * 1103515245 + 12345) >> 16);
  WriteGzip(Path("full.gz"), IdxBytes(0x803, {4, 32, 32}, pixels));
  std::vector<uint8_t> raw = ReadAll(Path("full.gz"));
  raw.resize(raw.size() / 2);
  WritePlain(Path("cut.gz"), raw);
  ExpectInvalid(ReadIdxFile(Path("cut.gz")).status(), Path("cut.gz"));
  ExpectInvalid(ReadIdxFile(Path("cut.gz")).status(), "truncated");
  // Only the 8-byte gzip trailer missing: all data is there but the stream
  // is incomplete.
  raw = ReadAll(Path("full.gz"));
  raw.resize(raw.size() - 8);
  WritePlain(Path("notrailer.gz"), raw);
  ExpectInvalid(ReadIdxFile(Path("notrailer.gz")).status(), "truncated");
}

TEST_F(MnistFilesTest, TrailingBytes) {
  std::vector<uint8_t> bytes = Labels(3);
  bytes.push_back(0);
  WritePlain(Path("long"), bytes);
  ExpectInvalid(ReadIdxFile(Path("long")).status(), "has 1 bytes after the 3");
}

TEST_F(MnistFilesTest, BadMagic) {
  WritePlain(Path("text"),
             std::vector<uint8_t>{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  ExpectInvalid(ReadIdxFile(Path("text")).status(), Path("text") + " has bad magic number");
  WritePlain(Path("float"), IdxBytes(0x0d01, {1}, {0, 0, 0, 0}));  // IDX of floats
  ExpectInvalid(ReadIdxFile(Path("float")).status(), "bad magic number 0x00000d01");

  // Well-formed IDX files in the wrong roles: labels where images belong.
  WritePlain(Path("train-images-idx3-ubyte"), Labels(2));
  WritePlain(Path("train-labels-idx1-ubyte"), Labels(2));
  ExpectInvalid(
      LoadMnist(dir_, Split::kTrain).status(),
      Path("train-images-idx3-ubyte") + " has magic number 0x00000801, expected 0x00000803");
  WritePlain(Path("train-images-idx3-ubyte"), Images(2, 1, 1));
  WritePlain(Path("train-labels-idx1-ubyte"), Images(2, 1, 1));
  ExpectInvalid(
      LoadMnist(dir_, Split::kTrain).status(),
      Path("train-labels-idx1-ubyte") + " has magic number 0x00000803, expected 0x00000801");
}

TEST_F(MnistFilesTest, CountMismatch) {
  WriteGzip(Path("train-images-idx3-ubyte.gz"), Images(5, 2, 2));
  WriteGzip(Path("train-labels-idx1-ubyte.gz"), Labels(4));
  ExpectInvalid(LoadMnist(dir_, Split::kTrain).status(),
                Path("train-images-idx3-ubyte.gz") + " has 5 images but " +
                    Path("train-labels-idx1-ubyte.gz") + " has 4 labels");
}

TEST_F(MnistFilesTest, LabelOutOfRange) {
  WritePlain(Path("t10k-images-idx3-ubyte"), Images(3, 1, 1));
  WritePlain(Path("t10k-labels-idx1-ubyte"), IdxBytes(0x801, {3}, {1, 10, 2}));
  ExpectInvalid(LoadMnist(dir_, Split::kTest).status(),
                Path("t10k-labels-idx1-ubyte") + ": label 10 at index 1 is not below 10");
}

TEST(RealDataTest, FashionMnistLoads) {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(fs::path(dir) / "train-images-idx3-ubyte.gz") &&
      !fs::exists(fs::path(dir) / "train-images-idx3-ubyte")) {
    GTEST_SKIP() << "Fashion-MNIST not found in " << dir;
  }
  absl::StatusOr<Dataset> train = LoadMnist(dir, Split::kTrain);
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->count, 60000);
  EXPECT_EQ(train->height, 28);
  EXPECT_EQ(train->width, 28);
  EXPECT_EQ(train->images.size(), 60000u * 784);
  absl::StatusOr<Dataset> test = LoadMnist(dir, Split::kTest);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->count, 10000);
  EXPECT_EQ(test->height, 28);
  EXPECT_EQ(test->width, 28);
  // Every class occurs, and pixels span [0, 1].
  std::set<int32_t> classes(test->labels.begin(), test->labels.end());
  EXPECT_EQ(classes.size(), 10u);
  EXPECT_FLOAT_EQ(*std::max_element(test->images.begin(), test->images.end()), 1.0f);
  EXPECT_FLOAT_EQ(*std::min_element(test->images.begin(), test->images.end()), 0.0f);
}

// --- ShardSampler.

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(ShardSamplerTest, DisjointAndCoveringWhenDivisible) {
  constexpr int64_t kCount = 120;
  constexpr int kWorkers = 4;
  for (int64_t epoch : {0, 1, 7}) {
    std::vector<int64_t> all;
    for (int w = 0; w < kWorkers; ++w) {
      ShardSampler sampler(kCount, kWorkers, w, /*seed=*/42);
      EXPECT_EQ(sampler.shard_size(), 30);
      std::vector<int64_t> shard = sampler.EpochIndices(epoch);
      ASSERT_EQ(shard.size(), 30u);
      all.insert(all.end(), shard.begin(), shard.end());
    }
    std::vector<int64_t> expected(kCount);
    for (int64_t i = 0; i < kCount; ++i) expected[i] = i;
    EXPECT_EQ(Sorted(all), expected) << "epoch " << epoch;  // disjoint and covering
  }
}

TEST(ShardSamplerTest, NotDivisiblePadsByWrapping) {
  constexpr int64_t kCount = 10;
  constexpr int kWorkers = 3;
  std::vector<std::vector<int64_t>> shards;
  std::set<int64_t> seen;
  for (int w = 0; w < kWorkers; ++w) {
    ShardSampler sampler(kCount, kWorkers, w, 7);
    EXPECT_EQ(sampler.shard_size(), 4);
    shards.push_back(sampler.EpochIndices(3));
    ASSERT_EQ(shards.back().size(), 4u);
    for (int64_t i : shards.back()) {
      EXPECT_GE(i, 0);
      EXPECT_LT(i, kCount);
      seen.insert(i);
    }
  }
  EXPECT_EQ(seen.size(), 10u);  // union covers everything
  // 12 slots for 10 examples: positions 10 and 11 (the last of workers 1
  // and 2) wrap around to positions 0 and 1 (the first of workers 0 and 1).
  EXPECT_EQ(shards[1][3], shards[0][0]);
  EXPECT_EQ(shards[2][3], shards[1][0]);
}

TEST(ShardSamplerTest, FewerExamplesThanWorkers) {
  for (int w = 0; w < 5; ++w) {
    ShardSampler sampler(2, 5, w, 1);
    EXPECT_EQ(sampler.shard_size(), 1);
    std::vector<int64_t> shard = sampler.EpochIndices(0);
    ASSERT_EQ(shard.size(), 1u);
    EXPECT_TRUE(shard[0] == 0 || shard[0] == 1);
  }
}

TEST(ShardSamplerTest, EmptyDataset) {
  ShardSampler sampler(0, 2, 1, 1);
  EXPECT_EQ(sampler.shard_size(), 0);
  EXPECT_TRUE(sampler.EpochIndices(0).empty());
}

TEST(ShardSamplerTest, EpochsDifferAndSeedReproduces) {
  ShardSampler a(1000, 2, 1, 123);
  ShardSampler b(1000, 2, 1, 123);
  ShardSampler other_seed(1000, 2, 1, 124);
  EXPECT_EQ(a.EpochIndices(5), b.EpochIndices(5));
  EXPECT_NE(a.EpochIndices(0), a.EpochIndices(1));
  EXPECT_NE(a.EpochIndices(1), a.EpochIndices(2));
  EXPECT_NE(a.EpochIndices(0), other_seed.EpochIndices(0));
  // Shuffled, not the identity stride.
  std::vector<int64_t> stride;
  for (int64_t i = 1; i < 1000; i += 2) stride.push_back(i);
  EXPECT_NE(a.EpochIndices(0), stride);
}

TEST(ShardSamplerTest, StableAcrossPlatforms) {
  // Pinned output: the permutation must not depend on the standard library,
  // since every worker process computes it independently.
  ShardSampler sampler(10, 1, 0, 2024);
  const std::vector<int64_t> indices = sampler.EpochIndices(0);
  EXPECT_EQ(Sorted(indices), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_THAT(indices, ElementsAre(6, 0, 1, 9, 4, 7, 8, 3, 5, 2));
}

// --- GatherBatch.

Dataset TinyDataset() {
  Dataset ds;
  ds.count = 3;
  ds.channels = 1;
  ds.height = 1;
  ds.width = 2;
  ds.images = {0.0f, 0.1f, 1.0f, 1.1f, 2.0f, 2.1f};
  ds.labels = {7, 8, 9};
  return ds;
}

TEST(GatherBatchTest, CopiesExamplesInOrder) {
  const Dataset ds = TinyDataset();
  const std::vector<int64_t> indices = {2, 0, 2};
  std::vector<float> images(6, -1.0f);
  std::vector<int32_t> labels(3, -1);
  ASSERT_TRUE(GatherBatch(ds, indices, images.data(), nullptr, labels.data()).ok());
  EXPECT_THAT(images, ElementsAre(2.0f, 2.1f, 0.0f, 0.1f, 2.0f, 2.1f));
  EXPECT_THAT(labels, ElementsAre(9, 7, 9));
}

TEST(GatherBatchTest, OutOfRangeIsAnError) {
  const Dataset ds = TinyDataset();
  std::vector<float> images(4, -1.0f);
  std::vector<int32_t> labels(2, -1);
  const std::vector<int64_t> too_big = {0, 3};
  ExpectInvalid(GatherBatch(ds, too_big, images.data(), nullptr, labels.data()),
                "index 3 at position 1 is out of range [0, 3)");
  // Nothing was written.
  EXPECT_THAT(labels, ElementsAre(-1, -1));
  const std::vector<int64_t> negative = {-1};
  ExpectInvalid(GatherBatch(ds, negative, images.data(), nullptr, labels.data()), "index -1");
  EXPECT_TRUE(GatherBatch(ds, {}, nullptr, nullptr, nullptr).ok());
}

TEST(GatherBatchTest, CopiesIdsWithTheirExamples) {
  Dataset ds = TinyDataset();
  ds.id_features = {{"a", 1}, {"b", 1}};
  ds.ids = {10, 11, 20, 21, 30, 31};
  const std::vector<int64_t> indices = {2, 0};
  std::vector<float> images(4);
  std::vector<uint64_t> ids(4);
  std::vector<int32_t> labels(2);
  ASSERT_TRUE(GatherBatch(ds, indices, images.data(), ids.data(), labels.data()).ok());
  EXPECT_THAT(ids, ElementsAre(30, 31, 10, 11));
  ExpectInvalid(GatherBatch(ds, indices, images.data(), nullptr, labels.data()),
                "null output buffer");
  ds.ids.pop_back();
  ExpectInvalid(GatherBatch(ds, indices, images.data(), ids.data(), labels.data()),
                "smaller than its count says");
}

}  // namespace
}  // namespace psflow::data
