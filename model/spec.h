// Model specifications: the built-in models, loading user specs written in
// protobuf text format, checking a spec and deriving its variables (names,
// shapes, initial values). Knows nothing of kernels, so the chief can use it.
// All functions are thread-safe.
#ifndef PSFLOW_MODEL_SPEC_H_
#define PSFLOW_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/placement.h"
#include "proto/model.pb.h"

namespace psflow::model {

// "cnn" and "mlp" are built in; anything else is read as a path to a spec in
// protobuf text format. The result has passed ValidateModelSpec.
absl::StatusOr<ModelSpec> ResolveModelSpec(const std::string& name_or_path);

// Names of the built-in models.
std::vector<std::string> BuiltinModelNames();

// The shape of one example's activations, [C, H, W] (H = W = 1 after a
// dense layer).
struct ActivationShape {
  int channels = 0, height = 0, width = 0;
  int64_t size() const { return int64_t{channels} * height * width; }
};

// Checks layer names (unique, non-empty), parameters (positive, kernels that
// fit), and that the last layer is a dense layer with num_classes units.
// Returns the activation shape after each layer.
absl::StatusOr<std::vector<ActivationShape>> ValidateModelSpec(const ModelSpec& spec);

// The variables of a valid spec in layer order: "<layer>/weights" (conv:
// [filters, in_channels, k, k]; dense: [units, in_features]) then
// "<layer>/bias" ([filters] or [units]).
std::vector<VariableShape> ModelVariables(const ModelSpec& spec);

// Initial values, deterministic in `seed`: weights and biases uniform in
// (-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in being the inputs of one output unit.
std::vector<std::vector<float>> InitialValues(const ModelSpec& spec, uint64_t seed);

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_SPEC_H_
