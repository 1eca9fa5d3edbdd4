// A deadline for the first valid message of a stream: a stream that has not
// shown one within its server's StreamLimits::first_message_timeout is
// cancelled, so that silent streams cannot hold the stream budget. No thread
// waits for it: a grpc::Alarm runs `expire` once the time is up, unless
// Validated() came first. Thread-safe.
//
// Destroying the timer cancels the alarm, but an alarm that went off just
// before may still be running `expire`: it must hold what it needs (shared
// state), never the timer's owner itself.
#ifndef PSFLOW_TRANSPORT_FIRST_MESSAGE_TIMER_H_
#define PSFLOW_TRANSPORT_FIRST_MESSAGE_TIMER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <utility>

#include <grpcpp/alarm.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace psflow {

class FirstMessageTimer {
 public:
  // `timeout` zero (or less): never expires.
  FirstMessageTimer(absl::Duration timeout, std::function<void()> expire)
      : state_(std::make_shared<State>()) {
    if (timeout <= absl::ZeroDuration()) {
      state_->phase = kValidated;
      return;
    }
    state_->expire = std::move(expire);
    alarm_.Set(absl::ToChronoTime(absl::Now() + timeout), [state = state_](bool fired) {
      int pending = kPending;
      if (fired && state->phase.compare_exchange_strong(pending, kExpired)) state->expire();
    });
  }
  ~FirstMessageTimer() {
    int pending = kPending;
    state_->phase.compare_exchange_strong(pending, kValidated);
  }
  FirstMessageTimer(const FirstMessageTimer&) = delete;
  FirstMessageTimer& operator=(const FirstMessageTimer&) = delete;

  // The stream showed a valid first message: true if in time, false if it
  // expired already (`expire` ran, or runs now).
  bool Validated() {
    int pending = kPending;
    return state_->phase.compare_exchange_strong(pending, kValidated) || pending == kValidated;
  }

 private:
  enum Phase { kPending, kValidated, kExpired };
  struct State {
    std::atomic<int> phase{kPending};
    std::function<void()> expire;
  };
  const std::shared_ptr<State> state_;
  grpc::Alarm alarm_;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_FIRST_MESSAGE_TIMER_H_
