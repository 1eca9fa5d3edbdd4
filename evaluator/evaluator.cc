#include "evaluator/evaluator.h"

#include <algorithm>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/byte_size.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "data/source.h"
#include "evaluator/evaluation.h"
#include "model/spec.h"

namespace psflow::evaluator {
namespace {

// The chief said the job is over: Run ends well. Told apart by a payload.
constexpr char kJobOverPayload[] = "psflow.dev/job-over";

absl::Status JobOver() {
  absl::Status s = absl::AbortedError("the job is over");
  s.SetPayload(kJobOverPayload, absl::Cord());
  return s;
}
bool IsJobOver(const absl::Status& s) { return s.GetPayload(kJobOverPayload).has_value(); }

}  // namespace

Evaluator::Evaluator(EvaluatorOptions options, chief::EvaluatorClient* chief,
                     PsClientFactory make_ps)
    : options_(std::move(options)), chief_(chief), make_ps_(std::move(make_ps)) {
  metrics::Registry* m = metrics::Registry::OrPrivate(options_.metrics, own_metrics_);
  metrics_.step = m->GetGauge(
      "psflow_evaluator_step",
      "Step (version) of the weights this evaluator evaluated last; -1 before the first.");
  metrics_.loss = m->GetGauge("psflow_evaluator_loss",
                              "Test-split loss of this evaluator's latest evaluation (NaN before "
                              "the first).");
  metrics_.accuracy = m->GetGauge("psflow_evaluator_accuracy",
                                  "Test-split accuracy of this evaluator's latest evaluation (NaN "
                                  "before the first).");
  metrics_.evaluations = m->GetCounter("psflow_evaluator_evaluations_total",
                                       "Evaluations this evaluator finished (and reported).");
  metrics_.seconds = m->GetHistogram(
      "psflow_evaluator_seconds",
      "Duration of one evaluation: the snapshot from every ps and the pass over the test split.",
      {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600});
  metrics_.step->Set(-1);
  metrics_.loss->Set(std::numeric_limits<double>::quiet_NaN());
  metrics_.accuracy->Set(std::numeric_limits<double>::quiet_NaN());
  absl::MutexLock lock(&mu_);
  status_.set_evaluator(options_.evaluator_index);
  status_.set_step(-1);
}

EvaluatorStatus Evaluator::Status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

Evaluator::~Evaluator() = default;

void Evaluator::Stop(int signal) {
  absl::MutexLock lock(&mu_);
  if (stop_signal_ != 0) return;
  stop_signal_ = signal;
  chief_->CancelAll();
  if (ps_for_stop_ != nullptr) ps_for_stop_->CancelAll();
}

int Evaluator::stop_signal() const {
  absl::MutexLock lock(&mu_);
  return stop_signal_;
}

void Evaluator::SetRegistered(bool registered) const {
  if (options_.on_registered) options_.on_registered(registered);
}

absl::Status Evaluator::Register(bool* done) {
  *done = false;
  const absl::Time give_up = absl::Now() + options_.startup_timeout;
  Backoff backoff;
  absl::Status last;
  while (absl::Now() < give_up && stop_signal() == 0) {
    RegisterEvaluatorRequest request;
    request.set_evaluator(options_.evaluator_index);
    request.set_lease(lease_);
    absl::StatusOr<RegisterEvaluatorResponse> response = chief_->RegisterEvaluator(
        request, std::min(give_up, absl::Now() + options_.register_timeout));
    if (response.ok()) {
      if (response->done()) {
        *done = true;
        return absl::OkStatus();
      }
      if (ps_ != nullptr && response->job().SerializeAsString() != job_.SerializeAsString()) {
        return absl::InternalError("the chief now runs another job configuration; restarting");
      }
      job_ = response->job();
      job_id_ = response->job_id();
      lease_ = response->lease();
      {
        absl::MutexLock lock(&mu_);
        status_.set_job_id(job_id_);
      }
      every_steps_ = std::max<int64_t>(response->eval_every_steps(), 0);
      every_secs_ = std::max<int64_t>(response->eval_every_secs(), 0);
      if (ps_ == nullptr) {
        ps_ = make_ps_(
            std::vector<std::string>(response->ps_address().begin(), response->ps_address().end()));
        if (ps_ == nullptr) return absl::InternalError("no client for the ps");
        absl::MutexLock lock(&mu_);
        ps_for_stop_ = ps_.get();
        if (stop_signal_ != 0) ps_->CancelAll();  // Stop came before the client
      }
      return absl::OkStatus();
    }
    last = response.status();
    if (!IsRetryable(last)) return Permanent(last, "the chief refused registration: ");
    absl::SleepFor(backoff.Next());  // a chief that is not up yet, or ps not loaded
  }
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  return absl::UnavailableError(absl::StrCat(options_.chief_address, " unreachable after ",
                                             absl::FormatDuration(options_.startup_timeout), ": ",
                                             last.message()));
}

absl::Status Evaluator::Prepare() {
  if (job_.num_ps() < 1 || job_.num_ps() != ps_->num_ps() ||
      job_.placement().num_ps() != job_.num_ps() || job_.train_steps() < 1) {
    return absl::FailedPreconditionError("the chief sent an inconsistent job");
  }
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(options_.device, options_.compute_threads);
  if (!backend.ok()) return Permanent(backend.status(), "");
  backend_ = *std::move(backend);
  DataConfig source = job_.data();
  if (!options_.data_dir.empty()) source.set_data_dir(options_.data_dir);
  if (!options_.eval_files.empty()) {
    source.clear_eval();
    source.add_eval(options_.eval_files);
  }
  source.set_synthetic_examples(options_.synthetic_examples);
  absl::StatusOr<data::Dataset> test = data::LoadDataset(
      source, data::ModelInputOf(job_.model()), data::Split::kTest, options_.input_threads);
  if (!test.ok()) return Permanent(test.status(), "");
  test_ = *std::move(test);
  memory_budget_ = options_.memory_limit;
  if (memory_budget_ <= 0) {
    absl::StatusOr<int64_t> budget = DefaultMemoryBudget(backend_.get());
    if (!budget.ok()) return Permanent(budget.status(), "");
    memory_budget_ = *budget;
  }
  model::NetworkOptions net_options;
  net_options.forward_only = true;
  absl::StatusOr<std::unique_ptr<model::Network>> net =
      model::Network::Create(job_.model(), backend_.get(), net_options);
  if (!net.ok()) return Permanent(net.status(), "");
  net_ = *std::move(net);
  // Refused now rather than at the first evaluation.
  absl::StatusOr<int> batch =
      EvaluationBatch(*net_, test_.count, options_.batch_size, memory_budget_);
  if (!batch.ok()) return Permanent(batch.status(), "");
  values_.clear();
  for (const VariableShape& v : model::ModelVariables(job_.model()))
    values_.emplace_back(NumElements(v.shape));
  pool_ = std::make_unique<ThreadPool>(std::max(job_.num_ps() - 1, 1));
  PSLOG(INFO) << "evaluating model " << job_.model().name() << " on " << test_.count
              << " test examples (" << options_.device << ", batches of " << *batch
              << ", memory budget " << FormatByteSize(memory_budget_) << ") every "
              << (every_steps_ > 0 ? absl::StrCat(every_steps_, " steps") : "")
              << (every_steps_ > 0 && every_secs_ > 0 ? " or " : "")
              << (every_secs_ > 0 ? absl::StrCat(every_secs_, " s") : "")
              << (every_steps_ == 0 && every_secs_ == 0 ? "(the final model only)"
                                                        : ", and the final model");
  return absl::OkStatus();
}

absl::Status Evaluator::Report(const EvalResult* result) {
  ReportEvalRequest request;
  request.set_job_id(job_id_);
  request.set_evaluator(options_.evaluator_index);
  request.set_lease(lease_);
  if (result != nullptr) *request.mutable_result() = *result;
  const absl::Time give_up = absl::Now() + options_.startup_timeout;
  Backoff backoff;
  while (true) {
    absl::StatusOr<ReportEvalResponse> r =
        chief_->ReportEval(request, absl::Now() + options_.report_timeout);
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    if (r.ok()) {
      last_heartbeat_ = absl::Now();
      switch (r->action()) {
        case ReportEvalResponse::EXIT:
          return JobOver();
        case ReportEvalResponse::REGISTER:
          return RegisterAgain("the chief asked for a new registration");
        case ReportEvalResponse::FAIL:
          return absl::FailedPreconditionError("the chief failed the job; exiting");
        default:
          return absl::OkStatus();
      }
    }
    if (!IsRetryable(r.status())) return Permanent(r.status(), "the chief refused a report: ");
    if (absl::Now() >= give_up) {
      return absl::UnavailableError(absl::StrCat(options_.chief_address, " unreachable for ",
                                                 absl::FormatDuration(options_.startup_timeout),
                                                 ": ", r.status().message()));
    }
    absl::SleepFor(backoff.Next());  // a chief restarting
  }
}

absl::Status Evaluator::MaybeHeartbeat() {
  if (absl::Now() - last_heartbeat_ < options_.heartbeat_every) return absl::OkStatus();
  return Report(nullptr);
}

absl::StatusOr<int64_t> Evaluator::Version() {
  std::vector<int64_t> versions(job_.num_ps(), 0);
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_.get(), job_.num_ps(), RetryPolicy(), [&](int p) {
    absl::StatusOr<PsState> st = ps_->GetState(p, absl::Now() + options_.state_call);
    if (!st.ok()) return st.status();
    // A ps restarted or being reloaded: the chief will say what comes next.
    if (!st->holds_job()) return absl::UnavailableError(absl::StrCat("ps ", p, " holds no job"));
    if (st->job_id() != job_id_) return RegisterAgain(absl::StrCat("ps ", p, " holds another job"));
    versions[p] = st->version();
    return absl::OkStatus();
  }));
  newest_version_ = *std::max_element(versions.begin(), versions.end());
  return *std::min_element(versions.begin(), versions.end());
}

std::optional<int64_t> Evaluator::Target(int64_t v, absl::Time now) const {
  const int64_t final_step = job_.train_steps();
  if (last_step_ >= final_step) return std::nullopt;  // done: the chief's EXIT comes next
  // The ps stop at the final version: it is taken once they are there.
  if (v >= final_step) return final_step;
  std::optional<int64_t> target;
  if (every_steps_ > 0) {
    // A multiple not yet reached is asked for in advance: each ps copies it
    // the moment it gets there.
    // An asynchronous job's ps pass a version at different times: a
    // multiple one of them has passed cannot be taken any more.
    const int64_t from =
        std::max(AppliesEachGradient(job_) ? newest_version_ + 1 : v, last_step_ + 1);
    const int64_t multiple = (from + every_steps_ - 1) / every_steps_ * every_steps_;
    if (multiple < final_step) target = multiple;
  }
  if (every_secs_ > 0 && now - last_start_ >= absl::Seconds(every_secs_)) {
    // The version the ps are at may pass any moment: take the next one. The
    // ps of an asynchronous job are never in step (one may be a few
    // gradients ahead of another): a few gradients past the newest, which
    // every ps reaches soon.
    int64_t next = std::max(v, last_step_) + 1;
    if (job_.exchange() == JobConfig::ALL_REDUCE) {
      // Worker 0's replica may live on its GPU: its shard is brought up to
      // date at the multiples of kReplicaPublishSteps (and at the steps asked
      // for in advance); the step after the one it reports has passed.
      next =
          std::min((next + kReplicaPublishSteps - 1) / kReplicaPublishSteps * kReplicaPublishSteps,
                   final_step);
    } else if (AppliesEachGradient(job_)) {
      next = std::min(std::max(next, VersionAhead(job_, newest_version_)), final_step);
    }
    target = std::min(target.value_or(next), next);
  }
  return target;
}

absl::Status Evaluator::EvaluateVersion(int64_t version) {
  const absl::Time start = absl::Now();
  std::vector<float*> buffers;
  for (std::vector<float>& v : values_) buffers.push_back(v.data());
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_.get(), job_.num_ps(), RetryPolicy(), [&](int p) {
    return ps_->Snapshot(p, job_id_, version, SliceSinks(job_.placement(), p, buffers),
                         start + options_.snapshot_timeout);
  }));
  std::vector<const float*> weights(buffers.begin(), buffers.end());
  absl::Status set = net_->SetWeights(weights);
  if (!set.ok())
    return absl::InternalError(absl::StrCat("cannot set the weights: ", set.message()));
  absl::StatusOr<Evaluation> e = EvaluateDataset(
      net_.get(), test_, options_.batch_size, memory_budget_, [this] { return MaybeHeartbeat(); });
  if (!e.ok()) {
    if (IsJobOver(e.status()) || IsRegisterAgain(e.status()) || SignalOf(e.status())) {
      return e.status();
    }
    return absl::InternalError(absl::StrCat("evaluation failed: ", e.status().message()));
  }
  last_step_ = version;
  last_start_ = start;
  EvalResult result;
  result.set_step(version);
  result.set_loss(e->loss);
  result.set_correct(e->correct);
  result.set_examples(e->examples);
  if (e->auc.has_value()) result.set_auc(*e->auc);
  const absl::Duration took = absl::Now() - start;
  result.set_duration_us(absl::ToInt64Microseconds(took));
  {
    absl::MutexLock lock(&mu_);
    status_.set_step(version);
    status_.set_loss(e->loss);
    status_.set_accuracy(e->accuracy());
  }
  metrics_.step->Set(static_cast<double>(version));
  metrics_.loss->Set(e->loss);
  metrics_.accuracy->Set(e->accuracy());
  metrics_.evaluations->Add();
  metrics_.seconds->Observe(absl::ToDoubleSeconds(took));
  PSLOG(INFO) << absl::StrFormat("step %d: loss %.4f acc %.4f%s (%d examples, %.1f s)", version,
                                 e->loss, e->accuracy(),
                                 e->auc.has_value() ? absl::StrFormat(" auc %.4f", *e->auc) : "",
                                 e->examples, absl::ToDoubleSeconds(took));
  return Report(&result);
}

absl::Status Evaluator::EvaluateJob() {
  last_step_ = -1;
  last_start_ = absl::Now();
  while (true) {
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    PSFLOW_RETURN_IF_ERROR(MaybeHeartbeat());
    absl::StatusOr<int64_t> v = Version();
    if (!v.ok()) {
      if (IsRegisterAgain(v.status()) || !IsRetryable(v.status())) return v.status();
      absl::SleepFor(options_.look_every);  // a ps away, restarting or being reloaded
      continue;
    }
    const std::optional<int64_t> target = Target(*v, absl::Now());
    if (!target.has_value()) {
      absl::SleepFor(options_.look_every);
      continue;
    }
    absl::Status s = EvaluateVersion(*target);
    if (s.ok() || IsJobOver(s) || IsRegisterAgain(s) || SignalOf(s)) {
      if (!s.ok()) return s;
      continue;
    }
    if (stop_signal() != 0) return StoppedBySignal(stop_signal());
    // The ps passed the version (or one got it and another not), it has not
    // come within the call, the job was reloaded meanwhile, or a ps is away:
    // look again. Anything else ends the evaluator.
    if (absl::IsFailedPrecondition(s) || absl::IsAborted(s) || IsRetryable(s)) {
      if (absl::IsUnavailable(s)) absl::SleepFor(options_.look_every);
      continue;
    }
    return s;
  }
}

absl::Status Evaluator::Run() {
  bool done = false;
  PSFLOW_RETURN_IF_ERROR(Register(&done));
  if (!done) PSFLOW_RETURN_IF_ERROR(Prepare());
  Backoff backoff;
  while (!done) {
    SetRegistered(true);  // registered, the model and the test split loaded
    absl::Status s = EvaluateJob();
    SetRegistered(false);
    if (IsJobOver(s)) break;
    if (!IsRegisterAgain(s)) return s;
    PSLOG(INFO) << "the job was reloaded; registering again (" << s.message() << ")";
    absl::SleepFor(backoff.Next());
    PSFLOW_RETURN_IF_ERROR(Register(&done));
  }
  PSLOG(INFO) << "the job is over; exiting";
  return absl::OkStatus();
}

}  // namespace psflow::evaluator
