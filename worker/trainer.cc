#include "worker/trainer.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "data/source.h"
#include "worker/clip.h"
#include "worker/device_replica.h"
#include "worker/replica_tensors.h"
#include "worker/ring_exchange.h"

namespace psflow::worker {
namespace {

// A ps that holds another job (the chief reloaded it) or none (it restarted
// empty), drops this worker, or answers from another version than its peers
// (mid-reload): register again.
bool JobChanged(const absl::Status& s) {
  return absl::IsFailedPrecondition(s) || absl::IsAborted(s);
}

// A failed ps call: a peer that stayed unreachable keeps its code (exit code
// 138); anything else is worth a retry of the whole worker (INTERNAL: 140).
absl::Status PsFailure(const absl::Status& s, absl::string_view what) {
  if (IsRetryable(s)) return absl::Status(s.code(), absl::StrCat(what, " failed: ", s.message()));
  return absl::InternalError(
      absl::StrCat(what, " failed: ", s.message(), " (", absl::StatusCodeToString(s.code()), ")"));
}

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// The exchange of step `step`: the gradients of `push_step` (in an
// asynchronous job this worker's clock), then the weights of the next.
StepPush PushOf(int64_t step, int64_t push_step) {
  StepPush push;
  push.step = step;
  push.push_step = push_step;
  push.min_version = push_step + 1;
  return push;
}

}  // namespace

Trainer::Trainer(TrainerOptions options, chief::Client* chief, PsClientFactory make_ps)
    : options_(std::move(options)),
      chief_(chief),
      make_ps_(std::move(make_ps)),
      reporter_({options_.worker_index, options_.report_every, options_.report_timeout,
                 options_.startup_timeout, options_.nonfinite_wait},
                chief, [this] { CancelPs(); }) {}

Trainer::~Trainer() {
  // The lanes' uploads end before the buffers they read go.
  exchange_.reset();
}

void Trainer::Stop(int signal) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ == 0) stop_signal_ = signal;
    if (ps_ != nullptr) ps_->CancelAll();  // a pull blocked on the other workers ends now
    chief_->CancelAll();                   // so does a registration waiting for the chief
    if (options_.ring != nullptr) options_.ring->Cancel();  // and an all-reduce
  }
  reporter_.Stop();  // and the waits for the chief
}

void Trainer::CancelPs() {
  absl::MutexLock lock(&mu_);
  if (ps_ != nullptr) ps_->CancelAll();
}

void Trainer::StopAfterPushes(int signal, absl::Duration max_wait) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ != 0) return;
    if (pushes_open_) {
      if (stop_after_pushes_ == 0) stop_after_pushes_ = signal;
      PSLOG(INFO) << "stopping once the pushes of step " << reporter_.step() << " are answered";
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_signal_ != 0; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped), max_wait)) return;
      // (In a synchronous job a push is answered once every worker pushed
      // the step: one that was between steps when it was told stopped at
      // once.)
      PSLOG(INFO) << "the pushes of step " << reporter_.step() << " were not answered within "
                  << absl::FormatDuration(max_wait)
                  << " (another worker may have stopped before pushing it): stopping without "
                     "them";
    }
  }
  Stop(signal);
}

bool Trainer::StopPending() const {
  absl::MutexLock lock(&mu_);
  return stop_after_pushes_ != 0;
}

void Trainer::OpenPushes() {
  absl::MutexLock lock(&mu_);
  pushes_open_ = true;
}

void Trainer::ClosePushes() {
  int signal = 0;
  {
    absl::MutexLock lock(&mu_);
    pushes_open_ = false;
    std::swap(signal, stop_after_pushes_);
  }
  if (signal != 0) Stop(signal);
}

TrainerStatus Trainer::Status() const {
  TrainerStatus status;
  status.worker = options_.worker_index;
  status.job_id = job_id_;
  status.step = reporter_.step();
  status.finished = reporter_.finished();
  return status;
}

bool Trainer::Stopping() const { return stop_signal() != 0 || reporter_.job_failed(); }

absl::Status Trainer::FromPs(const absl::Status& s) const {
  if (!absl::IsCancelled(s)) return s;
  return worker::FromPs(s, Stopping());
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
      // Metrics not yet reported belong to a job that is gone: its steps
      // are done again.
      reporter_.Registered(response->job_id());
      job_id_ = response->job_id();
      ring_key_ = response->ring_key();
      if (first) {
        absl::MutexLock lock(&mu_);
        ps_ = std::move(client);
        if (stop_signal_ != 0) ps_->CancelAll();  // Stop came before there was a client to cancel
      }
      SetRegistered(true);
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

void Trainer::SetRegistered(bool registered) const {
  if (options_.on_registered) options_.on_registered(registered);
}

absl::Status Trainer::Prepare() {
  PSFLOW_RETURN_IF_ERROR(CheckJob());
  if (AllReduce()) {
    if (options_.ring == nullptr || options_.ring->size() != job_.num_workers() ||
        options_.replica == nullptr) {
      return absl::FailedPreconditionError(
          "the chief runs a job without ps (all-reduce), but this worker was started for a "
          "cluster with ps: give every process the same cluster");
    }
    if (options_.worker_index != 0) PSFLOW_RETURN_IF_ERROR(LoadReplica());
    options_.ring->Open(job_id_, job_.allreduce_bucket_bytes(), ring_key_);
  }
  absl::StatusOr<std::unique_ptr<ModelReplicas>> model =
      ModelReplicas::Create(options_.device, job_);
  if (!model.ok()) return model.status();
  model_ = *std::move(model);
  PSFLOW_RETURN_IF_ERROR(LoadData());
  // A GPU worker of a job with ps (one replica) copies each bucket of
  // gradients out as soon as the backward pass has written it.
  HostStagingOptions staging;
  staging.wire = WireDtypeOf(job_);
  staging.copy_buckets = !AllReduce() && !model_->several();
  staging.narrow_on_device = options_.narrow_on_device && !Clipping();
  staging.gradients_to_shared_memory = options_.gradients_to_shared_memory;
  absl::StatusOr<std::unique_ptr<HostStaging>> staged =
      HostStaging::Create(staging, model_->net(), model_->backend(), ps());
  if (!staged.ok()) return staged.status();
  staging_ = *std::move(staged);
  model_->net()->SetGradientsReady(nullptr);
  return MakeExchange();
}

absl::Status Trainer::CheckJob() const {
  if (job_.num_ps() < 1 || job_.num_ps() != ps()->num_ps() || job_.batch_size() < 1 ||
      job_.steps_per_epoch() < 1 || job_.num_workers() <= options_.worker_index ||
      job_.placement().num_ps() != job_.num_ps()) {
    return absl::FailedPreconditionError("the chief sent an inconsistent job");
  }
  if (WireDtypeOf(job_) == DT_INVALID) {
    return absl::FailedPreconditionError(
        absl::StrCat("the chief sent unknown wire dtype ", job_.wire_dtype()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::LoadData() {
  const data::ModelInput input = data::ModelInputOf(job_.model());
  if (data::IsStreamed(job_.data().format())) {
    // The chief counted the files; the batches read them as steps go.
    absl::StatusOr<std::unique_ptr<data::DataFormat>> format =
        data::OpenDataFormat(job_.data(), input.shape, data::Split::kTrain);
    if (!format.ok()) return Permanent(format.status());
    format_ = *std::move(format);
    data_ = data::Dataset();
    return absl::OkStatus();
  }
  format_.reset();
  DataConfig config = job_.data();
  config.set_synthetic_examples(job_.num_examples());
  absl::StatusOr<data::Dataset> data = data::LoadDataset(config, input, data::Split::kTrain);
  if (!data.ok()) return Permanent(data.status());
  data_ = *std::move(data);
  if (data_.count != job_.num_examples()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this worker sees ", data_.count, " training examples in ", job_.data().data_dir(),
        ", the chief saw ", job_.num_examples(), ": every process needs the same data"));
  }
  return absl::OkStatus();
}

ExchangeHooks Trainer::Hooks() {
  ExchangeHooks hooks;
  hooks.stop_signal = [this] { return stop_signal(); };
  hooks.stopping = [this] { return Stopping(); };
  hooks.stop_pending = [this] { return StopPending(); };
  hooks.open_pushes = [this] { OpenPushes(); };
  hooks.close_pushes = [this] { ClosePushes(); };
  return hooks;
}

absl::StatusOr<std::unique_ptr<PsExchange>> Trainer::MakeLanes() {
  PsExchangeOptions o;
  o.worker_index = options_.worker_index;
  // A replica of an all-reduce job hears its own worker alone, as worker 0.
  o.push_worker = AllReduce() ? 0 : options_.worker_index;
  o.pull_wait = options_.pull_wait;
  o.transfer_timeout = options_.transfer_timeout;
  o.startup_timeout = options_.startup_timeout;
  o.upload_from_shared_memory = options_.upload_from_shared_memory;
  o.plan.lanes_per_ps = options_.lanes_per_ps;
  o.plan.lane_bytes = options_.lane_bytes;
  o.plan.min_run_bytes = options_.min_run_bytes;
  o.async = Async();
  o.skip_nonfinite = job_.on_nonfinite() == JobConfig::SKIP_STEP;
  o.push_during_backward = options_.push_during_backward && !AllReduce() && !model_->several() &&
                           job_.on_nonfinite() == JobConfig::FAIL && !Clipping();
  // Pulls and pushes to a replica (all-reduce) stay in this process: fp32.
  o.dtype = AllReduce() ? DT_FLOAT : WireDtypeOf(job_);
  o.max_gradient_abs = job_.max_gradient_abs();
  o.trace = options_.trace;
  o.trace_step = &trace_step_;
  o.job_id = &job_id_;
  PsExchangeBuffers b;
  b.net = model_->net();
  b.backend = model_->backend();
  b.in_place = staging_->in_place();
  b.weights = staging_->weights();
  b.grads.assign(staging_->grads().begin(), staging_->grads().end());
  b.narrowed = staging_->narrowed();
  b.upload_after = staging_->upload_after();
  b.buckets = staging_->bucket_variables();
  return PsExchange::Create(o, Hooks(), ps(), job_.placement(), std::move(b));
}

absl::Status Trainer::MakeExchange() {
  absl::StatusOr<std::unique_ptr<PsExchange>> lanes = MakeLanes();
  if (!lanes.ok()) return lanes.status();
  // Pushing during the backward pass, each bucket's copies to the host
  // record an event that the step waits for before it tells the lanes.
  const bool early = (*lanes)->pushes_during_step();
  if (early) PSFLOW_RETURN_IF_ERROR(staging_->RecordCopies());
  const int count = (*lanes)->lanes();
  if (!AllReduce()) {
    exchange_ = *std::move(lanes);
  } else {
    absl::StatusOr<std::unique_ptr<Exchange>> device = MakeDeviceReplica();
    if (!device.ok()) return device.status();
    // On a CPU the ring starts during the backward pass: each variable's
    // piece is ready once its layer's backward is done (the last variables
    // first), the loss once the step returns.
    const bool overlap = staging_->in_place() && !model_->several() && options_.ring->size() > 1;
    exchange_ = *device != nullptr ? *std::move(device)
                                   : std::make_unique<RingExchange>(
                                         options_.ring, WireDtypeOf(job_), *std::move(lanes),
                                         model_->net(), staging_->grads(), overlap, Hooks());
  }
  PSLOG(INFO) << "joined job: " << job_.num_examples() << " training examples, "
              << model_->Description() << ", " << job_.num_ps() << " ps, " << count
              << (count == 1 ? " lane" : " lanes")
              << (early ? ", pushing during the backward pass" : "")
              << (Clipping() ? absl::StrCat(", clipping gradients to global norm ",
                                            job_.clip_gradient_norm(),
                                            " (pushes wait for the whole backward pass)")
                             : "");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Exchange>> Trainer::MakeDeviceReplica() {
  absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> peers = FormGpuGroup(
      options_.ring, model_->backend(), !staging_->in_place(), options_.worker_index,
      WireDtypeOf(job_), options_.startup_timeout, [this] { return stop_signal(); },
      [this] { return GroupAbandoned(); });
  if (!peers.ok()) return peers.status();
  // GPU workers that average on their devices (or one alone) keep the
  // replica there too; CPU workers, and a group that mixes CPUs and GPUs,
  // apply to the shard.
  if (staging_->in_place() || (*peers == nullptr && options_.ring->size() != 1)) return nullptr;
  DeviceReplicaOptions o;
  o.worker_index = options_.worker_index;
  o.transfer_timeout = options_.transfer_timeout;
  o.replica = options_.replica;
  o.client = ps();
  o.ring = options_.ring;
  o.job_id = &job_id_;
  absl::StatusOr<std::unique_ptr<DeviceReplica>> device =
      DeviceReplica::Create(job_, o, Hooks(), model_.get(), *std::move(peers));
  if (!device.ok()) return device.status();
  return std::unique_ptr<Exchange>(*std::move(device));
}

bool Trainer::Async() const { return AppliesEachGradient(job_); }

bool Trainer::GroupAbandoned() const {
  return Stopping() || (options_.ring != nullptr && !options_.ring->status().ok());
}

absl::Status Trainer::LoadReplica() {
  // Worker 0's replica (the chief loaded it) is at the step the group
  // starts from: it cannot move on before this worker takes part.
  ps::Client* const source = ps();
  const absl::Time deadline = absl::Now() + options_.transfer_timeout;
  absl::StatusOr<PsState> state = source->GetState(0, deadline);
  if (!state.ok()) return FromPs(state.status());
  if (state->job_id() != job_id_) return RegisterAgain("worker 0's replica holds another job");
  ReplicaTensors tensors(job_);
  PSFLOW_RETURN_IF_ERROR(FromPs(
      source->Snapshot(0, job_id_, state->version(), tensors.Sinks(job_.placement()), deadline)));
  std::unique_ptr<ps::Client> own = options_.replica->Connect();
  InitHeader header;
  header.set_job_id(job_id_);
  header.set_ps_index(0);
  *header.mutable_job() = ReplicaJob(job_);
  header.set_version(state->version());
  header.add_live_workers(0);  // this worker's own trainer, pushing as worker 0
  for (SliceSpec& spec : SliceSpecs(job_.placement(), 0)) *header.add_slice() = std::move(spec);
  PSFLOW_RETURN_IF_ERROR(FromPs(own->Init(0, header, tensors.Refs(job_.placement()), deadline)));
  PSLOG(INFO) << "loaded this worker's replica from worker 0's at step " << state->version();
  absl::MutexLock lock(&mu_);
  ps_ = std::move(own);
  if (stop_signal_ != 0) ps_->CancelAll();
  return absl::OkStatus();
}

void Trainer::LogReplicaDigest() {
  ReplicaTensors tensors(job_);
  absl::Status s = ps()->Snapshot(0, job_id_, job_.train_steps(), tensors.Sinks(job_.placement()),
                                  absl::Now() + options_.transfer_timeout);
  if (!s.ok()) {
    PSLOG(WARNING) << "cannot read this worker's replica: " << s.message();
    return;
  }
  uint32_t crc = 0;
  for (const auto& slot : tensors.buffers) {
    for (const std::vector<float>& b : slot) {
      crc = ExtendCrc32c(crc, absl::string_view(reinterpret_cast<const char*>(b.data()),
                                                b.size() * sizeof(float)));
    }
  }
  PSLOG(INFO) << absl::StrFormat(
      "replica at step %d: crc32c %08x of its values and optimizer state (the same on every "
      "worker)",
      job_.train_steps(), crc);
}

absl::Status Trainer::NonFinite(int64_t step) {
  // No gradient that is not finite was pushed; the chief decides what
  // happens next.
  StepMetrics m;
  m.set_step(step);
  m.set_examples(WorkerBatch(job_));
  m.set_nonfinite(true);
  // The job's policy is to fail: wait (a little) for the chief to confirm.
  reporter_.NonFinite(std::move(m));
  return absl::FailedPreconditionError(
      absl::StrCat("step ", step, ": the loss or the gradients are not finite"));
}

// Where Train's loop is between steps.
struct Trainer::Position {
  int64_t step = 0;
  // An asynchronous job counts this worker's own steps (its clock, as the
  // ps count its gradients); its data follow them.
  int64_t clock = 0;
  // The outcome of the latest round of pulls: the weights the next step
  // uses, and the time they took (pull and wait, reported with that step).
  ExchangeRound got;
  bool have_weights = false;
  int64_t pull_us = 0, wait_us = 0;
  // Steps in an epoch of this worker's data: in an asynchronous job
  // steps_per_epoch counts the steps of every worker.
  int64_t steps_per_epoch = 0;
};

absl::Status Trainer::Train(int64_t start) {
  Position at;
  at.step = start;
  at.steps_per_epoch = Async() ? std::max<int64_t>(job_.steps_per_epoch() / job_.num_workers(), 1)
                               : job_.steps_per_epoch();
  std::unique_ptr<WorkerBatches> batches;
  if (format_ != nullptr) {
    absl::StatusOr<std::unique_ptr<WorkerBatches>> streamed = WorkerBatches::Streamed(
        format_.get(), job_, options_.worker_index, at.steps_per_epoch, options_.input_threads);
    if (!streamed.ok()) return exchange_->Finish(Permanent(streamed.status()));
    batches = *std::move(streamed);
  } else {
    batches = std::make_unique<WorkerBatches>(data_, job_, options_.worker_index);
  }
  absl::Status s;
  while (s.ok()) {
    s = Interrupted(/*stop=*/true);
    if (s.ok() && !at.have_weights) s = FirstPull(&at);
    if (!s.ok() || at.got.version >= job_.train_steps()) break;
    s = TrainStep(*batches, &at);
  }
  if (const std::string summary = batches->Summary(); !summary.empty()) PSLOG(INFO) << summary;
  return exchange_->Finish(s);
}

absl::Status Trainer::Interrupted(bool stop) const {
  if (reporter_.job_failed()) return absl::FailedPreconditionError("the chief failed the job");
  if (reporter_.reregister()) return RegisterAgain("the chief asked for a new registration");
  if (const int sig = stop_signal(); stop && sig != 0) return StoppedBySignal(sig);
  return absl::OkStatus();
}

absl::Status Trainer::ExchangeFailure(const absl::Status& s, absl::string_view what) const {
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (reporter_.job_failed()) return absl::FailedPreconditionError("the chief failed the job");
  if (JobChanged(s)) return RegisterAgain(s.message());
  if (!s.ok()) return PsFailure(s, what);
  return absl::OkStatus();
}

absl::Status Trainer::FirstPull(Position* at) {
  const absl::Time t0 = absl::Now();
  // Asynchronous: whatever this worker's clock is on the ps.
  PSFLOW_RETURN_IF_ERROR(
      ExchangeFailure(exchange_->Pull(Async() ? 0 : at->step, &at->got), "pull"));
  at->have_weights = true;
  at->clock = at->got.clock;
  const int64_t took = Micros(absl::Now() - t0);
  at->wait_us = std::min(at->got.wait_us, took);
  at->pull_us = took - at->wait_us;
  return absl::OkStatus();
}

absl::StatusOr<model::Network::Result> Trainer::Compute(const WorkerBatches& batches) {
  const int batch = job_.batch_size();  // per replica
  if (model_->several()) {
    absl::StatusOr<model::Network::Result> result =
        model_->Step(batches.images(), batches.ids(), batches.labels(), batch,
                     batches.example_floats(), batches.model_ids());
    if (result.ok()) PSFLOW_RETURN_IF_ERROR(exchange_->StepQueued());  // it ran
    return result;
  }
  // The ids of the model's embedding layers, for the step queued next.
  if (batches.ids() != nullptr) PSFLOW_RETURN_IF_ERROR(model_->net()->SetIds(batches.ids(), batch));
  if (staging_->copies_buckets()) {
    return staging_->StepCopyingGradients(batches.images(), batches.labels(), batch,
                                          exchange_.get(), options_.trace, trace_step_);
  }
  // The network's TrainStep, with the exchange told between the step's
  // queueing and its end.
  model::Network* const net = model_->net();
  PSFLOW_RETURN_IF_ERROR(net->SetInputs(batches.images(), batches.labels(), batch));
  PSFLOW_RETURN_IF_ERROR(net->StartTrainStep(batch));
  PSFLOW_RETURN_IF_ERROR(exchange_->StepQueued());
  return net->FinishStep(batch);
}

absl::Status Trainer::TrainStep(WorkerBatches& batches, Position* at) {
  const absl::Time t1 = absl::Now();
  const bool async = Async();
  const int64_t step = at->got.version;
  trace_step_ = step;
  if (options_.trace != nullptr) options_.trace->Reached(step);
  // Until the step's exchange is over (the next weights are in).
  TraceSpan step_span(options_.trace, "step", step);
  TraceSpan input_span(options_.trace, "input", step);
  absl::Status s = batches.Gather(async ? at->clock : step, at->steps_per_epoch);
  input_span.End();
  // A record that cannot be read or decoded fails the job (no retry mends
  // it), unless the job skips bad records.
  if (!s.ok()) return Permanent(s, absl::StrCat("the input of step ", step, ": "));
  const int64_t input_us = Micros(absl::Now() - t1);
  // The step's outcome, and its metrics, which go out once every push is
  // answered (the pull that follows belongs to the next step).
  absl::StatusOr<model::Network::Result> result = absl::UnknownError("no step");
  absl::Time t2, pushed_at;
  StepMetrics async_metrics;
  bool clipped = false;
  StepPush push = PushOf(step, async ? at->clock : step);
  push.on_pushed = [&](absl::Time last_answer, bool skip) {
    // (Pushes during the backward pass may all be answered before the
    // step ends: then nothing of them is left to count as push time.)
    pushed_at = std::max(last_answer, t2);
    StepMetrics m;
    m.set_step(step);
    m.set_nonfinite(skip);  // the chief counts the skipped steps
    m.set_clipped(clipped && !skip);
    m.set_loss(skip ? 0 : result->loss);
    m.set_correct(result->correct);
    m.set_examples(batches.size());
    SetTimes(*at, t1, t2, pushed_at, &m);
    m.set_input_us(input_us);
    if (async) {
      async_metrics = std::move(m);  // reported with its staleness, once pulled
      return;
    }
    reporter_.Add(std::move(m));
  };
  // An exchange that overlaps the step starts now (the step's result and t2
  // are set before on_pushed runs).
  if (s.ok()) exchange_->BeginStep(push, &at->got);
  TraceSpan compute_span(options_.trace, "compute", step);
  result = s.ok() ? Compute(batches) : absl::StatusOr<model::Network::Result>(s);
  compute_span.End();
  exchange_->EndCompute(result.ok() ? absl::StatusOr<double>(result->loss) : result.status());
  if (result.ok() && exchange_->NeedsHostGradients()) s = staging_->FetchGradients();
  if (!result.ok() || !s.ok()) {
    // (Pushing during the backward pass, gradients are never fetched after
    // the step: a failure here is the step's.)
    exchange_->Abandon();
    const absl::Status& e = result.ok() ? s : result.status();
    return absl::InternalError(absl::StrCat("step ", step, " failed: ", e.message()));
  }
  t2 = absl::Now();
  push.loss = result->loss;
  push.mean_loss = static_cast<float>(result->loss);
  PSFLOW_RETURN_IF_ERROR(exchange_->Reduce(step, &push.mean_loss));
  PSFLOW_RETURN_IF_ERROR(Clip(&clipped));
  PSFLOW_RETURN_IF_ERROR(PushStep(push, &at->got));
  Advance(step, pushed_at, async ? &async_metrics : nullptr, at);
  return absl::OkStatus();
}

void Trainer::SetTimes(const Position& at, absl::Time t1, absl::Time t2, absl::Time pushed_at,
                       StepMetrics* m) {
  m->set_wait_us(at.wait_us);
  m->set_pull_us(at.pull_us);
  m->set_compute_us(Micros(t2 - t1));
  m->set_push_us(Micros(pushed_at - t2));
}

void Trainer::Advance(int64_t step, absl::Time pushed_at, StepMetrics* async_metrics,
                      Position* at) {
  // After the pushes: waiting for the version (for the other workers and
  // the ps's applies), and the pull itself.
  const int64_t after_push = Micros(absl::Now() - pushed_at);
  at->wait_us = std::min(at->got.wait_us, after_push);
  at->pull_us = after_push - at->wait_us;
  at->step = step + 1;
  register_backoff_.Reset();
  if (async_metrics != nullptr) {
    // The pull waited for this gradient's apply (unless the job ended
    // first): its staleness is known.
    async_metrics->set_staleness(at->got.lag);
    reporter_.Add(std::move(*async_metrics));
    at->clock = std::max(at->clock + 1, at->got.clock);
    at->step = at->got.version;
  }
  reporter_.SetStep(at->step);
}

absl::Status Trainer::Clip(bool* clipped) {
  *clipped = false;
  if (!Clipping()) return absl::OkStatus();
  if (!exchange_->NeedsHostGradients()) {
    return exchange_->ClipOnDevice(job_.clip_gradient_norm(), clipped);
  }
  // What the worker pushes: the host buffers, after the average over its
  // GPUs or the all-reduce (every worker of a ring clips the same bits
  // alike). Batch-norm running statistics are not gradients: left alone.
  const std::vector<VariableShape>& variables = model_->net()->variables();
  const std::vector<float*>& grads = staging_->grads();
  if (grads.size() != variables.size()) {
    return absl::InternalError("clipping: the gradients are not in fp32 on the host");
  }
  std::vector<absl::Span<float>> trained;
  for (size_t v = 0; v < variables.size(); ++v) {
    if (variables[v].trainable) trained.emplace_back(grads[v], NumElements(variables[v].shape));
  }
  *clipped = ClipByGlobalNorm(trained, job_.clip_gradient_norm()).clipped;
  return absl::OkStatus();
}

absl::Status Trainer::PushStep(const StepPush& push, ExchangeRound* got) {
  StepVerdictKind verdict = StepVerdictKind::kFinite;
  const absl::Status s = exchange_->PushStep(push, &verdict, got);
  if (verdict == StepVerdictKind::kNotFinite) {
    PSLOG(ERROR) << "step " << push.step << ": the loss (" << push.loss
                 << ") or the gradients are not finite (in the wire dtype); nothing pushed";
    return NonFinite(push.step);
  }
  if (verdict == StepVerdictKind::kNotFiniteMean) {
    PSLOG(ERROR) << "step " << push.step << ": the mean loss (" << push.mean_loss
                 << ") or the mean gradients are not finite; nothing applied";
    return NonFinite(push.step);
  }
  // (Lanes stopped by a signal or by the chief's FAIL leave the verdict
  // failed too: that is not this step's fault.)
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (reporter_.job_failed()) return absl::FailedPreconditionError("the chief failed the job");
  if (verdict == StepVerdictKind::kNotFiniteAfterPushes) {
    PSLOG(ERROR) << "step " << push.step << ": the loss (" << push.loss
                 << ") or the gradients are not finite (in the wire dtype); lanes of finite "
                    "gradients may have pushed them, the others did not";
    return NonFinite(push.step);
  }
  return ExchangeFailure(s, "exchange with the ps");
}

absl::Status Trainer::TrainAndWait() {
  while (true) {
    absl::Status s = Train(start_step_);
    if (IsRegisterAgain(s) && AllReduce()) {
      // The group formed for this job; it forms again only from the start.
      s = absl::UnavailableError(absl::StrCat(
          "the job changed under this worker's all-reduce group (", s.message(), "); restarting"));
    }
    if (IsRegisterAgain(s)) {
      PSLOG(INFO) << "the job was reloaded or this worker was dropped; registering again ("
                  << s.message() << ")";
      SetRegistered(false);
      // While the chief reloads the ps, registering again at once just spins.
      absl::SleepFor(register_backoff_.Next());
      s = Register();
      if (s.ok()) continue;
    }
    // Before the chief hears that this worker finished (and ends the job).
    if (s.ok() && AllReduce()) LogReplicaDigest();
    if (!s.ok()) {
      reporter_.EndLoop();
      return s;
    }
    switch (reporter_.FinishAndWait()) {
      case Reporter::Order::kExit:
        return absl::OkStatus();  // Run tells EXIT and FAIL apart
      case Reporter::Order::kStopped:
        return StoppedBySignal(stop_signal());
      case Reporter::Order::kReportFailed:
        return reporter_.report_error();
      case Reporter::Order::kRegisterAgain:
        break;  // the chief went back to a checkpoint: train on
    }
    if (AllReduce()) {
      reporter_.EndLoop();
      return absl::UnavailableError(
          "the chief went back to a checkpoint; the all-reduce group forms again from the start");
    }
    SetRegistered(false);
    absl::Status s2 = Register();
    if (!s2.ok()) {
      reporter_.EndLoop();
      return s2;
    }
  }
}

absl::Status Trainer::Run() {
  absl::Status s = Register();
  if (s.ok()) s = Prepare();
  if (!s.ok()) {
    SetRegistered(false);
    if (AllReduce() && options_.ring != nullptr) options_.ring->Leave(s);
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    return s;
  }
  std::thread reporter([this] { reporter_.Loop(); });
  s = TrainAndWait();
  reporter.join();
  SetRegistered(false);
  // Without ps, this worker's failure leaves its group: the others stop
  // waiting for it (on the ring or their GPUs) at once.
  if (!s.ok() && AllReduce() && options_.ring != nullptr) options_.ring->Leave(s);
  // The chief's verdict wins over how training ended (a pull it cancelled).
  if (reporter_.job_failed()) {
    return absl::FailedPreconditionError("the chief failed the job; exiting");
  }
  // So does a stop signal over what the stop made fail.
  if (const int sig = stop_signal(); !s.ok() && sig != 0) return StoppedBySignal(sig);
  if (s.ok()) PSLOG(INFO) << "released by the chief; exiting";
  return s;
}

}  // namespace psflow::worker
