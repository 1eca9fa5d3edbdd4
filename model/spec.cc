#include "model/spec.h"

#include <cmath>
#include <random>

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/tensor_view.h"
#include "model/graph.h"

namespace psflow::model {
namespace {

// conv 20@5x5, ReLU, max-pool 2, conv 50@5x5, ReLU, max-pool 2, dense 500,
// ReLU, dense 10.
constexpr char kCnn[] = R"spec(
  name: "cnn"
  input { channels: 1 height: 28 width: 28 }
  num_classes: 10
  layer { name: "conv1" conv2d { filters: 20 kernel: 5 } }
  layer { name: "relu1" relu {} }
  layer { name: "pool1" max_pool { size: 2 } }
  layer { name: "conv2" conv2d { filters: 50 kernel: 5 } }
  layer { name: "relu2" relu {} }
  layer { name: "pool2" max_pool { size: 2 } }
  layer { name: "fc1" dense { units: 500 } }
  layer { name: "relu3" relu {} }
  layer { name: "fc2" dense { units: 10 } }
)spec";

constexpr char kMlp[] = R"spec(
  name: "mlp"
  input { channels: 1 height: 28 width: 28 }
  num_classes: 10
  layer { name: "fc1" dense { units: 256 } }
  layer { name: "relu1" relu {} }
  layer { name: "fc2" dense { units: 256 } }
  layer { name: "relu2" relu {} }
  layer { name: "fc3" dense { units: 10 } }
)spec";

absl::StatusOr<ModelSpec> ParseText(const std::string& text, const std::string& source) {
  ModelSpec spec;
  google::protobuf::TextFormat::Parser parser;
  struct Collector : google::protobuf::io::ErrorCollector {
    std::string first;
    void AddError(int line, int column, const std::string& message) override {
      if (first.empty()) first = absl::StrCat("line ", line + 1, ":", column + 1, ": ", message);
    }
  } errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &spec)) {
    return absl::InvalidArgumentError(absl::StrCat("model spec ", source, ": ", errors.first));
  }
  return spec;
}

// A ResNet-18 for 32x32 inputs: a 3x3 stem (no max-pool), four stages of two
// basic blocks (64, 128, 256, 512 filters; stages 2-4 halve the resolution in
// their first block, whose shortcut is a strided 1x1 convolution with batch
// norm), global average pooling and a dense classifier. Convolutions followed
// by batch norm have no bias.
ModelSpec ResnetSpec() {
  ModelSpec spec;
  spec.set_name("resnet");
  spec.mutable_input()->set_channels(3);
  spec.mutable_input()->set_height(32);
  spec.mutable_input()->set_width(32);
  spec.set_num_classes(10);
  auto conv = [&](const std::string& name, int filters, int kernel, int stride,
                  const std::string& input) {
    LayerSpec* l = spec.add_layer();
    l->set_name(name);
    if (!input.empty()) l->set_input(input);
    Conv2DLayer* c = l->mutable_conv2d();
    c->set_filters(filters);
    c->set_kernel(kernel);
    c->set_stride(stride);
    c->set_padding(kernel / 2);
    c->set_no_bias(true);
  };
  auto simple = [&](const std::string& name) {
    LayerSpec* l = spec.add_layer();
    l->set_name(name);
    return l;
  };
  conv("conv1", 64, 3, 1, "");
  simple("bn1")->mutable_batch_norm();
  simple("relu1")->mutable_relu();
  std::string block_in = "relu1";
  int channels = 64;
  for (int stage = 1; stage <= 4; ++stage) {
    const int filters = 64 << (stage - 1);
    for (int block = 1; block <= 2; ++block) {
      const std::string p = absl::StrCat("s", stage, "b", block, "_");
      const int stride = (block == 1 && stage > 1) ? 2 : 1;
      conv(p + "conv1", filters, 3, stride, "");
      simple(p + "bn1")->mutable_batch_norm();
      simple(p + "relu1")->mutable_relu();
      conv(p + "conv2", filters, 3, 1, "");
      simple(p + "bn2")->mutable_batch_norm();
      std::string shortcut = block_in;
      if (stride != 1 || channels != filters) {
        conv(p + "proj", filters, 1, stride, block_in);
        simple(p + "proj_bn")->mutable_batch_norm();
        shortcut = p + "proj_bn";
        // The sum reads the main path (bn2) as its input and the shortcut.
        LayerSpec* add = simple(p + "add");
        add->set_input(p + "bn2");
        add->mutable_add()->set_other(shortcut);
      } else {
        simple(p + "add")->mutable_add()->set_other(shortcut);
      }
      simple(p + "relu2")->mutable_relu();
      block_in = p + "relu2";
      channels = filters;
    }
  }
  simple("pool")->mutable_global_avg_pool();
  simple("fc")->mutable_dense()->set_units(10);
  return spec;
}

}  // namespace

std::vector<std::string> BuiltinModelNames() { return {"cnn", "mlp", "resnet"}; }

absl::StatusOr<ModelSpec> ResolveModelSpec(const std::string& name_or_path) {
  absl::StatusOr<ModelSpec> spec;
  if (name_or_path == "cnn") {
    spec = ParseText(kCnn, "cnn");
  } else if (name_or_path == "mlp") {
    spec = ParseText(kMlp, "mlp");
  } else if (name_or_path == "resnet") {
    spec = ResnetSpec();
  } else {
    absl::StatusOr<std::string> text = ReadFile(name_or_path);
    if (!text.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", name_or_path,
          "' is neither a built-in model (cnn, mlp, resnet) nor a readable spec file"));
    }
    spec = ParseText(*text, name_or_path);
  }
  if (!spec.ok()) return spec.status();
  if (spec->name().empty()) spec->set_name(name_or_path);
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(*spec);
  if (!shapes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model spec ", name_or_path, ": ", shapes.status().message()));
  }
  return spec;
}

absl::StatusOr<std::vector<LayerWiring>> ResolveWiring(const ModelSpec& spec) {
  absl::StatusOr<WiredLayers> wired = WireLayers(spec);
  if (!wired.ok()) return wired.status();
  return std::move(wired->wiring);
}

absl::StatusOr<std::vector<ActivationShape>> ValidateModelSpec(const ModelSpec& spec) {
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec);
  if (!graph.ok()) return graph.status();
  return std::move(graph->shapes);
}

namespace {

// The variables of a valid spec; empty for an invalid one.
std::vector<GraphVariable> Variables(const ModelSpec& spec) {
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec);
  if (!graph.ok()) return {};
  return std::move(graph->variables);
}

}  // namespace

std::vector<LayerVariables> LayerVariableIndices(const ModelSpec& spec) {
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec);
  if (!graph.ok()) return std::vector<LayerVariables>(static_cast<size_t>(spec.layer_size()));
  return std::move(graph->layer_vars);
}

std::vector<VariableShape> ModelVariables(const ModelSpec& spec) {
  std::vector<VariableShape> out;
  for (GraphVariable& v : Variables(spec)) out.push_back(std::move(v.shape));
  return out;
}

std::vector<std::vector<float>> InitialValues(const ModelSpec& spec, uint64_t seed) {
  std::vector<std::vector<float>> values;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x5851F42D4C957F2Dull);
  for (const GraphVariable& var : Variables(spec)) {
    std::vector<float> v(NumElements(var.shape.shape));
    switch (var.init) {
      case LayerVariable::Init::kOnes:
        std::fill(v.begin(), v.end(), 1.0f);
        break;
      case LayerVariable::Init::kZeros:
        break;
      case LayerVariable::Init::kFanIn: {
        const double bound = 1.0 / std::sqrt(static_cast<double>(var.fan_in));
        for (float& x : v) {
          // 53 random bits to a double in [0, 1): identical on every platform.
          double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
          x = static_cast<float>((2.0 * u - 1.0) * bound);
        }
        break;
      }
    }
    values.push_back(std::move(v));
  }
  return values;
}

}  // namespace psflow::model
