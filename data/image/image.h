// Decoding and encoding the JPEG and PNG images of data sets (libjpeg-turbo,
// libpng), for the input pipeline and the converters that write its files.
//
// Decoded images are 8-bit, interleaved HWC, with 1 (gray) or 3 (RGB)
// channels whatever the file holds: gray, RGB, RGBA (alpha dropped), palette
// and 16-bit PNGs are converted; RGB to gray is ITU-R 601 luma, as libjpeg
// and PIL compute it. JPEG decoding keeps libjpeg's defaults (JDCT_ISLOW,
// fancy upsampling) so pixels match other decoders; speed comes from
// decoding only a crop window. EXIF orientation and color profiles are
// ignored. Bytes that are not a whole valid image (truncated, corrupt, CMYK
// JPEG, over kMaxImagePixels) are INVALID_ARGUMENT with a one-line message;
// nothing is printed. Thread-safe (no shared state).
#ifndef PSFLOW_DATA_IMAGE_IMAGE_H_
#define PSFLOW_DATA_IMAGE_IMAGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow::data {

// height * width * channels bytes, row-major, channels interleaved.
struct Image {
  int height = 0, width = 0, channels = 0;
  std::vector<uint8_t> pixels;
};

struct ImageSize {
  int height = 0, width = 0;
};

// A rectangle of an image: rows [y, y + height), columns [x, x + width).
struct CropWindow {
  int y = 0, x = 0, height = 0, width = 0;
};

// Images larger than this (height * width) are refused before anything is
// allocated: a corrupt header must not ask for gigabytes.
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

enum class ImageFormat { kJpeg, kPng, kUnknown };

// From the magic bytes only.
ImageFormat SniffImage(absl::string_view bytes);

// The size in the header, without decoding pixels.
absl::StatusOr<ImageSize> PeekImageSize(absl::string_view bytes);

// Decodes to `channels` (1 or 3). With `crop`, returns only that window
// (which must lie inside the image), the same pixels as cropping the whole
// decode: a JPEG decodes just the rows and iMCU columns covering it (so
// damage below the window goes unseen); a PNG decodes whole and is cropped.
absl::StatusOr<Image> DecodeImage(absl::string_view bytes, int channels,
                                  const CropWindow* crop = nullptr);

// DecodeImage for a loop that decodes many images: decodes the crop (or the
// whole image) into *out and sets *window to where it lies there, rows
// [0, crop height) and columns from window->x. A JPEG keeps the columns
// libjpeg decodes around the crop (up to an iMCU boundary), so no row is
// copied, and reuses out's pixel buffer (no allocation once it has held as
// large an image); a PNG becomes exactly the crop. Errors as DecodeImage,
// leaving *out unspecified.
absl::Status DecodeImageInto(absl::string_view bytes, int channels, const CropWindow* crop,
                             Image* out, CropWindow* window);

// Lossless, for images of 1, 3 or 4 channels.
absl::StatusOr<std::string> EncodePng(const Image& image);
// Baseline JPEG (4:2:0 for color) of an image of 1 or 3 channels, quality in [1, 100].
absl::StatusOr<std::string> EncodeJpeg(const Image& image, int quality);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_IMAGE_IMAGE_H_
