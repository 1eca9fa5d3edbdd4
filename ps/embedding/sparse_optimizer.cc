#include "ps/embedding/sparse_optimizer.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace psflow::ps::embedding {
namespace {

absl::Status BadField(absl::string_view field, absl::string_view want, float value) {
  return absl::InvalidArgumentError(
      absl::StrCat("SparseOptimizerConfig.", field, " must be ", want, ", got ", value));
}

absl::Status CheckNonNegative(absl::string_view field, float value) {
  if (std::isfinite(value) && value >= 0) return absl::OkStatus();
  return BadField(field, ">= 0 and finite", value);
}

void SgdRow(const SparseStep& s, int dim, const float* g, float* w) {
  for (int j = 0; j < dim; ++j) w[j] -= s.lr * g[j];
}

// FBGEMM's rowwise Adagrad: one accumulator for the row, the mean square of
// its gradient added each step.
void RowwiseAdagradRow(const SparseStep& s, int dim, const float* g, float* w, float* acc) {
  float sum = 0;
  for (int j = 0; j < dim; ++j) sum += g[j] * g[j];
  *acc += sum / static_cast<float>(dim);
  const float rate = s.lr / (std::sqrt(*acc) + s.eps);
  for (int j = 0; j < dim; ++j) w[j] -= rate * g[j];
}

void LazyAdamRow(const SparseStep& s, int dim, const float* g, float* w, float* m, float* v) {
  for (int j = 0; j < dim; ++j) {
    m[j] = s.b1 * m[j] + (1 - s.b1) * g[j];
    v[j] = s.b2 * v[j] + (1 - s.b2) * g[j] * g[j];
    w[j] -= s.adam_lr * m[j] / (std::sqrt(v[j]) + s.eps);
  }
}

// TensorFlow's ApplyFtrl with learning-rate power -0.5.
void FtrlRow(const SparseStep& s, int dim, const float* g, float* w, float* n, float* z) {
  for (int j = 0; j < dim; ++j) {
    const float n_new = n[j] + g[j] * g[j];
    const float sigma = (std::sqrt(n_new) - std::sqrt(n[j])) / s.lr;
    z[j] += g[j] - sigma * w[j];
    n[j] = n_new;
    const float quadratic = std::sqrt(n_new) / s.lr + 2 * s.l2;
    w[j] = std::fabs(z[j]) > s.l1 ? (std::copysign(s.l1, z[j]) - z[j]) / quadratic : 0.0f;
  }
}

}  // namespace

absl::Status ValidateSparseOptimizer(const SparseOptimizerConfig& config) {
  if (!SparseOptimizerConfig::Kind_IsValid(config.kind())) {
    return absl::InvalidArgumentError(
        absl::StrCat("SparseOptimizerConfig.kind ", static_cast<int>(config.kind()),
                     " is not a sparse optimizer (SGD, ROWWISE_ADAGRAD, LAZY_ADAM, FTRL)"));
  }
  const float lr = config.learning_rate();
  if (!(std::isfinite(lr) && lr > 0)) return BadField("learning_rate", "> 0 and finite", lr);
  if (auto s = CheckNonNegative("epsilon", config.epsilon()); !s.ok()) return s;
  if (auto s = CheckNonNegative("initial_accumulator", config.initial_accumulator()); !s.ok()) {
    return s;
  }
  if (!(config.beta1() >= 0 && config.beta1() < 1))
    return BadField("beta1", "in [0, 1)", config.beta1());
  if (!(config.beta2() >= 0 && config.beta2() < 1))
    return BadField("beta2", "in [0, 1)", config.beta2());
  if (auto s = CheckNonNegative("l1", config.l1()); !s.ok()) return s;
  return CheckNonNegative("l2", config.l2());
}

absl::StatusOr<SparseOptimizerConfig::Kind> ParseSparseOptimizerKind(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "sgd") return SparseOptimizerConfig::SGD;
  if (lower == "adagrad" || lower == "rowwise_adagrad")
    return SparseOptimizerConfig::ROWWISE_ADAGRAD;
  if (lower == "lazy_adam") return SparseOptimizerConfig::LAZY_ADAM;
  if (lower == "ftrl") return SparseOptimizerConfig::FTRL;
  constexpr absl::string_view kChoices =
      "embedding tables take sgd, rowwise_adagrad (adagrad), lazy_adam or ftrl";
  if (lower == "adam" || lower == "adamw") {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer \"", name, "\" is dense: ", kChoices,
        " (dense Adam would move every row's moments each step; lazy_adam moves only the rows "
        "a batch touches)"));
  }
  if (lower == "momentum" || lower == "nesterov" || lower == "rmsprop") {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer \"", name, "\" is dense: ", kChoices,
        " (a dense rule would move every row's state each step, not only the rows a batch "
        "touches)"));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown optimizer \"", name, "\": ", kChoices));
}

absl::string_view SparseOptimizerName(SparseOptimizerConfig::Kind kind) {
  switch (kind) {
    case SparseOptimizerConfig::SGD:
      return "sgd";
    case SparseOptimizerConfig::ROWWISE_ADAGRAD:
      return "rowwise_adagrad";
    case SparseOptimizerConfig::LAZY_ADAM:
      return "lazy_adam";
    case SparseOptimizerConfig::FTRL:
      return "ftrl";
    default:
      return "unknown";
  }
}

absl::StatusOr<SparseOptimizer> SparseOptimizer::Create(const SparseOptimizerConfig& config) {
  if (auto s = ValidateSparseOptimizer(config); !s.ok()) return s;
  SparseOptimizerConfig c = config;
  const auto kind = c.kind();
  if (c.epsilon() == 0) c.set_epsilon(kind == SparseOptimizerConfig::LAZY_ADAM ? 1e-7f : 1e-8f);
  if (c.initial_accumulator() == 0 && kind == SparseOptimizerConfig::FTRL) {
    c.set_initial_accumulator(0.1f);
  }
  if (c.beta1() == 0) c.set_beta1(0.9f);
  if (c.beta2() == 0) c.set_beta2(0.999f);
  return SparseOptimizer(std::move(c));
}

int SparseOptimizer::SlotFloats(int dim) const {
  switch (kind()) {
    case SparseOptimizerConfig::ROWWISE_ADAGRAD:
      return 1;
    case SparseOptimizerConfig::LAZY_ADAM:
    case SparseOptimizerConfig::FTRL:
      return 2 * dim;
    default:
      return 0;
  }
}

void SparseOptimizer::InitSlots(int dim, float* slots) const {
  const int n = SlotFloats(dim);
  for (int j = 0; j < n; ++j) slots[j] = 0;
  if (kind() == SparseOptimizerConfig::ROWWISE_ADAGRAD) slots[0] = config_.initial_accumulator();
  if (kind() == SparseOptimizerConfig::FTRL) {
    for (int j = 0; j < dim; ++j) slots[j] = config_.initial_accumulator();
  }
}

SparseStep SparseOptimizer::StepAt(int64_t step) const {
  SparseStep s;
  s.lr = config_.learning_rate();
  s.eps = config_.epsilon();
  s.b1 = config_.beta1();
  s.b2 = config_.beta2();
  s.l1 = config_.l1();
  s.l2 = config_.l2();
  const double t = static_cast<double>(step) + 1;
  s.adam_lr = static_cast<float>(s.lr * std::sqrt(1 - std::pow(double{s.b2}, t)) /
                                 (1 - std::pow(double{s.b1}, t)));
  return s;
}

void SparseOptimizer::ApplyRow(const SparseStep& s, int dim, const float* g, float* w,
                               float* slots) const {
  switch (kind()) {
    case SparseOptimizerConfig::ROWWISE_ADAGRAD:
      return RowwiseAdagradRow(s, dim, g, w, slots);
    case SparseOptimizerConfig::LAZY_ADAM:
      return LazyAdamRow(s, dim, g, w, slots, slots + dim);
    case SparseOptimizerConfig::FTRL:
      return FtrlRow(s, dim, g, w, slots, slots + dim);
    default:
      return SgdRow(s, dim, g, w);
  }
}

}  // namespace psflow::ps::embedding
