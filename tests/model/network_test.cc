#include "model/network.h"
#include "tests/model/network_testing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "model/spec.h"
#include "tests/kernels/wrapped_backend.h"
#include "tests/model/test_specs.h"

namespace psflow::model {
namespace {

using ::testing::HasSubstr;

using WeightsD = std::vector<std::vector<double>>;

// A residual block on a stem, in text format: r1 (the block input) is read by
// both c2 and the projection shortcut, and `sum` joins the two paths.
//   input 2x6x6 -> c1 conv 3@3x3 pad 1 (no bias) -> bn1 -> r1 relu
//     main path: c2 conv 4@3x3 pad 1 (no bias) -> bn2
//     shortcut:  proj conv 4@1x1 (no bias), reading r1 -> proj_bn
//   -> sum (bn2 + proj_bn) -> r2 relu -> global average pool (4) -> fc dense 3
constexpr char kResidualSpec[] = R"spec(
  name: "residual"
  input { channels: 2 height: 6 width: 6 }
  num_classes: 3
  layer { name: "c1" conv2d { filters: 3 kernel: 3 padding: 1 no_bias: true } }
  layer { name: "bn1" batch_norm {} }
  layer { name: "r1" relu {} }
  layer { name: "c2" conv2d { filters: 4 kernel: 3 padding: 1 no_bias: true } }
  layer { name: "bn2" batch_norm {} }
  layer { name: "proj" input: "r1" conv2d { filters: 4 kernel: 1 no_bias: true } }
  layer { name: "proj_bn" batch_norm {} }
  layer { name: "sum" input: "bn2" add { other: "proj_bn" } }
  layer { name: "r2" relu {} }
  layer { name: "pool" global_avg_pool {} }
  layer { name: "fc" dense { units: 3 } }
)spec";

constexpr int kBatch = 8;

// DLRM's shape in small: a bottom layer and two "embeddings" (dense layers
// here) meet in a dot interaction, whose output is joined with one of them
// again, so e2's gradient has two contributions that the join layers add.
constexpr char kJoinSpec[] = R"spec(
  name: "join"
  input { channels: 1 height: 1 width: 6 }
  num_classes: 3
  layer { name: "bottom" dense { units: 4 } }
  layer { name: "brelu" relu {} }
  layer { name: "e1" input: "bottom" dense { units: 4 } }
  layer { name: "e2" input: "brelu" dense { units: 4 } }
  layer { name: "inter" input: "brelu" interaction { others: "e1" others: "e2" } }
  layer { name: "cat" concat { others: "e2" } }
  layer { name: "fc" dense { units: 3 } }
)spec";

// InitialValues, with batch-norm gamma and beta moved off 1 and 0 so that
// their gradients are generic.
Weights ResidualWeights(const ModelSpec& spec, uint64_t seed) {
  Weights w = InitialValues(spec, seed);
  const std::vector<VariableShape> vars = ModelVariables(spec);
  std::mt19937 rng(static_cast<uint32_t>(seed) + 100);
  std::uniform_real_distribution<float> gamma(0.5f, 1.5f), beta(-0.3f, 0.3f);
  for (size_t v = 0; v < vars.size(); ++v) {
    const std::string kind = vars[v].name.substr(vars[v].name.find('/') + 1);
    if (kind == "gamma") {
      for (float& x : w[v]) x = gamma(rng);
    } else if (kind == "beta") {
      for (float& x : w[v]) x = beta(rng);
    }
  }
  return w;
}

// Random pixels in [0, 1) and labels in [0, num_classes).
void RandomBatch(const ModelSpec& spec, int batch, uint32_t seed, std::vector<float>* images,
                 std::vector<int32_t>* labels) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  const int64_t per =
      int64_t{spec.input().channels()} * spec.input().height() * spec.input().width();
  images->resize(static_cast<size_t>(batch * per));
  for (float& x : *images) x = pixel(rng);
  labels->resize(static_cast<size_t>(batch));
  for (int32_t& y : *labels)
    y = static_cast<int32_t>(rng() % static_cast<uint32_t>(spec.num_classes()));
}

WeightsD ToDouble(const Weights& w) {
  WeightsD out;
  for (const auto& v : w) out.emplace_back(v.begin(), v.end());
  return out;
}

// A double-precision interpreter of a model spec (plain loops, written from
// the documented semantics of each layer), the reference for the gradient
// checks. Its loss is the network's up to fp32 rounding, and it records every
// ReLU sign and max-pool arg-max: the loss is smooth in the weights as long as
// none of these decisions changes, so comparing them tells whether a
// finite-difference step crosses a kink.
class Reference {
 public:
  // `ids`: the batch's ids, for models with embedding layers (Network::SetIds).
  explicit Reference(const ModelSpec& spec, std::vector<uint64_t> ids = {})
      : spec_(spec), ids_(std::move(ids)) {
    absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
    absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(spec);
    EXPECT_TRUE(shapes.ok() && wiring.ok());
    if (shapes.ok()) shapes_ = *shapes;
    if (wiring.ok()) wiring_ = *wiring;
    vars_ = LayerVariableIndices(spec);
  }

  // The mean cross-entropy over the batch; appends the decisions to
  // *decisions unless it is null. Batch norm: in training mode with the
  // batch's statistics, which go to (*stats)[v] for each running-statistic
  // variable v (batch mean, unbiased variance) unless stats is null;
  // otherwise with the running statistics in w.
  double Loss(const WeightsD& w, const float* images, const int32_t* labels, int batch,
              std::vector<int>* decisions = nullptr, bool training = true,
              WeightsD* stats = nullptr) const {
    std::vector<std::vector<double>> acts(spec_.layer_size() + 1);
    acts[0] = StandardizedInput(images, batch);
    for (int l = 0; l < spec_.layer_size(); ++l) {
      if (!Forward(l, w, batch, acts, decisions, training, stats)) return NAN;
    }
    return CrossEntropy(acts.back(), labels, batch);
  }

 private:
  // One layer's forward pass: its input x of shape a, its output y of shape o
  // (zeroed), and its variables (null where it has none).
  struct Pass {
    ActivationShape a, o;
    const std::vector<double>& x;
    std::vector<double>& y;
    const std::vector<double>* w1;
    const std::vector<double>* w2;
    int batch;
  };

  static size_t At(const ActivationShape& s, int n, int c, int h, int v) {
    return ((static_cast<size_t>(n) * s.channels + c) * s.height + h) * s.width + v;
  }

  ActivationShape ModelInputShape() const {
    const InputSpec& in = spec_.input();
    return {in.channels(), in.height(), in.width()};
  }

  std::vector<double> StandardizedInput(const float* images, int batch) const {
    const InputSpec& in = spec_.input();
    std::vector<double> x(static_cast<size_t>(ModelInputShape().size() * batch));
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = in.stddev() > 0 ? (images[i] - double{in.mean()}) / in.stddev() : images[i];
    }
    return x;
  }

  // Layer l's output into acts[l + 1]; false (and a failure) for a layer
  // without kind.
  bool Forward(int l, const WeightsD& w, int batch, std::vector<std::vector<double>>& acts,
               std::vector<int>* decisions, bool training, WeightsD* stats) const {
    const LayerSpec& layer = spec_.layer(l);
    const int src = wiring_[l].input + 1;
    const ActivationShape o = shapes_[l];
    std::vector<double>& y = acts[l + 1];
    y.assign(static_cast<size_t>(o.size() * batch), 0.0);
    const Pass pass{src == 0 ? ModelInputShape() : shapes_[src - 1],
                    o,
                    acts[src],
                    y,
                    vars_[l].first >= 0 ? &w[vars_[l].first] : nullptr,
                    vars_[l].second >= 0 ? &w[vars_[l].second] : nullptr,
                    batch};
    switch (layer.kind_case()) {
      case LayerSpec::kConv2D:
        Conv(layer.conv2d(), pass);
        break;
      case LayerSpec::kMaxPool:
        MaxPool(layer.max_pool(), pass, decisions);
        break;
      case LayerSpec::kRelu:
        for (size_t i = 0; i < y.size(); ++i) {
          y[i] = std::max(pass.x[i], 0.0);
          if (decisions != nullptr) decisions->push_back(pass.x[i] > 0);
        }
        break;
      case LayerSpec::kDense:
        Dense(pass);
        break;
      case LayerSpec::kBatchNorm:
        BatchNorm(layer.batch_norm(), vars_[l], w, pass, training, stats);
        break;
      case LayerSpec::kAdd: {
        const std::vector<double>& other = acts[wiring_[l].others[0] + 1];
        for (size_t i = 0; i < y.size(); ++i) y[i] = pass.x[i] + other[i];
        break;
      }
      case LayerSpec::kConcat:
        Concat(Operands(l, acts), pass);
        break;
      case LayerSpec::kInteraction:
        Interaction(Operands(l, acts), layer.interaction().self_interaction(), pass);
        break;
      case LayerSpec::kGlobalAvgPool:
        GlobalAvgPool(pass);
        break;
      case LayerSpec::kEmbedding:
        Embedding(layer.embedding(), pass);
        break;
      case LayerSpec::KIND_NOT_SET:
        ADD_FAILURE() << "layer without kind";
        return false;
    }
    return true;
  }

  // Layer l's operands: its input, then its others.
  std::vector<const std::vector<double>*> Operands(
      int l, const std::vector<std::vector<double>>& acts) const {
    std::vector<const std::vector<double>*> xs{&acts[wiring_[l].input + 1]};
    for (int o : wiring_[l].others) xs.push_back(&acts[o + 1]);
    return xs;
  }

  // Per example, the rows (id mod rows) of its bag of the layer's feature,
  // summed, averaged or summed over sqrt(width).
  void Embedding(const EmbeddingLayer& e, const Pass& pass) const {
    size_t per = 0, offset = 0, width = 0;
    for (const IdFeatureSpec& f : spec_.input().id_feature()) {
      const size_t w = static_cast<size_t>(std::max(f.width(), 1));
      if (f.name() == e.feature()) {
        offset = per;
        width = w;
      }
      per += w;
    }
    ASSERT_EQ(ids_.size(), per * pass.batch) << "ids for every example";
    double scale = 1;
    if (e.combiner() == EmbeddingLayer::MEAN) scale = 1.0 / width;
    if (e.combiner() == EmbeddingLayer::SQRTN) scale = 1.0 / std::sqrt(static_cast<double>(width));
    const size_t dim = static_cast<size_t>(e.dim());
    for (size_t n = 0; n < static_cast<size_t>(pass.batch); ++n) {
      for (size_t j = 0; j < width; ++j) {
        const uint64_t row = ids_[n * per + offset + j] % static_cast<uint64_t>(e.rows());
        for (size_t k = 0; k < dim; ++k) pass.y[n * dim + k] += scale * (*pass.w1)[row * dim + k];
      }
    }
  }

  // Each example's operands end to end.
  static void Concat(const std::vector<const std::vector<double>*>& xs, const Pass& pass) {
    size_t at = 0;
    for (int n = 0; n < pass.batch; ++n) {
      for (const std::vector<double>* x : xs) {
        const size_t per = x->size() / pass.batch;
        for (size_t k = 0; k < per; ++k) pass.y[at++] = (*x)[n * per + k];
      }
    }
  }

  // x0, then the dot of every pair (i, j), i > j (i >= j with self), i
  // ascending, then j.
  static void Interaction(const std::vector<const std::vector<double>*>& xs, bool self,
                          const Pass& pass) {
    const size_t d = xs[0]->size() / pass.batch;
    size_t at = 0;
    for (int n = 0; n < pass.batch; ++n) {
      for (size_t k = 0; k < d; ++k) pass.y[at++] = (*xs[0])[n * d + k];
      for (size_t i = 0; i < xs.size(); ++i) {
        for (size_t j = 0; j < (self ? i + 1 : i); ++j) {
          double dot = 0;
          for (size_t k = 0; k < d; ++k) dot += (*xs[i])[n * d + k] * (*xs[j])[n * d + k];
          pass.y[at++] = dot;
        }
      }
    }
  }

  static void Conv(const Conv2DLayer& c, const Pass& pass) {
    const ActivationShape &a = pass.a, &o = pass.o;
    const int k = c.kernel(), stride = c.stride() == 0 ? 1 : c.stride(), pad = c.padding();
    for (int n = 0; n < pass.batch; ++n) {
      for (int f = 0; f < o.channels; ++f) {
        for (int p = 0; p < o.height; ++p) {
          for (int q = 0; q < o.width; ++q) {
            double s = pass.w2 != nullptr ? (*pass.w2)[f] : 0.0;
            for (int ch = 0; ch < a.channels; ++ch) {
              for (int r = 0; r < k; ++r) {
                for (int t = 0; t < k; ++t) {
                  const int hh = p * stride + r - pad, ww = q * stride + t - pad;
                  if (hh < 0 || hh >= a.height || ww < 0 || ww >= a.width) continue;
                  s += (*pass.w1)[((static_cast<size_t>(f) * a.channels + ch) * k + r) * k + t] *
                       pass.x[At(a, n, ch, hh, ww)];
                }
              }
            }
            pass.y[At(o, n, f, p, q)] = s;
          }
        }
      }
    }
  }

  static void MaxPool(const MaxPoolLayer& m, const Pass& pass, std::vector<int>* decisions) {
    const ActivationShape &a = pass.a, &o = pass.o;
    const int size = m.size();
    const int stride = m.stride() == 0 ? size : m.stride();
    for (int n = 0; n < pass.batch; ++n) {
      for (int c = 0; c < o.channels; ++c) {
        for (int p = 0; p < o.height; ++p) {
          for (int q = 0; q < o.width; ++q) {
            double best = -std::numeric_limits<double>::infinity();
            int arg = 0;
            for (int r = 0; r < size; ++r) {
              for (int t = 0; t < size; ++t) {
                const double v = pass.x[At(a, n, c, p * stride + r, q * stride + t)];
                if (v > best) {
                  best = v;
                  arg = r * size + t;
                }
              }
            }
            pass.y[At(o, n, c, p, q)] = best;
            if (decisions != nullptr) decisions->push_back(arg);
          }
        }
      }
    }
  }

  static void Dense(const Pass& pass) {
    const int64_t in_f = pass.a.size();
    for (int n = 0; n < pass.batch; ++n) {
      for (int u = 0; u < pass.o.channels; ++u) {
        double s = (*pass.w2)[u];
        for (int64_t i = 0; i < in_f; ++i) s += (*pass.w1)[u * in_f + i] * pass.x[n * in_f + i];
        pass.y[static_cast<size_t>(n) * pass.o.channels + u] = s;
      }
    }
  }

  // Channel c's sum of x, and its sum of squared deviations from `mean`.
  static double ChannelSum(const Pass& pass, int c) {
    double sum = 0;
    for (int n = 0; n < pass.batch; ++n) {
      for (int h = 0; h < pass.a.height; ++h) {
        for (int v = 0; v < pass.a.width; ++v) sum += pass.x[At(pass.a, n, c, h, v)];
      }
    }
    return sum;
  }
  static double ChannelSquares(const Pass& pass, int c, double mean) {
    const ActivationShape& a = pass.a;
    double sq = 0;
    for (int n = 0; n < pass.batch; ++n) {
      for (int h = 0; h < a.height; ++h) {
        for (int v = 0; v < a.width; ++v)
          sq += (pass.x[At(a, n, c, h, v)] - mean) * (pass.x[At(a, n, c, h, v)] - mean);
      }
    }
    return sq;
  }

  static void BatchNorm(const BatchNormLayer& bn, const LayerVariables& vars, const WeightsD& w,
                        const Pass& pass, bool training, WeightsD* stats) {
    const ActivationShape& a = pass.a;
    const double eps = bn.epsilon() > 0 ? bn.epsilon() : 1e-5;
    const double count = static_cast<double>(pass.batch) * a.height * a.width;
    for (int c = 0; c < a.channels; ++c) {
      double mean = ChannelSum(pass, c) / count;
      const double sq = ChannelSquares(pass, c, mean);
      double var = sq / count;
      if (training && stats != nullptr) {
        (*stats)[vars.running_mean].resize(a.channels);
        (*stats)[vars.running_var].resize(a.channels);
        (*stats)[vars.running_mean][c] = mean;
        (*stats)[vars.running_var][c] = count > 1 ? sq / (count - 1) : var;
      }
      if (!training) {
        mean = w[vars.running_mean][c];
        var = w[vars.running_var][c];
      }
      const double inv = 1.0 / std::sqrt(var + eps);
      for (int n = 0; n < pass.batch; ++n) {
        for (int h = 0; h < a.height; ++h) {
          for (int v = 0; v < a.width; ++v) {
            const size_t i = At(a, n, c, h, v);
            pass.y[i] = (*pass.w1)[c] * (pass.x[i] - mean) * inv + (*pass.w2)[c];
          }
        }
      }
    }
  }

  static void GlobalAvgPool(const Pass& pass) {
    const ActivationShape& a = pass.a;
    const int hw = a.height * a.width;
    for (int n = 0; n < pass.batch; ++n) {
      for (int c = 0; c < a.channels; ++c) {
        double s = 0;
        for (int i = 0; i < hw; ++i)
          s += pass.x[(static_cast<size_t>(n) * a.channels + c) * hw + i];
        pass.y[static_cast<size_t>(n) * a.channels + c] = s / hw;
      }
    }
  }

  double CrossEntropy(const std::vector<double>& logits, const int32_t* labels, int batch) const {
    const int classes = spec_.num_classes();
    double total = 0;
    for (int n = 0; n < batch; ++n) {
      const double* z = logits.data() + static_cast<size_t>(n) * classes;
      const double m = *std::max_element(z, z + classes);
      double sum = 0;
      for (int c = 0; c < classes; ++c) sum += std::exp(z[c] - m);
      total += m + std::log(sum) - z[labels[n]];
    }
    return total / batch;
  }

  ModelSpec spec_;
  std::vector<uint64_t> ids_;
  std::vector<ActivationShape> shapes_;
  std::vector<LayerWiring> wiring_;
  std::vector<LayerVariables> vars_;
};

// The gradients a network computes on one batch at weights w, against finite
// differences (ExpectGradientsMatchFiniteDifferences says how).
class GradientCheck {
 public:
  GradientCheck(const ModelSpec& spec, Network& net, const Weights& w,
                const std::vector<float>& images, const std::vector<int32_t>& labels, int batch,
                const std::vector<uint64_t>& ids)
      : net_(net),
        w_(w),
        images_(images),
        labels_(labels),
        batch_(batch),
        ids_(ids),
        ref_(spec, ids),
        wd_(ToDouble(w)) {}

  // The network's step at w: its loss is the reference's, and its running
  // statistics' "gradients" the batch's statistics.
  void Step() {
    ASSERT_TRUE(SetNetWeights(net_, w_).ok());
    ASSERT_TRUE(SetIds().ok());
    absl::StatusOr<Network::Result> step = net_.TrainStep(images_.data(), labels_.data(), batch_);
    ASSERT_TRUE(step.ok()) << step.status();
    grads_ = NetGradients(net_);
    ASSERT_EQ(grads_.size(), w_.size());
    WeightsD stats(w_.size());
    ref_loss_ =
        ref_.Loss(wd_, images_.data(), labels_.data(), batch_, &base_, /*training=*/true, &stats);
    ASSERT_FALSE(base_.empty()) << "the model has ReLU or max-pool decisions";
    EXPECT_NEAR(step->loss, ref_loss_, 1e-5 * ref_loss_)
        << "the network computes the reference's loss";
    ASSERT_NO_FATAL_FAILURE(ExpectBatchStatistics(stats));
  }

  // 1. Every element against the reference.
  void ExpectEveryElementMatchesTheReference() {
    int64_t checked = 0, kinked = 0;
    for (size_t v = 0; v < grads_.size(); ++v) {
      if (!trainable(v)) continue;
      const std::string& name = net_.variables()[v].name;
      double largest = 0;
      for (float g : grads_[v]) largest = std::max(largest, static_cast<double>(std::abs(g)));
      EXPECT_GT(largest, 1e-5) << name << " has no gradient";
      constexpr double h = 1e-6;
      for (int64_t i = 0; i < static_cast<int64_t>(grads_[v].size()); ++i) {
        if (!SmoothWithin(v, i, h, /*float_steps=*/false)) {
          ++kinked;
          continue;
        }
        ++checked;
        const double fd = RefDifference(v, i, wd_[v][i] + h, wd_[v][i] - h);
        EXPECT_NEAR(grads_[v][i], fd, 1e-3 * std::abs(fd) + 1e-4 * largest)
            << name << "[" << i << "]";
      }
    }
    EXPECT_LE(kinked, checked / 50) << "kinks within 1e-6 of the weights should be rare";
  }

  // 2. Picked elements against the network's own loss.
  void ExpectPickedElementsMatchTheNetworkLoss() {
    const float loss32 = static_cast<float>(ref_loss_);
    const double ulp = std::nextafter(loss32, std::numeric_limits<float>::infinity()) - loss32;
    int total_done = 0, trainables = 0;
    for (size_t v = 0; v < grads_.size(); ++v) {
      if (!trainable(v)) continue;
      ++trainables;
      const int done = ExpectPicksOf(v, ulp);
      EXPECT_GE(done, 1) << net_.variables()[v].name
                         << ": no element without a kink within +-1.5e-4";
      total_done += done;
    }
    // Most picks find an element of their own (variables of 3 or 4 elements may
    // have fewer kink-free ones).
    EXPECT_GE(total_done, 3 * trainables);
  }

 private:
  bool trainable(size_t v) const { return net_.variables()[v].trainable; }
  // Every step needs its batch's ids (models with embedding layers).
  absl::Status SetIds() {
    return ids_.empty() ? absl::OkStatus() : net_.SetIds(ids_.data(), batch_);
  }

  // Running statistics have no gradient: the step leaves the batch's
  // statistics in their place.
  void ExpectBatchStatistics(const WeightsD& stats) {
    for (size_t v = 0; v < grads_.size(); ++v) {
      if (trainable(v)) continue;
      const std::string& name = net_.variables()[v].name;
      ASSERT_EQ(stats[v].size(), grads_[v].size()) << name;
      for (size_t i = 0; i < grads_[v].size(); ++i) {
        EXPECT_NEAR(grads_[v][i], stats[v][i], 1e-5 * (1 + std::abs(stats[v][i])))
            << name << "[" << i << "]";
      }
    }
  }

  // Whether the reference's decisions stay those at w for every step t*h,
  // t in [-1, 1], of element (v, i) (t = +-1/4, +-1/2, +-3/4, +-1).
  bool SmoothWithin(size_t v, int64_t i, double h, bool float_steps) const {
    for (int k = -4; k <= 4; ++k) {
      if (k == 0) continue;
      WeightsD p = wd_;
      p[v][i] = float_steps ? static_cast<double>(static_cast<float>(w_[v][i] + h * k / 4))
                            : wd_[v][i] + h * k / 4;
      std::vector<int> d;
      ref_.Loss(p, images_.data(), labels_.data(), batch_, &d);
      if (d != base_) return false;
    }
    return true;
  }

  double RefDifference(size_t v, int64_t i, double up_value, double down_value) const {
    WeightsD p = wd_;
    p[v][i] = up_value;
    const double up = ref_.Loss(p, images_.data(), labels_.data(), batch_);
    p[v][i] = down_value;
    const double down = ref_.Loss(p, images_.data(), labels_.data(), batch_);
    return (up - down) / (up_value - down_value);
  }

  // The training-mode loss (batch norm with the batch's statistics).
  double NetLoss(const Weights& p) {
    EXPECT_TRUE(SetNetWeights(net_, p).ok());
    EXPECT_TRUE(SetIds().ok());
    absl::StatusOr<Network::Result> r = net_.TrainStep(images_.data(), labels_.data(), batch_);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->loss : NAN;
  }

  // The largest candidate step with no decision change within +-h at (v, i);
  // 0 if none.
  double KinkFreeStep(size_t v, int64_t i) const {
    for (double candidate : {5e-3, 2.5e-3, 1.25e-3, 6.25e-4, 3.125e-4, 1.5625e-4}) {
      if (SmoothWithin(v, i, candidate, /*float_steps=*/true)) return candidate;
    }
    return 0;
  }

  // Up to 4 elements of variable v against the network's loss; returns how
  // many were checked.
  int ExpectPicksOf(size_t v, double ulp) {
    const int64_t n = static_cast<int64_t>(grads_[v].size());
    std::vector<bool> used(static_cast<size_t>(n), false);
    int done = 0;
    for (int64_t pick : {int64_t{0}, n / 3, n / 2, n - 1}) {
      // The first element from `pick` on, not checked yet, with a kink-free
      // step.
      for (int64_t tries = 0; tries < n; ++tries) {
        const int64_t i = (pick + tries) % n;
        if (used[i]) continue;
        const double h = KinkFreeStep(v, i);
        if (h == 0) continue;
        used[i] = true;
        ExpectElementMatchesTheNetworkLoss(v, i, h, ulp);
        ++done;
        break;
      }
    }
    return done;
  }

  void ExpectElementMatchesTheNetworkLoss(size_t v, int64_t i, double h, double ulp) {
    Weights p = w_;
    p[v][i] = static_cast<float>(w_[v][i] + h);
    const double up_value = p[v][i];
    const double up = NetLoss(p);
    p[v][i] = static_cast<float>(w_[v][i] - h);
    const double down_value = p[v][i];
    const double down = NetLoss(p);
    const double fd = (up - down) / (up_value - down_value);
    const double truncation = std::abs(RefDifference(v, i, up_value, down_value) -
                                       RefDifference(v, i, wd_[v][i] + 1e-6, wd_[v][i] - 1e-6));
    const double an = grads_[v][i];
    EXPECT_NEAR(an, fd, 1e-2 * std::max(std::abs(fd), std::abs(an)) + 2 * ulp / h + truncation)
        << net_.variables()[v].name << "[" << i << "], h = " << h;
  }

  Network& net_;
  const Weights& w_;
  const std::vector<float>& images_;
  const std::vector<int32_t>& labels_;
  const int batch_;
  const std::vector<uint64_t>& ids_;
  const Reference ref_;
  const WeightsD wd_;
  Weights grads_;
  std::vector<int> base_;  // the reference's decisions at w
  double ref_loss_ = 0;
};

// Checks the gradients a network computes on one batch at weights w, for
// every variable, in two ways:
//
// 1. Every element against central differences of the double-precision
//    reference (h = 1e-6: rounding in double contributes ~1e-10, and no ReLU
//    or max-pool decision changes within +-h, which is checked). Tolerance:
//    1e-3 relative plus 1e-4 of the variable's largest gradient, for the fp32
//    sums inside the network's backward pass.
//
// 2. A few elements per variable against central differences of the network's
//    own fp32 loss. The loss comes back as a float, so each evaluation is off
//    by up to ~2 ulp of the loss (its rounding to float plus the fp32
//    arithmetic of softmax and mean), and the difference quotient by up to
//    2 ulp / h: that is the absolute term of the tolerance, next to 1e-2
//    relative and the truncation error of that h (measured on the reference,
//    |D_h - D_1e-6|). h is the largest of 5e-3, 2.5e-3, ..., 1.5625e-4 (the
//    smaller the h, the looser the check) for which the reference sees no
//    ReLU or max-pool decision change within +-h (8 points checked): kinks are
//    dense here (a weight before batch norm moves every activation of its
//    channel), and a step across one makes the difference quotient the mean
//    of two one-sided slopes. Up to 4 distinct elements per variable, from
//    the first, a third, half way and the last on: an element kinked even at
//    the smallest h gives way to the next one.
void ExpectGradientsMatchFiniteDifferences(const ModelSpec& spec, Network& net, const Weights& w,
                                           const std::vector<float>& images,
                                           const std::vector<int32_t>& labels, int batch,
                                           const std::vector<uint64_t>& ids = {}) {
  GradientCheck check(spec, net, w, images, labels, batch, ids);
  ASSERT_NO_FATAL_FAILURE(check.Step());
  check.ExpectEveryElementMatchesTheReference();
  check.ExpectPickedElementsMatchTheNetworkLoss();
}

class NetworkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = ParseSpec(kSmallSpec);
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu", 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(spec_, backend_.get());
    ASSERT_TRUE(net.ok()) << net.status();
    net_ = *std::move(net);
    ASSERT_EQ(net_->variables().size(), 4u);
    ASSERT_EQ(net_->input_floats(), 64);

    weights_ = InitialValues(spec_, 3);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
    images_.resize(kBatch * 64);
    for (float& x : images_) x = pixel(rng);
    for (int i = 0; i < kBatch; ++i) labels_.push_back(i % 4);
    ASSERT_TRUE(SetWeights(weights_).ok());
  }

  absl::Status SetWeights(const std::vector<std::vector<float>>& w) {
    return SetNetWeights(*net_, w);
  }

  std::vector<std::vector<float>> Gradients() { return NetGradients(*net_); }

  double Loss(const std::vector<std::vector<float>>& w, int batch = kBatch, int first = 0) {
    EXPECT_TRUE(SetWeights(w).ok());
    absl::StatusOr<Network::Result> r =
        net_->Evaluate(images_.data() + first * 64, labels_.data() + first, batch);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->loss : NAN;
  }

  ModelSpec spec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Network> net_;
  std::vector<std::vector<float>> weights_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
};

TEST_F(NetworkTest, GradientsMatchFiniteDifferences) {
  absl::StatusOr<Network::Result> r = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->loss, 0.0);
  EXPECT_NEAR(r->loss, Loss(weights_), 1e-6) << "TrainStep and Evaluate agree on the loss";
  ExpectGradientsMatchFiniteDifferences(spec_, *net_, weights_, images_, labels_, kBatch);
}

TEST_F(NetworkTest, SgdStepsReduceTheLoss) {
  std::vector<std::vector<float>> w = weights_;
  const double initial = Loss(w);
  double last = initial;
  for (int step = 0; step < 30; ++step) {
    ASSERT_TRUE(SetWeights(w).ok());
    absl::StatusOr<Network::Result> r = net_->TrainStep(images_.data(), labels_.data(), kBatch);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GE(r->correct, 0);
    EXPECT_LE(r->correct, kBatch);
    last = r->loss;
    const auto g = Gradients();
    for (size_t v = 0; v < w.size(); ++v) {
      for (size_t i = 0; i < w[v].size(); ++i) w[v][i] -= 0.5f * g[v][i];
    }
  }
  const double final_loss = Loss(w);
  EXPECT_LT(final_loss, last);
  EXPECT_LT(final_loss, 0.5 * initial) << "initial " << initial;
}

TEST_F(NetworkTest, EvaluateWithOtherBatchSizes) {
  const double full = Loss(weights_);
  double sum = 0;
  for (int i = 0; i < kBatch; ++i) sum += Loss(weights_, 1, i);
  EXPECT_NEAR(sum / kBatch, full, 1e-5);
  // 3 + 5 examples.
  const double split = (3 * Loss(weights_, 3, 0) + 5 * Loss(weights_, 5, 3)) / kBatch;
  EXPECT_NEAR(split, full, 1e-5);

  // Ops for other batch sizes do not disturb the training state of this one.
  ASSERT_TRUE(SetWeights(weights_).ok());
  ASSERT_TRUE(net_->TrainStep(images_.data(), labels_.data(), kBatch).ok());
  const auto before = Gradients();
  EXPECT_NEAR(Loss(weights_, 2, 1), (Loss(weights_, 1, 1) + Loss(weights_, 1, 2)) / 2, 1e-5);
  ASSERT_TRUE(SetWeights(weights_).ok());
  absl::StatusOr<Network::Result> r = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(r.ok());
  EXPECT_NEAR(r->loss, full, 1e-6);
  const auto after = Gradients();
  for (size_t v = 0; v < before.size(); ++v) {
    for (size_t i = 0; i < before[v].size(); ++i) EXPECT_NEAR(after[v][i], before[v][i], 1e-6);
  }
}

// A spec with input mean/stddev sees (x - mean) / stddev: the same result as an
// unstandardized spec fed pre-standardized inputs, and not the same as that
// spec fed raw ones.
TEST_F(NetworkTest, StandardizesInputsAsTheSpecSays) {
  ModelSpec standardized = spec_;
  standardized.mutable_input()->set_mean(0.25f);
  standardized.mutable_input()->set_stddev(0.5f);
  absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(standardized, backend_.get());
  ASSERT_TRUE(net.ok()) << net.status();
  ASSERT_TRUE(SetNetWeights(**net, weights_).ok());
  absl::StatusOr<Network::Result> got = (*net)->Evaluate(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(got.ok()) << got.status();

  std::vector<float> pre(images_.size());
  for (size_t i = 0; i < pre.size(); ++i) pre[i] = (images_[i] - 0.25f) / 0.5f;
  absl::StatusOr<Network::Result> want = net_->Evaluate(pre.data(), labels_.data(), kBatch);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_NEAR(got->loss, want->loss, 1e-5);
  EXPECT_EQ(got->correct, want->correct);
  absl::StatusOr<Network::Result> raw = net_->Evaluate(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_GT(std::abs(raw->loss - got->loss), 1e-4);
}

// Per-channel standardization (InputSpec channel_mean/channel_stddev): the
// network on raw images equals one without standardization fed images
// standardized by hand; a spec with the wrong number of values is refused.
TEST(NetworkChannelsTest, StandardizesEachChannelAsTheSpecSays) {
  ModelSpec plain = ParseSpec(R"(name: "two" input { channels: 2 height: 3 width: 4 }
                                num_classes: 3 layer { name: "fc" dense { units: 3 } })");
  ModelSpec standardized = plain;
  InputSpec* in = standardized.mutable_input();
  for (float m : {0.25f, -0.5f}) in->add_channel_mean(m);
  for (float s : {0.5f, 2.0f}) in->add_channel_stddev(s);
  auto backend = kernels::CreateBackend("cpu", 1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto a = Network::Create(standardized, backend->get());
  auto b = Network::Create(plain, backend->get());
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  std::vector<float> fc(3 * 24 + 3);
  for (size_t i = 0; i < fc.size(); ++i) fc[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
  const std::vector<float> w(fc.begin(), fc.begin() + 72), bias(fc.begin() + 72, fc.end());
  ASSERT_TRUE((*a)->SetWeights({w.data(), bias.data()}).ok());
  ASSERT_TRUE((*b)->SetWeights({w.data(), bias.data()}).ok());
  const int batch = 2;
  std::vector<float> images(batch * 24), pre(images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    images[i] = static_cast<float>(i % 7) / 7.0f;
    const int c = static_cast<int>(i / 12) % 2;
    pre[i] = (images[i] - in->channel_mean(c)) / in->channel_stddev(c);
  }
  const std::vector<int32_t> labels = {0, 2};
  auto got = (*a)->Evaluate(images.data(), labels.data(), batch);
  auto want = (*b)->Evaluate(pre.data(), labels.data(), batch);
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_NEAR(got->loss, want->loss, 1e-5);
  EXPECT_EQ(got->correct, want->correct);

  in->add_channel_mean(0.1f);  // three means for two channels
  auto refused = Network::Create(standardized, backend->get());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("one value per channel (2)"));
}

TEST_F(NetworkTest, Errors) {
  EXPECT_EQ(net_->Evaluate(images_.data(), labels_.data(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<const float*> three(3, weights_[0].data());
  EXPECT_EQ(net_->SetWeights(three).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float*> none;
  EXPECT_EQ(net_->GetGradients(none).code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad_labels(kBatch, 4);
  EXPECT_EQ(net_->Evaluate(images_.data(), bad_labels.data(), kBatch).status().code(),
            absl::StatusCode::kInvalidArgument);

  ModelSpec invalid = spec_;
  invalid.mutable_layer(3)->mutable_dense()->set_units(5);
  EXPECT_EQ(Network::Create(invalid, backend_.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// SetWeightRangeAfter writes a range of one variable's floats (a slice's
// rows) and nothing else; a range outside the variable is refused.
TEST_F(NetworkTest, SetWeightRangeAfterWritesOnlyItsRange) {
  // Variable 2 is fc's kernel: 108 floats (27 rows of 4).
  const std::vector<float> rows = {1.5f, -2.5f, 3.5f, -4.5f, 5.5f, -6.5f, 7.5f, -8.5f};
  ASSERT_TRUE(net_->SetWeightRangeAfter(2, 8, 8, rows.data(), nullptr).ok());
  std::vector<std::vector<float>> got(4);
  std::vector<float*> out;
  for (size_t v = 0; v < 4; ++v) {
    got[v].resize(weights_[v].size());
    out.push_back(got[v].data());
  }
  ASSERT_TRUE(net_->GetWeights(out).ok());
  std::vector<float> want = weights_[2];
  std::copy(rows.begin(), rows.end(), want.begin() + 8);
  EXPECT_EQ(got[2], want);
  for (int v : {0, 1, 3}) EXPECT_EQ(got[v], weights_[v]) << "variable " << v;
  EXPECT_EQ(net_->SetWeightRangeAfter(2, 104, 8, rows.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(net_->SetWeightRangeAfter(2, -1, 1, rows.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(net_->SetWeightRangeAfter(4, 0, 1, rows.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// The small spec's forward buffers, by hand: the input (64 floats per
// example) in one buffer, conv (108) in a second; relu (108) takes the
// first, grown, once conv has read the input; pool (27) takes the second
// and fc (4) the first. 216 floats of activations, then the image (64), its
// label (1) and the class probabilities (4): 285 floats. The weights: conv
// 27 + 3, fc 108 + 4.
TEST_F(NetworkTest, ForwardMemoryOfTheSmallSpec) {
  NetworkOptions options;
  options.forward_only = true;
  absl::StatusOr<std::unique_ptr<Network>> fwd = Network::Create(spec_, backend_.get(), options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ((*fwd)->forward_memory().fixed, 142 * 4);
  EXPECT_EQ((*fwd)->forward_memory().per_example, 285 * 4);
  // A training network holds the gradients too.
  EXPECT_EQ(net_->forward_memory().fixed, 2 * 142 * 4);
  EXPECT_EQ(net_->forward_memory().per_example, 285 * 4);
}

// A forward-only network evaluates as any other and has nothing to train
// with: no gradients, and every training call refused.
TEST_F(NetworkTest, ForwardOnlyNetworkOnlyEvaluates) {
  NetworkOptions options;
  options.forward_only = true;
  absl::StatusOr<std::unique_ptr<Network>> fwd = Network::Create(spec_, backend_.get(), options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_TRUE(SetNetWeights(**fwd, weights_).ok());
  absl::StatusOr<Network::Result> got = (*fwd)->Evaluate(images_.data(), labels_.data(), kBatch);
  absl::StatusOr<Network::Result> want = net_->Evaluate(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(got.ok() && want.ok()) << got.status() << want.status();
  EXPECT_EQ(got->loss, want->loss);
  EXPECT_EQ(got->correct, want->correct);

  EXPECT_TRUE((*fwd)->HostGradients().empty());
  EXPECT_FALSE((*fwd)->HostWeights().empty());
  auto refused = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("forward-only")) << s;
  };
  refused((*fwd)->TrainStep(images_.data(), labels_.data(), kBatch).status());
  refused((*fwd)->SetInputs(images_.data(), labels_.data(), kBatch));
  refused((*fwd)->StartTrainStep(kBatch));
  std::vector<float*> none;
  refused((*fwd)->GetGradients(none));
}

// The residual model on the CPU backend.
class ResidualNetworkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = ParseSpec(kResidualSpec);
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu", 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    net_ = MakeNetwork();
    ASSERT_NE(net_, nullptr);
    // conv c1, c2, proj: weights; bn1, bn2, proj_bn: gamma, beta, running
    // mean and variance; fc: weights and bias.
    ASSERT_EQ(net_->variables().size(), 3u + 3 * 4 + 2);
    weights_ = ResidualWeights(spec_, 5);
    RandomBatch(spec_, kBatch, 12, &images_, &labels_);
    // Not one class only, and not one pixel value.
    EXPECT_NE(std::count(labels_.begin(), labels_.end(), labels_[0]), kBatch);
    EXPECT_NE(*std::min_element(images_.begin(), images_.end()),
              *std::max_element(images_.begin(), images_.end()));
  }

  std::unique_ptr<Network> MakeNetwork(const NetworkOptions& options = {}) {
    absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(spec_, backend_.get(), options);
    EXPECT_TRUE(net.ok()) << net.status();
    return net.ok() ? *std::move(net) : nullptr;
  }

  ModelSpec spec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Network> net_;
  Weights weights_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
};

class JoinNetworkTest : public ::testing::TestWithParam<bool> {};

// Concat and interaction (with and without each vector's dot with itself)
// against the double-precision reference, their operands' gradients
// included; e2 feeds both, so its gradient is right only if the second
// contribution is added to the first.
TEST_P(JoinNetworkTest, GradientsMatchFiniteDifferences) {
  ModelSpec spec = ParseSpec(kJoinSpec);
  spec.mutable_layer(4)->mutable_interaction()->set_self_interaction(GetParam());
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_EQ((*shapes)[4].channels, GetParam() ? 4 + 6 : 4 + 3);
  EXPECT_EQ((*shapes)[5].channels, (*shapes)[4].channels + 4);
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu", 1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(spec, backend->get());
  ASSERT_TRUE(net.ok()) << net.status();
  std::vector<float> images;
  std::vector<int32_t> labels;
  RandomBatch(spec, 6, 21, &images, &labels);
  ExpectGradientsMatchFiniteDifferences(spec, **net, InitialValues(spec, 8), images, labels, 6);
}

INSTANTIATE_TEST_SUITE_P(SelfInteraction, JoinNetworkTest, ::testing::Bool());

TEST(JoinSpecTest, OperandsAreCheckedByName) {
  auto error = [](const std::string& layers) {
    const std::string text =
        "input { channels: 1 height: 1 width: 4 } num_classes: 2 "
        "layer { name: \"a\" dense { units: 4 } } "
        "layer { name: \"b\" dense { units: 3 } } " +
        layers + " layer { name: \"fc\" dense { units: 2 } }";
    absl::StatusOr<std::vector<ActivationShape>> shapes =
        ValidateModelSpec(ParseSpec(text.c_str()));
    return shapes.ok() ? std::string("ok") : std::string(shapes.status().message());
  };
  EXPECT_EQ(error("layer { name: \"j\" interaction { others: \"a\" } }"),
            "layer 'j': 'a' gives 4 values per example, its input 3: all must be equal");
  EXPECT_EQ(error("layer { name: \"j\" concat { others: \"b\" } }"), "layer 'j': reads 'b' twice");
  EXPECT_EQ(error("layer { name: \"j\" concat { others: \"z\" } }"),
            "layer 'j': concat.others 'z' is not an earlier layer");
  EXPECT_EQ(error("layer { name: \"j\" concat {} }"), "layer 'j': concat needs others");
  EXPECT_EQ(error("layer { name: \"j\" concat { others: \"a\" } }"), "ok");
}

// DLRM in small with real embedding layers: a bottom layer meets two
// tables in a dot interaction, one reading a single id ("city", SUM), one
// a bag of 3 ("tags", MEAN), and the joined vector is concatenated with the
// city embedding again before the classifier.
constexpr char kEmbeddingSpec[] = R"spec(
  name: "embedding"
  input {
    channels: 1 height: 1 width: 5
    id_feature { name: "city" }
    id_feature { name: "tags" width: 3 }
  }
  num_classes: 3
  layer { name: "bottom" dense { units: 4 } }
  layer { name: "brelu" relu {} }
  layer { name: "city_emb" embedding { feature: "city" rows: 7 dim: 4 } }
  layer { name: "tag_emb" embedding { feature: "tags" rows: 5 dim: 4 combiner: MEAN } }
  layer { name: "inter" input: "brelu" interaction { others: "city_emb" others: "tag_emb" } }
  layer { name: "cat" concat { others: "city_emb" } }
  layer { name: "fc" dense { units: 3 } }
)spec";

class EmbeddingNetworkTest : public ::testing::Test {
 protected:
  static constexpr int kExamples = 6;

  void SetUp() override {
    spec_ = ParseSpec(kEmbeddingSpec);
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu", 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(spec_, backend_.get());
    ASSERT_TRUE(net.ok()) << net.status();
    net_ = *std::move(net);
    RandomBatch(spec_, kExamples, 31, &images_, &labels_);
    // Ids far above the tables' rows, so that only their hashing (x mod
    // rows) finds the rows; example 0's tags hold one id twice.
    std::mt19937_64 rng(17);
    for (uint64_t& id : ids_) id = rng();
    ids_[2] = ids_[1] + 5 * 1000003;
    weights_ = InitialValues(spec_, 4);
    ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  }

  ModelSpec spec_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Network> net_;
  Weights weights_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
  std::vector<uint64_t> ids_ = std::vector<uint64_t>(kExamples * 4);
};

// Both tables' gradients (dense: zeros in the rows no id fell on), and those
// of the layers their outputs feed, against the double-precision reference.
TEST_F(EmbeddingNetworkTest, GradientsMatchFiniteDifferences) {
  ASSERT_EQ(net_->variables()[2].name, "city_emb/table");
  EXPECT_EQ(net_->variables()[2].shape, (std::vector<int64_t>{7, 4}));
  ExpectGradientsMatchFiniteDifferences(spec_, *net_, weights_, images_, labels_, kExamples, ids_);
  // A row no id of the batch fell on has no gradient.
  std::vector<bool> used(5, false);
  for (int n = 0; n < kExamples; ++n) {
    for (int j = 1; j < 4; ++j) used[ids_[n * 4 + j] % 5] = true;
  }
  const Weights grads = NetGradients(*net_);
  for (int r = 0; r < 5; ++r) {
    double sum = 0;
    for (int k = 0; k < 4; ++k) sum += std::abs(grads[3][r * 4 + k]);
    EXPECT_EQ(sum == 0, !used[r]) << "tag_emb/table row " << r;
  }
}

TEST_F(EmbeddingNetworkTest, EvaluateReadsTheIdsGiven) {
  const Reference ref(spec_, ids_);
  ASSERT_TRUE(net_->SetIds(ids_.data(), kExamples).ok());
  absl::StatusOr<Network::Result> r = net_->Evaluate(images_.data(), labels_.data(), kExamples);
  ASSERT_TRUE(r.ok()) << r.status();
  const double expected =
      ref.Loss(ToDouble(weights_), images_.data(), labels_.data(), kExamples, nullptr, false);
  EXPECT_NEAR(r->loss, expected, 1e-5 * expected);
  // Ids that hash to the same rows give the same loss; others another.
  std::vector<uint64_t> same = ids_;
  for (int n = 0; n < kExamples; ++n) same[n * 4] += 7 * 12345;
  ASSERT_TRUE(net_->SetIds(same.data(), kExamples).ok());
  absl::StatusOr<Network::Result> again = net_->Evaluate(images_.data(), labels_.data(), kExamples);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->loss, r->loss);
  std::vector<uint64_t> other = ids_;
  for (int n = 0; n < kExamples; ++n) other[n * 4] += 1;
  ASSERT_TRUE(net_->SetIds(other.data(), kExamples).ok());
  absl::StatusOr<Network::Result> moved = net_->Evaluate(images_.data(), labels_.data(), kExamples);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_NE(moved->loss, r->loss);
}

TEST_F(EmbeddingNetworkTest, WithoutIdsOfTheBatchIsFailedPrecondition) {
  const float* x = images_.data();
  const int32_t* y = labels_.data();
  auto code = [](const absl::Status& s) { return s.code(); };
  EXPECT_EQ(code(net_->TrainStep(x, y, kExamples).status()), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(net_->Evaluate(x, y, kExamples).status()), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(net_->SetInputs(x, y, kExamples)), absl::StatusCode::kFailedPrecondition);
  absl::Status wrong_size = net_->SetInputs(x, y, 4);
  ASSERT_TRUE(net_->SetIds(ids_.data(), kExamples).ok());
  wrong_size = net_->SetInputs(x, y, 4);
  EXPECT_EQ(code(wrong_size), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong_size.message()), HasSubstr("a batch of 6, not 4"));
  // Ids serve one batch: the next needs its own.
  ASSERT_TRUE(net_->SetIds(ids_.data(), kExamples).ok());
  EXPECT_TRUE(net_->TrainStep(x, y, kExamples).ok());
  EXPECT_EQ(code(net_->TrainStep(x, y, kExamples).status()), absl::StatusCode::kFailedPrecondition);
  // SetInputs keeps them with its inputs for every StartTrainStep on them.
  ASSERT_TRUE(net_->SetIds(ids_.data(), kExamples).ok());
  ASSERT_TRUE(net_->SetInputs(x, y, kExamples).ok());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(net_->StartTrainStep(kExamples).ok());
    EXPECT_TRUE(net_->FinishStep(kExamples).ok());
  }
  EXPECT_EQ(code(net_->SetIds(ids_.data(), 0)), absl::StatusCode::kInvalidArgument);
}

// r1 is read by both c2 and proj, so the gradients of c1 and bn1 are right
// only if the network sums both contributions to r1's gradient (and `sum`
// passes its gradient to both of its operands); the checks below cover that.
TEST_F(ResidualNetworkTest, GradientsMatchFiniteDifferences) {
  ExpectGradientsMatchFiniteDifferences(spec_, *net_, weights_, images_, labels_, kBatch);
}

// The same on another batch and other weights, with standardized inputs.
TEST_F(ResidualNetworkTest, GradientsMatchFiniteDifferencesStandardized) {
  spec_.mutable_input()->set_mean(0.5f);
  spec_.mutable_input()->set_stddev(0.25f);
  std::unique_ptr<Network> net = MakeNetwork();
  ASSERT_NE(net, nullptr);
  std::vector<float> images;
  std::vector<int32_t> labels;
  RandomBatch(spec_, 5, 13, &images, &labels);
  ExpectGradientsMatchFiniteDifferences(spec_, *net, ResidualWeights(spec_, 6), images, labels, 5);
}

TEST_F(ResidualNetworkTest, TrainStepEqualsItsParts) {
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  absl::StatusOr<Network::Result> whole = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const Weights whole_grads = NetGradients(*net_);

  std::unique_ptr<Network> parts = MakeNetwork();
  ASSERT_NE(parts, nullptr);
  ASSERT_TRUE(SetNetWeights(*parts, weights_).ok());
  ASSERT_TRUE(parts->SetInputs(images_.data(), labels_.data(), kBatch).ok());
  // Inputs of another batch size are kept apart.
  std::vector<float> other_images;
  std::vector<int32_t> other_labels;
  RandomBatch(spec_, 3, 99, &other_images, &other_labels);
  ASSERT_TRUE(parts->SetInputs(other_images.data(), other_labels.data(), 3).ok());
  ASSERT_TRUE(parts->StartTrainStep(kBatch).ok());
  absl::StatusOr<Network::Result> finished = parts->FinishStep(kBatch);
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_GT(whole->loss, 0.0);
  EXPECT_EQ(finished->loss, whole->loss);
  EXPECT_EQ(finished->correct, whole->correct);
  const Weights part_grads = NetGradients(*parts);
  for (size_t v = 0; v < whole_grads.size(); ++v) {
    EXPECT_EQ(part_grads[v], whole_grads[v]) << net_->variables()[v].name;
  }

  // A second StartTrainStep reuses the inputs set before, with the weights
  // as they are now.
  Weights doubled = weights_;
  for (float& x : doubled.back()) x += 1.0f;  // fc/bias: shifts the logits
  doubled.back()[0] += 2.0f;
  ASSERT_TRUE(SetNetWeights(*parts, doubled).ok());
  ASSERT_TRUE(parts->StartTrainStep(kBatch).ok());
  absl::StatusOr<Network::Result> again = parts->FinishStep(kBatch);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(SetNetWeights(*net_, doubled).ok());
  absl::StatusOr<Network::Result> want = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(again->loss, want->loss);
  EXPECT_GT(std::abs(again->loss - whole->loss), 1e-3) << "the new weights were used";

  // The other batch size's step reads its own inputs.
  ASSERT_TRUE(parts->StartTrainStep(3).ok());
  absl::StatusOr<Network::Result> small = parts->FinishStep(3);
  ASSERT_TRUE(small.ok()) << small.status();
  absl::StatusOr<Network::Result> small_want =
      net_->TrainStep(other_images.data(), other_labels.data(), 3);
  ASSERT_TRUE(small_want.ok()) << small_want.status();
  EXPECT_EQ(small->loss, small_want->loss);
}

// The backward pass names each variable once, as its layer completes it,
// with its final gradient (or batch statistic) already in place: the fc's
// first (the last layer), the first conv's last.
TEST_F(ResidualNetworkTest, GradientsReadyNamesEachVariableOnceWithItsFinalValue) {
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  const std::vector<float*> grads = net_->HostGradients();
  ASSERT_EQ(grads.size(), net_->variables().size());
  std::vector<int> order;
  Weights at_ready(grads.size());
  net_->SetGradientsReady([&](absl::Span<const int> done) {
    for (int v : done) {
      order.push_back(v);
      at_ready[v].assign(grads[v], grads[v] + NumElements(net_->variables()[v].shape));
    }
  });
  ASSERT_TRUE(net_->TrainStep(images_.data(), labels_.data(), kBatch).ok());
  std::vector<int> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> all(grads.size());
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(sorted, all) << "each variable once";
  const int fc_weights = static_cast<int>(grads.size()) - 2;  // then its bias
  EXPECT_EQ(order, net_->BackwardOrder());
  EXPECT_EQ(order.front(), fc_weights);
  EXPECT_EQ(order.back(), 0) << "the first layer's comes last";
  const Weights final_grads = NetGradients(*net_);
  for (size_t v = 0; v < grads.size(); ++v) {
    EXPECT_EQ(at_ready[v], final_grads[v]) << net_->variables()[v].name;
  }
  // Cleared: not called again.
  net_->SetGradientsReady(nullptr);
  order.clear();
  ASSERT_TRUE(net_->TrainStep(images_.data(), labels_.data(), kBatch).ok());
  EXPECT_TRUE(order.empty());
}

TEST_F(ResidualNetworkTest, LocalSgdSubtractsTheScaledGradient) {
  constexpr float kRate = 0.1f;
  NetworkOptions options;
  options.local_sgd_learning_rate = kRate;
  std::unique_ptr<Network> sgd = MakeNetwork(options);
  ASSERT_NE(sgd, nullptr);
  ASSERT_TRUE(SetNetWeights(*sgd, weights_).ok());
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  absl::StatusOr<Network::Result> a = sgd->TrainStep(images_.data(), labels_.data(), kBatch);
  absl::StatusOr<Network::Result> b = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss, b->loss);
  const Weights grads = NetGradients(*net_);
  EXPECT_EQ(NetGradients(*sgd), grads) << "the gradients are still there to read";
  const Weights after = NetWeights(*sgd);
  EXPECT_EQ(NetWeights(*net_), weights_) << "no update without local SGD";
  int64_t moved = 0;
  const float m = options.local_bn_momentum;
  for (size_t v = 0; v < after.size(); ++v) {
    const bool trainable = net_->variables()[v].trainable;
    for (size_t i = 0; i < after[v].size(); ++i) {
      // w - lr * g in fp32, with or without a fused multiply-add; running
      // statistics r take (1 - m) r + m s instead, s the batch's statistic.
      const float kept = weights_[v][i] * (1 - m);
      const float plain =
          trainable ? weights_[v][i] - kRate * grads[v][i] : kept - -m * grads[v][i];
      const float fused = trainable ? std::fma(-kRate, grads[v][i], weights_[v][i])
                                    : std::fma(m, grads[v][i], kept);
      EXPECT_TRUE(after[v][i] == plain || after[v][i] == fused)
          << net_->variables()[v].name << "[" << i << "]: " << after[v][i] << " vs " << plain;
      if (after[v][i] != weights_[v][i]) ++moved;
    }
  }
  EXPECT_GT(moved, 100) << "most weights move";

  // The next step runs on the updated weights: the same as a plain network
  // given them.
  ASSERT_TRUE(SetNetWeights(*net_, after).ok());
  absl::StatusOr<Network::Result> a2 = sgd->TrainStep(images_.data(), labels_.data(), kBatch);
  absl::StatusOr<Network::Result> b2 = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(a2.ok() && b2.ok());
  EXPECT_EQ(a2->loss, b2->loss);
  EXPECT_LT(a2->loss, a->loss) << "a step down the gradient lowers the loss of the same batch";
}

TEST_F(ResidualNetworkTest, LabelsOutOfRangeAreInvalid) {
  for (int32_t bad : {-1, 3, 1000}) {
    std::vector<int32_t> labels = labels_;
    labels[kBatch - 1] = bad;
    absl::Status set = net_->SetInputs(images_.data(), labels.data(), kBatch);
    EXPECT_EQ(set.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(set.message()), HasSubstr(absl::StrCat("label ", bad))) << set;
    EXPECT_EQ(net_->TrainStep(images_.data(), labels.data(), kBatch).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(net_->Evaluate(images_.data(), labels.data(), kBatch).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Nothing was set, so no step can start.
  EXPECT_EQ(net_->StartTrainStep(kBatch).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(net_->SetInputs(images_.data(), labels_.data(), 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(net_->StartTrainStep(-1).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ResidualNetworkTest, StartTrainStepBeforeSetInputsFails) {
  absl::Status s = net_->StartTrainStep(kBatch);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  ASSERT_TRUE(net_->SetInputs(images_.data(), labels_.data(), kBatch).ok());
  // Inputs are per batch size.
  EXPECT_EQ(net_->StartTrainStep(4).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  EXPECT_TRUE(net_->StartTrainStep(kBatch).ok());
  absl::StatusOr<Network::Result> r = net_->FinishStep(kBatch);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->loss, 0.0);
}

TEST_F(ResidualNetworkTest, NoGraphsOnTheCpu) {
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  EXPECT_FALSE(net_->UsesGraph(kBatch));
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<Network::Result> r = net_->TrainStep(images_.data(), labels_.data(), kBatch);
    ASSERT_TRUE(r.ok()) << r.status();
    losses.push_back(r->loss);
    EXPECT_FALSE(net_->UsesGraph(kBatch)) << "step " << step;
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[0], losses[2]);
  ASSERT_TRUE(net_->Evaluate(images_.data(), labels_.data(), kBatch).ok());
  EXPECT_FALSE(net_->UsesGraph(kBatch));
  EXPECT_FALSE(net_->UsesGraph(3)) << "a batch size never run";
}

// Weights with running statistics of plausible size: means around 0, variances
// around 1 (as after some training), so that evaluation normalizes sensibly.
Weights WithRunningStatistics(const ModelSpec& spec, Weights w, uint32_t seed) {
  const std::vector<VariableShape> vars = ModelVariables(spec);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mean(-0.3f, 0.3f), var(0.5f, 2.0f);
  for (size_t v = 0; v < vars.size(); ++v) {
    const std::string kind = vars[v].name.substr(vars[v].name.find('/') + 1);
    if (kind == "running_mean") {
      for (float& x : w[v]) x = mean(rng);
    } else if (kind == "running_var") {
      for (float& x : w[v]) x = var(rng);
    }
  }
  return w;
}

// Evaluation normalizes with the running statistics, so the loss and the
// correct count over a set of examples do not depend on how they are
// batched: 100 examples in batches of 1, 7 (the last of 2) and 100 agree,
// and with the double-precision reference in inference mode. (With batch
// statistics, as evaluation had it before, a batch of one normalizes each
// example by itself.)
TEST_F(ResidualNetworkTest, EvaluationDoesNotDependOnTheBatchSize) {
  constexpr int kExamples = 100;
  std::vector<float> images;
  std::vector<int32_t> labels;
  RandomBatch(spec_, kExamples, 21, &images, &labels);
  const Weights w = WithRunningStatistics(spec_, weights_, 22);
  ASSERT_TRUE(SetNetWeights(*net_, w).ok());
  const int64_t per = net_->input_floats();
  struct Total {
    double loss = 0;
    int64_t correct = 0;
  };
  auto evaluate = [&](int batch) {
    Total t;
    for (int first = 0; first < kExamples; first += batch) {
      const int n = std::min(batch, kExamples - first);
      absl::StatusOr<Network::Result> r =
          net_->Evaluate(images.data() + first * per, labels.data() + first, n);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return t;
      t.loss += r->loss * n;
      t.correct += r->correct;
    }
    t.loss /= kExamples;
    return t;
  };
  const Total whole = evaluate(100), sevens = evaluate(7), ones = evaluate(1);
  EXPECT_NEAR(sevens.loss, whole.loss, 1e-5 * whole.loss);
  EXPECT_NEAR(ones.loss, whole.loss, 1e-5 * whole.loss);
  EXPECT_EQ(sevens.correct, whole.correct);
  EXPECT_EQ(ones.correct, whole.correct);
  const Reference ref(spec_);
  const double want =
      ref.Loss(ToDouble(w), images.data(), labels.data(), kExamples, nullptr, /*training=*/false);
  EXPECT_NEAR(whole.loss, want, 1e-5 * want);
  // The running statistics matter: the batch's own give another loss.
  const double with_batch_statistics =
      ref.Loss(ToDouble(w), images.data(), labels.data(), kExamples);
  EXPECT_GT(std::abs(with_batch_statistics - want), 1e-3);
}

// Training steps still normalize with the batch's statistics: the running
// statistics in the weights do not change a step's loss or gradients, and
// the step hands out the batch's mean and unbiased variance where the
// running statistics' gradients would be.
TEST_F(ResidualNetworkTest, TrainingNormalizesWithTheBatch) {
  ASSERT_TRUE(SetNetWeights(*net_, weights_).ok());
  absl::StatusOr<Network::Result> a = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(a.ok()) << a.status();
  const Weights grads_a = NetGradients(*net_);
  ASSERT_TRUE(SetNetWeights(*net_, WithRunningStatistics(spec_, weights_, 23)).ok());
  absl::StatusOr<Network::Result> b = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->loss, b->loss);
  EXPECT_EQ(NetGradients(*net_), grads_a);
  const Reference ref(spec_);
  WeightsD stats(weights_.size());
  const double want = ref.Loss(ToDouble(weights_), images_.data(), labels_.data(), kBatch, nullptr,
                               /*training=*/true, &stats);
  EXPECT_NEAR(a->loss, want, 1e-5 * want);
  int checked = 0;
  for (size_t v = 0; v < weights_.size(); ++v) {
    if (net_->variables()[v].trainable) continue;
    ++checked;
    ASSERT_EQ(grads_a[v].size(), stats[v].size());
    for (size_t i = 0; i < stats[v].size(); ++i) {
      EXPECT_NEAR(grads_a[v][i], stats[v][i], 1e-5 * (1 + std::abs(stats[v][i])))
          << net_->variables()[v].name << "[" << i << "]";
    }
  }
  EXPECT_EQ(checked, 6) << "three batch norms, two statistics each";
}

// Evaluation and training of the same batch size keep apart: an evaluation
// between two training steps changes neither, and vice versa.
TEST_F(ResidualNetworkTest, EvaluationAndTrainingOfOneBatchSizeKeepApart) {
  const Weights w = WithRunningStatistics(spec_, weights_, 24);
  ASSERT_TRUE(SetNetWeights(*net_, w).ok());
  absl::StatusOr<Network::Result> eval1 = net_->Evaluate(images_.data(), labels_.data(), kBatch);
  absl::StatusOr<Network::Result> train1 = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  const Weights grads = NetGradients(*net_);
  absl::StatusOr<Network::Result> eval2 = net_->Evaluate(images_.data(), labels_.data(), kBatch);
  EXPECT_EQ(NetGradients(*net_), grads) << "evaluation leaves the step's gradients alone";
  absl::StatusOr<Network::Result> train2 = net_->TrainStep(images_.data(), labels_.data(), kBatch);
  ASSERT_TRUE(eval1.ok() && train1.ok() && eval2.ok() && train2.ok());
  EXPECT_EQ(eval1->loss, eval2->loss);
  EXPECT_EQ(train1->loss, train2->loss);
  EXPECT_GT(std::abs(eval1->loss - train1->loss), 1e-4);
}

// What Evaluate allocates is what forward_memory() says: the fixed bytes at
// creation, then per_example bytes for each example of each batch size (and
// the 2 floats of the loss's statistics). The block input r1, read by c2 and
// by the shortcut, stays live across both paths, and the results are those
// of a training network, whose activations have buffers of their own.
TEST_F(ResidualNetworkTest, EvaluateAllocatesWhatForwardMemorySays) {
  kernels::WrappedBackend counting(backend_.get());
  NetworkOptions options;
  options.forward_only = true;
  absl::StatusOr<std::unique_ptr<Network>> fwd = Network::Create(spec_, &counting, options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const Network::ForwardMemory m = (*fwd)->forward_memory();
  EXPECT_EQ(counting.floats() * 4, m.fixed);
  const Weights w = WithRunningStatistics(spec_, weights_, 25);
  ASSERT_TRUE(SetNetWeights(**fwd, w).ok());
  ASSERT_TRUE(SetNetWeights(*net_, w).ok());
  int64_t before = counting.floats();
  for (int batch : {kBatch, 3}) {
    absl::StatusOr<Network::Result> got = (*fwd)->Evaluate(images_.data(), labels_.data(), batch);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ((counting.floats() - before) * 4, batch * m.per_example + 2 * 4) << "batch " << batch;
    before = counting.floats();
    absl::StatusOr<Network::Result> want = net_->Evaluate(images_.data(), labels_.data(), batch);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->loss, want->loss) << "batch " << batch;
    EXPECT_EQ(got->correct, want->correct) << "batch " << batch;
  }
  // Evaluating again takes nothing more.
  ASSERT_TRUE((*fwd)->Evaluate(images_.data(), labels_.data(), kBatch).ok());
  EXPECT_EQ(counting.floats(), before);
  // Shared buffers: far less than every activation of its own (1267 floats
  // per example with the input; 508 with the image, label and probabilities).
  EXPECT_EQ(m.per_example, 508 * 4);
}

}  // namespace
}  // namespace psflow::model
