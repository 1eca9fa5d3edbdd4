#include "data/synthetic.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace psflow::data {
namespace {

// splitmix64: a tiny counter-based generator, so that example i can be made
// without making the ones before it.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

float Unit(uint64_t bits) { return static_cast<float>(bits >> 40) * 0x1.0p-24f; }  // [0, 1)

constexpr uint64_t kPatternSalt = 0x5053464C4F57ull;  // "PSFLOW"
constexpr int64_t kMaxFloats = int64_t{1} << 31;

}  // namespace

absl::Status CheckSynthetic(const SyntheticShape& shape, int64_t count) {
  if (shape.channels <= 0 || shape.height <= 0 || shape.width <= 0 || shape.num_classes < 2 ||
      count <= 0) {
    return absl::InvalidArgumentError(
        "synthetic data needs positive sizes, a positive count and 2+ classes");
  }
  const int64_t per = int64_t{shape.channels} * shape.height * shape.width;  // ints: no overflow
  if (per > kMaxFloats / (count + shape.num_classes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic data of ", count, " examples of ", per, " values is too large"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Dataset> MakeSynthetic(const SyntheticShape& shape, int64_t count, Split split) {
  if (absl::Status s = CheckSynthetic(shape, count); !s.ok()) return s;
  Dataset d;
  d.count = count;
  d.channels = shape.channels;
  d.height = shape.height;
  d.width = shape.width;
  d.num_classes = shape.num_classes;
  const int64_t per = d.example_floats();
  std::vector<float> patterns(static_cast<size_t>(per * shape.num_classes));
  for (size_t i = 0; i < patterns.size(); ++i) patterns[i] = Unit(Mix(kPatternSalt ^ Mix(i)));
  d.images.resize(static_cast<size_t>(per * count));
  d.labels.resize(static_cast<size_t>(count));
  // Test examples are numbered after every possible training example.
  const uint64_t base = split == Split::kTrain ? 0 : (uint64_t{1} << 40);
  for (int64_t e = 0; e < count; ++e) {
    uint64_t state = Mix(base + static_cast<uint64_t>(e));
    const int label = static_cast<int>(state % static_cast<uint64_t>(shape.num_classes));
    d.labels[e] = label;
    const float* pattern = patterns.data() + label * per;
    float* out = d.images.data() + e * per;
    for (int64_t p = 0; p < per; ++p) {
      state = Mix(state);
      out[p] = 0.5f * pattern[p] + 0.5f * Unit(state);
    }
  }
  return d;
}

}  // namespace psflow::data
