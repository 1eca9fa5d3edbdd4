#include "ps/optimizer.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace psflow::ps {
namespace {

// The loops below run over every weight of a shard each step. target_clones
// compiles each for AVX2 and for the baseline, picked at load time, so one
// binary runs everywhere and vectorizes wide where it can.
#define PSFLOW_VECTOR_LOOP __attribute__((target_clones("avx2", "default")))

PSFLOW_VECTOR_LOOP void SgdLoop(float lr, float* w, const float* g, int64_t n) {
  for (int64_t i = 0; i < n; ++i) w[i] -= lr * g[i];
}

PSFLOW_VECTOR_LOOP void MomentumLoop(float lr, float mu, float* w, const float* g, float* buf,
                                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = mu * buf[i] + g[i];
    w[i] -= lr * buf[i];
  }
}

PSFLOW_VECTOR_LOOP void AdamLoop(float b1, float b2, float eps, float step_size, float inv_c2,
                                 float* w, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    w[i] -= step_size * m[i] / (std::sqrt(v[i]) * inv_c2 + eps);
  }
}

class Sgd : public Optimizer {
 public:
  explicit Sgd(float lr) : lr_(lr) {}
  std::vector<std::string> SlotNames() const override {
    return Optimizer::SlotNames(OptimizerConfig::SGD);
  }
  void Apply(int64_t, float* w, const float* g, int64_t n,
             const std::vector<float*>&) const override {
    SgdLoop(lr_, w, g, n);
  }

 private:
  float lr_;
};

class Momentum : public Optimizer {
 public:
  Momentum(float lr, float mu) : lr_(lr), mu_(mu) {}
  std::vector<std::string> SlotNames() const override {
    return Optimizer::SlotNames(OptimizerConfig::MOMENTUM);
  }
  void Apply(int64_t, float* w, const float* g, int64_t n,
             const std::vector<float*>& slots) const override {
    MomentumLoop(lr_, mu_, w, g, slots[0], n);
  }

 private:
  float lr_, mu_;
};

class Adam : public Optimizer {
 public:
  Adam(float lr, float b1, float b2, float eps) : lr_(lr), b1_(b1), b2_(b2), eps_(eps) {}
  std::vector<std::string> SlotNames() const override {
    return Optimizer::SlotNames(OptimizerConfig::ADAM);
  }
  void Apply(int64_t step, float* w, const float* g, int64_t n,
             const std::vector<float*>& slots) const override {
    // As torch.optim.Adam: w -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps).
    const double t = static_cast<double>(step + 1);
    const float step_size = static_cast<float>(lr_ / (1.0 - std::pow(b1_, t)));
    const float inv_c2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(b2_, t)));
    AdamLoop(b1_, b2_, eps_, step_size, inv_c2, w, g, slots[0], slots[1], n);
  }

 private:
  float lr_, b1_, b2_, eps_;
};

}  // namespace

PSFLOW_VECTOR_LOOP void AddInto(float* sum, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] += x[i];
}

PSFLOW_VECTOR_LOOP void ScaleInPlace(float* x, float factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

std::vector<std::string> Optimizer::SlotNames(OptimizerConfig::Kind kind) {
  switch (kind) {
    case OptimizerConfig::MOMENTUM:
      return {"momentum"};
    case OptimizerConfig::ADAM:
      return {"m", "v"};
    default:  // SGD, and kinds Create refuses
      return {};
  }
}

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config) {
  const float lr = config.learning_rate();
  if (!(lr > 0) || !std::isfinite(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("learning rate must be positive, got ", lr));
  }
  switch (config.kind()) {
    case OptimizerConfig::SGD:
      return std::make_unique<Sgd>(lr);
    case OptimizerConfig::MOMENTUM: {
      float mu = config.momentum() == 0 ? 0.9f : config.momentum();
      if (!(mu > 0 && mu < 1)) return absl::InvalidArgumentError("momentum must be in (0, 1)");
      return std::make_unique<Momentum>(lr, mu);
    }
    case OptimizerConfig::ADAM: {
      float b1 = config.beta1() == 0 ? 0.9f : config.beta1();
      float b2 = config.beta2() == 0 ? 0.999f : config.beta2();
      float eps = config.epsilon() == 0 ? 1e-8f : config.epsilon();
      if (!(b1 > 0 && b1 < 1 && b2 > 0 && b2 < 1 && eps > 0)) {
        return absl::InvalidArgumentError("adam needs beta1, beta2 in (0, 1) and epsilon > 0");
      }
      return std::make_unique<Adam>(lr, b1, b2, eps);
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("unknown optimizer kind ", config.kind()));
  }
}

}  // namespace psflow::ps
