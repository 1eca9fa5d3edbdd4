#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/placement.h"
#include "data/source.h"

namespace psflow::worker {
namespace {

// Marks the status of Train (and its helpers) that means "register again":
// the job was reloaded, this worker was dropped from it, or the ps disagree
// on the version mid-reload. Never leaves Run.
constexpr char kRegisterAgainPayload[] = "psflow.dev/register-again";

absl::Status RegisterAgain(absl::string_view why) {
  absl::Status s = absl::AbortedError(why);
  s.SetPayload(kRegisterAgainPayload, absl::Cord());
  return s;
}

bool IsRegisterAgain(const absl::Status& s) {
  return s.GetPayload(kRegisterAgainPayload).has_value();
}

// A ps that holds another job (the chief reloaded it) or none (it restarted
// empty), drops this worker, or answers from another version than its peers
// (mid-reload): register again.
bool JobChanged(const absl::Status& s) {
  return absl::IsFailedPrecondition(s) || absl::IsAborted(s);
}

// A failure that happens again with the same input: exit code 1 whatever
// the code of `s`.
absl::Status Permanent(const absl::Status& s, absl::string_view context = "") {
  const absl::StatusCode code = absl::IsInvalidArgument(s) ? absl::StatusCode::kInvalidArgument
                                                           : absl::StatusCode::kFailedPrecondition;
  return absl::Status(code, absl::StrCat(context, s.message()));
}

// A failed ps call: a peer that stayed unreachable keeps its code (exit code
// 138); anything else is worth a retry of the whole worker (INTERNAL: 140).
absl::Status PsFailure(const absl::Status& s, absl::string_view what) {
  if (IsRetryable(s)) return absl::Status(s.code(), absl::StrCat(what, " failed: ", s.message()));
  return absl::InternalError(
      absl::StrCat(what, " failed: ", s.message(), " (", absl::StatusCodeToString(s.code()), ")"));
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// Whether every value stays finite on the wire: below `overflow` in
// magnitude (WireOverflow of the wire dtype; false for NaN).
bool AllFinite(const float* v, int64_t n, float overflow) {
  // No early exit: the loop vectorizes, and a finite job reads every value anyway.
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::abs(v[i]) < overflow;
  return finite;
}

}  // namespace

Trainer::Trainer(TrainerOptions options, chief::Client* chief, PsClientFactory make_ps)
    : options_(std::move(options)), chief_(chief), make_ps_(std::move(make_ps)) {}

Trainer::~Trainer() = default;

void Trainer::Stop(int signal) {
  absl::MutexLock lock(&mu_);
  if (stop_signal_ == 0) stop_signal_ = signal;
  if (ps_ != nullptr) ps_->CancelAll();  // a pull blocked on the other workers ends now
  chief_->CancelAll();                   // so does a registration waiting for the chief
}

TrainerStatus Trainer::Status() const {
  absl::MutexLock lock(&mu_);
  TrainerStatus status;
  status.worker = options_.worker_index;
  status.job_id = job_id_;
  status.step = step_;
  status.finished = finished_;
  return status;
}

bool Trainer::Stopping() const {
  absl::MutexLock lock(&mu_);
  return stop_signal_ != 0 || job_failed_;
}

absl::Status Trainer::FromPs(const absl::Status& s) const {
  if (!absl::IsCancelled(s) || Stopping()) return s;
  // Not cancelled here: the ps cancelled the call (it is going away).
  return absl::UnavailableError(absl::StrCat(s.message(), " (by the ps)"));
}

int Trainer::stop_signal() const {
  absl::MutexLock lock(&mu_);
  return stop_signal_;
}

ps::Client* Trainer::ps() const {
  absl::MutexLock lock(&mu_);
  return ps_.get();
}

absl::Status Trainer::Register() {
  const absl::Time give_up = absl::Now() + options_.startup_timeout;
  Backoff backoff;
  absl::Status last;
  while (absl::Now() < give_up && stop_signal() == 0) {
    absl::StatusOr<RegisterWorkerResponse> response = chief_->RegisterWorker(
        options_.worker_index, std::min(give_up, absl::Now() + options_.register_timeout));
    if (response.ok()) {
      const bool first = ps() == nullptr;
      if (!first && response->job().SerializeAsString() != job_.SerializeAsString()) {
        // Same cluster, another job config: start over as a fresh process.
        return absl::InternalError("the chief now runs another job configuration; restarting");
      }
      job_ = response->job();
      start_step_ = response->start_step();
      std::unique_ptr<ps::Client> client;
      if (first) {
        client = make_ps_(
            std::vector<std::string>(response->ps_address().begin(), response->ps_address().end()));
        if (client == nullptr) return absl::InternalError("no client for the ps");
      }
      absl::MutexLock lock(&mu_);
      // Metrics not yet reported belong to a job that is gone: its steps
      // are done again.
      if (job_id_ != response->job_id()) pending_.clear();
      job_id_ = response->job_id();
      if (first) {
        ps_ = std::move(client);
        if (stop_signal_ != 0) ps_->CancelAll();  // Stop came before there was a client to cancel
      }
      reregister_ = false;
      return absl::OkStatus();
    }
    last = response.status();
    if (!IsRetryable(last)) return Permanent(last, "the chief refused registration: ");
    absl::SleepFor(backoff.Next());  // retry backoff towards a chief that is not up yet
  }
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  return absl::UnavailableError(absl::StrCat(options_.chief_address, " unreachable after ",
                                             absl::FormatDuration(options_.startup_timeout), ": ",
                                             last.message()));
}

absl::Status Trainer::Prepare() {
  const int index = options_.worker_index;
  if (job_.num_ps() < 1 || job_.num_ps() != ps()->num_ps() || job_.batch_size() < 1 ||
      job_.steps_per_epoch() < 1 || job_.num_workers() <= index ||
      job_.placement().num_ps() != job_.num_ps()) {
    return absl::FailedPreconditionError("the chief sent an inconsistent job");
  }
  const DataType wire = WireDtypeOf(job_);
  if (wire == DT_INVALID) {
    return absl::FailedPreconditionError(
        absl::StrCat("the chief sent unknown wire dtype ", job_.wire_dtype()));
  }
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(options_.device, job_.compute_threads());
  if (!backend.ok()) return Permanent(backend.status());
  backend_ = *std::move(backend);
  absl::StatusOr<data::Dataset> data =
      data::LoadDataset({job_.dataset(), job_.data_dir(), job_.num_examples()},
                        data::ModelInputOf(job_.model()), data::Split::kTrain);
  if (!data.ok()) return Permanent(data.status());
  data_ = *std::move(data);
  if (data_.count != job_.num_examples()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this worker sees ", data_.count, " training examples in ", job_.data_dir(),
        ", the chief saw ", job_.num_examples(), ": every process needs the same data"));
  }
  absl::StatusOr<std::unique_ptr<model::Network>> net =
      model::Network::Create(job_.model(), backend_.get());
  if (!net.ok()) return Permanent(net.status());
  net_ = *std::move(net);
  // Pull into and push from the network's own buffers when they are host
  // memory; otherwise stage on the host.
  weights_ = net_->HostWeights();
  grads_ = net_->HostGradients();
  in_place_ = !weights_.empty();
  if (!in_place_) {
    for (const VariableShape& v : net_->variables()) {
      staging_.emplace_back(NumElements(v.shape));
      weights_.push_back(staging_.back().data());
      staging_.emplace_back(NumElements(v.shape));
      grads_.push_back(staging_.back().data());
    }
  }
  const std::vector<const float*> grads(grads_.begin(), grads_.end());
  for (int p = 0; p < job_.num_ps(); ++p) {
    pull_sinks_.push_back(SliceSinks(job_.placement(), p, weights_, "", wire));
    push_refs_.push_back(SliceRefs(job_.placement(), p, grads, "", wire));
  }
  pool_ = std::make_unique<ThreadPool>(std::max(job_.num_ps() - 1, 1));
  PSLOG(INFO) << "joined job: " << data_.count << " training examples, device " << backend_->name()
              << ", " << job_.num_ps() << " ps";
  return absl::OkStatus();
}

absl::Status Trainer::PullAll(int64_t min_version, int64_t* version, int64_t* wait_us) {
  const int n = job_.num_ps();
  ps::Client* const client = ps();
  const uint64_t job_id = job_id_;
  std::vector<int64_t> versions(n, -1), waits(n, 0);
  RetryPolicy policy;
  policy.give_up = absl::Now() + options_.startup_timeout;
  policy.stop = [this] { return Stopping(); };
  const absl::Time start = absl::Now();
  absl::Status s = FanOut(pool_.get(), n, policy, [&](int p) -> absl::Status {
    absl::StatusOr<ps::Client::PullResult> r;
    absl::Time last_ask;
    do {  // ask again while the other workers are still on the step
      if (stop_signal() != 0) return absl::CancelledError("stopping");
      last_ask = absl::Now();
      r = client->Pull(p, job_id, min_version, pull_sinks_[p],
                       last_ask + options_.pull_wait + options_.transfer_timeout,
                       options_.pull_wait);
    } while (r.ok() && r->version < min_version);
    if (!r.ok()) {
      const absl::Status failed = FromPs(r.status());
      if (IsRetryable(failed)) PSLOG(WARNING) << "retrying: " << failed.message();
      return failed;
    }
    versions[p] = r->version;
    // Time spent on "not yet" answers (and retries) is waiting too.
    waits[p] = r->wait_us + Micros(last_ask - start);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  *version = *std::min_element(versions.begin(), versions.end());
  *wait_us = *std::max_element(waits.begin(), waits.end());
  const int64_t newest = *std::max_element(versions.begin(), versions.end());
  // One step apart: a worker died between its pushes of the last step to
  // different ps (some applied it, the others still wait for its push). Do
  // the older step: the ps past it answer STALE, the others get their push.
  if (newest - *version > 1) {
    return absl::AbortedError(
        absl::StrCat("ps disagree on the version: ", *version, " and ", newest));
  }
  return absl::OkStatus();
}

absl::Status Trainer::PushAll(int64_t step) {
  ps::Client* const client = ps();
  PushHeader header;
  header.set_job_id(job_id_);
  header.set_worker(options_.worker_index);
  header.set_step(step);
  RetryPolicy policy;
  policy.give_up = absl::Now() + options_.startup_timeout;
  policy.stop = [this] { return Stopping(); };
  // A retried push that had arrived after all is answered DUPLICATE (or
  // STALE once applied): either way the ps has this worker's gradients.
  return FanOut(pool_.get(), job_.num_ps(), policy, [&](int p) -> absl::Status {
    absl::Status s = FromPs(
        client->Push(p, header, push_refs_[p], absl::Now() + options_.transfer_timeout).status());
    if (IsRetryable(s)) PSLOG(WARNING) << "retrying: " << s.message();
    return s;
  });
}

void Trainer::ReportLoop() {
  absl::Time last_ok = absl::Now();
  while (true) {
    ReportRequest request;
    request.set_worker(options_.worker_index);
    {
      absl::MutexLock lock(&mu_);
      if (released_ || job_failed_ || stop_signal_ != 0 || !report_error_.ok() || training_failed_)
        return;
      // Wake early once the last step is done, so the exit order arrives promptly.
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return finished_ || nonfinite_ || stop_signal_ != 0;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.report_every);
      // The job the metrics belong to: a registration changes both under mu_.
      request.set_job_id(job_id_);
      for (StepMetrics& m : pending_) *request.add_metrics() = std::move(m);
      pending_.clear();
      nonfinite_ = false;  // woken once for it; it travels with this report
      request.set_finished(finished_);
    }
    absl::StatusOr<ReportResponse> response =
        chief_->Report(request, absl::Now() + options_.report_timeout);
    absl::MutexLock lock(&mu_);
    if (response.ok()) {
      last_ok = absl::Now();
      if (response->action() == ReportResponse::EXIT) released_ = true;
      if (response->action() == ReportResponse::REGISTER) reregister_ = true;
      if (response->action() == ReportResponse::FAIL) {
        job_failed_ = true;
        if (ps_ != nullptr) ps_->CancelAll();  // a pull waiting for the failed step ends now
      }
      continue;
    }
    // Metrics of a failed report are dropped (the log is best effort), but
    // not a non-finite step: the chief must hear of that one.
    for (const StepMetrics& m : request.metrics()) {
      if (m.nonfinite()) pending_.push_back(m);
    }
    if (stop_signal_ != 0) return;
    const absl::Status& s = response.status();
    if (absl::IsInvalidArgument(s)) {
      // The chief refused these metrics (values it finds impossible); the
      // heartbeat goes on with the next report.
      PSLOG(WARNING) << "the chief refused a report: " << s.message();
      continue;
    }
    if (!IsRetryable(s)) {
      report_error_ =
          absl::InternalError(absl::StrCat("cannot report to the chief: ", s.message(), " (",
                                           absl::StatusCodeToString(s.code()), ")"));
    } else if (absl::Now() - last_ok > options_.startup_timeout) {
      report_error_ =
          absl::Status(s.code(), absl::StrCat("cannot report to the chief: ", s.message()));
    }
  }
}

absl::Status Trainer::NonFinite(int64_t step) {
  // Nothing of this step is pushed; the chief decides what happens next.
  StepMetrics m;
  m.set_step(step);
  m.set_examples(job_.batch_size());
  m.set_nonfinite(true);
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(m));
  nonfinite_ = true;
  // The job's policy is to fail: wait (a little) for the chief to confirm.
  auto told = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job_failed_ || stop_signal_ != 0 || !report_error_.ok();
  };
  mu_.AwaitWithTimeout(absl::Condition(&told), options_.nonfinite_wait);
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, ": the loss or the gradients are not finite; nothing pushed"));
}

absl::Status Trainer::Train(int64_t start) {
  const int index = options_.worker_index;
  data::ShardSampler sampler(data_.count, job_.num_workers(), index, job_.seed());
  const int batch = job_.batch_size();
  const int64_t example = data_.example_floats();
  std::vector<float> images(static_cast<size_t>(batch) * example);
  std::vector<int32_t> labels(batch);
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  const std::vector<const float*> weight_ptrs(weights_.begin(), weights_.end());
  const float wire_overflow = WireOverflow(WireDtypeOf(job_));
  auto job_failed = [this] {
    absl::MutexLock lock(&mu_);
    return job_failed_;
  };
  const absl::Status failed = absl::FailedPreconditionError("the chief failed the job");

  int64_t step = start;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (job_failed_) return failed;
      if (reregister_) return RegisterAgain("the chief asked for a new registration");
    }
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    const absl::Time t0 = absl::Now();
    int64_t version = 0, wait_us = 0;
    absl::Status s = PullAll(step, &version, &wait_us);
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    if (job_failed()) return failed;
    if (JobChanged(s)) return RegisterAgain(s.message());
    if (!s.ok()) return PsFailure(s, "pull");
    const absl::Time t1 = absl::Now();
    if (version >= job_.train_steps()) break;
    step = version;
    const int64_t epoch = step / job_.steps_per_epoch();
    const int64_t position = step % job_.steps_per_epoch();
    if (epoch != order_epoch) {
      order = sampler.EpochIndices(epoch);
      order_epoch = epoch;
    }
    s = data::GatherBatch(data_, absl::MakeConstSpan(order).subspan(position * batch, batch),
                          images.data(), labels.data());
    if (s.ok() && !in_place_) s = net_->SetWeights(weight_ptrs);
    absl::StatusOr<model::Network::Result> result =
        s.ok() ? net_->TrainStep(images.data(), labels.data(), batch) : s;
    if (result.ok() && !in_place_) s = net_->GetGradients(grads_);
    if (!result.ok() || !s.ok()) {
      const absl::Status& e = result.ok() ? s : result.status();
      return absl::InternalError(absl::StrCat("step ", step, " failed: ", e.message()));
    }
    const absl::Time t2 = absl::Now();
    // A gradient the wire dtype turns into infinity (fp16 from 65520 on)
    // is as diverged as one that already is.
    // Each ps's slices are checked on the pool, as the pushes will go.
    std::vector<char> finite_on(push_refs_.size(), 1);
    FanOut(pool_.get(), static_cast<int>(push_refs_.size()), RetryPolicy(), [&](int p) {
      for (const TensorRef& r : push_refs_[p]) {
        if (!AllFinite(r.data, NumElements(r.shape), wire_overflow)) finite_on[p] = 0;
      }
      return absl::OkStatus();
    }).IgnoreError();  // the calls cannot fail
    const bool finite = std::isfinite(result->loss) &&
                        std::all_of(finite_on.begin(), finite_on.end(), [](char f) { return f; });
    if (!finite) {
      PSLOG(ERROR) << "step " << step << ": the loss (" << result->loss
                   << ") or the gradients are not finite (in the wire dtype); nothing pushed";
      return NonFinite(step);
    }
    s = PushAll(step);
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    if (JobChanged(s)) return RegisterAgain(s.message());
    if (!s.ok()) return PsFailure(s, "push");
    const absl::Time t3 = absl::Now();
    StepMetrics m;
    m.set_step(step);
    m.set_loss(result->loss);
    m.set_correct(result->correct);
    m.set_examples(batch);
    m.set_wait_us(wait_us);
    m.set_pull_us(std::max<int64_t>(Micros(t1 - t0) - wait_us, 0));
    m.set_compute_us(Micros(t2 - t1));
    m.set_push_us(Micros(t3 - t2));
    ++step;
    register_backoff_.Reset();
    absl::MutexLock lock(&mu_);
    pending_.push_back(std::move(m));
    step_ = step;
  }
  return absl::OkStatus();
}

absl::Status Trainer::TrainAndWait() {
  while (true) {
    absl::Status s = Train(start_step_);
    if (IsRegisterAgain(s)) {
      PSLOG(INFO) << "the job was reloaded or this worker was dropped; registering again ("
                  << s.message() << ")";
      // While the chief reloads the ps, registering again at once just spins.
      absl::SleepFor(register_backoff_.Next());
      s = Register();
      if (s.ok()) continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!s.ok()) {
        training_failed_ = true;  // ends the report loop
        return s;
      }
      finished_ = true;
      PSLOG(INFO) << "reached the last step; waiting for the chief's exit order";
      auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return released_ || job_failed_ || stop_signal_ != 0 || !report_error_.ok() || reregister_;
      };
      mu_.Await(absl::Condition(&over));
      if (released_ || job_failed_) return absl::OkStatus();  // Run tells the two apart
      if (stop_signal_ != 0) return StoppedBySignal(stop_signal_);
      if (!report_error_.ok()) return report_error_;
      finished_ = false;  // the chief went back to a checkpoint: train on
    }
    absl::Status s2 = Register();
    if (!s2.ok()) {
      absl::MutexLock lock(&mu_);
      training_failed_ = true;
      return s2;
    }
  }
}

absl::Status Trainer::Run() {
  absl::Status s = Register();
  if (!s.ok()) return s;
  s = Prepare();
  if (!s.ok()) return s;
  std::thread reporter([this] { ReportLoop(); });
  s = TrainAndWait();
  reporter.join();
  absl::MutexLock lock(&mu_);
  // The chief's verdict wins over how training ended (a pull it cancelled).
  if (job_failed_) return absl::FailedPreconditionError("the chief failed the job; exiting");
  if (s.ok()) PSLOG(INFO) << "released by the chief; exiting";
  return s;
}

}  // namespace psflow::worker
