// Tests of the oneDNN CPU backend: every op forward and backward against plain
// loop references, finite-difference gradient checks, primitive reuse with
// re-pointed memory, and the error paths.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cpu_count.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "tests/kernels/status_testing.h"

namespace psflow::kernels {
namespace {

using ::testing::HasSubstr;
using Ref = std::vector<double>;

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& f : v) f = dist(gen);
  return v;
}

// Expects |got - want| <= rtol * (1 + |want|) elementwise; reports the first few misses.
void ExpectClose(const std::vector<float>& got, const Ref& want, const std::string& what,
                 double rtol = 1e-4) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= rtol * (1 + std::abs(want[i])))) {
      if (++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ";
}

// ------------------------------------------------------------ references

size_t Idx(int a, int b, int c, int d, int B, int C, int D) {
  return ((static_cast<size_t>(a) * B + b) * C + c) * D + d;
}

Ref ConvForwardRef(const Conv2DShape& s, const std::vector<float>& x, const std::vector<float>& w,
                   const std::vector<float>& b) {
  const int P = s.out_height(), Q = s.out_width();
  Ref y(static_cast<size_t>(s.batch) * s.out_channels * P * Q);
  for (int n = 0; n < s.batch; ++n)
    for (int k = 0; k < s.out_channels; ++k)
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) {
          double acc = b[k];
          for (int c = 0; c < s.in_channels; ++c)
            for (int r = 0; r < s.kernel_h; ++r)
              for (int t = 0; t < s.kernel_w; ++t) {
                const int ih = p * s.stride - s.padding + r, iw = q * s.stride - s.padding + t;
                if (ih < 0 || ih >= s.height || iw < 0 || iw >= s.width) continue;
                acc += double{x[Idx(n, c, ih, iw, s.in_channels, s.height, s.width)]} *
                       w[Idx(k, c, r, t, s.in_channels, s.kernel_h, s.kernel_w)];
              }
          y[Idx(n, k, p, q, s.out_channels, P, Q)] = acc;
        }
  return y;
}

struct Grads {
  Ref dx, dw, db;
};

Grads ConvBackwardRef(const Conv2DShape& s, const std::vector<float>& x,
                      const std::vector<float>& w, const std::vector<float>& dy) {
  const int P = s.out_height(), Q = s.out_width();
  Grads g{Ref(x.size()), Ref(w.size()), Ref(s.out_channels)};
  for (int n = 0; n < s.batch; ++n)
    for (int k = 0; k < s.out_channels; ++k)
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) {
          const double d = dy[Idx(n, k, p, q, s.out_channels, P, Q)];
          g.db[k] += d;
          for (int c = 0; c < s.in_channels; ++c)
            for (int r = 0; r < s.kernel_h; ++r)
              for (int t = 0; t < s.kernel_w; ++t) {
                const int ih = p * s.stride - s.padding + r, iw = q * s.stride - s.padding + t;
                if (ih < 0 || ih >= s.height || iw < 0 || iw >= s.width) continue;
                const size_t xi = Idx(n, c, ih, iw, s.in_channels, s.height, s.width);
                const size_t wi = Idx(k, c, r, t, s.in_channels, s.kernel_h, s.kernel_w);
                g.dx[xi] += d * w[wi];
                g.dw[wi] += d * x[xi];
              }
        }
  return g;
}

// Forward and backward of max pooling; backward routes dy to the first maximum.
void PoolRef(const Pool2DShape& s, const std::vector<float>& x, const std::vector<float>& dy,
             Ref* y, Ref* dx) {
  const int P = s.out_height(), Q = s.out_width();
  y->assign(static_cast<size_t>(s.batch) * s.channels * P * Q, 0);
  dx->assign(x.size(), 0);
  for (int n = 0; n < s.batch; ++n)
    for (int c = 0; c < s.channels; ++c)
      for (int p = 0; p < P; ++p)
        for (int q = 0; q < Q; ++q) {
          size_t best = Idx(n, c, p * s.stride, q * s.stride, s.channels, s.height, s.width);
          for (int r = 0; r < s.window; ++r)
            for (int t = 0; t < s.window; ++t) {
              const size_t i =
                  Idx(n, c, p * s.stride + r, q * s.stride + t, s.channels, s.height, s.width);
              if (x[i] > x[best]) best = i;
            }
          const size_t o = Idx(n, c, p, q, s.channels, P, Q);
          (*y)[o] = x[best];
          if (!dy.empty()) (*dx)[best] += dy[o];
        }
}

Ref DenseForwardRef(const DenseShape& s, const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<float>& b) {
  Ref y(static_cast<size_t>(s.batch) * s.out_features);
  for (int n = 0; n < s.batch; ++n)
    for (int o = 0; o < s.out_features; ++o) {
      double acc = b[o];
      for (int i = 0; i < s.in_features; ++i)
        acc += double{x[n * s.in_features + i]} * w[o * s.in_features + i];
      y[n * s.out_features + o] = acc;
    }
  return y;
}

Grads DenseBackwardRef(const DenseShape& s, const std::vector<float>& x,
                       const std::vector<float>& w, const std::vector<float>& dy) {
  Grads g{Ref(x.size()), Ref(w.size()), Ref(s.out_features)};
  for (int n = 0; n < s.batch; ++n)
    for (int o = 0; o < s.out_features; ++o) {
      const double d = dy[n * s.out_features + o];
      g.db[o] += d;
      for (int i = 0; i < s.in_features; ++i) {
        g.dx[n * s.in_features + i] += d * w[o * s.in_features + i];
        g.dw[o * s.in_features + i] += d * x[n * s.in_features + i];
      }
    }
  return g;
}

// ------------------------------------------------------------ fixture

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = CreateBackend("cpu");
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(*backend);
  }

  std::unique_ptr<Buffer> Upload(const std::vector<float>& host) {
    auto buffer = backend_->Allocate(host.size()).value();
    EXPECT_TRUE(backend_->CopyToDevice(host.data(), host.size(), buffer->data()).ok());
    return buffer;
  }
  // A buffer of n copies of `value` (garbage that an overwriting op must replace).
  std::unique_ptr<Buffer> Filled(size_t n, float value) {
    return Upload(std::vector<float>(n, value));
  }
  std::vector<float> Download(Buffer& buffer) {
    std::vector<float> host(buffer.size());
    EXPECT_TRUE(backend_->CopyToHost(buffer.data(), host.size(), host.data()).ok());
    return host;
  }
  // Labels live in a Buffer of N floats that holds their int32 bits. CPU
  // buffers are host memory, so the bits are copied straight in.
  std::unique_ptr<Buffer> UploadLabels(const std::vector<int32_t>& labels) {
    static_assert(sizeof(int32_t) == sizeof(float));
    auto buffer = backend_->Allocate(labels.size()).value();
    std::memcpy(buffer->data(), labels.data(), labels.size() * sizeof(int32_t));
    return buffer;
  }
  static const int32_t* Labels(Buffer& buffer) {
    return reinterpret_cast<const int32_t*>(buffer.data());
  }

  std::unique_ptr<Backend> backend_;
};

// Central differences of loss() with respect to each of param[0, n), against
// `analytic`. CPU buffers are host memory, so the test perturbs them in place.
// The step actually taken (after rounding to float) is the denominator.
void CheckGradient(const std::string& what, float* param, size_t n,
                   const std::function<double()>& loss, const std::vector<float>& analytic,
                   float eps, double atol = 2e-3, double rtol = 1e-2) {
  ASSERT_EQ(analytic.size(), n) << what;
  for (size_t i = 0; i < n; ++i) {
    const float orig = param[i], hi = orig + eps, lo = orig - eps;
    param[i] = hi;
    const double loss_hi = loss();
    param[i] = lo;
    const double loss_lo = loss();
    param[i] = orig;
    const double numeric = (loss_hi - loss_lo) / (double{hi} - double{lo});
    EXPECT_NEAR(analytic[i], numeric, atol + rtol * std::abs(numeric)) << what << "[" << i << "]";
  }
}

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += double{a[i]} * b[i];
  return sum;
}

// ------------------------------------------------------------ backend basics

// The description names the kernel threads the backend set: the ones asked
// for, or the cores this process may use.
TEST_F(CpuBackendTest, DescriptionGivesTheKernelThreads) {
  for (const auto& [threads, text] :
       {std::pair{3, std::string("cpu (3 kernel threads)")},
        std::pair{1, std::string("cpu (1 kernel thread)")},
        std::pair{0, absl::StrCat("cpu (", UsableCores(),
                                  UsableCores() == 1 ? " kernel thread)" : " kernel threads)")}}) {
    auto backend = CpuBackend::Create(threads);
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->Description(), text) << threads;
  }
}

TEST_F(CpuBackendTest, NameAndUnknownDevice) {
  EXPECT_EQ(backend_->name(), "cpu");
  auto tpu = CreateBackend("tpu");
  ASSERT_FALSE(tpu.ok());
  EXPECT_EQ(tpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tpu.status().message(), HasSubstr("unknown device 'tpu'"));
  EXPECT_THAT(tpu.status().message(), HasSubstr("supports: cpu"));
}

TEST_F(CpuBackendTest, AllocateAndCopy) {
  auto buffer = backend_->Allocate(1001).value();
  EXPECT_EQ(buffer->size(), 1001u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 64, 0u);
  EXPECT_EQ(Download(*buffer), std::vector<float>(1001, 0.0f));
  const std::vector<float> host = Random(1001, 1);
  ASSERT_TRUE(backend_->CopyToDevice(host.data(), host.size(), buffer->data()).ok());
  EXPECT_EQ(Download(*buffer), host);
  EXPECT_TRUE(backend_->Synchronize().ok());

  auto empty = backend_->Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ((*empty)->size(), 0u);
  EXPECT_EQ(backend_->CopyToDevice(nullptr, 4, buffer->data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ Conv2D

// A named shape for parameterized tests; the name labels the test and its failures.
template <typename Shape>
struct Case {
  const char* name;
  Shape shape;
};
template <typename Shape>
void PrintTo(const Case<Shape>& c, std::ostream* os) {
  *os << c.name;
}
template <typename Shape>
std::string CaseName(const ::testing::TestParamInfo<Case<Shape>>& info) {
  return info.param.name;
}

using ConvCase = Case<Conv2DShape>;
class ConvTest : public CpuBackendTest, public ::testing::WithParamInterface<ConvCase> {};

TEST_P(ConvTest, ForwardAndBackwardMatchReference) {
  const Conv2DShape& s = GetParam().shape;
  auto conv = backend_->CreateConv2D(s);
  ASSERT_TRUE(conv.ok()) << conv.status();
  const size_t nx = static_cast<size_t>(s.batch) * s.in_channels * s.height * s.width;
  const size_t nw = static_cast<size_t>(s.out_channels) * s.in_channels * s.kernel_h * s.kernel_w;
  const size_t ny = static_cast<size_t>(s.batch) * s.out_channels * s.out_height() * s.out_width();
  const auto x = Random(nx, 1), w = Random(nw, 2), b = Random(s.out_channels, 3),
             dy = Random(ny, 4);
  auto xd = Upload(x), wd = Upload(w), bd = Upload(b), dyd = Upload(dy);
  auto yd = Filled(ny, 7), dxd = Filled(nx, 7), dwd = Filled(nw, 7),
       dbd = Filled(s.out_channels, 7);

  ASSERT_TRUE((*conv)->Forward(xd->data(), wd->data(), bd->data(), yd->data()).ok());
  ExpectClose(Download(*yd), ConvForwardRef(s, x, w, b), "y");

  const Grads want = ConvBackwardRef(s, x, w, dy);
  ASSERT_TRUE(
      (*conv)
          ->Backward(xd->data(), wd->data(), dyd->data(), dxd->data(), dwd->data(), dbd->data())
          .ok());
  ExpectClose(Download(*dxd), want.dx, "dx");
  ExpectClose(Download(*dwd), want.dw, "dw");
  ExpectClose(Download(*dbd), want.db, "db");

  // A first layer passes no dx; dw and db are still overwritten.
  auto dw2 = Filled(nw, -3), db2 = Filled(s.out_channels, -3);
  ASSERT_TRUE((*conv)
                  ->Backward(xd->data(), wd->data(), dyd->data(), nullptr, dw2->data(), db2->data())
                  .ok());
  ExpectClose(Download(*dw2), want.dw, "dw (no dx)");
  ExpectClose(Download(*db2), want.db, "db (no dx)");

  // Without bias: b and db null. The same op runs both variants.
  auto y3 = Filled(ny, 7);
  ASSERT_TRUE((*conv)->Forward(xd->data(), wd->data(), nullptr, y3->data()).ok());
  ExpectClose(Download(*y3), ConvForwardRef(s, x, w, std::vector<float>(s.out_channels, 0.0f)),
              "y (no bias)");
  auto dx3 = Filled(nx, 7), dw3 = Filled(nw, 7);
  ASSERT_TRUE((*conv)
                  ->Backward(xd->data(), wd->data(), dyd->data(), dx3->data(), dw3->data(), nullptr)
                  .ok());
  ExpectClose(Download(*dx3), want.dx, "dx (no bias)");
  ExpectClose(Download(*dw3), want.dw, "dw (no bias)");
  auto dw4 = Filled(nw, -3);
  ASSERT_TRUE(
      (*conv)->Backward(xd->data(), wd->data(), dyd->data(), nullptr, dw4->data(), nullptr).ok());
  ExpectClose(Download(*dw4), want.dw, "dw (no bias, no dx)");

  // And back to the bias variant: nothing of the bias-less calls sticks.
  auto y5 = Filled(ny, 7);
  ASSERT_TRUE((*conv)->Forward(xd->data(), wd->data(), bd->data(), y5->data()).ok());
  ExpectClose(Download(*y5), ConvForwardRef(s, x, w, b), "y (bias again)");
}

// Odd sizes throughout; "floor" cases leave input rows/columns no window reaches.
INSTANTIATE_TEST_SUITE_P(Shapes, ConvTest,
                         ::testing::Values(ConvCase{"s1p0", {2, 3, 7, 5, 4, 3, 3, 1, 0}},
                                           ConvCase{"s1p1", {2, 3, 7, 5, 4, 3, 3, 1, 1}},
                                           ConvCase{"s2p0", {2, 3, 9, 7, 4, 3, 3, 2, 0}},
                                           ConvCase{"s2p1", {2, 3, 7, 5, 4, 3, 3, 2, 1}},
                                           ConvCase{"s2p1_floor_rect_kernel",
                                                    {1, 2, 8, 6, 3, 3, 2, 2, 1}},
                                           ConvCase{"s2p0_floor", {3, 1, 8, 8, 2, 3, 3, 2, 0}},
                                           ConvCase{"kernel1x1", {2, 5, 3, 3, 2, 1, 1, 1, 0}},
                                           ConvCase{"kernel_wider_than_input_with_padding",
                                                    {1, 2, 3, 3, 2, 5, 5, 1, 1}}),
                         CaseName<Conv2DShape>);

TEST_F(CpuBackendTest, ConvFiniteDifferences) {
  const Conv2DShape s{2, 2, 5, 5, 3, 3, 3, 2, 1};
  auto conv = backend_->CreateConv2D(s).value();
  const size_t nx = 2 * 2 * 5 * 5, nw = 3 * 2 * 3 * 3, ny = 2 * 3 * 3 * 3;
  auto x = Upload(Random(nx, 5)), w = Upload(Random(nw, 6)), b = Upload(Random(3, 7));
  const auto g = Random(ny, 8);  // L = sum(y * g), so dL/dy = g
  auto gd = Upload(g), y = Filled(ny, 0), dx = Filled(nx, 0), dw = Filled(nw, 0), db = Filled(3, 0);
  ASSERT_TRUE(
      conv->Backward(x->data(), w->data(), gd->data(), dx->data(), dw->data(), db->data()).ok());
  const auto loss = [&] {
    EXPECT_TRUE(conv->Forward(x->data(), w->data(), b->data(), y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), nx, loss, Download(*dx), 1e-2f);
  CheckGradient("dw", w->data(), nw, loss, Download(*dw), 1e-2f);
  CheckGradient("db", b->data(), 3, loss, Download(*db), 1e-2f);
}

TEST_F(CpuBackendTest, ConvWithoutBiasFiniteDifferences) {
  const Conv2DShape s{2, 2, 6, 5, 3, 3, 2, 1, 1};
  auto conv = backend_->CreateConv2D(s).value();
  const size_t nx = 2 * 2 * 6 * 5, nw = 3 * 2 * 3 * 2, ny = 2 * 3 * 6 * 6;
  auto x = Upload(Random(nx, 9)), w = Upload(Random(nw, 10));
  const auto g = Random(ny, 15);
  auto gd = Upload(g), y = Filled(ny, 0), dx = Filled(nx, 0), dw = Filled(nw, 0);
  ASSERT_TRUE(
      conv->Backward(x->data(), w->data(), gd->data(), dx->data(), dw->data(), nullptr).ok());
  const auto loss = [&] {
    EXPECT_TRUE(conv->Forward(x->data(), w->data(), nullptr, y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), nx, loss, Download(*dx), 1e-2f);
  CheckGradient("dw", w->data(), nw, loss, Download(*dw), 1e-2f);
}

// ------------------------------------------------------------ MaxPool2D

using PoolCase = Case<Pool2DShape>;
class PoolTest : public CpuBackendTest, public ::testing::WithParamInterface<PoolCase> {};

TEST_P(PoolTest, ForwardAndBackwardMatchReference) {
  const Pool2DShape& s = GetParam().shape;
  auto pool = backend_->CreateMaxPool2D(s);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const size_t nx = static_cast<size_t>(s.batch) * s.channels * s.height * s.width;
  const size_t ny = static_cast<size_t>(s.batch) * s.channels * s.out_height() * s.out_width();
  const auto x = Random(nx, 11), dy = Random(ny, 12);
  auto xd = Upload(x), dyd = Upload(dy), yd = Filled(ny, 7), dxd = Filled(nx, 7);
  Ref want_y, want_dx;
  PoolRef(s, x, dy, &want_y, &want_dx);

  ASSERT_TRUE((*pool)->Forward(xd->data(), yd->data()).ok());
  ExpectClose(Download(*yd), want_y, "y");
  ASSERT_TRUE((*pool)->Backward(dyd->data(), dxd->data()).ok());
  ExpectClose(Download(*dxd), want_dx, "dx");
}

// "floor" cases leave input rows/columns that no window reaches.
INSTANTIATE_TEST_SUITE_P(Shapes, PoolTest,
                         ::testing::Values(PoolCase{"w2s2", {2, 3, 6, 6, 2, 2}},
                                           PoolCase{"w3s2_overlap", {1, 2, 7, 5, 3, 2}},
                                           PoolCase{"w3s2_overlap_floor", {2, 2, 6, 7, 3, 2}},
                                           PoolCase{"w2s1_overlap", {1, 1, 5, 5, 2, 1}},
                                           PoolCase{"w2s2_floor", {2, 1, 5, 7, 2, 2}}),
                         CaseName<Pool2DShape>);

TEST_F(CpuBackendTest, PoolFiniteDifferences) {
  const Pool2DShape s{1, 2, 7, 7, 3, 2};
  auto pool = backend_->CreateMaxPool2D(s).value();
  const size_t nx = 2 * 7 * 7, ny = 2 * 3 * 3;
  // Distinct values 0.05 apart, so a 1e-3 step never changes which one is the max.
  std::vector<float> xh(nx);
  std::iota(xh.begin(), xh.end(), 0.0f);
  std::shuffle(xh.begin(), xh.end(), std::mt19937(13));
  for (float& v : xh) v *= 0.05f;
  const auto g = Random(ny, 14);
  auto x = Upload(xh), gd = Upload(g), y = Filled(ny, 0), dx = Filled(nx, 0);
  ASSERT_TRUE(pool->Forward(x->data(), y->data()).ok());
  ASSERT_TRUE(pool->Backward(gd->data(), dx->data()).ok());
  const auto loss = [&] {
    EXPECT_TRUE(pool->Forward(x->data(), y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), nx, loss, Download(*dx), 1e-3f);
}

// Ties go to the first largest value in row-major window order, for the
// values and for the gradient; a NaN is its window's maximum.
TEST_F(CpuBackendTest, PoolTiesGoToTheFirstAndNanWins) {
  const Pool2DShape s{1, 1, 2, 4, 2, 2};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Window 0: 1 1 / 1 0 (a three-way tie); window 1: 2 nan / 3 nan.
  auto x = Upload({1, 1, 2, nan, 1, 0, 3, nan});
  auto y = Filled(2, 7), dy = Upload({10, 20}), dx = Filled(8, 7);
  auto pool = backend_->CreateMaxPool2D(s).value();
  ASSERT_TRUE(pool->Forward(x->data(), y->data()).ok());
  const std::vector<float> got = Download(*y);
  EXPECT_EQ(got[0], 1.0f);
  EXPECT_TRUE(std::isnan(got[1]));
  ASSERT_TRUE(pool->Backward(dy->data(), dx->data()).ok());
  const std::vector<float> want_dx = {10, 0, 0, 20, 0, 0, 0, 0};
  EXPECT_EQ(Download(*dx), want_dx);
}

// ------------------------------------------------------------ Relu

TEST_F(CpuBackendTest, ReluMatchesReference) {
  const int64_t n = 1037;
  auto x = Random(n, 21), dy = Random(n, 22);
  for (int64_t i = 0; i < n; i += 97) x[i] = 0.0f;  // the kink: gradient 0 there
  auto relu = backend_->CreateRelu(n);
  ASSERT_TRUE(relu.ok()) << relu.status();
  auto xd = Upload(x), dyd = Upload(dy), yd = Filled(n, 7), dxd = Filled(n, 7);
  Ref want_y(n), want_dx(n);
  for (int64_t i = 0; i < n; ++i) {
    want_y[i] = std::max(x[i], 0.0f);
    want_dx[i] = x[i] > 0 ? dy[i] : 0.0;
  }
  ASSERT_TRUE((*relu)->Forward(xd->data(), yd->data()).ok());
  ExpectClose(Download(*yd), want_y, "y");
  ASSERT_TRUE((*relu)->Backward(xd->data(), dyd->data(), dxd->data()).ok());
  ExpectClose(Download(*dxd), want_dx, "dx");
}

TEST_F(CpuBackendTest, ReluFiniteDifferences) {
  const int64_t n = 64;
  auto xh = Random(n, 23, 0.1f, 1.0f);  // kept away from the kink at 0
  for (int64_t i = 0; i < n; i += 2) xh[i] = -xh[i];
  const auto g = Random(n, 24);
  auto relu = backend_->CreateRelu(n).value();
  auto x = Upload(xh), gd = Upload(g), y = Filled(n, 0), dx = Filled(n, 0);
  ASSERT_TRUE(relu->Backward(x->data(), gd->data(), dx->data()).ok());
  const auto loss = [&] {
    EXPECT_TRUE(relu->Forward(x->data(), y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), n, loss, Download(*dx), 1e-3f);
}

// ------------------------------------------------------------ Dense

using DenseCase = Case<DenseShape>;
class DenseTest : public CpuBackendTest, public ::testing::WithParamInterface<DenseCase> {};

TEST_P(DenseTest, ForwardAndBackwardMatchReference) {
  const DenseShape& s = GetParam().shape;
  auto dense = backend_->CreateDense(s);
  ASSERT_TRUE(dense.ok()) << dense.status();
  const size_t nx = static_cast<size_t>(s.batch) * s.in_features;
  const size_t nw = static_cast<size_t>(s.out_features) * s.in_features;
  const size_t ny = static_cast<size_t>(s.batch) * s.out_features;
  const auto x = Random(nx, 31), w = Random(nw, 32), b = Random(s.out_features, 33),
             dy = Random(ny, 34);
  auto xd = Upload(x), wd = Upload(w), bd = Upload(b), dyd = Upload(dy);
  auto yd = Filled(ny, 7), dxd = Filled(nx, 7), dwd = Filled(nw, 7),
       dbd = Filled(s.out_features, 7);

  ASSERT_TRUE((*dense)->Forward(xd->data(), wd->data(), bd->data(), yd->data()).ok());
  ExpectClose(Download(*yd), DenseForwardRef(s, x, w, b), "y");
  const Grads want = DenseBackwardRef(s, x, w, dy);
  ASSERT_TRUE(
      (*dense)
          ->Backward(xd->data(), wd->data(), dyd->data(), dxd->data(), dwd->data(), dbd->data())
          .ok());
  ExpectClose(Download(*dxd), want.dx, "dx");
  ExpectClose(Download(*dwd), want.dw, "dw");
  ExpectClose(Download(*dbd), want.db, "db");

  auto dw2 = Filled(nw, -3), db2 = Filled(s.out_features, -3);
  ASSERT_TRUE((*dense)
                  ->Backward(xd->data(), wd->data(), dyd->data(), nullptr, dw2->data(), db2->data())
                  .ok());
  ExpectClose(Download(*dw2), want.dw, "dw (no dx)");
  ExpectClose(Download(*db2), want.db, "db (no dx)");
}

INSTANTIATE_TEST_SUITE_P(Shapes, DenseTest,
                         ::testing::Values(DenseCase{"odd", {5, 13, 7}},
                                           DenseCase{"single", {1, 3, 1}},
                                           DenseCase{"mnist_head", {16, 64, 10}}),
                         CaseName<DenseShape>);

TEST_F(CpuBackendTest, DenseFiniteDifferences) {
  const DenseShape s{3, 5, 4};
  auto dense = backend_->CreateDense(s).value();
  auto x = Upload(Random(15, 35)), w = Upload(Random(20, 36)), b = Upload(Random(4, 37));
  const auto g = Random(12, 38);
  auto gd = Upload(g), y = Filled(12, 0), dx = Filled(15, 0), dw = Filled(20, 0), db = Filled(4, 0);
  ASSERT_TRUE(
      dense->Backward(x->data(), w->data(), gd->data(), dx->data(), dw->data(), db->data()).ok());
  const auto loss = [&] {
    EXPECT_TRUE(dense->Forward(x->data(), w->data(), b->data(), y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), 15, loss, Download(*dx), 1e-2f);
  CheckGradient("dw", w->data(), 20, loss, Download(*dw), 1e-2f);
  CheckGradient("db", b->data(), 4, loss, Download(*db), 1e-2f);
}

// ------------------------------------------------------------ SoftmaxCrossEntropy

TEST_F(CpuBackendTest, SoftmaxCrossEntropyMatchesReference) {
  const int n = 6, classes = 10;
  const auto logits = Random(n * classes, 41, -3, 3);
  std::vector<int32_t> labels(n);
  std::mt19937 gen(42);
  Ref want_probs(n * classes), want_dlogits(n * classes);
  double want_loss = 0;
  int64_t want_correct = 0;
  for (int i = 0; i < n; ++i) {
    const float* row = &logits[i * classes];
    const int argmax = static_cast<int>(std::max_element(row, row + classes) - row);
    // Half the examples are labelled with their arg-max, so accuracy is not trivially 0.
    labels[i] = i % 2 == 0 ? argmax : static_cast<int32_t>(gen() % classes);
    want_correct += labels[i] == argmax;
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(double{row[j]});
    for (int j = 0; j < classes; ++j) {
      want_probs[i * classes + j] = std::exp(double{row[j]}) / sum;
      want_dlogits[i * classes + j] = (want_probs[i * classes + j] - (j == labels[i])) / n;
    }
    want_loss -= std::log(want_probs[i * classes + labels[i]]) / n;
  }
  auto op = backend_->CreateSoftmaxCrossEntropy(n, classes);
  ASSERT_TRUE(op.ok()) << op.status();
  auto ld = Upload(logits), lab = UploadLabels(labels);
  auto probs = Filled(n * classes, 7), dlogits = Filled(n * classes, 7), stats = Filled(2, 7);

  ASSERT_TRUE((*op)->Forward(ld->data(), Labels(*lab), probs->data(), stats->data()).ok());
  const auto got = Download(*stats);
  EXPECT_NEAR(got[0], want_loss, 1e-5 * (1 + want_loss));
  EXPECT_EQ(got[1], static_cast<float>(want_correct));
  ExpectClose(Download(*probs), want_probs, "probs");
  ASSERT_TRUE((*op)->Backward(probs->data(), Labels(*lab), dlogits->data()).ok());
  ExpectClose(Download(*dlogits), want_dlogits, "dlogits");
}

TEST_F(CpuBackendTest, SoftmaxCrossEntropyIsNumericallySafe) {
  // The label's probability underflows to 0 in fp32; the loss must stay exact.
  auto op = backend_->CreateSoftmaxCrossEntropy(2, 3).value();
  auto logits = Upload({1000, 0, -1000, -1000, 0, 1000}), probs = Filled(6, 0);
  auto labels = UploadLabels({2, 2}), stats = Filled(2, 7);
  ASSERT_TRUE(op->Forward(logits->data(), Labels(*labels), probs->data(), stats->data()).ok());
  const auto got = Download(*stats);
  EXPECT_NEAR(got[0], (2000.0 + 0.0) / 2, 1e-3);
  EXPECT_EQ(got[1], 1.0f);
  for (float p : Download(*probs)) EXPECT_TRUE(std::isfinite(p));
}

TEST_F(CpuBackendTest, SoftmaxCrossEntropyFiniteDifferences) {
  const int n = 3, classes = 5;
  auto op = backend_->CreateSoftmaxCrossEntropy(n, classes).value();
  auto logits = Upload(Random(n * classes, 43, -2, 2));
  auto probs = Filled(n * classes, 0), dlogits = Filled(n * classes, 0), stats = Filled(2, 0);
  auto labels = UploadLabels({0, 4, 2});
  ASSERT_TRUE(op->Forward(logits->data(), Labels(*labels), probs->data(), stats->data()).ok());
  ASSERT_TRUE(op->Backward(probs->data(), Labels(*labels), dlogits->data()).ok());
  const auto analytic = Download(*dlogits);
  // The loss now comes back as a float, so the step is larger than for a
  // double loss: a 1e-2 step keeps float rounding of the loss below 1e-5.
  const auto loss = [&] {
    EXPECT_TRUE(op->Forward(logits->data(), Labels(*labels), probs->data(), stats->data()).ok());
    return double{Download(*stats)[0]};
  };
  CheckGradient("dlogits", logits->data(), n * classes, loss, analytic, 1e-2f, 1e-4, 1e-3);
}

TEST_F(CpuBackendTest, SoftmaxCrossEntropyRejectsBadLabels) {
  auto op = backend_->CreateSoftmaxCrossEntropy(2, 10).value();
  auto logits = Upload(Random(20, 44)), probs = Filled(20, 0), dlogits = Filled(20, 0);
  auto stats = Filled(2, 7);
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{3, 10}, {-1, 0}}) {
    auto labels = UploadLabels(bad);
    const absl::Status s =
        op->Forward(logits->data(), Labels(*labels), probs->data(), stats->data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("label"));
    EXPECT_EQ(op->Backward(probs->data(), Labels(*labels), dlogits->data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Nothing was written by the rejected calls.
  EXPECT_EQ(Download(*stats), std::vector<float>(2, 7.0f));
  EXPECT_EQ(
      op->Forward(logits->data(), Labels(*UploadLabels({1, 2})), probs->data(), nullptr).code(),
      absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------ BatchNorm

struct BatchNormRefResult {
  Ref y, dx, dgamma, dbeta;
  Ref mean, unbiased_var;  // the batch's statistics, for running averages
};

// Training-mode batch norm in double: per channel over N*H*W, biased variance
// (and the unbiased one, over M - 1, among the statistics; over M for M = 1).
// Backward by the standard formulas, with M = N*H*W:
//   dbeta = sum dy, dgamma = sum dy * xhat,
//   dx = gamma * invstd / M * (M * dy - dbeta - xhat * dgamma).
BatchNormRefResult BatchNormRef(const BatchNormShape& s, const std::vector<float>& x,
                                const std::vector<float>& gamma, const std::vector<float>& beta,
                                const std::vector<float>& dy) {
  const size_t hw = static_cast<size_t>(s.height) * s.width;
  const double m = static_cast<double>(s.batch) * hw;
  BatchNormRefResult r{Ref(x.size()),   Ref(x.size()),   Ref(s.channels),
                       Ref(s.channels), Ref(s.channels), Ref(s.channels)};
  for (int c = 0; c < s.channels; ++c) {
    const auto at = [&](int n, size_t i) {
      return (static_cast<size_t>(n) * s.channels + c) * hw + i;
    };
    double mean = 0, var = 0;
    for (int n = 0; n < s.batch; ++n)
      for (size_t i = 0; i < hw; ++i) mean += x[at(n, i)];
    mean /= m;
    for (int n = 0; n < s.batch; ++n)
      for (size_t i = 0; i < hw; ++i) var += (x[at(n, i)] - mean) * (x[at(n, i)] - mean);
    r.mean[c] = mean;
    r.unbiased_var[c] = m > 1 ? var / (m - 1) : var;
    var /= m;
    const double invstd = 1 / std::sqrt(var + double{s.epsilon});
    double dbeta = 0, dgamma = 0;
    for (int n = 0; n < s.batch; ++n)
      for (size_t i = 0; i < hw; ++i) {
        const double xhat = (x[at(n, i)] - mean) * invstd;
        r.y[at(n, i)] = gamma[c] * xhat + beta[c];
        dbeta += dy[at(n, i)];
        dgamma += dy[at(n, i)] * xhat;
      }
    r.dbeta[c] = dbeta;
    r.dgamma[c] = dgamma;
    for (int n = 0; n < s.batch; ++n)
      for (size_t i = 0; i < hw; ++i) {
        const double xhat = (x[at(n, i)] - mean) * invstd;
        r.dx[at(n, i)] = gamma[c] * invstd / m * (m * dy[at(n, i)] - dbeta - xhat * dgamma);
      }
  }
  return r;
}

size_t Elements(const BatchNormShape& s) {
  return static_cast<size_t>(s.batch) * s.channels * s.height * s.width;
}

using BatchNormCase = Case<BatchNormShape>;
class BatchNormTest : public CpuBackendTest, public ::testing::WithParamInterface<BatchNormCase> {};

TEST_P(BatchNormTest, ForwardAndBackwardMatchReference) {
  const BatchNormShape& s = GetParam().shape;
  auto bn = backend_->CreateBatchNorm(s);
  ASSERT_TRUE(bn.ok()) << bn.status();
  const size_t nx = Elements(s);
  const auto x = Random(nx, 91), gamma = Random(s.channels, 92), beta = Random(s.channels, 93),
             dy = Random(nx, 94);
  const BatchNormRefResult want = BatchNormRef(s, x, gamma, beta, dy);
  auto xd = Upload(x), gd = Upload(gamma), bd = Upload(beta), dyd = Upload(dy);
  auto yd = Filled(nx, 7), dxd = Filled(nx, 7), dgd = Filled(s.channels, 7),
       dbd = Filled(s.channels, 7), meand = Filled(s.channels, 7), vard = Filled(s.channels, 7);

  PSFLOW_ASSERT_OK(
      (*bn)->Forward(xd->data(), gd->data(), bd->data(), yd->data(), meand->data(), vard->data()));
  ExpectClose(Download(*yd), want.y, "y");
  ExpectClose(Download(*meand), want.mean, "batch mean");
  ExpectClose(Download(*vard), want.unbiased_var, "batch unbiased variance");
  // Without the statistics' buffers, the same y.
  auto y2 = Filled(nx, 7);
  PSFLOW_ASSERT_OK(
      (*bn)->Forward(xd->data(), gd->data(), bd->data(), y2->data(), nullptr, nullptr));
  EXPECT_EQ(Download(*y2), Download(*yd));
  PSFLOW_ASSERT_OK(
      (*bn)->Backward(xd->data(), gd->data(), dyd->data(), dxd->data(), dgd->data(), dbd->data()));
  ExpectClose(Download(*dxd), want.dx, "dx");
  ExpectClose(Download(*dgd), want.dgamma, "dgamma");
  ExpectClose(Download(*dbd), want.dbeta, "dbeta");
}

INSTANTIATE_TEST_SUITE_P(Shapes, BatchNormTest,
                         ::testing::Values(BatchNormCase{"odd", {2, 3, 5, 4}},
                                           BatchNormCase{"one_image", {1, 2, 7, 3}},
                                           BatchNormCase{"one_pixel_per_image", {9, 5, 1, 1}},
                                           BatchNormCase{"many_channels", {4, 37, 3, 3}},
                                           BatchNormCase{"larger", {8, 16, 12, 12}},
                                           BatchNormCase{"epsilon_0_1", {3, 4, 5, 5, 1e-1f}},
                                           // M = 1: the variance is 0, y = beta and dx = 0.
                                           BatchNormCase{"single_value_per_channel", {1, 4, 1, 1}}),
                         CaseName<BatchNormShape>);

TEST_F(CpuBackendTest, BatchNormFiniteDifferences) {
  const BatchNormShape s{2, 3, 3, 2};
  auto bn = backend_->CreateBatchNorm(s).value();
  const size_t nx = Elements(s);
  auto x = Upload(Random(nx, 101)), gamma = Upload(Random(3, 102)), beta = Upload(Random(3, 103));
  const auto g = Random(nx, 104);  // L = sum(y * g)
  auto gd = Upload(g), y = Filled(nx, 0), dx = Filled(nx, 0), dgamma = Filled(3, 0),
       dbeta = Filled(3, 0);
  PSFLOW_ASSERT_OK(
      bn->Forward(x->data(), gamma->data(), beta->data(), y->data(), nullptr, nullptr));
  PSFLOW_ASSERT_OK(bn->Backward(x->data(), gamma->data(), gd->data(), dx->data(), dgamma->data(),
                                dbeta->data()));
  const auto loss = [&] {
    EXPECT_TRUE(
        bn->Forward(x->data(), gamma->data(), beta->data(), y->data(), nullptr, nullptr).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), nx, loss, Download(*dx), 1e-2f, 2e-3, 1e-2);
  CheckGradient("dgamma", gamma->data(), 3, loss, Download(*dgamma), 1e-2f, 2e-3, 1e-2);
  CheckGradient("dbeta", beta->data(), 3, loss, Download(*dbeta), 1e-2f, 2e-3, 1e-2);
}

// Inference-mode batch norm in double: y = gamma * (x - mean) / sqrt(var +
// epsilon) + beta with the given per-channel mean and var.
Ref BatchNormInferenceRef(const BatchNormShape& s, const std::vector<float>& x,
                          const std::vector<float>& gamma, const std::vector<float>& beta,
                          const std::vector<float>& mean, const std::vector<float>& var) {
  const size_t hw = static_cast<size_t>(s.height) * s.width;
  Ref y(x.size());
  for (int n = 0; n < s.batch; ++n) {
    for (int c = 0; c < s.channels; ++c) {
      const double inv = 1 / std::sqrt(double{var[c]} + double{s.epsilon});
      for (size_t i = 0; i < hw; ++i) {
        const size_t at = (static_cast<size_t>(n) * s.channels + c) * hw + i;
        y[at] = gamma[c] * (x[at] - double{mean[c]}) * inv + beta[c];
      }
    }
  }
  return y;
}

// Inference normalizes with the statistics it is given, whatever the batch:
// against the reference, for every shape of the training cases.
TEST_P(BatchNormTest, InferenceMatchesReference) {
  const BatchNormShape& s = GetParam().shape;
  auto bn = backend_->CreateBatchNorm(s);
  ASSERT_TRUE(bn.ok()) << bn.status();
  const size_t nx = Elements(s);
  const auto x = Random(nx, 95, -2.0f, 3.0f), gamma = Random(s.channels, 96),
             beta = Random(s.channels, 97), mean = Random(s.channels, 98),
             var = Random(s.channels, 99, 0.05f, 4.0f);
  auto xd = Upload(x), gd = Upload(gamma), bd = Upload(beta), md = Upload(mean), vd = Upload(var);
  auto yd = Filled(nx, 7);
  PSFLOW_ASSERT_OK(
      (*bn)->Infer(xd->data(), gd->data(), bd->data(), md->data(), vd->data(), yd->data()));
  ExpectClose(Download(*yd), BatchNormInferenceRef(s, x, gamma, beta, mean, var), "y");
}

// Given the batch's own (biased) statistics, inference computes what
// training does; and an inference between a Forward and its Backward leaves
// the Backward's statistics alone.
TEST_F(CpuBackendTest, BatchNormInferenceWithTheBatchStatisticsIsTraining) {
  const BatchNormShape s{4, 3, 5, 3};
  auto bn = backend_->CreateBatchNorm(s).value();
  const size_t nx = Elements(s);
  const double m = static_cast<double>(s.batch) * s.height * s.width;
  const auto x = Random(nx, 131), gamma = Random(3, 132), beta = Random(3, 133),
             dy = Random(nx, 134), other = Random(nx, 135, 2.0f, 5.0f);
  const BatchNormRefResult want = BatchNormRef(s, x, gamma, beta, dy);
  std::vector<float> biased(3), mean(3);
  for (int c = 0; c < 3; ++c) {
    mean[c] = static_cast<float>(want.mean[c]);
    biased[c] = static_cast<float>(want.unbiased_var[c] * (m - 1) / m);
  }
  auto xd = Upload(x), gd = Upload(gamma), bd = Upload(beta), dyd = Upload(dy), od = Upload(other),
       md = Upload(mean), vd = Upload(biased);
  auto y = Filled(nx, 7), yi = Filled(nx, 7), dx = Filled(nx, 7), dg = Filled(3, 7),
       db = Filled(3, 7);
  PSFLOW_ASSERT_OK(bn->Forward(xd->data(), gd->data(), bd->data(), y->data(), nullptr, nullptr));
  PSFLOW_ASSERT_OK(
      bn->Infer(xd->data(), gd->data(), bd->data(), md->data(), vd->data(), yi->data()));
  ExpectClose(Download(*yi), want.y, "inference with the batch statistics");
  // Another input through inference, then the Backward of the Forward above.
  PSFLOW_ASSERT_OK(
      bn->Infer(od->data(), gd->data(), bd->data(), md->data(), vd->data(), yi->data()));
  PSFLOW_ASSERT_OK(
      bn->Backward(xd->data(), gd->data(), dyd->data(), dx->data(), dg->data(), db->data()));
  ExpectClose(Download(*dx), want.dx, "dx");
  ExpectClose(Download(*dg), want.dgamma, "dgamma");
}

// Backward uses the statistics of the latest Forward, kept in the op.
TEST_F(CpuBackendTest, BatchNormBackwardUsesLatestForward) {
  const BatchNormShape s{3, 4, 5, 3};
  auto bn = backend_->CreateBatchNorm(s).value();
  const size_t nx = Elements(s);
  // xb has other statistics than xa: shifted and scaled.
  const auto xa = Random(nx, 111), gamma = Random(4, 113), beta = Random(4, 114),
             dy = Random(nx, 115);
  auto xb = Random(nx, 112);
  for (float& v : xb) v = 0.5f + 2 * v;
  auto xad = Upload(xa), xbd = Upload(xb), gd = Upload(gamma), bd = Upload(beta), dyd = Upload(dy);
  auto ya = Filled(nx, 0), yb = Filled(nx, 0), dx = Filled(nx, 7), dg = Filled(4, 7),
       db = Filled(4, 7);
  const BatchNormRefResult wa = BatchNormRef(s, xa, gamma, beta, dy),
                           wb = BatchNormRef(s, xb, gamma, beta, dy);

  PSFLOW_ASSERT_OK(bn->Forward(xad->data(), gd->data(), bd->data(), ya->data(), nullptr, nullptr));
  PSFLOW_ASSERT_OK(bn->Forward(xbd->data(), gd->data(), bd->data(), yb->data(), nullptr, nullptr));
  ExpectClose(Download(*ya), wa.y, "ya");
  ExpectClose(Download(*yb), wb.y, "yb");
  PSFLOW_ASSERT_OK(
      bn->Backward(xbd->data(), gd->data(), dyd->data(), dx->data(), dg->data(), db->data()));
  ExpectClose(Download(*dx), wb.dx, "dx of xb");
  ExpectClose(Download(*dg), wb.dgamma, "dgamma of xb");
  ExpectClose(Download(*db), wb.dbeta, "dbeta of xb");
  PSFLOW_ASSERT_OK(bn->Forward(xad->data(), gd->data(), bd->data(), ya->data(), nullptr, nullptr));
  PSFLOW_ASSERT_OK(
      bn->Backward(xad->data(), gd->data(), dyd->data(), dx->data(), dg->data(), db->data()));
  ExpectClose(Download(*dx), wa.dx, "dx of xa");
  ExpectClose(Download(*dg), wa.dgamma, "dgamma of xa");
}

// ------------------------------------------------------------ GlobalAvgPool

using GapCase = Case<GlobalAvgPoolShape>;
class GlobalAvgPoolTest : public CpuBackendTest, public ::testing::WithParamInterface<GapCase> {};

TEST_P(GlobalAvgPoolTest, ForwardAndBackwardMatchReference) {
  const GlobalAvgPoolShape& s = GetParam().shape;
  auto gap = backend_->CreateGlobalAvgPool(s);
  ASSERT_TRUE(gap.ok()) << gap.status();
  const size_t planes = static_cast<size_t>(s.batch) * s.channels;
  const size_t hw = static_cast<size_t>(s.height) * s.width;
  const auto x = Random(planes * hw, 121), dy = Random(planes, 122);
  Ref want_y(planes), want_dx(planes * hw);
  for (size_t p = 0; p < planes; ++p) {
    for (size_t i = 0; i < hw; ++i) want_y[p] += x[p * hw + i];
    want_y[p] /= static_cast<double>(hw);
    for (size_t i = 0; i < hw; ++i) want_dx[p * hw + i] = dy[p] / static_cast<double>(hw);
  }
  auto xd = Upload(x), dyd = Upload(dy), yd = Filled(planes, 7), dxd = Filled(planes * hw, 7);
  PSFLOW_ASSERT_OK((*gap)->Forward(xd->data(), yd->data()));
  ExpectClose(Download(*yd), want_y, "y");
  PSFLOW_ASSERT_OK((*gap)->Backward(dyd->data(), dxd->data()));
  ExpectClose(Download(*dxd), want_dx, "dx");
}

// "parallel" cases are large enough for the OpenMP loops.
INSTANTIATE_TEST_SUITE_P(Shapes, GlobalAvgPoolTest,
                         ::testing::Values(GapCase{"odd", {2, 3, 5, 4}},
                                           GapCase{"one_pixel", {3, 5, 1, 1}},
                                           GapCase{"one_plane", {1, 1, 9, 7}},
                                           GapCase{"parallel", {8, 64, 8, 8}},
                                           GapCase{"parallel_big_planes", {2, 3, 111, 97}}),
                         CaseName<GlobalAvgPoolShape>);

TEST_F(CpuBackendTest, GlobalAvgPoolFiniteDifferences) {
  const GlobalAvgPoolShape s{2, 3, 3, 4};
  auto gap = backend_->CreateGlobalAvgPool(s).value();
  const size_t nx = 2 * 3 * 3 * 4, ny = 2 * 3;
  const auto g = Random(ny, 123);
  auto x = Upload(Random(nx, 124)), gd = Upload(g), y = Filled(ny, 0), dx = Filled(nx, 0);
  PSFLOW_ASSERT_OK(gap->Backward(gd->data(), dx->data()));
  const auto loss = [&] {
    EXPECT_TRUE(gap->Forward(x->data(), y->data()).ok());
    return Dot(Download(*y), g);
  };
  CheckGradient("dx", x->data(), nx, loss, Download(*dx), 1e-2f);
}

// ------------------------------------------------------------ elementwise helpers

// Odd sizes, below and above the size where the loops go parallel.
class HelperTest : public CpuBackendTest, public ::testing::WithParamInterface<int64_t> {};

TEST_P(HelperTest, Add) {
  const int64_t n = GetParam();
  const auto a = Random(n, 131), b = Random(n, 132);
  Ref want(n), want_twice(n);
  for (int64_t i = 0; i < n; ++i) want[i] = double{a[i]} + b[i], want_twice[i] = 2.0 * a[i];
  auto ad = Upload(a), bd = Upload(b), y = Filled(n, 7);
  PSFLOW_ASSERT_OK(backend_->Add(ad->data(), bd->data(), y->data(), n));
  ExpectClose(Download(*y), want, "y = a + b");
  EXPECT_EQ(Download(*ad), a) << "a changed";
  EXPECT_EQ(Download(*bd), b) << "b changed";
  // In place, on either input.
  PSFLOW_ASSERT_OK(backend_->Add(ad->data(), bd->data(), ad->data(), n));
  ExpectClose(Download(*ad), want, "a = a + b");
  auto a2 = Upload(a);
  PSFLOW_ASSERT_OK(backend_->Add(a2->data(), bd->data(), bd->data(), n));
  ExpectClose(Download(*bd), want, "b = a + b");
  // All three the same.
  PSFLOW_ASSERT_OK(backend_->Add(a2->data(), a2->data(), a2->data(), n));
  ExpectClose(Download(*a2), want_twice, "a = a + a");
}

TEST_P(HelperTest, Affine) {
  const int64_t n = GetParam();
  const auto x = Random(n, 141);
  const float scale = -0.75f, shift = 0.3f;
  Ref want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = double{x[i]} * scale + shift;
  auto xd = Upload(x), y = Filled(n, 7);
  PSFLOW_ASSERT_OK(backend_->Affine(xd->data(), scale, shift, y->data(), n));
  ExpectClose(Download(*y), want, "y");
  EXPECT_EQ(Download(*xd), x) << "x changed";
  PSFLOW_ASSERT_OK(backend_->Affine(xd->data(), scale, shift, xd->data(), n));
  ExpectClose(Download(*xd), want, "x in place");
}

TEST_P(HelperTest, ChannelAffine) {
  // n images of 3 channels of `plane` values.
  const int64_t plane = std::max<int64_t>(GetParam() / 6, 1), channels = 3, images = 2;
  const int64_t n = images * channels * plane;
  const auto x = Random(n, 143);
  const std::vector<float> scale = {2.0f, -0.5f, 1.25f}, shift = {0.1f, 0.0f, -3.0f};
  Ref want(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = (i / plane) % channels;
    want[i] = double{x[i]} * scale[c] + shift[c];
  }
  auto xd = Upload(x), y = Filled(n, 7), sd = Upload(scale), hd = Upload(shift);
  PSFLOW_ASSERT_OK(backend_->ChannelAffine(xd->data(), sd->data(), hd->data(), y->data(), images,
                                           channels, plane));
  ExpectClose(Download(*y), want, "y");
  PSFLOW_ASSERT_OK(backend_->ChannelAffine(xd->data(), sd->data(), hd->data(), xd->data(), images,
                                           channels, plane));
  ExpectClose(Download(*xd), want, "x in place");
}

TEST_P(HelperTest, Sgd) {
  const int64_t n = GetParam();
  const auto w = Random(n, 151), g = Random(n, 152);
  const float lr = 0.05f;
  Ref want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = double{w[i]} - double{lr} * g[i];
  auto wd = Upload(w), gd = Upload(g);
  PSFLOW_ASSERT_OK(backend_->Sgd(wd->data(), gd->data(), lr, n));
  ExpectClose(Download(*wd), want, "w", 1e-6);
  EXPECT_EQ(Download(*gd), g) << "g changed";
}

TEST_P(HelperTest, Copy) {
  const int64_t n = GetParam();
  const auto src = Random(n, 161);
  auto sd = Upload(src), dd = Filled(n, 7);
  PSFLOW_ASSERT_OK(backend_->Copy(sd->data(), dd->data(), n));
  EXPECT_EQ(Download(*dd), src);
  EXPECT_EQ(Download(*sd), src) << "src changed";
  PSFLOW_ASSERT_OK(backend_->Copy(sd->data(), sd->data(), n));
  EXPECT_EQ(Download(*sd), src) << "copy onto itself";
}

INSTANTIATE_TEST_SUITE_P(Sizes, HelperTest, ::testing::Values(1, 7, 1037, 100003),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "n" + std::to_string(info.param);
                         });

TEST_F(CpuBackendTest, HelpersOnPartsOfBuffers) {
  // A tail of n floats inside a larger buffer: the floats around it stay.
  const auto a = Random(40, 171), b = Random(40, 172);
  auto ad = Upload(a), bd = Upload(b), y = Filled(40, 7);
  PSFLOW_ASSERT_OK(backend_->Add(ad->data() + 5, bd->data() + 5, y->data() + 5, 30));
  const auto got = Download(*y);
  for (int i = 0; i < 40; ++i) {
    if (i < 5 || i >= 35) {
      EXPECT_EQ(got[i], 7.0f) << i;
    } else {
      EXPECT_FLOAT_EQ(got[i], a[i] + b[i]) << i;
    }
  }
  // Overlapping ranges of one buffer: Copy behaves like memmove.
  auto m = Upload(a);
  PSFLOW_ASSERT_OK(backend_->Copy(m->data(), m->data() + 3, 30));
  auto moved = Download(*m);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(moved[i + 3], a[i]) << i;
  m = Upload(a);
  PSFLOW_ASSERT_OK(backend_->Copy(m->data() + 3, m->data(), 30));
  moved = Download(*m);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(moved[i], a[i + 3]) << i;
}

TEST_F(CpuBackendTest, HelpersRejectBadArguments) {
  auto buf = Filled(8, 1);
  float* p = buf->data();
  const auto invalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(backend_->Add(p, p, p, -1).code(), invalid);
  EXPECT_EQ(backend_->Add(p, nullptr, p, 8).code(), invalid);
  EXPECT_EQ(backend_->Affine(nullptr, 1, 0, p, 8).code(), invalid);
  EXPECT_EQ(backend_->Affine(p, 1, 0, p, -2).code(), invalid);
  EXPECT_EQ(backend_->Sgd(nullptr, p, 0.1f, 8).code(), invalid);
  EXPECT_EQ(backend_->Sgd(p, p, 0.1f, -8).code(), invalid);
  EXPECT_EQ(backend_->Copy(p, nullptr, 8).code(), invalid);
  EXPECT_EQ(backend_->Copy(p, p, -3).code(), invalid);
  // n == 0 is a no-op.
  EXPECT_TRUE(backend_->Add(nullptr, nullptr, nullptr, 0).ok());
  EXPECT_TRUE(backend_->Copy(nullptr, nullptr, 0).ok());
  EXPECT_EQ(Download(*buf), std::vector<float>(8, 1.0f));
}

// ------------------------------------------------------------ graphs

TEST_F(CpuBackendTest, CaptureIsUnimplemented) {
  bool ran = false;
  auto graph = backend_->Capture([&] {
    ran = true;
    return absl::OkStatus();
  });
  ASSERT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(graph.status().message(), HasSubstr("cpu"));
  EXPECT_FALSE(ran) << "Capture must not run the work it refuses to record";
}

// ------------------------------------------------------------ reuse

// Primitives are built once; each call must follow the pointers it is given.
TEST_F(CpuBackendTest, ConvReusedWithDifferentPointers) {
  const Conv2DShape s{2, 3, 6, 5, 4, 3, 3, 1, 1};
  auto conv = backend_->CreateConv2D(s).value();
  const size_t nx = 2 * 3 * 6 * 5, nw = 4 * 3 * 3 * 3, ny = 2 * 4 * 6 * 5;
  const auto xa = Random(nx, 51), xb = Random(nx, 52), wa = Random(nw, 53), wb = Random(nw, 54);
  const auto ba = Random(4, 55), bb = Random(4, 56), dya = Random(ny, 57), dyb = Random(ny, 58);
  auto xad = Upload(xa), xbd = Upload(xb), wad = Upload(wa), wbd = Upload(wb);
  auto bad = Upload(ba), bbd = Upload(bb), dyad = Upload(dya), dybd = Upload(dyb);
  auto ya = Filled(ny, 0), yb = Filled(ny, 0), yc = Filled(ny, 0);

  ASSERT_TRUE(conv->Forward(xad->data(), wad->data(), bad->data(), ya->data()).ok());
  ASSERT_TRUE(conv->Forward(xbd->data(), wbd->data(), bbd->data(), yb->data()).ok());
  ASSERT_TRUE(conv->Forward(xbd->data(), wad->data(), bad->data(), yc->data()).ok());
  ExpectClose(Download(*ya), ConvForwardRef(s, xa, wa, ba), "ya");
  ExpectClose(Download(*yb), ConvForwardRef(s, xb, wb, bb), "yb");
  ExpectClose(Download(*yc), ConvForwardRef(s, xb, wa, ba), "yc");

  auto dxa = Filled(nx, 0), dwa = Filled(nw, 0), dba = Filled(4, 0);
  auto dxb = Filled(nx, 0), dwb = Filled(nw, 0), dbb = Filled(4, 0);
  ASSERT_TRUE(
      conv->Backward(xad->data(), wad->data(), dyad->data(), dxa->data(), dwa->data(), dba->data())
          .ok());
  ASSERT_TRUE(
      conv->Backward(xbd->data(), wbd->data(), dybd->data(), dxb->data(), dwb->data(), dbb->data())
          .ok());
  const Grads ga = ConvBackwardRef(s, xa, wa, dya), gb = ConvBackwardRef(s, xb, wb, dyb);
  ExpectClose(Download(*dxa), ga.dx, "dxa");
  ExpectClose(Download(*dwa), ga.dw, "dwa");
  ExpectClose(Download(*dba), ga.db, "dba");
  ExpectClose(Download(*dxb), gb.dx, "dxb");
  ExpectClose(Download(*dwb), gb.dw, "dwb");
  ExpectClose(Download(*dbb), gb.db, "dbb");
}

TEST_F(CpuBackendTest, PoolBackwardUsesLatestForward) {
  const Pool2DShape s{2, 3, 6, 6, 2, 2};
  auto pool = backend_->CreateMaxPool2D(s).value();
  const size_t nx = 2 * 3 * 6 * 6, ny = 2 * 3 * 3 * 3;
  const auto xa = Random(nx, 61), xb = Random(nx, 62), dy = Random(ny, 63);
  auto xad = Upload(xa), xbd = Upload(xb), dyd = Upload(dy);
  auto ya = Filled(ny, 0), yb = Filled(ny, 0), dx = Filled(nx, 0);
  Ref want_ya, want_yb, want_dxa, want_dxb;
  PoolRef(s, xa, dy, &want_ya, &want_dxa);
  PoolRef(s, xb, dy, &want_yb, &want_dxb);

  ASSERT_TRUE(pool->Forward(xad->data(), ya->data()).ok());
  ASSERT_TRUE(pool->Forward(xbd->data(), yb->data()).ok());
  ASSERT_TRUE(pool->Backward(dyd->data(), dx->data()).ok());
  ExpectClose(Download(*ya), want_ya, "ya");
  ExpectClose(Download(*yb), want_yb, "yb");
  ExpectClose(Download(*dx), want_dxb, "dx");
  ASSERT_TRUE(pool->Forward(xad->data(), ya->data()).ok());
  ASSERT_TRUE(pool->Backward(dyd->data(), dx->data()).ok());
  ExpectClose(Download(*dx), want_dxa, "dx after forward on xa");
}

TEST_F(CpuBackendTest, DenseReusedWithDifferentPointers) {
  const DenseShape s{4, 6, 3};
  auto dense = backend_->CreateDense(s).value();
  const auto xa = Random(24, 71), xb = Random(24, 72), w = Random(18, 73), b = Random(3, 74);
  auto xad = Upload(xa), xbd = Upload(xb), wd = Upload(w), bd = Upload(b);
  auto ya = Filled(12, 0), yb = Filled(12, 0);
  ASSERT_TRUE(dense->Forward(xad->data(), wd->data(), bd->data(), ya->data()).ok());
  ASSERT_TRUE(dense->Forward(xbd->data(), wd->data(), bd->data(), yb->data()).ok());
  ExpectClose(Download(*ya), DenseForwardRef(s, xa, w, b), "ya");
  ExpectClose(Download(*yb), DenseForwardRef(s, xb, w, b), "yb");
}

// Ops of one backend called from two threads at once (the stream is shared).
TEST_F(CpuBackendTest, OpsOfOneBackendOnTwoThreads) {
  const DenseShape s{8, 32, 16};
  const auto x = Random(8 * 32, 81), w = Random(16 * 32, 82), b = Random(16, 83);
  const Ref want = DenseForwardRef(s, x, w, b);
  auto xd = Upload(x), wd = Upload(w), bd = Upload(b);
  auto run = [&](Buffer* y) {
    auto dense = backend_->CreateDense(s).value();
    for (int i = 0; i < 50; ++i) {
      EXPECT_TRUE(dense->Forward(xd->data(), wd->data(), bd->data(), y->data()).ok());
    }
  };
  auto y1 = Filled(8 * 16, 0), y2 = Filled(8 * 16, 0);
  std::thread t1(run, y1.get()), t2(run, y2.get());
  t1.join();
  t2.join();
  ExpectClose(Download(*y1), want, "y1");
  ExpectClose(Download(*y2), want, "y2");
}

TEST_F(CpuBackendTest, OpOutlivesBackend) {
  auto relu = backend_->CreateRelu(4).value();
  backend_.reset();
  float x[4] = {-1, 2, -3, 4}, y[4] = {};
  ASSERT_TRUE(relu->Forward(x, y).ok());
  EXPECT_EQ(std::vector<float>(y, y + 4), (std::vector<float>{0, 2, 0, 4}));
}

// ------------------------------------------------------------ error paths

TEST_F(CpuBackendTest, InvalidShapesAreInvalidArgument) {
  const auto expect_invalid = [](const absl::Status& s, const char* what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
  };
  expect_invalid(backend_->CreateConv2D({1, 1, 3, 3, 1, 5, 5, 1, 0}).status(), "kernel > input");
  expect_invalid(backend_->CreateConv2D({0, 1, 3, 3, 1, 3, 3, 1, 0}).status(), "zero batch");
  expect_invalid(backend_->CreateConv2D({1, 1, 3, 3, 1, 3, 3, 0, 0}).status(), "zero stride");
  expect_invalid(backend_->CreateConv2D({1, 1, 3, 3, 1, 3, 3, 1, -1}).status(), "negative pad");
  expect_invalid(backend_->CreateConv2D({1, -2, 3, 3, 1, 3, 3, 1, 0}).status(), "channels");
  expect_invalid(backend_->CreateMaxPool2D({1, 1, 3, 5, 4, 2}).status(), "window > height");
  expect_invalid(backend_->CreateMaxPool2D({1, 1, 4, 4, 2, 0}).status(), "zero stride");
  expect_invalid(backend_->CreateMaxPool2D({1, 0, 4, 4, 2, 2}).status(), "zero channels");
  expect_invalid(backend_->CreateRelu(0).status(), "relu size 0");
  expect_invalid(backend_->CreateRelu(-5).status(), "relu size -5");
  expect_invalid(backend_->CreateDense({4, 0, 3}).status(), "dense in 0");
  expect_invalid(backend_->CreateDense({-1, 2, 3}).status(), "dense batch -1");
  expect_invalid(backend_->CreateSoftmaxCrossEntropy(4, 0).status(), "softmax classes 0");
  expect_invalid(backend_->CreateSoftmaxCrossEntropy(0, 3).status(), "softmax batch 0");
  expect_invalid(backend_->CreateBatchNorm({0, 3, 4, 4}).status(), "batchnorm batch 0");
  expect_invalid(backend_->CreateBatchNorm({2, 3, 4, -4}).status(), "batchnorm width -4");
  expect_invalid(backend_->CreateBatchNorm({2, 3, 4, 4, -1e-5f}).status(), "batchnorm eps < 0");
  expect_invalid(backend_->CreateBatchNorm({2, 3, 4, 4, NAN}).status(), "batchnorm eps NaN");
  expect_invalid(backend_->CreateGlobalAvgPool({2, 0, 4, 4}).status(), "gap channels 0");
  expect_invalid(backend_->CreateGlobalAvgPool({2, 3, 0, 4}).status(), "gap height 0");

  auto conv = backend_->CreateConv2D({1, 1, 3, 3, 1, 5, 5, 1, 0});
  EXPECT_THAT(conv.status().message(), HasSubstr("kernel is larger"));
}

TEST_F(CpuBackendTest, MisuseIsReported) {
  auto pool = backend_->CreateMaxPool2D({1, 1, 4, 4, 2, 2}).value();
  auto dy = Filled(4, 1), dx = Filled(16, 0);
  EXPECT_EQ(pool->Backward(dy->data(), dx->data()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->Forward(nullptr, dy->data()).code(), absl::StatusCode::kInvalidArgument);

  auto dense = backend_->CreateDense({1, 2, 2}).value();
  auto buf = Filled(4, 0);
  EXPECT_EQ(dense->Forward(buf->data(), nullptr, buf->data(), buf->data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      dense->Backward(buf->data(), buf->data(), buf->data(), buf->data(), nullptr, buf->data())
          .code(),
      absl::StatusCode::kInvalidArgument);

  // A bias-less conv still needs x, w, y and dw.
  auto conv = backend_->CreateConv2D({1, 1, 2, 2, 1, 1, 1, 1, 0}).value();
  EXPECT_EQ(conv->Forward(buf->data(), nullptr, nullptr, buf->data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(conv->Backward(buf->data(), buf->data(), buf->data(), nullptr, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);

  auto bn = backend_->CreateBatchNorm({1, 2, 1, 2}).value();
  EXPECT_EQ(
      bn->Backward(buf->data(), buf->data(), buf->data(), buf->data(), buf->data(), buf->data())
          .code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bn->Forward(buf->data(), buf->data(), nullptr, buf->data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  // A Forward rejected for a null argument does not enable Backward.
  EXPECT_EQ(
      bn->Backward(buf->data(), buf->data(), buf->data(), buf->data(), buf->data(), buf->data())
          .code(),
      absl::StatusCode::kFailedPrecondition);
  // Inference needs every statistic; nor does it enable Backward.
  EXPECT_EQ(
      bn->Infer(buf->data(), buf->data(), buf->data(), nullptr, buf->data(), buf->data()).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      bn->Infer(buf->data(), buf->data(), buf->data(), buf->data(), buf->data(), buf->data()).ok());
  EXPECT_EQ(
      bn->Backward(buf->data(), buf->data(), buf->data(), buf->data(), buf->data(), buf->data())
          .code(),
      absl::StatusCode::kFailedPrecondition);

  auto gap = backend_->CreateGlobalAvgPool({1, 2, 2, 1}).value();
  EXPECT_EQ(gap->Forward(nullptr, buf->data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gap->Backward(buf->data(), nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// Forward-only ops compute exactly what the full ops compute forward, and
// refuse the calls they were built without.
TEST_F(CpuBackendTest, ForwardOnlyOpsComputeTheSameAndRefuseTheRest) {
  auto expect_refused = [](const absl::Status& s, const char* what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("forward-only")) << what;
  };
  {
    Conv2DShape s{3, 2, 7, 6, 4, 3, 3, 2, 1};
    const size_t nx = 3 * 2 * 7 * 6, nw = 4 * 2 * 3 * 3;
    const size_t ny = static_cast<size_t>(3) * 4 * s.out_height() * s.out_width();
    auto xd = Upload(Random(nx, 201)), wd = Upload(Random(nw, 202)), bd = Upload(Random(4, 203));
    auto full = backend_->CreateConv2D(s).value();
    s.forward_only = true;
    auto fwd = backend_->CreateConv2D(s).value();
    for (Buffer* b : {bd.get(), static_cast<Buffer*>(nullptr)}) {
      auto want = Filled(ny, 7), got = Filled(ny, 7);
      float* bias = b == nullptr ? nullptr : b->data();
      PSFLOW_ASSERT_OK(full->Forward(xd->data(), wd->data(), bias, want->data()));
      PSFLOW_ASSERT_OK(fwd->Forward(xd->data(), wd->data(), bias, got->data()));
      EXPECT_EQ(Download(*got), Download(*want)) << (b == nullptr ? "no bias" : "bias");
    }
    auto d = Filled(nx + nw + ny, 0);
    expect_refused(fwd->Backward(xd->data(), wd->data(), d->data(), d->data(), d->data(), nullptr),
                   "Conv2D");
  }
  {
    Pool2DShape s{2, 3, 7, 5, 3, 2};
    const size_t nx = 2 * 3 * 7 * 5,
                 ny = static_cast<size_t>(2) * 3 * s.out_height() * s.out_width();
    auto xd = Upload(Random(nx, 204));
    auto full = backend_->CreateMaxPool2D(s).value();
    s.forward_only = true;
    auto fwd = backend_->CreateMaxPool2D(s).value();
    auto want = Filled(ny, 7), got = Filled(ny, 7);
    PSFLOW_ASSERT_OK(full->Forward(xd->data(), want->data()));
    PSFLOW_ASSERT_OK(fwd->Forward(xd->data(), got->data()));
    EXPECT_EQ(Download(*got), Download(*want));
    auto dx = Filled(nx, 0);
    expect_refused(fwd->Backward(got->data(), dx->data()), "MaxPool2D");
  }
  {
    DenseShape s{5, 13, 6};
    auto xd = Upload(Random(5 * 13, 205)), wd = Upload(Random(6 * 13, 206)),
         bd = Upload(Random(6, 207));
    auto full = backend_->CreateDense(s).value();
    s.forward_only = true;
    auto fwd = backend_->CreateDense(s).value();
    auto want = Filled(5 * 6, 7), got = Filled(5 * 6, 7);
    PSFLOW_ASSERT_OK(full->Forward(xd->data(), wd->data(), bd->data(), want->data()));
    PSFLOW_ASSERT_OK(fwd->Forward(xd->data(), wd->data(), bd->data(), got->data()));
    EXPECT_EQ(Download(*got), Download(*want));
    auto d = Filled(6 * 13, 0);
    expect_refused(
        fwd->Backward(xd->data(), wd->data(), got->data(), xd->data(), d->data(), bd->data()),
        "Dense");
  }
  {
    BatchNormShape s{4, 3, 5, 3};
    const size_t nx = Elements(s);
    auto xd = Upload(Random(nx, 208)), gd = Upload(Random(3, 209)), bd = Upload(Random(3, 210)),
         md = Upload(Random(3, 211)), vd = Upload(Random(3, 212, 0.1f, 2.0f));
    auto full = backend_->CreateBatchNorm(s).value();
    s.forward_only = true;
    auto fwd = backend_->CreateBatchNorm(s).value();
    auto want = Filled(nx, 7), got = Filled(nx, 7);
    PSFLOW_ASSERT_OK(
        full->Infer(xd->data(), gd->data(), bd->data(), md->data(), vd->data(), want->data()));
    PSFLOW_ASSERT_OK(
        fwd->Infer(xd->data(), gd->data(), bd->data(), md->data(), vd->data(), got->data()));
    EXPECT_EQ(Download(*got), Download(*want));
    expect_refused(fwd->Forward(xd->data(), gd->data(), bd->data(), got->data(), nullptr, nullptr),
                   "BatchNorm forward");
    auto d = Filled(nx, 0);
    expect_refused(
        fwd->Backward(xd->data(), gd->data(), got->data(), d->data(), md->data(), vd->data()),
        "BatchNorm backward");
  }
}

// The CPU's available memory is the host's: more than nothing, less than
// a petabyte.
TEST_F(CpuBackendTest, AvailableMemoryIsTheHosts) {
  absl::StatusOr<int64_t> bytes = backend_->AvailableMemory();
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_GT(*bytes, 0);
  EXPECT_LT(*bytes, int64_t{1} << 50);
}

}  // namespace
}  // namespace psflow::kernels

namespace psflow::kernels {
namespace {

TEST(ExpandDevicesTest, ListsAndRefusals) {
  absl::StatusOr<std::vector<std::string>> d = ExpandDevices("cpu");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, std::vector<std::string>{"cpu"});
  d = ExpandDevices("cuda:0,cuda:1");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, (std::vector<std::string>{"cuda:0", "cuda:1"}));
  d = ExpandDevices("cuda,cuda:1");  // "cuda" is cuda:0
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, (std::vector<std::string>{"cuda:0", "cuda:1"}));
  EXPECT_EQ(ExpandDevices("cuda:0,,cuda:1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandDevices("cuda:1,cuda:1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpandDevices("cuda,cuda:0").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpandDevicesTest, CpusFormNoDeviceGroup) {
  absl::StatusOr<std::unique_ptr<Backend>> a = CreateBackend("cpu"), b = CreateBackend("cpu");
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<std::unique_ptr<DeviceGroup>> group = CreateDeviceGroup({a->get(), b->get()});
  EXPECT_FALSE(group.ok());
  // INVALID_ARGUMENT with the CUDA backend built in, UNIMPLEMENTED without.
  EXPECT_TRUE(absl::IsInvalidArgument(group.status()) || absl::IsUnimplemented(group.status()))
      << group.status();
}

// ------------------------------------------------------------ Concat and Interaction

TEST_F(CpuBackendTest, ConcatJoinsAndSplitsWithAddFlags) {
  auto op = backend_->CreateConcat({2, {2, 1}}).value();
  auto a = Upload({1, 2, 3, 4}), b = Upload({5, 6}), y = Filled(6, -1);
  ASSERT_TRUE(op->Forward({a->data(), b->data()}, y->data()).ok());
  EXPECT_EQ(Download(*y), (std::vector<float>{1, 2, 5, 3, 4, 6}));
  auto dy = Upload({10, 20, 30, 40, 50, 60}), da = Filled(4, 1), db = Filled(2, 1);
  // da is written, db added to.
  const std::vector<uint8_t> add = {0, 1};
  ASSERT_TRUE(op->Backward(dy->data(), {da->data(), db->data()}, add).ok());
  EXPECT_EQ(Download(*da), (std::vector<float>{10, 20, 40, 50}));
  EXPECT_EQ(Download(*db), (std::vector<float>{31, 61}));
  // A gradient not wanted; wrong operand counts.
  ASSERT_TRUE(op->Backward(dy->data(), {nullptr, db->data()}, {0, 0}).ok());
  EXPECT_EQ(Download(*db), (std::vector<float>{30, 60}));
  EXPECT_FALSE(op->Forward({a->data()}, y->data()).ok());
  EXPECT_FALSE(backend_->CreateConcat({2, {}}).ok());
  EXPECT_FALSE(backend_->CreateConcat({2, {3, 0}}).ok());
}

TEST_F(CpuBackendTest, InteractionDotsEveryPairAndAddsGradients) {
  // One example, three vectors of 2: pairs (1,0), (2,0), (2,1).
  auto op = backend_->CreateInteraction({1, 3, 2, false}).value();
  auto x0 = Upload({1, 2}), x1 = Upload({3, 4}), x2 = Upload({5, 6}), y = Filled(5, -1);
  ASSERT_TRUE(op->Forward({x0->data(), x1->data(), x2->data()}, y->data()).ok());
  EXPECT_EQ(Download(*y), (std::vector<float>{1, 2, 11, 17, 39}));
  // dy: 1 on x0's copy, then pair gradients 1, 10, 100.
  auto dy = Upload({1, 1, 1, 10, 100});
  auto d0 = Filled(2, 7), d1 = Filled(2, 7), d2 = Filled(2, 7);
  const std::vector<uint8_t> add = {0, 0, 1};
  ASSERT_TRUE(op->Backward({x0->data(), x1->data(), x2->data()}, dy->data(),
                           {d0->data(), d1->data(), d2->data()}, add)
                  .ok());
  // d0 = dy[0:2] + 1*x1 + 10*x2; d1 = 1*x0 + 100*x2; d2 = 7 + 10*x0 + 100*x1.
  EXPECT_EQ(Download(*d0), (std::vector<float>{1 + 3 + 50, 1 + 4 + 60}));
  EXPECT_EQ(Download(*d1), (std::vector<float>{1 + 500, 2 + 600}));
  EXPECT_EQ(Download(*d2), (std::vector<float>{7 + 10 + 300, 7 + 20 + 400}));
  // With self: (0,0), (1,0), (1,1) for two vectors; a vector's own dot
  // contributes twice its value.
  auto self = backend_->CreateInteraction({1, 2, 2, true}).value();
  auto ys = Filled(5, -1);
  ASSERT_TRUE(self->Forward({x0->data(), x1->data()}, ys->data()).ok());
  EXPECT_EQ(Download(*ys), (std::vector<float>{1, 2, 5, 11, 25}));
  auto dys = Upload({0, 0, 1, 0, 0});
  ASSERT_TRUE(
      self->Backward({x0->data(), x1->data()}, dys->data(), {d0->data(), nullptr}, {0, 0}).ok());
  EXPECT_EQ(Download(*d0), (std::vector<float>{2, 4}));
  EXPECT_FALSE(backend_->CreateInteraction({1, 1, 2, false}).ok());
  EXPECT_FALSE(backend_->CreateInteraction({1, kMaxJoinOperands + 1, 2, false}).ok());
}

}  // namespace
}  // namespace psflow::kernels
