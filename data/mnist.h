// Reading MNIST-format IDX files and splitting each epoch over workers.
//
// LoadMnist reads <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte, gzipped
// (".gz" appended) or not, and returns images as fp32 NCHW scaled to [0, 1].
// Files that are missing, truncated, of the wrong magic number or whose image
// and label counts disagree are an error naming the file. Thread-safe (no
// shared state).
#ifndef PSFLOW_DATA_MNIST_H_
#define PSFLOW_DATA_MNIST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "data/reader.h"

namespace psflow::data {

enum class Split { kTrain, kTest };

// One example's shape: an image [channels, height, width] and a label in
// [0, num_classes).
struct ExampleShape {
  int channels = 0, height = 0, width = 0;
  int num_classes = 0;
};

struct Dataset {
  int64_t count = 0;
  int channels = 1, height = 0, width = 0;
  std::vector<float> images;    // count * channels * height * width, in [0, 1]
  std::vector<int32_t> labels;  // count, each in [0, num_classes)
  int num_classes = 10;
  // Categorical ids (data/reader.h), example_ids() per example, of the
  // features `id_features` in order; none for images.
  std::vector<uint64_t> ids;  // count * example_ids()
  std::vector<IdFeature> id_features;
  int64_t example_ids() const { return IdsPerExample(id_features); }
  int64_t example_floats() const { return int64_t{channels} * height * width; }
  ExampleShape shape() const { return {channels, height, width, num_classes}; }
};

absl::StatusOr<Dataset> LoadMnist(const std::string& dir, Split split);

// Reads one IDX file (gzipped or not: detected from the content, not the
// name). Exposed for tests.
struct IdxFile {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;
};
absl::StatusOr<IdxFile> ReadIdxFile(const std::string& path);
// Reads <dir>/<name>, or <dir>/<name>.gz when only that exists.
absl::StatusOr<IdxFile> ReadIdxFileInDir(const std::string& dir, const std::string& name);

// DistributedSampler-style sharding: each epoch is a permutation of
// [0, count) drawn from (seed, epoch); the permutation is padded by wrapping
// around to a multiple of num_workers, and worker w takes positions
// w, w + num_workers, ... so the shards of one epoch are disjoint (up to the
// padding) and cover every example. Deterministic across processes.
class ShardSampler {
 public:
  ShardSampler(int64_t count, int num_workers, int worker_index, uint64_t seed);
  // Examples this worker sees per epoch: ceil(count / num_workers).
  int64_t shard_size() const;
  // The indices of this worker's shard for `epoch`, in visiting order.
  std::vector<int64_t> EpochIndices(int64_t epoch) const;

 private:
  int64_t count_;
  int num_workers_;
  int worker_index_;
  uint64_t seed_;
};

// Copies the examples at `indices` into images (indices.size() * example
// floats), ids (indices.size() * example_ids; may be null where there are
// none) and labels. An index out of range is INVALID_ARGUMENT.
absl::Status GatherBatch(const Dataset& dataset, absl::Span<const int64_t> indices, float* images,
                         uint64_t* ids, int32_t* labels);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_MNIST_H_
