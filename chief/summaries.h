// The chief's TensorBoard event files (common/event_file.h): the numbers of
// every progress line under <model_dir>/train, and the evaluations of the
// weights under <model_dir>/eval (`tensorboard --logdir <model_dir>` shows
// both runs). Each directory gets a new file when this process first writes
// to it; earlier files (a previous chief's) are never touched.
//
// Restarts: TensorBoard drops every point read before a SessionLog START at
// the START's step or later. A job that starts or goes back to step s (s
// steps done) writes a START at s + 1 to each directory, so the points of
// steps up to s stay (they describe steps the checkpoint holds) and those
// after s, which are trained again, give way to the new ones.
//
// Errors never reach the caller and never stop training: it goes on without
// its curves. The first is logged, later ones at most once a minute; after a
// failed write the next event goes to a new file.
//
// Thread-safe. Progress calls OnRestart and OnLine under its own lock: that
// lock comes before this object's.
#ifndef PSFLOW_CHIEF_SUMMARIES_H_
#define PSFLOW_CHIEF_SUMMARIES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/progress.h"
#include "common/event_file.h"

namespace psflow::chief {

class Summaries : public ProgressListener {
 public:
  // `on_error` receives every error (default: the rate-limited log above).
  explicit Summaries(const std::string& model_dir,
                     std::function<void(const absl::Status&)> on_error = nullptr);
  ~Summaries() override;
  Summaries(const Summaries&) = delete;
  Summaries& operator=(const Summaries&) = delete;

  // Where the curves go.
  static std::string TrainDir(const std::string& model_dir) { return model_dir + "/train"; }
  static std::string EvalDir(const std::string& model_dir) { return model_dir + "/eval"; }

  // A SessionLog START at step + 1 in train/ at once, and in eval/ at once
  // if it is open, else before its first evaluation.
  void OnRestart(int64_t step) override;
  // At the line's step, in train/, then flushed: loss, accuracy,
  // examples_per_sec, learning_rate (when known), step_ms/pull,
  // step_ms/compute, step_ms/push, step_ms/wait, live_workers, live_ps (and
  // staleness/mean, staleness/max for an asynchronous job).
  void OnLine(const ProgressLine& line) override;

  // The evaluation of the weights of `step` (the steps applied to them):
  // `loss` and `accuracy` at `step` in eval/, then flushed. The directory's
  // file is opened at the first call.
  void Eval(int64_t step, double loss, double accuracy);
  void OnEval(int64_t step, double loss, double accuracy) override { Eval(step, loss, accuracy); }

 private:
  struct Run {
    std::string dir;
    std::unique_ptr<EventFileWriter> writer;  // null until used, and after a failed write
    std::optional<int64_t> pending_start;     // a START step to write before the next event
  };

  // Writes `values` at `step` to `run` (opening it if needed, a pending START
  // first) and flushes; with no values, only a pending START.
  void WriteLocked(Run& run, int64_t step, absl::Time wall_time,
                   const std::vector<std::pair<std::string, double>>& values)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReportLocked(const absl::Status& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  Run train_ ABSL_GUARDED_BY(mu_);
  Run eval_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::Status&)> on_error_;  // set once, in the constructor
  int64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t unlogged_errors_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_logged_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_SUMMARIES_H_
