// TensorBoard event files: TFRecord framing of Event messages
// (proto/summary.proto) and a writer of new files.
//
// A TFRecord is: the data's length (uint64, little-endian), the masked
// CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data (both
// uint32, little-endian; common/crc32c.h).
//
// An EventFileWriter always makes a new file, never appends to an old one,
// so a restarted process leaves its predecessor's files as they were.
// TensorBoard reads every file of a directory in name order, and names start
// with the Unix time, so a later writer's file is read after an earlier one's.
#ifndef PSFLOW_COMMON_EVENT_FILE_H_
#define PSFLOW_COMMON_EVENT_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/summary.pb.h"

namespace psflow {

// The file_version of the first record of every file.
inline constexpr char kEventFileVersion[] = "brain.Event:2";

// `data` framed as one TFRecord.
std::string FrameRecord(absl::string_view data);
// The records of a TFRecord file's `contents`, in order. DATA_LOSS naming the
// byte offset for a record cut short or a CRC that does not match.
absl::StatusOr<std::vector<std::string>> ParseRecords(absl::string_view contents);

// "events.out.tfevents.<Unix seconds of now>.<host>.<pid>".
std::string EventFileName(absl::Time now, absl::string_view host, int pid);

// Not thread-safe: callers serialize their calls.
class EventFileWriter {
 public:
  // Creates `dir` (and its parents) if missing, then a new file in it named
  // EventFileName(now, this host, this process), with ".<n>" added for the
  // first n >= 1 that is free when that name is taken (another writer of
  // this process in the same second), and writes the file_version record.
  // Errors name the path.
  static absl::StatusOr<std::unique_ptr<EventFileWriter>> Open(const std::string& dir,
                                                               absl::Time now);
  ~EventFileWriter();  // flushes (ignoring errors) and closes
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // Queue one record; nothing reaches the file before Flush.
  void Write(const Event& event);
  // One Summary event of `values` (tag, value), stored as float.
  void WriteScalars(int64_t step, absl::Time wall_time,
                    absl::Span<const std::pair<std::string, double>> values);
  // A SessionLog START at `step`: TensorBoard drops every point of this
  // directory read before it at `step` or later.
  void WriteSessionStart(int64_t step, absl::Time wall_time);

  // Writes the queued records to the file (into the OS's cache, without
  // fsync: enough for a reader to see them). After a failed write the file
  // may end in a partial record: that error is returned again by every later
  // Flush, and the caller should open a new file.
  absl::Status Flush();

  const std::string& path() const { return path_; }

 private:
  EventFileWriter(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}

  const std::string path_;
  const int fd_;
  std::string pending_;  // framed records not written yet
  absl::Status failed_;  // the first write error
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_EVENT_FILE_H_
