// Where a job's examples come from, and whether they fit a model: the one
// place that chooses between the data formats (DataConfig.format) and checks
// the data against the model's input. Reads a model's input from its
// spec (the proto) and needs nothing of model/ or kernels/, so the chief can
// use it. Thread-safe (no shared state).
#ifndef PSFLOW_DATA_SOURCE_H_
#define PSFLOW_DATA_SOURCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/mnist.h"
#include "proto/data.pb.h"
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

// The values of --data_format, for messages.
inline constexpr char kDataFormats[] = "idx, synthetic, tfrecord, image_folder, csv";

// A DataConfig of idx or synthetic data, the formats held whole.
DataConfig InMemoryData(const std::string& format, const std::string& data_dir,
                        int64_t synthetic_examples);

// How messages name the data of a source: "the images in <data_dir>", "the
// synthetic images" or "the tfrecord data".
std::string DescribeSource(const DataConfig& config);

// The split of the data, whole in memory, after CheckFitsModel: the IDX
// files of data_dir, synthetic_examples synthetic examples, or every record
// of a streamed format's split (data/formats.h; decoded on `threads`
// threads). INVALID_ARGUMENT for an unknown format ("data format 'x' is not
// one of ..."), for files that are missing or malformed (naming the file),
// for a synthetic count or shape MakeSynthetic refuses, and for data that
// does not fit the model.
absl::StatusOr<Dataset> LoadDataset(const DataConfig& config, const ModelInput& model, Split split,
                                    int threads = 1);

// OK when examples of shape `data` (from `origin`, e.g. DescribeSource(...))
// fit the model: same channels, height, width and class count. Otherwise
// INVALID_ARGUMENT on one line, e.g. "model resnet takes 3x32x32 inputs with
// 10 classes, but the images in /data are 1x28x28 with 10 classes".
absl::Status CheckFitsModel(const ExampleShape& data, absl::string_view origin,
                            const ModelInput& model);

// The same for a loaded dataset; its origin is named "the data".
absl::Status CheckFitsModel(const Dataset& data, const ModelInput& model);

// The ids a model's embedding layers read (InputSpec.id_feature, in its
// order) picked by name out of the ids the data carries (data/reader.h).
// Immutable once made: thread-safe.
class IdSelection {
 public:
  // INVALID_ARGUMENT on one line for a feature the model reads that the
  // data lacks, or has with another width: "model dlrm reads id feature
  // 'C27' (1 id per example), which <origin> lack (they have C1, ..., C26)".
  static absl::StatusOr<IdSelection> Create(const std::vector<IdFeature>& data,
                                            absl::string_view origin, const ModelSpec& model);
  // The model's ids per example (0: it reads none).
  int64_t model_ids() const { return static_cast<int64_t>(sources_.size()); }
  // `examples` examples' ids, data_ids() of the data's each, into `out`
  // (examples * model_ids()).
  void Select(const uint64_t* data, int64_t examples, uint64_t* out) const;

 private:
  std::vector<int64_t> sources_;  // per model id: its index among the data's
  int64_t data_ids_ = 0;
};

}  // namespace psflow::data

#endif  // PSFLOW_DATA_SOURCE_H_
