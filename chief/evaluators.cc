#include "chief/evaluators.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace psflow::chief {
namespace {

double Accuracy(const EvalResult& r) {
  return static_cast<double>(r.correct()) / static_cast<double>(r.examples());
}

uint64_t NewLease() {
  uint64_t lease = 0;
  while (lease == 0) lease = absl::Uniform<uint64_t>(absl::BitGen());
  return lease;
}

}  // namespace

std::string AucText(const EvalResult& r) {
  return r.has_auc() ? absl::StrFormat(" auc %.4f", r.auc()) : "";
}

absl::Status CheckEvalResult(const EvalResult& r, int64_t train_steps) {
  auto bad = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("impossible evaluation result: ", what));
  };
  if (r.step() < 0 || r.step() > train_steps) return bad("step outside the job");
  if (r.examples() <= 0 || r.examples() > 1'000'000'000) return bad("example count");
  if (r.correct() < 0 || r.correct() > r.examples()) return bad("correct count");
  if (!std::isfinite(r.loss()) || r.loss() < 0) return bad("loss");
  if (r.has_auc() && !(r.auc() >= 0 && r.auc() <= 1)) return bad("auc");
  if (r.duration_us() < 0 || r.duration_us() > int64_t{86400} * 1'000'000) return bad("duration");
  return absl::OkStatus();
}

Evaluators::Evaluators(EvaluatorsOptions options, Progress* progress)
    : options_(std::move(options)), progress_(progress) {}

absl::Status Evaluators::CheckIndex(int evaluator) const {
  // The chief's cluster may leave evaluators out (the operator's minimal
  // form): then any small index is taken from a caller whose certificate
  // says it is an evaluator. Without certificates, anyone who reaches the
  // port could register: only the listed indices are.
  if (options_.num_evaluators == 0 && !options_.identified) {
    return absl::InvalidArgumentError(absl::StrCat(
        "evaluator ", evaluator,
        " is not in the cluster: the chief's cluster lists no evaluators, and without TLS only "
        "listed ones may register"));
  }
  const int limit = options_.num_evaluators > 0 ? options_.num_evaluators : 64;
  if (evaluator < 0 || evaluator >= limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("evaluator ", evaluator, " is not in the cluster (", limit,
                     options_.num_evaluators > 0 ? "" : " at most", " evaluators)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisterEvaluatorResponse> Evaluators::Register(int evaluator, const JobState& job,
                                                               uint64_t lease) {
  PSFLOW_RETURN_IF_ERROR(CheckIndex(evaluator));
  RegisterEvaluatorResponse response;
  if (!job.failure.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the job failed: ", job.failure.message()));
  }
  if (job.done) {
    // No lease: nothing it reports from now on is recorded.
    response.set_done(true);
    return response;
  }
  if (!job.ready) return absl::UnavailableError("the parameter servers are not loaded yet");
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    auto held = holders_.find(evaluator);
    if (held != holders_.end() && held->second.lease != lease && !options_.identified &&
        now - held->second.last_heard <= options_.silence) {
      // Either may be the impostor: the one in place keeps the index until
      // it falls silent (a restarted evaluator retries until then, and the
      // end of the job waits for it meanwhile).
      last_applicant_ = now;
      return absl::UnavailableError(absl::StrCat(
          "evaluator ", evaluator, " is registered already and was heard from ",
          absl::FormatDuration(absl::Trunc(now - held->second.last_heard, absl::Milliseconds(1))),
          " ago: another registration of it waits until it is silent for ",
          absl::FormatDuration(options_.silence)));
    }
    const bool renewal = held != holders_.end() && held->second.lease == lease;
    Holder& holder = holders_[evaluator];
    if (!renewal) holder.lease = NewLease();
    holder.last_heard = now;
    response.set_lease(holder.lease);
  }
  response.set_job_id(job.job_id);
  response.set_eval_every_steps(options_.eval_every_steps);
  response.set_eval_every_secs(options_.eval_every_secs);
  PSLOG(INFO) << "evaluator " << evaluator << " registered";
  return response;
}

absl::StatusOr<ReportEvalResponse> Evaluators::Report(const ReportEvalRequest& request,
                                                      const JobState& job) {
  const int e = request.evaluator();
  PSFLOW_RETURN_IF_ERROR(CheckIndex(e));
  if (request.has_result()) {
    absl::Status valid = CheckEvalResult(request.result(), options_.train_steps);
    if (!valid.ok()) {
      absl::MutexLock lock(&mu_);
      if (++refused_ <= 10) {
        PSLOG(WARNING) << "refused a report from evaluator " << e << ": " << valid.message();
      }
      return valid;
    }
  }
  ReportEvalResponse response;
  {
    absl::MutexLock lock(&mu_);
    auto held = holders_.find(e);
    const bool holder = held != holders_.end() && held->second.lease == request.lease();
    if (holder) held->second.last_heard = absl::Now();
    if (!job.failure.ok()) {
      response.set_action(ReportEvalResponse::FAIL);
      return response;
    }
    if (job.done) {
      response.set_action(ReportEvalResponse::EXIT);
      return response;
    }
    if (!holder) {
      // Not its index's registration: a forged report, or one of an
      // evaluator whose registration went (the chief restarted, or another
      // took its silent index). Nothing is recorded; a real one registers.
      LogForeignReport(e);
      response.set_action(ReportEvalResponse::REGISTER);
      return response;
    }
    if (request.job_id() != job.job_id || !job.ready) {
      response.set_action(ReportEvalResponse::REGISTER);  // the job was reloaded
      return response;
    }
    if (!request.has_result()) return response;
    if (request.result().step() == options_.train_steps) {
      final_ = request.result();
      // Its work is done: the end of the job need not wait for it any more.
      response.set_action(ReportEvalResponse::EXIT);
    }
  }
  const EvalResult& r = request.result();
  if (progress_ != nullptr) progress_->Eval(r.step(), r.loss(), Accuracy(r));
  PSLOG(INFO) << absl::StrFormat(
      "eval: step %d/%d loss %.4f acc %.4f%s | %d test examples, %.1f s, evaluator %d", r.step(),
      options_.train_steps, r.loss(), Accuracy(r), AucText(r), r.examples(),
      static_cast<double>(r.duration_us()) / 1e6, e);
  return response;
}

void Evaluators::LogForeignReport(int evaluator) {
  if (++foreign_ <= 10) {
    PSLOG(WARNING) << "dropped a report naming evaluator " << evaluator
                   << " without the lease of its registration (" << foreign_ << " so far)";
  }
}

void Evaluators::WaitForFinal() {
  absl::MutexLock lock(&mu_);
  if (final_.has_value() || (options_.num_evaluators == 0 && holders_.empty())) return;
  PSLOG(INFO) << "waiting for the evaluation of the final model (step " << options_.train_steps
              << ")";
  const absl::Time start = absl::Now();
  auto got = [this]()
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return final_.has_value() || cancelled_; };
  while (!got()) {
    const absl::Time now = absl::Now();
    // None ever called: most likely none runs. One starting this late gets
    // the time to register; once it has called, it is waited for as any.
    if (holders_.empty() && now - start > options_.unregistered_wait) {
      PSLOG(WARNING) << "no evaluation of the final model: no evaluator registered (waited "
                     << options_.unregistered_wait << " for one)";
      return;
    }
    absl::Time heard = std::max(start, last_applicant_);
    for (const auto& [e, h] : holders_) heard = std::max(heard, h.last_heard);
    if (now - heard > options_.silence) {
      PSLOG(WARNING) << "no evaluation of the final model: no evaluator was heard from for "
                     << options_.silence;
      return;
    }
    if (now - start > options_.final_wait) {
      PSLOG(WARNING) << "no evaluation of the final model within " << options_.final_wait
                     << " (--eval_final_timeout)";
      return;
    }
    mu_.AwaitWithTimeout(absl::Condition(&got), absl::Milliseconds(200));
  }
}

void Evaluators::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
}

std::optional<EvalResult> Evaluators::final_result() const {
  absl::MutexLock lock(&mu_);
  return final_;
}

}  // namespace psflow::chief
