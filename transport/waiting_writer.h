// The server side of a streaming call that waits: a reactor (gRPC's
// ServerWriteReactor, or a same-host channel's) that writes chunked messages
// as what it waits for becomes ready, holding no thread while it waits.
//
// A WaitingWriter streams from one thread at a time: every event (a write
// done, a cancel, a wake) takes its lock and calls Advance, which writes the
// next message, finishes, or waits. Waiting costs no thread: the host's
// waiter (added once per call) and a grpc::Alarm at the deadline each
// schedule a Poke on the host's wake pool, which advances the call again.
// The waiter only schedules when the call armed it (just before it looked at
// the host's state), so a call is poked at most once per wait. OnDone, the
// last event the base sends, unhooks the Waker before the writer is deleted;
// a Poke that comes later finds no writer.
//
// The ps's Pull and Snapshot calls (ps/service.cc) are its subclasses; the
// host is the PsService, whose shard wakes them.
#ifndef PSFLOW_TRANSPORT_WAITING_WRITER_H_
#define PSFLOW_TRANSPORT_WAITING_WRITER_H_

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include <grpcpp/alarm.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deferred_work.h"
#include "common/thread_pool.h"
#include "transport/grpc_util.h"

namespace psflow {

// What the waiting calls of one server share. Implementations are
// thread-safe.
class WaitingCallHost {
 public:
  virtual ~WaitingCallHost() = default;
  // Counts a stream of `peer` in, or refuses it (RESOURCE_EXHAUSTED) over a
  // bound; every admitted stream is let out once.
  virtual absl::Status Admit(const std::string& peer) = 0;
  virtual void LetOut(const std::string& peer) = 0;
  // Calls `wake(slice)` on every change a waiting call may wait for (the
  // apply of slice `slice`, or -1: another change), under the host's lock,
  // until RemoveWaiter(id).
  virtual int64_t AddWaiter(std::function<void(int slice)> wake) = 0;
  virtual void RemoveWaiter(int64_t id) = 0;
  // Where pokes run; and whether the calls that one change wakes are spread
  // over it (Waker::Schedule).
  virtual ThreadPool* wake_pool() = 0;
  virtual bool spread_wakes() const = 0;
};

class Waker {
 public:
  // `spread`: see Schedule.
  Waker(ThreadPool* pool, bool spread) : pool_(pool), spread_(spread) {}
  // Arms the next wake (before looking at what it waits for): by any change
  // of the shard, or with `first` >= 0 only by the apply of a slice from
  // `first` to `last` or a change that is not a slice's apply.
  void Arm(int first = -1, int last = -1) {
    first_.store(first, std::memory_order_relaxed);
    last_.store(std::max(first, last), std::memory_order_relaxed);
    armed_.store(true, std::memory_order_release);
  }
  void Disarm() { armed_.store(false, std::memory_order_release); }
  // From the shard's waiter, under its lock (so after the Arm that came
  // before the call looked at the shard): schedules a poke if armed for
  // `slice` (the slice applied, or -1: any change).
  void Wake(std::shared_ptr<Waker> self, int slice) {
    if (!armed_.load(std::memory_order_acquire)) return;
    const int first = first_.load(std::memory_order_relaxed);
    if (slice >= 0 && first >= 0 &&
        (slice < first || slice > last_.load(std::memory_order_relaxed))) {
      return;
    }
    if (armed_.exchange(false, std::memory_order_acq_rel)) Schedule(std::move(self));
  }
  // Schedules a poke whatever the arming (an alarm): on the thread's
  // DeferredWork scope if it has one open (a shard's applier, a push that
  // completed a slice), which runs it once it lets go of the shard's lock,
  // else on the pool. With `spread_`, the scope keeps only the first work
  // it is given and later pokes go to the pool: the calls that one apply
  // wakes (every worker's pull of the slice) are answered in parallel, not
  // one after the other on the applying thread.
  void Schedule(std::shared_ptr<Waker> self) {
    std::function<void()> poke = [self = std::move(self)] { self->Poke(); };
    const bool deferred = spread_ ? DeferredWork::DeferFirst(poke) : DeferredWork::Defer(poke);
    if (!deferred) pool_->Schedule(std::move(poke));
  }
  void Attach(std::function<void()> advance) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    advance_ = std::move(advance);
  }
  void Detach() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    advance_ = nullptr;
  }

 private:
  void Poke() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (advance_) advance_();
  }

  ThreadPool* const pool_;
  const bool spread_;
  std::atomic<bool> armed_{false};
  // The slices whose applies the armed wake waits for; -1: any change.
  std::atomic<int> first_{-1}, last_{-1};
  absl::Mutex mu_;
  std::function<void()> advance_ ABSL_GUARDED_BY(mu_);  // null once the call is done
};

template <typename Response, typename Base>
class WaitingWriter : public Base {
 public:
  // `host` (not owned) outlives the call; `base_args` go to the base: none
  // for gRPC's, the host for a channel's.
  template <typename... BaseArgs>
  WaitingWriter(WaitingCallHost* host, std::string peer, absl::Time deadline, BaseArgs... base_args)
      : Base(base_args...),
        host_(host),
        peer_(std::move(peer)),
        call_deadline_(deadline),
        waker_(std::make_shared<Waker>(host->wake_pool(), host->spread_wakes())) {}

 protected:
  // Admits the call and hooks it to the shard, then advances it; or
  // finishes it with the refusal.
  void Start(const absl::Status& refused) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::Status admitted = refused;
    if (admitted.ok()) admitted = host_->Admit(peer_);
    if (admitted.ok()) {
      admitted_ = true;
      // Lock order: the waker's lock, then the writer's (a poke advances
      // the call), then the host's state (a ps: its shard's).
      waker_->Attach([this] {
        absl::MutexLock lock(&mu_);
        AdvanceLocked();
      });
      std::weak_ptr<Waker> weak = waker_;
      waiter_ = host_->AddWaiter([weak](int slice) {
        if (std::shared_ptr<Waker> w = weak.lock()) w->Wake(w, slice);
      });
    }
    absl::MutexLock lock(&mu_);
    if (!admitted.ok()) {
      FinishLocked(admitted);
      return;
    }
    AdvanceLocked();
  }

  // The next message, a finish, or a wait; called under mu_ with no write in
  // flight and the call not finished.
  virtual void Next() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

  // For Next: look at the host's state after this (a change after it wakes
  // the call).
  void Arm(int first = -1, int last = -1) { waker_->Arm(first, last); }
  void Disarm() { waker_->Disarm(); }
  // For Next: wait until woken, or until `deadline`, when Next runs again.
  void WaitUntil(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (alarm_ != nullptr && alarm_deadline_ == deadline) return;
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_deadline_ = deadline;
    std::weak_ptr<Waker> weak = waker_;
    alarm_->Set(absl::ToChronoTime(deadline), [weak](bool fired) {
      if (!fired) return;  // cancelled
      if (std::shared_ptr<Waker> w = weak.lock()) w->Schedule(w);
    });
  }
  // For Next: writes response_ (Next runs again once it is written).
  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    this->StartWrite(&response_);
  }
  void FinishLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Disarm();
    Finishing(status);
    this->Finish(ToGrpcStatus(status));
  }
  // What a subclass records of the call's end (once, just before Finish).
  virtual void Finishing(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {}

  WaitingCallHost* const host_;
  const std::string peer_;
  const absl::Time call_deadline_;
  absl::Mutex mu_;
  Response response_ ABSL_GUARDED_BY(mu_);
  bool finish_after_write_ ABSL_GUARDED_BY(mu_) = false;

 private:
  void AdvanceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (cancelled_) {
      FinishLocked(absl::CancelledError("client went away"));
      return;
    }
    if (finish_after_write_) {
      FinishLocked(absl::OkStatus());
      return;
    }
    Next();
  }
  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) cancelled_ = true;
    AdvanceLocked();
  }
  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    AdvanceLocked();
  }
  void OnDone() override {
    waker_->Detach();  // waits for a poke in progress; later ones find nothing
    if (waiter_ >= 0) host_->RemoveWaiter(waiter_);
    if (admitted_) host_->LetOut(peer_);
    Done();
    delete this;
  }
  // Last words of a subclass (release what it holds), without the lock.
  virtual void Done() {}

  std::shared_ptr<Waker> waker_;
  int64_t waiter_ = -1;
  bool admitted_ = false;
  std::unique_ptr<grpc::Alarm> alarm_ ABSL_GUARDED_BY(mu_);
  absl::Time alarm_deadline_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_WAITING_WRITER_H_
