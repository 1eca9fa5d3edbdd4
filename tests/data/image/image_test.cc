#include "data/image/image.h"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "data/image/transforms.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

// Smooth color gradients under a gray 8x8 checker (edges in luma only, which
// 4:2:0 JPEG keeps): every window has detail, and every channel differs.
Image MakeImage(int height, int width, int channels) {
  Image image{height, width, channels, {}};
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      const int checker = ((y / 8 + x / 8) % 2) * 40;
      const int ramps[4] = {x * 200 / width, y * 200 / height, (x + y) * 100 / (width + height),
                            255 - x * 100 / width};
      for (int c = 0; c < channels; ++c) {
        image.pixels.push_back(static_cast<uint8_t>(ramps[c] + checker + 10));
      }
    }
  }
  return image;
}

Image Decode(const std::string& bytes, int channels, const CropWindow* crop = nullptr) {
  absl::StatusOr<Image> image = DecodeImage(bytes, channels, crop);
  EXPECT_TRUE(image.ok()) << image.status();
  return image.ok() ? *std::move(image) : Image();
}

std::string Encode(const absl::StatusOr<std::string>& bytes) {
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : std::string();
}

// Window `w` of `image`.
Image Crop(const Image& image, const CropWindow& w) {
  Image out{w.height, w.width, image.channels, {}};
  for (int y = w.y; y < w.y + w.height; ++y) {
    const auto* row = image.pixels.data() + (size_t{1} * y * image.width + w.x) * image.channels;
    out.pixels.insert(out.pixels.end(), row, row + size_t{1} * w.width * image.channels);
  }
  return out;
}

int MaxAbsDiff(const Image& a, const Image& b) {
  EXPECT_EQ(a.pixels.size(), b.pixels.size());
  int worst = 0;
  for (size_t i = 0; i < std::min(a.pixels.size(), b.pixels.size()); ++i) {
    worst = std::max(worst, std::abs(a.pixels[i] - b.pixels[i]));
  }
  return worst;
}

double MeanAbsDiff(const Image& a, const Image& b) {
  double sum = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) sum += std::abs(a.pixels[i] - b.pixels[i]);
  return a.pixels.empty() ? 0 : sum / a.pixels.size();
}

// A PNG written with libpng directly, in the color types the encoder never
// writes. `rows` are packed as the format stores them (16-bit big-endian).
std::string WritePng(int height, int width, int color_type, int bit_depth,
                     const std::vector<uint8_t>& rows, const std::vector<png_color>& palette = {},
                     bool interlaced = false) {
  std::string out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(
      png, &out,
      [](png_structp p, png_bytep data, size_t n) {
        static_cast<std::string*>(png_get_io_ptr(p))->append(reinterpret_cast<char*>(data), n);
      },
      nullptr);
  png_set_IHDR(png, info, width, height, bit_depth, color_type,
               interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) png_set_PLTE(png, info, palette.data(), palette.size());
  png_write_info(png, info);
  const size_t stride = rows.size() / height;
  std::vector<png_bytep> row_pointers;
  for (int y = 0; y < height; ++y) {
    row_pointers.push_back(const_cast<png_bytep>(rows.data() + y * stride));
  }
  png_write_image(png, row_pointers.data());  // every Adam7 pass when interlaced
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

uint8_t Luma(int r, int g, int b) { return std::lround(0.299 * r + 0.587 * g + 0.114 * b); }

TEST(ImageTest, SniffAndPeek) {
  const Image image = MakeImage(37, 53, 3);
  const std::string png = Encode(EncodePng(image)), jpeg = Encode(EncodeJpeg(image, 90));
  EXPECT_EQ(SniffImage(png), ImageFormat::kPng);
  EXPECT_EQ(SniffImage(jpeg), ImageFormat::kJpeg);
  EXPECT_EQ(SniffImage("GIF89a"), ImageFormat::kUnknown);
  EXPECT_EQ(SniffImage(""), ImageFormat::kUnknown);
  for (const std::string& bytes : {png, jpeg}) {
    absl::StatusOr<ImageSize> size = PeekImageSize(bytes);
    ASSERT_TRUE(size.ok()) << size.status();
    EXPECT_EQ(size->height, 37);
    EXPECT_EQ(size->width, 53);
    EXPECT_EQ(PeekImageSize(bytes.substr(0, 10)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(PeekImageSize("not an image").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ImageTest, PngRoundTripIsExact) {
  for (int channels : {1, 3}) {
    const Image image = MakeImage(31, 45, channels);
    const Image back = Decode(Encode(EncodePng(image)), channels);
    EXPECT_EQ(back.height, 31);
    EXPECT_EQ(back.width, 45);
    EXPECT_EQ(back.channels, channels);
    EXPECT_EQ(back.pixels, image.pixels);
  }
}

TEST(ImageTest, JpegRoundTripIsClose) {
  for (int channels : {1, 3}) {
    const Image image = MakeImage(64, 80, channels);
    const Image back = Decode(Encode(EncodeJpeg(image, 95)), channels);
    ASSERT_EQ(back.pixels.size(), image.pixels.size());
    EXPECT_LT(MeanAbsDiff(back, image), 2.5) << channels << " channels";
  }
  EXPECT_FALSE(EncodeJpeg(MakeImage(4, 4, 3), 0).ok());
  EXPECT_FALSE(EncodeJpeg(MakeImage(4, 4, 4), 90).ok());
  EXPECT_FALSE(EncodePng(Image{4, 4, 3, {}}).ok());
}

TEST(ImageTest, GrayAndRgbConvert) {
  const Image gray = MakeImage(9, 11, 1);
  const Image rgb = Decode(Encode(EncodePng(gray)), 3);
  ASSERT_EQ(rgb.channels, 3);
  for (size_t i = 0; i < gray.pixels.size(); ++i) {
    EXPECT_EQ(rgb.pixels[3 * i], gray.pixels[i]);
    EXPECT_EQ(rgb.pixels[3 * i + 1], gray.pixels[i]);
    EXPECT_EQ(rgb.pixels[3 * i + 2], gray.pixels[i]);
  }
  const Image color = MakeImage(9, 11, 3);
  const Image luma = Decode(Encode(EncodePng(color)), 1);
  ASSERT_EQ(luma.channels, 1);
  for (size_t i = 0; i < luma.pixels.size(); ++i) {
    const uint8_t* p = &color.pixels[3 * i];
    EXPECT_NEAR(luma.pixels[i], Luma(p[0], p[1], p[2]), 1) << i;
  }
  // A JPEG read as gray is its luma too (libjpeg keeps only Y).
  const Image red{16, 16, 3, [] {
                    std::vector<uint8_t> v;
                    for (int i = 0; i < 256; ++i) v.insert(v.end(), {255, 0, 0});
                    return v;
                  }()};
  for (uint8_t v : Decode(Encode(EncodeJpeg(red, 95)), 1).pixels) EXPECT_NEAR(v, 76, 2);
  // And a gray JPEG read as RGB repeats it.
  const Image rgb_of_jpeg = Decode(Encode(EncodeJpeg(gray, 95)), 3);
  for (size_t i = 0; i < gray.pixels.size(); ++i) {
    EXPECT_EQ(rgb_of_jpeg.pixels[3 * i], rgb_of_jpeg.pixels[3 * i + 2]);
  }
}

TEST(ImageTest, RgbaPngDropsAlpha) {
  const Image rgba = MakeImage(6, 7, 4);
  const std::string bytes = WritePng(6, 7, PNG_COLOR_TYPE_RGBA, 8, rgba.pixels);
  const Image rgb = Decode(bytes, 3);
  const Image gray = Decode(bytes, 1);
  for (size_t i = 0; i < 6 * 7; ++i) {
    const uint8_t* p = &rgba.pixels[4 * i];
    EXPECT_EQ(rgb.pixels[3 * i], p[0]);
    EXPECT_EQ(rgb.pixels[3 * i + 1], p[1]);
    EXPECT_EQ(rgb.pixels[3 * i + 2], p[2]);
    EXPECT_NEAR(gray.pixels[i], Luma(p[0], p[1], p[2]), 1);
  }
}

TEST(ImageTest, InterlacedAndGrayAlphaPngs) {
  const Image rgb = MakeImage(13, 17, 3);
  EXPECT_EQ(Decode(WritePng(13, 17, PNG_COLOR_TYPE_RGB, 8, rgb.pixels, {}, true), 3).pixels,
            rgb.pixels);
  const Image gray_alpha = MakeImage(13, 17, 2);
  const Image gray = Decode(WritePng(13, 17, PNG_COLOR_TYPE_GRAY_ALPHA, 8, gray_alpha.pixels), 3);
  for (size_t i = 0; i < 13 * 17; ++i) {
    EXPECT_EQ(gray.pixels[3 * i], gray_alpha.pixels[2 * i]);
    EXPECT_EQ(gray.pixels[3 * i + 2], gray_alpha.pixels[2 * i]);
  }
}

TEST(ImageTest, SixteenBitPngScalesTo8Bits) {
  const Image rgb = MakeImage(5, 8, 3);
  std::vector<uint8_t> wide;  // v * 257 = v in both bytes
  for (uint8_t v : rgb.pixels) wide.insert(wide.end(), {v, v});
  EXPECT_EQ(Decode(WritePng(5, 8, PNG_COLOR_TYPE_RGB, 16, wide), 3).pixels, rgb.pixels);
  const Image gray = MakeImage(5, 8, 1);
  wide.clear();
  for (uint8_t v : gray.pixels) wide.insert(wide.end(), {v, v});
  EXPECT_EQ(Decode(WritePng(5, 8, PNG_COLOR_TYPE_GRAY, 16, wide), 1).pixels, gray.pixels);
}

TEST(ImageTest, PalettePngExpands) {
  const std::vector<png_color> palette = {{0, 0, 0}, {255, 0, 0}, {10, 200, 30}, {90, 90, 250}};
  // 2 bits an index, 4 pixels a byte: rows of 8 pixels are 2 bytes.
  const std::vector<uint8_t> rows = {0b00011011, 0b11100100, 0b01010101, 0b10101010};
  const Image rgb = Decode(WritePng(2, 8, PNG_COLOR_TYPE_PALETTE, 2, rows, palette), 3);
  ASSERT_EQ(rgb.pixels.size(), 2u * 8 * 3);
  const int indices[16] = {0, 1, 2, 3, 3, 2, 1, 0, 1, 1, 1, 1, 2, 2, 2, 2};
  for (int i = 0; i < 16; ++i) {
    const png_color& c = palette[indices[i]];
    EXPECT_EQ(rgb.pixels[3 * i], c.red) << i;
    EXPECT_EQ(rgb.pixels[3 * i + 1], c.green) << i;
    EXPECT_EQ(rgb.pixels[3 * i + 2], c.blue) << i;
  }
  const Image gray = Decode(WritePng(2, 8, PNG_COLOR_TYPE_PALETTE, 2, rows, palette), 1);
  EXPECT_EQ(gray.pixels[1], Luma(255, 0, 0));
}

TEST(ImageTest, CropDecodeMatchesFullDecode) {
  const Image image = MakeImage(120, 160, 3);
  const std::string jpeg = Encode(EncodeJpeg(image, 90));
  const std::string png = Encode(EncodePng(image));
  const CropWindow windows[] = {{0, 0, 120, 160}, {0, 0, 1, 1},      {16, 32, 48, 64},
                                {17, 33, 50, 61}, {5, 100, 115, 60}, {119, 159, 1, 1},
                                {40, 3, 20, 150}};
  for (int channels : {1, 3}) {
    const Image full_jpeg = Decode(jpeg, channels), full_png = Decode(png, channels);
    for (const CropWindow& w : windows) {
      const Image part = Decode(jpeg, channels, &w);
      EXPECT_EQ(part.height, w.height);
      EXPECT_EQ(part.width, w.width);
      EXPECT_EQ(part.channels, channels);
      EXPECT_EQ(MaxAbsDiff(part, Crop(full_jpeg, w)), 0)
          << channels << " channels, window " << w.y << "," << w.x << " " << w.height << "x"
          << w.width;
      EXPECT_EQ(Decode(png, channels, &w).pixels, Crop(full_png, w).pixels);
    }
  }
  for (const CropWindow& bad : {CropWindow{0, 0, 0, 5}, CropWindow{-1, 0, 5, 5},
                                CropWindow{100, 0, 21, 5}, CropWindow{0, 150, 5, 11}}) {
    EXPECT_EQ(DecodeImage(jpeg, 3, &bad).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(DecodeImage(png, 3, &bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// DecodeImageInto keeps libjpeg's columns around the crop; the crop it
// places there is DecodeImage's, and the buffer is reused.
TEST(ImageTest, DecodeIntoPlacesTheCrop) {
  const Image image = MakeImage(120, 160, 3);
  const std::string jpeg = Encode(EncodeJpeg(image, 90));
  const std::string png = Encode(EncodePng(image));
  const CropWindow windows[] = {{0, 0, 120, 160},  {16, 32, 48, 64}, {17, 33, 50, 61},
                                {5, 100, 115, 60}, {119, 159, 1, 1}, {40, 3, 20, 150}};
  Image out;
  for (int channels : {1, 3}) {
    for (const std::string* bytes : {&jpeg, &png}) {
      for (const CropWindow& w : windows) {
        CropWindow placed;
        ASSERT_TRUE(DecodeImageInto(*bytes, channels, &w, &out, &placed).ok());
        EXPECT_EQ(out.channels, channels);
        EXPECT_EQ(out.height, w.height);
        EXPECT_EQ(placed.y, 0);
        EXPECT_EQ(placed.height, w.height);
        EXPECT_EQ(placed.width, w.width);
        ASSERT_LE(placed.x + placed.width, out.width);
        EXPECT_EQ(out.pixels.size(), size_t{1} * out.height * out.width * channels);
        EXPECT_EQ(Crop(out, placed).pixels, Decode(*bytes, channels, &w).pixels)
            << channels << " channels, window " << w.y << "," << w.x << " " << w.height << "x"
            << w.width;
      }
    }
  }
  CropWindow whole;
  ASSERT_TRUE(DecodeImageInto(jpeg, 3, nullptr, &out, &whole).ok());
  const uint8_t* buffer = out.pixels.data();
  ASSERT_TRUE(DecodeImageInto(jpeg, 3, &windows[1], &out, &whole).ok());
  EXPECT_EQ(out.pixels.data(), buffer);
  const CropWindow bad{100, 0, 21, 5};
  EXPECT_EQ(DecodeImageInto(jpeg, 3, &bad, &out, &whole).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeImageInto("not an image", 3, nullptr, &out, &whole).code(),
            absl::StatusCode::kInvalidArgument);
}

// Every prefix of a valid file and a few corruptions are one-line
// INVALID_ARGUMENT errors (or, for corruption libjpeg cannot see, an image),
// never a crash, and nothing is printed.
TEST(ImageTest, TruncatedAndCorruptBytesAreInvalidArgument) {
  const Image image = MakeImage(24, 40, 3);
  const std::string files[] = {Encode(EncodeJpeg(image, 80)), Encode(EncodePng(image))};
  testing::internal::CaptureStderr();
  for (const std::string& file : files) {
    for (size_t n = 0; n < file.size(); n += (n < 64 || file.size() - n < 64) ? 1 : 7) {
      absl::StatusOr<Image> decoded = DecodeImage(file.substr(0, n), 3);
      ASSERT_FALSE(decoded.ok()) << "prefix of " << n << " bytes";
      EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(decoded.status().message().find('\n'), absl::string_view::npos);
    }
    for (size_t at = 2; at < file.size(); at += 5) {
      std::string corrupt = file;
      corrupt[at] = static_cast<char>(corrupt[at] ^ 0x5a);
      absl::StatusOr<Image> decoded = DecodeImage(corrupt, 3);
      if (!decoded.ok()) {
        EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument) << decoded.status();
      }
    }
  }
  std::string garbage = "\xff\xd8\xff";
  for (int i = 0; i < 500; ++i) garbage.push_back(static_cast<char>(i * 37 % 251));
  EXPECT_EQ(DecodeImage(garbage, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeImage("hello", 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeImage(files[1], 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(TransformsTest, RandomResizedCropStaysInBounds) {
  const ImageSize sizes[] = {{375, 500}, {500, 375}, {100, 30}, {30, 100}, {1, 1}, {224, 224}};
  for (const ImageSize& size : sizes) {
    const double area = static_cast<double>(size.height) * size.width;
    for (uint64_t seed = 0; seed < 2000; ++seed) {
      const CropWindow w = RandomResizedCrop(size, seed);
      ASSERT_GE(w.y, 0);
      ASSERT_GE(w.x, 0);
      ASSERT_GE(w.height, 1);
      ASSERT_GE(w.width, 1);
      ASSERT_LE(w.y + w.height, size.height);
      ASSERT_LE(w.x + w.width, size.width);
      if (size.height < 4 || size.width < 4) continue;
      // Sides are rounded, so the bounds hold to half a pixel.
      EXPECT_GE((w.height + 0.5) * (w.width + 0.5), 0.08 * area);
      EXPECT_LE((w.height - 0.5) * (w.width - 0.5), area);
      EXPECT_GE((w.width + 0.5) / (w.height - 0.5), 3.0 / 4);
      EXPECT_LE((w.width - 0.5) / (w.height + 0.5), 4.0 / 3);
    }
  }
}

TEST(TransformsTest, RandomResizedCropIsDeterministic) {
  std::set<std::tuple<int, int, int, int>> seen;
  for (uint64_t seed = 0; seed < 100; ++seed) {
    const CropWindow a = RandomResizedCrop({375, 500}, seed);
    const CropWindow b = RandomResizedCrop({375, 500}, seed);
    EXPECT_EQ(std::tie(a.y, a.x, a.height, a.width), std::tie(b.y, b.x, b.height, b.width));
    seen.insert({a.y, a.x, a.height, a.width});
  }
  EXPECT_GT(seen.size(), 95u);
  // A 10x1000 strip never fits a draw of at least 8% of its area with a
  // ratio <= 4/3: the fallback is the central 10x13 (round(10 * 4/3)).
  const CropWindow strip = RandomResizedCrop({10, 1000}, 7);
  EXPECT_EQ(std::tie(strip.y, strip.x, strip.height, strip.width), std::make_tuple(0, 493, 10, 13));
  // scale (1, 1) and ratio (1, 1) on a square leaves only the whole image.
  const CropWindow whole = RandomResizedCrop({50, 50}, 3, 1.0, 1.0, 1.0, 1.0);
  EXPECT_EQ(std::tie(whole.y, whole.x, whole.height, whole.width), std::make_tuple(0, 0, 50, 50));
}

TEST(TransformsTest, CenterCropKnownWindows) {
  auto window = [](ImageSize size, int resize, int h, int w) {
    const CropWindow c = CenterCrop(size, resize, h, w);
    return std::make_tuple(c.y, c.x, c.height, c.width);
  };
  // 375 / 256 original pixels per resized one: 224 of them are 328.125.
  EXPECT_EQ(window({375, 500}, 256, 224, 224), std::make_tuple(23, 86, 328, 328));
  EXPECT_EQ(window({500, 375}, 256, 224, 224), std::make_tuple(86, 23, 328, 328));
  // 224 / 256 = 0.875: the central 87.5%.
  EXPECT_EQ(window({224, 224}, 256, 224, 224), std::make_tuple(14, 14, 196, 196));
  EXPECT_EQ(window({256, 512}, 256, 224, 224), std::make_tuple(16, 144, 224, 224));
  // Wider than the resized image: clamped to it.
  EXPECT_EQ(window({100, 300}, 100, 100, 400), std::make_tuple(0, 0, 100, 300));
  EXPECT_EQ(window({100, 300}, 0, 100, 100), std::make_tuple(0, 0, 0, 0));
}

TEST(TransformsTest, ResizeIdentityCopies) {
  const Image image = MakeImage(7, 5, 3);
  std::vector<float> out(3 * 7 * 5);
  ASSERT_TRUE(ResizeInto(image, {0, 0, 7, 5}, 7, 5, false, out.data()).ok());
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < 7; ++y) {
      for (int x = 0; x < 5; ++x) {
        EXPECT_FLOAT_EQ(out[(c * 7 + y) * 5 + x], image.pixels[(y * 5 + x) * 3 + c] / 255.0f);
      }
    }
  }
  // A window resized to its own size is that window.
  std::vector<float> part(3 * 3 * 2);
  ASSERT_TRUE(ResizeInto(image, {2, 1, 3, 2}, 3, 2, false, part.data()).ok());
  EXPECT_FLOAT_EQ(part[0], image.pixels[(2 * 5 + 1) * 3] / 255.0f);
  EXPECT_FLOAT_EQ(part[3 * 2 * 2 + 5], image.pixels[(4 * 5 + 2) * 3 + 2] / 255.0f);
}

TEST(TransformsTest, ResizeBilinearHalfPixelKnownAnswer) {
  // [[0, 100], [200, 40]] to 4x4: outputs sample 0 (clamped), 0.25, 0.75, 1 (clamped).
  const Image image{2, 2, 1, {0, 100, 200, 40}};
  const float expected[4][4] = {
      {0, 25, 75, 100}, {50, 58.75, 76.25, 85}, {150, 126.25, 78.75, 55}, {200, 160, 80, 40}};
  std::vector<float> out(16);
  ASSERT_TRUE(ResizeInto(image, {0, 0, 2, 2}, 4, 4, false, out.data()).ok());
  for (int y = 0; y < 4; ++y) {
    for (int x = 0; x < 4; ++x) EXPECT_NEAR(out[y * 4 + x], expected[y][x] / 255, 1e-6);
  }
  ASSERT_TRUE(ResizeInto(image, {0, 0, 2, 2}, 4, 4, true, out.data()).ok());
  for (int y = 0; y < 4; ++y) {
    for (int x = 0; x < 4; ++x) EXPECT_NEAR(out[y * 4 + x], expected[y][3 - x] / 255, 1e-6);
  }
}

TEST(TransformsTest, ResizeFlipMirrors) {
  const Image image = MakeImage(40, 60, 3);
  const CropWindow w{5, 7, 30, 45};
  std::vector<float> plain(3 * 17 * 23), flipped(3 * 17 * 23);
  ASSERT_TRUE(ResizeInto(image, w, 17, 23, false, plain.data()).ok());
  ASSERT_TRUE(ResizeInto(image, w, 17, 23, true, flipped.data()).ok());
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < 17; ++y) {
      for (int x = 0; x < 23; ++x) {
        EXPECT_EQ(flipped[(c * 17 + y) * 23 + x], plain[(c * 17 + y) * 23 + 22 - x]);
      }
    }
  }
  for (float v : plain) {
    EXPECT_GE(v, 0.0f);
    EXPECT_LE(v, 1.0f);
  }
}

// The definition, one output value at a time in double: half-pixel
// centers clamped to the window, taps clamped to its last row and column.
std::vector<float> ReferenceResize(const Image& src, const CropWindow& w, int out_height,
                                   int out_width, bool flip) {
  auto tap = [](int o, int in, int out, int* lo, int* hi) {
    const double at = std::max(0.0, (o + 0.5) * in / out - 0.5);
    *lo = std::min(static_cast<int>(at), in - 1);
    *hi = std::min(*lo + 1, in - 1);
    return at - *lo;
  };
  std::vector<float> out(size_t{1} * src.channels * out_height * out_width);
  for (int oy = 0; oy < out_height; ++oy) {
    int y0, y1;
    const double fy = tap(oy, w.height, out_height, &y0, &y1);
    for (int ox = 0; ox < out_width; ++ox) {
      int x0, x1;
      const double fx = tap(flip ? out_width - 1 - ox : ox, w.width, out_width, &x0, &x1);
      for (int c = 0; c < src.channels; ++c) {
        auto at = [&](int y, int x) {
          const size_t i = (size_t{1} * (w.y + y) * src.width + w.x + x) * src.channels + c;
          return static_cast<double>(src.pixels[i]);
        };
        const double upper = at(y0, x0) + (at(y0, x1) - at(y0, x0)) * fx;
        const double lower = at(y1, x0) + (at(y1, x1) - at(y1, x0)) * fx;
        out[(size_t{1} * c * out_height + oy) * out_width + ox] =
            static_cast<float>((upper + (lower - upper) * fy) / 255);
      }
    }
  }
  return out;
}

TEST(TransformsTest, ResizeMatchesReferenceOnRandomWindows) {
  std::mt19937 rng(7);
  auto uniform = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    const int channels = trial % 4 + 1;
    Image src{uniform(1, 60), uniform(1, 60), channels, {}};
    src.pixels.resize(size_t{1} * src.height * src.width * channels);
    for (uint8_t& p : src.pixels) p = static_cast<uint8_t>(uniform(0, 255));
    CropWindow w;
    w.height = uniform(1, src.height);
    w.width = uniform(1, src.width);
    w.y = uniform(0, src.height - w.height);
    w.x = uniform(0, src.width - w.width);
    const int out_height = uniform(1, 80), out_width = uniform(1, 80);
    const bool flip = uniform(0, 1) == 1;
    std::vector<float> out(size_t{1} * channels * out_height * out_width, -1.0f);
    ASSERT_TRUE(ResizeInto(src, w, out_height, out_width, flip, out.data()).ok());
    const std::vector<float> expected = ReferenceResize(src, w, out_height, out_width, flip);
    float worst = 0;
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - expected[i]));
    EXPECT_LE(worst, 1e-6f) << "trial " << trial << ": " << src.height << "x" << src.width << "x"
                            << channels << ", window " << w.y << "," << w.x << " " << w.height
                            << "x" << w.width << " to " << out_height << "x" << out_width
                            << (flip ? " flipped" : "");
  }
}

TEST(TransformsTest, ResizeRejectsBadArguments) {
  const Image image = MakeImage(10, 10, 3);
  std::vector<float> out(3 * 4 * 4);
  for (const CropWindow& bad : {CropWindow{0, 0, 11, 10}, CropWindow{-1, 0, 4, 4},
                                CropWindow{0, 8, 4, 4}, CropWindow{0, 0, 0, 4}}) {
    EXPECT_EQ(ResizeInto(image, bad, 4, 4, false, out.data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(ResizeInto(image, {0, 0, 4, 4}, 0, 4, false, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResizeInto(Image{10, 10, 3, {}}, {0, 0, 4, 4}, 4, 4, false, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow::data
