#include "tools/data/convert.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/byte_size.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "tools/data/sources.h"

namespace psflow::data_tool {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxShards = 99999;  // five digits in the name

std::string PrefixOf(const ConvertOptions& o) {
  if (!o.name.empty()) return o.name;
  return o.from == "idx" && o.split == data::Split::kTest ? "test" : "train";
}

absl::Status CheckOptions(const ConvertOptions& o) {
  if (o.input.empty()) return absl::InvalidArgumentError("--input is required");
  if (o.output.empty()) return absl::InvalidArgumentError("--output is required");
  if (o.shards < 1 || o.shards > kMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shards=", o.shards, " is not in [1, ", kMaxShards, "]"));
  }
  if (o.threads < 1) return absl::InvalidArgumentError("--threads must be at least 1");
  if (o.jpeg_quality < 1 || o.jpeg_quality > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("--jpeg_quality=", o.jpeg_quality, " is not in [1, 100]"));
  }
  if (PrefixOf(o).find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--name '", o.name, "' holds a '/'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ExampleSource>> OpenSource(const ConvertOptions& o) {
  if (o.from == "idx") return OpenIdxSource(o.input, o.split, o.image_format, o.jpeg_quality);
  if (o.from == "image_folder") return OpenImageFolderSource(o.input);
  if (o.from == "csv") {
    if (o.csv.columns.empty()) {
      return absl::InvalidArgumentError(
          "--from=csv needs --csv_columns (e.g. 'label:label,*:numeric') or --csv_preset");
    }
    return OpenCsvSource(o.input, o.csv);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--from '", o.from, "' is not idx, image_folder or csv"));
}

// Makes a closed file's bytes durable before it is renamed into place.
absl::Status SyncFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0 || fsync(fd) != 0) {
    const std::string reason = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::InternalError(absl::StrCat(path, ": cannot sync: ", reason));
  }
  close(fd);
  return absl::OkStatus();
}

// The shards being written and the first error of any writer. Thread-safe.
class ShardWriters {
 public:
  ShardWriters(const ExampleSource* source, std::vector<std::string> paths,
               data::RecordCompression compression)
      : source_(source), paths_(std::move(paths)), compression_(compression) {}

  // Writer `writer` of `writers`: shards writer, writer + writers, ...
  void Run(int writer, int writers) {
    absl::StatusOr<std::unique_ptr<ExampleCursor>> cursor = source_->NewCursor();
    if (!cursor.ok()) return Fail(cursor.status());
    const int shards = static_cast<int>(paths_.size());
    for (int s = writer; s < shards && !failed_.load(); s += writers) {
      absl::Status status = WriteShard(cursor->get(), s);
      if (!status.ok()) return Fail(status);
    }
  }

  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return first_error_;
  }

 private:
  absl::Status WriteShard(ExampleCursor* cursor, int shard) {
    const int64_t n = source_->size(), shards = static_cast<int64_t>(paths_.size());
    const int64_t begin = shard * n / shards, end = (shard + 1) * n / shards;
    const std::string tmp = paths_[shard] + ".tmp";
    PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<data::RecordWriter> out,
                            data::RecordWriter::Open(tmp, compression_));
    data::Example example;
    std::string record;
    for (int64_t i = begin; i < end; ++i) {
      // Another writer failed: the run is lost, this shard need not be finished.
      if (failed_.load()) return absl::OkStatus();
      PSFLOW_RETURN_IF_ERROR(cursor->Read(i, &example));
      if (!example.SerializeToString(&record)) {
        return absl::InternalError(absl::StrCat("record ", i, " does not serialize"));
      }
      PSFLOW_RETURN_IF_ERROR(out->Write(record));
    }
    PSFLOW_RETURN_IF_ERROR(out->Close());
    return SyncFile(tmp);
  }

  void Fail(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = status;
    failed_.store(true);
  }

  const ExampleSource* const source_;
  const std::vector<std::string> paths_;
  const data::RecordCompression compression_;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> failed_{false};  // first_error_ is set: writers stop early
};

void RemoveTemporaries(const std::vector<std::string>& paths) {
  std::error_code ignored;
  for (const std::string& p : paths) fs::remove(p + ".tmp", ignored);
}

// Renames every .tmp into place; the bytes written.
absl::StatusOr<int64_t> Publish(const std::string& dir, const std::vector<std::string>& paths) {
  int64_t bytes = 0;
  for (const std::string& p : paths) {
    std::error_code ec;
    fs::rename(p + ".tmp", p, ec);
    if (ec)
      return absl::InternalError(absl::StrCat(p, ": cannot rename into place: ", ec.message()));
    bytes += static_cast<int64_t>(fs::file_size(p, ec));
  }
  // The renames themselves are durable once the folder is synced.
  PSFLOW_RETURN_IF_ERROR(SyncFile(dir));
  return bytes;
}

// The files of `dir` named <prefix>-* that are not `paths`.
int64_t CountOtherFiles(const std::string& dir, const std::string& prefix,
                        const std::vector<std::string>& paths) {
  int64_t others = 0;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, prefix + "-") &&
        std::find(paths.begin(), paths.end(), e.path().string()) == paths.end()) {
      ++others;
    }
  }
  return others;
}

}  // namespace

std::string ShardName(const std::string& name, int shard, int shards) {
  return absl::StrFormat("%s-%05d-of-%05d", name, shard, shards);
}

absl::StatusOr<ConvertSummary> Convert(const ConvertOptions& options, ThreadPool* pool) {
  const absl::Time start = absl::Now();
  PSFLOW_RETURN_IF_ERROR(CheckOptions(options));
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<ExampleSource> source, OpenSource(options));
  if (source->size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(options.input, " holds no records"));
  }
  PSFLOW_RETURN_IF_ERROR(MakeDirectories(options.output));
  std::vector<std::string> paths;
  for (int s = 0; s < options.shards; ++s) {
    paths.push_back(
        (fs::path(options.output) / ShardName(PrefixOf(options), s, options.shards)).string());
  }
  ShardWriters writers(source.get(), paths, options.compression);
  const int threads = std::min(options.threads, options.shards);
  pool->ParallelFor(threads, [&writers, threads](int t) { writers.Run(t, threads); });
  absl::Status status = writers.status();
  absl::StatusOr<int64_t> bytes = status.ok() ? Publish(options.output, paths) : status;
  RemoveTemporaries(paths);
  if (!bytes.ok()) return bytes.status();
  ConvertSummary summary;
  summary.records = source->size();
  summary.shards = options.shards;
  summary.bytes = *bytes;
  summary.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  summary.other_files = CountOtherFiles(options.output, PrefixOf(options), paths);
  return summary;
}

std::string DescribeSummary(const ConvertOptions& options, const ConvertSummary& summary) {
  std::string line = absl::StrFormat(
      "wrote %d records to %d shards in %s (%s-*): %s in %.2f s", summary.records, summary.shards,
      options.output, PrefixOf(options), FormatByteSize(summary.bytes), summary.seconds);
  if (summary.other_files > 0) {
    absl::StrAppend(&line, "; ", summary.other_files, " other ", PrefixOf(options),
                    "-* files there are not of this run");
  }
  return line;
}

}  // namespace psflow::data_tool
