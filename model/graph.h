// A model spec read once: its layers (defaults resolved), which outputs each
// one reads, the activation shapes and the variables with their owners. The
// spec functions of model/spec.h and the Network are all views of it.
// Immutable once built: thread-safe.
#ifndef PSFLOW_MODEL_GRAPH_H_
#define PSFLOW_MODEL_GRAPH_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/placement.h"
#include "model/layer.h"
#include "model/spec.h"
#include "proto/model.pb.h"

namespace psflow::model {

// A variable of the model, in ModelVariables order.
struct GraphVariable {
  VariableShape shape;  // "<layer>/<suffix>"
  LayerVariable::Init init = LayerVariable::Init::kFanIn;
  int64_t fan_in = 1;
  int layer = -1;  // the index of the layer that owns it
};

struct ModelGraph {
  ActivationShape input;  // the model input's shape
  std::vector<std::unique_ptr<const Layer>> layers;
  std::vector<LayerWiring> wiring;         // per layer
  std::vector<ActivationShape> shapes;     // per layer: its output
  std::vector<LayerVariables> layer_vars;  // per layer: indices into variables
  std::vector<GraphVariable> variables;

  // The shape layer i reads as its input.
  const ActivationShape& input_of(int i) const {
    return wiring[i].input < 0 ? input : shapes[wiring[i].input];
  }
};

// Checks a spec as ValidateModelSpec documents; INVALID_ARGUMENT naming the
// fault (and the layer, where one is at fault).
absl::StatusOr<ModelGraph> BuildModelGraph(const ModelSpec& spec);

// The layers of a spec and what each reads: the part of BuildModelGraph that
// ResolveWiring exposes. Checks names, layer parameters that need no input
// shape, and the wiring rules of ResolveWiring.
struct WiredLayers {
  std::vector<std::unique_ptr<const Layer>> layers;
  std::vector<LayerWiring> wiring;
};
absl::StatusOr<WiredLayers> WireLayers(const ModelSpec& spec);

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_GRAPH_H_
