#include "worker/clip.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& g) {
  std::vector<absl::Span<float>> spans;
  for (std::vector<float>& v : g) spans.push_back(absl::MakeSpan(v));
  return spans;
}

TEST(ClipTest, GlobalNormIsOverEveryGradient) {
  std::vector<std::vector<float>> g = {{3, 0}, {}, {4}};
  EXPECT_DOUBLE_EQ(
      GlobalNorm({absl::MakeConstSpan(g[0]), absl::MakeConstSpan(g[1]), absl::MakeConstSpan(g[2])}),
      5.0);
  EXPECT_DOUBLE_EQ(GlobalNorm({}), 0.0);
}

TEST(ClipTest, ScalesEveryGradientByBoundOverNorm) {
  // Norm 5 (3-4-5 over two tensors): clipped to 1, every value / 5, as
  // tf.clip_by_global_norm([[3], [4]], 1) gives [[0.6], [0.8]].
  std::vector<std::vector<float>> g = {{3, 0}, {-4}};
  const Clipped c = ClipByGlobalNorm(Spans(g), 1.0f);
  EXPECT_TRUE(c.clipped);
  EXPECT_DOUBLE_EQ(c.norm, 5.0);
  EXPECT_FLOAT_EQ(g[0][0], 0.6f);
  EXPECT_FLOAT_EQ(g[0][1], 0.0f);
  EXPECT_FLOAT_EQ(g[1][0], -0.8f);
  EXPECT_NEAR(GlobalNorm({absl::MakeConstSpan(g[0]), absl::MakeConstSpan(g[1])}), 1.0, 1e-6);
}

TEST(ClipTest, LeavesGradientsWithinTheBound) {
  std::vector<std::vector<float>> g = {{3, 0}, {-4}};
  for (float bound : {5.0f, 6.0f, 1e30f}) {
    const Clipped c = ClipByGlobalNorm(Spans(g), bound);
    EXPECT_FALSE(c.clipped) << bound;
    EXPECT_EQ(g[0][0], 3.0f);
    EXPECT_EQ(g[1][0], -4.0f);
  }
  // 0: no clipping at all.
  const Clipped off = ClipByGlobalNorm(Spans(g), 0.0f);
  EXPECT_FALSE(off.clipped);
  EXPECT_EQ(g[0][0], 3.0f);
}

TEST(ClipTest, NonFiniteNormsAreNotClipped) {
  // A NaN or an infinity is the on_nonfinite policy's: left as it is, so the
  // step's check still finds it.
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<std::vector<float>> g = {{1, bad}, {100}};
    const Clipped c = ClipByGlobalNorm(Spans(g), 1.0f);
    EXPECT_FALSE(c.clipped) << bad;
    EXPECT_FALSE(std::isfinite(c.norm)) << bad;
    EXPECT_EQ(g[0][0], 1.0f);
    EXPECT_EQ(g[1][0], 100.0f);
  }
  EXPECT_EQ(ClipScale(std::numeric_limits<double>::quiet_NaN(), 1.0f), 1.0f);
}

TEST(ClipTest, HugeFiniteGradientsHaveAFiniteNorm) {
  // Squares of fp32 values near their maximum overflow fp32, not double:
  // the norm stays finite and the clip brings them down.
  const float big = std::numeric_limits<float>::max() / 2;
  std::vector<std::vector<float>> g = {{big, big, big, big}};
  const Clipped c = ClipByGlobalNorm(Spans(g), 2.0f);
  EXPECT_TRUE(std::isfinite(c.norm));
  EXPECT_TRUE(c.clipped);
  for (float v : g[0]) EXPECT_NEAR(v, 1.0f, 1e-6f);
}

}  // namespace
}  // namespace psflow::worker
