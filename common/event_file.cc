#include "common/event_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace psflow {
namespace {

void AppendLittleEndian(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

uint64_t ReadLittleEndian(absl::string_view in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return v;
}

double UnixSeconds(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

std::string HostName() {
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') return "localhost";
  return host;
}

}  // namespace

std::string FrameRecord(absl::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  AppendLittleEndian(&out, data.size(), 8);
  AppendLittleEndian(&out, MaskCrc32c(Crc32c(out)), 4);
  out.append(data.data(), data.size());
  AppendLittleEndian(&out, MaskCrc32c(Crc32c(data)), 4);
  return out;
}

absl::StatusOr<std::vector<std::string>> ParseRecords(absl::string_view contents) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < contents.size()) {
    absl::string_view rest = contents.substr(at);
    if (rest.size() < 12) {
      return absl::DataLossError(absl::StrCat("a record header cut short at byte ", at));
    }
    const absl::string_view length_bytes = rest.substr(0, 8);
    if (UnmaskCrc32c(static_cast<uint32_t>(ReadLittleEndian(rest.substr(8), 4))) !=
        Crc32c(length_bytes)) {
      return absl::DataLossError(
          absl::StrCat("the length of the record at byte ", at, " fails its checksum"));
    }
    const uint64_t length = ReadLittleEndian(length_bytes, 8);
    if (length > rest.size() - 12 || rest.size() - 12 - length < 4) {
      return absl::DataLossError(
          absl::StrCat("the record at byte ", at, " (", length, " bytes) is cut short"));
    }
    const absl::string_view data = rest.substr(12, length);
    if (UnmaskCrc32c(static_cast<uint32_t>(ReadLittleEndian(rest.substr(12 + length), 4))) !=
        Crc32c(data)) {
      return absl::DataLossError(
          absl::StrCat("the data of the record at byte ", at, " fails its checksum"));
    }
    records.emplace_back(data);
    at += 16 + length;
  }
  return records;
}

std::string EventFileName(absl::Time now, absl::string_view host, int pid) {
  return absl::StrCat("events.out.tfevents.", absl::ToUnixSeconds(now), ".", host, ".", pid);
}

absl::StatusOr<std::unique_ptr<EventFileWriter>> EventFileWriter::Open(const std::string& dir,
                                                                       absl::Time now) {
  PSFLOW_RETURN_IF_ERROR(MakeDirectories(dir));
  const std::string base = absl::StrCat(dir, "/", EventFileName(now, HostName(), ::getpid()));
  std::string path = base;
  int fd = -1;
  for (int n = 1;; ++n) {
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST || n > 1000) break;
    path = absl::StrCat(base, ".", n);
  }
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<EventFileWriter> writer(new EventFileWriter(path, fd));
  Event version;
  version.set_wall_time(UnixSeconds(now));
  version.set_file_version(kEventFileVersion);
  writer->Write(version);
  PSFLOW_RETURN_IF_ERROR(writer->Flush());
  return writer;
}

EventFileWriter::~EventFileWriter() {
  (void)Flush();
  ::close(fd_);
}

void EventFileWriter::Write(const Event& event) {
  pending_.append(FrameRecord(event.SerializeAsString()));
}

void EventFileWriter::WriteScalars(int64_t step, absl::Time wall_time,
                                   absl::Span<const std::pair<std::string, double>> values) {
  Event event;
  event.set_wall_time(UnixSeconds(wall_time));
  event.set_step(step);
  Summary* summary = event.mutable_summary();
  for (const auto& [tag, value] : values) {
    Summary::Value* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  Write(event);
}

void EventFileWriter::WriteSessionStart(int64_t step, absl::Time wall_time) {
  Event event;
  event.set_wall_time(UnixSeconds(wall_time));
  event.set_step(step);
  event.mutable_session_log()->set_status(SessionLog::START);
  Write(event);
}

absl::Status EventFileWriter::Flush() {
  if (!failed_.ok()) return failed_;
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      failed_ =
          absl::InternalError(absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
      pending_.clear();
      return failed_;
    }
    done += static_cast<size_t>(n);
  }
  pending_.clear();
  return absl::OkStatus();
}

}  // namespace psflow
