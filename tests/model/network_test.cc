#include "model/network.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_chunks.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "model/spec.h"

namespace psflow::model {
namespace {

// input 1x8x8 -> conv 3@3x3 (3x6x6) -> relu -> max-pool 2 (3x3x3) -> dense 4.
constexpr char kSmallSpec[] = R"pb(
  name: "small"
  input { channels: 1 height: 8 width: 8 }
  num_classes: 4
  layer { name: "conv" conv2d { filters: 3 kernel: 3 } }
  layer { name: "relu" relu {} }
  layer { name: "pool" max_pool { size: 2 } }
  layer { name: "fc" dense { units: 4 } }
)pb";

constexpr int kBatch = 8;

class NetworkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kSmallSpec, &spec_));
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
    std::vector<const float*> ptrs;
    for (const auto& v : w) ptrs.push_back(v.data());
    return net_->SetWeights(ptrs);
  }

  std::vector<std::vector<float>> Gradients() {
    std::vector<std::vector<float>> g;
    for (const VariableShape& v : net_->variables()) g.emplace_back(NumElements(v.shape), 0.0f);
    std::vector<float*> ptrs;
    for (auto& v : g) ptrs.push_back(v.data());
    absl::Status s = net_->GetGradients(ptrs);
    EXPECT_TRUE(s.ok()) << s;
    return g;
  }

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
  ASSERT_TRUE(SetWeights(weights_).ok());
  ASSERT_TRUE(net_->TrainStep(images_.data(), labels_.data(), kBatch).ok());
  const std::vector<std::vector<float>> grads = Gradients();

  // Small enough that no ReLU or max-pool switch lies within +-h of these
  // weights (conv/bias[2] has one near 1e-3), large enough for fp32 noise.
  const double h = 3e-4;
  for (size_t v = 0; v < grads.size(); ++v) {
    const std::string& name = net_->variables()[v].name;
    const int64_t n = static_cast<int64_t>(grads[v].size());
    double norm = 0;
    for (float g : grads[v]) norm += std::abs(g);
    EXPECT_GT(norm, 1e-4) << name << " has no gradient";
    // First, middle and last element, and a few more for the small ones.
    std::vector<int64_t> picks = {0, n / 2, n - 1, n / 3};
    for (int64_t i : picks) {
      std::vector<std::vector<float>> w = weights_;
      w[v][i] = weights_[v][i] + static_cast<float>(h);
      const double up = Loss(w);
      w[v][i] = weights_[v][i] - static_cast<float>(h);
      const double down = Loss(w);
      const double fd = (up - down) / (2 * h);
      const double an = grads[v][i];
      EXPECT_NEAR(an, fd, 1e-2 * std::max(std::abs(fd), std::abs(an)) + 2e-5)
          << name << "[" << i << "]";
    }
  }
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
  std::vector<const float*> ptrs;
  for (const auto& v : weights_) ptrs.push_back(v.data());
  ASSERT_TRUE((*net)->SetWeights(ptrs).ok());
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
  EXPECT_EQ(Network::Create(invalid, backend_.get()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow::model
