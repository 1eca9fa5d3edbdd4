#include "tools/data/sources.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "data/formats.h"

namespace psflow::data_tool {
namespace {

namespace fs = std::filesystem;
using data::Example;

constexpr char kEncoded[] = "image/encoded";
constexpr char kLabel[] = "image/class/label";

absl::Status Prefixed(const std::string& path, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
}

absl::string_view FormatName(data::ImageFormat format) {
  return format == data::ImageFormat::kJpeg ? "JPEG" : "PNG";
}

// The keys every image record has.
void AddImage(absl::string_view bytes, data::ImageFormat format, int height, int width,
              int channels, int64_t label, Example* example) {
  data::AddBytes(example, kEncoded, bytes);
  data::AddBytes(example, "image/format", FormatName(format));
  data::AddInt64(example, kLabel, label);
  data::AddInt64(example, "image/height", height);
  data::AddInt64(example, "image/width", width);
  data::AddInt64(example, "image/channels", channels);
}

// --- idx ---

class IdxSource : public ExampleSource {
 public:
  IdxSource(data::IdxFile images, data::IdxFile labels, data::ImageFormat format, int quality)
      : images_(std::move(images)),
        labels_(std::move(labels)),
        format_(format),
        quality_(quality) {}

  int64_t size() const override { return images_.dims[0]; }
  absl::StatusOr<std::unique_ptr<ExampleCursor>> NewCursor() const override;

  // Record `index` encoded; thread-safe.
  absl::Status Read(int64_t index, Example* example) const {
    data::Image image;
    image.height = static_cast<int>(images_.dims[1]);
    image.width = static_cast<int>(images_.dims[2]);
    image.channels = 1;
    const int64_t pixels = int64_t{image.height} * image.width;
    const auto first = images_.data.begin() + index * pixels;
    image.pixels.assign(first, first + pixels);
    absl::StatusOr<std::string> bytes = format_ == data::ImageFormat::kJpeg
                                            ? data::EncodeJpeg(image, quality_)
                                            : data::EncodePng(image);
    if (!bytes.ok()) return bytes.status();
    example->Clear();
    AddImage(*bytes, format_, image.height, image.width, 1, labels_.data[index], example);
    return absl::OkStatus();
  }

 private:
  const data::IdxFile images_, labels_;
  const data::ImageFormat format_;
  const int quality_;
};

class IdxCursor : public ExampleCursor {
 public:
  explicit IdxCursor(const IdxSource* source) : source_(source) {}
  absl::Status Read(int64_t index, Example* example) override {
    return source_->Read(index, example);
  }

 private:
  const IdxSource* const source_;
};

absl::StatusOr<std::unique_ptr<ExampleCursor>> IdxSource::NewCursor() const {
  return std::unique_ptr<ExampleCursor>(new IdxCursor(this));
}

// --- image_folder ---

struct FolderImage {
  std::string path;
  int64_t label = 0;
};

class ImageFolderSource : public ExampleSource {
 public:
  ImageFolderSource(std::vector<std::string> classes, std::vector<FolderImage> images)
      : classes_(std::move(classes)), images_(std::move(images)) {}

  int64_t size() const override { return static_cast<int64_t>(images_.size()); }
  absl::StatusOr<std::unique_ptr<ExampleCursor>> NewCursor() const override;

  // Thread-safe.
  absl::Status Read(int64_t index, Example* example) const {
    const FolderImage& image = images_[index];
    PSFLOW_ASSIGN_OR_RETURN(const std::string bytes, ReadFile(image.path));
    const data::ImageFormat format = data::SniffImage(bytes);
    if (format == data::ImageFormat::kUnknown) {
      return absl::InvalidArgumentError(absl::StrCat(image.path, ": not a JPEG or PNG image"));
    }
    absl::StatusOr<data::ImageSize> size = data::PeekImageSize(bytes);
    if (!size.ok()) return Prefixed(image.path, size.status());
    absl::StatusOr<int> channels = StoredChannels(bytes);
    if (!channels.ok()) return Prefixed(image.path, channels.status());
    example->Clear();
    AddImage(bytes, format, size->height, size->width, *channels, image.label, example);
    data::AddBytes(example, "image/class/text", classes_[image.label]);
    data::AddBytes(example, "image/filename", fs::path(image.path).filename().string());
    return absl::OkStatus();
  }

 private:
  const std::vector<std::string> classes_;
  const std::vector<FolderImage> images_;
};

class ImageFolderCursor : public ExampleCursor {
 public:
  explicit ImageFolderCursor(const ImageFolderSource* source) : source_(source) {}
  absl::Status Read(int64_t index, Example* example) override {
    return source_->Read(index, example);
  }

 private:
  const ImageFolderSource* const source_;
};

absl::StatusOr<std::unique_ptr<ExampleCursor>> ImageFolderSource::NewCursor() const {
  return std::unique_ptr<ExampleCursor>(new ImageFolderCursor(this));
}

// --- csv ---

class CsvSource : public ExampleSource {
 public:
  CsvSource(std::string path, data::CsvFormat format, int64_t rows)
      : path_(std::move(path)), format_(std::move(format)), rows_(rows) {}
  int64_t size() const override { return rows_; }
  absl::StatusOr<std::unique_ptr<ExampleCursor>> NewCursor() const override;

 private:
  const std::string path_;
  const data::CsvFormat format_;
  const int64_t rows_;
};

class CsvCursor : public ExampleCursor {
 public:
  CsvCursor(const std::string& path, std::unique_ptr<data::CsvReader> reader)
      : path_(path), reader_(std::move(reader)) {}

  absl::Status Read(int64_t index, Example* example) override {
    for (; next_ < index; ++next_) {
      PSFLOW_ASSIGN_OR_RETURN(const bool more, reader_->NextRow(&skipped_));
      if (!more) return Ended();
    }
    PSFLOW_ASSIGN_OR_RETURN(const bool more, reader_->Next(&row_));
    if (!more) return Ended();
    ++next_;
    example->Clear();
    size_t numeric = 0, categorical = 0, text = 0;
    for (const data::CsvColumn& c : reader_->format().columns) {
      switch (c.type) {
        case data::ColumnType::kLabel:
          data::AddInt64(example, "label", row_.label);
          break;
        case data::ColumnType::kNumeric:
          data::AddFloats(example, c.name, {row_.numeric[numeric++]});
          break;
        case data::ColumnType::kCategorical:
        case data::ColumnType::kCategoricalHex:
          data::AddInt64(example, c.name, static_cast<int64_t>(row_.categorical[categorical++]));
          break;
        case data::ColumnType::kText:
          data::AddBytes(example, c.name, row_.text[text++]);
          break;
        case data::ColumnType::kIgnore:
          break;
      }
    }
    return absl::OkStatus();
  }

 private:
  // The file shrank since its rows were counted.
  absl::Status Ended() const {
    return absl::DataLossError(absl::StrCat(path_, ": the file ended before data row ", next_ + 1,
                                            " (it changed while being converted)"));
  }

  const std::string& path_;
  std::unique_ptr<data::CsvReader> reader_;
  int64_t next_ = 0;  // the index of the next row the reader returns
  std::vector<std::string> skipped_;
  data::CsvRow row_;
};

absl::StatusOr<std::unique_ptr<ExampleCursor>> CsvSource::NewCursor() const {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<data::CsvReader> reader,
                          data::CsvReader::Open(path_, format_));
  return std::unique_ptr<ExampleCursor>(new CsvCursor(path_, std::move(reader)));
}

uint32_t BigEndian16(absl::string_view b, size_t i) {
  return (static_cast<uint32_t>(static_cast<uint8_t>(b[i])) << 8) | static_cast<uint8_t>(b[i + 1]);
}

// The component count of a JPEG's frame header (SOFn).
absl::StatusOr<int> JpegChannels(absl::string_view b) {
  size_t i = 2;  // after SOI
  while (i + 4 <= b.size()) {
    if (static_cast<uint8_t>(b[i]) != 0xFF) break;
    const uint8_t marker = static_cast<uint8_t>(b[i + 1]);
    if (marker == 0xFF) {  // fill byte
      ++i;
      continue;
    }
    const bool sof =
        marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (sof) {
      if (i + 10 > b.size()) break;
      return static_cast<int>(static_cast<uint8_t>(b[i + 9]));
    }
    const bool standalone = marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8);
    i += standalone ? 2 : 2 + BigEndian16(b, i + 2);
  }
  return absl::InvalidArgumentError("JPEG without a readable frame header");
}

}  // namespace

absl::StatusOr<int> StoredChannels(absl::string_view bytes) {
  switch (data::SniffImage(bytes)) {
    case data::ImageFormat::kJpeg:
      return JpegChannels(bytes);
    case data::ImageFormat::kPng: {
      // The IHDR chunk comes first: its color type is byte 25 of the file.
      if (bytes.size() < 26) return absl::InvalidArgumentError("PNG without its IHDR chunk");
      switch (static_cast<uint8_t>(bytes[25])) {
        case 0:
          return 1;
        case 4:
          return 2;
        case 2:
        case 3:  // palette entries are RGB
          return 3;
        case 6:
          return 4;
        default:
          return absl::InvalidArgumentError("PNG of an unknown color type");
      }
    }
    case data::ImageFormat::kUnknown:
      break;
  }
  return absl::InvalidArgumentError("not a JPEG or PNG image");
}

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenIdxSource(const std::string& dir,
                                                             data::Split split,
                                                             data::ImageFormat format,
                                                             int jpeg_quality) {
  const std::string prefix = split == data::Split::kTrain ? "train" : "t10k";
  const std::string images_name = prefix + "-images-idx3-ubyte";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  PSFLOW_ASSIGN_OR_RETURN(data::IdxFile images, data::ReadIdxFileInDir(dir, images_name));
  PSFLOW_ASSIGN_OR_RETURN(data::IdxFile labels, data::ReadIdxFileInDir(dir, labels_name));
  const std::string images_path = (fs::path(dir) / images_name).string();
  if (images.dims.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, " holds ", images.dims.size(), "-d data, not images (3-d)"));
  }
  if (labels.dims.size() != 1 || labels.dims[0] != images.dims[0]) {
    return absl::InvalidArgumentError(absl::StrCat((fs::path(dir) / labels_name).string(),
                                                   " does not hold one label for each of the ",
                                                   images.dims[0], " images of ", images_path));
  }
  return std::unique_ptr<ExampleSource>(
      new IdxSource(std::move(images), std::move(labels), format, jpeg_quality));
}

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenImageFolderSource(const std::string& root) {
  PSFLOW_ASSIGN_OR_RETURN(data::ImageFolder folder, data::ListImageFolder(root));
  std::vector<FolderImage> images;
  images.reserve(folder.paths.size());
  for (size_t i = 0; i < folder.paths.size(); ++i) {
    images.push_back({std::move(folder.paths[i]), folder.labels[i]});
  }
  return std::unique_ptr<ExampleSource>(
      new ImageFolderSource(std::move(folder.classes), std::move(images)));
}

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenCsvSource(const std::string& path,
                                                             const data::CsvFormat& format) {
  PSFLOW_ASSIGN_OR_RETURN(const int64_t rows, data::CountRows(path, format));
  return std::unique_ptr<ExampleSource>(new CsvSource(path, format, rows));
}

}  // namespace psflow::data_tool
