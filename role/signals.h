// Termination signals as events. BlockTerminationSignals() must run in main
// before any thread starts, so that SIGTERM and SIGINT reach only the thread
// of a TerminationWatcher, which runs `on_signal` with the signal number once
// per signal.
#ifndef PSFLOW_ROLE_SIGNALS_H_
#define PSFLOW_ROLE_SIGNALS_H_

#include <atomic>
#include <functional>
#include <thread>

namespace psflow {

// Blocks SIGTERM, SIGINT (and SIGUSR2, used to stop a watcher) in the calling
// thread and in every thread it starts afterwards.
void BlockTerminationSignals();

class TerminationWatcher {
 public:
  explicit TerminationWatcher(std::function<void(int)> on_signal);
  // Returns once on_signal has returned (if it was running) and can no
  // longer be called: declare the watcher after everything on_signal uses.
  ~TerminationWatcher();
  TerminationWatcher(const TerminationWatcher&) = delete;
  TerminationWatcher& operator=(const TerminationWatcher&) = delete;

 private:
  std::function<void(int)> on_signal_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace psflow

#endif  // PSFLOW_ROLE_SIGNALS_H_
