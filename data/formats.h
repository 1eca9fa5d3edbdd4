// The data sets read as streams of records (data/pipeline.h): TFRecord files
// of tf.Example, folders of images (one sub-folder per class) and CSV/TSV
// files; and the chief's resolution of a job's files (docs/data.md).
//
// Images, from a tf.Example's bytes feature or from a file, decode to the
// model's input shape: in training with DataConfig.augment, a random part of
// the image (RandomResizedCrop) flipped left to right half the time; else
// the shorter side resized to resize_shorter (0: the model's shorter input
// side) and the center cut out. Pixels land in [0, 1]. CSV files feed their
// numeric columns, in column order, as the model's input (a missing value
// is 0), and their categorical and hex columns as the examples' ids
// (DataFormat::id_features: one id per column, named by it, in column
// order; see data/csv/csv.h for how a value becomes an id); text columns
// are checked and read, and left to models that embed them.
//
// Thread-safe (the formats are immutable once opened).
#ifndef PSFLOW_DATA_FORMATS_H_
#define PSFLOW_DATA_FORMATS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/mnist.h"
#include "data/reader.h"
#include "proto/data.pb.h"

namespace psflow::data {

// The defaults of the data flags (data/flags.h), for options built without
// flags: the keys of TensorFlow's image recipe, a CSV with a header and
// commas, a shuffle buffer of 10,000 records, 2 batches read ahead.
DataConfig DefaultDataConfig();

// tfrecord, image_folder and csv: read as streams. idx and synthetic are
// held whole (data/source.h).
bool IsStreamed(absl::string_view format);

// What the chief's flags say of the files: comma-separated paths or glob
// patterns (an image folder: its root), empty for the default places.
struct DataFiles {
  std::string train;
  std::string eval;
};

// The chief's resolution of `config` (format, data_dir and the keys set by
// flags): recognizes an empty format from the files, lists and counts the
// training files (config->train) or the image folder's classes, and sets
// the evaluation files left empty to the default place. Without files:
// data_dir/train-* and validation-* or test-* (tfrecord), data_dir/train
// and val, validation or test (image_folder), data_dir/train.csv or .tsv
// and test.csv or .tsv (csv). Errors name the flag and the path.
absl::Status ResolveDataFiles(const DataFiles& files, DataConfig* config);

// The same for a process that evaluates alone (psflow-eval): recognizes an
// empty format from `eval_files` or data_dir and sets config->eval to
// `eval_files` or the default place.
absl::Status ResolveEvalFiles(const std::string& eval_files, DataConfig* config);

// Opens the resolved data set for `split` as a model of input `shape` takes
// it. The evaluation split expands and counts config.eval here. Errors:
// files missing, a CSV whose numeric columns do not make the model's input,
// an image folder whose classes are not the model's.
absl::StatusOr<std::unique_ptr<DataFormat>> OpenDataFormat(const DataConfig& config,
                                                           const ExampleShape& shape, Split split);

// A folder of class folders (<root>/<class>/<image>.jpg|.jpeg|.png, other
// files ignored): the classes by sorted folder name, the images sorted by
// path within a class, each with its class id. NOT_FOUND when root is no
// folder; INVALID_ARGUMENT when it cannot be listed or holds no image.
struct ImageFolder {
  std::vector<std::string> classes;
  std::vector<std::string> paths;
  std::vector<int32_t> labels;
};
absl::StatusOr<ImageFolder> ListImageFolder(const std::string& root);

// A view of `format` holding its files 0, stride, 2 * stride, ... (stride
// >= 1), for samples spread over a data set (an image folder's classes come
// one after another). `format` outlives the view.
std::unique_ptr<DataFormat> EveryNthFile(const DataFormat& format, int64_t stride);

// The first `max_examples` examples of `format` (all when negative), in file
// order, decoded with the evaluation transform on `threads` threads.
absl::StatusOr<Dataset> ReadExamples(const DataFormat& format, const ExampleShape& shape,
                                     int64_t max_examples, int threads);

// The training data of a resolved config, for logs: "tfrecord, 12 files
// (/data/train-00000-of-00012 ...), 60000 records", "image_folder /data/train,
// 60000 images in 10 classes", "idx files in /usr/share/...".
std::string DescribeData(const DataConfig& config);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_FORMATS_H_
