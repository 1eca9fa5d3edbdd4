// A chief behind the chief::Client interface, for testing a worker's logic
// without processes or gRPC. Registration hands out a given
// RegisterWorkerResponse (job id, job config, ps addresses, start step);
// reports are recorded and answered as a test says: by default CONTINUE, EXIT
// to a report marked finished, and FAIL from the first report that holds a
// non-finite step on (as the real chief with --on_nonfinite=fail). As the
// real chief, once it answered a worker REGISTER it answers that worker's
// reports REGISTER until it registers again. Calls may be made to fail with a
// status code.
//
// Thread-safe. Hooks run on the caller's thread without the fake's lock held,
// so they may call any method of the fake other than the chief::Client ones.
#ifndef PSFLOW_TESTS_FAKES_FAKE_CHIEF_H_
#define PSFLOW_TESTS_FAKES_FAKE_CHIEF_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/client.h"

namespace psflow::fakes {

class FakeChief final : public chief::Client {
 public:
  explicit FakeChief(RegisterWorkerResponse registration);

  // chief::Client.
  absl::StatusOr<RegisterWorkerResponse> RegisterWorker(int worker, absl::Time deadline) override;
  absl::StatusOr<ReportResponse> Report(const ReportRequest& request, absl::Time deadline) override;
  // Every later call fails with CANCELLED, as a transport's would.
  void CancelAll() override;

  // What later registrations get.
  void SetRegistration(RegisterWorkerResponse registration);
  // Runs `hook(worker)` before each registration is answered (after any
  // injected failure): the test's stand-in for the chief loading the ps
  // before it lets a worker in. May change the registration.
  void OnRegister(std::function<void(int worker)> hook);
  // Answers the next `count` reports (count < 0: every later report) with
  // `action` instead of the default.
  void SetAction(ReportResponse::Action action, int count = -1);
  // Whether a report marked finished gets EXIT by default (true at first).
  void ExitWhenFinished(bool exit);
  // Whether a report holding a non-finite step fails the job: FAIL to it and
  // to every later report (true at first).
  void FailOnNonFinite(bool fail);
  // The next `count` calls (either method; count < 0: every later call)
  // fail with `code`; count 0 ends an earlier FailCalls.
  void FailCalls(absl::StatusCode code, int count);

  // Observation.
  int registrations() const;                   // answered successfully
  std::vector<ReportRequest> reports() const;  // received, in order (failed calls excluded)
  std::vector<StepMetrics> metrics() const;    // of every recorded report, in order
  // Waits until `pred(metrics())` holds or `timeout` passes; returns whether
  // it held.
  bool AwaitMetrics(const std::function<bool(const std::vector<StepMetrics>&)>& pred,
                    absl::Duration timeout) const;

 private:
  // Whether this call fails by injection (and with what).
  absl::Status InjectedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  RegisterWorkerResponse registration_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const std::function<void(int)>> on_register_ ABSL_GUARDED_BY(mu_);
  ReportResponse::Action action_ ABSL_GUARDED_BY(mu_) = ReportResponse::CONTINUE;
  int action_count_ ABSL_GUARDED_BY(mu_) = 0;  // reports left to answer with action_ (< 0: all)
  bool exit_when_finished_ ABSL_GUARDED_BY(mu_) = true;
  bool fail_on_nonfinite_ ABSL_GUARDED_BY(mu_) = true;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // a non-finite step failed the job
  absl::flat_hash_set<int> to_register_
      ABSL_GUARDED_BY(mu_);  // answered REGISTER since they registered
  absl::StatusCode fail_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  int fail_count_ ABSL_GUARDED_BY(mu_) = 0;  // calls left to fail (< 0: all)
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<ReportRequest> reports_ ABSL_GUARDED_BY(mu_);
  std::vector<StepMetrics> metrics_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow::fakes

#endif  // PSFLOW_TESTS_FAKES_FAKE_CHIEF_H_
