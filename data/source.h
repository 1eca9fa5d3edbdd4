// Where a job's examples come from, and whether they fit a model: the one
// place that chooses between the IDX files and the synthetic dataset and
// checks the data against the model's input. Reads a model's input from its
// spec (the proto) and needs nothing of model/ or kernels/, so the chief can
// use it. Thread-safe (no shared state).
#ifndef PSFLOW_DATA_SOURCE_H_
#define PSFLOW_DATA_SOURCE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/mnist.h"
#include "proto/model.pb.h"

namespace psflow::data {

// What a model takes, as a ModelSpec says it: its name (for messages), its
// input's shape and its class count.
struct ModelInput {
  std::string model_name;
  ExampleShape shape;
};

// The input of the model `spec` describes: its name, input channels, height
// and width, and num_classes.
ModelInput ModelInputOf(const ModelSpec& spec);

struct DataSource {
  // "idx": the MNIST-format IDX files in data_dir (10 classes); "synthetic":
  // synthetic_examples examples made in memory in the model's input shape
  // (see data/synthetic.h).
  std::string dataset = "idx";
  std::string data_dir;
  int64_t synthetic_examples = 0;
};

// How messages name the data of a source: "the images in <data_dir>" or "the
// synthetic images".
std::string DescribeSource(const DataSource& source);

// The split of the source's data, after CheckFitsModel. INVALID_ARGUMENT for
// an unknown dataset ("dataset 'x' is not one of idx, synthetic"), for files
// that are missing or malformed (naming the file), for a synthetic count or
// shape MakeSynthetic refuses, and for data that does not fit the model.
absl::StatusOr<Dataset> LoadDataset(const DataSource& source, const ModelInput& model, Split split);

// OK when examples of shape `data` (from `origin`, e.g. DescribeSource(...))
// fit the model: same channels, height, width and class count. Otherwise
// INVALID_ARGUMENT on one line, e.g. "model resnet takes 3x32x32 inputs with
// 10 classes, but the images in /data are 1x28x28 with 10 classes".
absl::Status CheckFitsModel(const ExampleShape& data, absl::string_view origin,
                            const ModelInput& model);

// The same for a loaded dataset; its origin is named "the data".
absl::Status CheckFitsModel(const Dataset& data, const ModelInput& model);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_SOURCE_H_
