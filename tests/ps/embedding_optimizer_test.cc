// The sharding rule and the sparse update rules of embedding tables, against
// numbers computed apart (the owners) and double-precision references written
// here from the published formulas.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/embedding/sharding.h"
#include "ps/embedding/sparse_optimizer.h"

namespace psflow::ps::embedding {
namespace {

using ::testing::HasSubstr;

TEST(ShardingTest, SplitMix64MatchesTheFinalizer) {
  // Values of the SplitMix64 finalizer computed apart (Python, mod 2^64).
  EXPECT_EQ(SplitMix64(0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(SplitMix64(1), 0x910A2DEC89025CC1ull);
  EXPECT_EQ(SplitMix64(42), 0xBDD732262FEB6E95ull);
  EXPECT_EQ(SplitMix64(~0ull), 0xE4D971771B652C20ull);
}

TEST(ShardingTest, DynamicOwnersArePinned) {
  Sharding two(0, 2), three(0, 3), seven(0, 7);
  EXPECT_FALSE(two.fixed());
  const uint64_t ids[] = {0, 1, 2, 42, 12345, 1ull << 63, ~0ull};
  const int want2[] = {1, 1, 0, 1, 0, 1, 0};
  const int want3[] = {1, 2, 1, 1, 2, 1, 2};
  const int want7[] = {2, 2, 4, 5, 5, 6, 0};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(two.Owner(ids[i]), want2[i]) << ids[i];
    EXPECT_EQ(three.Owner(ids[i]), want3[i]) << ids[i];
    EXPECT_EQ(seven.Owner(ids[i]), want7[i]) << ids[i];
  }
}

TEST(ShardingTest, FixedRowsGoRoundRobin) {
  Sharding s(10, 3);
  EXPECT_TRUE(s.fixed());
  EXPECT_EQ(s.Row(23), 3u);
  EXPECT_EQ(s.Owner(23), 0);
  EXPECT_EQ(s.LocalIndex(3), 1);
  EXPECT_EQ(s.Owner(8), 2);
  EXPECT_EQ(s.LocalIndex(8), 2);
  EXPECT_EQ(s.Row(~0ull), 5u);
  EXPECT_EQ(s.Owner(~0ull), 2);
  EXPECT_EQ(s.LocalRows(0), 4);  // rows 0 3 6 9
  EXPECT_EQ(s.LocalRows(1), 3);
  EXPECT_EQ(s.LocalRows(2), 3);
  EXPECT_EQ(Sharding(2, 3).LocalRows(2), 0);
}

SparseOptimizerConfig Config(SparseOptimizerConfig::Kind kind, float lr) {
  SparseOptimizerConfig c;
  c.set_kind(kind);
  c.set_learning_rate(lr);
  return c;
}

TEST(SparseOptimizerTest, ValidationNamesTheField) {
  auto bad = [](SparseOptimizerConfig c) { return ValidateSparseOptimizer(c); };
  EXPECT_TRUE(bad(Config(SparseOptimizerConfig::SGD, 0.1f)).ok());
  EXPECT_THAT(bad(Config(SparseOptimizerConfig::SGD, 0)).message(), HasSubstr("learning_rate"));
  EXPECT_THAT(bad(Config(SparseOptimizerConfig::SGD, NAN)).message(), HasSubstr("learning_rate"));
  SparseOptimizerConfig c = Config(SparseOptimizerConfig::LAZY_ADAM, 0.1f);
  c.set_beta1(1);
  EXPECT_THAT(bad(c).message(), HasSubstr("beta1"));
  c = Config(SparseOptimizerConfig::FTRL, 0.1f);
  c.set_l1(-1);
  EXPECT_THAT(bad(c).message(), HasSubstr("l1"));
  c = Config(SparseOptimizerConfig::FTRL, 0.1f);
  c.set_epsilon(-1);
  EXPECT_EQ(bad(c).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad(c).message(), HasSubstr("epsilon"));
  c = Config(static_cast<SparseOptimizerConfig::Kind>(9), 0.1f);
  EXPECT_THAT(bad(c).message(), HasSubstr("kind"));
  EXPECT_FALSE(SparseOptimizer::Create(c).ok());
}

TEST(SparseOptimizerTest, ParsesTableOptimizerNames) {
  EXPECT_EQ(*ParseSparseOptimizerKind("sgd"), SparseOptimizerConfig::SGD);
  EXPECT_EQ(*ParseSparseOptimizerKind("adagrad"), SparseOptimizerConfig::ROWWISE_ADAGRAD);
  EXPECT_EQ(*ParseSparseOptimizerKind("RowWise_Adagrad"), SparseOptimizerConfig::ROWWISE_ADAGRAD);
  EXPECT_EQ(*ParseSparseOptimizerKind("lazy_adam"), SparseOptimizerConfig::LAZY_ADAM);
  EXPECT_EQ(*ParseSparseOptimizerKind("ftrl"), SparseOptimizerConfig::FTRL);
  auto adam = ParseSparseOptimizerKind("adam");
  ASSERT_FALSE(adam.ok());
  EXPECT_EQ(adam.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(adam.status().message(), HasSubstr("lazy_adam"));
  EXPECT_THAT(adam.status().message(), HasSubstr("every row"));
  EXPECT_EQ(adam.status().message().find('\n'), absl::string_view::npos);
  EXPECT_THAT(ParseSparseOptimizerKind("momentum").status().message(), HasSubstr("is dense"));
  EXPECT_THAT(ParseSparseOptimizerKind("lbfgs").status().message(), HasSubstr("unknown"));
  EXPECT_EQ(SparseOptimizerName(SparseOptimizerConfig::FTRL), "ftrl");
}

// Runs `steps` updates of one row with the optimizer and returns the row.
std::vector<float> RunFloat(const SparseOptimizer& opt, int dim, std::vector<float> w,
                            const std::vector<std::vector<double>>& grads, int64_t first_step) {
  std::vector<float> slots(opt.SlotFloats(dim));
  opt.InitSlots(dim, slots.data());
  for (size_t k = 0; k < grads.size(); ++k) {
    std::vector<float> g(grads[k].begin(), grads[k].end());
    opt.ApplyRow(opt.StepAt(first_step + static_cast<int64_t>(k)), dim, g.data(), w.data(),
                 slots.data());
  }
  return w;
}

struct Case {
  int dim = 5;
  std::vector<double> w0;
  std::vector<std::vector<double>> grads;
};

Case MakeCase(int steps) {
  Case c;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int j = 0; j < c.dim; ++j) c.w0.push_back(u(rng));
  for (int k = 0; k < steps; ++k) {
    c.grads.emplace_back();
    for (int j = 0; j < c.dim; ++j) c.grads.back().push_back(u(rng));
  }
  return c;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < got.size(); ++j) {
    EXPECT_NEAR(got[j], want[j], 1e-5 * (1 + std::fabs(want[j]))) << "element " << j;
  }
}

std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }

TEST(SparseOptimizerTest, SgdMatchesReference) {
  Case c = MakeCase(6);
  auto opt = *SparseOptimizer::Create(Config(SparseOptimizerConfig::SGD, 0.3f));
  EXPECT_EQ(opt.SlotFloats(c.dim), 0);
  std::vector<double> w = c.w0;
  for (const auto& g : c.grads) {
    for (int j = 0; j < c.dim; ++j) w[j] -= 0.3 * g[j];
  }
  ExpectNear(RunFloat(opt, c.dim, ToFloat(c.w0), c.grads, 0), w);
}

TEST(SparseOptimizerTest, RowwiseAdagradMatchesReference) {
  Case c = MakeCase(6);
  SparseOptimizerConfig config = Config(SparseOptimizerConfig::ROWWISE_ADAGRAD, 0.2f);
  config.set_initial_accumulator(0.05f);
  auto opt = *SparseOptimizer::Create(config);
  EXPECT_EQ(opt.SlotFloats(c.dim), 1);
  EXPECT_FLOAT_EQ(opt.config().epsilon(), 1e-8f);
  std::vector<double> w = c.w0;
  double a = 0.05;
  for (const auto& g : c.grads) {
    double sq = 0;
    for (double x : g) sq += x * x;
    a += sq / c.dim;  // one accumulator per row: the mean square
    for (int j = 0; j < c.dim; ++j) w[j] -= 0.2 * g[j] / (std::sqrt(a) + 1e-8);
  }
  ExpectNear(RunFloat(opt, c.dim, ToFloat(c.w0), c.grads, 0), w);
}

TEST(SparseOptimizerTest, LazyAdamMatchesReferenceWithGlobalStep) {
  Case c = MakeCase(5);
  auto opt = *SparseOptimizer::Create(Config(SparseOptimizerConfig::LAZY_ADAM, 0.01f));
  EXPECT_EQ(opt.SlotFloats(c.dim), 2 * c.dim);
  // The row is first touched at global step 10: bias correction counts from
  // the global step, not the row's own updates (TF Addons' LazyAdam).
  const int64_t first = 10;
  std::vector<double> w = c.w0, m(c.dim, 0), v(c.dim, 0);
  const double b1 = 0.9, b2 = 0.999, eps = 1e-7;
  for (size_t k = 0; k < c.grads.size(); ++k) {
    const double t = static_cast<double>(first + k + 1);
    const double lr_t = 0.01 * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    for (int j = 0; j < c.dim; ++j) {
      const double g = c.grads[k][j];
      m[j] = b1 * m[j] + (1 - b1) * g;
      v[j] = b2 * v[j] + (1 - b2) * g * g;
      w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + eps);
    }
  }
  ExpectNear(RunFloat(opt, c.dim, ToFloat(c.w0), c.grads, first), w);
}

TEST(SparseOptimizerTest, FtrlMatchesTensorFlowApplyFtrl) {
  Case c = MakeCase(8);
  SparseOptimizerConfig config = Config(SparseOptimizerConfig::FTRL, 0.5f);
  config.set_l1(0.05f);
  config.set_l2(0.1f);
  auto opt = *SparseOptimizer::Create(config);
  EXPECT_FLOAT_EQ(opt.config().initial_accumulator(), 0.1f);
  const double lr = 0.5, l1 = 0.05, l2 = 0.1;
  std::vector<double> w = c.w0, n(c.dim, 0.1), z(c.dim, 0);
  for (const auto& grad : c.grads) {
    for (int j = 0; j < c.dim; ++j) {
      const double g = grad[j];
      const double n_new = n[j] + g * g;
      z[j] += g - (std::pow(n_new, 0.5) - std::pow(n[j], 0.5)) / lr * w[j];
      const double quadratic = std::pow(n_new, 0.5) / lr + 2 * l2;
      w[j] = std::fabs(z[j]) > l1 ? ((z[j] > 0 ? l1 : -l1) - z[j]) / quadratic : 0.0;
      n[j] = n_new;
    }
  }
  ExpectNear(RunFloat(opt, c.dim, ToFloat(c.w0), c.grads, 0), w);
}

}  // namespace
}  // namespace psflow::ps::embedding
