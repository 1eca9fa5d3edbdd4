// Tests of the evaluator's logic against an in-memory chief and ps: a model
// of which not even one example fits the memory budget is refused when the
// job is prepared, with one line and a permanent exit code.
#include "evaluator/evaluator.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "chief/client.h"
#include "common/exit_codes.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/spec.h"
#include "tests/fakes/fake_ps.h"

namespace psflow::evaluator {
namespace {

using ::testing::HasSubstr;

// A chief that registers the evaluator for `job` and answers every report
// CONTINUE.
class FakeEvaluatorChief final : public chief::EvaluatorClient {
 public:
  explicit FakeEvaluatorChief(JobConfig job) : job_(std::move(job)) {}

  absl::StatusOr<RegisterEvaluatorResponse> RegisterEvaluator(
      const RegisterEvaluatorRequest& request, absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    ++registrations_;
    RegisterEvaluatorResponse r;
    r.set_job_id(7);
    *r.mutable_job() = job_;
    r.add_ps_address("ps0");
    return r;
  }
  absl::StatusOr<ReportEvalResponse> ReportEval(const ReportEvalRequest& request,
                                                absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    ++reports_;
    return ReportEvalResponse();
  }
  void CancelAll() override {}

  int registrations() const {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }
  int reports() const {
    absl::MutexLock lock(&mu_);
    return reports_;
  }

 private:
  const JobConfig job_;
  mutable absl::Mutex mu_;
  int registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int reports_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(EvaluatorTest, ModelBeyondTheMemoryLimitIsRefusedWhenPrepared) {
  JobConfig job;
  *job.mutable_model() = model::ResolveModelSpec("mlp").value();
  job.mutable_data()->set_format("synthetic");
  job.set_num_ps(1);
  job.mutable_placement()->set_num_ps(1);
  job.set_train_steps(10);
  FakeEvaluatorChief chief(job);
  fakes::FakePs ps(1);
  EvaluatorOptions options;
  options.synthetic_examples = 50;
  options.memory_limit = 64 << 10;  // the mlp's weights alone take 0.9 MiB
  options.startup_timeout = absl::Seconds(5);
  Evaluator evaluator(options, &chief,
                      [&ps](const std::vector<std::string>&) { return ps.NewClient(); });
  const absl::Status s = evaluator.Run();
  EXPECT_EQ(ExitCodeFor(s), kExitPermanent) << s;
  const std::string message(s.message());
  EXPECT_THAT(message, HasSubstr("model mlp needs "));
  EXPECT_THAT(message, HasSubstr("more than the memory budget of 64.0 KiB"));
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_EQ(chief.registrations(), 1);
  EXPECT_EQ(chief.reports(), 0) << "nothing evaluated";
}

}  // namespace
}  // namespace psflow::evaluator
