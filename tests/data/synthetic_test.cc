#include "data/synthetic.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "data/mnist.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

Dataset Make(const SyntheticShape& shape, int64_t count, Split split) {
  absl::StatusOr<Dataset> d = MakeSynthetic(shape, count, split);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : Dataset();
}

TEST(SyntheticTest, ShapeAndCounts) {
  const SyntheticShape shape{2, 5, 7, 4};
  const Dataset d = Make(shape, 30, Split::kTrain);
  EXPECT_EQ(d.count, 30);
  EXPECT_EQ(d.channels, 2);
  EXPECT_EQ(d.height, 5);
  EXPECT_EQ(d.width, 7);
  EXPECT_EQ(d.num_classes, 4);
  EXPECT_EQ(d.example_floats(), 2 * 5 * 7);
  EXPECT_EQ(d.images.size(), 30u * 2 * 5 * 7);
  EXPECT_EQ(d.labels.size(), 30u);
  // The default is the resnet's input: 3x32x32, 10 classes.
  const SyntheticShape resnet;
  EXPECT_EQ(resnet.channels, 3);
  EXPECT_EQ(resnet.height, 32);
  EXPECT_EQ(resnet.width, 32);
  EXPECT_EQ(resnet.num_classes, 10);
}

TEST(SyntheticTest, Deterministic) {
  const SyntheticShape shape;
  for (Split split : {Split::kTrain, Split::kTest}) {
    const Dataset a = Make(shape, 50, split);
    const Dataset b = Make(shape, 50, split);
    EXPECT_EQ(a.images, b.images);
    EXPECT_EQ(a.labels, b.labels);
    // Example i does not depend on how many are made.
    const Dataset more = Make(shape, 80, split);
    EXPECT_TRUE(std::equal(a.images.begin(), a.images.end(), more.images.begin()));
    EXPECT_TRUE(std::equal(a.labels.begin(), a.labels.end(), more.labels.begin()));
  }
}

TEST(SyntheticTest, TrainAndTestDiffer) {
  const SyntheticShape shape;
  const Dataset train = Make(shape, 100, Split::kTrain);
  const Dataset test = Make(shape, 100, Split::kTest);
  EXPECT_NE(train.images, test.images);
  // No test example equals any training example.
  const int64_t per = train.example_floats();
  for (int64_t i = 0; i < test.count; ++i) {
    for (int64_t j = 0; j < train.count; ++j) {
      ASSERT_FALSE(std::equal(test.images.begin() + i * per, test.images.begin() + (i + 1) * per,
                              train.images.begin() + j * per))
          << "test " << i << " equals train " << j;
    }
  }
  // Examples within a split differ too.
  EXPECT_FALSE(
      std::equal(train.images.begin(), train.images.begin() + per, train.images.begin() + per));
}

TEST(SyntheticTest, LabelsInRangeAndEveryClassPresent) {
  for (const SyntheticShape& shape :
       {SyntheticShape{}, SyntheticShape{1, 4, 4, 7}, SyntheticShape{3, 2, 2, 2}}) {
    for (Split split : {Split::kTrain, Split::kTest}) {
      const Dataset d = Make(shape, 200, split);
      std::vector<int> per_class(shape.num_classes, 0);
      for (int32_t y : d.labels) {
        ASSERT_GE(y, 0);
        ASSERT_LT(y, shape.num_classes);
        ++per_class[y];
      }
      for (int c = 0; c < shape.num_classes; ++c) {
        EXPECT_GT(per_class[c], 0) << "class " << c << " of " << shape.num_classes;
      }
    }
  }
}

TEST(SyntheticTest, PixelsInUnitInterval) {
  const Dataset d = Make(SyntheticShape{}, 100, Split::kTrain);
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  double sum = 0;
  for (float p : d.images) {
    ASSERT_GE(p, 0.0f);
    ASSERT_LE(p, 1.0f);
    lo = std::min(lo, p);
    hi = std::max(hi, p);
    sum += p;
  }
  // Half pattern, half noise, both uniform on [0, 1): spread over the whole
  // interval with mean 1/2.
  EXPECT_LT(lo, 0.05f);
  EXPECT_GT(hi, 0.95f);
  EXPECT_NEAR(sum / static_cast<double>(d.images.size()), 0.5, 0.01);
}

TEST(SyntheticTest, BadArgumentsAreInvalid) {
  const SyntheticShape good;
  auto code = [](const SyntheticShape& s, int64_t count) {
    return MakeSynthetic(s, count, Split::kTrain).status().code();
  };
  EXPECT_EQ(code(good, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(good, -5), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{0, 32, 32, 10}, 10), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{3, -1, 32, 10}, 10), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{3, 32, 0, 10}, 10), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{3, 32, 32, 1}, 10), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{3, 32, 32, 0}, 10), absl::StatusCode::kInvalidArgument);
  // More than 2^31 floats in all: refused before allocating anything.
  EXPECT_EQ(code(good, int64_t{1} << 20), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(SyntheticShape{65536, 65536, 65536, 10}, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(good, std::numeric_limits<int64_t>::max()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(good, 1), absl::StatusCode::kOk);
}

// The classes are learnable: the mean of each class's training examples is
// its pattern blurred by noise, and the nearest class mean labels >90% of
// the test split (chance: 10%).
TEST(SyntheticTest, NearestClassMeanClassifies) {
  const SyntheticShape shape;
  const Dataset train = Make(shape, 1000, Split::kTrain);
  const Dataset test = Make(shape, 500, Split::kTest);
  const int64_t per = train.example_floats();
  std::vector<std::vector<double>> means(shape.num_classes, std::vector<double>(per, 0.0));
  std::vector<int> counts(shape.num_classes, 0);
  for (int64_t e = 0; e < train.count; ++e) {
    const int y = train.labels[e];
    ++counts[y];
    for (int64_t p = 0; p < per; ++p) means[y][p] += train.images[e * per + p];
  }
  for (int c = 0; c < shape.num_classes; ++c) {
    ASSERT_GT(counts[c], 0);
    for (double& m : means[c]) m /= counts[c];
  }
  int correct = 0;
  for (int64_t e = 0; e < test.count; ++e) {
    int best = -1;
    double best_distance = std::numeric_limits<double>::infinity();
    for (int c = 0; c < shape.num_classes; ++c) {
      double distance = 0;
      for (int64_t p = 0; p < per; ++p) {
        const double d = test.images[e * per + p] - means[c][p];
        distance += d * d;
      }
      if (distance < best_distance) {
        best_distance = distance;
        best = c;
      }
    }
    if (best == test.labels[e]) ++correct;
  }
  EXPECT_GT(correct, 450) << correct << " of 500";
}

}  // namespace
}  // namespace psflow::data
