#include "tests/fakes/fake_chief.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace psflow::fakes {

FakeChief::FakeChief(RegisterWorkerResponse registration)
    : registration_(std::move(registration)) {}

void FakeChief::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
}

absl::Status FakeChief::InjectedLocked() {
  if (cancelled_) return absl::CancelledError("call cancelled");
  if (fail_count_ == 0) return absl::OkStatus();
  if (fail_count_ > 0) --fail_count_;
  return absl::Status(fail_code_, "injected failure of the chief");
}

absl::StatusOr<RegisterWorkerResponse> FakeChief::RegisterWorker(int worker, absl::Time deadline) {
  std::shared_ptr<const std::function<void(int)>> hook;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = InjectedLocked(); !s.ok()) return s;
    hook = on_register_;
  }
  if (hook != nullptr) (*hook)(worker);
  absl::MutexLock lock(&mu_);
  ++registrations_;
  to_register_.erase(worker);
  return registration_;
}

absl::StatusOr<ReportResponse> FakeChief::Report(const ReportRequest& request,
                                                 absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = InjectedLocked(); !s.ok()) return s;
  reports_.push_back(request);
  for (const StepMetrics& m : request.metrics()) {
    metrics_.push_back(m);
    if (m.nonfinite() && fail_on_nonfinite_) failed_ = true;
  }
  ReportResponse response;
  if (action_count_ != 0) {
    if (action_count_ > 0) --action_count_;
    response.set_action(action_);
  } else if (failed_) {
    response.set_action(ReportResponse::FAIL);
  } else if (to_register_.contains(request.worker())) {
    response.set_action(ReportResponse::REGISTER);
  } else if (request.finished() && exit_when_finished_) {
    response.set_action(ReportResponse::EXIT);
  }
  if (response.action() == ReportResponse::REGISTER) to_register_.insert(request.worker());
  return response;
}

void FakeChief::SetRegistration(RegisterWorkerResponse registration) {
  absl::MutexLock lock(&mu_);
  registration_ = std::move(registration);
}

void FakeChief::OnRegister(std::function<void(int worker)> hook) {
  absl::MutexLock lock(&mu_);
  on_register_ = hook ? std::make_shared<const std::function<void(int)>>(std::move(hook)) : nullptr;
}

void FakeChief::SetAction(ReportResponse::Action action, int count) {
  absl::MutexLock lock(&mu_);
  action_ = action;
  action_count_ = count;
}

void FakeChief::ExitWhenFinished(bool exit) {
  absl::MutexLock lock(&mu_);
  exit_when_finished_ = exit;
}

void FakeChief::FailOnNonFinite(bool fail) {
  absl::MutexLock lock(&mu_);
  fail_on_nonfinite_ = fail;
}

void FakeChief::FailCalls(absl::StatusCode code, int count) {
  absl::MutexLock lock(&mu_);
  fail_code_ = code;
  fail_count_ = count;
}

int FakeChief::registrations() const {
  absl::MutexLock lock(&mu_);
  return registrations_;
}

std::vector<ReportRequest> FakeChief::reports() const {
  absl::MutexLock lock(&mu_);
  return reports_;
}

std::vector<StepMetrics> FakeChief::metrics() const {
  absl::MutexLock lock(&mu_);
  return metrics_;
}

bool FakeChief::AwaitMetrics(const std::function<bool(const std::vector<StepMetrics>&)>& pred,
                             absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto holds = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(metrics_); };
  return mu_.AwaitWithTimeout(absl::Condition(&holds), timeout);
}

}  // namespace psflow::fakes
