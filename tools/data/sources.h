// The inputs psflow-data converts, each a fixed sequence of records made into
// tf.Examples: MNIST-format IDX files, a folder of images (one sub-folder per
// class) and CSV/TSV files. The image keys are those of TensorFlow's
// build_image_data.py (image/encoded, image/class/label, ...).
//
// A source is immutable once opened and may be shared by threads; each thread
// reads through a cursor of its own. Errors are one line naming the file.
#ifndef PSFLOW_TOOLS_DATA_SOURCES_H_
#define PSFLOW_TOOLS_DATA_SOURCES_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "data/csv/csv.h"
#include "data/image/image.h"
#include "data/mnist.h"
#include "data/tfrecord/example.h"

namespace psflow::data_tool {

// Reads the records of a source for one thread. Not thread-safe.
class ExampleCursor {
 public:
  virtual ~ExampleCursor() = default;
  // Replaces *example with record `index`. Indices must grow from call to
  // call (a CSV file is read forward only; the records between are skipped).
  virtual absl::Status Read(int64_t index, data::Example* example) = 0;
};

class ExampleSource {
 public:
  virtual ~ExampleSource() = default;
  virtual int64_t size() const = 0;
  virtual absl::StatusOr<std::unique_ptr<ExampleCursor>> NewCursor() const = 0;
};

// <dir>/{train,t10k}-images-idx3-ubyte and -labels-idx1-ubyte (or .gz):
// each image's bytes as they are in the file, encoded as `format` (PNG, or
// JPEG at `jpeg_quality`), with 1 channel and the label as its class.
absl::StatusOr<std::unique_ptr<ExampleSource>> OpenIdxSource(const std::string& dir,
                                                             data::Split split,
                                                             data::ImageFormat format,
                                                             int jpeg_quality);

// <root>/<class>/<image>.{jpg,jpeg,png} (the extension in any case): classes
// are the sorted folder names, numbered from 0, images sorted within a class.
// Each image's bytes are kept as they are; its format, size and channels (as
// the file stores them: 1 gray, 2 gray+alpha, 3, 4 RGBA) come from its header.
// Adds image/class/text (the folder's name) and image/filename (the file's).
absl::StatusOr<std::unique_ptr<ExampleSource>> OpenImageFolderSource(const std::string& root);

// A CSV/TSV file typed by `format` (data/csv/csv.h); the rows are counted
// here. Each column becomes a feature of its name: numeric a float_list of 1
// (a missing value is 0, as psflow's trainer reads it), categorical and hex an
// int64_list of 1 holding the 64-bit id (HashId, or kMissingId when empty) as
// two's complement, text a bytes_list of 1; the label column is an int64
// feature named "label" whatever its column's name. Ignored columns are left
// out.
absl::StatusOr<std::unique_ptr<ExampleSource>> OpenCsvSource(const std::string& path,
                                                             const data::CsvFormat& format);

// The channels a JPEG or PNG file stores (its header's count, before any
// conversion): 1 to 4. INVALID_ARGUMENT for bytes without a readable header.
absl::StatusOr<int> StoredChannels(absl::string_view bytes);

}  // namespace psflow::data_tool

#endif  // PSFLOW_TOOLS_DATA_SOURCES_H_
