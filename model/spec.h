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

// "cnn", "mlp" and "resnet" (ResNet-18 for 32x32x3 inputs) are built in; anything else is read as a
// path to a spec in protobuf text format. The result has passed ValidateModelSpec.
absl::StatusOr<ModelSpec> ResolveModelSpec(const std::string& name_or_path);

// Names of the built-in models.
std::vector<std::string> BuiltinModelNames();

// The shape of one example's activations, [C, H, W] (H = W = 1 after a
// dense layer).
struct ActivationShape {
  int channels = 0, height = 0, width = 0;
  int64_t size() const { return int64_t{channels} * height * width; }
};

// Checks layer names (unique, non-empty), wiring (inputs name earlier layers,
// every output but the last is read, added shapes agree), parameters
// (positive, kernels that fit), the input's id features and that each
// embedding layer reads one of them, and that the last layer is a dense layer with
// num_classes units. Returns the activation shape after each layer.
absl::StatusOr<std::vector<ActivationShape>> ValidateModelSpec(const ModelSpec& spec);

// Which layer outputs a layer reads: the index of an earlier layer, or -1 for
// the model input. `others` are the further operands (add.other,
// concat.others, interaction.others), in order.
struct LayerWiring {
  int input = -1;
  std::vector<int> others;
};
absl::StatusOr<std::vector<LayerWiring>> ResolveWiring(const ModelSpec& spec);

// The variables of a valid spec in layer order: conv "<layer>/weights"
// [filters, in_channels, k, k] and "<layer>/bias" [filters] (unless no_bias);
// dense "<layer>/weights" [units, in_features] and "<layer>/bias" [units];
// batch_norm "<layer>/gamma", "<layer>/beta", and the non-trainable
// (VariableShape.trainable false) "<layer>/running_mean" and
// "<layer>/running_var", all [channels]; embedding "<layer>/table" [rows,
// dim].
std::vector<VariableShape> ModelVariables(const ModelSpec& spec);

// Per layer, the indices into ModelVariables of its variables: weights and
// bias, or gamma and beta; a batch norm's running mean and variance; -1
// where it has none (everywhere for an invalid spec, whose ModelVariables is
// empty).
struct LayerVariables {
  int first = -1, second = -1;
  int running_mean = -1, running_var = -1;
};
std::vector<LayerVariables> LayerVariableIndices(const ModelSpec& spec);

// Initial values, deterministic in `seed`: weights and biases uniform in
// (-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in being the inputs of one output
// unit (an embedding table's row: fan_in = dim); batch-norm gamma 1 and beta
// 0, running mean 0 and running variance 1.
std::vector<std::vector<float>> InitialValues(const ModelSpec& spec, uint64_t seed);

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_SPEC_H_
