// The ImageNet-style training and evaluation transforms of the input
// pipeline: choose a window of the original image (RandomResizedCrop,
// CenterCrop), decode only that window (DecodeImage with a crop), then
// resample it once to the model's input, written as float CHW (ResizeInto).
//
// Pure functions of their arguments: deterministic for a seed on every
// platform and standard library, thread-safe.
#ifndef PSFLOW_DATA_IMAGE_TRANSFORMS_H_
#define PSFLOW_DATA_IMAGE_TRANSFORMS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "data/image/image.h"

namespace psflow::data {

// torchvision's RandomResizedCrop.get_params: up to 10 draws of an area
// fraction uniform in [min_scale, max_scale] and an aspect ratio (width /
// height) log-uniform in [min_ratio, max_ratio], the first that fits; else
// the central crop of the whole image with its ratio clamped to
// [min_ratio, max_ratio]. Sides are rounded half to even, as Python's round.
// Random numbers come from SplitMix64 seeded with `seed`. An empty size gives
// an empty window.
CropWindow RandomResizedCrop(ImageSize size, uint64_t seed, double min_scale = 0.08,
                             double max_scale = 1.0, double min_ratio = 3.0 / 4,
                             double max_ratio = 4.0 / 3);

// The evaluation recipe "resize the shorter side to resize_shorter, then
// take the central out_height x out_width", as the window of the original
// image that becomes the output (its sides rounded, its corner floored, so
// within a pixel of the exact one; clamped to the image). Resizing that
// window to out_height x out_width with ResizeInto is the recipe with one
// resampling instead of two. Non-positive arguments give an empty window.
CropWindow CenterCrop(ImageSize size, int resize_shorter, int out_height, int out_width);

// Bilinear resampling of `window` (in src's coordinates) to out_height x
// out_width with half-pixel centers, as tf.image.resize (bilinear, no
// antialias) and PyTorch's interpolate(align_corners=False); mirrored left
// to right when flip_horizontal. Writes src.channels planes of out_height *
// out_width floats, pixel / 255, to chw_out. A window outside the image, an
// inconsistent src or a non-positive output size is INVALID_ARGUMENT.
absl::Status ResizeInto(const Image& src, CropWindow window, int out_height, int out_width,
                        bool flip_horizontal, float* chw_out);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_IMAGE_TRANSFORMS_H_
