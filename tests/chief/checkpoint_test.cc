#include "chief/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::chief {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/ckpt_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  static Checkpoint Make(int64_t step) {
    Checkpoint c;
    c.manifest.set_step(step);
    c.manifest.set_num_ps(2);
    c.manifest.set_steps_per_epoch(10);
    c.tensors.push_back({"fc/weights", "", {2, 3}, {1, 2, 3, 4, 5, static_cast<float>(step)}});
    c.tensors.push_back({"fc/weights", "m", {2, 3}, {0.5f, 0, 0, 0, 0, -1}});
    c.tensors.push_back({"fc/bias", "", {2}, {7, 8}});
    return c;
  }

  std::string Ckpt(int64_t step) const {
    return absl::StrCat(CheckpointsDir(dir_), "/ckpt-", step);
  }

  std::string dir_;
};

TEST_F(CheckpointTest, RoundTripsTensorsAndManifest) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(40), 3).ok());
  absl::StatusOr<Checkpoint> got = ReadNewestCheckpoint(dir_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->manifest.step(), 40);
  EXPECT_EQ(got->manifest.num_ps(), 2);
  ASSERT_EQ(got->tensors.size(), 3u);
  const Checkpoint want = Make(40);
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    EXPECT_EQ(got->tensors[i].name, want.tensors[i].name);
    EXPECT_EQ(got->tensors[i].slot, want.tensors[i].slot);
    EXPECT_EQ(got->tensors[i].shape, want.tensors[i].shape);
    EXPECT_EQ(got->tensors[i].values, want.tensors[i].values);
  }
  absl::StatusOr<std::string> pointer = ReadFile(CheckpointsDir(dir_) + "/checkpoint");
  ASSERT_TRUE(pointer.ok());
  EXPECT_EQ(*pointer, "ckpt-40\n");
}

TEST_F(CheckpointTest, NoCheckpointIsNotFound) {
  EXPECT_TRUE(absl::IsNotFound(ReadNewestCheckpoint(dir_).status()));
}

TEST_F(CheckpointTest, KeepsTheNewestAndRemovesLeftovers) {
  fs::create_directories(CheckpointsDir(dir_) + "/ckpt-5.tmp");  // an interrupted write
  for (int64_t step : {10, 20, 30, 40}) ASSERT_TRUE(WriteCheckpoint(dir_, Make(step), 2).ok());
  EXPECT_FALSE(fs::exists(Ckpt(10)));
  EXPECT_FALSE(fs::exists(Ckpt(20)));
  EXPECT_TRUE(fs::exists(Ckpt(30)));
  EXPECT_TRUE(fs::exists(Ckpt(40)));
  EXPECT_FALSE(fs::exists(CheckpointsDir(dir_) + "/ckpt-5.tmp"));
}

TEST_F(CheckpointTest, CorruptNewestFallsBackToTheOlder) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(10), 5).ok());
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(20), 5).ok());
  {
    std::fstream f(Ckpt(20) + "/data", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  }
  absl::StatusOr<Checkpoint> got = ReadNewestCheckpoint(dir_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->manifest.step(), 10);
}

TEST_F(CheckpointTest, HalfWrittenCheckpointsDoNotExist) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(10), 5).ok());
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(20), 5).ok());
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(30), 5).ok());
  fs::remove(Ckpt(30) + "/manifest.pb");   // crashed before the manifest
  fs::resize_file(Ckpt(20) + "/data", 8);  // truncated data
  absl::StatusOr<Checkpoint> got = ReadNewestCheckpoint(dir_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->manifest.step(), 10);
}

TEST_F(CheckpointTest, GarbageManifestIsSkipped) {
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(10), 5).ok());
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(20), 5).ok());
  ASSERT_TRUE(WriteFileAtomically(Ckpt(20) + "/manifest.pb", "\xff\xff\xff garbage").ok());
  absl::StatusOr<Checkpoint> got = ReadNewestCheckpoint(dir_);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->manifest.step(), 10);
  // A manifest naming another step than its directory is not trusted either.
  ASSERT_TRUE(WriteCheckpoint(dir_, Make(30), 5).ok());
  fs::rename(Ckpt(30), Ckpt(50));
  got = ReadNewestCheckpoint(dir_);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->manifest.step(), 10);
}

}  // namespace
}  // namespace psflow::chief
