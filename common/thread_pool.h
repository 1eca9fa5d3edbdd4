// A fixed pool of threads. Work is handed in as closures; ParallelFor runs a
// loop body over [0, n) on the pool and waits for all of it. Thread-safe. The
// destructor finishes queued work and joins.
#ifndef PSFLOW_COMMON_THREAD_POOL_H_
#define PSFLOW_COMMON_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace psflow {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> fn);
  // Runs body(i) for i in [0, n) on the pool and the calling thread, and
  // blocks until all returned. The caller claims indices too, so concurrent
  // callers never wait for each other's work. Must not be called from a pool
  // thread.
  void ParallelFor(int n, const std::function<void(int)>& body);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace psflow

#endif  // PSFLOW_COMMON_THREAD_POOL_H_
