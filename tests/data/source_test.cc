#include "data/source.h"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "data/mnist.h"
#include "data/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/data/idx_files.h"

namespace psflow::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

void ExpectInvalid(const absl::Status& status, const std::string& substring) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(substring));
}

// IDX files of `count` 1x6x5 images (pixel k of image i = (i + k) % 256) and
// labels i % 10, in a fresh directory per test.
class DataSourceTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kCount = 12;

  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::path(::testing::TempDir()) / absl::StrCat("source_test_", info->name())).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* prefix : {"train", "t10k"}) {
      std::vector<uint8_t> pixels(kCount * 6 * 5), labels(kCount);
      for (size_t j = 0; j < pixels.size(); ++j)
        pixels[j] = static_cast<uint8_t>((j / 30 + j % 30) % 256);
      for (uint32_t i = 0; i < kCount; ++i) labels[i] = static_cast<uint8_t>(i % 10);
      idx_testing::WritePlain(Path(absl::StrCat(prefix, "-images-idx3-ubyte")),
                              idx_testing::IdxBytes(0x803, {kCount, 6, 5}, pixels));
      idx_testing::WriteGzip(Path(absl::StrCat(prefix, "-labels-idx1-ubyte.gz")),
                             idx_testing::IdxBytes(0x801, {kCount}, labels));
    }
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  DataConfig Idx() const { return InMemoryData("idx", dir_, 0); }

  std::string dir_;
};

TEST_F(DataSourceTest, IdxLoadsTheSplitOfTheFiles) {
  const ModelInput model{"tiny", {1, 6, 5, 10}};
  for (Split split : {Split::kTrain, Split::kTest}) {
    absl::StatusOr<Dataset> data = LoadDataset(Idx(), model, split);
    ASSERT_TRUE(data.ok()) << data.status();
    absl::StatusOr<Dataset> direct = LoadMnist(dir_, split);
    ASSERT_TRUE(direct.ok()) << direct.status();
    EXPECT_EQ(data->count, kCount);
    EXPECT_EQ(data->images, direct->images);
    EXPECT_EQ(data->labels, direct->labels);
    EXPECT_FLOAT_EQ(data->images[31], 2.0f / 255.0f) << "image 1, pixel 1";
    EXPECT_EQ(data->labels[11], 1);
  }
}

TEST_F(DataSourceTest, IdxOfAnotherShapeDoesNotFit) {
  const absl::StatusOr<Dataset> data =
      LoadDataset(Idx(), {"resnet", {3, 32, 32, 10}}, Split::kTrain);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(data.status().message(),
            absl::StrCat("model resnet takes 3x32x32 inputs with 10 classes, but the "
                         "images in ",
                         dir_, " are 1x6x5 with 10 classes"));
  // Height and width are not interchangeable.
  ExpectInvalid(LoadDataset(Idx(), {"t", {1, 5, 6, 10}}, Split::kTest).status(), "are 1x6x5");
}

TEST_F(DataSourceTest, IdxHasTenClasses) {
  ExpectInvalid(LoadDataset(Idx(), {"five", {1, 6, 5, 5}}, Split::kTrain).status(),
                "model five takes 1x6x5 inputs with 5 classes, but the images in");
  ExpectInvalid(LoadDataset(Idx(), {"five", {1, 6, 5, 5}}, Split::kTrain).status(),
                "with 10 classes");
}

TEST_F(DataSourceTest, IdxErrorsNameTheFile) {
  fs::remove(Path("t10k-images-idx3-ubyte"));
  ExpectInvalid(LoadDataset(Idx(), {"tiny", {1, 6, 5, 10}}, Split::kTest).status(),
                "t10k-images-idx3-ubyte");
  EXPECT_TRUE(LoadDataset(Idx(), {"tiny", {1, 6, 5, 10}}, Split::kTrain).ok());
  ExpectInvalid(
      LoadDataset(InMemoryData("idx", Path("nowhere"), 0), {"tiny", {1, 6, 5, 10}}, Split::kTrain)
          .status(),
      "nowhere");
}

TEST(DataSourceSyntheticTest, MadeInTheModelsShape) {
  const ModelInput model{"five", {2, 3, 4, 5}};
  const DataConfig source = InMemoryData("synthetic", "", 40);
  for (Split split : {Split::kTrain, Split::kTest}) {
    absl::StatusOr<Dataset> data = LoadDataset(source, model, split);
    ASSERT_TRUE(data.ok()) << data.status();
    absl::StatusOr<Dataset> direct = MakeSynthetic({2, 3, 4, 5}, 40, split);
    ASSERT_TRUE(direct.ok()) << direct.status();
    EXPECT_EQ(data->count, 40);
    EXPECT_EQ(data->channels, 2);
    EXPECT_EQ(data->height, 3);
    EXPECT_EQ(data->width, 4);
    EXPECT_EQ(data->num_classes, 5);
    EXPECT_EQ(data->images, direct->images);
    EXPECT_EQ(data->labels, direct->labels);
  }
  // data_dir plays no part.
  absl::StatusOr<Dataset> elsewhere =
      LoadDataset(InMemoryData("synthetic", "/nonexistent", 40), model, Split::kTrain);
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
}

TEST(DataSourceSyntheticTest, RefusesWhatMakeSyntheticRefuses) {
  ExpectInvalid(
      LoadDataset(InMemoryData("synthetic", "", 0), {"m", {1, 4, 4, 10}}, Split::kTrain).status(),
      "positive count");
  ExpectInvalid(
      LoadDataset(InMemoryData("synthetic", "", 10), {"m", {1, 4, 4, 1}}, Split::kTrain).status(),
      "2+ classes");
  ExpectInvalid(LoadDataset(InMemoryData("synthetic", "", int64_t{1} << 40), {"m", {1, 4, 4, 10}},
                            Split::kTrain)
                    .status(),
                "too large");
}

TEST(DataSourceNameTest, UnknownDatasets) {
  const ModelInput model{"m", {1, 4, 4, 10}};
  const absl::StatusOr<Dataset> data =
      LoadDataset(InMemoryData("imagenet", "/x", 10), model, Split::kTrain);
  EXPECT_EQ(data.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(data.status().message(),
            "data format 'imagenet' is not one of idx, synthetic, tfrecord, image_folder, csv");
  ExpectInvalid(LoadDataset(InMemoryData("", "/x", 10), model, Split::kTrain).status(),
                "data format '' is not one of");
  ExpectInvalid(LoadDataset(InMemoryData("IDX", "/x", 10), model, Split::kTrain).status(),
                "data format 'IDX'");
}

TEST(CheckFitsModelTest, ComparesEveryDimensionAndTheClasses) {
  const ModelInput model{"cnn", {1, 28, 28, 10}};
  EXPECT_TRUE(CheckFitsModel({1, 28, 28, 10}, "the images in /d", model).ok());
  const ExampleShape off[] = {{3, 28, 28, 10}, {1, 27, 28, 10}, {1, 28, 29, 10}, {1, 28, 28, 9}};
  for (const ExampleShape& data : off) {
    const absl::Status s = CheckFitsModel(data, "the images in /d", model);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(
        s.message(),
        absl::StrCat("model cnn takes 1x28x28 inputs with 10 classes, but the images in /d are ",
                     data.channels, "x", data.height, "x", data.width, " with ", data.num_classes,
                     " classes"));
  }
}

TEST(CheckFitsModelTest, OfADataset) {
  absl::StatusOr<Dataset> data = MakeSynthetic({3, 8, 8, 4}, 5, Split::kTrain);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(CheckFitsModel(*data, {"m", {3, 8, 8, 4}}).ok());
  const absl::Status s = CheckFitsModel(*data, {"m", {3, 8, 8, 10}});
  EXPECT_EQ(s.message(),
            "model m takes 3x8x8 inputs with 10 classes, but the data are 3x8x8 with 4 classes");
}

TEST(ModelInputOfTest, ReadsTheSpec) {
  ModelSpec spec;
  spec.set_name("resnet");
  spec.mutable_input()->set_channels(3);
  spec.mutable_input()->set_height(32);
  spec.mutable_input()->set_width(30);
  spec.set_num_classes(7);
  const ModelInput model = ModelInputOf(spec);
  EXPECT_EQ(model.model_name, "resnet");
  EXPECT_EQ(model.shape.channels, 3);
  EXPECT_EQ(model.shape.height, 32);
  EXPECT_EQ(model.shape.width, 30);
  EXPECT_EQ(model.shape.num_classes, 7);
}

TEST(DescribeSourceTest, NamesTheDirectoryOrTheSyntheticSet) {
  EXPECT_EQ(DescribeSource(InMemoryData("idx", "/usr/share/datasets/fashion-mnist", 0)),
            "the images in /usr/share/datasets/fashion-mnist");
  EXPECT_EQ(DescribeSource(InMemoryData("synthetic", "/ignored", 100)), "the synthetic images");
}

TEST(IdSelectionTest, PicksTheModelsFeaturesByNameInItsOrder) {
  ModelSpec model;
  model.set_name("rec");
  IdFeatureSpec* bag = model.mutable_input()->add_id_feature();
  bag->set_name("tags");
  bag->set_width(2);
  model.mutable_input()->add_id_feature()->set_name("city");
  const std::vector<IdFeature> data = {{"city", 1}, {"shop", 1}, {"tags", 2}};
  absl::StatusOr<IdSelection> s = IdSelection::Create(data, "the csv data", model);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->model_ids(), 3);
  // Two examples of the data's 4 ids each.
  const std::vector<uint64_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<uint64_t> out(6);
  s->Select(ids.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<uint64_t>{3, 4, 1, 7, 8, 5}));
  // A model reading no ids reads none of any data.
  absl::StatusOr<IdSelection> none = IdSelection::Create({}, "the images", ModelSpec());
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->model_ids(), 0);
  // A feature the data lacks, or has with another width.
  absl::StatusOr<IdSelection> lacking = IdSelection::Create({{"city", 1}}, "the csv data", model);
  EXPECT_EQ(lacking.status().message(),
            "model rec reads id feature 'tags' (2 ids per example), which the csv data lack (they "
            "have city)");
  absl::StatusOr<IdSelection> narrow =
      IdSelection::Create({{"tags", 1}, {"city", 1}}, "the data", model);
  EXPECT_FALSE(narrow.ok());
  absl::StatusOr<IdSelection> images = IdSelection::Create({}, "the images in /d", model);
  EXPECT_THAT(std::string(images.status().message()), HasSubstr("(they carry no ids)"));
}

}  // namespace
}  // namespace psflow::data
