// Checkpoints on the chief's storage. A checkpoint of step N is the directory
// <model_dir>/checkpoints/ckpt-N holding `data` (every tensor's raw bytes,
// back to back) and `manifest.pb` (a CheckpointManifest with a crc32 per
// tensor). Writing goes to a temporary directory — data, then the manifest,
// each fsynced — which is renamed into place; then the `checkpoint` pointer
// file is rewritten to name it, and all but the newest `keep` are removed.
// Tensors are whole variables (not ps slices), so a checkpoint restores onto
// any number of ps. Not thread-safe: one writer per model_dir.
#ifndef PSFLOW_CHIEF_CHECKPOINT_H_
#define PSFLOW_CHIEF_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/checkpoint.pb.h"
#include "proto/job.pb.h"

namespace psflow::chief {

struct CheckpointTensorData {
  std::string name;
  std::string slot;  // "" for the value
  std::vector<int64_t> shape;
  std::vector<float> values;
};

struct Checkpoint {
  // Everything but the tensor entries and data_bytes, which writing fills.
  CheckpointManifest manifest;
  std::vector<CheckpointTensorData> tensors;
};

// An empty checkpoint of step `step` of `job`: the manifest (model,
// optimizer, data position of every worker) and, per variable in placement
// order, a zeroed tensor for its value and one for each of `slots`
// (tensors[i * (1 + slots.size()) + k], k = 0 the value).
Checkpoint EmptyCheckpoint(const JobConfig& job, int64_t step,
                           const std::vector<std::string>& slots);

// An empty checkpoint of step `step` of `job`: the manifest (model,
// optimizer, data position of every worker) and, per variable in placement
// order, a zeroed tensor for its value and one for each of `slots`
// (tensors[i * (1 + slots.size()) + k], k = 0 the value).
Checkpoint EmptyCheckpoint(const JobConfig& job, int64_t step,
                           const std::vector<std::string>& slots);

// <model_dir>/checkpoints
std::string CheckpointsDir(const std::string& model_dir);

// Writes `checkpoint` (its manifest's step names it) and prunes to `keep`.
absl::Status WriteCheckpoint(const std::string& model_dir, const Checkpoint& checkpoint, int keep);

// The newest checkpoint that is whole: manifest parses, data has the size
// the manifest says, every tensor's checksum matches. Each one skipped is
// logged with the reason. NOT_FOUND when there is none.
absl::StatusOr<Checkpoint> ReadNewestCheckpoint(const std::string& model_dir);

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_CHECKPOINT_H_
