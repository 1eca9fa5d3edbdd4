// Streams held open on a ps as a flood would hold them, for tests: Push or
// Init streams that send nothing, and pulls of a version that never comes.
// Each call's end is counted by its status code. The calls still open are
// cancelled (and waited for) when the flood is destroyed.
#ifndef PSFLOW_TESTS_PS_STREAM_FLOOD_H_
#define PSFLOW_TESTS_PS_STREAM_FLOOD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/ps.grpc.pb.h"

namespace psflow::testing_flood {

class StreamFlood {
 public:
  // On `channel`'s connection (MakeChannel with own_connection: one peer).
  explicit StreamFlood(std::shared_ptr<grpc::Channel> channel)
      : stub_(ParameterServer::NewStub(std::move(channel))) {}
  ~StreamFlood() {
    for (auto& call : calls_) call->context.TryCancel();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](StreamFlood* f) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return f->ended_count_ == static_cast<int>(f->calls_.size());
        },
        this));
  }

  void SilentPushes(int n) {
    for (int i = 0; i < n; ++i) {
      calls_.push_back(std::make_unique<Silent<PushRequest, PushResponse>>(
          this, [this](grpc::ClientContext* c, PushResponse* r,
                       grpc::ClientWriteReactor<PushRequest>* reactor) {
            stub_->async()->Push(c, r, reactor);
          }));
    }
  }
  void SilentInits(int n) {
    for (int i = 0; i < n; ++i) {
      calls_.push_back(std::make_unique<Silent<InitRequest, InitResponse>>(
          this, [this](grpc::ClientContext* c, InitResponse* r,
                       grpc::ClientWriteReactor<InitRequest>* reactor) {
            stub_->async()->Init(c, r, reactor);
          }));
    }
  }
  void WaitingPulls(int n, uint64_t job_id) {
    PullRequest request;
    request.set_job_id(job_id);
    request.set_min_version(int64_t{1} << 40);
    for (int i = 0; i < n; ++i) calls_.push_back(std::make_unique<Waiting>(this, request));
  }

  // The calls that ended, by code.
  std::map<grpc::StatusCode, int> ended() const {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  // The message of the first call that ended with each code.
  std::map<grpc::StatusCode, std::string> messages() const {
    absl::MutexLock lock(&mu_);
    return messages_;
  }
  // Waits until `n` calls in all have ended, or `timeout` passed: whether
  // they did.
  bool WaitEnded(int n, absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    std::pair<const StreamFlood*, int> args(this, n);
    return mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<const StreamFlood*, int>* a)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->first->ended_count_ >= a->second; },
            &args),
        timeout);
  }

 private:
  struct Call {
    // Each waits for its connection, as an attacker that tries again would.
    Call() { context.set_wait_for_ready(true); }
    virtual ~Call() = default;
    grpc::ClientContext context;
  };
  // A client stream that writes nothing, not even its end.
  template <typename Request, typename Response>
  struct Silent final : Call, grpc::ClientWriteReactor<Request> {
    template <typename Start>
    Silent(StreamFlood* f, const Start& start) : flood(f) {
      start(&this->context, &response, this);
      this->StartCall();
    }
    void OnDone(const grpc::Status& s) override { flood->Ended(s); }
    StreamFlood* const flood;
    Response response;
  };
  struct Waiting final : Call, grpc::ClientReadReactor<PullResponse> {
    Waiting(StreamFlood* f, const PullRequest& r) : flood(f), request(r) {
      f->stub_->async()->Pull(&context, &request, this);
      StartRead(&response);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (ok) StartRead(&response);
    }
    void OnDone(const grpc::Status& s) override { flood->Ended(s); }
    StreamFlood* const flood;
    PullRequest request;
    PullResponse response;
  };

  void Ended(const grpc::Status& s) {
    absl::MutexLock lock(&mu_);
    if (++ended_[s.error_code()] == 1) messages_[s.error_code()] = s.error_message();
    ++ended_count_;
  }

  std::unique_ptr<ParameterServer::Stub> stub_;
  std::vector<std::unique_ptr<Call>> calls_;  // added by the test's thread only
  mutable absl::Mutex mu_;
  std::map<grpc::StatusCode, int> ended_ ABSL_GUARDED_BY(mu_);
  std::map<grpc::StatusCode, std::string> messages_ ABSL_GUARDED_BY(mu_);  // the first, by code
  int ended_count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace psflow::testing_flood

#endif  // PSFLOW_TESTS_PS_STREAM_FLOOD_H_
