#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>

namespace psflow {

ThreadPool::ThreadPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::Schedule(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(fn));
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& body) {
  if (n <= 0) return;
  if (n == 1) {
    body(0);
    return;
  }
  // Indices are claimed from a counter by the caller and by pool threads
  // alike, so a caller never waits behind work queued before its own (a busy
  // pool only means the caller does more of the loop itself). A pool task
  // that starts after every index was claimed touches only the shared state,
  // never `body`, which may be gone by then.
  struct Loop {
    explicit Loop(int count) : n(count) {}
    const int n;
    std::atomic<int> next{0};
    absl::Mutex mu;
    int finished ABSL_GUARDED_BY(mu) = 0;
  };
  auto loop = std::make_shared<Loop>(n);
  const std::function<void(int)>* fn = &body;
  auto run = [loop, fn, n] {
    for (int i = loop->next.fetch_add(1); i < n; i = loop->next.fetch_add(1)) {
      (*fn)(i);
      absl::MutexLock lock(&loop->mu);
      ++loop->finished;
    }
  };
  for (int k = 1; k < std::min<int>(n, static_cast<int>(threads_.size()) + 1); ++k) Schedule(run);
  run();
  absl::MutexLock lock(&loop->mu);
  loop->mu.Await(absl::Condition(
      +[](Loop* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu) { return l->finished == l->n; },
      loop.get()));
}

void ThreadPool::Loop() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* p)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace psflow
