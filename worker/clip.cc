#include "worker/clip.h"

#include <cmath>

namespace psflow::worker {

double GlobalNorm(const std::vector<absl::Span<const float>>& grads) {
  double sum = 0;
  for (absl::Span<const float> g : grads) {
    for (float v : g) sum += static_cast<double>(v) * static_cast<double>(v);
  }
  return std::sqrt(sum);
}

float ClipScale(double norm, float bound) {
  if (!(bound > 0) || !std::isfinite(norm) || norm <= bound) return 1.0f;
  return static_cast<float>(static_cast<double>(bound) / norm);
}

Clipped ClipByGlobalNorm(const std::vector<absl::Span<float>>& grads, float bound) {
  std::vector<absl::Span<const float>> read(grads.begin(), grads.end());
  Clipped c;
  c.norm = GlobalNorm(read);
  const float scale = ClipScale(c.norm, bound);
  if (scale == 1.0f) return c;
  for (absl::Span<float> g : grads) {
    for (float& v : g) v *= scale;
  }
  c.clipped = true;
  return c;
}

}  // namespace psflow::worker
