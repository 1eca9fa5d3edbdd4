// Termination signals as events. BlockTerminationSignals() must run in main
// before any thread starts, so that SIGTERM/SIGINT reach only the watcher
// thread that WatchTerminationSignals starts; `on_signal` runs there with the
// signal number, once per signal.
#ifndef PSFLOW_COMMON_SIGNALS_H_
#define PSFLOW_COMMON_SIGNALS_H_

#include <functional>
#include <thread>

namespace psflow {

void BlockTerminationSignals();
// The thread is detached: it lives as long as the process.
void WatchTerminationSignals(std::function<void(int)> on_signal);

}  // namespace psflow

#endif  // PSFLOW_COMMON_SIGNALS_H_
