#include "data/tfrecord/example.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace psflow::data {
namespace {

Example MakeExample() {
  Example example;
  AddBytes(&example, "image/encoded", std::string(20417, 'j'));
  AddInt64(&example, "label", 7);
  const std::vector<float> box = {0.25f, 0.5f, 0.75f, 1.0f};
  AddFloats(&example, "bbox", box);
  AddBytes(&example, "names", "cat");
  AddBytes(&example, "names", "");
  AddInt64s(&example, "ids", std::vector<int64_t>{1, -2, int64_t{1} << 40});
  return example;
}

TEST(ExampleTest, ReadsWhatTheBuildersWrote) {
  absl::StatusOr<Example> example = ParseExample(MakeExample().SerializeAsString());
  ASSERT_TRUE(example.ok()) << example.status();
  EXPECT_EQ(*OneBytes(*example, "image/encoded"), std::string(20417, 'j'));
  EXPECT_EQ(*OneInt64(*example, "label"), 7);
  absl::StatusOr<absl::Span<const float>> box = Floats(*example, "bbox", 4);
  ASSERT_TRUE(box.ok());
  EXPECT_EQ(std::vector<float>(box->begin(), box->end()),
            (std::vector<float>{0.25f, 0.5f, 0.75f, 1.0f}));
  EXPECT_EQ(Floats(*example, "bbox")->size(), 4u);
  absl::StatusOr<absl::Span<const int64_t>> ids = Int64s(*example, "ids");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(std::vector<int64_t>(ids->begin(), ids->end()),
            (std::vector<int64_t>{1, -2, int64_t{1} << 40}));
}

// The bytes TensorFlow writes for {"a": int64_list [1]}, by hand from the
// field numbers: Example.features (1) > Features.feature (1, a map entry:
// key 1, value 2) > Feature.int64_list (3) > Int64List.value (1, packed).
TEST(ExampleTest, ParsesTensorFlowWireBytes) {
  const std::string wire("\x0a\x0c\x0a\x0a\x0a\x01\x61\x12\x05\x1a\x03\x0a\x01\x01", 14);
  absl::StatusOr<Example> example = ParseExample(wire);
  ASSERT_TRUE(example.ok());
  EXPECT_EQ(*OneInt64(*example, "a"), 1);
  Example built;
  AddInt64(&built, "a", 1);
  EXPECT_EQ(built.SerializeAsString(), wire);
}

TEST(ExampleTest, NotAnExample) {
  absl::StatusOr<Example> example = ParseExample("\xff\xff\xff");
  EXPECT_EQ(example.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(example.status().message(),
            "not a tf.Example: a record of 3 bytes that does not parse as one");
}

TEST(ExampleTest, ErrorsNameTheFeature) {
  const Example example = MakeExample();
  EXPECT_EQ(OneInt64(example, "image/encoded").status().message(),
            "feature 'image/encoded' is a bytes_list, not an int64_list");
  EXPECT_EQ(OneBytes(example, "label").status().message(),
            "feature 'label' is an int64_list, not a bytes_list");
  EXPECT_EQ(Floats(example, "ids").status().message(),
            "feature 'ids' is an int64_list, not a float_list");
  EXPECT_EQ(Int64s(example, "bbox").status().message(),
            "feature 'bbox' is a float_list, not an int64_list");
  EXPECT_EQ(OneBytes(example, "label_text").status().message(),
            "the example has no feature 'label_text'");
  EXPECT_EQ(OneBytes(example, "names").status().message(), "feature 'names' has 2 values, not 1");
  EXPECT_EQ(Floats(example, "bbox", 3).status().message(), "feature 'bbox' has 4 values, not 3");
  EXPECT_EQ(OneInt64(example, "label_text").status().code(), absl::StatusCode::kInvalidArgument);
}

// A feature with no list set reads as an empty list of the type asked for.
TEST(ExampleTest, FeatureWithoutAListIsEmpty) {
  Example example;
  (*example.mutable_features()->mutable_feature())["empty"];
  EXPECT_TRUE(Floats(example, "empty")->empty());
  EXPECT_TRUE(Int64s(example, "empty", 0)->empty());
  EXPECT_EQ(OneInt64(example, "empty").status().message(), "feature 'empty' has 0 values, not 1");
  EXPECT_EQ(DescribeFeatures(example), "empty: no list, 0 values\n");
}

TEST(ExampleTest, DescribeFeatures) {
  Example example = MakeExample();
  AddBytes(&example, "many", "1");
  for (int i = 0; i < 4; ++i) AddBytes(&example, "many", "22");
  EXPECT_EQ(DescribeFeatures(example),
            "bbox: float_list, 4 values\n"
            "ids: int64_list, 3 values\n"
            "image/encoded: bytes_list, 1 value (20417 bytes)\n"
            "label: int64_list, 1 value\n"
            "many: bytes_list, 5 values\n"
            "names: bytes_list, 2 values (3, 0 bytes)\n");
  EXPECT_EQ(DescribeFeatures(Example()), "(no features)\n");
}

// A builder of another type replaces the feature.
TEST(ExampleTest, BuilderOfAnotherTypeReplaces) {
  Example example;
  AddBytes(&example, "x", "text");
  AddInt64(&example, "x", 3);
  AddInt64(&example, "x", 4);
  EXPECT_EQ(Int64s(example, "x", 2)->at(1), 4);
}

}  // namespace
}  // namespace psflow::data
