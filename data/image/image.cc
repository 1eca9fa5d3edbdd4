#include "data/image/image.h"

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <utility>

// jpeglib.h needs FILE and size_t declared first (cstdio), jerror.h its
// configuration.
#include <jpeglib.h>
// (after jpeglib.h)
#include <jerror.h>
#include <png.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// libjpeg and libpng report errors by longjmp out of their callbacks. Every
// function below that calls setjmp keeps only trivially destructible locals
// past that point, and the vectors the libraries write into are owned by its
// caller, so a longjmp never skips a destructor (C++ [csetjmp.syn]).

namespace psflow::data {
namespace {

constexpr unsigned char kPngMagic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

absl::Status CheckWindow(const CropWindow& w, int height, int width) {
  if (w.y < 0 || w.x < 0 || w.height <= 0 || w.width <= 0 || w.y > height - w.height ||
      w.x > width - w.width) {
    return absl::InvalidArgumentError(absl::StrCat("crop window (y ", w.y, ", x ", w.x, ", ",
                                                   w.height, "x", w.width, ") is not inside the ",
                                                   height, "x", width, " image"));
  }
  return absl::OkStatus();
}

absl::Status CheckPixelCount(int64_t height, int64_t width) {
  if (height <= 0 || width <= 0 || height * width > kMaxImagePixels) {
    return absl::InvalidArgumentError(
        absl::StrCat("image of ", height, "x", width, " pixels is empty or too large"));
  }
  return absl::OkStatus();
}

// ITU-R 601 luma with libjpeg's fixed-point constants (jccolor.c), so a
// color PNG read as gray matches a color JPEG read as gray.
uint8_t Luma(const uint8_t* rgb) {
  return static_cast<uint8_t>((19595 * rgb[0] + 38470 * rgb[1] + 7471 * rgb[2] + 32768) >> 16);
}

// The window `w` of `src`, with `channels` channels: src's, or 1 from 3.
Image ConvertWindow(const Image& src, const CropWindow& w, int channels) {
  Image out{w.height, w.width, channels, {}};
  out.pixels.resize(size_t{1} * w.height * w.width * channels);
  const int sc = src.channels;
  for (int r = 0; r < w.height; ++r) {
    const uint8_t* s = src.pixels.data() + ((size_t{1} * (w.y + r) * src.width) + w.x) * sc;
    uint8_t* d = out.pixels.data() + size_t{1} * r * w.width * channels;
    if (sc == channels) {
      std::memcpy(d, s, size_t{1} * w.width * channels);
    } else {
      for (int c = 0; c < w.width; ++c) d[c] = Luma(s + 3 * c);
    }
  }
  return out;
}

// ---------------------------------------------------------------- JPEG

struct JpegErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = "";
};

[[noreturn]] void JpegErrorExit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// libjpeg only warns about missing or corrupt entropy-coded data and fills
// what it could not decode with gray; such pixels are not the image, so
// those warnings are errors here. The others (extraneous bytes before a
// marker, an unknown JFIF revision, a bad ICC marker) leave the pixels right.
void JpegEmitMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  switch (cinfo->err->msg_code) {
    case JWRN_JPEG_EOF:
    case JWRN_HIT_MARKER:
    case JWRN_MUST_RESYNC:
    case JWRN_HUFF_BAD_CODE:
    case JWRN_ARITH_BAD_CODE:
    case JWRN_NOT_SEQUENTIAL:
      JpegErrorExit(cinfo);
    default:
      cinfo->err->num_warnings++;
  }
}

void JpegOutputMessage(j_common_ptr) {}  // never print

void InstallJpegErrors(JpegErrorManager* err) {
  jpeg_std_error(&err->pub);
  err->pub.error_exit = JpegErrorExit;
  err->pub.emit_message = JpegEmitMessage;
  err->pub.output_message = JpegOutputMessage;
}

struct JpegDecoder {
  jpeg_decompress_struct cinfo{};
  JpegErrorManager err;
  bool created = false;

  JpegDecoder() {
    InstallJpegErrors(&err);
    cinfo.err = &err.pub;
  }
  ~JpegDecoder() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
  absl::Status Error() const {
    return absl::InvalidArgumentError(absl::StrCat("JPEG: ", err.message));
  }
};

bool JpegReadHeader(JpegDecoder* d, absl::string_view bytes) {
  if (setjmp(d->err.jump)) return false;
  d->created = true;
  jpeg_create_decompress(&d->cinfo);
  jpeg_mem_src(&d->cinfo, reinterpret_cast<const unsigned char*>(bytes.data()),
               static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&d->cinfo, TRUE);
  return true;
}

// Starts decoding window `w`. jpeg_crop_scanline widens the columns to an
// iMCU boundary: libjpeg outputs columns [*xoffset, *xoffset + *width) of
// each row, rows from w.y on (those above are skipped, those below never
// decoded).
bool JpegStartWindow(JpegDecoder* d, const CropWindow& w, int channels, JDIMENSION* xoffset,
                     JDIMENSION* width) {
  jpeg_decompress_struct* cinfo = &d->cinfo;
  if (setjmp(d->err.jump)) return false;
  cinfo->out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(cinfo);
  // One more column on each side: fancy upsampling replicates the edge
  // samples of the decoded columns instead of reading their neighbours.
  *xoffset = std::max(w.x - 1, 0);
  *width = std::min<JDIMENSION>(w.x + w.width + 1, cinfo->output_width) - *xoffset;
  if (*width < cinfo->output_width) jpeg_crop_scanline(cinfo, xoffset, width);
  if (w.y > 0 && jpeg_skip_scanlines(cinfo, w.y) != static_cast<JDIMENSION>(w.y)) {
    std::snprintf(d->err.message, sizeof(d->err.message), "could not skip %d rows", w.y);
    return false;
  }
  return true;
}

// Rows per jpeg_read_scanlines call: it returns what one pass of its
// upsampler and color converter made, often more than one row.
constexpr int kJpegRowBatch = 16;

// Reads the next `count` rows into `out`, `stride` bytes apart.
bool JpegReadRows(JpegDecoder* d, int count, uint8_t* out, size_t stride) {
  jpeg_decompress_struct* cinfo = &d->cinfo;
  if (setjmp(d->err.jump)) return false;
  for (int done = 0; done < count;) {
    JSAMPROW rows[kJpegRowBatch];
    const int n = std::min(count - done, kJpegRowBatch);
    for (int i = 0; i < n; ++i) rows[i] = out + (done + i) * stride;
    const JDIMENSION got = jpeg_read_scanlines(cinfo, rows, n);
    if (got == 0) {
      std::snprintf(d->err.message, sizeof(d->err.message), "no data for row %u",
                    cinfo->output_scanline);
      return false;
    }
    done += static_cast<int>(got);
  }
  return true;
}

// Window `w`, decoded from `left` columns into rows of `width` columns,
// trimmed into `out` (w.height * w.width * channels bytes) through a buffer
// of a few rows.
bool JpegReadTrimmed(JpegDecoder* d, const CropWindow& w, int channels, int left, int width,
                     uint8_t* out) {
  const size_t stride = size_t{1} * width * channels, row_bytes = size_t{1} * w.width * channels;
  std::vector<uint8_t> buffer(kJpegRowBatch * stride);
  for (int r = 0; r < w.height; r += kJpegRowBatch) {
    const int n = std::min(w.height - r, kJpegRowBatch);
    if (!JpegReadRows(d, n, buffer.data(), stride)) return false;
    for (int i = 0; i < n; ++i) {
      std::memcpy(out + (r + i) * row_bytes, buffer.data() + i * stride + left * channels,
                  row_bytes);
    }
  }
  return true;
}

absl::StatusOr<ImageSize> PeekJpeg(absl::string_view bytes) {
  JpegDecoder d;
  if (!JpegReadHeader(&d, bytes)) return d.Error();
  return ImageSize{static_cast<int>(d.cinfo.image_height), static_cast<int>(d.cinfo.image_width)};
}

// Decodes the crop (or the whole image) into *out and sets *placed to where
// it lies there: with `exact`, *out is the crop; else it keeps the columns
// libjpeg decodes, so rows need no copy.
absl::Status DecodeJpeg(absl::string_view bytes, int channels, const CropWindow* crop, bool exact,
                        Image* out, CropWindow* placed) {
  JpegDecoder d;
  if (!JpegReadHeader(&d, bytes)) return d.Error();
  if (d.cinfo.jpeg_color_space == JCS_CMYK || d.cinfo.jpeg_color_space == JCS_YCCK) {
    return absl::InvalidArgumentError("JPEG: CMYK images are not supported");
  }
  const int height = d.cinfo.image_height, width = d.cinfo.image_width;
  if (absl::Status s = CheckPixelCount(height, width); !s.ok()) return s;
  const CropWindow w = crop != nullptr ? *crop : CropWindow{0, 0, height, width};
  if (absl::Status s = CheckWindow(w, height, width); !s.ok()) return s;
  JDIMENSION xoffset = 0, decoded_width = 0;
  if (!JpegStartWindow(&d, w, channels, &xoffset, &decoded_width)) return d.Error();
  const int left = w.x - static_cast<int>(xoffset);
  const bool whole_rows =
      !exact || (left == 0 && decoded_width == static_cast<JDIMENSION>(w.width));
  *out = Image{w.height, whole_rows ? static_cast<int>(decoded_width) : w.width, channels,
               std::move(out->pixels)};
  out->pixels.resize(size_t{1} * out->height * out->width * channels);
  *placed = CropWindow{0, whole_rows ? left : 0, w.height, w.width};
  const bool read =
      whole_rows ? JpegReadRows(&d, w.height, out->pixels.data(), size_t{1} * out->width * channels)
                 : JpegReadTrimmed(&d, w, channels, left, decoded_width, out->pixels.data());
  if (!read) return d.Error();
  jpeg_abort_decompress(&d.cinfo);
  return absl::OkStatus();
}

absl::StatusOr<Image> DecodeJpeg(absl::string_view bytes, int channels, const CropWindow* crop) {
  Image image;
  CropWindow placed;
  if (absl::Status s = DecodeJpeg(bytes, channels, crop, /*exact=*/true, &image, &placed);
      !s.ok()) {
    return s;
  }
  return image;
}

// A libjpeg destination that grows a std::string owned by the caller.
struct StringDestination {
  jpeg_destination_mgr pub;
  std::string* out;
};

void StringInit(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<StringDestination*>(cinfo->dest);
  dest->out->resize(16384);
  dest->pub.next_output_byte = reinterpret_cast<JOCTET*>(dest->out->data());
  dest->pub.free_in_buffer = dest->out->size();
}

boolean StringGrow(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<StringDestination*>(cinfo->dest);
  const size_t used = dest->out->size();
  dest->out->resize(2 * used);
  dest->pub.next_output_byte = reinterpret_cast<JOCTET*>(dest->out->data()) + used;
  dest->pub.free_in_buffer = used;
  return TRUE;
}

void StringTerm(j_compress_ptr cinfo) {
  auto* dest = reinterpret_cast<StringDestination*>(cinfo->dest);
  dest->out->resize(dest->out->size() - dest->pub.free_in_buffer);
}

struct JpegEncoder {
  jpeg_compress_struct cinfo{};
  JpegErrorManager err;
  StringDestination dest{};
  bool created = false;

  JpegEncoder() {
    InstallJpegErrors(&err);
    cinfo.err = &err.pub;
  }
  ~JpegEncoder() {
    if (created) jpeg_destroy_compress(&cinfo);
  }
};

bool JpegCompress(JpegEncoder* e, const Image& image, int quality, std::string* out) {
  jpeg_compress_struct* cinfo = &e->cinfo;
  if (setjmp(e->err.jump)) return false;
  e->created = true;
  jpeg_create_compress(cinfo);
  e->dest.pub.init_destination = StringInit;
  e->dest.pub.empty_output_buffer = StringGrow;
  e->dest.pub.term_destination = StringTerm;
  e->dest.out = out;
  cinfo->dest = &e->dest.pub;
  cinfo->image_width = image.width;
  cinfo->image_height = image.height;
  cinfo->input_components = image.channels;
  cinfo->in_color_space = image.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(cinfo);
  jpeg_set_quality(cinfo, quality, TRUE);
  jpeg_start_compress(cinfo, TRUE);
  const size_t stride = size_t{1} * image.width * image.channels;
  while (cinfo->next_scanline < cinfo->image_height) {
    JSAMPROW rows[1] = {const_cast<uint8_t*>(image.pixels.data()) + cinfo->next_scanline * stride};
    jpeg_write_scanlines(cinfo, rows, 1);
  }
  jpeg_finish_compress(cinfo);
  return true;
}

// ---------------------------------------------------------------- PNG

struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  absl::string_view bytes;
  size_t pos = 0;
  char message[160] = "";

  explicit PngReader(absl::string_view in) : bytes(in) {
    png = png_create_read_struct(PNG_LIBPNG_VER_STRING, this, OnError, OnWarning);
    if (png != nullptr) info = png_create_info_struct(png);
  }
  ~PngReader() { png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr); }
  absl::Status Error() const { return absl::InvalidArgumentError(absl::StrCat("PNG: ", message)); }

  static void OnError(png_structp png, png_const_charp msg) {
    auto* r = static_cast<PngReader*>(png_get_error_ptr(png));
    std::snprintf(r->message, sizeof(r->message), "%s", msg);
    png_longjmp(png, 1);
  }
  static void OnWarning(png_structp, png_const_charp) {}  // never print
  static void Read(png_structp png, png_bytep out, size_t n) {
    auto* r = static_cast<PngReader*>(png_get_io_ptr(png));
    if (r->bytes.size() - r->pos < n) png_error(png, "truncated file");
    std::memcpy(out, r->bytes.data() + r->pos, n);
    r->pos += n;
  }
};

// Reads the header and asks libpng for 8-bit gray or RGB without alpha
// (gray stays gray unless `channels` is 3; RGB to gray is left to
// ConvertWindow). Sets *height, *width and *decoded_channels.
bool PngReadHeader(PngReader* r, int channels, int* height, int* width, int* decoded_channels) {
  png_structp png = r->png;
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, r, PngReader::Read);
  png_read_info(png, r->info);
  const int color_type = png_get_color_type(png, r->info);
  png_set_expand(png);  // palette to RGB, gray of 1, 2 or 4 bits to 8, tRNS to alpha
  png_set_scale_16(png);
  png_set_strip_alpha(png);
  if (channels == 3 && (color_type & PNG_COLOR_MASK_COLOR) == 0) png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, r->info);
  *height = png_get_image_height(png, r->info);
  *width = png_get_image_width(png, r->info);
  *decoded_channels = png_get_channels(png, r->info);
  return true;
}

bool PngReadPixels(PngReader* r, png_bytep* rows) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_read_image(r->png, rows);
  png_read_end(r->png, nullptr);
  return true;
}

uint32_t BigEndian32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t{u[0]} << 24) | (uint32_t{u[1]} << 16) | (uint32_t{u[2]} << 8) | u[3];
}

// The IHDR chunk always comes first: signature, length, "IHDR", width, height.
absl::StatusOr<ImageSize> PeekPng(absl::string_view bytes) {
  if (bytes.size() < 24 || bytes.substr(12, 4) != "IHDR") {
    return absl::InvalidArgumentError("PNG: no IHDR chunk");
  }
  const uint32_t width = BigEndian32(bytes.data() + 16), height = BigEndian32(bytes.data() + 20);
  if (width == 0 || height == 0 || width > 0x7fffffff || height > 0x7fffffff) {
    return absl::InvalidArgumentError("PNG: bad image size in IHDR");
  }
  return ImageSize{static_cast<int>(height), static_cast<int>(width)};
}

absl::StatusOr<Image> DecodePng(absl::string_view bytes, int channels, const CropWindow* crop) {
  PngReader r(bytes);
  if (r.png == nullptr || r.info == nullptr) return absl::InternalError("PNG: no reader");
  Image full;
  if (!PngReadHeader(&r, channels, &full.height, &full.width, &full.channels)) return r.Error();
  if (absl::Status s = CheckPixelCount(full.height, full.width); !s.ok()) return s;
  if (full.channels != 1 && full.channels != 3) {
    return absl::InternalError(absl::StrCat("PNG: decoded to ", full.channels, " channels"));
  }
  const CropWindow w = crop != nullptr ? *crop : CropWindow{0, 0, full.height, full.width};
  if (absl::Status s = CheckWindow(w, full.height, full.width); !s.ok()) return s;
  const size_t stride = size_t{1} * full.width * full.channels;
  full.pixels.resize(stride * full.height);
  std::vector<png_bytep> rows(full.height);
  for (int i = 0; i < full.height; ++i) rows[i] = full.pixels.data() + i * stride;
  if (!PngReadPixels(&r, rows.data())) return r.Error();
  if (full.channels == channels && w.height == full.height && w.width == full.width) return full;
  return ConvertWindow(full, w, channels);
}

}  // namespace

ImageFormat SniffImage(absl::string_view bytes) {
  if (bytes.size() >= 3 && static_cast<unsigned char>(bytes[0]) == 0xff &&
      static_cast<unsigned char>(bytes[1]) == 0xd8 &&
      static_cast<unsigned char>(bytes[2]) == 0xff) {
    return ImageFormat::kJpeg;
  }
  if (bytes.size() >= sizeof(kPngMagic) &&
      std::memcmp(bytes.data(), kPngMagic, sizeof(kPngMagic)) == 0) {
    return ImageFormat::kPng;
  }
  return ImageFormat::kUnknown;
}

absl::StatusOr<ImageSize> PeekImageSize(absl::string_view bytes) {
  switch (SniffImage(bytes)) {
    case ImageFormat::kJpeg:
      return PeekJpeg(bytes);
    case ImageFormat::kPng:
      return PeekPng(bytes);
    case ImageFormat::kUnknown:
      break;
  }
  return absl::InvalidArgumentError("not a JPEG or PNG image");
}

absl::StatusOr<Image> DecodeImage(absl::string_view bytes, int channels, const CropWindow* crop) {
  if (channels != 1 && channels != 3) {
    return absl::InvalidArgumentError(absl::StrCat("cannot decode to ", channels, " channels"));
  }
  switch (SniffImage(bytes)) {
    case ImageFormat::kJpeg:
      return DecodeJpeg(bytes, channels, crop);
    case ImageFormat::kPng:
      return DecodePng(bytes, channels, crop);
    case ImageFormat::kUnknown:
      break;
  }
  return absl::InvalidArgumentError("not a JPEG or PNG image");
}

absl::Status DecodeImageInto(absl::string_view bytes, int channels, const CropWindow* crop,
                             Image* out, CropWindow* window) {
  if (channels != 1 && channels != 3) {
    return absl::InvalidArgumentError(absl::StrCat("cannot decode to ", channels, " channels"));
  }
  switch (SniffImage(bytes)) {
    case ImageFormat::kJpeg:
      return DecodeJpeg(bytes, channels, crop, /*exact=*/false, out, window);
    case ImageFormat::kPng: {
      absl::StatusOr<Image> image = DecodePng(bytes, channels, crop);
      if (!image.ok()) return image.status();
      *out = *std::move(image);
      *window = CropWindow{0, 0, out->height, out->width};
      return absl::OkStatus();
    }
    case ImageFormat::kUnknown:
      break;
  }
  return absl::InvalidArgumentError("not a JPEG or PNG image");
}

namespace {

absl::Status CheckEncodable(const Image& image) {
  if (image.height <= 0 || image.width <= 0 || image.height > 65500 || image.width > 65500 ||
      image.pixels.size() != size_t{1} * image.height * image.width * image.channels) {
    return absl::InvalidArgumentError(absl::StrCat("cannot encode a ", image.height, "x",
                                                   image.width, "x", image.channels, " image of ",
                                                   image.pixels.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> EncodePng(const Image& image) {
  if (absl::Status s = CheckEncodable(image); !s.ok()) return s;
  png_image png{};
  png.version = PNG_IMAGE_VERSION;
  png.width = image.width;
  png.height = image.height;
  switch (image.channels) {
    case 1:
      png.format = PNG_FORMAT_GRAY;
      break;
    case 3:
      png.format = PNG_FORMAT_RGB;
      break;
    case 4:
      png.format = PNG_FORMAT_RGBA;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("PNG of ", image.channels, " channels"));
  }
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&png, nullptr, &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("PNG: ", png.message));
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("PNG: ", png.message));
  }
  out.resize(size);
  return out;
}

absl::StatusOr<std::string> EncodeJpeg(const Image& image, int quality) {
  if (absl::Status s = CheckEncodable(image); !s.ok()) return s;
  if (image.channels != 1 && image.channels != 3) {
    return absl::InvalidArgumentError(absl::StrCat("JPEG of ", image.channels, " channels"));
  }
  if (quality < 1 || quality > 100) {
    return absl::InvalidArgumentError(absl::StrCat("JPEG quality ", quality, " not in [1, 100]"));
  }
  std::string out;
  JpegEncoder e;
  if (!JpegCompress(&e, image, quality, &out)) {
    return absl::InternalError(absl::StrCat("JPEG: ", e.err.message));
  }
  return out;
}

}  // namespace psflow::data
