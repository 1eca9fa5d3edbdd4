// The saved model: one self-describing file (a serialized SavedModel proto:
// the model spec, the global step and every variable as raw bytes with a crc32
// each) inside the saved-model directory. Written atomically; reading checks
// every checksum and every variable's shape against the spec.
#ifndef PSFLOW_MODEL_SAVED_MODEL_H_
#define PSFLOW_MODEL_SAVED_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/model.pb.h"

namespace psflow::model {

// The file's name inside a saved-model directory.
inline constexpr char kSavedModelFile[] = "model.pb";

struct LoadedModel {
  ModelSpec spec;
  int64_t global_step = 0;
  std::vector<std::vector<float>> values;  // in ModelVariables(spec) order
};

// Writes <dir>/model.pb, creating `dir`. `values` follow ModelVariables(spec).
absl::Status WriteSavedModel(const std::string& dir, const ModelSpec& spec, int64_t global_step,
                             const std::vector<std::vector<float>>& values);

// Whether WriteSavedModel may write to `dir`, found without creating
// anything (a job that fails leaves no empty directory behind): the nearest
// directory of its path that exists (`dir` itself, or where it would be
// created) must be a directory this process may write in.
// FAILED_PRECONDITION naming the path otherwise.
absl::Status CheckSavedModelDir(const std::string& dir);

// `path` is a saved-model directory or the model file itself. A missing file,
// a corrupt one (parse or checksum failure) or one whose variables do not
// match its spec is an error naming the path (and the first variable of the
// spec it lacks: batch norm's running statistics, for a saved model written
// before they were kept).
absl::StatusOr<LoadedModel> ReadSavedModel(const std::string& path);

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_SAVED_MODEL_H_
