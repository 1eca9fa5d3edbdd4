// psflow-bench-embedding: one ps's shard of a dynamic embedding table
// (ps/embedding/table.h) with row-wise Adagrad, each figure beside a baseline
// measured in the same run on the same bytes, without the table's index,
// locks and bookkeeping:
//   lookup:   batches of random ids read out, against a gather of the same
//             rows from one flat array
//   lookup_2_threads: the same lookups from two threads, against one thread
//             (the lock stripes let them run side by side: 2 is perfect)
//   apply:    the same batches updated, against the same update of the flat
//             array's rows
//   write:    the shard's snapshot file, against writing and fsyncing a file
//             of as many bytes from one buffer
//   read:     restoring the shard from it, against reading the file through
//             a 1 MiB buffer (which builds no index)
// Prints the shard's memory (bytes per row), then one line each, e.g.
//   lookup rows=4000000 dim=16 per_s=1.4e+07 baseline_per_s=3.0e+07 ratio=0.47
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "ps/embedding/table.h"
#include "ps/embedding/table_file.h"
#include "role/command_line.h"
#include "role/process_setup.h"

ABSL_FLAG(int64_t, rows, 4000000, "Rows of the table (ids 0..rows-1, all on one ps).");
ABSL_FLAG(int, dim, 16, "Floats per row.");
ABSL_FLAG(int, batch, 4096, "Ids per lookup and per update.");
ABSL_FLAG(int64_t, batches, 400, "Timed batches of lookups and of updates.");
ABSL_FLAG(std::string, dir, "/tmp", "Where the snapshot file goes (removed after).");
ABSL_FLAG(bool, memory_only, false, "Only fill the table and print its memory line (for sizing).");

namespace psflow::ps::embedding {
namespace {

struct Options {
  int64_t rows, batches;
  int dim, batch;
  std::string dir;
  bool memory_only;
};

double Seconds(absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

void Report(const char* what, const Options& o, double rate, double baseline, const char* unit) {
  std::printf("%s rows=%lld dim=%d %s=%.3g baseline_%s=%.3g ratio=%.2f\n", what,
              static_cast<long long>(o.rows), o.dim, unit, rate, unit, baseline, rate / baseline);
}

// Batches of distinct random ids: an update takes each id once.
std::vector<std::vector<uint64_t>> MakeBatches(const Options& o) {
  std::mt19937_64 rng(1);
  std::vector<std::vector<uint64_t>> batches(o.batches);
  for (auto& b : batches) {
    for (int i = 0; i < o.batch; ++i) b.push_back(rng() % o.rows);
    std::sort(b.begin(), b.end());
    b.erase(std::unique(b.begin(), b.end()), b.end());
  }
  return batches;
}

absl::Status Fill(EmbeddingShard& shard, const Options& o) {
  std::vector<uint64_t> ids(o.batch);
  std::vector<float> out(static_cast<size_t>(o.batch) * o.dim);
  for (int64_t first = 0; first < o.rows; first += o.batch) {
    const int64_t n = std::min<int64_t>(o.batch, o.rows - first);
    ids.resize(n);
    std::iota(ids.begin(), ids.end(), first);
    absl::Status s = shard.Lookup(ids, true, 0, absl::MakeSpan(out.data(), n * o.dim));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status BenchRows(EmbeddingShard& shard, const Options& o) {
  const auto batches = MakeBatches(o);
  int64_t ids = 0;
  for (const auto& b : batches) ids += static_cast<int64_t>(b.size());
  std::vector<float> out(static_cast<size_t>(o.batch) * o.dim, 0.5f), flat(o.rows * o.dim, 0.1f),
      acc(o.rows, 0.0f);
  absl::Time start = absl::Now();
  for (const auto& b : batches) {
    absl::Status s = shard.Lookup(b, true, 1, absl::MakeSpan(out.data(), b.size() * o.dim));
    if (!s.ok()) return s;
  }
  const double lookup = ids / Seconds(start);
  start = absl::Now();
  for (const auto& b : batches) {
    for (size_t i = 0; i < b.size(); ++i) {
      std::memcpy(&out[i * o.dim], &flat[b[i] * o.dim], sizeof(float) * o.dim);
    }
  }
  Report("lookup", o, lookup, ids / Seconds(start), "per_s");
  // The same batches from two threads at once, against one thread.
  start = absl::Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> mine(out.size());
      for (size_t k = t; k < batches.size(); k += 2) {
        const auto& b = batches[k];
        (void)shard.Lookup(b, true, 1, absl::MakeSpan(mine.data(), b.size() * o.dim));
      }
    });
  }
  for (auto& t : threads) t.join();
  Report("lookup_2_threads", o, ids / Seconds(start), lookup, "per_s");
  start = absl::Now();
  for (const auto& b : batches) {
    auto r = shard.Apply(b, absl::MakeConstSpan(out.data(), b.size() * o.dim), 1);
    if (!r.ok()) return r.status();
  }
  const double apply = ids / Seconds(start);
  const SparseStep step = shard.optimizer().StepAt(1);
  start = absl::Now();
  for (const auto& b : batches) {
    for (size_t i = 0; i < b.size(); ++i) {
      shard.optimizer().ApplyRow(step, o.dim, &out[i * o.dim], &flat[b[i] * o.dim], &acc[b[i]]);
    }
  }
  Report("apply", o, apply, ids / Seconds(start), "per_s");
  return absl::OkStatus();
}

// Reads `path` whole through one 1 MiB buffer, as a restore reads its blocks.
absl::Status ReadRaw(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::vector<char> buffer(1 << 20);
  while (::read(fd, buffer.data(), buffer.size()) > 0) {
  }
  ::close(fd);
  return absl::OkStatus();
}

// Each side twice, alternating, the best of each: the page cache and the
// disk's write-back favour neither.
absl::Status BenchFiles(const EmbeddingShard& shard, const Options& o) {
  const std::string path = absl::StrCat(o.dir, "/psflow-bench-embedding-", ::getpid());
  const std::string copy = path + ".baseline";
  double write_s = 1e9, base_write_s = 1e9, read_s = 1e9, base_read_s = 1e9, mb = 0;
  for (int round = 0; round < 2; ++round) {
    absl::Time start = absl::Now();
    if (auto s = WriteEmbeddingShard(shard, path); !s.ok()) return s;
    write_s = std::min(write_s, Seconds(start));
    mb = static_cast<double>(std::filesystem::file_size(path)) / 1e6;
    const std::string bytes(static_cast<size_t>(mb * 1e6), 'x');
    start = absl::Now();
    if (auto s = WriteFileAtomically(copy, bytes); !s.ok()) return s;
    base_write_s = std::min(base_write_s, Seconds(start));
  }
  for (int round = 0; round < 2; ++round) {
    absl::Time start = absl::Now();
    auto restored = RestoreEmbeddingShard(shard.spec(), 1, 0, 1, {path});
    if (!restored.ok()) return restored.status();
    read_s = std::min(read_s, Seconds(start));
    restored->reset();
    start = absl::Now();
    if (auto s = ReadRaw(copy); !s.ok()) return s;
    base_read_s = std::min(base_read_s, Seconds(start));
  }
  Report("write", o, mb / write_s, mb / base_write_s, "mb_per_s");
  Report("read", o, mb / read_s, mb / base_read_s, "mb_per_s");
  std::filesystem::remove(path);
  std::filesystem::remove(copy);
  return absl::OkStatus();
}

absl::Status Run(const Options& o) {
  EmbeddingTableSpec spec;
  spec.set_name("bench");
  spec.set_dim(o.dim);
  spec.mutable_optimizer()->set_kind(SparseOptimizerConfig::ROWWISE_ADAGRAD);
  spec.mutable_optimizer()->set_learning_rate(0.01f);
  auto shard = EmbeddingShard::Create(spec, 1, 0, 1);
  if (!shard.ok()) return shard.status();
  absl::Time start = absl::Now();
  if (auto s = Fill(**shard, o); !s.ok()) return s;
  const double fill_s = Seconds(start);
  const EmbeddingShard::Stats st = (*shard)->GetStats();
  std::printf(
      "memory rows=%lld dim=%d row_bytes=%lld bytes_per_row=%.1f total_mb=%.1f "
      "created_per_s=%.3g\n",
      static_cast<long long>(st.rows), o.dim, static_cast<long long>(st.row_bytes),
      st.bytes_per_row, st.bytes / 1e6, st.rows / fill_s);
  if (o.memory_only) return absl::OkStatus();
  if (auto s = BenchRows(**shard, o); !s.ok()) return s;
  return BenchFiles(**shard, o);
}

}  // namespace
}  // namespace psflow::ps::embedding

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv, "an embedding table shard's rates beside flat baselines.",
                           {"embedding_table.cc"});
  psflow::ps::embedding::Options o{absl::GetFlag(FLAGS_rows), absl::GetFlag(FLAGS_batches),
                                   absl::GetFlag(FLAGS_dim),  absl::GetFlag(FLAGS_batch),
                                   absl::GetFlag(FLAGS_dir),  absl::GetFlag(FLAGS_memory_only)};
  if (o.rows <= 0 || o.batches <= 0 || o.dim <= 0 || o.batch <= 0) {
    return psflow::FailWith("--rows, --batches, --dim and --batch must be positive");
  }
  absl::Status s = psflow::ps::embedding::Run(o);
  return s.ok() ? 0 : psflow::FailWith(s);
}
