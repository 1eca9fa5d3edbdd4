#include "model/saved_model.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <google/protobuf/util/message_differencer.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/spec.h"

namespace psflow::model {
namespace {

using ::testing::HasSubstr;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class SavedModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/saved_model_test_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                        "/nested/dir");
    std::filesystem::remove_all(dir_);
    absl::StatusOr<ModelSpec> spec = ResolveModelSpec("cnn");
    ASSERT_TRUE(spec.ok()) << spec.status();
    spec_ = *spec;
    values_ = InitialValues(spec_, 7);
  }

  std::string file() const { return absl::StrCat(dir_, "/", kSavedModelFile); }

  void ExpectLoaded(const absl::StatusOr<LoadedModel>& loaded) {
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(loaded->spec, spec_));
    EXPECT_EQ(loaded->global_step, 1234);
    EXPECT_EQ(loaded->values, values_);
  }

  std::string dir_;
  ModelSpec spec_;
  std::vector<std::vector<float>> values_;
};

TEST_F(SavedModelTest, WriteAndReadBackFromDirectoryOrFile) {
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1234, values_).ok());
  EXPECT_TRUE(std::filesystem::is_regular_file(file()));
  ExpectLoaded(ReadSavedModel(dir_));
  ExpectLoaded(ReadSavedModel(file()));
  // Writing again replaces the file and leaves no temporary behind.
  values_[0][0] = 0.5f;
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1234, values_).ok());
  ExpectLoaded(ReadSavedModel(dir_));
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), kSavedModelFile);
  }
  EXPECT_EQ(files, 1);
}

TEST_F(SavedModelTest, WriteRejectsValuesThatDoNotMatchTheSpec) {
  std::vector<std::vector<float>> fewer = values_;
  fewer.pop_back();
  EXPECT_EQ(WriteSavedModel(dir_, spec_, 1, fewer).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<float>> shorter = values_;
  shorter[4].pop_back();
  absl::Status s = WriteSavedModel(dir_, spec_, 1, shorter);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("fc1/weights"));
  EXPECT_FALSE(std::filesystem::exists(file()));
}

// The chief checks the saved model's directory at its start and makes it
// only when it writes the model: the check creates nothing, and refuses a
// path the writer could not create.
TEST_F(SavedModelTest, CheckingTheDirectoryCreatesNothing) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(dir_).parent_path().parent_path();  // .../<test>
  fs::remove_all(root);
  EXPECT_TRUE(CheckSavedModelDir(dir_).ok());
  EXPECT_FALSE(fs::exists(root));

  // A file where a directory of the path would go.
  fs::create_directories(root);
  WriteBytes((root / "nested").string(), "a file");
  absl::Status s = CheckSavedModelDir(dir_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr((root / "nested").string()));
  EXPECT_THAT(std::string(s.message()), HasSubstr("not a directory"));
  EXPECT_FALSE(WriteSavedModel(dir_, spec_, 1, values_).ok());

  fs::remove(root / "nested");
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1, values_).ok());
  EXPECT_TRUE(CheckSavedModelDir(dir_).ok());
  // A directory this process may not write in (root may write anywhere).
  if (::geteuid() != 0) {
    fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec);
    s = CheckSavedModelDir(dir_);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    fs::permissions(dir_, fs::perms::owner_all);
  }
}

TEST_F(SavedModelTest, FlippedByteInTheWeightsIsDataLoss) {
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1234, values_).ok());
  std::string bytes = ReadBytes(file());
  // Find fc1/weights' raw bytes in the file and flip one bit in their middle.
  const std::vector<float>& fc1 = values_[4];
  const std::string needle(reinterpret_cast<const char*>(fc1.data()), 64);
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  bytes[at + fc1.size() * 2] ^= 0x10;
  WriteBytes(file(), bytes);
  absl::StatusOr<LoadedModel> loaded = ReadSavedModel(dir_);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("checksum"));
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("fc1/weights"));
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(file()));
}

TEST_F(SavedModelTest, EveryFlippedByteOfASmallModelIsCaughtOrHarmless) {
  // A tiny model so that every byte can be flipped. A flip must be reported
  // as DATA_LOSS or leave the weights as written: only tensors carry
  // checksums, so e.g. a flip in global_step goes unnoticed.
  ModelSpec tiny;
  tiny.mutable_input()->set_channels(1);
  tiny.mutable_input()->set_height(2);
  tiny.mutable_input()->set_width(2);
  tiny.set_num_classes(2);
  LayerSpec* d = tiny.add_layer();
  d->set_name("d");
  d->mutable_dense()->set_units(2);
  const std::vector<std::vector<float>> values = {{1, 2, 3, 4, 5, 6, 7, 8}, {-1, -2}};
  ASSERT_TRUE(WriteSavedModel(dir_, tiny, 5, values).ok());
  const std::string original = ReadBytes(file());
  int caught = 0;
  for (size_t i = 0; i < original.size(); ++i) {
    std::string bytes = original;
    bytes[i] ^= 0x01;
    WriteBytes(file(), bytes);
    absl::StatusOr<LoadedModel> loaded = ReadSavedModel(file());
    if (!loaded.ok()) {
      EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss)
          << "byte " << i << ": " << loaded.status();
      ++caught;
    } else {
      EXPECT_EQ(loaded->values, values) << "byte " << i << " changed the weights undetected";
    }
  }
  // All bytes of the tensors (data, shapes, names, checksums) are covered.
  EXPECT_GT(caught, static_cast<int>(original.size()) / 2);
}

TEST_F(SavedModelTest, TruncatedFileIsDataLoss) {
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1234, values_).ok());
  const std::string bytes = ReadBytes(file());
  WriteBytes(file(), bytes.substr(0, bytes.size() / 2));
  EXPECT_EQ(ReadSavedModel(dir_).status().code(), absl::StatusCode::kDataLoss);
  WriteBytes(file(), "this is not a saved model");
  EXPECT_EQ(ReadSavedModel(dir_).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(SavedModelTest, MissingFileIsAnErrorNamingThePath) {
  absl::StatusOr<LoadedModel> loaded = ReadSavedModel(file());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound) << loaded.status();
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(file()));
  // An existing directory without the model file.
  std::filesystem::create_directories(dir_);
  loaded = ReadSavedModel(dir_);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound) << loaded.status();
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(kSavedModelFile));
}

// A model with batch norm keeps its running statistics in the saved model,
// as any variable. One written before they were kept (the spec's other
// variables only) fails to load with one line naming the first missing one.
TEST_F(SavedModelTest, RunningStatisticsAreSavedAndOlderModelsWithoutThemAreRefused) {
  absl::StatusOr<ModelSpec> resnet = ResolveModelSpec("resnet");
  ASSERT_TRUE(resnet.ok()) << resnet.status();
  spec_ = *resnet;
  values_ = InitialValues(spec_, 3);
  const std::vector<VariableShape> vars = ModelVariables(spec_);
  for (size_t i = 0; i < vars.size(); ++i) {
    if (vars[i].trainable) continue;
    for (float& x : values_[i]) x = 0.25f + static_cast<float>(i);  // trained statistics
  }
  ASSERT_TRUE(WriteSavedModel(dir_, spec_, 1234, values_).ok());
  ExpectLoaded(ReadSavedModel(dir_));

  // The same file without the running statistics.
  SavedModel saved;
  ASSERT_TRUE(saved.ParseFromString(ReadBytes(file())));
  SavedModel old = saved;
  old.clear_variable();
  for (const TensorProto& t : saved.variable()) {
    if (t.name().find("/running_") == std::string::npos) *old.add_variable() = t;
  }
  ASSERT_LT(old.variable_size(), saved.variable_size());
  WriteBytes(file(), old.SerializeAsString());
  absl::StatusOr<LoadedModel> loaded = ReadSavedModel(dir_);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << loaded.status();
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("no variable 'bn1/running_mean'"));
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("running statistics"));
  EXPECT_EQ(std::string(loaded.status().message()).find('\n'), std::string::npos);
}

}  // namespace
}  // namespace psflow::model
