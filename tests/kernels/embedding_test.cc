// Tests of the embedding plan (kernels/embedding_plan.h) against a naive
// reference, and of the CPU backend's EmbeddingBag: forward against the
// combiners computed straight from the bags, backward against the naive sum
// and finite differences, bit-identical results across runs and thread
// counts, and the errors.
#include "kernels/embedding_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/kernels.h"
#include "tests/kernels/embedding_testing.h"
#include "tests/kernels/status_testing.h"

namespace psflow::kernels {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;

// ------------------------------------------------------------ references

// A bag's combiner scale, in double, by TensorFlow's definitions.
double Scale(const OwnedBags& f, int64_t begin, int64_t end) {
  double sum = 0, squares = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double w = f.weights.empty() ? 1.0 : f.weights[i];
    sum += w;
    squares += w * w;
  }
  switch (f.combiner) {
    case Combiner::kSum:
      return 1.0;
    case Combiner::kMean:
      return sum > 0 ? 1.0 / sum : 0.0;
    case Combiner::kSqrtN:
      return squares > 0 ? 1.0 / std::sqrt(squares) : 0.0;
  }
  return 0.0;
}

double Weight(const OwnedBags& f, int64_t i) { return f.weights.empty() ? 1.0 : f.weights[i]; }

// The plan's maps, built the slow way: unique ids by linear search, each
// row's occurrences by scanning every bag.
struct NaivePlan {
  std::vector<uint64_t> unique;
  std::vector<std::vector<std::pair<int32_t, double>>> forward, backward;
};

NaivePlan BuildNaive(int batch, const std::vector<OwnedBags>& features) {
  NaivePlan p;
  for (const OwnedBags& f : features) {
    for (int b = 0; b < batch; ++b) {
      std::vector<std::pair<int32_t, double>> bag;
      const double scale = Scale(f, f.offsets[b], f.offsets[b + 1]);
      for (int64_t i = f.offsets[b]; i < f.offsets[b + 1]; ++i) {
        auto it = std::find(p.unique.begin(), p.unique.end(), f.ids[i]);
        if (it == p.unique.end()) it = p.unique.insert(p.unique.end(), f.ids[i]);
        bag.emplace_back(static_cast<int32_t>(it - p.unique.begin()), Weight(f, i) * scale);
      }
      p.forward.push_back(bag);
    }
  }
  p.backward.resize(p.unique.size());
  for (size_t u = 0; u < p.unique.size(); ++u) {
    for (size_t g = 0; g < p.forward.size(); ++g) {
      for (const auto& [row, coef] : p.forward[g]) {
        if (row == static_cast<int32_t>(u)) p.backward[u].emplace_back(g, coef);
      }
    }
  }
  return p;
}

// One CSR map of the plan against the naive lists.
void ExpectMap(const std::vector<int32_t>& offsets, const std::vector<int32_t>& index,
               const std::vector<float>& coefs,
               const std::vector<std::vector<std::pair<int32_t, double>>>& want,
               const std::string& what) {
  ASSERT_EQ(offsets.size(), want.size() + 1) << what;
  EXPECT_EQ(offsets[0], 0) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(offsets[i + 1] - offsets[i], static_cast<int32_t>(want[i].size()))
        << what << " " << i;
    for (size_t k = 0; k < want[i].size(); ++k) {
      const int32_t at = offsets[i] + static_cast<int32_t>(k);
      EXPECT_EQ(index[at], want[i][k].first) << what << " " << i << "." << k;
      EXPECT_FLOAT_EQ(coefs[at], static_cast<float>(want[i][k].second))
          << what << " " << i << "." << k;
    }
  }
}

void ExpectPlanMatchesNaive(int batch, const std::vector<OwnedBags>& features) {
  const auto views = Views(features);
  const absl::StatusOr<EmbeddingPlan> plan = BuildEmbeddingPlan(batch, views);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const NaivePlan want = BuildNaive(batch, features);
  EXPECT_EQ(plan->batch, batch);
  EXPECT_EQ(plan->features, static_cast<int32_t>(features.size()));
  EXPECT_EQ(plan->unique_ids, want.unique);
  ExpectMap(plan->bag_offsets, plan->bag_rows, plan->bag_coefs, want.forward, "forward");
  ExpectMap(plan->row_offsets, plan->row_bags, plan->row_coefs, want.backward, "backward");
  PSFLOW_ASSERT_OK(CheckEmbeddingPlan(*plan));
}

// out [bags, dim] straight from the bags and TableValue, in double.
std::vector<double> NaiveForward(int batch, const std::vector<OwnedBags>& features, int64_t dim) {
  std::vector<double> out(features.size() * batch * dim, 0.0);
  for (size_t f = 0; f < features.size(); ++f) {
    const OwnedBags& bags = features[f];
    for (int b = 0; b < batch; ++b) {
      const double scale = Scale(bags, bags.offsets[b], bags.offsets[b + 1]);
      double* o = out.data() + (f * batch + b) * dim;
      for (int64_t i = bags.offsets[b]; i < bags.offsets[b + 1]; ++i) {
        for (int64_t j = 0; j < dim; ++j)
          o[j] += Weight(bags, i) * scale * TableValue(bags.ids[i], j);
      }
    }
  }
  return out;
}

// The gradient of each id's row for the bags' gradients dy, in double.
std::map<uint64_t, std::vector<double>> NaiveBackward(int batch,
                                                      const std::vector<OwnedBags>& features,
                                                      const std::vector<float>& dy, int64_t dim) {
  std::map<uint64_t, std::vector<double>> grads;
  for (size_t f = 0; f < features.size(); ++f) {
    const OwnedBags& bags = features[f];
    for (int b = 0; b < batch; ++b) {
      const double scale = Scale(bags, bags.offsets[b], bags.offsets[b + 1]);
      const float* g = dy.data() + (f * batch + b) * dim;
      for (int64_t i = bags.offsets[b]; i < bags.offsets[b + 1]; ++i) {
        std::vector<double>& row = grads[bags.ids[i]];
        row.resize(dim, 0.0);
        for (int64_t j = 0; j < dim; ++j) row[j] += Weight(bags, i) * scale * g[j];
      }
    }
  }
  return grads;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want,
                const std::string& what, double rtol = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= rtol * (1 + std::abs(want[i]))) && ++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

std::vector<OwnedBags> MixedFeatures(std::mt19937& gen, int batch, int max_len, uint64_t vocab) {
  return {RandomBags(gen, batch, max_len, vocab, Combiner::kSum, false),
          RandomBags(gen, batch, max_len, vocab, Combiner::kMean, true),
          RandomBags(gen, batch, max_len, vocab, Combiner::kSqrtN, true),
          RandomBags(gen, batch, max_len, vocab, Combiner::kMean, false),
          RandomBags(gen, batch, max_len, vocab, Combiner::kSqrtN, false),
          RandomBags(gen, batch, max_len, vocab, Combiner::kSum, true)};
}

// ------------------------------------------------------------ the plan

TEST(EmbeddingPlanTest, SmallCaseByHand) {
  // Feature 0 (SUM): {10, 20}, {}, {20, 20, 30}. Feature 1 (MEAN, weighted):
  // {30 w1, 40 w3}, {10 w2}, {}.
  OwnedBags a{{0, 2, 2, 5}, {10, 20, 20, 20, 30}, {}, Combiner::kSum};
  OwnedBags b{{0, 2, 3, 3}, {30, 40, 10}, {1, 3, 2}, Combiner::kMean};
  const std::vector<OwnedBags> features = {a, b};
  const absl::StatusOr<EmbeddingPlan> plan = BuildEmbeddingPlan(3, Views(features));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->unique_ids, ElementsAre(10, 20, 30, 40));
  EXPECT_EQ(plan->bags(), 6);
  EXPECT_THAT(plan->bag_offsets, ElementsAre(0, 2, 2, 5, 7, 8, 8));
  EXPECT_THAT(plan->bag_rows, ElementsAre(0, 1, 1, 1, 2, 2, 3, 0));
  EXPECT_THAT(plan->bag_coefs, ElementsAre(1, 1, 1, 1, 1, 0.25f, 0.75f, 1));
  EXPECT_THAT(plan->row_offsets, ElementsAre(0, 2, 5, 7, 8));
  EXPECT_THAT(plan->row_bags, ElementsAre(0, 4, 0, 2, 2, 2, 3, 3));
  EXPECT_THAT(plan->row_coefs, ElementsAre(1, 1, 1, 1, 1, 1, 0.25f, 0.75f));
}

TEST(EmbeddingPlanTest, SqrtNAndZeroWeights) {
  // SQRTN: weights 3 and 4 scale by 1/5; four unweighted ids by 1/2.
  OwnedBags s{{0, 2, 6}, {1, 2, 3, 4, 5, 6}, {3, 4, 1, 1, 1, 1}, Combiner::kSqrtN};
  // MEAN over weights that are all zero: zeros, like an empty bag.
  OwnedBags m{{0, 2, 2}, {1, 7}, {0, 0}, Combiner::kMean};
  const std::vector<OwnedBags> features = {s, m};
  const absl::StatusOr<EmbeddingPlan> plan = BuildEmbeddingPlan(2, Views(features));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->bag_coefs, ElementsAre(0.6f, 0.8f, 0.5f, 0.5f, 0.5f, 0.5f, 0, 0));
  EXPECT_THAT(plan->unique_ids, ElementsAre(1, 2, 3, 4, 5, 6, 7));
}

TEST(EmbeddingPlanTest, RandomFeaturesSharingATableMatchTheNaivePlan) {
  std::mt19937 gen(7);
  for (const auto& [batch, max_len, vocab] :
       {std::tuple{1, 3, uint64_t{5}}, std::tuple{8, 6, uint64_t{20}},
        std::tuple{64, 10, uint64_t{500}}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch << " vocab " << vocab);
    ASSERT_NO_FATAL_FAILURE(
        ExpectPlanMatchesNaive(batch, MixedFeatures(gen, batch, max_len, vocab)));
  }
}

TEST(EmbeddingPlanTest, AllBagsEmpty) {
  OwnedBags f{{0, 0, 0}, {}, {}, Combiner::kMean};
  const absl::StatusOr<EmbeddingPlan> plan = BuildEmbeddingPlan(2, Views({f}));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->unique(), 0);
  EXPECT_THAT(plan->bag_offsets, ElementsAre(0, 0, 0));
  EXPECT_THAT(plan->row_offsets, ElementsAre(0));
  EXPECT_TRUE(CheckEmbeddingPlan(*plan).ok());
}

TEST(EmbeddingPlanTest, RebuildingReusesThePlanAndForgetsTheOldBatch) {
  std::mt19937 gen(11);
  const std::vector<OwnedBags> big = MixedFeatures(gen, 32, 8, 100);
  const std::vector<OwnedBags> small = {RandomBags(gen, 4, 3, 10, Combiner::kMean, true)};
  EmbeddingPlan plan;
  PSFLOW_ASSERT_OK(BuildEmbeddingPlan(32, Views(big), &plan));
  PSFLOW_ASSERT_OK(BuildEmbeddingPlan(4, Views(small), &plan));
  const absl::StatusOr<EmbeddingPlan> fresh = BuildEmbeddingPlan(4, Views(small));
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(plan.unique_ids, fresh->unique_ids);
  EXPECT_EQ(plan.bag_offsets, fresh->bag_offsets);
  EXPECT_EQ(plan.bag_rows, fresh->bag_rows);
  EXPECT_EQ(plan.bag_coefs, fresh->bag_coefs);
  EXPECT_EQ(plan.row_offsets, fresh->row_offsets);
  EXPECT_EQ(plan.row_bags, fresh->row_bags);
  EXPECT_EQ(plan.row_coefs, fresh->row_coefs);
}

// INVALID_ARGUMENT, one line, containing `want`.
void ExpectRefused(int batch, const std::vector<OwnedBags>& features, const std::string& want) {
  const absl::StatusOr<EmbeddingPlan> plan = BuildEmbeddingPlan(batch, Views(features));
  ASSERT_FALSE(plan.ok()) << want;
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  EXPECT_THAT(plan.status().message(), HasSubstr(want));
  EXPECT_THAT(std::string(plan.status().message()), Not(HasSubstr("\n")));
}

TEST(EmbeddingPlanTest, RefusesBadBags) {
  const OwnedBags good{{0, 1, 2}, {5, 6}, {}, Combiner::kSum};
  ExpectRefused(0, {good}, "batch 0 is not positive");
  ExpectRefused(2, {}, "no features");
  ExpectRefused(3, {good}, "feature 0: 3 offsets for a batch of 3 (want 4)");
  ExpectRefused(2, {good, {{1, 1, 2}, {5, 6}, {}, Combiner::kSum}},
                "feature 1: offsets start at 1, not 0");
  ExpectRefused(2, {{{0, 2, 1}, {5, 6}, {}, Combiner::kSum}}, "offset 2 (1) is below offset 1 (2)");
  ExpectRefused(2, {{{0, 1, 3}, {5, 6}, {}, Combiner::kSum}},
                "offsets end at 3 but there are 2 ids");
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {1}, Combiner::kSum}}, "1 weights for 2 ids");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {1, nan}, Combiner::kSum}}, "weight 1 is nan");
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {inf, 1}, Combiner::kSqrtN}}, "weight 0 is inf");
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {1, -1}, Combiner::kMean}},
                "weight 1 is -1, which MEAN cannot take");
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {-2, 1}, Combiner::kSqrtN}},
                "weight 0 is -2, which SQRTN cannot take");
  ExpectRefused(2, {{{0, 1, 2}, {5, 6}, {}, static_cast<Combiner>(7)}}, "unknown combiner 7");
  // SUM takes negative weights.
  EXPECT_TRUE(BuildEmbeddingPlan(2, Views({{{0, 1, 2}, {5, 6}, {-1, 2}, Combiner::kSum}})).ok());
}

TEST(EmbeddingPlanTest, CheckFindsInconsistentPlans) {
  std::mt19937 gen(3);
  const std::vector<OwnedBags> features = MixedFeatures(gen, 8, 4, 30);
  const EmbeddingPlan good = BuildEmbeddingPlan(8, Views(features)).value();
  auto expect_bad = [](const EmbeddingPlan& plan, const std::string& want) {
    const absl::Status s = CheckEmbeddingPlan(plan);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(want));
  };
  EmbeddingPlan p = good;
  p.bag_rows[3] = static_cast<int32_t>(p.unique());
  expect_bad(p, "forward map: index 3 is");
  p = good;
  p.row_bags.back() = -1;
  expect_bad(p, "backward map: index");
  p = good;
  p.bag_offsets[2] = p.bag_offsets[1] - 1;
  expect_bad(p, "forward map: offset 2 is below offset 1");
  p = good;
  p.row_coefs[0] = std::numeric_limits<float>::infinity();
  expect_bad(p, "coefficient 0 is inf");
  p = good;
  p.batch += 1;
  expect_bad(p, "offsets for");
  p = good;
  p.row_bags.pop_back();
  expect_bad(p, "occurrences forward but");
}

// ------------------------------------------------------------ the CPU op

class CpuEmbeddingBagTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = CpuBackend::Create().value(); }

  // Runs Forward, then Backward of dy, on a fresh op of `backend`.
  static void Run(Backend& backend, const EmbeddingPlan& plan, int64_t dim,
                  const std::vector<float>& rows, const std::vector<float>& dy,
                  std::vector<float>& out, std::vector<float>& row_grads) {
    auto op = backend.CreateEmbeddingBag(dim);
    ASSERT_TRUE(op.ok()) << op.status();
    PSFLOW_ASSERT_OK((*op)->SetPlan(plan));
    out.assign(plan.bags() * dim, std::numeric_limits<float>::quiet_NaN());
    row_grads.assign(plan.unique() * dim, std::numeric_limits<float>::quiet_NaN());
    PSFLOW_ASSERT_OK((*op)->Forward(rows.data(), out.data()));
    PSFLOW_ASSERT_OK((*op)->Backward(dy.data(), row_grads.data()));
  }

  std::unique_ptr<CpuBackend> backend_;
};

TEST_F(CpuEmbeddingBagTest, ForwardAndBackwardMatchTheNaiveSums) {
  std::mt19937 gen(21);
  for (const auto& [batch, dim] :
       {std::pair{5, int64_t{1}}, std::pair{16, int64_t{7}}, std::pair{64, int64_t{32}}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch << " dim " << dim);
    const std::vector<OwnedBags> features = MixedFeatures(gen, batch, 6, 50);
    const EmbeddingPlan plan = BuildEmbeddingPlan(batch, Views(features)).value();
    std::vector<float> dy(plan.bags() * dim);
    std::uniform_real_distribution<float> dist(-1, 1);
    for (float& v : dy) v = dist(gen);
    std::vector<float> out, row_grads;
    ASSERT_NO_FATAL_FAILURE(Run(*backend_, plan, dim, TableRows(plan, dim), dy, out, row_grads));
    ExpectNear(out, NaiveForward(batch, features, dim), "out");
    const auto grads = NaiveBackward(batch, features, dy, dim);
    ASSERT_EQ(grads.size(), plan.unique_ids.size());
    std::vector<double> want;
    for (uint64_t id : plan.unique_ids) {
      ASSERT_TRUE(grads.count(id)) << id;
      want.insert(want.end(), grads.at(id).begin(), grads.at(id).end());
    }
    ExpectNear(row_grads, want, "row_grads");
  }
}

// Backward is the gradient of Forward: for L = 0.5 * sum(out^2), dy = out,
// against central differences of L in each row value.
TEST_F(CpuEmbeddingBagTest, BackwardMatchesFiniteDifferences) {
  std::mt19937 gen(5);
  const int batch = 4;
  const int64_t dim = 3;
  const std::vector<OwnedBags> features = {RandomBags(gen, batch, 4, 6, Combiner::kMean, true),
                                           RandomBags(gen, batch, 4, 6, Combiner::kSqrtN, false),
                                           RandomBags(gen, batch, 4, 6, Combiner::kSum, true)};
  const EmbeddingPlan plan = BuildEmbeddingPlan(batch, Views(features)).value();
  auto op = backend_->CreateEmbeddingBag(dim).value();
  PSFLOW_ASSERT_OK(op->SetPlan(plan));
  std::vector<float> rows = TableRows(plan, dim), out(plan.bags() * dim);
  auto loss = [&]() {
    EXPECT_TRUE(op->Forward(rows.data(), out.data()).ok());
    double l = 0;
    for (float v : out) l += 0.5 * double{v} * v;
    return l;
  };
  loss();
  const std::vector<float> dy = out;
  std::vector<float> row_grads(plan.unique() * dim);
  PSFLOW_ASSERT_OK(op->Backward(dy.data(), row_grads.data()));
  const float eps = 1e-2f;
  for (size_t i = 0; i < rows.size(); ++i) {
    const float keep = rows[i];
    rows[i] = keep + eps;
    const double up = loss();
    rows[i] = keep - eps;
    const double down = loss();
    rows[i] = keep;
    const double numeric = (up - down) / (2.0 * eps);
    EXPECT_NEAR(row_grads[i], numeric, 2e-3 * (1 + std::abs(numeric))) << "row value " << i;
  }
}

TEST_F(CpuEmbeddingBagTest, BitIdenticalAcrossRunsAndThreadCounts) {
  std::mt19937 gen(9);
  const int batch = 256;
  const int64_t dim = 64;  // large enough for the loops to run on several threads
  const std::vector<OwnedBags> features = MixedFeatures(gen, batch, 10, 2000);
  const EmbeddingPlan plan = BuildEmbeddingPlan(batch, Views(features)).value();
  std::vector<float> dy(plan.bags() * dim);
  std::uniform_real_distribution<float> dist(-1, 1);
  for (float& v : dy) v = dist(gen);
  const std::vector<float> rows = TableRows(plan, dim);
  std::vector<float> out1, grads1;
  ASSERT_NO_FATAL_FAILURE(Run(*backend_, plan, dim, rows, dy, out1, grads1));
  for (int threads : {1, 2, 3, 4}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    auto backend = CpuBackend::Create(threads).value();
    std::vector<float> out, grads;
    ASSERT_NO_FATAL_FAILURE(Run(*backend, plan, dim, rows, dy, out, grads));
    ASSERT_EQ(out.size(), out1.size());
    ASSERT_EQ(grads.size(), grads1.size());
    EXPECT_EQ(std::memcmp(out.data(), out1.data(), out.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(grads.data(), grads1.data(), grads.size() * sizeof(float)), 0);
  }
}

TEST_F(CpuEmbeddingBagTest, EmptyBagsGiveZerosAndPlansChangeBetweenBatches) {
  auto op = backend_->CreateEmbeddingBag(4).value();
  std::mt19937 gen(13);
  // A large batch, an empty one (no rows at all: null rows are fine), a small one.
  const std::vector<OwnedBags> big = MixedFeatures(gen, 40, 6, 80);
  const std::vector<OwnedBags> empty = {{{0, 0, 0, 0}, {}, {}, Combiner::kMean}};
  const std::vector<OwnedBags> small = {RandomBags(gen, 3, 4, 5, Combiner::kSqrtN, true)};
  for (const auto& [batch, features] :
       {std::pair{40, &big}, std::pair{3, &empty}, std::pair{3, &small}}) {
    const EmbeddingPlan plan = BuildEmbeddingPlan(batch, Views(*features)).value();
    PSFLOW_ASSERT_OK(op->SetPlan(plan));
    EXPECT_EQ(op->bags(), plan.bags());
    EXPECT_EQ(op->unique(), plan.unique());
    const std::vector<float> rows = TableRows(plan, 4);
    std::vector<float> out(plan.bags() * 4, std::numeric_limits<float>::quiet_NaN());
    PSFLOW_ASSERT_OK(op->Forward(plan.unique() > 0 ? rows.data() : nullptr, out.data()));
    ExpectNear(out, NaiveForward(batch, *features, 4), "out");
    std::vector<float> dy(plan.bags() * 4, 1.0f), grads(plan.unique() * 4);
    PSFLOW_ASSERT_OK(op->Backward(dy.data(), plan.unique() > 0 ? grads.data() : nullptr));
  }
}

TEST_F(CpuEmbeddingBagTest, Errors) {
  auto zero = backend_->CreateEmbeddingBag(0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(zero.status().message(), HasSubstr("EmbeddingBag(dim=0): dim must be positive"));

  auto op = backend_->CreateEmbeddingBag(2).value();
  std::vector<float> buffer(64);
  EXPECT_EQ(op->Forward(buffer.data(), buffer.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(op->Backward(buffer.data(), buffer.data()).code(),
            absl::StatusCode::kFailedPrecondition);

  const OwnedBags f{{0, 2, 3}, {1, 2, 1}, {}, Combiner::kSum};
  const EmbeddingPlan plan = BuildEmbeddingPlan(2, Views({f})).value();
  PSFLOW_ASSERT_OK(op->SetPlan(plan));
  EXPECT_EQ(op->Forward(nullptr, buffer.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(op->Backward(buffer.data(), nullptr).code(), absl::StatusCode::kInvalidArgument);

  // A broken plan is refused and the previous one stays.
  EmbeddingPlan broken = plan;
  broken.bag_rows[0] = 99;
  EXPECT_EQ(op->SetPlan(broken).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<float> rows = {1, 2, 10, 20};
  std::vector<float> out(4);
  PSFLOW_ASSERT_OK(op->Forward(rows.data(), out.data()));
  EXPECT_THAT(out, ElementsAreArray({11.0f, 22.0f, 1.0f, 2.0f}));
}

}  // namespace
}  // namespace psflow::kernels
