#include "model/spec.h"

#include <cmath>
#include <random>

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include "absl/container/flat_hash_map.h"
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
  auto conv = [&](const std::string& name, int filters, int kernel, int stride, const std::string& input) {
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
          "model '", name_or_path, "' is neither a built-in model (cnn, mlp, resnet) nor a readable spec file"));
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

absl::StatusOr<std::vector<LayerWiring>> ResolveWiring(const ModelSpec& spec) {
  std::vector<LayerWiring> wiring;
  absl::flat_hash_map<std::string, int> index;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    if (layer.name().empty() || layer.name().find('/') != std::string::npos) {
      return absl::InvalidArgumentError("every layer needs a name without '/'");
    }
    if (index.contains(layer.name())) return LayerError(layer, "name used twice");
    LayerWiring w;
    w.input = i - 1;
    if (!layer.input().empty()) {
      auto it = index.find(layer.input());
      if (it == index.end()) {
        return LayerError(layer, absl::StrCat("input '", layer.input(), "' is not an earlier layer"));
      }
      w.input = it->second;
    }
    if (layer.has_add()) {
      auto it = index.find(layer.add().other());
      if (it == index.end()) {
        return LayerError(layer, absl::StrCat("add.other '", layer.add().other(), "' is not an earlier layer"));
      }
      w.other = it->second;
    }
    index[layer.name()] = i;
    wiring.push_back(w);
  }
  // Every output but the last feeds some layer: a dangling branch is a typo.
  std::vector<bool> read(wiring.size(), false);
  for (const LayerWiring& w : wiring) {
    if (w.input >= 0) read[w.input] = true;
    if (w.other >= 0) read[w.other] = true;
  }
  for (size_t i = 0; i + 1 < read.size(); ++i) {
    if (!read[i]) return LayerError(spec.layer(static_cast<int>(i)), "its output is never read");
  }
  return wiring;
}

namespace {

// What checking a spec finds out: the activation shape after each layer and
// the layers each one reads.
struct Analysis {
  std::vector<ActivationShape> shapes;
  std::vector<LayerWiring> wiring;
};

// The checks of ValidateModelSpec, in one pass over the spec.
absl::StatusOr<Analysis> Analyze(const ModelSpec& spec) {
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
  absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(spec);
  if (!wiring.ok()) return wiring.status();
  const ActivationShape model_in{in.channels(), in.height(), in.width()};
  Analysis result;
  result.wiring = *std::move(wiring);
  std::vector<ActivationShape>& shapes = result.shapes;
  int64_t params = 0;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    const LayerWiring& w = result.wiring[i];
    const ActivationShape cur = w.input < 0 ? model_in : shapes[w.input];
    if (cur.size() > kMaxParameters) {
      return LayerError(layer, absl::StrCat("its input has more than ", kMaxParameters, " values"));
    }
    ActivationShape out = cur;
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
        out = {c.filters(), (cur.height + 2 * c.padding() - c.kernel()) / stride + 1,
               (cur.width + 2 * c.padding() - c.kernel()) / stride + 1};
        const int64_t k = c.kernel();
        params += c.filters() * (int64_t{cur.channels} * k * k + (c.no_bias() ? 0 : 1));
        break;
      }
      case LayerSpec::kMaxPool: {
        const MaxPoolLayer& p = layer.max_pool();
        const int stride = p.stride() == 0 ? p.size() : p.stride();
        if (p.size() <= 0 || stride <= 0) return LayerError(layer, "max_pool needs a positive size");
        if (cur.height < p.size() || cur.width < p.size()) {
          return LayerError(layer, "pool window larger than its input");
        }
        out = {cur.channels, (cur.height - p.size()) / stride + 1, (cur.width - p.size()) / stride + 1};
        break;
      }
      case LayerSpec::kRelu:
        break;
      case LayerSpec::kDense:
        if (layer.dense().units() <= 0) return LayerError(layer, "dense needs positive units");
        out = {layer.dense().units(), 1, 1};
        params += layer.dense().units() * (cur.size() + 1);
        break;
      case LayerSpec::kBatchNorm:
        if (!(layer.batch_norm().epsilon() >= 0) || !std::isfinite(layer.batch_norm().epsilon())) {
          return LayerError(layer, "batch_norm epsilon must be finite and not negative");
        }
        params += 2 * int64_t{cur.channels};
        break;
      case LayerSpec::kAdd: {
        const ActivationShape& other = shapes[w.other];
        if (other.channels != cur.channels || other.height != cur.height || other.width != cur.width) {
          return LayerError(layer, absl::StrCat("adds ", other.channels, "x", other.height, "x", other.width,
                                                " from '", layer.add().other(), "' to its ", cur.channels, "x",
                                                cur.height, "x", cur.width, " input"));
        }
        break;
      }
      case LayerSpec::kGlobalAvgPool:
        out = {cur.channels, 1, 1};
        break;
      case LayerSpec::KIND_NOT_SET:
        return LayerError(layer, "no layer kind given (conv2d, max_pool, relu, dense, batch_norm, add or "
                                 "global_avg_pool)");
    }
    if (params > kMaxParameters) {
      return LayerError(layer, absl::StrCat("the model exceeds ", kMaxParameters, " parameters"));
    }
    shapes.push_back(out);
  }
  const LayerSpec& last = spec.layer(spec.layer_size() - 1);
  if (last.kind_case() != LayerSpec::kDense || last.dense().units() != spec.num_classes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the last layer must be dense with num_classes (", spec.num_classes(), ") units"));
  }
  return result;
}

}  // namespace

absl::StatusOr<std::vector<ActivationShape>> ValidateModelSpec(const ModelSpec& spec) {
  absl::StatusOr<Analysis> analysis = Analyze(spec);
  if (!analysis.ok()) return analysis.status();
  return std::move(analysis->shapes);
}

namespace {

enum class Init { kFanIn, kOnes, kZeros };

struct VariableInit {
  VariableShape shape;
  Init init = Init::kFanIn;
  int64_t fan_in = 1;
  int layer = -1;  // index of the layer that owns it
};

// The one place that says which layer owns which variables, in what order.
// Empty for an invalid spec.
std::vector<VariableInit> Variables(const ModelSpec& spec) {
  std::vector<VariableInit> vars;
  absl::StatusOr<Analysis> analysis = Analyze(spec);
  if (!analysis.ok()) return vars;
  const ActivationShape model_in{spec.input().channels(), spec.input().height(), spec.input().width()};
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    const int src = analysis->wiring[i].input;
    const ActivationShape in = src < 0 ? model_in : analysis->shapes[src];
    if (layer.has_conv2d()) {
      const int64_t k = layer.conv2d().kernel(), f = layer.conv2d().filters();
      const int64_t fan_in = int64_t{in.channels} * k * k;
      vars.push_back({{layer.name() + "/weights", {f, in.channels, k, k}}, Init::kFanIn, fan_in, i});
      if (!layer.conv2d().no_bias()) vars.push_back({{layer.name() + "/bias", {f}}, Init::kFanIn, fan_in, i});
    } else if (layer.has_dense()) {
      const int64_t u = layer.dense().units();
      vars.push_back({{layer.name() + "/weights", {u, in.size()}}, Init::kFanIn, in.size(), i});
      vars.push_back({{layer.name() + "/bias", {u}}, Init::kFanIn, in.size(), i});
    } else if (layer.has_batch_norm()) {
      vars.push_back({{layer.name() + "/gamma", {in.channels}}, Init::kOnes, 1, i});
      vars.push_back({{layer.name() + "/beta", {in.channels}}, Init::kZeros, 1, i});
    }
  }
  return vars;
}

}  // namespace

std::vector<LayerVariables> LayerVariableIndices(const ModelSpec& spec) {
  std::vector<LayerVariables> out(static_cast<size_t>(spec.layer_size()));
  const std::vector<VariableInit> vars = Variables(spec);
  for (size_t v = 0; v < vars.size(); ++v) {
    LayerVariables& owner = out[static_cast<size_t>(vars[v].layer)];
    (owner.first < 0 ? owner.first : owner.second) = static_cast<int>(v);
  }
  return out;
}

std::vector<VariableShape> ModelVariables(const ModelSpec& spec) {
  std::vector<VariableShape> out;
  for (VariableInit& v : Variables(spec)) out.push_back(std::move(v.shape));
  return out;
}

std::vector<std::vector<float>> InitialValues(const ModelSpec& spec, uint64_t seed) {
  std::vector<std::vector<float>> values;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 0x5851F42D4C957F2Dull);
  for (const VariableInit& var : Variables(spec)) {
    std::vector<float> v(NumElements(var.shape.shape));
    switch (var.init) {
      case Init::kOnes:
        std::fill(v.begin(), v.end(), 1.0f);
        break;
      case Init::kZeros:
        break;
      case Init::kFanIn: {
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
