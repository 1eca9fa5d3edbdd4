// Tests of one evaluation pass within a memory budget: the batch that fits,
// the refusal of a model of which not even one example fits, and figures
// that do not depend on the pieces a batch is split into (a resnet at batch
// 1, 100 and 10000 among them).
#include "evaluator/evaluation.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/byte_size.h"
#include "common/tensor_view.h"
#include "data/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/spec.h"
#include "tests/common/trained_weights.h"
#include "tests/kernels/wrapped_backend.h"
#include "tests/model/test_specs.h"

namespace psflow::evaluator {
namespace {

using model::kBatchNormSpec;
using model::kSmallSpec;
using model::Network;
using model::ParseSpec;
using ::testing::HasSubstr;

class EvaluationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One thread: OpenMP teams of batch-1 passes crawl on a busy 2-core machine.
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu", 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
  }

  // A forward-only network of `spec` with initial weights and running
  // statistics as after some training (means around 0, variances around 1).
  std::unique_ptr<Network> MakeNetwork(const ModelSpec& spec) {
    model::NetworkOptions options;
    options.forward_only = true;
    absl::StatusOr<std::unique_ptr<Network>> net = Network::Create(spec, backend_.get(), options);
    EXPECT_TRUE(net.ok()) << net.status();
    if (!net.ok()) return nullptr;
    std::vector<std::vector<float>> w = testing_weights::WithRunningStatistics(spec, 3, 4);
    std::vector<const float*> ptrs;
    for (const auto& v : w) ptrs.push_back(v.data());
    EXPECT_TRUE((*net)->SetWeights(ptrs).ok());
    return *std::move(net);
  }

  data::Dataset Synthetic(const ModelSpec& spec, int64_t count) {
    absl::StatusOr<data::Dataset> d =
        data::MakeSynthetic(data::SyntheticShape(spec.input().channels(), spec.input().height(),
                                                 spec.input().width(), spec.num_classes()),
                            count, data::Split::kTest);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : data::Dataset{};
  }

  std::unique_ptr<kernels::Backend> backend_;
};

// Half of what the device has available; a backend that cannot tell says so.
TEST_F(EvaluationTest, DefaultMemoryBudgetIsHalfOfWhatIsAvailable) {
  kernels::WrappedBackend backend(backend_.get());
  backend.SetAvailableMemory(int64_t{3} << 30);
  EXPECT_EQ(DefaultMemoryBudget(&backend).value(), int64_t{3} << 29);
  backend.SetAvailableMemory(absl::UnavailableError("cannot read /proc/meminfo"));
  absl::StatusOr<int64_t> budget = DefaultMemoryBudget(&backend);
  EXPECT_EQ(budget.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(budget.status().message(),
            "cannot tell how much memory cpu has available: cannot read /proc/meminfo");
  // The CPU's own: half of the host's.
  absl::StatusOr<int64_t> cpu = DefaultMemoryBudget(backend_.get());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_GT(*cpu, 0);
}

TEST_F(EvaluationTest, BatchThatFitsTheBudget) {
  std::unique_ptr<Network> net = MakeNetwork(ParseSpec(kSmallSpec));
  ASSERT_NE(net, nullptr);
  const Network::ForwardMemory m = net->forward_memory();
  ASSERT_EQ(m.fixed, 142 * 4);
  ASSERT_EQ(m.per_example, 285 * 4);
  // No budget: the batch asked for, or every example if fewer.
  EXPECT_EQ(EvaluationBatch(*net, 10, 4, 0).value(), 4);
  EXPECT_EQ(EvaluationBatch(*net, 10, 500, 0).value(), 10);
  // Room for 7 examples: 10 in one batch do not fit; 7 (and the last 3) or
  // 6 (and 4) do not either; 5 twice do.
  const int64_t seven = m.fixed + 7 * m.per_example;
  EXPECT_EQ(EvaluationBatch(*net, 10, 500, seven).value(), 5);
  EXPECT_EQ(EvaluationBatch(*net, 10, 10, seven).value(), 5);
  // 4 with the last 2 fit: the batch asked for.
  EXPECT_EQ(EvaluationBatch(*net, 10, 4, seven).value(), 4);
  EXPECT_EQ(EvaluationBatch(*net, 14, 500, seven).value(), 7);
  EXPECT_EQ(EvaluationBatch(*net, 1000000, 1000000, seven).value(), 5);  // 200000 batches
  EXPECT_EQ(EvaluationBatch(*net, 10, 500, m.fixed + m.per_example).value(), 1);
  // Asked for nonsense.
  EXPECT_EQ(EvaluationBatch(*net, 10, 0, seven).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EvaluationBatch(*net, 0, 5, seven).status().code(), absl::StatusCode::kInvalidArgument);
}

// Not even one example fits: one line with what it needs and the budget.
TEST_F(EvaluationTest, BudgetBelowOneExampleIsRefusedOnOneLine) {
  const ModelSpec spec = ParseSpec(kBatchNormSpec);
  std::unique_ptr<Network> net = MakeNetwork(spec);
  ASSERT_NE(net, nullptr);
  const Network::ForwardMemory m = net->forward_memory();
  const int64_t budget = m.fixed + m.per_example - 1;
  absl::StatusOr<int> batch = EvaluationBatch(*net, 100, 50, budget);
  ASSERT_EQ(batch.status().code(), absl::StatusCode::kResourceExhausted) << batch.status();
  const std::string message(batch.status().message());
  EXPECT_THAT(message, HasSubstr("model small_bn needs " + FormatByteSize(m.fixed + m.per_example) +
                                 " to evaluate one example ("));
  EXPECT_THAT(message, HasSubstr(FormatByteSize(m.per_example) + " per example"));
  EXPECT_THAT(message, HasSubstr("more than the memory budget of " + FormatByteSize(budget)));
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  // EvaluateDataset refuses the same way, before running anything.
  const data::Dataset data = Synthetic(spec, 100);
  absl::StatusOr<Evaluation> e = EvaluateDataset(net.get(), data, 50, budget);
  EXPECT_EQ(e.status(), batch.status());
}

// A budget that splits the batch changes nothing but the number of passes.
TEST_F(EvaluationTest, PiecesGiveTheFiguresOfOneBatch) {
  const ModelSpec spec = ParseSpec(kBatchNormSpec);
  std::unique_ptr<Network> net = MakeNetwork(spec);
  ASSERT_NE(net, nullptr);
  const data::Dataset data = Synthetic(spec, 103);
  int whole_passes = 1, piece_passes = 1;
  absl::StatusOr<Evaluation> whole = EvaluateDataset(net.get(), data, 500, 0, [&] {
    ++whole_passes;
    return absl::OkStatus();
  });
  const Network::ForwardMemory m = net->forward_memory();
  absl::StatusOr<Evaluation> pieces =
      EvaluateDataset(net.get(), data, 500, m.fixed + 10 * m.per_example, [&] {
        ++piece_passes;
        return absl::OkStatus();
      });
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  EXPECT_EQ(whole_passes, 1);
  // Room for 10: 10 (with the last 3), 9 (4), 8 (7) and 7 (5) do not fit;
  // 6 with the last 1 does.
  EXPECT_EQ(EvaluationBatch(*net, 103, 500, m.fixed + 10 * m.per_example).value(), 6);
  EXPECT_EQ(piece_passes, 18);
  EXPECT_EQ(pieces->examples, 103);
  EXPECT_EQ(pieces->correct, whole->correct);
  EXPECT_NEAR(pieces->loss, whole->loss, 1e-6 * whole->loss);
  EXPECT_GT(whole->correct, 0);
}

// The built-in resnet (ResNet-18) evaluates to the same accuracy and loss at
// batch 1, 100 and 10000 with a budget of 7 examples: batches of 100 and
// 10000 run in pieces of 6 (24 examples), and so never take more than the
// budget; with no budget at all, one pass of 24.
TEST_F(EvaluationTest, ResnetIsTheSameAtBatch1And100And10000) {
  absl::StatusOr<ModelSpec> spec = model::ResolveModelSpec("resnet");
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::unique_ptr<Network> net = MakeNetwork(*spec);
  ASSERT_NE(net, nullptr);
  const Network::ForwardMemory m = net->forward_memory();
  // 11.2M weights; a few activations of 64x32x32 per example.
  EXPECT_GT(m.fixed, 40 << 20);
  EXPECT_LT(m.per_example, 1 << 20);
  const data::Dataset data = Synthetic(*spec, 24);
  const int64_t budget = m.fixed + 7 * m.per_example;
  EXPECT_EQ(EvaluationBatch(*net, data.count, 100, budget).value(), 6);
  EXPECT_EQ(EvaluationBatch(*net, data.count, 10000, budget).value(), 6);
  absl::StatusOr<Evaluation> all = EvaluateDataset(net.get(), data, 10000, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  for (int batch : {1, 100, 10000}) {
    absl::StatusOr<Evaluation> e = EvaluateDataset(net.get(), data, batch, budget);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->examples, 24);
    EXPECT_EQ(e->correct, all->correct) << "batch " << batch;
    EXPECT_NEAR(e->loss, all->loss, 1e-5 * all->loss) << "batch " << batch;
  }
}

// A model of two classes gets the AUC of its probabilities of class 1, the
// Mann-Whitney statistic of the examples' scores, whatever the pieces.
TEST_F(EvaluationTest, TwoClassModelsGetTheAucOfClassOne) {
  const ModelSpec spec = ParseSpec(R"spec(
    name: "binary"
    input { channels: 1 height: 1 width: 6 }
    num_classes: 2
    layer { name: "hidden" dense { units: 5 } }
    layer { name: "relu" relu {} }
    layer { name: "out" dense { units: 2 } }
  )spec");
  std::unique_ptr<Network> net = MakeNetwork(spec);
  ASSERT_NE(net, nullptr);
  const data::Dataset data = Synthetic(spec, 60);
  ASSERT_GT(std::count(data.labels.begin(), data.labels.end(), 1), 0);
  ASSERT_GT(std::count(data.labels.begin(), data.labels.end(), 0), 0);
  // The probabilities of one pass over all, and their AUC pair by pair.
  ASSERT_TRUE(net->Evaluate(data.images.data(), data.labels.data(), 60).ok());
  std::vector<float> probs(120);
  ASSERT_TRUE(net->ReadProbabilities(60, probs.data()).ok());
  double wins = 0, pairs = 0;
  for (int i = 0; i < 60; ++i) {
    for (int j = 0; j < 60; ++j) {
      if (data.labels[i] != 1 || data.labels[j] != 0) continue;
      pairs += 1;
      wins += probs[2 * i + 1] > probs[2 * j + 1]    ? 1
              : probs[2 * i + 1] == probs[2 * j + 1] ? 0.5
                                                     : 0;
    }
  }
  absl::StatusOr<Evaluation> whole = EvaluateDataset(net.get(), data, 60, 0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(whole->binary);
  ASSERT_TRUE(whole->auc.has_value());
  EXPECT_DOUBLE_EQ(*whole->auc, wins / pairs);
  absl::StatusOr<Evaluation> pieces = EvaluateDataset(net.get(), data, 7, 0);
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  ASSERT_TRUE(pieces->auc.has_value());
  EXPECT_NEAR(*pieces->auc, wins / pairs, 1e-9);
  // One class only: no AUC. Four classes: none either.
  data::Dataset ones = data;
  std::fill(ones.labels.begin(), ones.labels.end(), 1);
  absl::StatusOr<Evaluation> one_class = EvaluateDataset(net.get(), ones, 60, 0);
  ASSERT_TRUE(one_class.ok()) << one_class.status();
  EXPECT_TRUE(one_class->binary);
  EXPECT_FALSE(one_class->auc.has_value());
  const ModelSpec four = ParseSpec(kSmallSpec);
  std::unique_ptr<Network> four_net = MakeNetwork(four);
  absl::StatusOr<Evaluation> e = EvaluateDataset(four_net.get(), Synthetic(four, 20), 20, 0);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_FALSE(e->binary);
  EXPECT_FALSE(e->auc.has_value());
  // Probabilities are there only after an evaluation of that batch size.
  EXPECT_EQ(four_net->ReadProbabilities(3, probs.data()).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace psflow::evaluator
