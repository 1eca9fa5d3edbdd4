// A timeline of chosen steps of one process (--trace_dir, --trace_steps of
// psflow-worker and psflow-ps): spans of what each thread did in those
// steps (a worker's step, input, compute, each lane's pushes and pulls, its
// runs' waits and checks, its ps client's copies, writes and reads; a ps's
// push messages, slice applies and pull answers), written as one JSON file
// per process in the trace event format,
// which Perfetto and chrome://tracing open (scripts/trace-summary.py merges
// the files of a job and prints one step's events in order). Timestamps are
// the host's steady clock, so the processes of one host line up; across
// hosts they do not.
//
// Spans of steps outside the range cost one comparison. Thread-safe.
#ifndef PSFLOW_COMMON_STEP_TRACE_H_
#define PSFLOW_COMMON_STEP_TRACE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "proto/trace.pb.h"

namespace psflow {

// The help of the flags that turn a trace on, the same for every role.
inline constexpr char kTraceDirHelp[] =
    "Write a timeline of the steps --trace_steps names to DIR/<role><index>.json (made where "
    "missing): what each thread of this process did in those steps, in the trace event format "
    "that Perfetto (ui.perfetto.dev) and chrome://tracing open; scripts/trace-summary.py merges "
    "the files of a job and lists one step. Written once the steps are over (or at exit, for a "
    "process that stops first). Empty: no trace.";
inline constexpr char kTraceStepsHelp[] =
    "With --trace_dir: the steps to trace, FIRST:LAST (both included) or one step. A ps counts "
    "a step by the pushes of it, their applies and the pulls of the weights they made.";

class StepTrace {
 public:
  // By default at most this many spans are kept; later ones are counted
  // and dropped.
  static constexpr int64_t kMaxSpans = 1 << 18;

  // "FIRST:LAST" (both included) or "STEP"; 0 <= FIRST <= LAST.
  // INVALID_ARGUMENT naming the text otherwise.
  static absl::Status ParseSteps(absl::string_view text, int64_t* first, int64_t* last);

  // A trace of steps `first` to `last` that `process` ("worker 0", "ps 1";
  // also the events' category's first word) writes to `dir`/`file_name`.
  // Makes `dir` where it is missing and checks that a file can be written
  // there: an error now rather than a lost trace at the end.
  static absl::StatusOr<std::unique_ptr<StepTrace>> Create(const std::string& dir,
                                                           const std::string& file_name,
                                                           std::string process, int64_t first,
                                                           int64_t last,
                                                           int64_t max_spans = kMaxSpans);
  // The trace of a role's process from its flags: null where `dir` is
  // empty; otherwise `role``index`.json in `dir`, named "`role` `index`".
  // INVALID_ARGUMENT for malformed `steps`.
  static absl::StatusOr<std::unique_ptr<StepTrace>> FromFlags(const std::string& dir,
                                                              absl::string_view steps,
                                                              absl::string_view role, int index);

  // Writes the file if Reached did not (a process that stops early keeps
  // what it traced).
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  bool Wants(int64_t step) const { return step >= first_ && step <= last_; }
  const std::string& path() const { return path_; }

  // Microseconds on the steady clock: the spans' time base.
  static int64_t NowMicros();

  // A span of the calling thread, kept where Wants(step): `args` are its
  // details (the step is added as "step").
  void Record(absl::string_view name, int64_t step, int64_t start_us, int64_t end_us,
              std::vector<std::pair<std::string, std::string>> args = {}) ABSL_LOCKS_EXCLUDED(mu_);

  // The process has begun `step` (a worker its step, a ps a push of it):
  // once that is past the range by two (the range's last events are over),
  // the file is written, once.
  void Reached(int64_t step) ABSL_LOCKS_EXCLUDED(mu_);

  // Writes every span kept so far (replacing the file, atomically).
  absl::Status Write() ABSL_LOCKS_EXCLUDED(mu_);

  // Spans kept and dropped (over the bound) so far.
  int64_t spans() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t dropped() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  StepTrace(std::string path, std::string process, int64_t first, int64_t last, int64_t max_spans);

  const std::string path_;
  const std::string process_;
  const std::string category_;
  const int64_t first_, last_;
  const int64_t max_spans_;
  const int32_t pid_;
  mutable absl::Mutex mu_;
  TraceFile file_ ABSL_GUARDED_BY(mu_);
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  bool written_ ABSL_GUARDED_BY(mu_) = false;  // by Reached or the destructor
};

// A span from its construction to its destruction, recorded into `trace`
// (may be null: nothing) where it wants `step`.
class TraceSpan {
 public:
  TraceSpan(StepTrace* trace, const char* name, int64_t step)
      : trace_(trace != nullptr && trace->Wants(step) ? trace : nullptr),
        name_(name),
        step_(step),
        start_(trace_ != nullptr ? StepTrace::NowMicros() : 0) {}
  ~TraceSpan() { End(); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  bool active() const { return trace_ != nullptr; }
  // A detail of the span: `parts` joined by absl::StrCat, only where the
  // span is active (a span of a step outside the range formats nothing).
  template <typename... Parts>
  void Arg(const char* key, const Parts&... parts) {
    if (trace_ != nullptr) args_.emplace_back(key, absl::StrCat(parts...));
  }
  // Records the span now rather than at destruction (once).
  void End() {
    if (trace_ == nullptr) return;
    trace_->Record(name_, step_, start_, StepTrace::NowMicros(), std::move(args_));
    trace_ = nullptr;
  }

 private:
  StepTrace* trace_;
  const char* const name_;
  const int64_t step_;
  const int64_t start_;
  std::vector<std::pair<std::string, std::string>> args_;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_STEP_TRACE_H_
