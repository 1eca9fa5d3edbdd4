// A training worker: registers with the chief, takes its shard of every
// epoch, and runs synchronous steps: pull the weights of step k from every ps
// in parallel, forward and backward on its batch, push the gradients to every
// ps in parallel, and report the step's metrics to the chief (the reports are
// also its heartbeat). When the ps reach the last step it waits for the
// chief's exit order.
#ifndef PSFLOW_WORKER_WORKER_H_
#define PSFLOW_WORKER_WORKER_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "common/cluster_config.h"

namespace psflow::worker {

struct WorkerOptions {
  ClusterConfig cluster;
  std::string device = "cpu";  // kernels backend
  // How long to keep trying to reach the chief and the ps before giving up
  // with exit code 138.
  absl::Duration startup_timeout = absl::Minutes(5);
};

class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Trains until the chief says the job is over. Returns the exit code: 0
  // done, 1 a permanent error (bad device, data that does not fit the model),
  // 138 chief or ps unreachable within the startup timeout, 140 another
  // failure worth a retry, 128+n after Stop(n).
  int Run();
  // Makes Run() return 128 + signal after the call in flight. Thread-safe.
  void Stop(int signal);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_WORKER_H_
