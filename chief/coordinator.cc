#include "chief/coordinator.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <google/protobuf/util/message_differencer.h>

#include "absl/random/distributions.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "model/saved_model.h"
#include "model/spec.h"
#include "ps/optimizer.h"

namespace psflow::chief {
namespace {

// The tensors of each of `slots` ("" the values) as whole-variable buffers,
// in placement order; empty for a slot the tensors lack (it starts at zero
// on the ps).
std::vector<std::vector<const float*>> SlotBuffers(const std::vector<CheckpointTensorData>& tensors,
                                                   const Placement& placement,
                                                   const std::vector<std::string>& slots) {
  std::vector<std::vector<const float*>> buffers(slots.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    for (const VariablePlacement& v : placement.variable()) {
      auto it = std::find_if(tensors.begin(), tensors.end(), [&](const CheckpointTensorData& t) {
        return t.name == v.name() && t.slot == slots[k];
      });
      buffers[k].push_back(it == tensors.end() ? nullptr : it->values.data());
    }
    if (std::find(buffers[k].begin(), buffers[k].end(), nullptr) != buffers[k].end())
      buffers[k].clear();
  }
  return buffers;
}

// A fresh random job id: calls that name an older one fail.
uint64_t NewJobId() { return absl::Uniform<uint64_t>(absl::BitGen()); }

// Why a job with --on_nonfinite=fail fails: worker `w`'s step `step`.
absl::Status DivergedAt(int w, int64_t step) {
  return absl::OutOfRangeError(
      absl::StrCat("worker ", w, " computed a non-finite loss or gradients at step ", step,
                   " (the job diverged; lower --learning_rate?); with --on_nonfinite=fail no "
                   "saved model is written"));
}

std::vector<int> Sorted(const absl::flat_hash_set<int>& set) {
  std::vector<int> v(set.begin(), set.end());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

absl::StatusOr<JobConfig> BuildJobConfig(const ChiefOptions& o) {
  if (o.coordinator.model_dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (o.coordinator.log_every_steps <= 0) {
    return absl::InvalidArgumentError("--log_every_steps must be positive");
  }
  if (o.coordinator.eval_every_steps < 0 || o.coordinator.eval_every_secs < 0) {
    return absl::InvalidArgumentError(
        "--eval_every_steps and --eval_every_secs must not be negative");
  }
  return BuildJobConfig(o.job, static_cast<int>(o.cluster.cluster.worker.size()),
                        static_cast<int>(o.cluster.cluster.ps.size()));
}

Coordinator::Coordinator(CoordinatorOptions options, JobConfig job, ps::Client* ps,
                         ThreadPool* pool, ProgressListener* progress_listener)
    : options_(std::move(options)),
      job_(std::move(job)),
      ps_(ps),
      pool_(pool),
      progress_(std::make_unique<Progress>(
          job_.train_steps(), job_.steps_per_epoch(), options_.log_every_steps, job_.num_workers(),
          job_.num_ps(),
          [this] {
            int n = 0;
            for (int p = 0; p < job_.num_ps(); ++p) n += ps_->Reachable(p);
            return n;
          },
          [](const std::string& line) { PSLOG(INFO) << line; },
          [optimizer = job_.optimizer()](int64_t step) {
            return ps::LearningRate(optimizer, step);
          },
          progress_listener, options_.metrics)),
      evaluators_({.num_evaluators = options_.num_evaluators,
                   .identified = options_.identified_callers,
                   .train_steps = job_.train_steps(),
                   .eval_every_steps = options_.eval_every_steps,
                   .eval_every_secs = options_.eval_every_secs,
                   .silence = options_.timeouts.evaluator,
                   .unregistered_wait = options_.timeouts.unregistered_evaluator,
                   .final_wait = options_.timeouts.final_eval},
                  progress_.get()),
      metrics_(options_.metrics),
      ring_key_(NewJobId()),
      witness_(AppliesEachGradient(job_)) {
  progress_->SetAsynchronous(AppliesEachGradient(job_));
  progress_->SetAllReduce(AllReduce());
  absl::MutexLock lock(&mu_);
  job_id_ = NewJobId();
  for (int w = 0; w < job_.num_workers(); ++w) live_.insert(w);
  last_seen_.assign(job_.num_workers(), absl::Now());
}

Coordinator::~Coordinator() = default;

void Coordinator::Stop(int signal) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ == 0) stop_signal_ = signal;
    // Before the ps are loaded nothing needs saving: stop waiting for them.
    // Exit orders on their way are given up: a ps stopping with the cluster
    // would hold each for its whole deadline (the calls wait for a ps to be
    // ready), past the grace the chief has.
    if (!ready_ || exit_orders_out_) ps_->CancelAll();
  }
  evaluators_.Cancel();  // no waiting for the final evaluation either
}

void Coordinator::Fail(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = why;  // the first failure is the one kept
  }
  evaluators_.Cancel();
}

bool Coordinator::Failed() {
  absl::MutexLock lock(&mu_);
  return !failure_.ok();
}

uint64_t Coordinator::job_id() {
  absl::MutexLock lock(&mu_);
  return job_id_;
}

std::string Coordinator::SavedModelDir() const {
  return options_.saved_model_dir.empty() ? absl::StrCat(options_.model_dir, "/saved_model")
                                          : options_.saved_model_dir;
}

absl::Status Coordinator::BroadcastLiveWorkers(const std::vector<int>& live, int64_t from_version) {
  if (AllReduce()) {
    // A replica hears its own worker only: nothing to tell it.
    progress_->SetLiveWorkers(live);
    return absl::OkStatus();
  }
  const uint64_t id = job_id();
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_, job_.num_ps(), RetryPolicy(), [&](int p) {
    return ps_->SetLiveWorkers(p, id, live, from_version,
                               absl::Now() + options_.timeouts.control_call);
  }));
  progress_->SetLiveWorkers(live);
  return absl::OkStatus();
}

absl::Status Coordinator::JoinGroup(int w) {
  // Every worker is in every step of an all-reduce: one that registers
  // again after all had (it restarted) has left its group broken.
  if (registered_.size() == static_cast<size_t>(job_.num_workers()) && registered_.contains(w) &&
      group_broken_.ok()) {
    group_broken_ = absl::UnavailableError(absl::StrCat(
        "worker ", w,
        " registered again (it restarted): the all-reduce group is broken; every worker "
        "restarts from the newest checkpoint"));
    PSLOG(WARNING) << group_broken_.message();
  }
  if (!group_broken_.ok()) return group_broken_;
  registered_.insert(w);
  reported_.erase(w);  // its reports start once its group formed
  return absl::OkStatus();
}

absl::StatusOr<RegisterWorkerResponse> Coordinator::RegisterWorker(int w, absl::Time deadline) {
  if (w < 0 || w >= job_.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", w, " is not in the cluster (", job_.num_workers(), " workers)"));
  }
  absl::MutexLock membership(&membership_mu_);
  std::vector<int> live;
  {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ || Stopping(); };
    mu_.AwaitWithDeadline(absl::Condition(&ready),
                          std::min(deadline, absl::Now() + options_.timeouts.register_wait));
    if (!ready_) return absl::UnavailableError("the parameter servers are not loaded yet");
    if (AllReduce()) PSFLOW_RETURN_IF_ERROR(JoinGroup(w));
    last_seen_[w] = absl::Now();
    finished_.erase(w);
    if (!live_.contains(w)) {
      live_.insert(w);
      live = Sorted(live_);
    }
  }
  int64_t start = 0;  // a member already: pull whatever version the ps are at
  if (!live.empty()) {
    // A (re)joining worker takes part from the step after the newest one any
    // ps has reached, so no step waits for a push computed on other weights.
    int64_t max_version = 0;
    if (!PsHealthy(&max_version)) return absl::UnavailableError("a ps is not reachable");
    start = max_version + 1;
    absl::Status s = BroadcastLiveWorkers(live, start);
    if (!s.ok()) {
      // Not a member until every ps knows it: the worker's next try
      // broadcasts again (some ps may already count it; that is repaired then).
      absl::MutexLock lock(&mu_);
      live_.erase(w);
      return absl::UnavailableError(s.message());
    }
    progress_->Rejoin(w, start);
    PSLOG(INFO) << "worker " << w << " joins at step " << start << " (" << live.size() << " live)";
  } else {
    PSLOG(INFO) << "worker " << w << " registered";
  }
  RegisterWorkerResponse response;
  response.set_job_id(job_id());
  *response.mutable_job() = job_;
  for (const std::string& a : options_.ps_addresses) response.add_ps_address(a);
  response.set_start_step(start);
  if (AllReduce()) response.set_ring_key(ring_key_);
  return response;
}

bool Coordinator::ConfirmsNonfinite() const {
  return job_.on_nonfinite() == JobConfig::FAIL && !AllReduce() && !AppliesEachGradient(job_);
}

void Coordinator::HandleNonfinite(const ReportRequest& request) {
  const int w = request.worker();
  for (const StepMetrics& m : request.metrics()) {
    if (!m.nonfinite()) continue;
    if (ConfirmsNonfinite()) {
      // Anyone who knows the job id can send this: it fails the job only once
      // the ps bear it out (ResolveNonfinite). A claim the last look at the
      // ps cannot place gets a fresh look first.
      const bool placed = witness_.Reached(job_id(), m.step());
      if (!placed) States(job_id()).IgnoreError();
    }
    {
      // A late report of an older job (reloaded since) or of a job already
      // trained to its end says nothing about the weights that stay.
      absl::MutexLock lock(&mu_);
      if (request.job_id() != job_id_ || trained_ || !failure_.ok()) continue;
      if (ConfirmsNonfinite()) {
        witness_.Claim(job_id_, w, m.step(), absl::Now());
        continue;
      }
      if (job_.on_nonfinite() == JobConfig::SKIP_STEP) {
        // Every worker of the step may say so: count the step once.
        if (!skipped_steps_.insert(m.step()).second) continue;
        const int64_t skipped = static_cast<int64_t>(skipped_steps_.size());
        PSLOG(WARNING) << "step " << m.step() << " skipped: worker " << w
                       << " computed a non-finite loss or gradients (" << skipped
                       << " steps skipped, at most " << job_.max_skipped_steps() << ")";
        if (skipped <= job_.max_skipped_steps()) continue;
      }
    }
    if (job_.on_nonfinite() == JobConfig::SKIP_STEP) {
      Fail(absl::OutOfRangeError(absl::StrCat(
          "more than ", job_.max_skipped_steps(),
          " steps were skipped for non-finite losses or gradients (the job diverged; lower "
          "--learning_rate?); no saved model is written")));
      return;
    }
    Fail(DivergedAt(w, m.step()));
  }
}

void Coordinator::ResolveNonfinite(const std::vector<PsState>& states) {
  for (const PsWitness::Confirmed& c :
       witness_.Resolve(job_id(), states, absl::Now(), options_.timeouts.nonfinite_confirm)) {
    Fail(DivergedAt(c.worker, c.step));
  }
}

absl::StatusOr<ReportResponse> Coordinator::Report(const ReportRequest& request,
                                                   absl::Time deadline) {
  const int w = request.worker();
  if (w < 0 || w >= job_.num_workers()) return absl::InvalidArgumentError("unknown worker");
  for (const StepMetrics& m : request.metrics()) {
    absl::Status valid = CheckStepMetrics(m, job_.train_steps(), WorkerBatch(job_));
    if (valid.ok()) continue;
    absl::MutexLock lock(&mu_);
    // Refused, never logged as progress; the first few are named. The call
    // still shows the worker alive.
    if (request.job_id() == job_id_) last_seen_[w] = absl::Now();
    if (++refused_reports_ <= 10) {
      PSLOG(WARNING) << "refused a report from worker " << w << ": " << valid.message();
    }
    return valid;
  }
  HandleNonfinite(request);
  ReportResponse response;
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) {
      response.set_action(ReportResponse::FAIL);
      released_.insert(w);
      return response;
    }
    if (request.job_id() != job_id_ || !ready_) {
      response.set_action(ReportResponse::REGISTER);  // the job was reloaded: its step is gone
      return response;
    }
    last_seen_[w] = absl::Now();
    reported_.insert(w);
  }
  // Outside mu_: recording may write log lines.
  progress_->Record(w, CheckedMetrics(request), absl::Now());
  // A worker has finished only when the ps say the last step was applied:
  // a report alone (a forged one, say) cannot end the job.
  const bool finished = request.finished() && EveryPsAtTheEnd();
  if (finished) progress_->Finished(w);
  absl::MutexLock lock(&mu_);
  if (finished) {
    finished_.insert(w);
    // Long-poll: answer when the job is over, or soon enough to serve as a heartbeat.
    auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return done_ || Stopping() || !failure_.ok();
    };
    mu_.AwaitWithDeadline(absl::Condition(&over),
                          std::min(deadline, absl::Now() + options_.timeouts.report_hold));
  }
  if (!failure_.ok()) {
    response.set_action(ReportResponse::FAIL);
    released_.insert(w);
  } else if (done_) {
    response.set_action(ReportResponse::EXIT);
    released_.insert(w);
  }
  return response;
}

std::vector<StepMetrics> Coordinator::CheckedMetrics(const ReportRequest& request) {
  const int w = request.worker();
  std::vector<StepMetrics> kept;
  for (const StepMetrics& m : request.metrics()) {
    if (m.nonfinite() && job_.on_nonfinite() == JobConfig::FAIL) continue;
    kept.push_back(m);
  }
  // A replica of a job without ps hears its own worker alone: there is
  // nothing to hold a worker's steps against.
  if (kept.empty() || AllReduce()) return kept;
  // A worker reports a step once every ps answered its push of the step:
  // the ps have it by then, so a step they lack (far ahead, say) was not
  // this worker's. The last look at the ps is usually a step behind.
  const uint64_t id = job_id();
  auto borne_out = [&] {
    return std::all_of(kept.begin(), kept.end(),
                       [&](const StepMetrics& m) { return witness_.HasStep(id, w, m.step()); });
  };
  if (!borne_out()) States(id).IgnoreError();
  std::vector<StepMetrics> accepted;
  for (StepMetrics& m : kept) {
    if (witness_.HasStep(id, w, m.step())) {
      accepted.push_back(std::move(m));
    } else {
      witness_.RefuseMetrics(w, m.step());
    }
  }
  return accepted;
}

JobState Coordinator::StateForEvaluators() {
  absl::MutexLock lock(&mu_);
  return {.failure = failure_, .done = done_, .ready = ready_, .job_id = job_id_};
}

absl::StatusOr<RegisterEvaluatorResponse> Coordinator::RegisterEvaluator(int evaluator,
                                                                         uint64_t lease) {
  PSFLOW_ASSIGN_OR_RETURN(RegisterEvaluatorResponse response,
                          evaluators_.Register(evaluator, StateForEvaluators(), lease));
  if (response.done()) return response;
  *response.mutable_job() = job_;
  for (const std::string& a : options_.ps_addresses) response.add_ps_address(a);
  return response;
}

absl::StatusOr<ReportEvalResponse> Coordinator::ReportEval(const ReportEvalRequest& request) {
  return evaluators_.Report(request, StateForEvaluators());
}

absl::StatusOr<Coordinator::Weights> Coordinator::InitialWeights() {
  const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
  absl::StatusOr<Checkpoint> ckpt = ReadNewestCheckpoint(options_.model_dir);
  Weights w;
  if (!ckpt.ok()) {
    if (!absl::IsNotFound(ckpt.status())) return ckpt.status();
    std::vector<std::vector<float>> init = model::InitialValues(job_.model(), job_.seed());
    for (size_t i = 0; i < vars.size(); ++i)
      w.tensors.push_back({vars[i].name, "", vars[i].shape, std::move(init[i])});
    return w;
  }
  // Every variable must be there with its shape; optimizer slots are taken
  // when the optimizer is the same kind (otherwise they start at zero).
  const bool same_optimizer = ckpt->manifest.optimizer().kind() == job_.optimizer().kind();
  absl::flat_hash_set<std::string> wanted;
  for (const VariableShape& v : vars) wanted.insert(v.name);
  for (const VariableShape& v : vars) {
    auto it = std::find_if(
        ckpt->tensors.begin(), ckpt->tensors.end(),
        [&](const CheckpointTensorData& t) { return t.name == v.name && t.slot.empty(); });
    if (it == ckpt->tensors.end() || it->shape != v.shape) {
      // Checkpoints from before batch norm kept running statistics lack them.
      const bool old_batch_norm = it == ckpt->tensors.end() && !v.trainable;
      return absl::InvalidArgumentError(absl::StrCat(
          "the newest checkpoint in ", CheckpointsDir(options_.model_dir), " does not fit model ",
          job_.model().name(), " (variable '", v.name, "'",
          old_batch_norm ? " missing: written before batch norm kept running statistics" : "",
          "): use another --model_dir"));
    }
  }
  for (CheckpointTensorData& t : ckpt->tensors) {
    if (wanted.contains(t.name) && (t.slot.empty() || same_optimizer))
      w.tensors.push_back(std::move(t));
  }
  w.step = ckpt->manifest.step();
  PSLOG(INFO) << "restoring from the checkpoint of step " << w.step << " (saved with "
              << ckpt->manifest.num_ps() << " ps"
              << (same_optimizer ? "" : ", optimizer slots reset") << ")";
  return w;
}

bool Coordinator::TryAdopt() {
  // After a restart of the chief alone, the ps may still hold the job: take
  // it over as it is rather than going back to a checkpoint, at the lowest
  // version of the ps. In sync mode they are at most one step apart (a step
  // half applied: its last pushes are on their way, or a worker died, or
  // was stopped, between its pushes to two ps and pushes the older step
  // again once back, which the ps past it answer STALE). The ps of an
  // asynchronous job count their versions apart (each is one consistent
  // state of its shard).
  const bool asynchronous = AppliesEachGradient(job_);
  for (int attempt = 0; attempt < options_.timeouts.adopt_attempts; ++attempt) {
    absl::StatusOr<std::vector<PsState>> looked = States(/*job_id=*/0);
    if (!looked.ok()) return false;
    const std::vector<PsState>& states = *looked;
    bool same = google::protobuf::util::MessageDifferencer::Equals(
        states[0].job(), AllReduce() ? ReplicaJob(job_) : job_);
    int64_t version = states[0].version(), newest = states[0].version();
    for (const PsState& st : states) {
      same = same && st.job_id() == states[0].job_id() && st.live_workers_size() > 0;
      version = std::min(version, st.version());
      newest = std::max(newest, st.version());
    }
    if (!same) return false;
    if (asynchronous || newest - version <= 1) {
      std::vector<int> live(states[0].live_workers().begin(), states[0].live_workers().end());
      if (AllReduce()) {
        // A replica's live set is its own worker; the job's is every worker.
        live.clear();
        for (int w = 0; w < job_.num_workers(); ++w) live.push_back(w);
      }
      {
        absl::MutexLock lock(&mu_);
        job_id_ = states[0].job_id();
        live_ = absl::flat_hash_set<int>(live.begin(), live.end());
        for (absl::Time& t : last_seen_) t = absl::Now();
      }
      progress_->Restart(version);
      progress_->SetLiveWorkers(live);
      last_checkpoint_step_ = version;
      PSLOG(INFO) << "adopting the running job at step " << version << " (" << live.size()
                  << " live workers)";
      return true;
    }
    absl::SleepFor(options_.timeouts.adopt_retry);  // look again
  }
  return false;
}

absl::Status Coordinator::LoadParameterServers(const Weights& weights) {
  std::vector<int> live;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    live = Sorted(live_);
    id = job_id_;
  }
  std::vector<std::string> slots = {""};
  for (const std::string& s : ps::Optimizer::SlotNames(job_.optimizer().kind())) slots.push_back(s);
  const std::vector<std::vector<const float*>> buffers =
      SlotBuffers(weights.tensors, job_.placement(), slots);
  RetryPolicy retry;
  retry.give_up = absl::Now() + options_.timeouts.startup;
  retry.stop = [this] {
    absl::MutexLock lock(&mu_);
    return Stopping();
  };
  absl::Status s = FanOut(pool_, job_.num_ps(), retry, [&](int p) {
    InitHeader header;
    header.set_job_id(id);
    header.set_ps_index(p);
    *header.mutable_job() = AllReduce() ? ReplicaJob(job_) : job_;
    header.set_version(weights.step);
    if (AllReduce()) {
      // Worker 0's replica: its own trainer pushes the all-reduced mean, as worker 0.
      header.add_live_workers(0);
    } else {
      for (int w : live) header.add_live_workers(w);
    }
    for (SliceSpec& spec : SliceSpecs(job_.placement(), p)) *header.add_slice() = std::move(spec);
    // wait_for_ready covers a ps not up yet; a connection that breaks under
    // the call (a ps going down as it is asked) is tried again.
    return ps_->Init(p, header, StateRefs(job_.placement(), p, buffers, slots), retry.give_up);
  });
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    if (Stopping()) return StoppedBySignal(stop_signal_);
    // A ps that refuses the job (another task index at that address, say)
    // refuses it again: INVALID_ARGUMENT and FAILED_PRECONDITION stay
    // permanent, an unreachable ps stays "unreachable", the rest is retryable.
    const bool keep = IsRetryable(s) || absl::IsInvalidArgument(s) || absl::IsFailedPrecondition(s);
    return absl::Status(keep ? s.code() : absl::StatusCode::kInternal,
                        absl::StrCat("cannot load the parameter servers: ", s.message()));
  }
  progress_->Restart(weights.step);
  progress_->SetLiveWorkers(live);
  last_checkpoint_step_ = weights.step;
  last_checkpoint_time_ = absl::Now();
  absl::MutexLock lock(&mu_);
  ready_ = true;
  if (options_.on_ready) options_.on_ready(true);
  for (absl::Time& t : last_seen_) t = absl::Now();  // the workers' timeouts start now
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PsState>> Coordinator::States(uint64_t job_id) {
  std::vector<PsState> states(job_.num_ps());
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_, job_.num_ps(), RetryPolicy(), [&](int p) {
    absl::StatusOr<PsState> st = ps_->GetState(p, absl::Now() + options_.timeouts.state_call);
    if (!st.ok()) return st.status();
    if (!st->holds_job()) return absl::NotFoundError(absl::StrCat("ps ", p, " holds no job"));
    if (job_id != 0 && st->job_id() != job_id) {
      return absl::FailedPreconditionError(absl::StrCat("ps ", p, " holds another job"));
    }
    states[p] = *std::move(st);
    return absl::OkStatus();
  }));
  witness_.Observe(states);  // what the workers' reports are held against
  return states;
}

int64_t Coordinator::MaxVersion(const std::vector<PsState>& states) {
  int64_t v = 0;
  for (const PsState& st : states) v = std::max(v, st.version());
  return v;
}

bool Coordinator::PsHealthy(int64_t* max_version) {
  absl::StatusOr<std::vector<PsState>> states = States(job_id());
  *max_version = states.ok() ? MaxVersion(*states) : 0;
  return states.ok();
}

bool Coordinator::EveryPsAtTheEnd() {
  absl::StatusOr<std::vector<PsState>> states = States(job_id());
  if (!states.ok()) return false;
  for (const PsState& st : *states) {
    if (st.version() < job_.train_steps()) return false;
  }
  return true;
}

void Coordinator::RepairLiveSets(const std::vector<PsState>& states) {
  if (AllReduce()) return;  // replicas wait for their own worker alone
  std::vector<int> live;
  {
    absl::MutexLock lock(&mu_);
    live = Sorted(live_);
  }
  for (size_t p = 0; p < states.size(); ++p) {
    // Joining workers are live from a later step: they count as members.
    std::vector<int> seen(states[p].live_workers().begin(), states[p].live_workers().end());
    seen.insert(seen.end(), states[p].joining_workers().begin(), states[p].joining_workers().end());
    std::sort(seen.begin(), seen.end());
    if (seen == live) continue;
    PSLOG(WARNING) << "ps " << p << " waits for workers [" << absl::StrJoin(seen, ",")
                   << "], the chief for [" << absl::StrJoin(live, ",") << "]; repairing every ps";
    // Workers a ps lacks join from the next step, as at a registration.
    absl::Status b = BroadcastLiveWorkers(live, MaxVersion(states) + 1);
    if (!b.ok())
      PSLOG(WARNING) << "cannot repair the live workers: " << b.message() << " ("
                     << absl::StatusCodeToString(b.code()) << ")";
    return;
  }
}

void Coordinator::CheckWorkers() {
  absl::MutexLock membership(&membership_mu_);
  std::vector<int> live;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (int w : Sorted(live_)) {
      if (now - last_seen_[w] <= options_.timeouts.worker || finished_.contains(w)) continue;
      if (AllReduce()) {
        // Between its registration and its first report a worker forms its
        // group (up to --startup_timeout, which the others' ring enforces).
        if (!reported_.contains(w)) continue;
        // The others cannot step without it.
        if (group_broken_.ok()) {
          group_broken_ = absl::UnavailableError(absl::StrCat(
              "worker ", w, " sent no heartbeat for ",
              absl::FormatDuration(options_.timeouts.worker),
              ": the all-reduce group is broken; every worker restarts from the newest "
              "checkpoint"));
          PSLOG(WARNING) << group_broken_.message();
        }
        return;
      }
      if (live_.size() == 1) break;  // the last one: nobody left to go on with
      live_.erase(w);
      PSLOG(WARNING) << "worker " << w << " sent no heartbeat for " << options_.timeouts.worker
                     << "; going on with " << live_.size() << " workers";
      live = Sorted(live_);
    }
  }
  if (live.empty()) return;
  absl::Status s = BroadcastLiveWorkers(live, 0);
  if (!s.ok())
    PSLOG(WARNING) << "cannot update the live workers: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
}

absl::Status Coordinator::Recover() {
  {
    absl::MutexLock lock(&mu_);
    // Decided with ready_ under one lock: a stop from here on cancels the
    // reload's calls (Stop).
    if (Stopping()) return StoppedBySignal(stop_signal_);
    PSLOG(WARNING)
        << "a parameter server is down or lost its shard; pausing the workers and reloading "
           "every ps from the newest checkpoint";
    ready_ = false;
    if (options_.on_ready) options_.on_ready(false);
    // A new job id: the workers' calls to the old one fail and they register again.
    job_id_ = NewJobId();
    finished_.clear();
  }
  PSFLOW_ASSIGN_OR_RETURN(Weights weights, InitialWeights());
  PSFLOW_RETURN_IF_ERROR(LoadParameterServers(weights));
  told_stopping_.clear();  // those were restarted
  PSLOG(INFO) << "parameter servers reloaded at step " << weights.step << "; training";
  return absl::OkStatus();
}

absl::Status Coordinator::Supervise() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (Stopping() || !failure_.ok() || !group_broken_.ok()) return true;
        for (int w : live_) {
          if (!finished_.contains(w)) return false;
        }
        return true;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), options_.timeouts.supervise_every);
      if (!failure_.ok()) return failure_;
      if (Stopping() || !group_broken_.ok()) break;
      if (wake()) return absl::OkStatus();
    }
    // One look at every ps per round: its health, its version, its live set
    // (repaired under membership_mu_, so no registration changes it between).
    absl::StatusOr<std::vector<PsState>> states;
    {
      absl::MutexLock membership(&membership_mu_);
      states = States(job_id());
      if (states.ok()) RepairLiveSets(*states);
    }
    if (!states.ok()) {
      {
        // A ps that went down as the chief was told to stop (a whole
        // cluster stopping): no reload, the stop's checkpoint below. A job
        // that failed meanwhile is not reloaded either.
        absl::MutexLock lock(&mu_);
        if (!failure_.ok()) return failure_;
        if (Stopping()) break;
      }
      PSFLOW_RETURN_IF_ERROR(Recover());
      continue;
    }
    const int64_t version = MaxVersion(*states);
    metrics_.SetGlobalStep(version);
    ResolveNonfinite(*states);
    CheckWorkers();
    if (!CheckpointForStoppingPs(*states, version)) continue;  // failed: the next round ends it
    CheckpointIfDue(version);
  }
  return CheckpointAndStop();
}

bool Coordinator::StopRequested() {
  absl::MutexLock lock(&mu_);
  return Stopping();
}

void Coordinator::LogStaleness() {
  absl::StatusOr<std::vector<PsState>> states = States(job_id());
  if (!states.ok()) return;  // best effort: the job is done either way
  int64_t count = 0, sum = 0, max = 0, gap = 0;
  for (const PsState& st : *states) {
    count += st.lag_count();
    sum += st.lag_sum();
    max = std::max(max, st.lag_max());
    gap = std::max(gap, st.clock_gap_max());
  }
  const std::string bound =
      job_.mode() == JobConfig::SSP ? absl::StrCat(" (ssp bound ", job_.staleness(), ")") : "";
  PSLOG(INFO) << absl::StrFormat(
      "staleness over the job: %d gradients applied, versions behind mean %.2f max %d; "
      "largest lead of a worker over the slowest %d steps%s",
      count, count > 0 ? static_cast<double>(sum) / static_cast<double>(count) : 0.0, max, gap,
      bound);
}

void Coordinator::ReleaseEveryone() {
  bool stopping = false;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    // Workers learn it from their next report; give them a little while.
    // Every finished worker, or after a failure every live one, is told.
    auto all_released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (Stopping()) return true;
      if (failure_.ok()) return released_.size() >= finished_.size();
      for (int w : live_) {
        if (!released_.contains(w)) return false;
      }
      return true;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_released), options_.timeouts.release_wait)) {
      PSLOG(WARNING) << "not every worker collected its exit order";
    }
    stopping = Stopping();
    exit_orders_out_ = true;  // a stop from here on cancels them (Stop)
  }
  const uint64_t id = job_id();
  // A chief told to stop has its grace period left, no more: the ps still
  // up take the order at once, and one gone with the cluster must not hold
  // the chief up.
  const absl::Time deadline = absl::Now() + (stopping ? std::min(options_.timeouts.control_call,
                                                                 options_.timeouts.stop_release)
                                                      : options_.timeouts.control_call);
  absl::Status s = FanOut(pool_, job_.num_ps(), RetryPolicy(),
                          [&](int p) { return ps_->Shutdown(p, id, deadline); });
  if (!s.ok())
    PSLOG(WARNING) << "a ps did not take the exit order: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
}

absl::Status Coordinator::StartJob() {
  if (TryAdopt()) {
    absl::MutexLock lock(&mu_);
    ready_ = true;
    if (options_.on_ready) options_.on_ready(true);
    return absl::OkStatus();
  }
  PSFLOW_ASSIGN_OR_RETURN(const Weights weights, InitialWeights());
  PSFLOW_RETURN_IF_ERROR(LoadParameterServers(weights));
  PSLOG(INFO) << "parameter servers loaded at step " << weights.step << "; training";
  return absl::OkStatus();
}

bool Coordinator::Conclude(absl::Status* status) {
  {
    absl::MutexLock lock(&mu_);
    trained_ = true;
  }
  // The last checkpoint holds the final step: a restarted job finds it done.
  Checkpoint final_checkpoint;
  absl::Status s = TakeCheckpoint(&final_checkpoint);
  if (Failed()) return false;
  if (!s.ok())
    PSLOG(WARNING) << "no final checkpoint: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
  // It holds the final weights too, unless a ps had gone past
  // train_steps: then they are pulled again.
  const bool reuse = s.ok() && final_checkpoint.manifest.step() == job_.train_steps();
  *status = SaveModel(reuse ? &final_checkpoint : nullptr);
  // The ps still hold the final weights for an evaluator to take.
  if (status->ok()) evaluators_.WaitForFinal();
  return true;
}

void Coordinator::LogDone() {
  const Progress::Summary s = progress_->summary();
  std::string eval;
  if (const std::optional<EvalResult> r = evaluators_.final_result(); r.has_value()) {
    eval = absl::StrFormat(", test loss %.4f acc %.4f%s (evaluator)", r->loss(),
                           static_cast<double>(r->correct()) / static_cast<double>(r->examples()),
                           AucText(*r));
  }
  std::string line = absl::StrFormat("done: %d steps", job_.train_steps());
  if (s.examples == 0) {
    // Restored (or adopted) at the last step: no loss or accuracy to give.
    line += ", all trained before this run (it started at the last step)";
  } else {
    absl::StrAppendFormat(&line, ", %d examples in %.1f s", s.examples,
                          absl::ToDoubleSeconds(s.elapsed));
    // One logged interval, the first, counts start-up: no rate then.
    line += s.examples_per_sec > 0
                ? absl::StrFormat(", %.0f ex/s after the first interval", s.examples_per_sec)
                : " (too few logged intervals for a rate after the first)";
    absl::StrAppendFormat(&line, ", final loss %.4f acc %.3f", s.last_loss, s.last_accuracy);
    if (s.clipped > 0) absl::StrAppendFormat(&line, ", %d worker steps clipped", s.clipped);
  }
  PSLOG(INFO) << line << eval;
}

absl::Status Coordinator::Run() {
  // Find out now, not after training, that the outputs cannot be written.
  // That is a matter of configuration: permanent. The saved model's
  // directory is only made when the model is written, so that a failed job
  // leaves none.
  absl::Status writable = model::CheckSavedModelDir(SavedModelDir());
  if (writable.ok()) writable = MakeDirectories(CheckpointsDir(options_.model_dir));
  if (!writable.ok()) return absl::FailedPreconditionError(writable.message());
  PSLOG(INFO) << DescribeJob(job_);
  absl::Status status = StartJob();
  if (status.ok()) status = Supervise();
  bool trained = status.ok();
  if (trained) trained = Conclude(&status);
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) status = failure_;
    if (Stopping() && status.ok()) status = StoppedBySignal(stop_signal_);
  }
  if (trained && AppliesEachGradient(job_)) LogStaleness();
  // Once training is over (or failed), ps and workers have nothing left to
  // do, whether or not the saved model could be written.
  if (trained || Failed()) ReleaseEveryone();
  if (status.ok()) LogDone();
  return status;
}

}  // namespace psflow::chief
