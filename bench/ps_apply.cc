// psflow-bench-apply: the time one ps shard takes to apply a step — average
// the pushes of the workers and run the optimizer over every float it holds —
// with one thread and with more (Shard's apply pool). The floats are split
// into slices of at most --slice_floats, as placement spreads a model's
// variables. Prints one line per thread count:
//   apply floats=11200000 optimizer=adam workers=2 threads=2 ms=23.1 speedup=1.84
// (speedup against the first --threads entry, measured in the same run). Only
// the apply is timed: the pushes are handed in before the clock starts.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/thread_pool.h"
#include "ps/shard.h"
#include "role/command_line.h"
#include "role/process_setup.h"

ABSL_FLAG(std::string, threads, "1,2", "Comma-separated apply thread counts; 1 is the baseline.");
ABSL_FLAG(int64_t, floats, 11200000, "Floats on the shard (the resnet's 11.2M over one ps).");
ABSL_FLAG(int64_t, slice_floats, 2400000, "Most floats of one slice.");
ABSL_FLAG(std::string, optimizer, "adam", "sgd, momentum or adam.");
ABSL_FLAG(int, workers, 2, "Workers whose pushes each step averages.");
ABSL_FLAG(int, iterations, 20, "Timed applies per thread count (after 2 untimed ones).");

int main(int argc, char** argv) {
  // The same process settings as the role binaries, so that the figures compare.
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv, "milliseconds per apply of one ps shard, by apply threads.",
                           {"ps_apply.cc"});
  std::vector<int> thread_counts;
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_threads), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(t, &v) || v <= 0)
      return psflow::FailWith(absl::StrCat("bad --threads entry '", t, "'"));
    thread_counts.push_back(v);
  }
  const int64_t floats = absl::GetFlag(FLAGS_floats);
  const int64_t slice_floats = absl::GetFlag(FLAGS_slice_floats);
  const int workers = absl::GetFlag(FLAGS_workers);
  const int iterations = absl::GetFlag(FLAGS_iterations);
  if (floats <= 0 || slice_floats <= 0 || workers <= 0 || iterations <= 0)
    return psflow::FailWith(
        "--floats, --slice_floats, --workers and --iterations must be positive");
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  psflow::OptimizerConfig::Kind kind;
  if (!psflow::OptimizerConfig::Kind_Parse(absl::AsciiStrToUpper(optimizer), &kind))
    return psflow::FailWith(absl::StrCat("unknown --optimizer '", optimizer, "'"));

  psflow::InitHeader header;
  header.set_job_id(1);
  header.mutable_job()->mutable_optimizer()->set_kind(kind);
  header.mutable_job()->mutable_optimizer()->set_learning_rate(0.001f);
  // Worker `workers` never pushes: leaving it out of the live set applies the
  // step on this thread, so the apply alone is timed (no push, no check of
  // the gradients), then it is let back in.
  std::vector<int> pushing, all;
  for (int w = 0; w <= workers; ++w) {
    header.add_live_workers(w);
    all.push_back(w);
    if (w < workers) pushing.push_back(w);
  }
  std::vector<int64_t> sizes;
  for (int64_t left = floats; left > 0; left -= slice_floats)
    sizes.push_back(std::min(left, slice_floats));
  for (size_t i = 0; i < sizes.size(); ++i) {
    psflow::SliceSpec* s = header.add_slice();
    s->set_name(absl::StrCat("v", i));
    s->add_shape(sizes[i]);
    s->set_row_end(sizes[i]);
  }
  std::vector<std::vector<float>> grads;
  for (size_t i = 0; i < sizes.size(); ++i) {
    grads.emplace_back(sizes[i]);
    for (int64_t j = 0; j < sizes[i]; ++j) grads.back()[j] = 1e-3f * static_cast<float>(j % 97);
  }

  double baseline_ms = 0;
  for (int threads : thread_counts) {
    std::unique_ptr<psflow::ThreadPool> pool;
    if (threads > 1) pool = std::make_unique<psflow::ThreadPool>(threads - 1);
    psflow::ps::Shard shard(pool.get());
    std::vector<psflow::ps::Shard::SliceValues> values(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) values[i].value.assign(sizes[i], 0.5f);
    absl::Status s = shard.Init(header, std::move(values));
    if (!s.ok()) return psflow::FailWith(s);
    absl::Duration total;
    for (int it = -2; it < iterations; ++it) {
      const int64_t step = it + 2;
      for (int w : pushing) {
        auto r = shard.Push(1, w, step, grads);
        if (!r.ok()) return psflow::FailWith(r.status());
      }
      const absl::Time start = absl::Now();
      s = shard.SetLiveWorkers(1, pushing, step);
      const absl::Duration took = absl::Now() - start;
      if (s.ok()) s = shard.SetLiveWorkers(1, all, step + 1);
      if (!s.ok()) return psflow::FailWith(s);
      if (it >= 0) total += took;
    }
    if (shard.stats().version != iterations + 2) return psflow::FailWith("a step was not applied");
    const double ms = absl::ToDoubleMilliseconds(total) / iterations;
    if (threads == thread_counts.front()) baseline_ms = ms;
    std::printf("apply floats=%lld optimizer=%s workers=%d threads=%d ms=%.2f speedup=%.2f\n",
                static_cast<long long>(floats), optimizer.c_str(), workers, threads, ms,
                baseline_ms / ms);
  }
  return 0;
}
