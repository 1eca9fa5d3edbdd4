// Work a thread holds back while it holds a lock, then runs itself once it
// has let go. A wake-up found under a lock (a waiting call whose data just
// became ready) would otherwise go to another thread: a hand-off that costs a
// thread switch and its latency on the path of a step.
//
//   {
//     DeferredWork scope;            // opened where no lock is held
//     absl::MutexLock lock(&mu);
//     ...                            // DeferredWork::Defer(fn) keeps fn
//   }                                // lock let go, then fn runs here
//
// Scopes nest: the outermost one runs the work of all. Without a scope on
// the thread, Defer refuses and the caller hands the work elsewhere.
#ifndef PSFLOW_COMMON_DEFERRED_WORK_H_
#define PSFLOW_COMMON_DEFERRED_WORK_H_

#include <functional>
#include <vector>

namespace psflow {

class DeferredWork {
 public:
  DeferredWork();
  // Runs what was deferred in the scope, in order, if it is the outermost
  // (work deferred by that work runs too).
  ~DeferredWork();
  DeferredWork(const DeferredWork&) = delete;
  DeferredWork& operator=(const DeferredWork&) = delete;

  // Keeps `fn` (moved from) for the scope open on this thread; false, with
  // `fn` untouched, when none is.
  static bool Defer(std::function<void()>& fn);
  // As Defer, but keeps `fn` only where the open scope holds no work yet:
  // the thread then does one piece of such work, and the caller hands the
  // rest elsewhere, to run in parallel.
  static bool DeferFirst(std::function<void()>& fn);

 private:
  const bool outermost_;  // the scope that runs the work
  std::vector<std::function<void()>> work_;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_DEFERRED_WORK_H_
