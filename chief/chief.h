// The chief: owns the job config, places the variables, loads every ps,
// hands the job to workers when they register, logs progress from their
// reports, and at the last step writes the saved model and tells ps and
// workers to exit.
#ifndef PSFLOW_CHIEF_CHIEF_H_
#define PSFLOW_CHIEF_CHIEF_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"
#include "common/exit_codes.h"
#include "proto/job.pb.h"

namespace psflow::chief {

inline constexpr char kDefaultDataDir[] = "/usr/share/datasets/fashion-mnist";

// Every setting of a job; defaults are the flags' defaults.
struct ChiefOptions {
  ClusterConfig cluster;
  std::string model = "cnn";             // built-in name or spec file
  std::string data_dir = kDefaultDataDir;
  std::string dataset = "idx";           // idx (files in data_dir) or synthetic
  int64_t synthetic_examples = 10000;    // training examples of the synthetic dataset
  int batch_size = 64;                   // per worker
  int64_t epochs = 0;                    // 0: not given
  int64_t train_steps = 0;               // 0: not given; exactly one of the two, else 1 epoch
  std::string optimizer = "sgd";         // sgd, momentum, adam
  float learning_rate = 0.01f;
  float momentum = 0.9f;
  uint64_t seed = 1;
  std::string model_dir;                 // required
  std::string saved_model_dir;           // default <model_dir>/saved_model
  int log_every_steps = 100;
  int compute_threads = 0;               // per worker; 0 = library default
  absl::Duration startup_timeout = absl::Minutes(5);
  // Checkpoints: every this many steps and/or seconds (0 = not by that
  // measure), keeping the newest keep_checkpoints.
  int64_t checkpoint_every_steps = 0;
  absl::Duration checkpoint_every = absl::Minutes(10);
  int keep_checkpoints = 5;
  // A worker without a report (heartbeat) for this long is dropped from the
  // synchronous steps until it registers again.
  absl::Duration worker_timeout = absl::Seconds(30);
  // What a step with a non-finite loss or gradients does: "fail" stops the
  // job with exit code 1, keeping the checkpoints taken before it.
  std::string on_nonfinite = "fail";
};

// Turns options into the job config: resolves the model, reads the training
// data's size and pixel statistics (the model's inputs are standardized with
// them), derives steps per epoch and total steps, places the variables.
// INVALID_ARGUMENT with one line for any bad setting.
absl::StatusOr<JobConfig> BuildJobConfig(const ChiefOptions& options);

class Chief {
 public:
  explicit Chief(ChiefOptions options);
  ~Chief();
  Chief(const Chief&) = delete;
  Chief& operator=(const Chief&) = delete;

  // Runs the job to the end and returns the process exit code (common/exit_codes.h),
  // or 128 + n after Stop(n).
  int Run();
  // Makes Run() stop waiting and return 128 + signal. Thread-safe; meant for
  // the signal watcher.
  void Stop(int signal);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_CHIEF_H_
