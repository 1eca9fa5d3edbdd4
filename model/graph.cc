#include "model/graph.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"

namespace psflow::model {
namespace {

constexpr int64_t kMaxParameters = int64_t{1} << 30;

// A layer whose Backward writes each operand's gradient reads each output
// at most once.
absl::Status CheckDistinct(const ModelSpec& spec, const LayerSpec& layer, const LayerWiring& w) {
  std::vector<int> all{w.input};
  all.insert(all.end(), w.others.begin(), w.others.end());
  std::sort(all.begin(), all.end());
  const auto twice = std::adjacent_find(all.begin(), all.end());
  if (twice == all.end()) return absl::OkStatus();
  const std::string what =
      *twice < 0 ? "the model input" : absl::StrCat("'", spec.layer(*twice).name(), "'");
  return LayerError(layer, absl::StrCat("reads ", what, " twice"));
}

}  // namespace

absl::StatusOr<WiredLayers> WireLayers(const ModelSpec& spec) {
  WiredLayers out;
  absl::flat_hash_map<std::string, int> index;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    if (layer.name().empty() || layer.name().find('/') != std::string::npos) {
      return absl::InvalidArgumentError("every layer needs a name without '/'");
    }
    if (index.contains(layer.name())) return LayerError(layer, "name used twice");
    absl::StatusOr<std::unique_ptr<const Layer>> created = CreateLayer(layer);
    if (!created.ok()) return created.status();
    LayerWiring w;
    w.input = (*created)->reads_input() ? i - 1 : -1;
    if (!(*created)->reads_input() && !layer.input().empty()) {
      return LayerError(layer, "reads ids, not an activation: its input must be empty");
    }
    if (!layer.input().empty()) {
      auto it = index.find(layer.input());
      if (it == index.end()) {
        return LayerError(layer,
                          absl::StrCat("input '", layer.input(), "' is not an earlier layer"));
      }
      w.input = it->second;
    }
    for (const std::string& other : (*created)->other_inputs()) {
      auto it = index.find(other);
      if (it == index.end()) {
        return LayerError(layer, absl::StrCat((*created)->other_field(), " '", other,
                                              "' is not an earlier layer"));
      }
      w.others.push_back(it->second);
    }
    if ((*created)->adds_to_gradients()) PSFLOW_RETURN_IF_ERROR(CheckDistinct(spec, layer, w));
    index[layer.name()] = i;
    out.layers.push_back(*std::move(created));
    out.wiring.push_back(w);
  }
  // Every output but the last feeds some layer: a dangling branch is a typo.
  std::vector<bool> read(out.wiring.size(), false);
  for (const LayerWiring& w : out.wiring) {
    if (w.input >= 0) read[w.input] = true;
    for (int o : w.others) read[o] = true;
  }
  for (size_t i = 0; i + 1 < read.size(); ++i) {
    if (!read[i]) return LayerError(spec.layer(static_cast<int>(i)), "its output is never read");
  }
  return out;
}

namespace {

// The input's sizes and standardization, and its id features.
absl::Status CheckInput(const ModelSpec& spec) {
  const InputSpec& in = spec.input();
  if (in.channels() <= 0 || in.height() <= 0 || in.width() <= 0) {
    return absl::InvalidArgumentError("input needs positive channels, height and width");
  }
  auto too_big = [](int64_t v) { return v > kMaxSpecDim; };
  if (too_big(in.channels()) || too_big(in.height()) || too_big(in.width()) ||
      too_big(spec.num_classes())) {
    return absl::InvalidArgumentError(
        absl::StrCat("input sizes and num_classes must be at most ", kMaxSpecDim));
  }
  if (spec.num_classes() < 2) return absl::InvalidArgumentError("num_classes must be at least 2");
  if (!(in.stddev() >= 0) || !std::isfinite(in.mean()) || !std::isfinite(in.stddev())) {
    return absl::InvalidArgumentError("input stddev must be finite and not negative");
  }
  if (in.channel_mean_size() != 0 || in.channel_stddev_size() != 0) {
    if (in.channel_mean_size() != in.channels() || in.channel_stddev_size() != in.channels()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input channel_mean and channel_stddev need one value per channel (", in.channels(),
          "), got ", in.channel_mean_size(), " and ", in.channel_stddev_size()));
    }
    for (int c = 0; c < in.channels(); ++c) {
      if (!std::isfinite(in.channel_mean(c)) || !(in.channel_stddev(c) > 0) ||
          !std::isfinite(in.channel_stddev(c))) {
        return absl::InvalidArgumentError(
            "input channel_mean must be finite and channel_stddev finite and positive");
      }
    }
  }
  absl::flat_hash_map<std::string, int> names;
  for (const IdFeatureSpec& f : in.id_feature()) {
    if (f.name().empty()) return absl::InvalidArgumentError("every input id_feature needs a name");
    if (!names.emplace(f.name(), 0).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("input id_feature '", f.name(), "' is named twice"));
    }
    if (f.width() < 0 || f.width() > kMaxSpecDim) {
      return absl::InvalidArgumentError(absl::StrCat("input id_feature '", f.name(),
                                                     "' needs a width in [1, ", kMaxSpecDim, "]"));
    }
  }
  return absl::OkStatus();
}

// Each embedding layer reads an id feature the input names.
absl::Status CheckEmbeddingFeatures(const ModelSpec& spec) {
  for (const LayerSpec& layer : spec.layer()) {
    if (!layer.has_embedding()) continue;
    const auto& features = spec.input().id_feature();
    const bool named = std::any_of(features.begin(), features.end(), [&](const IdFeatureSpec& f) {
      return f.name() == layer.embedding().feature();
    });
    if (!named) {
      return LayerError(layer, absl::StrCat("feature '", layer.embedding().feature(),
                                            "' is not an input id_feature"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelGraph> BuildModelGraph(const ModelSpec& spec) {
  PSFLOW_RETURN_IF_ERROR(CheckInput(spec));
  const InputSpec& in = spec.input();
  if (spec.layer_size() == 0) return absl::InvalidArgumentError("the model has no layers");
  absl::StatusOr<WiredLayers> wired = WireLayers(spec);
  if (!wired.ok()) return wired.status();
  PSFLOW_RETURN_IF_ERROR(CheckEmbeddingFeatures(spec));
  ModelGraph g;
  g.input = {in.channels(), in.height(), in.width()};
  g.layers = std::move(wired->layers);
  g.wiring = std::move(wired->wiring);
  g.layer_vars.resize(g.layers.size());
  int64_t params = 0;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const LayerSpec& layer = spec.layer(i);
    const Layer& kind = *g.layers[i];
    const ActivationShape cur = g.input_of(i);
    if (cur.size() > kMaxParameters) {
      return LayerError(layer, absl::StrCat("its input has more than ", kMaxParameters, " values"));
    }
    std::vector<ActivationShape> others;
    for (int o : g.wiring[i].others) others.push_back(g.shapes[o]);
    absl::StatusOr<ActivationShape> out = kind.OutputShape(cur, others);
    if (!out.ok()) return LayerError(layer, out.status().message());
    for (LayerVariable& v : kind.Variables(cur)) {
      LayerVariables& owned = g.layer_vars[i];
      const int index = static_cast<int>(g.variables.size());
      if (v.trainable) {
        (owned.first < 0 ? owned.first : owned.second) = index;
      } else {
        (owned.running_mean < 0 ? owned.running_mean : owned.running_var) = index;
      }
      params += NumElements(v.shape);
      g.variables.push_back(
          {{absl::StrCat(layer.name(), "/", v.suffix), std::move(v.shape), v.trainable},
           v.init,
           v.fan_in,
           i});
    }
    if (params > kMaxParameters) {
      return LayerError(layer, absl::StrCat("the model exceeds ", kMaxParameters, " parameters"));
    }
    g.shapes.push_back(*out);
  }
  const LayerSpec& last = spec.layer(spec.layer_size() - 1);
  if (!last.has_dense() || last.dense().units() != spec.num_classes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the last layer must be dense with num_classes (", spec.num_classes(), ") units"));
  }
  return g;
}

}  // namespace psflow::model
