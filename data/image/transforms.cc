#include "data/image/transforms.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace psflow::data {
namespace {

// SplitMix64 (Steele, Lea and Flood): fully specified, so a seed gives the
// same windows everywhere, unlike the distributions of <random>.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi), from the top 53 bits.
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * (static_cast<double>(Next() >> 11) * 0x1.0p-53);
  }
  // Uniform in [0, n) for n > 0 (multiply-shift; bias below 2^-32 here).
  int Below(int n) {
    return static_cast<int>((static_cast<unsigned __int128>(Next()) * static_cast<uint64_t>(n)) >>
                            64);
  }

 private:
  uint64_t state_;
};

// Python's round(): half to even (the default floating-point rounding mode).
int RoundHalfEven(double v) { return static_cast<int>(std::nearbyint(v)); }

// One output coordinate's two source samples and the weight of the second.
struct Tap {
  int lo = 0, hi = 0;
  float frac = 0;
};

// Half-pixel centers: output o samples input (o + 0.5) * in / out - 0.5,
// clamped to [0, in - 1]; taps are offset by `origin` and multiplied by
// `stride` (bytes between neighbours).
std::vector<Tap> ComputeTaps(int in_size, int out_size, int origin, int stride) {
  std::vector<Tap> taps(out_size);
  const double scale = static_cast<double>(in_size) / out_size;
  for (int o = 0; o < out_size; ++o) {
    const double at = std::max(0.0, (o + 0.5) * scale - 0.5);
    const int lo = std::min(static_cast<int>(at), in_size - 1);
    const int hi = std::min(lo + 1, in_size - 1);
    taps[o] = {(origin + lo) * stride, (origin + hi) * stride, static_cast<float>(at - lo)};
  }
  return taps;
}

// Source row `row` (as floats) resampled along x: channel c of output
// column ox at out[c * out_width + ox]. kChannels fixes the channel count at
// compile time for the common 1 and 3, so the channel loop unrolls; 0 takes
// `channels`.
template <int kChannels>
void ResampleRow(const float* row, const Tap* cols, int out_width, int channels,
                 float* __restrict out) {
  const int n = kChannels > 0 ? kChannels : channels;
  for (int ox = 0; ox < out_width; ++ox) {
    const Tap& t = cols[ox];
    const float *a = row + t.lo, *b = row + t.hi;
    for (int c = 0; c < n; ++c) out[c * out_width + ox] = a[c] + (b[c] - a[c]) * t.frac;
  }
}

void ResampleRow(const float* row, const Tap* cols, int out_width, int channels, float* out) {
  switch (channels) {
    case 1:
      return ResampleRow<1>(row, cols, out_width, 1, out);
    case 3:
      return ResampleRow<3>(row, cols, out_width, 3, out);
    default:
      return ResampleRow<0>(row, cols, out_width, channels, out);
  }
}

// Blends two rows resampled along x, `n` floats each, into `dst`. The float
// operations and their order are those of the per-pixel form (along x in
// both rows, then along y), so results are bit for bit the same.
void BlendRows(const float* __restrict upper, const float* __restrict lower, float wy, int n,
               float* __restrict dst) {
  constexpr float kScale = 1.0f / 255;
  for (int i = 0; i < n; ++i) dst[i] = (upper[i] + (lower[i] - upper[i]) * wy) * kScale;
}

// Two source rows resampled along x, tagged with their offsets in the
// image, so consecutive output rows sharing a source row resample it once.
// A row's window is converted to float first, in a loop the compiler
// vectorizes; the taps then read floats (exact: they hold bytes).
class RowCache {
 public:
  // `window`: the first of a row's `span` bytes in the window; `cols` are
  // offsets from it.
  RowCache(const uint8_t* window, int span, const Tap* cols, int out_width, int channels)
      : window_(window), span_(span), cols_(cols), out_width_(out_width), channels_(channels) {
    const size_t n = size_t{1} * out_width * channels;
    buffer_.resize(2 * n + span);
    slots_[0] = {-1, buffer_.data()};
    slots_[1] = {-1, buffer_.data() + n};
  }

  // The resampled row at byte offset `offset`, keeping the one at `keep`.
  const float* Get(int offset, int keep) {
    for (const Slot& s : slots_) {
      if (s.offset == offset) return s.data;
    }
    Slot& s = slots_[0].offset == keep ? slots_[1] : slots_[0];
    s.offset = offset;
    float* __restrict row = buffer_.data() + buffer_.size() - span_;
    const uint8_t* __restrict bytes = window_ + offset;
    for (int i = 0; i < span_; ++i) row[i] = bytes[i];
    ResampleRow(row, cols_, out_width_, channels_, s.data);
    return s.data;
  }

 private:
  struct Slot {
    int offset;
    float* data;
  };
  const uint8_t* window_;
  const int span_;
  const Tap* cols_;
  const int out_width_, channels_;
  std::vector<float> buffer_;
  Slot slots_[2];
};

}  // namespace

CropWindow RandomResizedCrop(ImageSize size, uint64_t seed, double min_scale, double max_scale,
                             double min_ratio, double max_ratio) {
  const int height = size.height, width = size.width;
  if (height <= 0 || width <= 0) return {};
  SplitMix64 rng(seed);
  const double area = static_cast<double>(height) * width;
  const double log_min = std::log(min_ratio), log_max = std::log(max_ratio);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * rng.Uniform(min_scale, max_scale);
    const double ratio = std::exp(rng.Uniform(log_min, log_max));
    const int w = RoundHalfEven(std::sqrt(target_area * ratio));
    const int h = RoundHalfEven(std::sqrt(target_area / ratio));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int y = rng.Below(height - h + 1);
      const int x = rng.Below(width - w + 1);
      return {y, x, h, w};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  int w = width, h = height;
  if (in_ratio < min_ratio) {
    h = std::clamp(RoundHalfEven(w / min_ratio), 1, height);
  } else if (in_ratio > max_ratio) {
    w = std::clamp(RoundHalfEven(h * max_ratio), 1, width);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

CropWindow CenterCrop(ImageSize size, int resize_shorter, int out_height, int out_width) {
  if (size.height <= 0 || size.width <= 0 || resize_shorter <= 0 || out_height <= 0 ||
      out_width <= 0) {
    return {};
  }
  // Original pixels per resized pixel.
  const double scale = static_cast<double>(std::min(size.height, size.width)) / resize_shorter;
  const int h = std::clamp(static_cast<int>(std::lround(out_height * scale)), 1, size.height);
  const int w = std::clamp(static_cast<int>(std::lround(out_width * scale)), 1, size.width);
  return {(size.height - h) / 2, (size.width - w) / 2, h, w};
}

absl::Status ResizeInto(const Image& src, CropWindow window, int out_height, int out_width,
                        bool flip_horizontal, float* chw_out) {
  const int channels = src.channels;
  if (src.height <= 0 || src.width <= 0 || channels <= 0 ||
      src.pixels.size() != size_t{1} * src.height * src.width * channels) {
    return absl::InvalidArgumentError(absl::StrCat("resize: ", src.height, "x", src.width, "x",
                                                   channels, " image of ", src.pixels.size(),
                                                   " bytes"));
  }
  const CropWindow& w = window;
  if (w.y < 0 || w.x < 0 || w.height <= 0 || w.width <= 0 || w.y > src.height - w.height ||
      w.x > src.width - w.width) {
    return absl::InvalidArgumentError(absl::StrCat("resize: window (y ", w.y, ", x ", w.x, ", ",
                                                   w.height, "x", w.width, ") is not inside the ",
                                                   src.height, "x", src.width, " image"));
  }
  if (out_height <= 0 || out_width <= 0 || chw_out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("resize: output of ", out_height, "x", out_width));
  }
  const int stride = src.width * channels;
  const std::vector<Tap> rows = ComputeTaps(w.height, out_height, w.y, stride);
  std::vector<Tap> cols = ComputeTaps(w.width, out_width, 0, channels);
  if (flip_horizontal) std::reverse(cols.begin(), cols.end());
  // Separable: each needed source row is resampled along x once into
  // channel-planar floats, then pairs of them are blended along y.
  RowCache cache(src.pixels.data() + w.x * channels, w.width * channels, cols.data(), out_width,
                 channels);
  const size_t plane = size_t{1} * out_height * out_width;
  for (int oy = 0; oy < out_height; ++oy) {
    const Tap& r = rows[oy];
    const float* upper = cache.Get(r.lo, r.hi);
    const float* lower = cache.Get(r.hi, r.lo);
    for (int c = 0; c < channels; ++c) {
      BlendRows(upper + size_t{1} * c * out_width, lower + size_t{1} * c * out_width, r.frac,
                out_width, chw_out + c * plane + size_t{1} * oy * out_width);
    }
  }
  return absl::OkStatus();
}

}  // namespace psflow::data
