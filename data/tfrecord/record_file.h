// TFRecord files: a sequence of records, each framed as TensorFlow frames it
// (tf.io.TFRecordWriter, tf.data.TFRecordDataset):
//
//   length  uint64, little-endian
//   masked CRC-32C of the 8 length bytes (uint32, little-endian)
//   data    `length` bytes
//   masked CRC-32C of the data (uint32, little-endian)
//
// (common/crc32c.h has the CRC and its mask.) A file may be gzip-compressed
// as a whole, as TensorFlow writes it with compression "GZIP"; offsets are
// then positions in the uncompressed stream.
//
// Readers and writers are not thread-safe: one per thread, or callers
// serialize their calls. Errors are one line that names the file.
#ifndef PSFLOW_DATA_TFRECORD_RECORD_FILE_H_
#define PSFLOW_DATA_TFRECORD_RECORD_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow::data {

namespace tfrecord_internal {
class RecordInput;   // the bytes of a file being read, plain or gzip
class RecordOutput;  // the bytes of a file being written, plain or gzip
}  // namespace tfrecord_internal

enum class RecordCompression {
  kNone,
  kGzip,  // the whole file is one gzip stream (TensorFlow's "GZIP")
};

// The longest record a reader accepts: a length over it is corrupt or a
// record too big to hold, so the reader never tries to allocate it.
inline constexpr uint64_t kMaxRecordLength = uint64_t{2} << 30;  // 2 GiB

struct RecordReaderOptions {
  // false: the first bad record is an error (DATA_LOSS or INVALID_ARGUMENT),
  // returned by that call and every later one.
  // true: bad records are counted (bad_records()) instead. A record whose
  // data fails its CRC is skipped and reading goes on with the next one; but
  // a record whose length fails its CRC, a length over kMaxRecordLength, a
  // record cut short or a corrupt gzip stream leave no way to find the next
  // record, so each counts as one bad record and ends the file there (Next
  // returns false).
  bool skip_bad_records = false;
  // Whether Next checks each record's data CRC. The length CRC is always
  // checked: without it a corrupt length loses the framing.
  bool check_data_crc = true;
};

class RecordReader {
 public:
  // Opens `path`, gzip-compressed or not: detected from the content, not the
  // name. A file that starts with the gzip magic (1f 8b) is gzip unless its
  // first 12 bytes are a plain record header whose length CRC holds.
  // NOT_FOUND "<path>: no such file"; other failures to open it are
  // INVALID_ARGUMENT naming the path (permissions, a directory).
  static absl::StatusOr<std::unique_ptr<RecordReader>> Open(const std::string& path,
                                                            RecordReaderOptions options = {});
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;

  // Reads the next record into `*record` (replacing its contents): true, or
  // false at the end of the file. Errors (see RecordReaderOptions), each one
  // line naming the file and the offset where the bad record starts:
  //   DATA_LOSS "<file>: truncated record at offset N" (cut short in its
  //     length, data or data CRC; or the gzip stream ends without its trailer)
  //   DATA_LOSS "<file>: corrupt record at offset N: its length fails the CRC"
  //   DATA_LOSS "<file>: corrupt record at offset N: its data fails the CRC"
  //   DATA_LOSS "<file>: corrupt gzip stream: <zlib's reason> (in the record
  //     at offset N)"
  //   INVALID_ARGUMENT "<file>: record at offset N is L bytes, over the 2 GiB limit"
  // A failure to read the file is UNKNOWN "<file>: read failed: <reason> (in
  // the record at offset N)", never skipped: the records are not at fault.
  absl::StatusOr<bool> Next(std::string* record);
  // Moves past the next record without returning it, and without checking
  // its data CRC: true, or false at the end. Plain files seek over the data.
  // The same errors as Next, but for the data CRC.
  absl::StatusOr<bool> Skip();

  // The offset of the next record in the (uncompressed) stream: after N
  // records of lengths L1..LN, 16 * N + L1 + ... + LN.
  int64_t offset() const { return offset_; }
  // Records skipped as bad (only with skip_bad_records).
  int64_t bad_records() const { return bad_records_; }
  RecordCompression compression() const { return compression_; }
  const std::string& path() const { return path_; }

 private:
  RecordReader(std::string path, RecordReaderOptions options, RecordCompression compression,
               std::unique_ptr<tfrecord_internal::RecordInput> input);
  // Next (record != nullptr) and Skip (nullptr).
  absl::StatusOr<bool> Read(std::string* record);
  // One record, without the bad-record policy; *bad_data is set for a data
  // CRC mismatch (the only error after which the next record can be found).
  absl::StatusOr<bool> ReadOnce(std::string* record, bool* bad_data);
  // Up to n bytes of the record at `start` (fewer only at the end of the
  // stream); input errors become one line naming the file and `start`.
  absl::StatusOr<size_t> ReadBytes(char* dst, size_t n, int64_t start);
  absl::StatusOr<size_t> SkipBytes(size_t n, int64_t start);
  absl::Status Corrupt(int64_t start, absl::string_view what) const;
  absl::Status Truncated(int64_t start) const;

  const std::string path_;
  const RecordReaderOptions options_;
  const RecordCompression compression_;
  std::unique_ptr<tfrecord_internal::RecordInput> input_;
  int64_t offset_ = 0;
  int64_t bad_records_ = 0;
  bool ended_ = false;
  absl::Status failed_;  // the first error, returned again by every later call
};

// Writes a new TFRecord file (replacing one at that path).
class RecordWriter {
 public:
  // Creates `path`. Errors name the path.
  static absl::StatusOr<std::unique_ptr<RecordWriter>> Open(
      const std::string& path, RecordCompression compression = RecordCompression::kNone);
  ~RecordWriter();  // closes the file if Close was not called, ignoring errors
  RecordWriter(const RecordWriter&) = delete;
  RecordWriter& operator=(const RecordWriter&) = delete;

  // Appends one record. Buffered: it may reach the file only at Close. After
  // a failed write every later Write and Close returns that error again.
  // INVALID_ARGUMENT for a record over kMaxRecordLength (no reader would
  // take it).
  absl::Status Write(absl::string_view record);
  // Flushes and closes the file (for gzip, ends the stream with its trailer).
  // Errors name the path. FAILED_PRECONDITION for Write or Close after Close.
  absl::Status Close();

  const std::string& path() const { return path_; }

 private:
  RecordWriter(std::string path, std::unique_ptr<tfrecord_internal::RecordOutput> output);

  const std::string path_;
  std::unique_ptr<tfrecord_internal::RecordOutput> output_;  // null once closed
  absl::Status failed_;
};

// The number of records of `path`, found by skipping through them: the length
// CRCs are checked, the data CRCs are not. The errors of RecordReader::Skip;
// with options.skip_bad_records, the count of the good records before the
// framing was lost.
absl::StatusOr<int64_t> CountRecords(const std::string& path, RecordReaderOptions options = {});

}  // namespace psflow::data

#endif  // PSFLOW_DATA_TFRECORD_RECORD_FILE_H_
