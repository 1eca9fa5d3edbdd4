#include "data/formats.h"

#include <glob.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "data/csv/csv.h"
#include "data/image/image.h"
#include "data/image/transforms.h"
#include "data/pipeline.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"

namespace psflow::data {
namespace {

namespace fs = std::filesystem;

constexpr absl::string_view kTfRecord = "tfrecord", kImageFolder = "image_folder", kCsv = "csv";

// ---- Files -------------------------------------------------------------

// The paths `patterns` (comma-separated paths or glob patterns) name,
// sorted, each pattern matching something.
absl::StatusOr<std::vector<std::string>> Expand(absl::string_view patterns,
                                                absl::string_view flag) {
  std::vector<std::string> paths;
  for (absl::string_view p : absl::StrSplit(patterns, ',', absl::SkipWhitespace())) {
    const std::string pattern(absl::StripAsciiWhitespace(p));
    glob_t g;
    const int rc = glob(pattern.c_str(), 0, nullptr, &g);
    if (rc == 0) {
      for (size_t i = 0; i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
    if (rc != 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", pattern, "' matches no file"));
    }
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  if (paths.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, " names no file"));
  return paths;
}

bool IsImageName(const fs::path& p) {
  const std::string ext = absl::AsciiStrToLower(p.extension().string());
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

bool IsDir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

// The first of `names` that exists in `dir`, or "".
std::string FirstIn(const std::string& dir, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    glob_t g;
    const std::string pattern = (fs::path(dir) / name).string();
    const bool found = glob(pattern.c_str(), 0, nullptr, &g) == 0;
    globfree(&g);
    if (found) return pattern;
  }
  return "";
}

// The format of `path` from its name or content.
absl::StatusOr<std::string> RecognizeFile(const std::string& path) {
  if (IsDir(path)) return std::string(kImageFolder);
  const std::string lower = absl::AsciiStrToLower(path);
  if (absl::EndsWith(lower, ".csv") || absl::EndsWith(lower, ".tsv") ||
      absl::EndsWith(lower, ".csv.txt")) {
    return std::string(kCsv);
  }
  RecordReaderOptions o;
  absl::StatusOr<std::unique_ptr<RecordReader>> reader = RecordReader::Open(path, o);
  if (reader.ok()) {
    std::string record;
    if ((*reader)->Next(&record).ok()) return std::string(kTfRecord);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cannot tell the format of ", path,
                   " (not a TFRecord file, a folder or a .csv/.tsv file): give --data_format"));
}

// The default training files of a format in `dir`, or "" when it has none.
std::string DefaultTrain(absl::string_view format, const std::string& dir) {
  if (format == kTfRecord) return FirstIn(dir, {"train-*", "train.tfrecord*"});
  if (format == kImageFolder) return FirstIn(dir, {"train"});
  if (format == kCsv) return FirstIn(dir, {"train.csv", "train.tsv"});
  return "";
}
std::string DefaultEval(absl::string_view format, const std::string& dir) {
  if (format == kTfRecord) {
    return FirstIn(dir, {"validation-*", "test-*", "validation.tfrecord*", "test.tfrecord*"});
  }
  if (format == kImageFolder) return FirstIn(dir, {"val", "validation", "test"});
  if (format == kCsv) return FirstIn(dir, {"test.csv", "test.tsv", "eval.csv", "eval.tsv"});
  return "";
}

// The format of a job given no --data_format: from the training files, or
// from what data_dir holds.
absl::StatusOr<std::string> Recognize(const DataFiles& files, const std::string& data_dir) {
  if (!files.train.empty()) {
    PSFLOW_ASSIGN_OR_RETURN(std::vector<std::string> paths, Expand(files.train, "--train_files"));
    return RecognizeFile(paths[0]);
  }
  if (!files.eval.empty()) {
    PSFLOW_ASSIGN_OR_RETURN(std::vector<std::string> paths, Expand(files.eval, "--eval_files"));
    return RecognizeFile(paths[0]);
  }
  if (!FirstIn(data_dir, {"train-images-idx3-ubyte*", "t10k-images-idx3-ubyte*"}).empty()) {
    return std::string("idx");
  }
  for (absl::string_view f : {kImageFolder, kTfRecord, kCsv}) {
    if (!DefaultTrain(f, data_dir).empty() || !DefaultEval(f, data_dir).empty()) {
      return std::string(f);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--data_dir ", data_dir,
      " holds no data set psflow recognizes (IDX files, train-* TFRecords, a train/ image folder, "
      "train.csv): give --data_format and --train_files"));
}

absl::StatusOr<CsvFormat> CsvFormatOf(const DataConfig& config) {
  return CsvFormatFromFlags(config.csv_preset(), config.csv_columns(),
                            config.csv_delimiter().empty() ? "," : config.csv_delimiter(),
                            config.csv_header());
}

// Counts the records of each file.
absl::StatusOr<std::vector<int64_t>> Count(const DataConfig& config,
                                           const std::vector<std::string>& paths) {
  std::vector<int64_t> counts;
  CsvFormat csv;
  if (config.format() == kCsv) {
    PSFLOW_ASSIGN_OR_RETURN(csv, CsvFormatOf(config));
  }
  for (const std::string& path : paths) {
    RecordReaderOptions o;
    o.skip_bad_records = config.skip_bad_records();
    absl::StatusOr<int64_t> n =
        config.format() == kCsv ? CountRows(path, csv) : CountRecords(path, o);
    if (!n.ok()) return n.status();
    counts.push_back(*n);
  }
  return counts;
}

// ---- Streams and decoders ----------------------------------------------

class TfRecordStream : public RecordStream {
 public:
  explicit TfRecordStream(std::unique_ptr<RecordReader> reader) : reader_(std::move(reader)) {}
  absl::StatusOr<bool> Next(Record* r) override { return reader_->Next(&r->bytes); }
  absl::StatusOr<bool> Skip() override { return reader_->Skip(); }
  int64_t bad_records() const override { return reader_->bad_records(); }

 private:
  std::unique_ptr<RecordReader> reader_;
};

// An image file: one record, its bytes, labelled by its folder.
class ImageFileStream : public RecordStream {
 public:
  ImageFileStream(std::string path, int32_t label) : path_(std::move(path)), label_(label) {}
  absl::StatusOr<bool> Next(Record* r) override {
    if (done_) return false;
    done_ = true;
    PSFLOW_ASSIGN_OR_RETURN(r->bytes, ReadFile(path_));
    r->label = label_;
    return true;
  }
  absl::StatusOr<bool> Skip() override {
    const bool was = done_;
    done_ = true;
    return !was;
  }

 private:
  const std::string path_;
  const int32_t label_;
  bool done_ = false;
};

// CSV rows, typed on the reader thread: a record carries the numeric
// columns' floats, then the categorical and hex columns' ids (uint64, in
// column order), and the label.
class CsvStream : public RecordStream {
 public:
  explicit CsvStream(std::unique_ptr<CsvReader> reader) : reader_(std::move(reader)) {}
  absl::StatusOr<bool> Next(Record* r) override {
    PSFLOW_ASSIGN_OR_RETURN(const bool got, reader_->Next(&row_));
    if (!got) return false;
    const size_t floats = row_.numeric.size() * sizeof(float);
    const size_t ids = row_.categorical.size() * sizeof(uint64_t);
    r->bytes.resize(floats + ids);
    if (floats > 0) std::memcpy(r->bytes.data(), row_.numeric.data(), floats);
    if (ids > 0) std::memcpy(r->bytes.data() + floats, row_.categorical.data(), ids);
    r->label = row_.label;
    return true;
  }
  absl::StatusOr<bool> Skip() override { return reader_->NextRow(&fields_); }

 private:
  std::unique_ptr<CsvReader> reader_;
  CsvRow row_;
  std::vector<std::string> fields_;
};

absl::Status CheckLabel(int64_t label, const ExampleShape& shape, absl::string_view hint) {
  if (label >= 0 && label < shape.num_classes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("label ", label, " is outside [0, ", shape.num_classes, ")", hint));
}

class ImageDecoder : public Decoder {
 public:
  // `keys`: the tf.Example keys (TFRecord), or null (image files).
  ImageDecoder(const ExampleShape& shape, const DataConfig& config, bool example)
      : shape_(shape), config_(config), example_(example) {}

  absl::Status Decode(const Record& record, uint64_t seed, bool train, float* input, uint64_t*,
                      int32_t* label) const override {
    absl::string_view bytes = record.bytes;
    int64_t id = record.label;
    Example example;
    if (example_) {
      PSFLOW_ASSIGN_OR_RETURN(example, ParseExample(record.bytes));
      PSFLOW_ASSIGN_OR_RETURN(bytes, OneBytes(example, config_.image_key()));
      PSFLOW_ASSIGN_OR_RETURN(id, OneInt64(example, config_.label_key()));
      id -= config_.label_offset();
    }
    PSFLOW_RETURN_IF_ERROR(
        CheckLabel(id, shape_,
                   example_ && config_.label_offset() == 0
                       ? " (a set whose 0 is 'background' needs --label_offset=1)"
                       : ""));
    PSFLOW_ASSIGN_OR_RETURN(const ImageSize size, PeekImageSize(bytes));
    const bool augment = train && config_.augment();
    const int shorter = config_.resize_shorter() > 0 ? config_.resize_shorter()
                                                     : std::min(shape_.height, shape_.width);
    const CropWindow window = augment ? RandomResizedCrop(size, seed)
                                      : CenterCrop(size, shorter, shape_.height, shape_.width);
    // Each decoding thread reuses one buffer (no allocation, no fresh pages
    // per image), but does not keep a huge image's.
    thread_local Image image;
    if (image.pixels.capacity() > (size_t{64} << 20)) image.pixels = {};
    CropWindow placed;
    PSFLOW_RETURN_IF_ERROR(DecodeImageInto(bytes, shape_.channels, &window, &image, &placed));
    const bool flip = augment && (MixSeed(seed, 3) & 1) != 0;
    PSFLOW_RETURN_IF_ERROR(ResizeInto(image, placed, shape_.height, shape_.width, flip, input));
    *label = static_cast<int32_t>(id);
    return absl::OkStatus();
  }

 private:
  const ExampleShape shape_;
  const DataConfig config_;
  const bool example_;
};

class CsvDecoder : public Decoder {
 public:
  CsvDecoder(const ExampleShape& shape, int64_t ids)
      : shape_(shape), floats_(int64_t{shape.channels} * shape.height * shape.width), ids_(ids) {}
  absl::Status Decode(const Record& record, uint64_t, bool, float* input, uint64_t* ids,
                      int32_t* label) const override {
    PSFLOW_RETURN_IF_ERROR(CheckLabel(record.label, shape_, ""));
    const size_t floats = floats_ * sizeof(float), id_bytes = ids_ * sizeof(uint64_t);
    // Every file's header must give the columns the first file gave.
    if (record.bytes.size() != floats + id_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the record has other columns than the first file (", floats_,
                       " numeric and ", ids_, " categorical)"));
    }
    std::memcpy(input, record.bytes.data(), floats);
    if (ids_ > 0) std::memcpy(ids, record.bytes.data() + floats, id_bytes);
    *label = static_cast<int32_t>(record.label);
    return absl::OkStatus();
  }

 private:
  const ExampleShape shape_;
  const int64_t floats_;
  const int64_t ids_;
};

std::vector<IdFeature> CsvIdFeatures(const std::vector<CsvColumn>& columns);
std::string DescribeColumns(const std::vector<CsvColumn>& columns);

// The files of a format, their counts and how to read them.
class FileFormat : public DataFormat {
 public:
  // `csv`: the layout of CSV files (parsed once, for every file opened);
  // `columns`: the first file's, as its header resolves them.
  FileFormat(const DataConfig& config, const ExampleShape& shape, std::vector<std::string> paths,
             std::vector<int64_t> records, std::vector<int32_t> labels, CsvFormat csv,
             std::vector<CsvColumn> columns)
      : config_(config),
        shape_(shape),
        paths_(std::move(paths)),
        records_(std::move(records)),
        labels_(std::move(labels)),
        columns_(std::move(columns)),
        id_features_(CsvIdFeatures(columns_)),
        image_decoder_(shape, config, config.format() == kTfRecord),
        csv_decoder_(shape, IdsPerExample(id_features_)),
        csv_(std::move(csv)) {}

  int64_t num_files() const override { return static_cast<int64_t>(paths_.size()); }
  int64_t records(int64_t file) const override { return labels_.empty() ? records_[file] : 1; }
  std::string file_name(int64_t file) const override { return paths_[file]; }
  int64_t example_floats() const override {
    return int64_t{shape_.channels} * shape_.height * shape_.width;
  }
  const Decoder& decoder() const override {
    if (config_.format() == kCsv) return csv_decoder_;
    return image_decoder_;
  }
  const std::vector<IdFeature>& id_features() const override { return id_features_; }
  absl::StatusOr<std::unique_ptr<RecordStream>> Open(int64_t file) const override {
    const std::string& path = paths_[file];
    if (config_.format() == kImageFolder) {
      return std::unique_ptr<RecordStream>(new ImageFileStream(path, labels_[file]));
    }
    if (config_.format() == kCsv) {
      PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<CsvReader> reader, CsvReader::Open(path, csv_));
      // Every file's header must give the first file's columns in its order:
      // a column read under another's name would feed the wrong input.
      if (reader->format().columns != columns_) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, " has the columns ", DescribeColumns(reader->format().columns), ", but ",
            paths_[0], " has ", DescribeColumns(columns_), ": every file needs the same"));
      }
      return std::unique_ptr<RecordStream>(new CsvStream(std::move(reader)));
    }
    RecordReaderOptions o;
    o.skip_bad_records = config_.skip_bad_records();
    PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<RecordReader> reader, RecordReader::Open(path, o));
    return std::unique_ptr<RecordStream>(new TfRecordStream(std::move(reader)));
  }

 private:
  const DataConfig config_;
  const ExampleShape shape_;
  const std::vector<std::string> paths_;
  const std::vector<int64_t> records_;
  const std::vector<int32_t> labels_;     // image folders: each file's class
  const std::vector<CsvColumn> columns_;  // CSV: the first file's
  const std::vector<IdFeature> id_features_;
  const ImageDecoder image_decoder_;
  const CsvDecoder csv_decoder_;
  const CsvFormat csv_;
};

// A CSV's numeric columns must make the model's input. Returns the first
// file's columns as its header resolves them, which every file must have.
absl::StatusOr<std::vector<CsvColumn>> CheckCsvColumns(const CsvFormat& format,
                                                       const std::string& first_file,
                                                       const ExampleShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<CsvReader> reader, CsvReader::Open(first_file, format));
  int64_t numeric = 0;
  for (const CsvColumn& c : reader->format().columns) numeric += c.type == ColumnType::kNumeric;
  const int64_t want = int64_t{shape.channels} * shape.height * shape.width;
  if (numeric != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(first_file, " has ", numeric, " numeric columns, but the model takes ", want,
                     " inputs (", shape.channels, "x", shape.height, "x", shape.width, ")"));
  }
  return reader->format().columns;
}

// The categorical and hex columns of resolved CSV columns, one id each.
std::vector<IdFeature> CsvIdFeatures(const std::vector<CsvColumn>& columns) {
  std::vector<IdFeature> ids;
  for (const CsvColumn& c : columns) {
    if (c.type == ColumnType::kCategorical || c.type == ColumnType::kCategoricalHex) {
      ids.push_back({.name = c.name, .width = 1});
    }
  }
  return ids;
}

// "label:label,price:numeric,...": columns for messages.
std::string DescribeColumns(const std::vector<CsvColumn>& columns) {
  return absl::StrJoin(columns, ",", [](std::string* out, const CsvColumn& c) {
    absl::StrAppend(out, c.name, ":", ColumnTypeName(c.type));
  });
}

absl::Status CheckClasses(const std::vector<std::string>& classes, const DataConfig& config,
                          const ExampleShape& shape, const std::string& root) {
  if (static_cast<int>(classes.size()) != shape.num_classes) {
    return absl::InvalidArgumentError(absl::StrCat(root, " holds ", classes.size(),
                                                   " class folders, but the model has ",
                                                   shape.num_classes, " classes"));
  }
  if (config.classes_size() > 0 && !std::equal(classes.begin(), classes.end(),
                                               config.classes().begin(), config.classes().end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the class folders of ", root, " are not those the chief found in ", config.data_dir()));
  }
  return absl::OkStatus();
}

class StridedFormat : public DataFormat {
 public:
  StridedFormat(const DataFormat& inner, int64_t stride) : inner_(inner), stride_(stride) {}
  int64_t num_files() const override { return (inner_.num_files() + stride_ - 1) / stride_; }
  int64_t records(int64_t file) const override { return inner_.records(file * stride_); }
  std::string file_name(int64_t file) const override { return inner_.file_name(file * stride_); }
  absl::StatusOr<std::unique_ptr<RecordStream>> Open(int64_t file) const override {
    return inner_.Open(file * stride_);
  }
  const Decoder& decoder() const override { return inner_.decoder(); }
  int64_t example_floats() const override { return inner_.example_floats(); }
  const std::vector<IdFeature>& id_features() const override { return inner_.id_features(); }

 private:
  const DataFormat& inner_;
  const int64_t stride_;
};

}  // namespace

absl::StatusOr<ImageFolder> ListImageFolder(const std::string& root) {
  if (!IsDir(root)) return absl::NotFoundError(absl::StrCat(root, " is not a folder"));
  ImageFolder listing;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    if (e.is_directory()) listing.classes.push_back(e.path().filename().string());
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat("cannot list ", root, ": ", ec.message()));
  std::sort(listing.classes.begin(), listing.classes.end());
  for (size_t c = 0; c < listing.classes.size(); ++c) {
    std::vector<std::string> files;
    for (const fs::directory_entry& e :
         fs::directory_iterator(fs::path(root) / listing.classes[c], ec)) {
      if (e.is_regular_file() && IsImageName(e.path())) files.push_back(e.path().string());
    }
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot list ", root, "/", listing.classes[c], ": ", ec.message()));
    }
    std::sort(files.begin(), files.end());
    for (std::string& f : files) {
      listing.paths.push_back(std::move(f));
      listing.labels.push_back(static_cast<int32_t>(c));
    }
  }
  if (listing.paths.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        root, " holds no .jpg, .jpeg or .png image in a class folder (<root>/<class>/<image>)"));
  }
  return listing;
}

std::unique_ptr<DataFormat> EveryNthFile(const DataFormat& format, int64_t stride) {
  return std::make_unique<StridedFormat>(format, std::max<int64_t>(stride, 1));
}

DataConfig DefaultDataConfig() {
  DataConfig c;
  c.set_image_key("image/encoded");
  c.set_label_key("image/class/label");
  c.set_csv_delimiter(",");
  c.set_csv_header(true);
  c.set_shuffle_buffer(10000);
  c.set_prefetch_batches(2);
  return c;
}

bool IsStreamed(absl::string_view format) {
  return format == kTfRecord || format == kImageFolder || format == kCsv;
}

absl::Status ResolveDataFiles(const DataFiles& files, DataConfig* config) {
  if (config->format().empty()) {
    PSFLOW_ASSIGN_OR_RETURN(*config->mutable_format(), Recognize(files, config->data_dir()));
  }
  const std::string& format = config->format();
  if (!IsStreamed(format)) {
    if (!files.train.empty() || !files.eval.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--train_files and --eval_files are for tfrecord, image_folder and csv "
                       "data, not ",
                       format));
    }
    return absl::OkStatus();
  }
  std::string train = files.train.empty() ? DefaultTrain(format, config->data_dir()) : files.train;
  if (train.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--data_dir ", config->data_dir(), " holds no ",
                                                   format, " training data: give --train_files"));
  }
  std::string eval = files.eval.empty() ? DefaultEval(format, config->data_dir()) : files.eval;
  config->clear_eval();
  if (!eval.empty()) config->add_eval(eval);
  config->clear_train();
  config->clear_classes();
  if (format == kImageFolder) {
    PSFLOW_ASSIGN_OR_RETURN(std::vector<std::string> roots, Expand(train, "--train_files"));
    if (roots.size() != 1) {
      return absl::InvalidArgumentError("--train_files: an image folder is one folder");
    }
    PSFLOW_ASSIGN_OR_RETURN(ImageFolder listing, ListImageFolder(roots[0]));
    config->set_data_dir(roots[0]);
    for (std::string& c : listing.classes) config->add_classes(std::move(c));
    DataFile* f = config->add_train();
    f->set_path(roots[0]);
    f->set_records(static_cast<int64_t>(listing.paths.size()));
    return absl::OkStatus();
  }
  PSFLOW_ASSIGN_OR_RETURN(std::vector<std::string> paths, Expand(train, "--train_files"));
  PSFLOW_ASSIGN_OR_RETURN(std::vector<int64_t> counts, Count(*config, paths));
  for (size_t i = 0; i < paths.size(); ++i) {
    DataFile* f = config->add_train();
    f->set_path(paths[i]);
    f->set_records(counts[i]);
  }
  return absl::OkStatus();
}

absl::Status ResolveEvalFiles(const std::string& eval_files, DataConfig* config) {
  if (config->format().empty()) {
    PSFLOW_ASSIGN_OR_RETURN(*config->mutable_format(),
                            Recognize({"", eval_files}, config->data_dir()));
  }
  if (!IsStreamed(config->format())) {
    if (!eval_files.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--eval_files is for tfrecord, image_folder and csv data, not ", config->format()));
    }
    return absl::OkStatus();
  }
  const std::string eval =
      eval_files.empty() ? DefaultEval(config->format(), config->data_dir()) : eval_files;
  if (eval.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--data_dir ", config->data_dir(), " holds no ",
                                                   config->format(),
                                                   " evaluation data: give --eval_files"));
  }
  config->clear_eval();
  config->add_eval(eval);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DataFormat>> OpenDataFormat(const DataConfig& config,
                                                           const ExampleShape& shape, Split split) {
  if (!IsStreamed(config.format())) {
    return absl::InvalidArgumentError(absl::StrCat(config.format(), " data is not streamed"));
  }
  std::vector<std::string> paths;
  std::vector<int64_t> records;
  std::vector<int32_t> labels;
  if (split == Split::kTest && config.eval().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the job names no evaluation data: give --eval_files"));
  }
  const std::string root = split == Split::kTest
                               ? config.eval(0)
                               : (config.train().empty() ? "" : config.train(0).path());
  if (config.format() == kImageFolder) {
    PSFLOW_ASSIGN_OR_RETURN(std::vector<std::string> roots, Expand(root, "the image folder"));
    PSFLOW_ASSIGN_OR_RETURN(ImageFolder listing, ListImageFolder(roots[0]));
    PSFLOW_RETURN_IF_ERROR(CheckClasses(listing.classes, config, shape, roots[0]));
    if (split == Split::kTrain &&
        static_cast<int64_t>(listing.paths.size()) != config.train(0).records()) {
      return absl::FailedPreconditionError(absl::StrCat(
          roots[0], " holds ", listing.paths.size(), " images here, the chief counted ",
          config.train(0).records(), ": every process needs the same data"));
    }
    paths = std::move(listing.paths);
    labels = std::move(listing.labels);
  } else if (split == Split::kTest) {
    PSFLOW_ASSIGN_OR_RETURN(paths, Expand(absl::StrJoin(config.eval(), ","), "--eval_files"));
    PSFLOW_ASSIGN_OR_RETURN(records, Count(config, paths));
  } else {
    for (const DataFile& f : config.train()) {
      paths.push_back(f.path());
      records.push_back(f.records());
    }
    if (paths.empty()) return absl::InvalidArgumentError("the job lists no training files");
  }
  CsvFormat csv;
  std::vector<CsvColumn> columns;
  if (config.format() == kCsv) {
    PSFLOW_ASSIGN_OR_RETURN(csv, CsvFormatOf(config));
    PSFLOW_ASSIGN_OR_RETURN(columns, CheckCsvColumns(csv, paths[0], shape));
  }
  return std::unique_ptr<DataFormat>(new FileFormat(config, shape, std::move(paths),
                                                    std::move(records), std::move(labels),
                                                    std::move(csv), std::move(columns)));
}

absl::StatusOr<Dataset> ReadExamples(const DataFormat& format, const ExampleShape& shape,
                                     int64_t max_examples, int threads) {
  int64_t total = 0;
  for (int64_t f = 0; f < format.num_files(); ++f) total += format.records(f);
  const int64_t n = max_examples < 0 ? total : std::min(total, max_examples);
  if (n == 0) return absl::InvalidArgumentError("the data set has no examples");
  Dataset d;
  d.count = n;
  d.channels = shape.channels;
  d.height = shape.height;
  d.width = shape.width;
  d.num_classes = shape.num_classes;
  d.images.resize(static_cast<size_t>(n * d.example_floats()));
  d.id_features = format.id_features();
  d.ids.resize(static_cast<size_t>(n * d.example_ids()));
  d.labels.resize(static_cast<size_t>(n));
  // Records are read in order on this thread, a chunk at a time, and each
  // chunk decoded on the pool.
  ThreadPool pool(std::max(threads, 1));
  std::vector<Record> chunk(256);
  std::vector<absl::Status> status(chunk.size());
  int64_t done = 0, file = 0, index = 0;
  std::unique_ptr<RecordStream> stream;
  while (done < n) {
    const int64_t size = std::min<int64_t>(n - done, static_cast<int64_t>(chunk.size()));
    for (int64_t k = 0; k < size; ++k) {
      for (;;) {
        if (stream == nullptr) {
          PSFLOW_ASSIGN_OR_RETURN(stream, format.Open(file));
        }
        PSFLOW_ASSIGN_OR_RETURN(const bool got, stream->Next(&chunk[k]));
        if (got) break;
        stream.reset();
        index = 0;
        if (++file == format.num_files()) {
          return absl::DataLossError(absl::StrCat("the data set ends after ", done + k,
                                                  " records, fewer than counted (", n, ")"));
        }
      }
      chunk[k].file = file;
      chunk[k].index = index++;
    }
    pool.ParallelFor(static_cast<int>(size), [&](int k) {
      status[k] = format.decoder().Decode(
          chunk[k], 0, /*train=*/false, d.images.data() + (done + k) * d.example_floats(),
          d.ids.data() + (done + k) * d.example_ids(), d.labels.data() + done + k);
    });
    for (int64_t k = 0; k < size; ++k) {
      if (!status[k].ok()) {
        return absl::Status(status[k].code(),
                            absl::StrCat(format.file_name(chunk[k].file), ", record ",
                                         chunk[k].index, ": ", status[k].message()));
      }
    }
    done += size;
  }
  return d;
}

std::string DescribeData(const DataConfig& config) {
  if (config.format() == "synthetic") {
    return absl::StrCat(config.synthetic_examples(), " synthetic examples");
  }
  if (!IsStreamed(config.format())) {
    return absl::StrCat(config.format(), " files in ", config.data_dir());
  }
  int64_t total = 0;
  for (const DataFile& f : config.train()) total += f.records();
  const std::string eval = config.eval().empty()
                               ? ", no evaluation files"
                               : absl::StrCat(", evaluation ", absl::StrJoin(config.eval(), ","));
  if (config.format() == kImageFolder) {
    return absl::StrCat("image_folder ", config.data_dir(), ", ", total, " images in ",
                        config.classes_size(), " classes", eval);
  }
  const int files = config.train_size();
  return absl::StrCat(config.format(), ", ", files, " file", files == 1 ? "" : "s", " (",
                      files > 0 ? config.train(0).path() : "", files > 1 ? " ..." : "", "), ",
                      total, " records", eval);
}

}  // namespace psflow::data
