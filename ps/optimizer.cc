#include "ps/optimizer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kernels/optimizer_math.h"

namespace psflow::ps {
namespace {

// The loops below run over every weight of a shard each step. target_clones
// compiles each for AVX2 and for the baseline, picked at load time, so one
// binary runs everywhere and vectorizes wide where it can. Weight decay is
// always computed (as g + 0 * w when off): with finite weights the result is
// the same to the bit, and the loops stay branch-free. Each element's update
// is kernels/optimizer_math.h's, which the GPU replicas apply too.
#define PSFLOW_VECTOR_LOOP __attribute__((target_clones("avx2", "default")))
// Each output of these loops is its input itself or apart from every other
// array (ApplyStep's contract), so no iteration reads what another writes:
// the compiler may vectorize without checking how the arrays overlap (a
// rule with several slots has more pairs than it would check at run time,
// and an update in place would fail such a check and run scalar).
#if defined(__clang__)
#define PSFLOW_NO_LOOP_CARRIED _Pragma("clang loop vectorize(assume_safety)")
#else
#define PSFLOW_NO_LOOP_CARRIED _Pragma("GCC ivdep")
#endif

PSFLOW_VECTOR_LOOP void SgdLoop(float lr, float wd, const float* w, const float* g, float* out,
                                int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i];
    kernels::SgdElement(lr, wd, x, g[i]);
    out[i] = x;
  }
}

PSFLOW_VECTOR_LOOP void MomentumLoop(float lr, float mu, float wd, const float* w, const float* g,
                                     const float* buf, float* out, float* buf_out, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i], b = buf[i];
    kernels::MomentumElement(lr, mu, wd, x, g[i], b);
    out[i] = x;
    buf_out[i] = b;
  }
}

PSFLOW_VECTOR_LOOP void NesterovLoop(float lr, float mu, float wd, const float* w, const float* g,
                                     const float* buf, float* out, float* buf_out, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i], b = buf[i];
    kernels::NesterovElement(lr, mu, wd, x, g[i], b);
    out[i] = x;
    buf_out[i] = b;
  }
}

PSFLOW_VECTOR_LOOP void AdamLoop(float b1, float b2, float eps, float step_size, float inv_c2,
                                 float l2, float decay, const float* w, const float* g,
                                 const float* m, const float* v, float* out, float* m_out,
                                 float* v_out, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i], a = m[i], b = v[i];
    kernels::AdamElement(b1, b2, eps, step_size, inv_c2, l2, decay, x, g[i], a, b);
    out[i] = x;
    m_out[i] = a;
    v_out[i] = b;
  }
}

PSFLOW_VECTOR_LOOP void AdagradLoop(float lr, float eps, float wd, const float* w, const float* g,
                                    const float* sum, float* out, float* sum_out, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i], s = sum[i];
    kernels::AdagradElement(lr, eps, wd, x, g[i], s);
    out[i] = x;
    sum_out[i] = s;
  }
}

PSFLOW_VECTOR_LOOP void RmspropLoop(float lr, float alpha, float eps, float wd, const float* w,
                                    const float* g, const float* sq, float* out, float* sq_out,
                                    int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float x = w[i], s = sq[i];
    kernels::RmspropElement(lr, alpha, eps, wd, x, g[i], s);
    out[i] = x;
    sq_out[i] = s;
  }
}

PSFLOW_VECTOR_LOOP void MovingAverageLoop(float momentum, const float* r, const float* x,
                                          float* out, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) {
    float y = r[i];
    kernels::MovingAverageElement(momentum, y, x[i]);
    out[i] = y;
  }
}

constexpr float kDefaultDecayRate = 0.1f;

// config with the defaults filled in for the fields left at 0.
OptimizerConfig WithDefaults(OptimizerConfig c) {
  if (c.momentum() == 0) c.set_momentum(0.9f);
  if (c.beta1() == 0) c.set_beta1(0.9f);
  if (c.beta2() == 0) c.set_beta2(0.999f);
  if (c.epsilon() == 0) c.set_epsilon(c.kind() == OptimizerConfig::ADAGRAD ? 1e-10f : 1e-8f);
  if (c.alpha() == 0) c.set_alpha(0.99f);
  if (c.lr_decay_rate() == 0) c.set_lr_decay_rate(kDefaultDecayRate);
  return c;
}

// Holds the checked config; each kind's step is its rule at the step's rate.
class ConfiguredOptimizer : public Optimizer {
 public:
  explicit ConfiguredOptimizer(const OptimizerConfig& c) : c_(c) {}
  std::vector<std::string> SlotNames() const override { return Optimizer::SlotNames(c_.kind()); }

  kernels::OptimizerStep StepAt(int64_t step) const override {
    kernels::OptimizerStep s;
    s.lr = LearningRate(c_, step);
    s.wd = c_.weight_decay();
    s.eps = c_.epsilon();
    switch (c_.kind()) {
      case OptimizerConfig::MOMENTUM:
        // As torch.optim.SGD (dampening 0): buf = mu buf + g; w -= lr buf, or
        // w -= lr (g + mu buf) with nesterov; g includes weight_decay * w.
        s.rule =
            c_.nesterov() ? kernels::OptimizerStep::kNesterov : kernels::OptimizerStep::kMomentum;
        s.mu = c_.momentum();
        break;
      case OptimizerConfig::ADAM:
      case OptimizerConfig::ADAMW: {
        // As torch.optim.Adam: w -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps);
        // AdamW first multiplies w by 1 - lr * weight_decay, Adam adds it to g.
        s.rule = kernels::OptimizerStep::kAdam;
        s.b1 = c_.beta1();
        s.b2 = c_.beta2();
        const double t = static_cast<double>(step + 1);
        s.step_size = static_cast<float>(s.lr / (1.0 - std::pow(s.b1, t)));
        s.inv_c2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(s.b2, t)));
        const bool decoupled = c_.kind() == OptimizerConfig::ADAMW;
        s.l2 = decoupled ? 0.0f : c_.weight_decay();
        s.decay = decoupled ? 1.0f - s.lr * c_.weight_decay() : 1.0f;
        break;
      }
      case OptimizerConfig::ADAGRAD:
        // As torch.optim.Adagrad (lr_decay 0, initial_accumulator_value 0):
        // sum += g^2; w -= lr g / (sqrt(sum) + eps).
        s.rule = kernels::OptimizerStep::kAdagrad;
        break;
      case OptimizerConfig::RMSPROP:
        // As torch.optim.RMSprop (momentum 0, not centered):
        // sq = alpha sq + (1 - alpha) g^2; w -= lr g / (sqrt(sq) + eps).
        s.rule = kernels::OptimizerStep::kRmsprop;
        s.alpha = c_.alpha();
        break;
      default:  // SGD
        s.rule = kernels::OptimizerStep::kSgd;
        break;
    }
    return s;
  }

  void Apply(int64_t step, float* w, const float* g, int64_t n,
             const std::vector<float*>& slots) const override {
    ApplyStep(StepAt(step), w, g, n, slots, w, slots);
  }

 private:
  const OptimizerConfig c_;
};

absl::Status CheckSchedule(const OptimizerConfig& c) {
  if (c.lr_warmup_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr_warmup_steps must not be negative, got ", c.lr_warmup_steps()));
  }
  switch (c.lr_decay()) {
    case OptimizerConfig::CONSTANT:
      return absl::OkStatus();
    case OptimizerConfig::STEP:
    case OptimizerConfig::EXPONENTIAL:
      if (!(c.lr_decay_rate() > 0 && c.lr_decay_rate() <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lr_decay_rate must be in (0, 1], got ", c.lr_decay_rate()));
      }
      break;
    case OptimizerConfig::COSINE:
      if (!(c.lr_min() >= 0 && c.lr_min() <= c.learning_rate())) {
        return absl::InvalidArgumentError(absl::StrCat("lr_min must be in [0, learning_rate ",
                                                       c.learning_rate(), "], got ", c.lr_min()));
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown lr_decay ", c.lr_decay()));
  }
  if (c.lr_decay_steps() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr_decay_steps must be positive for lr_decay ",
                     absl::AsciiStrToLower(OptimizerConfig::Decay_Name(c.lr_decay())), ", got ",
                     c.lr_decay_steps()));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The passes of MeanInto. Adding to 0.0f is kept (it makes -0 into +0, as
// the sum into a zeroed buffer did); a scale of 1 changes nothing.
PSFLOW_VECTOR_LOOP void SumOneScaled(float* y, const float* a, float scale, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) y[i] = (0.0f + a[i]) * scale;
}

PSFLOW_VECTOR_LOOP void SumTwoScaled(float* y, const float* a, const float* b, float scale,
                                     int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) y[i] = ((0.0f + a[i]) + b[i]) * scale;
}

PSFLOW_VECTOR_LOOP void AddScaled(float* y, const float* x, float scale, int64_t n) {
  PSFLOW_NO_LOOP_CARRIED
  for (int64_t i = 0; i < n; ++i) y[i] = (y[i] + x[i]) * scale;
}

}  // namespace

void MeanInto(float* mean, absl::Span<const float* const> xs, float scale, int64_t n) {
  const size_t k = xs.size();
  if (k == 0) {
    std::fill(mean, mean + n, 0.0f * scale);
  } else if (k == 1) {
    SumOneScaled(mean, xs[0], scale, n);
  } else {
    SumTwoScaled(mean, xs[0], xs[1], k == 2 ? scale : 1.0f, n);
    for (size_t j = 2; j < k; ++j) AddScaled(mean, xs[j], j + 1 == k ? scale : 1.0f, n);
  }
}

void MovingAverageInto(float* r, const float* x, float momentum, int64_t n) {
  MovingAverageLoop(momentum, r, x, r, n);
}

void ApplyStep(const kernels::OptimizerStep& s, const float* w, const float* g, int64_t n,
               absl::Span<float* const> slots, float* out, absl::Span<float* const> slots_out) {
  float* const o = out;
  const absl::Span<float* const> so = slots_out;
  switch (s.rule) {
    case kernels::OptimizerStep::kSgd:
      SgdLoop(s.lr, s.wd, w, g, o, n);
      break;
    case kernels::OptimizerStep::kMomentum:
      MomentumLoop(s.lr, s.mu, s.wd, w, g, slots[0], o, so[0], n);
      break;
    case kernels::OptimizerStep::kNesterov:
      NesterovLoop(s.lr, s.mu, s.wd, w, g, slots[0], o, so[0], n);
      break;
    case kernels::OptimizerStep::kAdam:
      AdamLoop(s.b1, s.b2, s.eps, s.step_size, s.inv_c2, s.l2, s.decay, w, g, slots[0], slots[1], o,
               so[0], so[1], n);
      break;
    case kernels::OptimizerStep::kAdagrad:
      AdagradLoop(s.lr, s.eps, s.wd, w, g, slots[0], o, so[0], n);
      break;
    case kernels::OptimizerStep::kRmsprop:
      RmspropLoop(s.lr, s.alpha, s.eps, s.wd, w, g, slots[0], o, so[0], n);
      break;
    case kernels::OptimizerStep::kMovingAverage:
      MovingAverageLoop(s.mu, w, g, o, n);
      break;
  }
}

kernels::OptimizerStep MovingAverageStep(float momentum) {
  kernels::OptimizerStep s;
  s.rule = kernels::OptimizerStep::kMovingAverage;
  s.mu = momentum;
  return s;
}

absl::StatusOr<float> BnMomentum(const JobConfig& job) {
  const float m = job.bn_momentum();
  if (m == 0) return kDefaultBnMomentum;
  if (!(m > 0 && m <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("bn_momentum must be in (0, 1], got ", m));
  }
  return m;
}

float LearningRate(const OptimizerConfig& config, int64_t step) {
  const double lr = config.learning_rate();
  step = std::max<int64_t>(step, 0);
  const int64_t warmup = config.lr_warmup_steps();
  if (step < warmup) {
    return static_cast<float>(lr * static_cast<double>(step + 1) / static_cast<double>(warmup));
  }
  const int64_t t = step - std::max<int64_t>(warmup, 0);
  const int64_t n = config.lr_decay_steps();
  if (n <= 0) return static_cast<float>(lr);
  const double r = config.lr_decay_rate() == 0 ? kDefaultDecayRate : config.lr_decay_rate();
  switch (config.lr_decay()) {
    case OptimizerConfig::STEP:
      return static_cast<float>(lr * std::pow(r, static_cast<double>(t / n)));
    case OptimizerConfig::EXPONENTIAL:
      return static_cast<float>(lr * std::pow(r, static_cast<double>(t) / static_cast<double>(n)));
    case OptimizerConfig::COSINE: {
      const double lr_min = config.lr_min();
      const double progress = static_cast<double>(std::min(t, n)) / static_cast<double>(n);
      return static_cast<float>(lr_min + (lr - lr_min) * 0.5 * (1 + std::cos(M_PI * progress)));
    }
    default:  // CONSTANT
      return static_cast<float>(lr);
  }
}

std::vector<std::string> Optimizer::SlotNames(OptimizerConfig::Kind kind) {
  switch (kind) {
    case OptimizerConfig::MOMENTUM:
      return {"momentum"};
    case OptimizerConfig::ADAM:
    case OptimizerConfig::ADAMW:
      return {"m", "v"};
    case OptimizerConfig::ADAGRAD:
      return {"sum"};
    case OptimizerConfig::RMSPROP:
      return {"square_avg"};
    default:  // SGD, and kinds Create refuses
      return {};
  }
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config) {
  const OptimizerConfig c = WithDefaults(config);
  const float lr = c.learning_rate();
  if (!(lr > 0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("learning rate must be positive, got ", lr));
  }
  if (!(c.weight_decay() >= 0) || !std::isfinite(c.weight_decay())) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight_decay must be finite and not negative, got ", c.weight_decay()));
  }
  if (c.nesterov() && c.kind() != OptimizerConfig::MOMENTUM) {
    return absl::InvalidArgumentError("nesterov needs the momentum optimizer");
  }
  if (absl::Status s = CheckSchedule(c); !s.ok()) return s;
  switch (c.kind()) {
    case OptimizerConfig::SGD:
      return std::make_unique<ConfiguredOptimizer>(c);
    case OptimizerConfig::MOMENTUM:
      if (!(c.momentum() > 0 && c.momentum() < 1)) {
        return absl::InvalidArgumentError("momentum must be in (0, 1)");
      }
      return std::make_unique<ConfiguredOptimizer>(c);
    case OptimizerConfig::ADAM:
    case OptimizerConfig::ADAMW:
      if (!(c.beta1() > 0 && c.beta1() < 1 && c.beta2() > 0 && c.beta2() < 1 && c.epsilon() > 0)) {
        return absl::InvalidArgumentError("adam needs beta1, beta2 in (0, 1) and epsilon > 0");
      }
      return std::make_unique<ConfiguredOptimizer>(c);
    case OptimizerConfig::ADAGRAD:
      if (!(c.epsilon() > 0)) return absl::InvalidArgumentError("adagrad needs epsilon > 0");
      return std::make_unique<ConfiguredOptimizer>(c);
    case OptimizerConfig::RMSPROP:
      if (!(c.alpha() > 0 && c.alpha() < 1 && c.epsilon() > 0)) {
        return absl::InvalidArgumentError("rmsprop needs alpha in (0, 1) and epsilon > 0");
      }
      return std::make_unique<ConfiguredOptimizer>(c);
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown optimizer kind ", config.kind()));
  }
}

}  // namespace psflow::ps
