#include "ps/embedding/table_file.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace psflow::ps::embedding {
namespace {

static_assert(std::endian::native == std::endian::little,
              "embedding snapshots store the host's little-endian records");

constexpr char kMagic[8] = {'P', 'S', 'F', 'E', 'M', 'B', 'E', 'D'};
constexpr uint32_t kVersion = 1;
constexpr int64_t kBlockBytes = 1 << 20;  // records per block: about 1 MiB
constexpr uint32_t kMaxNameBytes = 1 << 16;

struct Header {
  std::string name;
  uint32_t dim = 0, kind = 0, slot_floats = 0;
  int64_t table_rows = 0, rows = 0;
};

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

std::string EncodeHeader(const Header& h) {
  std::string out(kMagic, sizeof(kMagic));
  Put(&out, kVersion);
  Put(&out, static_cast<uint32_t>(h.name.size()));
  out += h.name;
  Put(&out, h.dim);
  Put(&out, h.kind);
  Put(&out, h.slot_floats);
  Put(&out, h.table_rows);
  Put(&out, h.rows);
  Put(&out, MaskCrc32c(Crc32c(out)));
  return out;
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat("embedding snapshot ", path, ": cannot ", what, ": ", std::strerror(errno)));
}

absl::Status WriteAll(int fd, const std::string& path, const iovec* parts, int count) {
  std::vector<iovec> iov(parts, parts + count);
  size_t at = 0;
  while (at < iov.size()) {
    const ssize_t n = ::writev(fd, iov.data() + at, static_cast<int>(iov.size() - at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("write", path);
    size_t left = static_cast<size_t>(n);
    while (at < iov.size() && left >= iov[at].iov_len) left -= iov[at++].iov_len;
    if (at < iov.size()) {
      iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + left;
      iov[at].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

// Writes `records` (whole records) as blocks of about kBlockBytes.
absl::Status WriteBlocks(int fd, const std::string& path, const std::string& records,
                         int64_t record_bytes) {
  const int64_t block_rows = std::max<int64_t>(1, kBlockBytes / record_bytes);
  const int64_t rows = static_cast<int64_t>(records.size()) / record_bytes;
  for (int64_t first = 0; first < rows; first += block_rows) {
    const int64_t n = std::min(block_rows, rows - first);
    const absl::string_view payload(records.data() + first * record_bytes, n * record_bytes);
    const uint32_t head[2] = {static_cast<uint32_t>(n), MaskCrc32c(Crc32c(payload))};
    const iovec parts[2] = {{const_cast<uint32_t*>(head), sizeof(head)},
                            {const_cast<char*>(payload.data()), payload.size()}};
    if (auto s = WriteAll(fd, path, parts, 2); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WriteShardTo(int fd, const std::string& tmp, const EmbeddingShard& shard) {
  Header h{shard.name(),
           static_cast<uint32_t>(shard.dim()),
           static_cast<uint32_t>(shard.optimizer().kind()),
           static_cast<uint32_t>(shard.slot_floats()),
           shard.spec().rows(),
           0};
  std::string header = EncodeHeader(h);  // again at the end, with the row count
  iovec part{header.data(), header.size()};
  if (auto s = WriteAll(fd, tmp, &part, 1); !s.ok()) return s;
  std::string records;
  for (int stripe = 0; stripe < EmbeddingShard::kStripes; ++stripe) {
    records.clear();
    h.rows += shard.ExportStripe(stripe, &records);
    if (auto s = WriteBlocks(fd, tmp, records, shard.record_bytes()); !s.ok()) return s;
  }
  header = EncodeHeader(h);
  if (::pwrite(fd, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size())) {
    return Errno("write", tmp);
  }
  if (::fsync(fd) != 0) return Errno("fsync", tmp);
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteEmbeddingShard(const EmbeddingShard& shard, const std::string& path) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create", tmp);
  absl::Status s = WriteShardTo(fd, tmp, shard);
  if (::close(fd) != 0 && s.ok()) s = Errno("close", tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = Errno("rename onto", path);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  const int dir_fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) return Errno("open the directory of", path);
  const bool synced = ::fsync(dir_fd) == 0;
  ::close(dir_fd);
  return synced ? absl::OkStatus() : Errno("fsync the directory of", path);
}

namespace {

// Reads one snapshot file front to back; errors name it.
class FileReader {
 public:
  explicit FileReader(std::string path) : path_(std::move(path)) {}
  ~FileReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Open() {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ >= 0) return absl::OkStatus();
    return absl::NotFoundError(
        absl::StrCat("embedding snapshot ", path_, ": cannot open: ", std::strerror(errno)));
  }
  // Reads exactly n bytes; a short file is DATA_LOSS naming `what`.
  absl::Status Read(void* out, size_t n, absl::string_view what) {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(fd_, static_cast<char*>(out) + got, n - got);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return Errno("read", path_);
      if (r == 0) return Error(absl::StrCat("truncated in ", what));
      got += static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }
  bool AtEnd() {
    char c;
    return ::read(fd_, &c, 1) == 0;
  }
  absl::Status Error(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat("embedding snapshot ", path_, ": ", what));
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

absl::StatusOr<Header> ReadHeader(FileReader& in) {
  char magic[8];
  uint32_t version = 0, name_len = 0;
  if (auto s = in.Read(magic, 8, "the header"); !s.ok()) return s;
  if (std::memcmp(magic, kMagic, 8) != 0) return in.Error("not an embedding snapshot (bad magic)");
  if (auto s = in.Read(&version, 4, "the header"); !s.ok()) return s;
  if (version != kVersion) return in.Error(absl::StrCat("format version ", version, ", not 1"));
  if (auto s = in.Read(&name_len, 4, "the header"); !s.ok()) return s;
  if (name_len > kMaxNameBytes) return in.Error("corrupt header (table name too long)");
  Header h;
  h.name.resize(name_len);
  uint32_t crc = 0;
  if (auto s = in.Read(h.name.data(), name_len, "the header"); !s.ok()) return s;
  const std::pair<void*, size_t> fields[] = {{&h.dim, 4},        {&h.kind, 4}, {&h.slot_floats, 4},
                                             {&h.table_rows, 8}, {&h.rows, 8}, {&crc, 4}};
  for (const auto& [field, bytes] : fields) {
    if (auto s = in.Read(field, bytes, "the header"); !s.ok()) return s;
  }
  const std::string encoded = EncodeHeader(h);
  if (UnmaskCrc32c(crc) != Crc32c(absl::string_view(encoded).substr(0, encoded.size() - 4))) {
    return in.Error("header checksum mismatch");
  }
  if (h.rows < 0) return in.Error("corrupt header (negative row count)");
  return h;
}

absl::Status CheckMatches(const Header& h, const EmbeddingShard& shard, const std::string& path) {
  auto mismatch = [&](absl::string_view what, auto file, auto want) {
    return absl::FailedPreconditionError(absl::StrCat("embedding snapshot ", path, " holds ", what,
                                                      " ", file, ", not ", want, " (table \"",
                                                      shard.name(), "\")"));
  };
  if (h.name != shard.name()) return mismatch("table", h.name, shard.name());
  if (h.dim != static_cast<uint32_t>(shard.dim())) return mismatch("dim", h.dim, shard.dim());
  if (h.kind != static_cast<uint32_t>(shard.optimizer().kind()) ||
      h.slot_floats != static_cast<uint32_t>(shard.slot_floats())) {
    return mismatch("optimizer",
                    SparseOptimizerName(static_cast<SparseOptimizerConfig::Kind>(h.kind)),
                    SparseOptimizerName(shard.optimizer().kind()));
  }
  if (h.table_rows != shard.spec().rows()) {
    return mismatch("table rows", h.table_rows, shard.spec().rows());
  }
  return absl::OkStatus();
}

// Reads the blocks of `in`, whose header `header` was read and checked.
absl::Status RestoreBlocks(FileReader& in, const Header& header, EmbeddingShard& shard,
                           std::string& buffer) {
  const int64_t record_bytes = shard.record_bytes();
  const int64_t max_block_rows = std::max<int64_t>(1, kBlockBytes / record_bytes);
  for (int64_t left = header.rows, block = 0; left > 0; ++block) {
    uint32_t head[2];
    const std::string where = absl::StrCat("block ", block);
    if (auto s = in.Read(head, sizeof(head), where); !s.ok()) return s;
    if (head[0] == 0 || head[0] > left || head[0] > max_block_rows) {
      return in.Error(absl::StrCat(where, " claims ", head[0], " rows"));
    }
    buffer.resize(head[0] * record_bytes);
    if (auto s = in.Read(buffer.data(), buffer.size(), where); !s.ok()) return s;
    if (UnmaskCrc32c(head[1]) != Crc32c(buffer)) return in.Error(where + " checksum mismatch");
    auto kept = shard.ImportRecords(buffer);
    if (!kept.ok()) return in.Error(kept.status().message());
    left -= head[0];
  }
  if (!in.AtEnd()) return in.Error("bytes after the last row");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddingShard>> RestoreEmbeddingShard(
    const EmbeddingTableSpec& spec, int num_ps, int ps_index, uint64_t seed,
    const std::vector<std::string>& paths) {
  auto shard = EmbeddingShard::Create(spec, num_ps, ps_index, seed);
  if (!shard.ok()) return shard.status();
  // Every header first: a mismatched file fails before any row is read, and
  // the row count sizes the index once.
  std::vector<std::unique_ptr<FileReader>> files;
  std::vector<Header> headers;
  int64_t rows = 0;
  for (const std::string& path : paths) {
    files.push_back(std::make_unique<FileReader>(path));
    if (auto s = files.back()->Open(); !s.ok()) return s;
    auto header = ReadHeader(*files.back());
    if (!header.ok()) return header.status();
    if (auto s = CheckMatches(*header, **shard, path); !s.ok()) return s;
    // The count sizes the index before any row is read: it must fit the file.
    std::error_code error;
    const uintmax_t size = std::filesystem::file_size(path, error);
    const uintmax_t record = static_cast<uintmax_t>((*shard)->record_bytes());
    if (!error && (header->rows < 0 || static_cast<uintmax_t>(header->rows) > size / record)) {
      return absl::DataLossError(absl::StrCat("embedding snapshot ", path, ": the header counts ",
                                              header->rows, " rows, more than its ", size,
                                              " bytes hold"));
    }
    rows += header->rows;
    headers.push_back(*std::move(header));
  }
  (*shard)->Reserve(rows / num_ps);
  std::string buffer;
  for (size_t i = 0; i < files.size(); ++i) {
    if (auto s = RestoreBlocks(*files[i], headers[i], **shard, buffer); !s.ok()) return s;
  }
  return shard;
}

}  // namespace psflow::ps::embedding
