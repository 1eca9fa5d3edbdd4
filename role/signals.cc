#include "role/signals.h"

#include <pthread.h>
#include <signal.h>

namespace psflow {
namespace {

sigset_t WatchedSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR2);
  return set;
}

}  // namespace

void BlockTerminationSignals() {
  sigset_t set = WatchedSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

TerminationWatcher::TerminationWatcher(std::function<void(int)> on_signal)
    : on_signal_(std::move(on_signal)) {
  thread_ = std::thread([this] {
    sigset_t set = WatchedSet();
    while (true) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      if (stopping_.load()) return;
      if (sig != SIGUSR2) on_signal_(sig);
    }
  });
}

TerminationWatcher::~TerminationWatcher() {
  stopping_.store(true);
  pthread_kill(thread_.native_handle(), SIGUSR2);
  thread_.join();
}

}  // namespace psflow
