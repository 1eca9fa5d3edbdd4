// Synthetic labelled images of any shape and count, for benchmarks and for
// models whose inputs no installed dataset has (the 32x32x3 resnet).
//
// Each class has a fixed random pattern; an example is its class's pattern
// blended with noise of its own, so a model can learn the classes and the
// accuracy of a run still means something. The data is a pure function of
// (shape, classes, split, index): every process of a job makes the same
// examples without any file, and the test split is disjoint from training.
#ifndef PSFLOW_DATA_SYNTHETIC_H_
#define PSFLOW_DATA_SYNTHETIC_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "data/mnist.h"

namespace psflow::data {

// An ExampleShape whose default is the resnet's input: 3x32x32, 10 classes.
struct SyntheticShape : ExampleShape {
  SyntheticShape() : ExampleShape{3, 32, 32, 10} {}
  SyntheticShape(int channels, int height, int width, int num_classes)
      : ExampleShape{channels, height, width, num_classes} {}
  SyntheticShape(const ExampleShape& shape) : ExampleShape(shape) {}  // NOLINT: implicit on purpose
};

// INVALID_ARGUMENT for a non-positive size or count, fewer than 2 classes,
// or data of more than 2^31 floats in all.
absl::Status CheckSynthetic(const SyntheticShape& shape, int64_t count);

// `count` examples of the split, pixels in [0, 1]; the first k examples of a
// split are the same whatever the count. Fails as CheckSynthetic.
absl::StatusOr<Dataset> MakeSynthetic(const SyntheticShape& shape, int64_t count, Split split);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_SYNTHETIC_H_
