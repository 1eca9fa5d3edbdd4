// What a file format gives the input pipeline (data/pipeline.h): a data set
// as an ordered list of files of records, a stream over the records of one
// file, and a decoder that turns a record into the model's input and a label.
// The formats live in data/formats.h; IDX and synthetic data, small enough to
// hold whole, are read into a Dataset (data/source.h) instead.
#ifndef PSFLOW_DATA_READER_H_
#define PSFLOW_DATA_READER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace psflow::data {

// One record as a file holds it, before decoding.
struct Record {
  std::string bytes;
  // The label where the record's place gives it (an image folder's class);
  // -1 where the record holds it.
  int64_t label = -1;
  // Where it lies, for messages: its file (DataFormat's index) and its
  // index in that file. Set by the pipeline.
  int64_t file = -1, index = -1;
};

// The records of one file, in order. Not thread-safe (one reader thread).
class RecordStream {
 public:
  virtual ~RecordStream() = default;
  // The next record; false at the end of the file.
  virtual absl::StatusOr<bool> Next(Record* record) = 0;
  // Moves past the next record without keeping it; false at the end.
  virtual absl::StatusOr<bool> Skip() = 0;
  // Corrupt records passed over (DataConfig.skip_bad_records).
  virtual int64_t bad_records() const { return 0; }
};

// A categorical input of the examples, for models that embed ids: `width`
// 64-bit ids per example under the data's name for it (a CSV's categorical
// or hex column gives one id per example, named by the column).
struct IdFeature {
  std::string name;
  int width = 1;
};

// The ids of one example in total: the sum of the features' widths.
int64_t IdsPerExample(const std::vector<IdFeature>& features);

// Turns records into examples. Thread-safe: the decode pool calls it.
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Writes the model's input (example_floats floats, channels-first, pixels
  // in [0, 1]), the example's ids (example_ids of them, the features' in
  // DataFormat::id_features order; `ids` may be null where there are none)
  // and *label. `train` chooses the training transform (random crop and
  // flip, drawn from `seed`, the example's own) over the evaluation one. An
  // error names what is wrong with the record.
  virtual absl::Status Decode(const Record& record, uint64_t seed, bool train, float* input,
                              uint64_t* ids, int32_t* label) const = 0;
};

// A data set: files in a fixed order (the same in every process), each of a
// known number of records. Thread-safe (const).
class DataFormat {
 public:
  virtual ~DataFormat() = default;
  virtual int64_t num_files() const = 0;
  virtual int64_t records(int64_t file) const = 0;
  // For messages: the file's path.
  virtual std::string file_name(int64_t file) const = 0;
  virtual absl::StatusOr<std::unique_ptr<RecordStream>> Open(int64_t file) const = 0;
  virtual const Decoder& decoder() const = 0;
  // The floats of one decoded example.
  virtual int64_t example_floats() const = 0;
  // The categorical features of every example, in the order of their ids;
  // none for images.
  virtual const std::vector<IdFeature>& id_features() const;
  // The ids of one decoded example: IdsPerExample(id_features()).
  int64_t example_ids() const { return IdsPerExample(id_features()); }
};

}  // namespace psflow::data

#endif  // PSFLOW_DATA_READER_H_
