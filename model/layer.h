// Layer kinds. Each kind of LayerSpec is one class (in model/layers.cc) that
// knows everything about it: its parameters with their defaults resolved,
// which earlier outputs it reads, its output shape, its variables, and how it
// runs forward and backward on a kernels backend. Adding a kind means adding
// a LayerSpec field, its class and one row of the table in layers.cc.
//
// The spec side (shapes, variables) needs no backend, so psflow_model_spec
// (which the chief links) compiles this against the kernels interface only
// (kernels/kernels.h); running a layer needs a backend from psflow_kernels.
//
// Layers are immutable after CreateLayer: thread-safe. LayerOps are not.
#ifndef PSFLOW_MODEL_LAYER_H_
#define PSFLOW_MODEL_LAYER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"
#include "model/spec.h"
#include "proto/model.pb.h"

namespace psflow::model {

// Every size a spec names is at most this, so products of sizes fit in int64
// and a typo cannot ask the ps for terabytes.
inline constexpr int64_t kMaxSpecDim = 1 << 16;

// One variable of a layer, named "<layer>/<suffix>".
struct LayerVariable {
  enum class Init {
    kFanIn,  // uniform in (-1/sqrt(fan_in), 1/sqrt(fan_in))
    kOnes,
    kZeros,
  };
  std::string suffix;  // "weights", "bias", "gamma", "beta", "running_mean", "running_var"
  std::vector<int64_t> shape;
  Init init = Init::kFanIn;
  int64_t fan_in = 1;  // inputs of one output unit (kFanIn only)
  // False for running statistics: a training step gives them the batch's
  // statistic instead of a gradient (see ForwardArgs).
  bool trainable = true;
};

// Backend memory a layer reads and writes in one pass over a batch. The
// layer's first and second variables (weights and bias, gamma and beta) are
// w and b; null where the layer has none.
struct ForwardArgs {
  const float* x = nullptr;  // the input activation
  // The further operands (layers with other_inputs()), in their order.
  absl::InlinedVector<const float*, 4> others;
  float* y = nullptr;  // the output activation
  const float* w = nullptr;
  const float* b = nullptr;
  // Layers with running statistics (batch norm). Training normalizes with
  // the batch's statistics and writes them to batch_mean and batch_var
  // (the gradient buffers of the running statistics; null: not wanted);
  // inference normalizes with running_mean and running_var.
  bool training = true;
  const float* running_mean = nullptr;
  const float* running_var = nullptr;
  float* batch_mean = nullptr;
  float* batch_var = nullptr;
  // Embedding layers: the plan of this batch's ids for the layer's table
  // (unique rows: every row of the table, in order), which Forward sets on
  // its op; Backward runs on the plan of the Forward before it.
  const kernels::EmbeddingPlan* plan = nullptr;
};

struct BackwardArgs {
  const float* x = nullptr;  // the forward input
  const float* w = nullptr;
  const float* dy = nullptr;  // the gradient of the output
  // Overwritten with the gradient of the input; null when no one needs it
  // (the input is the model input). Variable gradients are written anyway.
  float* dx = nullptr;
  float* dw = nullptr;
  float* db = nullptr;
  // At least as large as the layer's input, free for the layer's use.
  float* scratch = nullptr;
  // Layers that adds_to_gradients(): the further operands' forward inputs
  // and gradients (null: not needed), and for each operand, the input
  // first, whether its gradient is to be added to what is there (another
  // reader of the same output wrote it) instead of written.
  absl::InlinedVector<const float*, 4> others;
  absl::InlinedVector<float*, 4> dothers;
  absl::InlinedVector<uint8_t, 4> add;
};

// A layer's kernels for one batch size, created once and run many times.
// Calls follow the kernels' contract: Backward after Forward on the same
// input.
class LayerOps {
 public:
  virtual ~LayerOps() = default;
  virtual absl::Status Forward(const ForwardArgs& args) = 0;
  virtual absl::Status Backward(const BackwardArgs& args) = 0;
};

class Layer {
 public:
  virtual ~Layer() = default;

  const std::string& name() const { return name_; }

  // The earlier layers whose outputs are further operands (add.other,
  // concat.others, ...), in order; `other_field` names the spec field that
  // says so, for messages.
  virtual std::vector<std::string> other_inputs() const { return {}; }
  virtual const char* other_field() const { return ""; }
  // False for layers that read no activation (embedding: ids); their
  // LayerSpec.input must be empty, and the model input stands in as their
  // input (its shape is passed, its values unused, no gradient asked).
  virtual bool reads_input() const { return true; }

  // Checks the parameters against the input shape (and the further
  // operands' shapes, one per other_inputs()) and returns the output shape.
  // Errors are INVALID_ARGUMENT without the layer's name (the caller adds
  // it).
  virtual absl::StatusOr<ActivationShape> OutputShape(
      const ActivationShape& in, absl::Span<const ActivationShape> others) const = 0;

  // The layer's variables for an input shape OutputShape accepted: none, or
  // two trainable ones (weights and bias, gamma and beta) of which the
  // second may be absent (a convolution without bias), in this order; then,
  // for a layer with running statistics, the non-trainable running mean and
  // running variance, in this order.
  virtual std::vector<LayerVariable> Variables(const ActivationShape& in) const { return {}; }

  // True when the gradient of each input is the output's gradient unchanged
  // (add): the network routes it to the inputs itself and never calls
  // Backward with a dx.
  virtual bool passes_gradient() const { return false; }
  // True for layers of several operands whose Backward computes every
  // operand's gradient (BackwardArgs: dx and dothers, with the add flags)
  // instead of writing dx alone; their operands must be distinct layers.
  virtual bool adds_to_gradients() const { return false; }

  // The kernels for batches of `batch` examples of input shape `in` (and
  // further operands of shapes `others`);
  // `forward_only`: kernels that only run Forward in inference mode
  // (kernels.h's forward-only ops), whose Backward fails.
  virtual absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(
      kernels::Backend* backend, int batch, const ActivationShape& in,
      absl::Span<const ActivationShape> others, bool forward_only) const = 0;

 protected:
  explicit Layer(std::string name) : name_(std::move(name)) {}

 private:
  std::string name_;
};

// The layer a spec describes, with defaults resolved (conv stride 1, pool
// stride = size, batch-norm epsilon 1e-5). INVALID_ARGUMENT "layer '<name>':
// ..." for a layer without a kind and for parameters that are out of range
// whatever the input (sizes above kMaxSpecDim, non-positive filters, ...).
absl::StatusOr<std::unique_ptr<const Layer>> CreateLayer(const LayerSpec& spec);

// INVALID_ARGUMENT "layer '<name>': <what>".
absl::Status LayerError(const LayerSpec& layer, absl::string_view what);

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_LAYER_H_
