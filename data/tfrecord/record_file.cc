#include "data/tfrecord/record_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status_macros.h"

namespace psflow::data {
namespace tfrecord_internal {

// The bytes of a file, in order.
class RecordInput {
 public:
  virtual ~RecordInput() = default;
  // Reads up to n bytes into dst: fewer only at the end of the stream. Errors
  // are a phrase ("read failed: ...") the reader completes.
  virtual absl::StatusOr<size_t> Read(char* dst, size_t n) = 0;
  // Moves past up to n bytes: fewer only at the end of the stream.
  virtual absl::StatusOr<size_t> Skip(size_t n) = 0;
  // At the end of the stream: whether it ended where it should (a gzip
  // stream cut short ends early).
  virtual bool EndedCleanly() { return true; }
};

class RecordOutput {
 public:
  virtual ~RecordOutput() = default;
  virtual absl::Status Write(absl::string_view bytes) = 0;
  virtual absl::Status Close() = 0;
};

}  // namespace tfrecord_internal

namespace {

using tfrecord_internal::RecordInput;
using tfrecord_internal::RecordOutput;

constexpr size_t kHeaderBytes = 12;  // length and its CRC
constexpr size_t kFooterBytes = 4;   // the data's CRC
// Reads and writes go through buffers this big, so a file of small records
// costs one system call per MiB, not several per record.
constexpr size_t kBufferBytes = size_t{1} << 20;
// read(), write(), gzread() and gzwrite() take at most this much at once.
constexpr size_t kMaxIoBytes = size_t{1} << 30;

uint64_t DecodeFixed(const char* p, int bytes) {
  uint64_t value = 0;
  for (int i = bytes - 1; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(p[i]);
  return value;
}

void EncodeFixed(uint64_t value, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xFF);
}

bool LengthCrcHolds(const char* header) {
  return UnmaskCrc32c(static_cast<uint32_t>(DecodeFixed(header + 8, 4))) ==
         Crc32c(absl::string_view(header, 8));
}

std::string ErrnoText(int errnum) { return std::strerror(errnum); }

// read(2) until n bytes or the end of the file.
absl::StatusOr<size_t> ReadFd(int fd, char* dst, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::read(fd, dst + done, std::min(n - done, kMaxIoBytes));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return absl::UnknownError(absl::StrCat("read failed: ", ErrnoText(errno)));
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

// A plain file through a buffer; Skip seeks over what is not buffered.
class PlainInput : public RecordInput {
 public:
  explicit PlainInput(int fd) : fd_(fd), buffer_(new char[kBufferBytes]) {}
  ~PlainInput() override { ::close(fd_); }

  absl::StatusOr<size_t> Read(char* dst, size_t n) override {
    size_t done = Take(dst, n);
    while (done < n) {
      if (n - done >= kBufferBytes) {  // big: straight into dst, no copy
        PSFLOW_ASSIGN_OR_RETURN(const size_t got, ReadFd(fd_, dst + done, n - done));
        return done + got;
      }
      PSFLOW_ASSIGN_OR_RETURN(end_, ReadFd(fd_, buffer_.get(), kBufferBytes));
      pos_ = 0;
      if (end_ == 0) break;
      done += Take(dst + done, n - done);
    }
    return done;
  }

  absl::StatusOr<size_t> Skip(size_t n) override {
    size_t done = std::min(n, end_ - pos_);
    pos_ += done;
    if (done == n) return done;
    // Seek, but no further than the end of the file: a record that claims
    // more than is there is cut short, and the caller must learn so.
    struct stat st;
    const off_t here = ::lseek(fd_, 0, SEEK_CUR);
    if (here >= 0 && ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) {
      const size_t left = st.st_size > here ? static_cast<size_t>(st.st_size - here) : 0;
      const size_t step = std::min(n - done, left);
      if (::lseek(fd_, static_cast<off_t>(step), SEEK_CUR) < 0) {
        return absl::UnknownError(absl::StrCat("seek failed: ", ErrnoText(errno)));
      }
      return done + step;
    }
    // Not seekable (a pipe): read through the buffer.
    while (done < n) {
      PSFLOW_ASSIGN_OR_RETURN(end_, ReadFd(fd_, buffer_.get(), std::min(n - done, kBufferBytes)));
      pos_ = end_;
      if (end_ == 0) break;
      done += end_;
    }
    return done;
  }

 private:
  size_t Take(char* dst, size_t n) {
    const size_t take = std::min(n, end_ - pos_);
    std::memcpy(dst, buffer_.get() + pos_, take);
    pos_ += take;
    return take;
  }

  const int fd_;
  std::unique_ptr<char[]> buffer_;
  size_t pos_ = 0;  // buffer_[pos_, end_) is read but not yet taken
  size_t end_ = 0;
};

// A gzip file through zlib's gz* functions, with buffers of kBufferBytes.
class GzipInput : public RecordInput {
 public:
  explicit GzipInput(gzFile file) : file_(file) { gzbuffer(file_, kBufferBytes); }
  ~GzipInput() override { gzclose(file_); }

  absl::StatusOr<size_t> Read(char* dst, size_t n) override {
    size_t done = 0;
    while (done < n) {
      const int got =
          gzread(file_, dst + done, static_cast<unsigned>(std::min(n - done, kMaxIoBytes)));
      if (got < 0) {
        int errnum = Z_OK;
        const char* message = gzerror(file_, &errnum);
        if (errnum == Z_ERRNO) {
          return absl::UnknownError(absl::StrCat("read failed: ", ErrnoText(errno)));
        }
        if (errnum == Z_MEM_ERROR) return absl::ResourceExhaustedError("zlib: out of memory");
        return absl::DataLossError(absl::StrCat("corrupt gzip stream: ", message));
      }
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }

  absl::StatusOr<size_t> Skip(size_t n) override {
    if (scratch_ == nullptr) scratch_.reset(new char[kBufferBytes]);
    size_t done = 0;
    while (done < n) {
      PSFLOW_ASSIGN_OR_RETURN(const size_t got,
                              Read(scratch_.get(), std::min(n - done, kBufferBytes)));
      if (got == 0) break;
      done += got;
    }
    return done;
  }

  // zlib reports a stream cut short (no trailer) as Z_BUF_ERROR once the
  // input runs out, not as a read error.
  bool EndedCleanly() override {
    int errnum = Z_OK;
    gzerror(file_, &errnum);
    return errnum == Z_OK;
  }

 private:
  gzFile file_;
  std::unique_ptr<char[]> scratch_;  // what Skip reads into
};

class PlainOutput : public RecordOutput {
 public:
  explicit PlainOutput(int fd) : fd_(fd) { buffer_.reserve(kBufferBytes); }
  ~PlainOutput() override {
    if (fd_ >= 0) ::close(fd_);
  }

  absl::Status Write(absl::string_view bytes) override {
    if (buffer_.size() + bytes.size() <= kBufferBytes) {
      buffer_.append(bytes.data(), bytes.size());
      return absl::OkStatus();
    }
    PSFLOW_RETURN_IF_ERROR(Flush());
    if (bytes.size() >= kBufferBytes) return WriteFd(bytes);  // big: no copy
    buffer_.append(bytes.data(), bytes.size());
    return absl::OkStatus();
  }

  absl::Status Close() override {
    absl::Status status = Flush();
    if (::close(fd_) != 0 && status.ok()) {
      status = absl::UnknownError(absl::StrCat("close failed: ", ErrnoText(errno)));
    }
    fd_ = -1;
    return status;
  }

 private:
  absl::Status Flush() {
    absl::Status status = WriteFd(buffer_);
    buffer_.clear();
    return status;
  }

  absl::Status WriteFd(absl::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t put = ::write(fd_, bytes.data(), std::min(bytes.size(), kMaxIoBytes));
      if (put < 0 && errno == EINTR) continue;
      if (put < 0) return absl::UnknownError(absl::StrCat("write failed: ", ErrnoText(errno)));
      bytes.remove_prefix(static_cast<size_t>(put));
    }
    return absl::OkStatus();
  }

  int fd_;
  std::string buffer_;
};

// gzwrite deflates with a gzip header and trailer at the default level, as
// TensorFlow's "GZIP" option does.
class GzipOutput : public RecordOutput {
 public:
  explicit GzipOutput(gzFile file) : file_(file) { gzbuffer(file_, kBufferBytes); }
  ~GzipOutput() override {
    if (file_ != nullptr) gzclose(file_);
  }

  absl::Status Write(absl::string_view bytes) override {
    while (!bytes.empty()) {
      const size_t chunk = std::min(bytes.size(), kMaxIoBytes);
      if (gzwrite(file_, bytes.data(), static_cast<unsigned>(chunk)) == 0) {
        int errnum = Z_OK;
        const char* message = gzerror(file_, &errnum);
        return absl::UnknownError(absl::StrCat(
            "write failed: ", errnum == Z_ERRNO ? ErrnoText(errno) : std::string(message)));
      }
      bytes.remove_prefix(chunk);
    }
    return absl::OkStatus();
  }

  absl::Status Close() override {
    const int rc = gzclose(file_);
    file_ = nullptr;
    if (rc == Z_OK) return absl::OkStatus();
    return absl::UnknownError(
        absl::StrCat("close failed: ", rc == Z_ERRNO ? ErrnoText(errno) : "zlib error"));
  }

 private:
  gzFile file_;
};

// Whether a file that starts with `head` (its first bytes, up to 12) is gzip.
// A plain file whose first length starts 1f 8b (35615 bytes, say) would look
// like gzip by its magic alone; its header's CRC tells it apart.
bool LooksGzip(absl::string_view head) {
  if (head.size() < 2 || head[0] != '\x1f' || head[1] != '\x8b') return false;
  return !(head.size() == kHeaderBytes && LengthCrcHolds(head.data()));
}

absl::StatusOr<int> OpenFd(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd >= 0) return fd;
  const int errnum = errno;
  if (errnum == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  return absl::InvalidArgumentError(absl::StrCat("cannot open ", path, ": ", ErrnoText(errnum)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RecordReader>> RecordReader::Open(const std::string& path,
                                                                 RecordReaderOptions options) {
  PSFLOW_ASSIGN_OR_RETURN(const int fd, OpenFd(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is a directory, not a TFRecord file"));
  }
  char head[kHeaderBytes];
  const ssize_t got = ::pread(fd, head, sizeof(head), 0);
  if (got < 0) {
    const int errnum = errno;
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path, ": ", ErrnoText(errnum)));
  }
  std::unique_ptr<RecordInput> input;
  RecordCompression compression = RecordCompression::kNone;
  if (LooksGzip(absl::string_view(head, static_cast<size_t>(got)))) {
    gzFile file = gzdopen(fd, "rb");
    if (file == nullptr) {
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("cannot open ", path, ": out of memory"));
    }
    input = std::make_unique<GzipInput>(file);
    compression = RecordCompression::kGzip;
  } else {
    input = std::make_unique<PlainInput>(fd);
  }
  return std::unique_ptr<RecordReader>(
      new RecordReader(path, options, compression, std::move(input)));
}

RecordReader::RecordReader(std::string path, RecordReaderOptions options,
                           RecordCompression compression, std::unique_ptr<RecordInput> input)
    : path_(std::move(path)),
      options_(options),
      compression_(compression),
      input_(std::move(input)) {}

RecordReader::~RecordReader() = default;

absl::StatusOr<bool> RecordReader::Next(std::string* record) { return Read(record); }

absl::StatusOr<bool> RecordReader::Skip() { return Read(nullptr); }

absl::StatusOr<bool> RecordReader::Read(std::string* record) {
  while (true) {
    if (!failed_.ok()) return failed_;
    if (ended_) return false;
    bool bad_data = false;
    absl::StatusOr<bool> got = ReadOnce(record, &bad_data);
    if (got.ok()) return got;
    // A bad record (not a failure to read the file) is skipped when asked;
    // past one that loses the framing, nothing more can be found.
    const bool bad_record = got.status().code() == absl::StatusCode::kDataLoss ||
                            got.status().code() == absl::StatusCode::kInvalidArgument;
    if (options_.skip_bad_records && bad_record) {
      ++bad_records_;
      if (bad_data) continue;
      ended_ = true;
      return false;
    }
    failed_ = got.status();
    return failed_;
  }
}

absl::StatusOr<bool> RecordReader::ReadOnce(std::string* record, bool* bad_data) {
  const int64_t start = offset_;
  char header[kHeaderBytes];
  PSFLOW_ASSIGN_OR_RETURN(size_t got, ReadBytes(header, kHeaderBytes, start));
  if (got == 0) {
    if (!input_->EndedCleanly()) return Truncated(start);
    ended_ = true;
    return false;
  }
  if (got < kHeaderBytes) return Truncated(start);
  if (!LengthCrcHolds(header)) return Corrupt(start, "its length fails the CRC");
  const uint64_t length = DecodeFixed(header, 8);
  if (length > kMaxRecordLength) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": record at offset ", start, " is ",
                                                   length, " bytes, over the 2 GiB limit"));
  }
  if (record != nullptr) {
    record->resize(length);
    PSFLOW_ASSIGN_OR_RETURN(got, ReadBytes(record->data(), length, start));
  } else {
    PSFLOW_ASSIGN_OR_RETURN(got, SkipBytes(length, start));
  }
  if (got < length) return Truncated(start);
  char footer[kFooterBytes];
  PSFLOW_ASSIGN_OR_RETURN(got, ReadBytes(footer, kFooterBytes, start));
  if (got < kFooterBytes) return Truncated(start);
  offset_ = start + static_cast<int64_t>(kHeaderBytes + length + kFooterBytes);
  if (record != nullptr && options_.check_data_crc &&
      UnmaskCrc32c(static_cast<uint32_t>(DecodeFixed(footer, 4))) != Crc32c(*record)) {
    *bad_data = true;
    return Corrupt(start, "its data fails the CRC");
  }
  return true;
}

absl::StatusOr<size_t> RecordReader::ReadBytes(char* dst, size_t n, int64_t start) {
  absl::StatusOr<size_t> got = input_->Read(dst, n);
  if (got.ok()) return got;
  return absl::Status(got.status().code(), absl::StrCat(path_, ": ", got.status().message(),
                                                        " (in the record at offset ", start, ")"));
}

absl::StatusOr<size_t> RecordReader::SkipBytes(size_t n, int64_t start) {
  absl::StatusOr<size_t> got = input_->Skip(n);
  if (got.ok()) return got;
  return absl::Status(got.status().code(), absl::StrCat(path_, ": ", got.status().message(),
                                                        " (in the record at offset ", start, ")"));
}

absl::Status RecordReader::Corrupt(int64_t start, absl::string_view what) const {
  return absl::DataLossError(absl::StrCat(path_, ": corrupt record at offset ", start, ": ", what));
}

absl::Status RecordReader::Truncated(int64_t start) const {
  return absl::DataLossError(absl::StrCat(path_, ": truncated record at offset ", start));
}

absl::StatusOr<std::unique_ptr<RecordWriter>> RecordWriter::Open(const std::string& path,
                                                                 RecordCompression compression) {
  PSFLOW_ASSIGN_OR_RETURN(const int fd, OpenFd(path, O_WRONLY | O_CREAT | O_TRUNC));
  std::unique_ptr<RecordOutput> output;
  if (compression == RecordCompression::kGzip) {
    gzFile file = gzdopen(fd, "wb");
    if (file == nullptr) {
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("cannot open ", path, ": out of memory"));
    }
    output = std::make_unique<GzipOutput>(file);
  } else {
    output = std::make_unique<PlainOutput>(fd);
  }
  return std::unique_ptr<RecordWriter>(new RecordWriter(path, std::move(output)));
}

RecordWriter::RecordWriter(std::string path, std::unique_ptr<RecordOutput> output)
    : path_(std::move(path)), output_(std::move(output)) {}

RecordWriter::~RecordWriter() {
  if (output_ != nullptr) output_->Close().IgnoreError();
}

absl::Status RecordWriter::Write(absl::string_view record) {
  if (!failed_.ok()) return failed_;
  if (output_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": write after close"));
  }
  if (record.size() > kMaxRecordLength) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": a record of ", record.size(), " bytes is over the 2 GiB limit"));
  }
  char header[kHeaderBytes];
  EncodeFixed(record.size(), 8, header);
  EncodeFixed(MaskCrc32c(Crc32c(absl::string_view(header, 8))), 4, header + 8);
  char footer[kFooterBytes];
  EncodeFixed(MaskCrc32c(Crc32c(record)), 4, footer);
  absl::Status status = output_->Write(absl::string_view(header, kHeaderBytes));
  if (status.ok()) status = output_->Write(record);
  if (status.ok()) status = output_->Write(absl::string_view(footer, kFooterBytes));
  if (!status.ok())
    failed_ = absl::Status(status.code(), absl::StrCat(path_, ": ", status.message()));
  return failed_;
}

absl::Status RecordWriter::Close() {
  if (output_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": closed twice"));
  }
  absl::Status status = output_->Close();
  output_.reset();
  if (!failed_.ok()) return failed_;
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat(path_, ": ", status.message()));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CountRecords(const std::string& path, RecordReaderOptions options) {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<RecordReader> reader, RecordReader::Open(path, options));
  int64_t count = 0;
  while (true) {
    PSFLOW_ASSIGN_OR_RETURN(const bool more, reader->Skip());
    if (!more) return count;
    ++count;
  }
}

}  // namespace psflow::data
