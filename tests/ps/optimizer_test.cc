#include "ps/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"

namespace psflow::ps {
namespace {

using ::testing::HasSubstr;

// ---- Learning-rate schedules ----

OptimizerConfig Schedule(OptimizerConfig::Decay decay, int64_t warmup, int64_t decay_steps,
                         float rate = 0, float lr_min = 0) {
  OptimizerConfig c;
  c.set_learning_rate(0.1f);
  c.set_lr_decay(decay);
  c.set_lr_warmup_steps(warmup);
  c.set_lr_decay_steps(decay_steps);
  c.set_lr_decay_rate(rate);
  c.set_lr_min(lr_min);
  return c;
}

void ExpectRates(const OptimizerConfig& c, const std::vector<std::pair<int64_t, double>>& want) {
  ASSERT_TRUE(Optimizer::Create(c).ok()) << Optimizer::Create(c).status();
  for (const auto& [step, lr] : want) {
    EXPECT_NEAR(LearningRate(c, step), lr, 1e-6 * lr + 1e-12) << "step " << step;
  }
}

TEST(LearningRateTest, ConstantByDefault) {
  OptimizerConfig c;
  c.set_learning_rate(0.1f);
  ExpectRates(c, {{0, 0.1}, {1, 0.1}, {1000000, 0.1}});
}

TEST(LearningRateTest, LinearWarmupReachesTheRateAtItsLastStep) {
  // lr * (step + 1) / W for step < W, as torch's LinearLR(start_factor=1/W, total_iters=W-1).
  ExpectRates(Schedule(OptimizerConfig::CONSTANT, 4, 0),
              {{0, 0.025}, {1, 0.05}, {2, 0.075}, {3, 0.1}, {4, 0.1}, {99, 0.1}});
}

TEST(LearningRateTest, StepDecay) {
  // lr * r^floor(t / N), as torch's StepLR(step_size=N, gamma=r).
  ExpectRates(
      Schedule(OptimizerConfig::STEP, 0, 3, 0.5f),
      {{0, 0.1}, {2, 0.1}, {3, 0.05}, {5, 0.05}, {6, 0.025}, {30, 0.1 * std::pow(0.5, 10)}});
  // The rate defaults to 0.1; the decay counts from the end of the warmup.
  ExpectRates(Schedule(OptimizerConfig::STEP, 2, 3),
              {{0, 0.05}, {1, 0.1}, {2, 0.1}, {4, 0.1}, {5, 0.1 * 0.1}, {8, 0.1 * 0.01}});
}

TEST(LearningRateTest, ExponentialDecay) {
  // lr * r^(t / N), as tf.train.exponential_decay (staircase=False).
  const double r = 0.5f;
  ExpectRates(
      Schedule(OptimizerConfig::EXPONENTIAL, 0, 3, 0.5f),
      {{0, 0.1}, {1, 0.1 * std::pow(r, 1.0 / 3)}, {3, 0.05}, {10, 0.1 * std::pow(r, 10.0 / 3)}});
}

TEST(LearningRateTest, CosineDecayAfterWarmup) {
  // lr_min + (lr - lr_min) (1 + cos(pi t / N)) / 2, as torch's
  // CosineAnnealingLR(T_max=N, eta_min), then lr_min for t > N.
  const double lr = 0.1f, lr_min = 0.01f;
  auto cosine = [&](double t) {
    return lr_min + (lr - lr_min) * (1 + std::cos(M_PI * t / 10)) / 2;
  };
  ExpectRates(Schedule(OptimizerConfig::COSINE, 2, 10, 0, 0.01f), {{0, 0.05},
                                                                   {1, 0.1},
                                                                   {2, 0.1},
                                                                   {3, cosine(1)},
                                                                   {7, 0.055},
                                                                   {11, cosine(9)},
                                                                   {12, 0.01},
                                                                   {1000, 0.01}});
  ExpectRates(Schedule(OptimizerConfig::COSINE, 0, 4), {{0, 0.1}, {2, 0.05}, {4, 0}, {5, 0}});
}

TEST(LearningRateTest, ScheduleRefusals) {
  auto refused = [](OptimizerConfig c, const std::string& words) {
    absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(c);
    ASSERT_FALSE(opt.ok()) << c.ShortDebugString();
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(opt.status().message()), HasSubstr(words));
  };
  refused(Schedule(OptimizerConfig::CONSTANT, -1, 0), "lr_warmup_steps must not be negative");
  for (auto decay :
       {OptimizerConfig::STEP, OptimizerConfig::EXPONENTIAL, OptimizerConfig::COSINE}) {
    refused(Schedule(decay, 0, 0), "lr_decay_steps must be positive");
    refused(Schedule(decay, 0, -5), "lr_decay_steps must be positive");
  }
  refused(Schedule(OptimizerConfig::STEP, 0, 3, 1.5f), "lr_decay_rate must be in (0, 1]");
  refused(Schedule(OptimizerConfig::EXPONENTIAL, 0, 3, -0.5f), "lr_decay_rate must be in (0, 1]");
  refused(Schedule(OptimizerConfig::EXPONENTIAL, 0, 3, std::nanf("")),
          "lr_decay_rate must be in (0, 1]");
  refused(Schedule(OptimizerConfig::COSINE, 0, 3, 0, 0.5f), "lr_min must be in [0, learning_rate");
  refused(Schedule(OptimizerConfig::COSINE, 0, 3, 0, -0.01f), "lr_min must be in [0");
  refused(Schedule(static_cast<OptimizerConfig::Decay>(9), 0, 3), "unknown lr_decay 9");
  // Fields a schedule does not use are not checked.
  EXPECT_TRUE(Optimizer::Create(Schedule(OptimizerConfig::CONSTANT, 0, -3, 7, 9)).ok());
}

// ---- Optimizers against double-precision references ----

// The hyper-parameters as the optimizer sees them (floats), in double.
struct Hyper {
  OptimizerConfig c;
  double lr(int64_t step) const {  // the schedule, from its formulas
    const double base = c.learning_rate();
    if (step < c.lr_warmup_steps()) return base * (step + 1) / c.lr_warmup_steps();
    const double t = static_cast<double>(step - c.lr_warmup_steps());
    const double n = static_cast<double>(c.lr_decay_steps());
    switch (c.lr_decay()) {
      case OptimizerConfig::STEP:
        return base * std::pow(c.lr_decay_rate(), std::floor(t / n));
      case OptimizerConfig::EXPONENTIAL:
        return base * std::pow(c.lr_decay_rate(), t / n);
      case OptimizerConfig::COSINE:
        return c.lr_min() + (base - c.lr_min()) * (1 + std::cos(M_PI * std::min(t, n) / n)) / 2;
      default:
        return base;
    }
  }
};

// One weight's state in the reference: the weight and up to two slots.
struct RefState {
  double w = 0, s0 = 0, s1 = 0;
};

// torch.optim's update rules (the pseudo-code of their documentation) for
// step `step` (0-based; t = step + 1), in double.
void ReferenceStep(const Hyper& h, int64_t step, double grad, RefState* st) {
  const OptimizerConfig& c = h.c;
  const double lr = h.lr(step), wd = c.weight_decay(), eps = c.epsilon();
  const double t = static_cast<double>(step + 1);
  double g = grad;
  if (c.kind() != OptimizerConfig::ADAMW) g += wd * st->w;
  switch (c.kind()) {
    case OptimizerConfig::SGD:
      st->w -= lr * g;
      break;
    case OptimizerConfig::MOMENTUM: {
      const double mu = c.momentum();
      st->s0 = step == 0 ? g : mu * st->s0 + g;  // torch: buf = clone(g) at first
      st->w -= lr * (c.nesterov() ? g + mu * st->s0 : st->s0);
      break;
    }
    case OptimizerConfig::ADAMW:
      st->w -= lr * wd * st->w;
      [[fallthrough]];
    case OptimizerConfig::ADAM: {
      const double b1 = c.beta1(), b2 = c.beta2();
      st->s0 = b1 * st->s0 + (1 - b1) * g;
      st->s1 = b2 * st->s1 + (1 - b2) * g * g;
      const double m_hat = st->s0 / (1 - std::pow(b1, t));
      const double v_hat = st->s1 / (1 - std::pow(b2, t));
      st->w -= lr * m_hat / (std::sqrt(v_hat) + eps);
      break;
    }
    case OptimizerConfig::ADAGRAD:  // lr_decay 0: clr = lr
      st->s0 += g * g;
      st->w -= lr * g / (std::sqrt(st->s0) + eps);
      break;
    case OptimizerConfig::RMSPROP: {
      const double alpha = c.alpha();
      st->s0 = alpha * st->s0 + (1 - alpha) * g * g;
      st->w -= lr * g / (std::sqrt(st->s0) + eps);
      break;
    }
    default:
      FAIL() << "no reference for " << c.kind();
  }
}

// Runs `config` over 37 weights (a vector body and a tail) for `steps` steps
// of random gradients and compares weights and slots with the reference.
// `defaults` is config with the defaults the optimizer is expected to fill.
void ExpectMatchesReference(const OptimizerConfig& config, const OptimizerConfig& defaults,
                            const std::vector<std::string>& slot_names, int steps = 6) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(config);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_EQ((*opt)->SlotNames(), slot_names);
  constexpr int kN = 37;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> weight(-1.5f, 1.5f), gradient(-2.0f, 2.0f);
  std::vector<float> w(kN), g(kN);
  std::vector<std::vector<float>> slots(slot_names.size(), std::vector<float>(kN, 0.0f));
  std::vector<float*> slot_ptrs;
  for (auto& s : slots) slot_ptrs.push_back(s.data());
  std::vector<RefState> ref(kN);
  for (int i = 0; i < kN; ++i) ref[i].w = w[i] = weight(rng);
  // The same steps through a kernels backend (what a GPU replica of a job
  // without ps applies, here on the CPU backend): StepAt's rule, elementwise.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> cpu = kernels::CreateBackend("cpu", 1);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> bw = w;
  std::vector<std::vector<float>> bslots = slots;
  bslots.resize(2, std::vector<float>(kN, 0.0f));
  const Hyper h{defaults};
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < kN; ++i) g[i] = gradient(rng);
    (*opt)->Apply(step, w.data(), g.data(), kN, slot_ptrs);
    const kernels::OptimizerStep rule = (*opt)->StepAt(step);
    ASSERT_EQ(rule.slots(), static_cast<int>(slot_names.size()));
    // As two tensors (and an empty one): the batch applies each.
    std::vector<kernels::OptimizerTensor> tensors;
    for (const auto& [first, n] : {std::pair{0, 20}, std::pair{20, 0}, std::pair{20, kN - 20}}) {
      tensors.push_back({bw.data() + first, g.data() + first,
                         rule.slots() > 0 ? bslots[0].data() + first : nullptr,
                         rule.slots() > 1 ? bslots[1].data() + first : nullptr, n});
    }
    ASSERT_TRUE((*cpu)->ApplyOptimizer(rule, tensors).ok());
    for (int i = 0; i < kN; ++i) {
      ReferenceStep(h, step, g[i], &ref[i]);
      const double want[] = {ref[i].w, ref[i].s0, ref[i].s1};
      const double got[] = {w[i], slots.size() > 0 ? slots[0][i] : 0.0,
                            slots.size() > 1 ? slots[1][i] : 0.0};
      const double backend[] = {bw[i], slots.size() > 0 ? bslots[0][i] : 0.0,
                                slots.size() > 1 ? bslots[1][i] : 0.0};
      for (int k = 0; k < 3; ++k) {
        ASSERT_NEAR(got[k], want[k], 1e-6 * std::max(std::abs(want[k]), 1.0))
            << config.ShortDebugString() << ": step " << step << " element " << i
            << (k == 0 ? " weight" : absl::StrCat(" slot ", k - 1));
        ASSERT_NEAR(backend[k], want[k], 1e-6 * std::max(std::abs(want[k]), 1.0))
            << "backend: " << config.ShortDebugString() << ": step " << step << " element " << i
            << (k == 0 ? " weight" : absl::StrCat(" slot ", k - 1));
      }
    }
  }
}

// The mean of the workers' gradients is bit for bit what a buffer filled
// with zeros, each gradient added in turn and then scaled gives (the order a
// determinism test of the whole job relies on), for any number of them, with
// signed zeros, NaNs, infinities and values whose sum depends on the order.
TEST(MeanIntoTest, MatchesZeroFillAddEachThenScaleBitForBit) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1e3f, 1e3f);
  const int64_t n = 1037;  // not a multiple of any vector width
  for (int k = 0; k <= 5; ++k) {
    SCOPED_TRACE(absl::StrCat(k, " gradients"));
    std::vector<std::vector<float>> grads(k, std::vector<float>(n));
    for (auto& g : grads) {
      for (float& x : g) x = uniform(rng) * std::pow(10.0f, static_cast<float>(rng() % 12) - 6);
      g[0] = -0.0f;
      g[1] = 1e30f;
      g[2] = -1e30f;
    }
    if (k > 0) {
      grads[0][3] = std::numeric_limits<float>::quiet_NaN();
      grads[k - 1][4] = std::numeric_limits<float>::infinity();
    }
    const float scale = k == 0 ? 1.0f : 1.0f / static_cast<float>(k);
    std::vector<float> want(n, 0.0f);
    for (const auto& g : grads) {
      for (int64_t i = 0; i < n; ++i) want[i] += g[i];
    }
    for (float& x : want) x *= scale;
    std::vector<const float*> xs;
    for (const auto& g : grads) xs.push_back(g.data());
    std::vector<float> got(n, 123.0f);
    MeanInto(got.data(), xs, scale, n);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t a, b;
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &want[i], 4);
      ASSERT_EQ(a, b) << "element " << i << ": " << got[i] << " against " << want[i];
    }
  }
}

// With outputs apart from the inputs, every rule writes there exactly the
// weights and slots an update in place gives, and leaves the weights and
// slots it read as they were (the ps reads one version's published weights
// and slots and writes the next version's elsewhere).
TEST(ApplyStepTest, OutputsGetTheUpdatedWeightsAndSlotsAndTheInputsStay) {
  std::vector<kernels::OptimizerStep> rules;
  for (OptimizerConfig::Kind kind :
       {OptimizerConfig::SGD, OptimizerConfig::MOMENTUM, OptimizerConfig::ADAM,
        OptimizerConfig::ADAMW, OptimizerConfig::ADAGRAD, OptimizerConfig::RMSPROP}) {
    for (bool nesterov : {false, true}) {
      if (nesterov && kind != OptimizerConfig::MOMENTUM) continue;
      OptimizerConfig c;
      c.set_kind(kind);
      c.set_learning_rate(0.01f);
      c.set_weight_decay(0.001f);
      c.set_nesterov(nesterov);
      absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(c);
      ASSERT_TRUE(opt.ok()) << opt.status();
      rules.push_back((*opt)->StepAt(3));
    }
  }
  rules.push_back(MovingAverageStep(0.3f));
  constexpr int64_t kN = 37;  // a vector body and a tail
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  };
  for (const kernels::OptimizerStep& rule : rules) {
    SCOPED_TRACE(static_cast<int>(rule.rule));
    std::vector<float> w(kN), g(kN);
    for (float& x : w) x = uniform(rng);
    for (float& x : g) x = uniform(rng);
    std::vector<std::vector<float>> slots(2, std::vector<float>(kN));
    for (auto& s : slots) {
      for (float& x : s) x = std::abs(uniform(rng));
    }
    const std::vector<float> before = w;
    std::vector<float> w2 = w, out(kN, -123.0f);
    std::vector<std::vector<float>> slots2 = slots;
    const std::vector<std::vector<float>> slots_before = slots;
    std::vector<std::vector<float>> slots_out(2, std::vector<float>(kN, -123.0f));
    ApplyStep(rule, w.data(), g.data(), kN, {slots[0].data(), slots[1].data()}, w.data(),
              {slots[0].data(), slots[1].data()});
    ApplyStep(rule, w2.data(), g.data(), kN, {slots2[0].data(), slots2[1].data()}, out.data(),
              {slots_out[0].data(), slots_out[1].data()});
    EXPECT_NE(bits(w), bits(before));
    EXPECT_EQ(bits(w2), bits(before));
    EXPECT_EQ(bits(out), bits(w));
    // Slots the rule has are written out; those it has not stay untouched.
    const size_t used = rule.rule == kernels::OptimizerStep::kAdam ? 2
                        : rule.rule == kernels::OptimizerStep::kSgd ||
                                rule.rule == kernels::OptimizerStep::kMovingAverage
                            ? 0
                            : 1;
    for (size_t k = 0; k < 2; ++k) {
      SCOPED_TRACE(k);
      EXPECT_EQ(bits(slots2[k]), bits(slots_before[k])) << "slots read were written";
      if (k < used) {
        EXPECT_NE(bits(slots[k]), bits(slots_before[k]));
        EXPECT_EQ(bits(slots_out[k]), bits(slots[k]));
      } else {
        EXPECT_EQ(bits(slots[k]), bits(slots_before[k]));
        EXPECT_EQ(slots_out[k], std::vector<float>(kN, -123.0f));
      }
    }
  }
}

// The running statistics' rule, and the backend's count of non-finite values.
TEST(OptimizerBackendTest, MovingAverageAndNonFiniteCount) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> cpu = kernels::CreateBackend("cpu", 1);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> r = {1, 2, 4}, x = {2, 2, 0};
  std::vector<float> want = r;
  MovingAverageInto(want.data(), x.data(), 0.25f, 3);
  ASSERT_TRUE(
      (*cpu)
          ->ApplyOptimizer(MovingAverageStep(0.25f), {{r.data(), x.data(), nullptr, nullptr, 3}})
          .ok());
  EXPECT_EQ(r, want);
  EXPECT_EQ(r, (std::vector<float>{1.25f, 2, 3}));
  // A rule with slots refuses to run without them, naming the tensor, and
  // touches none of the batch.
  OptimizerConfig momentum;
  momentum.set_kind(OptimizerConfig::MOMENTUM);
  momentum.set_learning_rate(0.1f);
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(momentum);
  ASSERT_TRUE(opt.ok());
  std::vector<float> slot(3, 0.0f);
  const absl::Status refused = (*cpu)->ApplyOptimizer(
      (*opt)->StepAt(0),
      {{r.data(), x.data(), slot.data(), nullptr, 3}, {r.data(), x.data(), nullptr, nullptr, 3}});
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_THAT(refused.message(), ::testing::HasSubstr("tensor 1: the rule needs its slot buffers"));
  EXPECT_EQ(r, want);
  EXPECT_TRUE(absl::IsInvalidArgument((*cpu)->ApplyOptimizer(
      MovingAverageStep(0.25f), {{r.data(), x.data(), nullptr, nullptr, -1}})));
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> values = {1, std::nanf(""), -inf, 0, inf, 3};
  float count = 1;  // added to
  // Two spans and an empty one: every value counted once.
  ASSERT_TRUE(
      (*cpu)
          ->CountNonFinite({absl::MakeConstSpan(values.data(), 2), absl::Span<const float>(),
                            absl::MakeConstSpan(values.data() + 2, 4)},
                           &count)
          .ok());
  EXPECT_EQ(count, 4);
  EXPECT_TRUE(absl::IsInvalidArgument((*cpu)->CountNonFinite({}, nullptr)));
  // The global norm of gradients that stay on the device (clipping), over
  // every span: 3-4-5.
  const std::vector<float> g = {3, 0, -4};
  float norm = -1, scratch[kernels::Backend::kGlobalNormScratch];
  ASSERT_TRUE((*cpu)
                  ->GlobalNorm({absl::MakeConstSpan(g.data(), 1), absl::Span<const float>(),
                                absl::MakeConstSpan(g.data() + 1, 2)},
                               scratch, &norm)
                  .ok());
  EXPECT_EQ(norm, 5.0f);
  EXPECT_TRUE(absl::IsInvalidArgument((*cpu)->GlobalNorm({}, scratch, nullptr)));
}

OptimizerConfig Config(OptimizerConfig::Kind kind, float lr, float weight_decay = 0) {
  OptimizerConfig c;
  c.set_kind(kind);
  c.set_learning_rate(lr);
  c.set_weight_decay(weight_decay);
  return c;
}

TEST(OptimizerReferenceTest, Sgd) {
  const OptimizerConfig c = Config(OptimizerConfig::SGD, 0.1f);
  ExpectMatchesReference(c, c, {});
}

TEST(OptimizerReferenceTest, SgdWithWeightDecay) {
  const OptimizerConfig c = Config(OptimizerConfig::SGD, 0.1f, 0.05f);
  ExpectMatchesReference(c, c, {});
}

TEST(OptimizerReferenceTest, Momentum) {
  OptimizerConfig c = Config(OptimizerConfig::MOMENTUM, 0.05f, 0.01f);
  OptimizerConfig d = c;
  d.set_momentum(0.9f);  // the default
  ExpectMatchesReference(c, d, {"momentum"});
  c.set_momentum(0.5f);
  ExpectMatchesReference(c, c, {"momentum"});
}

TEST(OptimizerReferenceTest, Nesterov) {
  OptimizerConfig c = Config(OptimizerConfig::MOMENTUM, 0.05f);
  c.set_momentum(0.8f);
  c.set_nesterov(true);
  ExpectMatchesReference(c, c, {"momentum"});
  c.set_weight_decay(0.02f);
  ExpectMatchesReference(c, c, {"momentum"});
}

TEST(OptimizerReferenceTest, NesterovByHand) {
  // torch.optim.SGD(lr=0.1, momentum=0.9, nesterov=True) on w=1, g=1, 0.5:
  // buf 1, w = 1 - 0.1 (1 + 0.9) = 0.81; buf 1.4, w = 0.81 - 0.1 (0.5 + 1.26) = 0.634.
  OptimizerConfig c = Config(OptimizerConfig::MOMENTUM, 0.1f);
  c.set_nesterov(true);
  std::unique_ptr<Optimizer> opt = *Optimizer::Create(c);
  float w = 1, buf = 0;
  const float g[] = {1, 0.5f};
  opt->Apply(0, &w, &g[0], 1, {&buf});
  EXPECT_NEAR(w, 0.81, 1e-6);
  opt->Apply(1, &w, &g[1], 1, {&buf});
  EXPECT_NEAR(w, 0.634, 1e-6);
  EXPECT_NEAR(buf, 1.4, 1e-6);
}

TEST(OptimizerReferenceTest, Adam) {
  OptimizerConfig c = Config(OptimizerConfig::ADAM, 0.01f);
  OptimizerConfig d = c;
  d.set_beta1(0.9f);
  d.set_beta2(0.999f);
  d.set_epsilon(1e-8f);
  ExpectMatchesReference(c, d, {"m", "v"});
  c.set_weight_decay(0.1f);  // L2, added to the gradient
  d.set_weight_decay(0.1f);
  ExpectMatchesReference(c, d, {"m", "v"});
}

TEST(OptimizerReferenceTest, AdamW) {
  OptimizerConfig c = Config(OptimizerConfig::ADAMW, 0.01f, 0.1f);
  c.set_beta1(0.8f);
  c.set_beta2(0.99f);
  c.set_epsilon(1e-6f);
  ExpectMatchesReference(c, c, {"m", "v"});
}

TEST(OptimizerReferenceTest, AdamWByHand) {
  // torch.optim.AdamW(lr=0.1, weight_decay=0.5) on w=2, g=1: w = 2 (1 - 0.05) = 1.9,
  // then the first Adam step moves it by lr * sign(g) (1 - 1e-8 / (1 + 1e-8) aside).
  std::unique_ptr<Optimizer> opt = *Optimizer::Create(Config(OptimizerConfig::ADAMW, 0.1f, 0.5f));
  float w = 2, m = 0, v = 0, g = 1;
  opt->Apply(0, &w, &g, 1, {&m, &v});
  EXPECT_NEAR(w, 1.8, 1e-6);
}

TEST(OptimizerReferenceTest, Adagrad) {
  OptimizerConfig c = Config(OptimizerConfig::ADAGRAD, 0.1f);
  OptimizerConfig d = c;
  d.set_epsilon(1e-10f);
  ExpectMatchesReference(c, d, {"sum"});
  c.set_weight_decay(0.05f);
  d.set_weight_decay(0.05f);
  ExpectMatchesReference(c, d, {"sum"});
}

TEST(OptimizerReferenceTest, Rmsprop) {
  OptimizerConfig c = Config(OptimizerConfig::RMSPROP, 0.01f);
  OptimizerConfig d = c;
  d.set_alpha(0.99f);
  d.set_epsilon(1e-8f);
  ExpectMatchesReference(c, d, {"square_avg"});
  c.set_alpha(0.9f);
  c.set_weight_decay(0.05f);
  d.set_alpha(0.9f);
  d.set_weight_decay(0.05f);
  ExpectMatchesReference(c, d, {"square_avg"});
}

TEST(OptimizerReferenceTest, EveryOptimizerFollowsTheSchedule) {
  for (auto kind : {OptimizerConfig::SGD, OptimizerConfig::MOMENTUM, OptimizerConfig::ADAM,
                    OptimizerConfig::ADAMW, OptimizerConfig::ADAGRAD, OptimizerConfig::RMSPROP}) {
    OptimizerConfig c = Config(kind, 0.02f, 0.01f);
    c.set_lr_warmup_steps(3);
    c.set_lr_decay(OptimizerConfig::COSINE);
    c.set_lr_decay_steps(5);
    c.set_lr_min(0.001f);
    OptimizerConfig d = c;
    d.set_momentum(0.9f);
    d.set_beta1(0.9f);
    d.set_beta2(0.999f);
    d.set_epsilon(kind == OptimizerConfig::ADAGRAD ? 1e-10f : 1e-8f);
    d.set_alpha(0.99f);
    ExpectMatchesReference(c, d, Optimizer::SlotNames(kind), 10);
    c.set_lr_decay(OptimizerConfig::STEP);
    c.set_lr_decay_rate(0.5f);
    d.set_lr_decay(OptimizerConfig::STEP);
    d.set_lr_decay_rate(0.5f);
    ExpectMatchesReference(c, d, Optimizer::SlotNames(kind), 10);
  }
}

TEST(OptimizerTest, SlotNames) {
  EXPECT_EQ(Optimizer::SlotNames(OptimizerConfig::ADAMW), (std::vector<std::string>{"m", "v"}));
  EXPECT_EQ(Optimizer::SlotNames(OptimizerConfig::ADAGRAD), (std::vector<std::string>{"sum"}));
  EXPECT_EQ(Optimizer::SlotNames(OptimizerConfig::RMSPROP),
            (std::vector<std::string>{"square_avg"}));
}

TEST(OptimizerTest, RefusesBadHyperParameters) {
  auto refused = [](OptimizerConfig c, const std::string& words) {
    absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(c);
    ASSERT_FALSE(opt.ok()) << c.ShortDebugString();
    EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(opt.status().message()), HasSubstr(words));
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float wd : {-0.1f, nan, inf}) {
    refused(Config(OptimizerConfig::SGD, 0.1f, wd), "weight_decay must be finite and not negative");
    refused(Config(OptimizerConfig::ADAMW, 0.1f, wd), "weight_decay");
  }
  for (auto kind : {OptimizerConfig::SGD, OptimizerConfig::ADAM, OptimizerConfig::RMSPROP}) {
    OptimizerConfig c = Config(kind, 0.1f);
    c.set_nesterov(true);
    refused(c, "nesterov needs the momentum optimizer");
  }
  OptimizerConfig c = Config(OptimizerConfig::ADAMW, 0.1f);
  c.set_beta2(1.0f);
  refused(c, "adam needs beta1, beta2 in (0, 1)");
  c = Config(OptimizerConfig::ADAGRAD, 0.1f);
  c.set_epsilon(-1e-10f);
  refused(c, "adagrad needs epsilon > 0");
  c = Config(OptimizerConfig::RMSPROP, 0.1f);
  c.set_alpha(1.0f);
  refused(c, "rmsprop needs alpha in (0, 1)");
  c.set_alpha(-0.5f);
  refused(c, "rmsprop needs alpha in (0, 1)");
  c.set_alpha(0.9f);
  c.set_epsilon(nan);
  refused(c, "rmsprop needs alpha in (0, 1) and epsilon > 0");
}

}  // namespace
}  // namespace psflow::ps
