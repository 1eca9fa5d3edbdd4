#include "model/spec.h"

#include <cmath>
#include <random>

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/tensor_chunks.h"

namespace psflow::model {
namespace {

// conv 20@5x5, ReLU, max-pool 2, conv 50@5x5, ReLU, max-pool 2, dense 500,
// ReLU, dense 10.
constexpr char kCnn[] = R"pb(
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
)pb";

constexpr char kMlp[] = R"pb(
  name: "mlp"
  input { channels: 1 height: 28 width: 28 }
  num_classes: 10
  layer { name: "fc1" dense { units: 256 } }
  layer { name: "relu1" relu {} }
  layer { name: "fc2" dense { units: 256 } }
  layer { name: "relu2" relu {} }
  layer { name: "fc3" dense { units: 10 } }
)pb";

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

constexpr int64_t kMaxDim = 1 << 16;
constexpr int64_t kMaxParameters = int64_t{1} << 30;

absl::Status LayerError(const LayerSpec& layer, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("layer '", layer.name(), "': ", what));
}

}  // namespace

std::vector<std::string> BuiltinModelNames() { return {"cnn", "mlp"}; }

absl::StatusOr<ModelSpec> ResolveModelSpec(const std::string& name_or_path) {
  absl::StatusOr<ModelSpec> spec;
  if (name_or_path == "cnn") {
    spec = ParseText(kCnn, "cnn");
  } else if (name_or_path == "mlp") {
    spec = ParseText(kMlp, "mlp");
  } else {
    absl::StatusOr<std::string> text = ReadFile(name_or_path);
    if (!text.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", name_or_path, "' is neither a built-in model (cnn, mlp) nor a readable spec file"));
    }
    spec = ParseText(*text, name_or_path);
  }
  if (!spec.ok()) return spec.status();
  if (spec->name().empty()) spec->set_name(name_or_path);
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(*spec);
  if (!shapes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model spec ", name_or_path, ": ", shapes.status().message()));
  }
  return spec;
}

absl::StatusOr<std::vector<ActivationShape>> ValidateModelSpec(const ModelSpec& spec) {
  const InputSpec& in = spec.input();
  if (in.channels() <= 0 || in.height() <= 0 || in.width() <= 0) {
    return absl::InvalidArgumentError("input needs positive channels, height and width");
  }
  // Every size a spec names stays within kMaxDim, so products below fit in
  // int64 and a typo cannot ask the ps for terabytes.
  auto too_big = [](int64_t v) { return v > kMaxDim; };
  if (too_big(in.channels()) || too_big(in.height()) || too_big(in.width()) || too_big(spec.num_classes())) {
    return absl::InvalidArgumentError(absl::StrCat("input sizes and num_classes must be at most ", kMaxDim));
  }
  for (const LayerSpec& layer : spec.layer()) {
    const bool big = too_big(layer.conv2d().filters()) || too_big(layer.conv2d().kernel()) ||
                     too_big(layer.conv2d().stride()) || too_big(layer.conv2d().padding()) ||
                     too_big(layer.max_pool().size()) || too_big(layer.max_pool().stride()) ||
                     too_big(layer.dense().units());
    if (big) return LayerError(layer, absl::StrCat("sizes must be at most ", kMaxDim));
  }
  if (spec.num_classes() < 2) return absl::InvalidArgumentError("num_classes must be at least 2");
  if (!(in.stddev() >= 0) || !std::isfinite(in.mean()) || !std::isfinite(in.stddev())) {
    return absl::InvalidArgumentError("input stddev must be finite and not negative");
  }
  if (spec.layer_size() == 0) return absl::InvalidArgumentError("the model has no layers");
  ActivationShape cur{in.channels(), in.height(), in.width()};
  std::vector<ActivationShape> shapes;
  absl::flat_hash_set<std::string> names;
  for (const LayerSpec& layer : spec.layer()) {
    if (layer.name().empty() || layer.name().find('/') != std::string::npos) {
      return absl::InvalidArgumentError("every layer needs a name without '/'");
    }
    if (!names.insert(layer.name()).second) return LayerError(layer, "name used twice");
    switch (layer.kind_case()) {
      case LayerSpec::kConv2D: {
        const Conv2DLayer& c = layer.conv2d();
        const int stride = c.stride() == 0 ? 1 : c.stride();
        if (c.filters() <= 0 || c.kernel() <= 0 || stride <= 0 || c.padding() < 0) {
          return LayerError(layer, "conv2d needs positive filters, kernel and stride");
        }
        if (cur.height + 2 * c.padding() < c.kernel() || cur.width + 2 * c.padding() < c.kernel()) {
          return LayerError(layer, absl::StrCat("kernel ", c.kernel(), " larger than its ", cur.height,
                                                "x", cur.width, " input"));
        }
        cur = {c.filters(), (cur.height + 2 * c.padding() - c.kernel()) / stride + 1,
               (cur.width + 2 * c.padding() - c.kernel()) / stride + 1};
        break;
      }
      case LayerSpec::kMaxPool: {
        const MaxPoolLayer& p = layer.max_pool();
        const int stride = p.stride() == 0 ? p.size() : p.stride();
        if (p.size() <= 0 || stride <= 0) return LayerError(layer, "max_pool needs a positive size");
        if (cur.height < p.size() || cur.width < p.size()) {
          return LayerError(layer, "pool window larger than its input");
        }
        cur = {cur.channels, (cur.height - p.size()) / stride + 1, (cur.width - p.size()) / stride + 1};
        break;
      }
      case LayerSpec::kRelu:
        break;
      case LayerSpec::kDense:
        if (layer.dense().units() <= 0) return LayerError(layer, "dense needs positive units");
        cur = {layer.dense().units(), 1, 1};
        break;
      case LayerSpec::KIND_NOT_SET:
        return LayerError(layer, "no layer kind given (conv2d, max_pool, relu or dense)");
    }
    shapes.push_back(cur);
  }
  int64_t params = 0;
  ActivationShape prev{in.channels(), in.height(), in.width()};
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    if (prev.size() > kMaxParameters) {
      return LayerError(layer, absl::StrCat("its input has more than ", kMaxParameters, " values"));
    }
    if (layer.has_conv2d()) {
      const int64_t k = layer.conv2d().kernel();
      params += layer.conv2d().filters() * (int64_t{prev.channels} * k * k + 1);
    } else if (layer.has_dense()) {
      params += layer.dense().units() * (prev.size() + 1);
    }
    if (params > kMaxParameters) {
      return LayerError(layer, absl::StrCat("the model exceeds ", kMaxParameters, " parameters"));
    }
    prev = shapes[i];
  }
  const LayerSpec& last = spec.layer(spec.layer_size() - 1);
  if (last.kind_case() != LayerSpec::kDense || last.dense().units() != spec.num_classes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the last layer must be dense with num_classes (", spec.num_classes(), ") units"));
  }
  return shapes;
}

std::vector<VariableShape> ModelVariables(const ModelSpec& spec) {
  std::vector<VariableShape> vars;
  int64_t channels = spec.input().channels();
  int64_t features = int64_t{spec.input().channels()} * spec.input().height() * spec.input().width();
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
  if (!shapes.ok()) return vars;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    if (layer.has_conv2d()) {
      const int64_t k = layer.conv2d().kernel(), f = layer.conv2d().filters();
      vars.push_back({layer.name() + "/weights", {f, channels, k, k}});
      vars.push_back({layer.name() + "/bias", {f}});
    } else if (layer.has_dense()) {
      const int64_t u = layer.dense().units();
      vars.push_back({layer.name() + "/weights", {u, features}});
      vars.push_back({layer.name() + "/bias", {u}});
    }
    channels = (*shapes)[i].channels;
    features = (*shapes)[i].size();
  }
  return vars;
}

std::vector<std::vector<float>> InitialValues(const ModelSpec& spec, uint64_t seed) {
  std::vector<VariableShape> vars = ModelVariables(spec);
  std::vector<std::vector<float>> values;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x5851F42D4C957F2Dull);
  for (size_t i = 0; i < vars.size(); ++i) {
    // weights and bias of a layer come in pairs; both use the weights' fan-in.
    const std::vector<int64_t>& w = vars[i - (i % 2)].shape;
    int64_t fan_in = 1;
    for (size_t d = 1; d < w.size(); ++d) fan_in *= w[d];
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::vector<float> v(NumElements(vars[i].shape));
    for (float& x : v) {
      // 53 random bits to a double in [0, 1): identical on every platform.
      double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
      x = static_cast<float>((2.0 * u - 1.0) * bound);
    }
    values.push_back(std::move(v));
  }
  return values;
}

}  // namespace psflow::model
