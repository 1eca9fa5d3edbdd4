#include "chief/summaries.h"

#include "absl/time/clock.h"
#include "common/log.h"

namespace psflow::chief {
namespace {

constexpr absl::Duration kLogEvery = absl::Minutes(1);

}  // namespace

Summaries::Summaries(const std::string& model_dir,
                     std::function<void(const absl::Status&)> on_error)
    : on_error_(std::move(on_error)) {
  absl::MutexLock lock(&mu_);
  train_.dir = TrainDir(model_dir);
  eval_.dir = EvalDir(model_dir);
}

Summaries::~Summaries() = default;

void Summaries::OnRestart(int64_t step) {
  absl::MutexLock lock(&mu_);
  train_.pending_start = step + 1;
  eval_.pending_start = step + 1;
  WriteLocked(train_, step, absl::Now(), {});
  if (eval_.writer != nullptr) WriteLocked(eval_, step, absl::Now(), {});
}

void Summaries::OnLine(const ProgressLine& line) {
  std::vector<std::pair<std::string, double>> values = {
      {"loss", line.loss},
      {"accuracy", line.accuracy},
      {"examples_per_sec", line.examples_per_sec},
  };
  if (line.learning_rate) values.emplace_back("learning_rate", *line.learning_rate);
  values.insert(values.end(), {
                                  {"step_ms/pull", line.pull_ms},
                                  {"step_ms/compute", line.compute_ms},
                                  {"step_ms/push", line.push_ms},
                                  {"step_ms/wait", line.wait_ms},
                                  {"live_workers", line.live_workers},
                                  {"live_ps", line.live_ps},
                              });
  if (line.staleness_mean) {  // --mode=async or ssp
    values.emplace_back("staleness/mean", *line.staleness_mean);
    values.emplace_back("staleness/max", static_cast<double>(line.staleness_max));
  }
  absl::MutexLock lock(&mu_);
  WriteLocked(train_, line.step, line.time, values);
}

void Summaries::Eval(int64_t step, double loss, double accuracy) {
  absl::MutexLock lock(&mu_);
  WriteLocked(eval_, step, absl::Now(), {{"loss", loss}, {"accuracy", accuracy}});
}

void Summaries::WriteLocked(Run& run, int64_t step, absl::Time wall_time,
                            const std::vector<std::pair<std::string, double>>& values) {
  if (run.writer == nullptr) {
    absl::StatusOr<std::unique_ptr<EventFileWriter>> opened =
        EventFileWriter::Open(run.dir, absl::Now());
    if (!opened.ok()) {
      ReportLocked(opened.status());
      return;
    }
    run.writer = *std::move(opened);
  }
  std::optional<int64_t> start;
  std::swap(start, run.pending_start);
  if (start) run.writer->WriteSessionStart(*start, wall_time);
  if (!values.empty()) run.writer->WriteScalars(step, wall_time, values);
  absl::Status s = run.writer->Flush();
  if (s.ok()) return;
  ReportLocked(s);
  // The file may end in a partial record: the next event goes to a new one,
  // after the START if this one was lost.
  run.writer.reset();
  if (!run.pending_start) run.pending_start = start;
}

void Summaries::ReportLocked(const absl::Status& error) {
  ++errors_;
  if (on_error_) {
    on_error_(error);
    return;
  }
  const absl::Time now = absl::Now();
  if (now - last_logged_ < kLogEvery) {
    ++unlogged_errors_;
    return;
  }
  if (errors_ == 1) {
    PSLOG(WARNING) << "cannot write TensorBoard event files: " << error.message()
                   << " (training goes on; further errors are logged at most once a minute)";
  } else {
    PSLOG(WARNING) << "cannot write TensorBoard event files: " << error.message() << " ("
                   << unlogged_errors_ << " more errors since the last message)";
  }
  unlogged_errors_ = 0;
  last_logged_ = now;
}

}  // namespace psflow::chief
