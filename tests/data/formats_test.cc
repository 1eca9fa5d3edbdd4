// The streamed formats of data/formats.h on files the tests write: TFRecord
// images decode to what DecodeImage and the transforms say, augmentation is
// a function of the seed, and every kind of bad record or bad layout is one
// line naming what is wrong; the chief's resolution recognizes each format.
#include "data/formats.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/status_macros.h"
#include "data/csv/csv.h"
#include "data/image/image.h"
#include "data/image/transforms.h"
#include "data/pipeline.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// An RGB image whose pixels vary in every direction.
Image Pattern(int height, int width, int channels) {
  Image im;
  im.height = height;
  im.width = width;
  im.channels = channels;
  im.pixels.resize(static_cast<size_t>(height) * width * channels);
  for (size_t i = 0; i < im.pixels.size(); ++i) im.pixels[i] = static_cast<uint8_t>(i * 37 % 251);
  return im;
}

std::string Record(const std::string& image, int64_t label) {
  Example e;
  AddBytes(&e, "image/encoded", image);
  AddInt64(&e, "image/class/label", label);
  return e.SerializeAsString();
}

class FormatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("formats_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
             "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    jpeg_ = EncodeJpeg(Pattern(30, 40, 3), 90).value();
    png_ = EncodePng(Pattern(20, 20, 1)).value();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A TFRecord file of `records`, listed in a tfrecord DataConfig.
  DataConfig Shard(const std::vector<std::string>& records) {
    const std::string path = dir_ + "/train-00000-of-00001";
    auto w = RecordWriter::Open(path).value();
    for (const std::string& r : records) EXPECT_TRUE(w->Write(r).ok());
    EXPECT_TRUE(w->Close().ok());
    DataConfig c = DefaultDataConfig();
    c.set_format("tfrecord");
    DataFile* f = c.add_train();
    f->set_path(path);
    f->set_records(static_cast<int64_t>(records.size()));
    return c;
  }

  // The error of decoding the only record of a shard.
  absl::Status DecodeError(const DataConfig& c, const ExampleShape& shape) {
    auto format = OpenDataFormat(c, shape, Split::kTrain);
    if (!format.ok()) return format.status();
    return ReadExamples(**format, shape, -1, 1).status();
  }

  std::string dir_, jpeg_, png_;
};

TEST_F(FormatsTest, TfRecordImagesDecodeAsTheCodecAndTransformsSay) {
  const ExampleShape shape{3, 16, 16, 5};
  DataConfig c = Shard({Record(jpeg_, 3), Record(png_, 0)});
  auto format = OpenDataFormat(c, shape, Split::kTrain);
  ASSERT_TRUE(format.ok()) << format.status();
  absl::StatusOr<Dataset> d = ReadExamples(**format, shape, -1, 2);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->count, 2);
  EXPECT_EQ(d->labels, (std::vector<int32_t>{3, 0}));
  int k = 0;
  for (const std::string* bytes : {&jpeg_, &png_}) {
    const Image whole = DecodeImage(*bytes, 3).value();  // gray PNG as RGB
    const CropWindow w = CenterCrop({whole.height, whole.width}, 16, 16, 16);
    std::vector<float> want(3 * 16 * 16);
    ASSERT_TRUE(ResizeInto(whole, w, 16, 16, false, want.data()).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(d->images[k * want.size() + i], want[i], 1e-6) << "example " << k << " at " << i;
    }
    ++k;
  }
}

TEST_F(FormatsTest, AugmentationIsAFunctionOfTheSeed) {
  const ExampleShape shape{3, 16, 16, 5};
  DataConfig c = Shard({Record(jpeg_, 1)});
  c.set_augment(true);
  auto format = OpenDataFormat(c, shape, Split::kTrain);
  ASSERT_TRUE(format.ok()) << format.status();
  auto stream = (*format)->Open(0).value();
  data::Record r;
  ASSERT_TRUE(stream->Next(&r).value());
  auto decode = [&](uint64_t seed, bool train) {
    std::vector<float> x(3 * 16 * 16);
    int32_t label = -1;
    EXPECT_TRUE((*format)->decoder().Decode(r, seed, train, x.data(), nullptr, &label).ok());
    EXPECT_EQ(label, 1);
    return x;
  };
  EXPECT_EQ(decode(7, true), decode(7, true));
  EXPECT_NE(decode(7, true), decode(8, true));
  // Evaluation never augments.
  EXPECT_EQ(decode(7, false), decode(8, false));
}

TEST_F(FormatsTest, BadRecordsAreOneLineNamingWhatIsWrong) {
  const ExampleShape shape{1, 8, 8, 5};
  Example no_image;
  AddInt64(&no_image, "image/class/label", 1);
  EXPECT_THAT(std::string(DecodeError(Shard({no_image.SerializeAsString()}), shape).message()),
              HasSubstr("record 0: the example has no feature 'image/encoded'"));
  Example bytes_label;
  AddBytes(&bytes_label, "image/encoded", png_);
  AddBytes(&bytes_label, "image/class/label", "3");
  EXPECT_THAT(std::string(DecodeError(Shard({bytes_label.SerializeAsString()}), shape).message()),
              HasSubstr("feature 'image/class/label' is a bytes_list, not an int64_list"));
  EXPECT_THAT(std::string(DecodeError(Shard({Record(png_, 5)}), shape).message()),
              HasSubstr("label 5 is outside [0, 5) (a set whose 0 is 'background' needs "
                        "--label_offset=1)"));
  EXPECT_THAT(std::string(DecodeError(Shard({Record("not an image", 1)}), shape).message()),
              HasSubstr("train-00000-of-00001, record 0: "));
  EXPECT_THAT(std::string(DecodeError(Shard({"garbage"}), shape).message()),
              HasSubstr("not a tf.Example"));
  // Labels 1..5 with the offset of sets that keep 0 for "background".
  DataConfig offset = Shard({Record(png_, 5), Record(png_, 1)});
  offset.set_label_offset(1);
  auto format = OpenDataFormat(offset, shape, Split::kTrain);
  ASSERT_TRUE(format.ok());
  absl::StatusOr<Dataset> d = ReadExamples(**format, shape, -1, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->labels, (std::vector<int32_t>{4, 0}));
}

TEST_F(FormatsTest, CsvColumnsMustMakeTheModelsInput) {
  std::ofstream(dir_ + "/train.csv") << "label,a,b,c\n1,0.5,0.25,1\n0,1,2,3\n";
  DataConfig c = DefaultDataConfig();
  c.set_format("csv");
  c.set_csv_columns("label:label,*:numeric");
  c.set_data_dir(dir_);
  ASSERT_TRUE(ResolveDataFiles({}, &c).ok());
  ASSERT_EQ(c.train_size(), 1);
  EXPECT_EQ(c.train(0).records(), 2);
  auto wrong = OpenDataFormat(c, {1, 1, 4, 2}, Split::kTrain);
  ASSERT_FALSE(wrong.ok());
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("train.csv has 3 numeric columns, but the model takes 4 inputs (1x1x4)"));
  auto format = OpenDataFormat(c, {1, 1, 3, 2}, Split::kTrain);
  ASSERT_TRUE(format.ok()) << format.status();
  absl::StatusOr<Dataset> d = ReadExamples(**format, {1, 1, 3, 2}, -1, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->images, (std::vector<float>{0.5f, 0.25f, 1, 1, 2, 3}));
  EXPECT_EQ(d->labels, (std::vector<int32_t>{1, 0}));
  EXPECT_TRUE((*format)->id_features().empty());
  EXPECT_EQ(d->example_ids(), 0);
}

TEST_F(FormatsTest, CsvCategoricalColumnsBecomeTheExamplesIds) {
  // Columns out of order, an empty categorical field, a hex id.
  std::ofstream(dir_ + "/train.csv") << "city,label,price,shop,n\n"
                                        "paris,1,2.5,ff,3\n"
                                        ",0,1,1a,4\n";
  DataConfig c = DefaultDataConfig();
  c.set_format("csv");
  c.set_csv_columns("label:label,city:categorical,shop:hex,*:numeric");
  c.set_data_dir(dir_);
  ASSERT_TRUE(ResolveDataFiles({}, &c).ok());
  auto format = OpenDataFormat(c, {1, 1, 2, 2}, Split::kTrain);
  ASSERT_TRUE(format.ok()) << format.status();
  ASSERT_EQ((*format)->id_features().size(), 2u);
  EXPECT_EQ((*format)->id_features()[0].name, "city");
  EXPECT_EQ((*format)->id_features()[1].name, "shop");
  EXPECT_EQ((*format)->example_ids(), 2);
  absl::StatusOr<Dataset> d = ReadExamples(**format, {1, 1, 2, 2}, -1, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->example_ids(), 2);
  EXPECT_EQ(d->ids, (std::vector<uint64_t>{HashId("paris"), 0xff, kMissingId, 0x1a}));
  EXPECT_EQ(d->images, (std::vector<float>{2.5f, 3, 1, 4}));
  // The pipeline hands the same ids out with their batch.
  PipelineOptions o;
  o.batch = 2;
  o.train = false;
  auto pipeline = Pipeline::Create(format->get(), o);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  auto batch = (*pipeline)->Get(0, 0);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ((*batch)->ids, d->ids);
  EXPECT_EQ((*batch)->labels, (std::vector<int32_t>{1, 0}));
}

// The training files a.csv and b.csv holding `a` and `b`, opened as one
// data set of a label, a numeric column x and categorical columns.
absl::StatusOr<std::unique_ptr<DataFormat>> OpenTwoCsvFiles(const std::string& dir,
                                                            const std::string& a,
                                                            const std::string& b) {
  std::ofstream(dir + "/a.csv") << a;
  std::ofstream(dir + "/b.csv") << b;
  DataConfig c = DefaultDataConfig();
  c.set_format("csv");
  c.set_csv_columns("label:label,x:numeric,*:categorical");
  PSFLOW_RETURN_IF_ERROR(ResolveDataFiles({dir + "/a.csv," + dir + "/b.csv", ""}, &c));
  return OpenDataFormat(c, {1, 1, 1, 2}, Split::kTrain);
}

TEST_F(FormatsTest, CsvFilesWithColumnsInAnotherOrderAreRefused) {
  // The same columns, two of them swapped: of equal record size, but read
  // under each other's names.
  auto format = OpenTwoCsvFiles(dir_, "label,x,c,d\n1,2,u,v\n", "label,x,d,c\n0,5,v,u\n");
  ASSERT_TRUE(format.ok()) << format.status();
  EXPECT_TRUE((*format)->Open(0).ok());
  auto second = (*format)->Open(1);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("b.csv has the columns label:label,x:numeric,d:categorical,c:categorical, "
                        "but " +
                        dir_ + "/a.csv has label:label,x:numeric,c:categorical,d:categorical"));
}

TEST_F(FormatsTest, CsvFilesWithOtherColumnsThanTheFirstAreRefused) {
  auto format = OpenTwoCsvFiles(dir_, "label,x,c\n1,2,u\n", "label,x\n0,5\n");
  ASSERT_TRUE(format.ok()) << format.status();
  absl::StatusOr<Dataset> d = ReadExamples(**format, {1, 1, 1, 2}, -1, 1);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("b.csv has the columns label:label,x:numeric, but " + dir_ +
                        "/a.csv has label:label,x:numeric,c:categorical"));
}

TEST_F(FormatsTest, ResolutionRecognizesEachFormatAndCountsItsRecords) {
  auto resolved = [&](const std::string& data_dir, const DataFiles& files) {
    DataConfig c = DefaultDataConfig();
    c.set_data_dir(data_dir);
    c.set_csv_columns("label:label,*:numeric");
    absl::Status s = ResolveDataFiles(files, &c);
    EXPECT_TRUE(s.ok()) << s;
    return c;
  };
  // An image folder: classes by sorted name; val/ for evaluation.
  for (const char* cls : {"b", "a"}) {
    fs::create_directories(fs::path(dir_) / "images/train" / cls);
    fs::create_directories(fs::path(dir_) / "images/val" / cls);
    std::ofstream(fs::path(dir_) / "images/train" / cls / "1.png", std::ios::binary) << png_;
  }
  const DataConfig folder = resolved(dir_ + "/images", {});
  EXPECT_EQ(folder.format(), "image_folder");
  EXPECT_THAT(folder.classes(), ::testing::ElementsAre("a", "b"));
  EXPECT_EQ(folder.train(0).records(), 2);
  EXPECT_EQ(folder.eval(0), dir_ + "/images/val");
  auto wrong_classes = OpenDataFormat(folder, {1, 8, 8, 5}, Split::kTrain);
  EXPECT_THAT(std::string(wrong_classes.status().message()),
              HasSubstr("holds 2 class folders, but the model has 5 classes"));
  // TFRecord shards by their content.
  Shard({Record(png_, 1), Record(png_, 2), Record(png_, 3)});
  const DataConfig tfrecord = resolved(dir_, {});
  EXPECT_EQ(tfrecord.format(), "tfrecord");
  EXPECT_EQ(tfrecord.train(0).records(), 3);
  EXPECT_THAT(DescribeData(tfrecord), HasSubstr("tfrecord, 1 file ("));
  // --train_files patterns that match nothing.
  DataConfig none = DefaultDataConfig();
  none.set_format("tfrecord");
  absl::Status s = ResolveDataFiles({dir_ + "/nothing-*", ""}, &none);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("--train_files: '" + dir_ + "/nothing-*' matches no file"));
}

}  // namespace
}  // namespace psflow::data
