// Parity of the CUDA backend with the CPU backend: every op and helper runs the
// same random inputs through CreateBackend("cpu") and CreateBackend("cuda:0"),
// and outputs and gradients must agree in relative L2 error ||gpu - cpu|| /
// ||cpu||. Every GPU output is poisoned with NaN before the GPU writes it, so
// an element the GPU leaves unwritten shows up. Then graph capture and replay,
// and the errors of the device name (which need no GPU). Without a GPU the
// tests that need one skip.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/embedding_plan.h"
#include "kernels/kernels.h"
#include "tests/kernels/embedding_testing.h"
#include "tests/kernels/status_testing.h"
#include "transport/shared_region.h"

namespace psflow::kernels {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr double kTol = 1e-4;
constexpr double kConvTol = 5e-3;  // cuDNN may use TF32 tensor cores for convolutions

// ||got - want|| / ||want|| in double over the elements where got is finite
// (callers check those themselves); ||got - want|| when that part of want is
// all zero.
double RelativeL2(const std::vector<float>& want, const std::vector<float>& got) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) continue;
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// One tensor on both backends.
struct Pair {
  std::unique_ptr<Buffer> cpu, gpu;
  float* c() const { return cpu->data(); }
  float* g() const { return gpu->data(); }
  size_t size() const { return cpu->size(); }
};

const int32_t* Labels(float* p) { return reinterpret_cast<const int32_t*>(p); }

class CudaParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto gpu = CreateBackend("cuda:0");
    if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().message();
    gpu_ = std::move(*gpu);
    auto cpu = CreateBackend("cpu");
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    // A fixed seed per test (from its name), so that a failure reproduces.
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    gen_.seed(static_cast<uint32_t>(std::hash<std::string>()(name)));
  }

  // n values uniform in [-1, 1], never exactly 0.
  std::vector<float> Random(size_t n) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& f : v) {
      do {
        f = dist(gen_);
      } while (f == 0.0f);
    }
    return v;
  }

  static std::unique_ptr<Buffer> Upload(Backend& backend, const std::vector<float>& host) {
    auto buffer = backend.Allocate(host.size()).value();
    EXPECT_TRUE(backend.CopyToDevice(host.data(), host.size(), buffer->data()).ok());
    return buffer;
  }
  static std::vector<float> Download(Backend& backend, const float* device, size_t n) {
    std::vector<float> host(n);
    const absl::Status status = backend.CopyToHost(device, n, host.data());
    EXPECT_TRUE(status.ok()) << status;
    return host;
  }

  // The op `create` makes on the CPU backend and on the CUDA one; one that
  // fails fails the test and comes back null.
  template <typename Create>
  auto CreateOnBoth(Create create) {
    auto cpu = create(*cpu_);
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = create(*gpu_);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    using OpPtr = typename decltype(cpu)::value_type;
    return std::pair<OpPtr, OpPtr>(cpu.ok() ? *std::move(cpu) : nullptr,
                                   gpu.ok() ? *std::move(gpu) : nullptr);
  }

  // A pooling op's Forward from nx random inputs to ny outputs and its
  // Backward from ny random gradients to nx, on both backends, compared.
  template <typename Op>
  void ExpectPoolingParity(Op& cpu_op, Op& gpu_op, size_t nx, size_t ny) {
    Pair x = In(nx), dy = In(ny), y = Out(ny), dx = Out(nx);
    PSFLOW_ASSERT_OK(cpu_op.Forward(x.c(), y.c()));
    PSFLOW_ASSERT_OK(gpu_op.Forward(x.g(), y.g()));
    ExpectMatch(y, kTol, "y");
    PSFLOW_ASSERT_OK(cpu_op.Backward(dy.c(), dx.c()));
    PSFLOW_ASSERT_OK(gpu_op.Backward(dy.g(), dx.g()));
    ExpectMatch(dx, kTol, "dx");
  }

  // The same values on both backends.
  Pair In(const std::vector<float>& host) { return {Upload(*cpu_, host), Upload(*gpu_, host)}; }
  Pair In(size_t n) { return In(Random(n)); }
  // Labels: their int32 bits in float slots.
  Pair InLabels(const std::vector<int32_t>& labels) {
    std::vector<float> bits(labels.size());
    std::memcpy(bits.data(), labels.data(), labels.size() * sizeof(int32_t));
    return In(bits);
  }
  // An output: zeros on the CPU, NaN on the GPU.
  Pair Out(size_t n) {
    Pair p{cpu_->Allocate(n).value(), gpu_->Allocate(n).value()};
    Poison(p);
    return p;
  }
  void Poison(const Pair& p) {
    const std::vector<float> nan(p.size(), std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(gpu_->CopyToDevice(nan.data(), nan.size(), p.g()).ok());
  }

  // Every GPU element written (finite) and ||gpu - cpu|| <= tol * ||cpu||.
  void ExpectMatch(const Pair& p, double tol, const std::string& what) {
    const std::vector<float> c = Download(*cpu_, p.c(), p.size());
    const std::vector<float> g = Download(*gpu_, p.g(), p.size());
    size_t unwritten = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      if (!std::isfinite(g[i]) && ++unwritten <= 3) {
        ADD_FAILURE() << what << "[" << i << "] on the GPU is " << g[i];
      }
    }
    EXPECT_EQ(unwritten, 0u) << what << ": " << unwritten << " of " << g.size()
                             << " elements not written by the GPU";
    EXPECT_LE(RelativeL2(c, g), tol)
        << what << ": relative L2 error over " << c.size() << " elements";
  }

  std::unique_ptr<Backend> cpu_, gpu_;
  std::mt19937 gen_;
};

// The fixture of the tests over a list of shapes (or cases) of one op.
template <typename Param>
class CudaParamParityTest : public CudaParityTest, public ::testing::WithParamInterface<Param> {};

// ------------------------------------------------------------ Conv2D

struct ConvCase {
  std::string name;
  Conv2DShape shape;
  bool bias = true;
  bool dx = true;
};

using CudaConvParityTest = CudaParamParityTest<ConvCase>;

TEST_P(CudaConvParityTest, ForwardAndBackward) {
  const ConvCase& tc = GetParam();
  const Conv2DShape& s = tc.shape;
  auto [cpu_op, gpu_op] = CreateOnBoth([&](Backend& backend) { return backend.CreateConv2D(s); });
  ASSERT_TRUE(cpu_op && gpu_op);

  const size_t nx = size_t{1} * s.batch * s.in_channels * s.height * s.width;
  const size_t nw = size_t{1} * s.out_channels * s.in_channels * s.kernel_h * s.kernel_w;
  const size_t ny = size_t{1} * s.batch * s.out_channels * s.out_height() * s.out_width();
  Pair x = In(nx), w = In(nw), b = In(s.out_channels), dy = In(ny);
  Pair y = Out(ny), dx = Out(nx), dw = Out(nw), db = Out(s.out_channels);

  PSFLOW_ASSERT_OK(cpu_op->Forward(x.c(), w.c(), tc.bias ? b.c() : nullptr, y.c()));
  PSFLOW_ASSERT_OK(gpu_op->Forward(x.g(), w.g(), tc.bias ? b.g() : nullptr, y.g()));
  ExpectMatch(y, kConvTol, "y");

  PSFLOW_ASSERT_OK(cpu_op->Backward(x.c(), w.c(), dy.c(), tc.dx ? dx.c() : nullptr, dw.c(),
                                    tc.bias ? db.c() : nullptr));
  PSFLOW_ASSERT_OK(gpu_op->Backward(x.g(), w.g(), dy.g(), tc.dx ? dx.g() : nullptr, dw.g(),
                                    tc.bias ? db.g() : nullptr));
  ExpectMatch(dw, kConvTol, "dw");
  if (tc.bias) ExpectMatch(db, kConvTol, "db");
  if (tc.dx) ExpectMatch(dx, kConvTol, "dx");
}

// Conv2DShape: {batch, in_channels, height, width, out_channels, kernel_h, kernel_w, stride,
// padding}.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaConvParityTest,
    ::testing::Values(ConvCase{"k3_pad1_stride1", {4, 3, 12, 12, 8, 3, 3, 1, 1}},
                      ConvCase{"k3_pad1_stride2", {2, 16, 15, 15, 32, 3, 3, 2, 1}},
                      ConvCase{"k1_stride2", {4, 8, 9, 9, 16, 1, 1, 2, 0}},
                      ConvCase{"k5_nopad_first_layer", {3, 1, 28, 28, 20, 5, 5, 1, 0}, true, false},
                      ConvCase{"k5_nopad_rect", {2, 4, 11, 9, 6, 5, 5, 1, 0}},
                      ConvCase{"k3_no_bias", {4, 8, 10, 10, 8, 3, 3, 1, 1}, false, true},
                      ConvCase{"k3_no_bias_no_dx", {2, 8, 10, 10, 16, 3, 3, 2, 1}, false, false},
                      ConvCase{"k3_wide", {8, 32, 16, 16, 64, 3, 3, 1, 1}}),
    [](const ::testing::TestParamInfo<ConvCase>& info) { return info.param.name; });

// ------------------------------------------------------------ MaxPool2D

using CudaPoolParityTest = CudaParamParityTest<Pool2DShape>;

TEST_P(CudaPoolParityTest, ForwardAndBackward) {
  const Pool2DShape& s = GetParam();
  auto [cpu_op, gpu_op] =
      CreateOnBoth([&](Backend& backend) { return backend.CreateMaxPool2D(s); });
  ASSERT_TRUE(cpu_op && gpu_op);
  const size_t nx = size_t{1} * s.batch * s.channels * s.height * s.width;
  const size_t ny = size_t{1} * s.batch * s.channels * s.out_height() * s.out_width();
  ASSERT_NO_FATAL_FAILURE(ExpectPoolingParity(*cpu_op, *gpu_op, nx, ny));
}

// Pool2DShape: {batch, channels, height, width, window, stride}.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaPoolParityTest,
                         ::testing::Values(Pool2DShape{4, 6, 8, 8, 2, 2},
                                           Pool2DShape{2, 3, 7, 7, 2, 2},
                                           Pool2DShape{3, 20, 24, 24, 2, 2},
                                           Pool2DShape{2, 4, 9, 7, 3, 2}));

// ------------------------------------------------------------ Relu

TEST_F(CudaParityTest, Relu) {
  // The second size is beyond 65535 elements in the descriptor's N.
  for (const int64_t size : {int64_t{1000}, int64_t{131075}}) {
    SCOPED_TRACE(size);
    auto [cpu_op, gpu_op] =
        CreateOnBoth([&](Backend& backend) { return backend.CreateRelu(size); });
    ASSERT_TRUE(cpu_op && gpu_op);
    const size_t n = static_cast<size_t>(size);
    Pair x = In(n), dy = In(n), y = Out(n), dx = Out(n);
    PSFLOW_ASSERT_OK(cpu_op->Forward(x.c(), y.c()));
    PSFLOW_ASSERT_OK(gpu_op->Forward(x.g(), y.g()));
    ExpectMatch(y, kTol, "y");
    PSFLOW_ASSERT_OK(cpu_op->Backward(x.c(), dy.c(), dx.c()));
    PSFLOW_ASSERT_OK(gpu_op->Backward(x.g(), dy.g(), dx.g()));
    ExpectMatch(dx, kTol, "dx");
  }
}

// ------------------------------------------------------------ Dense

struct DenseCase {
  std::string name;
  DenseShape shape;
  bool dx = true;
};

using CudaDenseParityTest = CudaParamParityTest<DenseCase>;

TEST_P(CudaDenseParityTest, ForwardAndBackward) {
  const DenseCase& tc = GetParam();
  const DenseShape& s = tc.shape;
  auto [cpu_op, gpu_op] = CreateOnBoth([&](Backend& backend) { return backend.CreateDense(s); });
  ASSERT_TRUE(cpu_op && gpu_op);
  const size_t nx = size_t{1} * s.batch * s.in_features;
  const size_t nw = size_t{1} * s.out_features * s.in_features;
  const size_t ny = size_t{1} * s.batch * s.out_features;
  Pair x = In(nx), w = In(nw), b = In(s.out_features), dy = In(ny);
  Pair y = Out(ny), dx = Out(nx), dw = Out(nw), db = Out(s.out_features);

  PSFLOW_ASSERT_OK(cpu_op->Forward(x.c(), w.c(), b.c(), y.c()));
  PSFLOW_ASSERT_OK(gpu_op->Forward(x.g(), w.g(), b.g(), y.g()));
  ExpectMatch(y, kTol, "y");
  PSFLOW_ASSERT_OK(
      cpu_op->Backward(x.c(), w.c(), dy.c(), tc.dx ? dx.c() : nullptr, dw.c(), db.c()));
  PSFLOW_ASSERT_OK(
      gpu_op->Backward(x.g(), w.g(), dy.g(), tc.dx ? dx.g() : nullptr, dw.g(), db.g()));
  ExpectMatch(dw, kTol, "dw");
  ExpectMatch(db, kTol, "db");
  if (tc.dx) ExpectMatch(dx, kTol, "dx");
}

// DenseShape: {batch, in_features, out_features}.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaDenseParityTest,
                         ::testing::Values(DenseCase{"small", {8, 50, 10}},
                                           DenseCase{"batch1", {1, 3, 7}},
                                           DenseCase{"cnn_hidden_no_dx", {64, 800, 500}, false},
                                           DenseCase{"odd", {33, 257, 129}}),
                         [](const ::testing::TestParamInfo<DenseCase>& info) {
                           return info.param.name;
                         });

// ------------------------------------------------------------ BatchNorm

// The batch-norm tests: the op on both backends, over n_ values in c_ channels.
class CudaBatchNormParityTest : public CudaParamParityTest<BatchNormShape> {
 protected:
  void SetUp() override {
    CudaParamParityTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    const BatchNormShape& s = GetParam();
    std::tie(cpu_op_, gpu_op_) =
        CreateOnBoth([&](Backend& backend) { return backend.CreateBatchNorm(s); });
    ASSERT_TRUE(cpu_op_ && gpu_op_);
    n_ = size_t{1} * s.batch * s.channels * s.height * s.width;
    c_ = s.channels;
  }

  std::unique_ptr<BatchNorm> cpu_op_, gpu_op_;
  size_t n_ = 0, c_ = 0;
};

TEST_P(CudaBatchNormParityTest, ForwardAndBackward) {
  Pair x = In(n_), gamma = In(c_), beta = In(c_), dy = In(n_);
  Pair y = Out(n_), dx = Out(n_), dgamma = Out(c_), dbeta = Out(c_), mean = Out(c_), var = Out(c_);

  PSFLOW_ASSERT_OK(cpu_op_->Forward(x.c(), gamma.c(), beta.c(), y.c(), mean.c(), var.c()));
  PSFLOW_ASSERT_OK(gpu_op_->Forward(x.g(), gamma.g(), beta.g(), y.g(), mean.g(), var.g()));
  ExpectMatch(y, kTol, "y");
  ExpectMatch(mean, kTol, "batch mean");
  ExpectMatch(var, kTol, "batch unbiased variance");
  PSFLOW_ASSERT_OK(cpu_op_->Backward(x.c(), gamma.c(), dy.c(), dx.c(), dgamma.c(), dbeta.c()));
  PSFLOW_ASSERT_OK(gpu_op_->Backward(x.g(), gamma.g(), dy.g(), dx.g(), dgamma.g(), dbeta.g()));
  ExpectMatch(dx, kTol, "dx");
  ExpectMatch(dgamma, kTol, "dgamma");
  ExpectMatch(dbeta, kTol, "dbeta");
}

// Inference with given statistics (running ones): the same y on both
// backends; then the Backward of a Forward before the inference is the
// Forward's (inference leaves the saved statistics alone).
TEST_P(CudaBatchNormParityTest, Inference) {
  std::vector<float> variances = Random(c_);
  for (float& v : variances) v = 0.1f + 2 * std::abs(v);  // positive
  Pair x = In(n_), other = In(n_), gamma = In(c_), beta = In(c_), mean = In(c_),
       var = In(variances), dy = In(n_);
  Pair y = Out(n_), yi = Out(n_), dx = Out(n_), dgamma = Out(c_), dbeta = Out(c_);

  PSFLOW_ASSERT_OK(cpu_op_->Infer(x.c(), gamma.c(), beta.c(), mean.c(), var.c(), yi.c()));
  PSFLOW_ASSERT_OK(gpu_op_->Infer(x.g(), gamma.g(), beta.g(), mean.g(), var.g(), yi.g()));
  ExpectMatch(yi, kTol, "inference y");

  PSFLOW_ASSERT_OK(cpu_op_->Forward(x.c(), gamma.c(), beta.c(), y.c(), nullptr, nullptr));
  PSFLOW_ASSERT_OK(gpu_op_->Forward(x.g(), gamma.g(), beta.g(), y.g(), nullptr, nullptr));
  Poison(yi);
  PSFLOW_ASSERT_OK(cpu_op_->Infer(other.c(), gamma.c(), beta.c(), mean.c(), var.c(), yi.c()));
  PSFLOW_ASSERT_OK(gpu_op_->Infer(other.g(), gamma.g(), beta.g(), mean.g(), var.g(), yi.g()));
  ExpectMatch(yi, kTol, "inference y of another input");
  PSFLOW_ASSERT_OK(cpu_op_->Backward(x.c(), gamma.c(), dy.c(), dx.c(), dgamma.c(), dbeta.c()));
  PSFLOW_ASSERT_OK(gpu_op_->Backward(x.g(), gamma.g(), dy.g(), dx.g(), dgamma.g(), dbeta.g()));
  ExpectMatch(dx, kTol, "dx");
  ExpectMatch(dgamma, kTol, "dgamma");
  ExpectMatch(dbeta, kTol, "dbeta");
}

// BatchNormShape: {batch, channels, height, width, epsilon}.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaBatchNormParityTest,
                         ::testing::Values(BatchNormShape{8, 16, 8, 8, 1e-5f},
                                           BatchNormShape{4, 3, 5, 5, 1e-5f},
                                           BatchNormShape{16, 8, 1, 1, 1e-3f}));

// ------------------------------------------------------------ GlobalAvgPool

TEST_F(CudaParityTest, GlobalAvgPool) {
  // GlobalAvgPoolShape: {batch, channels, height, width}.
  for (const GlobalAvgPoolShape& s :
       {GlobalAvgPoolShape{4, 8, 7, 7}, GlobalAvgPoolShape{2, 3, 1, 1},
        GlobalAvgPoolShape{3, 64, 8, 8}}) {
    SCOPED_TRACE(testing::Message()
                 << s.batch << "x" << s.channels << "x" << s.height << "x" << s.width);
    auto [cpu_op, gpu_op] =
        CreateOnBoth([&](Backend& backend) { return backend.CreateGlobalAvgPool(s); });
    ASSERT_TRUE(cpu_op && gpu_op);
    const size_t nx = size_t{1} * s.batch * s.channels * s.height * s.width;
    const size_t ny = size_t{1} * s.batch * s.channels;
    ASSERT_NO_FATAL_FAILURE(ExpectPoolingParity(*cpu_op, *gpu_op, nx, ny));
  }
}

// ------------------------------------------------------------ Concat and Interaction

// Forward, then backward with the first operand's gradient written and the
// others' added to what is there (the same on both backends).
TEST_F(CudaParityTest, ConcatAndInteraction) {
  const int n = 37;
  const std::vector<int64_t> widths = {5, 16, 1, 16};
  auto [cpu_cat, gpu_cat] = CreateOnBoth([&](Backend& backend) {
    return backend.CreateConcat({n, widths});
  });
  ASSERT_TRUE(cpu_cat && gpu_cat);
  std::vector<Pair> xs, dxs;
  for (int64_t w : widths) {
    xs.push_back(In(static_cast<size_t>(n * w)));
    dxs.push_back(In(static_cast<size_t>(n * w)));
  }
  auto pointers = [](std::vector<Pair>& ps, bool gpu) {
    std::vector<float*> out;
    for (Pair& p : ps) out.push_back(gpu ? p.g() : p.c());
    return out;
  };
  const std::vector<uint8_t> add = {0, 1, 1, 1};
  {
    std::vector<float*> cm = pointers(xs, false), gm = pointers(xs, true);
    const std::vector<const float*> cx(cm.begin(), cm.end()), gx(gm.begin(), gm.end());
    Pair y = Out(static_cast<size_t>(n * 38)), dy = In(static_cast<size_t>(n * 38));
    PSFLOW_ASSERT_OK(cpu_cat->Forward(cx, y.c()));
    PSFLOW_ASSERT_OK(gpu_cat->Forward(gx, y.g()));
    ExpectMatch(y, kTol, "concat y");
    PSFLOW_ASSERT_OK(cpu_cat->Backward(dy.c(), pointers(dxs, false), add));
    PSFLOW_ASSERT_OK(gpu_cat->Backward(dy.g(), pointers(dxs, true), add));
    for (size_t i = 0; i < dxs.size(); ++i) ExpectMatch(dxs[i], kTol, "concat dx");
  }
  for (const bool self : {false, true}) {
    SCOPED_TRACE(self ? "self" : "no self");
    const InteractionShape s{n, 4, 16, self};
    auto [cpu_op, gpu_op] =
        CreateOnBoth([&](Backend& backend) { return backend.CreateInteraction(s); });
    ASSERT_TRUE(cpu_op && gpu_op);
    std::vector<Pair> vs, dvs;
    for (int f = 0; f < s.features; ++f) {
      vs.push_back(In(static_cast<size_t>(n * s.dim)));
      dvs.push_back(In(static_cast<size_t>(n * s.dim)));
    }
    std::vector<float*> cv = pointers(vs, false), gv = pointers(vs, true);
    const std::vector<const float*> ccv(cv.begin(), cv.end()), cgv(gv.begin(), gv.end());
    const size_t ny = static_cast<size_t>(n * s.out_width());
    Pair y = Out(ny), dy = In(ny);
    PSFLOW_ASSERT_OK(cpu_op->Forward(ccv, y.c()));
    PSFLOW_ASSERT_OK(gpu_op->Forward(cgv, y.g()));
    ExpectMatch(y, kTol, "interaction y");
    PSFLOW_ASSERT_OK(cpu_op->Backward(ccv, dy.c(), pointers(dvs, false), add));
    PSFLOW_ASSERT_OK(gpu_op->Backward(cgv, dy.g(), pointers(dvs, true), add));
    for (size_t i = 0; i < dvs.size(); ++i) ExpectMatch(dvs[i], kTol, "interaction dx");
  }
}

// ------------------------------------------------------------ SoftmaxCrossEntropy

TEST_F(CudaParityTest, SoftmaxCrossEntropy) {
  // {batch, classes}: the stats reduction loops when batch > 256; 1000 classes
  // loop inside a warp.
  for (const auto& [batch, classes] :
       std::vector<std::pair<int, int>>{{64, 10}, {5, 1000}, {300, 3}, {1, 1}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch << ", classes " << classes);
    auto [cpu_op, gpu_op] = CreateOnBoth(
        // (Structured bindings are captured by copy: C++17 lets no lambda
        // capture them by reference.)
        [b = batch, c = classes](Backend& backend) {
          return backend.CreateSoftmaxCrossEntropy(b, c);
        });
    ASSERT_TRUE(cpu_op && gpu_op);
    const size_t n = size_t{1} * batch * classes;
    const std::vector<float> logits_host = Random(n);
    // Half the labels at the arg-max, so that some examples count as correct.
    std::vector<int32_t> labels_host(batch);
    for (int i = 0; i < batch; ++i) {
      const float* row = logits_host.data() + size_t{1} * i * classes;
      labels_host[i] = i % 2 == 0 ? static_cast<int32_t>(std::max_element(row, row + classes) - row)
                                  : static_cast<int32_t>(gen_() % classes);
    }
    Pair logits = In(logits_host), labels = InLabels(labels_host);
    Pair probs = Out(n), stats = Out(2), dlogits = Out(n);

    PSFLOW_ASSERT_OK(cpu_op->Forward(logits.c(), Labels(labels.c()), probs.c(), stats.c()));
    PSFLOW_ASSERT_OK(gpu_op->Forward(logits.g(), Labels(labels.g()), probs.g(), stats.g()));
    ExpectMatch(probs, kTol, "probs");
    const std::vector<float> cpu_stats = Download(*cpu_, stats.c(), 2);
    const std::vector<float> gpu_stats = Download(*gpu_, stats.g(), 2);
    EXPECT_NEAR(gpu_stats[0], cpu_stats[0], kTol * std::abs(cpu_stats[0])) << "mean loss";
    EXPECT_EQ(gpu_stats[1], cpu_stats[1]) << "correct";

    PSFLOW_ASSERT_OK(cpu_op->Backward(probs.c(), Labels(labels.c()), dlogits.c()));
    PSFLOW_ASSERT_OK(gpu_op->Backward(probs.g(), Labels(labels.g()), dlogits.g()));
    ExpectMatch(dlogits, kTol, "dlogits");
  }
}

// The GPU does not check labels (that would need a copy to the host); an
// out-of-range label must not be used as an index, and shows as a NaN loss.
TEST_F(CudaParityTest, SoftmaxCrossEntropyLabelOutOfRangeGivesNanLoss) {
  const int batch = 4, classes = 3;
  auto op = gpu_->CreateSoftmaxCrossEntropy(batch, classes).value();
  // Row 0's arg-max is class 2; rows 1 and 2 have bad labels.
  const std::vector<float> logits_host = {0, 1, 2, 0, 0, 0, 1, 1, 1, 3, 2, 1};
  const std::vector<int32_t> labels_host = {2, -1, classes, 0};
  std::vector<float> bits(batch);
  std::memcpy(bits.data(), labels_host.data(), sizeof(int32_t) * batch);
  auto logits = Upload(*gpu_, logits_host), labels = Upload(*gpu_, bits);
  auto probs = gpu_->Allocate(batch * classes).value(), stats = gpu_->Allocate(2).value();
  auto dlogits = gpu_->Allocate(batch * classes).value();
  PSFLOW_ASSERT_OK(
      op->Forward(logits->data(), Labels(labels->data()), probs->data(), stats->data()));
  PSFLOW_ASSERT_OK(op->Backward(probs->data(), Labels(labels->data()), dlogits->data()));
  const std::vector<float> got = Download(*gpu_, stats->data(), 2);
  EXPECT_TRUE(std::isnan(got[0])) << got[0];
  EXPECT_EQ(got[1], 2.0f);  // rows 0 and 3
  for (float d : Download(*gpu_, dlogits->data(), batch * classes)) EXPECT_TRUE(std::isfinite(d));
}

// ------------------------------------------------------------ EmbeddingBag

// Plans of several features sharing a table (every combiner, weighted and
// not, empty bags, hot ids), one op per backend taking them in turn: the
// largest first, then an empty one and a small one (the op's memory is
// reused), then one larger still (it grows). Forward and backward against the
// CPU, the GPU's results bit-identical when run again.
TEST_F(CudaParityTest, EmbeddingBag) {
  const int64_t dim = 48;  // more columns than a warp has lanes
  auto [cpu_op, gpu_op] =
      CreateOnBoth([&](Backend& backend) { return backend.CreateEmbeddingBag(dim); });
  ASSERT_TRUE(cpu_op && gpu_op);
  std::vector<std::vector<OwnedBags>> batches;
  const std::vector<int> sizes = {128, 3, 5, 512};
  for (int batch : sizes) {
    if (batch == 3) {
      batches.push_back({{{0, 0, 0, 0}, {}, {}, Combiner::kMean}});
      continue;
    }
    std::vector<OwnedBags> features;
    for (Combiner c : {Combiner::kSum, Combiner::kMean, Combiner::kSqrtN}) {
      for (bool weighted : {false, true}) {
        features.push_back(RandomBags(gen_, batch, 8, 10 * batch, c, weighted));
      }
    }
    batches.push_back(std::move(features));
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "batch " << sizes[i]);
    const EmbeddingPlan plan = BuildEmbeddingPlan(sizes[i], Views(batches[i])).value();
    PSFLOW_ASSERT_OK(cpu_op->SetPlan(plan));
    PSFLOW_ASSERT_OK(gpu_op->SetPlan(plan));
    EXPECT_EQ(gpu_op->bags(), plan.bags());
    EXPECT_EQ(gpu_op->unique(), plan.unique());
    std::vector<float> table = TableRows(plan, dim);
    if (table.empty()) table.push_back(0);  // one float stands in for no rows at all
    Pair rows = In(table), dy = In(plan.bags() * dim), out = Out(plan.bags() * dim);
    Pair grads = Out(table.size());
    PSFLOW_ASSERT_OK(cpu_op->Forward(rows.c(), out.c()));
    PSFLOW_ASSERT_OK(gpu_op->Forward(rows.g(), out.g()));
    ExpectMatch(out, kTol, "out");
    PSFLOW_ASSERT_OK(cpu_op->Backward(dy.c(), grads.c()));
    PSFLOW_ASSERT_OK(gpu_op->Backward(dy.g(), grads.g()));
    if (plan.unique() > 0) ExpectMatch(grads, kTol, "row_grads");

    const std::vector<float> out1 = Download(*gpu_, out.g(), out.size());
    const std::vector<float> grads1 = Download(*gpu_, grads.g(), grads.size());
    Poison(out);
    Poison(grads);
    PSFLOW_ASSERT_OK(gpu_op->Forward(rows.g(), out.g()));
    PSFLOW_ASSERT_OK(gpu_op->Backward(dy.g(), grads.g()));
    const std::vector<float> out2 = Download(*gpu_, out.g(), out.size());
    const std::vector<float> grads2 = Download(*gpu_, grads.g(), grads.size());
    EXPECT_EQ(std::memcmp(out1.data(), out2.data(), out1.size() * sizeof(float)), 0);
    if (plan.unique() > 0) {
      EXPECT_EQ(std::memcmp(grads1.data(), grads2.data(), grads1.size() * sizeof(float)), 0);
    }
  }
}

TEST_F(CudaParityTest, EmbeddingBagErrors) {
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(gpu_->CreateEmbeddingBag(0).status().code(), invalid);
  auto op = gpu_->CreateEmbeddingBag(2).value();
  auto buffer = gpu_->Allocate(16).value();
  float* p = buffer->data();
  EXPECT_EQ(op->Forward(p, p).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<OwnedBags> features = {{{0, 2, 3}, {1, 2, 1}, {}, Combiner::kSum}};
  const EmbeddingPlan plan = BuildEmbeddingPlan(2, Views(features)).value();
  PSFLOW_ASSERT_OK(op->SetPlan(plan));
  EXPECT_EQ(op->Forward(nullptr, p).code(), invalid);
  EXPECT_EQ(op->Backward(p, nullptr).code(), invalid);
  // A broken plan is refused; the previous one stays in place.
  EmbeddingPlan broken = plan;
  broken.row_bags[0] = 7;
  EXPECT_EQ(op->SetPlan(broken).code(), invalid);
  const std::vector<float> rows = {1, 2, 10, 20};
  PSFLOW_ASSERT_OK(gpu_->CopyToDevice(rows.data(), rows.size(), p));
  PSFLOW_ASSERT_OK(op->Forward(p, p + 4));
  EXPECT_EQ(Download(*gpu_, p + 4, 4), (std::vector<float>{11, 22, 1, 2}));
}

// ------------------------------------------------------------ helpers

TEST_F(CudaParityTest, ElementwiseHelpers) {
  // 1000: the float4 path; 1001: the scalar one; offset 1: misaligned pointers.
  for (const auto& [n, offset] : std::vector<std::pair<int64_t, size_t>>{
           {1000, 0}, {1001, 0}, {1000, 1}, {1, 0}, {1 << 20, 0}}) {
    SCOPED_TRACE(testing::Message() << "n " << n << ", offset " << offset);
    const size_t len = static_cast<size_t>(n) + offset;
    Pair a = In(len), b = In(len), y = Out(len);
    // (A structured binding is captured through an init-capture: Clang 14,
    // which scripts/check-thread-safety.py runs, takes no other.)
    auto at = [off = offset](const Pair& p, bool gpu) { return (gpu ? p.g() : p.c()) + off; };

    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      PSFLOW_ASSERT_OK(backend.Add(at(a, gpu), at(b, gpu), at(y, gpu), n));
    }
    // The unused leading element stays poisoned on the GPU; compare the rest.
    if (offset == 0) ExpectMatch(y, kTol, "Add");

    Pair z = Out(len);
    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      PSFLOW_ASSERT_OK(backend.Affine(at(a, gpu), 0.75f, -0.25f, at(z, gpu), n));
    }
    if (offset == 0) ExpectMatch(z, kTol, "Affine");

    // Per channel: 3 channels of planes that divide n where they can.
    const int64_t channels = 3, plane = std::max<int64_t>(n / 6, 1), images = n / (3 * plane);
    if (images > 0 && offset == 0) {
      Pair scale = In({1.5f, -0.5f, 0.25f}), shift = In({0.1f, 0.0f, -2.0f}), c = Out(len);
      for (bool gpu : {false, true}) {
        Backend& backend = gpu ? *gpu_ : *cpu_;
        PSFLOW_ASSERT_OK(backend.ChannelAffine(at(a, gpu), at(scale, gpu), at(shift, gpu),
                                               at(c, gpu), images, channels, plane));
      }
      const std::vector<float> cg = Download(*gpu_, c.g(), len), cc = Download(*cpu_, c.c(), len);
      const int64_t used = images * channels * plane;
      for (int64_t i = 0; i < used; ++i) ASSERT_NEAR(cg[i], cc[i], kTol) << "ChannelAffine " << i;
    }

    Pair w = In(len);  // updated in place
    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      PSFLOW_ASSERT_OK(backend.Sgd(at(w, gpu), at(b, gpu), 0.1f, n));
    }
    ExpectMatch(w, kTol, "Sgd");

    Pair copy = Out(len);
    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      PSFLOW_ASSERT_OK(backend.Copy(at(a, gpu), at(copy, gpu), n));
    }
    if (offset == 0) ExpectMatch(copy, 0.0, "Copy");

    // Outputs aliasing inputs: a += b.
    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      PSFLOW_ASSERT_OK(backend.Add(at(a, gpu), at(b, gpu), at(a, gpu), n));
    }
    ExpectMatch(a, kTol, "Add in place");

    if (offset != 0) {  // the misaligned outputs, without their unused first element
      for (const Pair* p : {&y, &z, &copy}) {
        const auto c = Download(*cpu_, p->c() + offset, n), g = Download(*gpu_, p->g() + offset, n);
        double diff = 0, norm = 0;
        for (size_t i = 0; i < c.size(); ++i) {
          ASSERT_TRUE(std::isfinite(g[i])) << i;
          diff += (double{g[i]} - c[i]) * (double{g[i]} - c[i]);
          norm += double{c[i]} * c[i];
        }
        EXPECT_LE(std::sqrt(diff / norm), kTol);
      }
    }
  }
}

// The optimizer rules a GPU replica of a job without ps applies, against the
// CPU backend's (the ps's arithmetic, kernels/optimizer_math.h), over a few
// steps; and the count of non-finite values the replicas agree on. Each as
// one batch of 60 tensors cut from one buffer (57 small, an empty one, a
// large one: more than one launch's worth, the largest setting the grid).
TEST_F(CudaParityTest, OptimizerRulesAndNonFiniteCount) {
  OptimizerStep sgd;
  sgd.rule = OptimizerStep::kSgd;
  sgd.lr = 0.1f;
  sgd.wd = 0.01f;
  OptimizerStep momentum = sgd, nesterov = sgd, adagrad = sgd, rmsprop = sgd, adam = sgd,
                average = sgd;
  momentum.rule = OptimizerStep::kMomentum;
  momentum.mu = 0.9f;
  nesterov.rule = OptimizerStep::kNesterov;
  nesterov.mu = 0.9f;
  adagrad.rule = OptimizerStep::kAdagrad;
  adagrad.eps = 1e-10f;
  rmsprop.rule = OptimizerStep::kRmsprop;
  rmsprop.alpha = 0.99f;
  rmsprop.eps = 1e-8f;
  adam.rule = OptimizerStep::kAdam;
  adam.b1 = 0.9f;
  adam.b2 = 0.999f;
  adam.eps = 1e-8f;
  adam.step_size = 0.01f;
  adam.inv_c2 = 1.5f;
  adam.decay = 0.999f;
  average.rule = OptimizerStep::kMovingAverage;
  average.mu = 0.1f;
  constexpr int64_t kN = 100003;  // the grid-stride loop's tail
  // The tensors' [first, first + n) in a buffer of kN.
  std::vector<std::pair<int64_t, int64_t>> cuts;
  int64_t first = 0;
  for (int64_t k = 1; k <= 57; first += k, ++k) cuts.emplace_back(first, k);
  cuts.emplace_back(first, 0);
  cuts.emplace_back(first, kN - first - 1);
  cuts.emplace_back(kN - 1, 1);
  for (const OptimizerStep& rule : {sgd, momentum, nesterov, adagrad, rmsprop, adam, average}) {
    SCOPED_TRACE(testing::Message() << "rule " << rule.rule);
    Pair w = In(kN);
    const std::vector<float> zeros(kN, 0.0f);
    Pair s0 = In(zeros), s1 = In(zeros);
    for (int step = 0; step < 3; ++step) {
      Pair g = In(kN);
      for (bool gpu : {false, true}) {
        Backend& backend = gpu ? *gpu_ : *cpu_;
        std::vector<OptimizerTensor> tensors;
        for (const auto& [at, n] : cuts) {
          tensors.push_back({(gpu ? w.g() : w.c()) + at, (gpu ? g.g() : g.c()) + at,
                             (gpu ? s0.g() : s0.c()) + at, (gpu ? s1.g() : s1.c()) + at, n});
        }
        PSFLOW_ASSERT_OK(backend.ApplyOptimizer(rule, tensors));
      }
    }
    ExpectMatch(w, 1e-6, "weights");
    if (rule.slots() > 0) ExpectMatch(s0, 1e-6, "slot 0");
    if (rule.slots() > 1) ExpectMatch(s1, 1e-6, "slot 1");
  }
  std::vector<float> values = Random(kN);
  values[0] = std::numeric_limits<float>::quiet_NaN();
  values[kN / 2] = std::numeric_limits<float>::infinity();
  values[kN - 1] = -std::numeric_limits<float>::infinity();
  Pair x = In(values);
  Pair count = In(std::vector<float>{2});
  for (bool gpu : {false, true}) {
    Backend& backend = gpu ? *gpu_ : *cpu_;
    std::vector<absl::Span<const float>> spans;
    for (const auto& [at, n] : cuts) {
      spans.push_back(absl::MakeConstSpan((gpu ? x.g() : x.c()) + at, static_cast<size_t>(n)));
    }
    PSFLOW_ASSERT_OK(backend.CountNonFinite(spans, gpu ? count.g() : count.c()));
  }
  EXPECT_EQ(Download(*gpu_, count.g(), 1)[0], 5.0f);
  EXPECT_EQ(Download(*cpu_, count.c(), 1)[0], 5.0f);
  // The global norm (clipping on the device): the CPU's to rounding, and
  // the same bits at every call (replicas must scale alike).
  Pair finite = In(kN);
  Pair norm = In(std::vector<float>{0});
  Pair scratch = In(static_cast<size_t>(Backend::kGlobalNormScratch));
  float first_norm = 0;
  for (int call = 0; call < 3; ++call) {
    for (bool gpu : {false, true}) {
      Backend& backend = gpu ? *gpu_ : *cpu_;
      std::vector<absl::Span<const float>> spans;
      for (const auto& [at, n] : cuts) {
        spans.push_back(
            absl::MakeConstSpan((gpu ? finite.g() : finite.c()) + at, static_cast<size_t>(n)));
      }
      PSFLOW_ASSERT_OK(
          backend.GlobalNorm(spans, gpu ? scratch.g() : scratch.c(), gpu ? norm.g() : norm.c()));
    }
    const float got = Download(*gpu_, norm.g(), 1)[0];
    if (call == 0) first_norm = got;
    EXPECT_EQ(got, first_norm);
    EXPECT_NEAR(got, Download(*cpu_, norm.c(), 1)[0], 1e-5f * got);
  }
}

TEST_F(CudaParityTest, BasicsAndErrors) {
  EXPECT_EQ(gpu_->name(), "cuda:0");
  EXPECT_FALSE(gpu_->host_memory());
  auto buffer = gpu_->Allocate(1001).value();
  EXPECT_EQ(buffer->size(), 1001u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 16, 0u);
  EXPECT_EQ(Download(*gpu_, buffer->data(), 1001), std::vector<float>(1001, 0.0f));
  auto empty = gpu_->Allocate(0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ((*empty)->size(), 0u);
  PSFLOW_ASSERT_OK(gpu_->Synchronize());

  const auto invalid = absl::StatusCode::kInvalidArgument;
  float* p = buffer->data();
  EXPECT_EQ(gpu_->CopyToDevice(nullptr, 4, p).code(), invalid);
  EXPECT_EQ(gpu_->Add(p, nullptr, p, 8).code(), invalid);
  EXPECT_EQ(gpu_->Affine(p, 1, 0, p, -1).code(), invalid);
  EXPECT_TRUE(gpu_->Copy(nullptr, nullptr, 0).ok());
  EXPECT_EQ(gpu_->CreateConv2D(Conv2DShape{1, 1, 2, 2, 1, 3, 3, 1, 0}).status().code(), invalid);
  EXPECT_EQ(gpu_->CreateRelu(int64_t{1} << 32).status().code(), invalid);
  EXPECT_EQ(gpu_->CreateDense(DenseShape{0, 1, 1}).status().code(), invalid);

  auto pool = gpu_->CreateMaxPool2D(Pool2DShape{1, 1, 4, 4, 2, 2}).value();
  EXPECT_EQ(pool->Backward(p, p).code(), absl::StatusCode::kFailedPrecondition);
  auto norm = gpu_->CreateBatchNorm(BatchNormShape{2, 1, 2, 2}).value();
  EXPECT_EQ(norm->Backward(p, p, p, p, p, p).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(norm->Infer(p, p, p, nullptr, p, p).code(), invalid);
  // The backend still works after the errors.
  PSFLOW_ASSERT_OK(gpu_->Affine(p, 0.0f, 2.0f, p, 4));
  EXPECT_EQ(Download(*gpu_, p, 4), std::vector<float>(4, 2.0f));
}

// ------------------------------------------------------------ graphs

TEST_F(CudaParityTest, CaptureRecordsWithoutRunningAndReplays) {
  const int64_t n = 4099;
  Pair x = In(n), y = Out(n), z = Out(n);
  auto queue = [&](Backend& backend, bool gpu) -> absl::Status {
    float* xp = gpu ? x.g() : x.c();
    float* yp = gpu ? y.g() : y.c();
    float* zp = gpu ? z.g() : z.c();
    if (absl::Status s = backend.Affine(xp, 2.0f, 1.0f, yp, n); !s.ok()) return s;
    return backend.Add(yp, xp, zp, n);  // z = 3x + 1
  };
  auto graph = gpu_->Capture([&] { return queue(*gpu_, true); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (float v : Download(*gpu_, z.g(), n)) ASSERT_TRUE(std::isnan(v)) << "Capture ran the work";

  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE(replay);
    const std::vector<float> input = Random(n);  // new contents, same pointers
    PSFLOW_ASSERT_OK(cpu_->CopyToDevice(input.data(), n, x.c()));
    PSFLOW_ASSERT_OK(gpu_->CopyToDevice(input.data(), n, x.g()));
    Poison(y);
    Poison(z);
    PSFLOW_ASSERT_OK(queue(*cpu_, false));
    PSFLOW_ASSERT_OK((*graph)->Launch());
    ExpectMatch(y, 1e-6, "y");
    ExpectMatch(z, 1e-6, "z");
  }
}

// CopyToHostAfter: each copy waits for its event (recorded eagerly, or by a
// graph's replay), not for the work queued before the copy itself; the
// copies are done once WaitCopies returns. Buffers large enough that a copy
// that did not wait would read the zeros the buffers start with.
// Two device buffers of n floats, page-locked host memory for each, and two
// events: what the tests of copies after events share.
struct CopyBuffers {
  CopyBuffers(Backend& gpu, int64_t floats)
      : n(floats),
        x(gpu.Allocate(n).value()),
        y(gpu.Allocate(n).value()),
        hx(gpu.AllocateHost(n).value()),
        hy(gpu.AllocateHost(n).value()),
        first(gpu.CreateEvent().value()),
        second(gpu.CreateEvent().value()) {}
  const int64_t n;
  std::unique_ptr<Buffer> x, y, hx, hy;
  std::unique_ptr<Event> first, second;
};

TEST_F(CudaParityTest, CopiesToTheHostWaitForTheirEvents) {
  CopyBuffers b(*gpu_, int64_t{1} << 22);
  const int64_t n = b.n;
  auto [x, y, hx, hy] = std::tie(b.x, b.y, b.hx, b.hy);
  auto [first, second] = std::tie(b.first, b.second);
  PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 0.0f, 1.0f, x->data(), n));
  PSFLOW_ASSERT_OK(gpu_->RecordEvent(first.get()));
  for (int k = 0; k < 8; ++k) PSFLOW_ASSERT_OK(gpu_->Affine(y->data(), 1.0f, 0.25f, y->data(), n));
  PSFLOW_ASSERT_OK(gpu_->RecordEvent(second.get()));
  // The later event's copy first: the copy of x still comes after its own.
  PSFLOW_ASSERT_OK(
      gpu_->CopyToHostAfter(second.get(), {{y->data(), hy->data(), static_cast<size_t>(n)}}));
  PSFLOW_ASSERT_OK(
      gpu_->CopyToHostAfter(first.get(), {{x->data(), hx->data(), static_cast<size_t>(n)}}));
  PSFLOW_ASSERT_OK(gpu_->WaitCopies());
  EXPECT_EQ(std::vector<float>(hx->data(), hx->data() + n), std::vector<float>(n, 1.0f));
  EXPECT_EQ(std::vector<float>(hy->data(), hy->data() + n), std::vector<float>(n, 2.0f));
  // An event inside a graph: each replay records it.
  // (The lambda names b's members: Clang 14 does not capture structured bindings.)
  auto graph = gpu_->Capture([&]() -> absl::Status {
    for (int k = 0; k < 4; ++k) {
      if (absl::Status s = gpu_->Affine(b.y->data(), 1.0f, 1.0f, b.y->data(), n); !s.ok()) return s;
    }
    return gpu_->RecordEvent(b.second.get());
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (float want : {6.0f, 10.0f}) {
    PSFLOW_ASSERT_OK((*graph)->Launch());
    PSFLOW_ASSERT_OK(
        gpu_->CopyToHostAfter(second.get(), {{y->data(), hy->data(), static_cast<size_t>(n)}}));
    PSFLOW_ASSERT_OK(gpu_->WaitCopies());
    EXPECT_EQ(std::vector<float>(hy->data(), hy->data() + n), std::vector<float>(n, want));
  }
  EXPECT_EQ(
      gpu_->CopyToHostAfter(nullptr, {{x->data(), hx->data(), static_cast<size_t>(n)}}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      gpu_->CopyToHostAfter(first.get(), {{nullptr, hx->data(), static_cast<size_t>(n)}}).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cpu_->CopyToHostAfter(first.get(), {{x->data(), hx->data(), static_cast<size_t>(n)}}).code(),
      absl::StatusCode::kUnimplemented);
}

// A worker pushing during the backward pass waits for each bucket's copies
// alone: an event recorded after some copies passes once they are in host
// memory, whatever is queued after them.
TEST_F(CudaParityTest, AnEventAfterCopiesPassesOnceTheyAreDone) {
  CopyBuffers b(*gpu_, int64_t{1} << 22);
  const int64_t n = b.n;
  auto [x, y, hx, hy] = std::tie(b.x, b.y, b.hx, b.hy);
  auto [first, second] = std::tie(b.first, b.second);
  auto x_copied = gpu_->CreateEvent().value();
  auto y_copied = gpu_->CreateEvent().value();
  for (float want : {1.0f, 2.0f}) {  // twice: the events are recorded again
    PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 0.0f, want, x->data(), n));
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(first.get()));
    for (int k = 0; k < 16; ++k) {
      PSFLOW_ASSERT_OK(gpu_->Affine(y->data(), 0.0f, want + k, y->data(), n));
    }
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(second.get()));
    PSFLOW_ASSERT_OK(
        gpu_->CopyToHostAfter(first.get(), {{x->data(), hx->data(), static_cast<size_t>(n)}}));
    PSFLOW_ASSERT_OK(gpu_->RecordCopiesDone(x_copied.get()));
    PSFLOW_ASSERT_OK(
        gpu_->CopyToHostAfter(second.get(), {{y->data(), hy->data(), static_cast<size_t>(n)}}));
    PSFLOW_ASSERT_OK(gpu_->RecordCopiesDone(y_copied.get()));
    PSFLOW_ASSERT_OK(gpu_->WaitEvent(x_copied.get()));
    EXPECT_EQ(std::vector<float>(hx->data(), hx->data() + n), std::vector<float>(n, want));
    // From another thread, as the worker's training thread does.
    absl::Status waited;
    std::thread([&] { waited = gpu_->WaitEvent(y_copied.get()); }).join();
    PSFLOW_ASSERT_OK(waited);
    EXPECT_EQ(std::vector<float>(hy->data(), hy->data() + n), std::vector<float>(n, want + 15));
  }
  EXPECT_EQ(gpu_->RecordCopiesDone(nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->WaitEvent(nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu_->RecordCopiesDone(x_copied.get()).code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu_->WaitEvent(x_copied.get()).code(), absl::StatusCode::kUnimplemented);
}

// Weights pulled during a step go to the device on a stream of their own:
// each copy waits for its event (not for the rest of the queued work), and
// the backend's stream waits for the copies only from JoinUploads on;
// Synchronize waits for them too.
TEST_F(CudaParityTest, UploadsWaitForTheirEventAndJoinTheStreamOnRequest) {
  CopyBuffers b(*gpu_, int64_t{1} << 22);
  const int64_t n = b.n;
  auto [x, y, hx, hy] = std::tie(b.x, b.y, b.hx, b.hy);
  const size_t count = static_cast<size_t>(n);
  for (float want : {2.0f, 5.0f}) {  // twice: the event is recorded again
    std::fill(hx->data(), hx->data() + n, want);
    // x is rewritten many times before the event: the upload lands after.
    for (int k = 0; k < 16; ++k)
      PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 0.0f, -1.0f - k, x->data(), n));
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(b.first.get()));
    PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(b.first.get(), hx->data(), count, x->data()));
    // Work queued after the join reads what the upload wrote.
    PSFLOW_ASSERT_OK(gpu_->JoinUploads());
    PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 1.0f, 1.0f, y->data(), n));
    EXPECT_EQ(Download(*gpu_, y->data(), n), std::vector<float>(n, want + 1));
  }
  // Inside a graph: each launch records the event, and the upload after it
  // lands after the graph's writes before the event.
  auto graph = gpu_->Capture([&]() -> absl::Status {
    for (int k = 0; k < 8; ++k) {
      if (absl::Status s = gpu_->Affine(b.x->data(), 0.0f, 7.0f + k, b.x->data(), n); !s.ok())
        return s;
    }
    return gpu_->RecordEvent(b.second.get());
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (float want : {-3.0f, 11.0f}) {
    std::fill(hy->data(), hy->data() + n, want);
    PSFLOW_ASSERT_OK((*graph)->Launch());
    PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(b.second.get(), hy->data(), count, x->data()));
    // Synchronize waits for the upload as well.
    PSFLOW_ASSERT_OK(gpu_->Synchronize());
    std::fill(hx->data(), hx->data() + n, 0.0f);
    PSFLOW_ASSERT_OK(gpu_->CopyToHost(x->data(), count, hx->data()));
    EXPECT_EQ(std::vector<float>(hx->data(), hx->data() + n), std::vector<float>(n, want));
  }
  // No event: at once; joined, then read on the backend's stream.
  std::fill(hx->data(), hx->data() + n, 4.0f);
  PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(nullptr, hx->data(), count, y->data()));
  PSFLOW_ASSERT_OK(gpu_->JoinUploads());
  EXPECT_EQ(Download(*gpu_, y->data(), n), std::vector<float>(n, 4.0f));
  PSFLOW_ASSERT_OK(gpu_->JoinUploads());  // nothing to join: a no-op
  EXPECT_EQ(gpu_->CopyToDeviceAfter(b.first.get(), nullptr, count, x->data()).code(),
            absl::StatusCode::kInvalidArgument);
  // The CPU runs its work at once: the copy is a plain one, whatever the event.
  std::vector<float> from(16, 9.0f), to(16, 0.0f);
  PSFLOW_ASSERT_OK(cpu_->CopyToDeviceAfter(nullptr, from.data(), 16, to.data()));
  PSFLOW_ASSERT_OK(cpu_->JoinUploads());
  EXPECT_EQ(to, from);
}

// Memory the backend did not allocate (a shared region, where a worker's
// pulls leave weights) is registered for its copies: an upload from it
// waits for its event like any other, and RecordUploadsDone marks when the
// region may change again. Twice, then unregistered.
TEST_F(CudaParityTest, UploadsFromARegisteredSharedRegion) {
  const Backend::HostPinning pinning = gpu_->host_pinning();
  ASSERT_NE(pinning.pin, nullptr);
  ASSERT_NE(pinning.unpin, nullptr);
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(int64_t{16} << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  const SharedSpan span = (*region)->data();
  ASSERT_TRUE(pinning.pin(span.data, static_cast<size_t>(span.size)));
  const int64_t n = span.size / static_cast<int64_t>(sizeof(float));
  float* const host = reinterpret_cast<float*>(span.data);
  auto x = gpu_->Allocate(static_cast<size_t>(n)).value();
  auto ready = gpu_->CreateEvent().value();
  auto done = gpu_->CreateEvent().value();
  for (float want : {3.0f, -1.0f}) {
    std::fill(host, host + n, want);
    for (int k = 0; k < 8; ++k)
      PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 0.0f, -1.0f - k, x->data(), n));
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(ready.get()));
    PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(ready.get(), host, static_cast<size_t>(n), x->data()));
    PSFLOW_ASSERT_OK(gpu_->RecordUploadsDone(done.get()));
    PSFLOW_ASSERT_OK(gpu_->WaitEvent(done.get()));
    std::fill(host, host + n, 0.0f);  // the upload is done: the region may change
    PSFLOW_ASSERT_OK(gpu_->JoinUploads());
    EXPECT_EQ(Download(*gpu_, x->data(), static_cast<size_t>(n)),
              std::vector<float>(static_cast<size_t>(n), want));
  }
  pinning.unpin(span.data);
  EXPECT_EQ(gpu_->RecordUploadsDone(nullptr).code(), absl::StatusCode::kInvalidArgument);
  // The CPU has nothing to register, and no events.
  EXPECT_EQ(cpu_->host_pinning().pin, nullptr);
  EXPECT_EQ(cpu_->RecordUploadsDone(done.get()).code(), absl::StatusCode::kUnimplemented);
}

// 16-bit values cross as they are and are widened on the device, exactly
// as the host decodes them (common/float16.h), after their event; a larger
// copy after a smaller one grows the device buffer they pass through.
TEST_F(CudaParityTest, HalvesCopiedToTheDeviceAreWidenedExactly) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  auto ready = gpu_->CreateEvent().value();
  for (const bool bf16 : {true, false}) {
    const DataType dtype = bf16 ? DT_BFLOAT16 : DT_HALF;
    for (const size_t n : {size_t{1000}, size_t{300000}, size_t{7}}) {
      std::vector<float> values(n);
      for (float& v : values) v = normal(rng);
      values[0] = std::numeric_limits<float>::infinity();
      auto host = gpu_->AllocateHost((n + 1) / 2).value();  // n 16-bit values
      auto* halves = reinterpret_cast<uint16_t*>(host->data());
      EncodeFloats(dtype, values.data(), static_cast<int64_t>(n), reinterpret_cast<char*>(halves));
      std::vector<float> want(n);
      DecodeFloats(dtype, reinterpret_cast<const char*>(halves), static_cast<int64_t>(n),
                   want.data());
      auto x = gpu_->Allocate(n).value();
      PSFLOW_ASSERT_OK(gpu_->Affine(x->data(), 0.0f, 42.0f, x->data(), static_cast<int64_t>(n)));
      PSFLOW_ASSERT_OK(gpu_->RecordEvent(ready.get()));
      PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(
          {{ready.get(), halves, n, x->data()}},
          bf16 ? Backend::HostValues::kBfloat16 : Backend::HostValues::kHalf));
      PSFLOW_ASSERT_OK(gpu_->JoinUploads());
      EXPECT_EQ(Download(*gpu_, x->data(), n), want) << (bf16 ? "bf16 " : "fp16 ") << n;
    }
  }
  EXPECT_EQ(
      gpu_->CopyToDeviceAfter({{nullptr, nullptr, 4, nullptr}}, Backend::HostValues::kBfloat16)
          .code(),
      absl::StatusCode::kInvalidArgument);
  std::vector<uint16_t> some(4);
  std::vector<float> out(4);
  EXPECT_EQ(
      cpu_->CopyToDeviceAfter({{nullptr, some.data(), 4, out.data()}}, Backend::HostValues::kHalf)
          .code(),
      absl::StatusCode::kUnimplemented);
}

// Gradients rounded to 16 bits on the device (NarrowToHalves) are the bits
// the host encodes (common/float16.h): to nearest even, halfway cases,
// values too small for the format (zero or subnormal) and too large for it
// (infinity) alike; eagerly and in a recorded graph.
TEST_F(CudaParityTest, ValuesNarrowedOnTheDeviceAreTheHostsEncoding) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  for (const size_t n : {size_t{1001}, size_t{300000}}) {
    std::vector<float> values(n);
    for (float& v : values) v = std::ldexp(normal(rng), exponent(rng));
    // Exactly halfway between two bf16 values (even below, then odd), and
    // between two fp16 ones; fp16's overflow boundary; infinities; tiny.
    const float specials[] = {1.0f + 0x1p-8f,
                              1.0f + 3 * 0x1p-8f,
                              1.0f + 0x1p-11f,
                              65519.0f,
                              65520.0f,
                              -70000.0f,
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              0x1p-25f,
                              0x1p-24f * 1.5f,
                              -0.0f,
                              std::numeric_limits<float>::max(),
                              1e-40f};
    std::copy(std::begin(specials), std::end(specials), values.begin());
    auto x = Upload(*gpu_, values);
    const size_t floats = (n + 1) / 2;  // that hold the n 16-bit values
    for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
      std::vector<char> want(n * 2);
      EncodeFloats(dtype, values.data(), static_cast<int64_t>(n), want.data());
      for (const bool in_graph : {false, true}) {
        auto y = gpu_->Allocate(floats).value();
        auto* halves = reinterpret_cast<uint16_t*>(y->data());
        const bool bf16 = dtype == DT_BFLOAT16;
        if (in_graph) {
          auto graph = gpu_->Capture([&] {
            return gpu_->NarrowToHalves(x->data(), static_cast<int64_t>(n), bf16, halves);
          });
          ASSERT_TRUE(graph.ok()) << graph.status();
          PSFLOW_ASSERT_OK((*graph)->Launch());
        } else {
          PSFLOW_ASSERT_OK(gpu_->NarrowToHalves(x->data(), static_cast<int64_t>(n), bf16, halves));
        }
        const std::vector<float> got_floats = Download(*gpu_, y->data(), floats);
        const char* got = reinterpret_cast<const char*>(got_floats.data());
        size_t differ = 0, first = n;
        for (size_t i = 0; i < n; ++i) {
          if (std::memcmp(got + 2 * i, want.data() + 2 * i, 2) != 0) {
            ++differ;
            first = std::min(first, i);
          }
        }
        EXPECT_EQ(differ, 0u) << DataType_Name(dtype) << (in_graph ? " in a graph" : "") << ", n "
                              << n << ", first at " << first << " ("
                              << (first < n ? values[first] : 0.0f) << ")";
      }
    }
  }
  std::vector<uint16_t> out(4);
  EXPECT_EQ(gpu_->NarrowToHalves(nullptr, 4, true, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<float> in(4);
  EXPECT_EQ(cpu_->NarrowToHalves(in.data(), 4, true, out.data()).code(),
            absl::StatusCode::kUnimplemented);
}

// A batch of uploads (the slices of one pull) lands each in its own place,
// floats as they are and 16-bit values widened exactly as the host decodes
// them, after the events of the batch: ranges close together in host
// memory, one far away (floats: copied straight to their place), one
// before the others, an empty one, and more than one kernel's worth.
TEST_F(CudaParityTest, BatchedUploadsLandInTheirPlacesAfterTheirEvents) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  constexpr size_t kValues = 600000;
  auto host = gpu_->AllocateHost(kValues).value();
  std::vector<float> values(kValues);
  for (float& v : values) v = normal(rng);
  constexpr int kPieces = 70;
  constexpr size_t kStride = 30000;  // floats of the device buffer per piece
  auto y = gpu_->Allocate(kPieces * kStride).value();
  auto first = gpu_->CreateEvent().value();
  auto second = gpu_->CreateEvent().value();
  using Values = Backend::HostValues;
  for (const Values kind : {Values::kFloat, Values::kBfloat16, Values::kHalf}) {
    const char* const name = kind == Values::kFloat      ? "fp32"
                             : kind == Values::kBfloat16 ? "bf16"
                                                         : "fp16";
    // What each value should become on the device, and the host's bytes.
    std::vector<float> expected = values;
    size_t value_bytes = sizeof(float);
    if (kind == Values::kFloat) {
      std::copy(values.begin(), values.end(), host->data());
    } else {
      const DataType dtype = kind == Values::kBfloat16 ? DT_BFLOAT16 : DT_HALF;
      EncodeFloats(dtype, values.data(), kValues, reinterpret_cast<char*>(host->data()));
      DecodeFloats(dtype, reinterpret_cast<const char*>(host->data()), kValues, expected.data());
      value_bytes = sizeof(uint16_t);
    }
    const char* const bytes = reinterpret_cast<const char*>(host->data());
    std::vector<Backend::Upload> uploads;
    std::vector<size_t> at(kPieces), count(kPieces);
    for (int k = 0; k < kPieces; ++k) {
      at[k] = static_cast<size_t>(k) * 5000 + (k % 3) * 7;
      count[k] = 1000 + static_cast<size_t>(k) * 13;
    }
    at[68] = 100;     // before the others
    at[69] = 500000;  // far from them
    count[69] = 20000;
    count[67] = 0;
    // The destination is overwritten by work queued before the events: a
    // copy or kernel that did not wait for them would be overwritten too.
    PSFLOW_ASSERT_OK(gpu_->Affine(y->data(), 0.0f, 42.0f, y->data(), kPieces * kStride));
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(first.get()));
    for (int k = 0; k < 8; ++k) {
      PSFLOW_ASSERT_OK(gpu_->Affine(y->data(), 1.0f, 0.0f, y->data(), kPieces * kStride));
    }
    PSFLOW_ASSERT_OK(gpu_->RecordEvent(second.get()));
    for (int k = 0; k < kPieces; ++k) {
      uploads.push_back({k % 2 == 0 ? first.get() : second.get(), bytes + at[k] * value_bytes,
                         count[k], y->data() + k * kStride, host.get()});
    }
    PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(uploads, kind));
    PSFLOW_ASSERT_OK(gpu_->JoinUploads());
    const std::vector<float> got = Download(*gpu_, y->data(), kPieces * kStride);
    for (int k = 0; k < kPieces; ++k) {
      const float* g = got.data() + k * kStride;
      EXPECT_EQ(std::vector<float>(g, g + count[k]),
                std::vector<float>(expected.begin() + at[k], expected.begin() + at[k] + count[k]))
          << name << " piece " << k;
      EXPECT_EQ(g[count[k]], 42.0f) << name << " piece " << k << " wrote past its end";
    }
  }
  // Uploads of separate allocations (made one after another, as a worker's
  // staging buffers are: they may lie next to each other) each cross on
  // their own: one copy over two of them would be refused.
  constexpr size_t kApart = 70000;  // floats of each
  std::vector<std::unique_ptr<Buffer>> apart;
  std::vector<Backend::Upload> uploads;
  for (int k = 0; k < 8; ++k) {
    apart.push_back(gpu_->AllocateHost(kApart).value());
    std::fill(apart.back()->data(), apart.back()->data() + kApart, static_cast<float>(k + 1));
    uploads.push_back({nullptr, apart.back()->data(), kApart, y->data() + k * kApart});
  }
  for (const bool named : {false, true}) {
    // No block named, or each allocation named as its own block.
    for (int k = 0; k < 8; ++k) uploads[k].block = named ? apart[k].get() : nullptr;
    PSFLOW_ASSERT_OK(gpu_->Affine(y->data(), 0.0f, 42.0f, y->data(), kPieces * kStride));
    PSFLOW_ASSERT_OK(gpu_->CopyToDeviceAfter(uploads, Values::kFloat));
    PSFLOW_ASSERT_OK(gpu_->JoinUploads());
    const std::vector<float> got = Download(*gpu_, y->data(), 8 * kApart);
    for (int k = 0; k < 8; ++k) {
      EXPECT_EQ(std::vector<float>(got.begin() + k * kApart, got.begin() + (k + 1) * kApart),
                std::vector<float>(kApart, static_cast<float>(k + 1)))
          << "allocation " << k;
    }
  }
  EXPECT_EQ(gpu_->CopyToDeviceAfter({{nullptr, nullptr, 4, y->data()}}, Values::kBfloat16).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->CopyToDeviceAfter({{nullptr, host->data(), 4, nullptr}}, Values::kFloat).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaParityTest, CaptureReturnsTheWorksError) {
  auto buffer = gpu_->Allocate(16).value();
  auto graph = gpu_->Capture([&]() -> absl::Status {
    if (absl::Status s = gpu_->Affine(buffer->data(), 1.0f, 1.0f, buffer->data(), 16); !s.ok()) {
      return s;
    }
    return absl::DataLossError("stop here");
  });
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(graph.status().message(), "stop here");
  // The capture was ended: the stream runs work again (and the recorded
  // Affine never ran).
  PSFLOW_ASSERT_OK(gpu_->Affine(buffer->data(), 1.0f, 3.0f, buffer->data(), 16));
  EXPECT_EQ(Download(*gpu_, buffer->data(), 16), std::vector<float>(16, 3.0f));
}

TEST_F(CudaParityTest, CaptureOfAHostCopyFailsAndTheBackendRecovers) {
  auto buffer = gpu_->Allocate(16).value();
  std::vector<float> host(16);
  auto graph =
      gpu_->Capture([&] { return gpu_->CopyToHost(buffer->data(), host.size(), host.data()); });
  EXPECT_FALSE(graph.ok());
  PSFLOW_ASSERT_OK(gpu_->Affine(buffer->data(), 1.0f, 5.0f, buffer->data(), 16));
  EXPECT_EQ(Download(*gpu_, buffer->data(), 16), std::vector<float>(16, 5.0f));
}

// A small network's whole training step (conv, batch norm with its batch
// statistics written out and an inference pass with them, relu, max pool,
// global average pooling, dense, softmax cross-entropy, their backward passes
// and SGD) on one backend. (Parity of each op with the CPU is tested above;
// the step compares a replayed graph with the same step run eagerly.)
class MiniNet {
 public:
  static constexpr int kN = 4, kC = 3, kH = 8, kK = 8, kClasses = 5;
  static constexpr float kLearningRate = 0.1f;

  // The buffers, in the order of Sizes().
  // clang-format off
  enum Name {
    kX, kLabels, kWc, kBc, kGamma, kBeta, kWd, kBd, kInputs,  // inputs and parameters
    kY1 = kInputs, kY2, kY3, kY4, kY5, kLogits, kProbs, kStats,  // forward
    kDLogits, kD5, kD4, kD3, kD2, kD1, kDWc, kDBc, kDGamma, kDBeta, kDWd, kDBd,  // backward
    kBatchMean, kBatchVar, kYInfer,  // batch statistics, and inference with them
    kCount
  };
  // clang-format on
  static std::vector<size_t> Sizes() {
    constexpr size_t act = kN * kK * kH * kH, pooled = kN * kK * (kH / 2) * (kH / 2);
    constexpr size_t wc = kK * kC * 9, wd = kClasses * kK, logits = kN * kClasses;
    // clang-format off
    return {kN * kC * kH * kH, kN, wc, kK, kK, kK, wd, kClasses,
            act, act, act, pooled, kN * kK, logits, logits, 2,
            logits, kN * kK, pooled, act, act, act, wc, kK, kK, kK, wd, kClasses,
            kK, kK, act};
    // clang-format on
  }

  explicit MiniNet(Backend& backend) : backend_(backend) {
    conv_ = backend.CreateConv2D(Conv2DShape{kN, kC, kH, kH, kK, 3, 3, 1, 1}).value();
    norm_ = backend.CreateBatchNorm(BatchNormShape{kN, kK, kH, kH}).value();
    relu_ = backend.CreateRelu(kN * kK * kH * kH).value();
    pool_ = backend.CreateMaxPool2D(Pool2DShape{kN, kK, kH, kH, 2, 2}).value();
    gap_ = backend.CreateGlobalAvgPool(GlobalAvgPoolShape{kN, kK, kH / 2, kH / 2}).value();
    dense_ = backend.CreateDense(DenseShape{kN, kK, kClasses}).value();
    loss_ = backend.CreateSoftmaxCrossEntropy(kN, kClasses).value();
    for (size_t size : Sizes()) buffers_.push_back(backend.Allocate(size).value());
  }

  float* at(int name) { return buffers_[name]->data(); }

  absl::Status QueueStep() {
    const int32_t* labels = Labels(at(kLabels));
    std::vector<absl::Status> s;
    s.push_back(conv_->Forward(at(kX), at(kWc), at(kBc), at(kY1)));
    s.push_back(
        norm_->Forward(at(kY1), at(kGamma), at(kBeta), at(kY2), at(kBatchMean), at(kBatchVar)));
    s.push_back(
        norm_->Infer(at(kY1), at(kGamma), at(kBeta), at(kBatchMean), at(kBatchVar), at(kYInfer)));
    s.push_back(relu_->Forward(at(kY2), at(kY3)));
    s.push_back(pool_->Forward(at(kY3), at(kY4)));
    s.push_back(gap_->Forward(at(kY4), at(kY5)));
    s.push_back(dense_->Forward(at(kY5), at(kWd), at(kBd), at(kLogits)));
    s.push_back(loss_->Forward(at(kLogits), labels, at(kProbs), at(kStats)));
    s.push_back(loss_->Backward(at(kProbs), labels, at(kDLogits)));
    s.push_back(dense_->Backward(at(kY5), at(kWd), at(kDLogits), at(kD5), at(kDWd), at(kDBd)));
    s.push_back(gap_->Backward(at(kD5), at(kD4)));
    s.push_back(pool_->Backward(at(kD4), at(kD3)));
    s.push_back(relu_->Backward(at(kY2), at(kD3), at(kD2)));
    s.push_back(norm_->Backward(at(kY1), at(kGamma), at(kD2), at(kD1), at(kDGamma), at(kDBeta)));
    s.push_back(conv_->Backward(at(kX), at(kWc), at(kD1), nullptr, at(kDWc), at(kDBc)));
    for (auto [param, grad] : {std::pair{kWc, kDWc},
                               {kBc, kDBc},
                               {kGamma, kDGamma},
                               {kBeta, kDBeta},
                               {kWd, kDWd},
                               {kBd, kDBd}}) {
      s.push_back(backend_.Sgd(at(param), at(grad), kLearningRate,
                               static_cast<int64_t>(buffers_[param]->size())));
    }
    for (const absl::Status& status : s) {
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }

 private:
  Backend& backend_;
  std::unique_ptr<Conv2D> conv_;
  std::unique_ptr<BatchNorm> norm_;
  std::unique_ptr<Relu> relu_;
  std::unique_ptr<MaxPool2D> pool_;
  std::unique_ptr<GlobalAvgPool> gap_;
  std::unique_ptr<Dense> dense_;
  std::unique_ptr<SoftmaxCrossEntropy> loss_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

TEST_F(CudaParityTest, CapturedTrainingStepMatchesEager) {
  const std::vector<size_t> sizes = MiniNet::Sizes();
  ASSERT_EQ(sizes.size(), size_t{MiniNet::kCount});
  MiniNet net(*gpu_);
  using Values = std::vector<std::vector<float>>;  // one per buffer
  auto make_inputs = [&] {
    Values inputs;
    for (int name = 0; name < MiniNet::kInputs; ++name) {
      inputs.push_back(Random(sizes[name]));
      if (name == MiniNet::kLabels) {
        for (float& v : inputs.back()) {
          const int32_t label = static_cast<int32_t>(gen_() % MiniNet::kClasses);
          std::memcpy(&v, &label, sizeof label);
        }
      }
    }
    return inputs;
  };
  // Loads the inputs, poisons the rest, runs `step` and returns every buffer.
  auto run = [&](const Values& inputs, const std::function<absl::Status()>& step) {
    for (int name = 0; name < MiniNet::kCount; ++name) {
      const std::vector<float> values =
          name < MiniNet::kInputs
              ? inputs[name]
              : std::vector<float>(sizes[name], std::numeric_limits<float>::quiet_NaN());
      EXPECT_TRUE(gpu_->CopyToDevice(values.data(), values.size(), net.at(name)).ok());
    }
    const absl::Status status = step();
    EXPECT_TRUE(status.ok()) << status;
    Values all;
    for (int name = 0; name < MiniNet::kCount; ++name) {
      all.push_back(Download(*gpu_, net.at(name), sizes[name]));
    }
    return all;
  };
  auto expect_same = [&](const Values& eager, const Values& replayed) {
    for (int name = 0; name < MiniNet::kCount; ++name) {
      const std::vector<float>& e = eager[name];
      const std::vector<float>& g = replayed[name];
      for (size_t i = 0; i < sizes[name]; ++i) {
        ASSERT_TRUE(std::isfinite(g[i])) << "buffer " << name << "[" << i << "] not written";
      }
      // An all-zero eager buffer must be replayed exactly (a relative bound
      // of 0 times its norm).
      const bool all_zero = std::all_of(e.begin(), e.end(), [](float v) { return v == 0.0f; });
      EXPECT_LE(RelativeL2(e, g), all_zero ? 0.0 : kTol) << "buffer " << name;
    }
  };

  // The eager run comes first: ops must have run before they are recorded.
  const Values inputs_a = make_inputs(), inputs_b = make_inputs();
  const Values eager_a = run(inputs_a, [&] { return net.QueueStep(); });
  auto graph = gpu_->Capture([&] { return net.QueueStep(); });
  ASSERT_TRUE(graph.ok()) << graph.status();
  expect_same(eager_a, run(inputs_a, [&] { return (*graph)->Launch(); }));
  // New contents of the same buffers.
  const Values eager_b = run(inputs_b, [&] { return net.QueueStep(); });
  expect_same(eager_b, run(inputs_b, [&] { return (*graph)->Launch(); }));
}

// ------------------------------------------------------------ device names (no GPU needed)

TEST(CudaDeviceNameTest, MalformedIndexIsInvalidArgument) {
  for (const char* device : {"cuda:x", "cuda:", "cuda:-1", "cuda:+1", "cuda: 1", "cuda:1x",
                             "cuda:0x1", "cuda:99999999999"}) {
    auto backend = CreateBackend(device);
    ASSERT_FALSE(backend.ok()) << device;
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument) << device;
    EXPECT_THAT(backend.status().message(), HasSubstr(device));
  }
}

TEST(CudaDeviceNameTest, MissingGpuIsUnavailable) {
  auto backend = CreateBackend("cuda:99");
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable) << backend.status();
  EXPECT_THAT(std::string(backend.status().message()), StartsWith("cuda:99: "));
  EXPECT_EQ(backend.status().message().find('\n'), absl::string_view::npos);
}

TEST(CudaDeviceNameTest, UnknownDeviceListsCuda) {
  auto backend = CreateBackend("gpu");
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend.status().message(), HasSubstr("cpu, cuda:N"));
}

}  // namespace
}  // namespace psflow::kernels
