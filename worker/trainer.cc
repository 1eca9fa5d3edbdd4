#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "data/source.h"
#include "ps/local_client.h"
#include "ps/optimizer.h"
#include "worker/ps_exchange.h"
#include "worker/ring_exchange.h"

namespace psflow::worker {
namespace {

// Floats of page-locked memory that another owner keeps (the push region).
class BorrowedBuffer final : public kernels::Buffer {
 public:
  BorrowedBuffer(float* data, size_t size) : data_(data), size_(size) {}
  float* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* const data_;
  const size_t size_;
};

// Floats of a variable's gradient buffer on the host, for `n` values: 16-bit
// ones (rounded on the device, `narrow`) two to a float.
int64_t HostGradientFloats(int64_t n, bool narrow) { return narrow ? (n + 1) / 2 : n; }

// Bytes of the push region for a buffer of `floats` floats.
int64_t PushRegionBytes(int64_t floats) {
  return (floats * static_cast<int64_t>(sizeof(float)) + kSharedAlign - 1) / kSharedAlign *
         kSharedAlign;
}

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
  const int index = options_.worker_index;
  if (job_.num_ps() < 1 || job_.num_ps() != ps()->num_ps() || job_.batch_size() < 1 ||
      job_.steps_per_epoch() < 1 || job_.num_workers() <= index ||
      job_.placement().num_ps() != job_.num_ps()) {
    return absl::FailedPreconditionError("the chief sent an inconsistent job");
  }
  if (WireDtypeOf(job_) == DT_INVALID) {
    return absl::FailedPreconditionError(
        absl::StrCat("the chief sent unknown wire dtype ", job_.wire_dtype()));
  }
  const DataType wire = WireDtypeOf(job_);
  if (AllReduce()) {
    if (options_.ring == nullptr || options_.ring->size() != job_.num_workers() ||
        options_.replica == nullptr) {
      return absl::FailedPreconditionError(
          "the chief runs a job without ps (all-reduce), but this worker was started for a "
          "cluster with ps: give every process the same cluster");
    }
    if (index != 0) PSFLOW_RETURN_IF_ERROR(LoadReplica());
    options_.ring->Open(job_id_, job_.allreduce_bucket_bytes());
  }
  PSFLOW_RETURN_IF_ERROR(CreateReplicas());
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
  // Pull into and push from the network's own buffers when they are host
  // memory; otherwise stage on the host, in memory the device copies fast.
  weights_ = net_->HostWeights();
  grads_ = net_->HostGradients();
  in_place_ = !weights_.empty();
  // (The gradients' staging comes below, once it is known whether the step
  // rounds them on the device: then they go to the host in 16 bits alone.)
  // Host buffers of `floats` floats: the gradients' from the push region
  // while it has room (MakePushRegion sized it for them), else page-locked
  // memory of the backend's.
  int64_t region_used = 0;
  auto host_buffer = [&](int64_t floats,
                         bool gradient) -> absl::StatusOr<std::unique_ptr<kernels::Buffer>> {
    if (gradient && push_region_ != nullptr) {
      const SharedSpan span = push_region_->data();
      const int64_t bytes = PushRegionBytes(floats);
      if (bytes <= span.size - region_used) {
        auto* at = reinterpret_cast<float*>(span.data + region_used);
        region_used += bytes;
        return std::make_unique<BorrowedBuffer>(at, static_cast<size_t>(floats));
      }
    }
    return backend_->AllocateHost(floats);
  };
  auto stage = [&](std::vector<float*>* into, bool gradients) -> absl::Status {
    for (const VariableShape& v : net_->variables()) {
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buffer =
          host_buffer(NumElements(v.shape), gradients);
      if (!buffer.ok()) return Permanent(buffer.status());
      staging_.push_back(*std::move(buffer));
      into->push_back(staging_.back()->data());
    }
    return absl::OkStatus();
  };
  if (!in_place_) PSFLOW_RETURN_IF_ERROR(stage(&weights_, false));
  // A GPU worker of a job with ps copies each bucket of gradients out as
  // soon as the backward pass has written it.
  if (!in_place_ && !AllReduce() && group_ == nullptr) {
    absl::StatusOr<std::vector<GradientBucket>> buckets = GradientBuckets();
    if (buckets.ok()) {
      host_buckets_ = *std::move(buckets);
      // Each variable's next weights may go to the device once the step's
      // backward pass is past its layer (its bucket's event), while the
      // rest of the pass runs.
      upload_after_.assign(net_->variables().size(), nullptr);
      for (GradientBucket& b : host_buckets_) {
        for (int v : b.variables) upload_after_[v] = b.ready.get();
      }
    } else if (!absl::IsUnimplemented(buckets.status())) {
      return Permanent(buckets.status());
    }
  }
  // Those buckets' gradients cross in the wire dtype, rounded by the step
  // on the device (in its graph, before each bucket's event).
  const bool narrow = !host_buckets_.empty() && wire != DT_FLOAT && options_.narrow_on_device;
  // Their host buffers lie in the push region where the pushes send them as
  // they lie (in the wire dtype already). (CreateReplicas dropped the last
  // registration's region.)
  if (!host_buckets_.empty() && options_.gradients_to_shared_memory &&
      (wire == DT_FLOAT || narrow)) {
    MakePushRegion(narrow);
  }
  if (narrow) {
    std::vector<uint16_t*> on_device;
    for (const VariableShape& v : net_->variables()) {
      const auto floats = static_cast<size_t>(HostGradientFloats(NumElements(v.shape), true));
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> device = backend_->Allocate(floats);
      if (!device.ok()) return Permanent(device.status());
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> host =
          host_buffer(static_cast<int64_t>(floats), true);
      if (!host.ok()) return Permanent(host.status());
      on_device.push_back(reinterpret_cast<uint16_t*>((*device)->data()));
      narrowed_.push_back({*std::move(device), *std::move(host)});
    }
    net_->SetGradientHalves(std::move(on_device), wire == DT_BFLOAT16);
    if (!told_narrowed_) {
      told_narrowed_ = true;
      PSLOG(INFO) << "gradients are rounded to " << (wire == DT_HALF ? "fp16" : "bf16")
                  << " on the GPU before they cross to the host";
    }
  }
  if (!in_place_ && narrowed_.empty()) PSFLOW_RETURN_IF_ERROR(stage(&grads_, true));
  net_->SetGradientsReady(nullptr);
  PSFLOW_RETURN_IF_ERROR(MakeExchange());
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

absl::Status Trainer::MakeExchange() {
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
  o.push_during_backward = options_.push_during_backward && !AllReduce() && group_ == nullptr &&
                           job_.on_nonfinite() == JobConfig::FAIL;
  // Pulls and pushes to a replica (all-reduce) stay in this process: fp32.
  o.dtype = AllReduce() ? DT_FLOAT : WireDtypeOf(job_);
  o.trace = options_.trace;
  o.trace_step = &trace_step_;
  o.job_id = &job_id_;
  PsExchangeBuffers b;
  b.net = net_.get();
  b.backend = backend_.get();
  b.in_place = in_place_;
  b.weights = weights_;
  b.grads.assign(grads_.begin(), grads_.end());
  for (const NarrowedGradient& n : narrowed_) b.narrowed.push_back(n.host_values());
  b.upload_after = upload_after_;
  for (const GradientBucket& bucket : host_buckets_) b.buckets.push_back(bucket.variables);
  absl::StatusOr<std::unique_ptr<PsExchange>> lanes =
      PsExchange::Create(o, Hooks(), ps(), job_.placement(), std::move(b));
  if (!lanes.ok()) return lanes.status();
  // Pushing during the backward pass, each bucket's copies to the host
  // record an event that the step waits for before it marks the bucket.
  copy_events_ = (*lanes)->pushes_during_step();
  for (GradientBucket& bucket : host_buckets_) {
    if (!copy_events_) break;
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    bucket.copied = *std::move(event);
  }
  const int count = (*lanes)->lanes();
  auto joined = [&] {
    PSLOG(INFO) << "joined job: " << data_.count << " training examples, "
                << (devices_.size() > 1 ? absl::StrCat(devices_.size(), " replicas on ",
                                                       absl::StrJoin(devices_, ", "))
                                        : absl::StrCat("device ", backend_->Description()))
                << ", " << job_.num_ps() << " ps, " << count << (count == 1 ? " lane" : " lanes")
                << (copy_events_ ? ", pushing during the backward pass" : "");
    return absl::OkStatus();
  };
  if (!AllReduce()) {
    exchange_ = *std::move(lanes);
    return joined();
  }
  PSFLOW_RETURN_IF_ERROR(FormGpuGroup());
  // GPU workers that average on their devices (or one alone) keep the
  // replica there too; CPU workers, and a group that mixes CPUs and GPUs,
  // apply to the shard.
  device_.reset();
  if (!in_place_ && (gpu_peers_ != nullptr || options_.ring->size() == 1)) {
    PSFLOW_RETURN_IF_ERROR(PrepareDeviceReplica());
  }
  // On a CPU the ring starts during the backward pass: each variable's
  // piece is ready once its layer's backward is done (the last variables
  // first), the loss once the step returns.
  const bool overlap = in_place_ && group_ == nullptr && options_.ring->size() > 1;
  exchange_ = std::make_unique<RingExchange>(options_.ring, WireDtypeOf(job_), *std::move(lanes),
                                             net_.get(), grads_, overlap, Hooks());
  return joined();
}

bool Trainer::Async() const { return AppliesEachGradient(job_); }

bool Trainer::GroupAbandoned() const {
  return Stopping() || (options_.ring != nullptr && !options_.ring->status().ok());
}

namespace {

// Whole-variable buffers of a replica's values ("") and optimizer slots.
struct ReplicaTensors {
  std::vector<std::string> slots;
  std::vector<std::vector<std::vector<float>>> buffers;  // [slot][variable]
  std::vector<std::vector<float*>> pointers;             // the same, as pointers

  explicit ReplicaTensors(const JobConfig& job) {
    slots = {""};
    for (const std::string& s : ps::Optimizer::SlotNames(job.optimizer().kind()))
      slots.push_back(s);
    buffers.resize(slots.size());
    pointers.resize(slots.size());
    for (size_t k = 0; k < slots.size(); ++k) {
      for (const VariablePlacement& v : job.placement().variable()) {
        int64_t n = 1;
        for (int64_t d : v.shape()) n *= d;
        buffers[k].emplace_back(static_cast<size_t>(n), 0.0f);
      }
      for (std::vector<float>& b : buffers[k]) pointers[k].push_back(b.data());
    }
  }
  std::vector<TensorSink> Sinks(const Placement& placement) {
    return StateSinks(placement, 0, pointers, slots);
  }
  std::vector<TensorRef> Refs(const Placement& placement) const {
    std::vector<std::vector<const float*>> values(pointers.size());
    for (size_t k = 0; k < pointers.size(); ++k)
      values[k].assign(pointers[k].begin(), pointers[k].end());
    return StateRefs(placement, 0, values, slots);
  }
};

}  // namespace

absl::Status Trainer::FormGpuGroup() {
  gpu_peers_.reset();
  allreduce::Ring* const ring = options_.ring;
  if (ring->size() < 2) return absl::OkStatus();
  // Whether every worker is on GPUs: the mean of a flag, times the workers.
  float on_gpu = in_place_ ? 0.0f : 1.0f;
  std::vector<absl::Span<float>> flag = {absl::MakeSpan(&on_gpu, 1)};
  absl::Status s = ring->AllReduce(/*step=*/-2, flag, DT_FLOAT);
  if (s.ok() && std::lrint(on_gpu * static_cast<float>(ring->size())) != ring->size()) {
    return absl::OkStatus();  // the host ring it is
  }
  std::string id(kernels::kPeerGroupIdBytes, '\0');
  if (s.ok() && options_.worker_index == 0) {
    absl::StatusOr<std::string> made = kernels::NewPeerGroupId();
    if (!made.ok()) return Permanent(made.status());
    id = *std::move(made);
  }
  if (s.ok()) {
    absl::StatusOr<std::string> shared = ring->Broadcast(/*step=*/-1, id);
    s = shared.status();
    if (s.ok()) id = *std::move(shared);
  }
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (!s.ok()) {
    return absl::Status(IsRetryable(s) ? s.code() : absl::StatusCode::kInternal,
                        absl::StrCat("forming the workers' group: ", s.message()));
  }
  const DataType dtype = WireDtypeOf(job_);
  const kernels::WireDtype wire = dtype == DT_BFLOAT16 ? kernels::WireDtype::kBfloat16
                                  : dtype == DT_HALF   ? kernels::WireDtype::kFloat16
                                                       : kernels::WireDtype::kFloat32;
  absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> group = kernels::JoinPeerGroup(
      backend_.get(), id, options_.worker_index, ring->size(), wire,
      absl::Now() + options_.startup_timeout, [this] { return GroupAbandoned(); });
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (!group.ok()) {
    const absl::Status& e = group.status();
    return absl::Status(IsRetryable(e) ? e.code() : absl::StatusCode::kInternal,
                        absl::StrCat("joining the workers' GPU group: ", e.message()));
  }
  gpu_peers_ = *std::move(group);
  PSLOG(INFO) << "the " << ring->size() << " workers average their gradients on their GPUs (NCCL"
              << (wire == kernels::WireDtype::kFloat32    ? ")"
                  : wire == kernels::WireDtype::kBfloat16 ? ", in bf16)"
                                                          : ", in fp16)");
  return absl::OkStatus();
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
  std::unique_ptr<ps::Client> own = std::make_unique<ps::LocalClient>(options_.replica);
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

namespace {
// GPU workers without ps average their gradients over NCCL in buckets of
// about this many bytes, each as soon as the backward pass completes it.
constexpr int64_t kGpuBucketBytes = int64_t{4} << 20;
// A GPU worker with ps copies its gradients to the host in buckets of about
// kGpuBucketBytes, the last ones (of the first layers) smaller, down to
// about this.
constexpr int64_t kGpuLastBucketBytes = int64_t{256} << 10;
}  // namespace

struct Trainer::DeviceReplica {
  std::unique_ptr<ps::Optimizer> optimizer;
  float bn_momentum = ps::kDefaultBnMomentum;
  int slots = 0;  // per variable
  // The variables the optimizer trains, and those that follow a moving
  // average (batch norm's running statistics): each a batch of one launch
  // or a few.
  std::vector<kernels::OptimizerTensor> trained, averaged;
  // The slots on the device, [variable * slots + k], and their host copies
  // for publishing, [variable * (1 + slots) + k] (k = 0 the value).
  std::vector<std::unique_ptr<kernels::Buffer>> slot_buffers, staging;
  // The mean loss and the count of non-finite values, on the device and in
  // page-locked memory.
  std::unique_ptr<kernels::Buffer> flags, host_flags;
  // The gradients and the loss: each step counts their non-finite values.
  std::vector<absl::Span<const float>> counted;
  // The gradients' means among the workers, in buckets: for single-GPU
  // workers about kGpuBucketBytes each, in the order the backward pass
  // completes them, averaged as the step runs; for workers of several GPUs
  // one bucket, once their GPUs have averaged theirs. Their events.
  std::vector<kernels::PeerGroup::Bucket> buckets;
  std::vector<std::unique_ptr<kernels::Event>> events;
  // The publish in flight (or done), its outcome and the version it holds.
  std::thread publisher;
  absl::Status published;
  int64_t published_version = -1;

  ~DeviceReplica() {
    if (publisher.joinable()) publisher.join();
  }
  float* slot(size_t variable, int k) {
    return k < slots ? slot_buffers[variable * slots + k]->data() : nullptr;
  }
};

absl::StatusOr<std::vector<Trainer::GradientBucket>> Trainer::GradientBuckets() {
  // Cut from the end of the backward order: the last bucket closes once it
  // holds kGpuLastBucketBytes, each earlier one at twice the next one's
  // size, up to kGpuBucketBytes (each overshoots by at most one variable;
  // the first takes what is left). What the backward pass completes last
  // is then little, and so is what the exchange still has to do after it.
  const std::vector<int> order = net_->BackwardOrder();
  if (order.empty()) return std::vector<GradientBucket>();
  std::vector<size_t> ends;  // into `order`, from the last bucket's
  int64_t bytes = 0;
  int64_t cap = kGpuLastBucketBytes;
  for (size_t k = order.size(); k-- > 0;) {
    if (bytes >= cap) {
      ends.push_back(k + 1);
      bytes = 0;
      cap = std::min(cap * 2, kGpuBucketBytes);
    }
    bytes += variable_floats_[order[k]] * static_cast<int64_t>(sizeof(float));
  }
  std::reverse(ends.begin(), ends.end());
  ends.push_back(order.size());
  std::vector<GradientBucket> buckets;
  std::vector<kernels::Event*> by_variable(variable_floats_.size(), nullptr);
  size_t begin = 0;
  for (size_t end : ends) {
    GradientBucket bucket;
    bucket.variables.assign(order.begin() + static_cast<std::ptrdiff_t>(begin),
                            order.begin() + static_cast<std::ptrdiff_t>(end));
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return event.status();
    bucket.ready = *std::move(event);
    by_variable[order[end - 1]] = bucket.ready.get();
    buckets.push_back(std::move(bucket));
    begin = end;
  }
  net_->SetGradientEvents(std::move(by_variable));
  return buckets;
}

void Trainer::MakePushRegion(bool narrow) {
  // A client without shared memory (--shared_memory=false) sends from
  // anywhere over the network: the backend's buffers do then.
  if (ps() == nullptr || !ps()->TakesPushRegion()) return;
  const kernels::Backend::HostPinning pinning = backend_->host_pinning();
  if (pinning.pin == nullptr) return;
  int64_t bytes = 0;
  for (const VariableShape& v : net_->variables()) {
    bytes += PushRegionBytes(HostGradientFloats(NumElements(v.shape), narrow));
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(bytes);
  std::string why;
  if (!made.ok()) {
    why = std::string(made.status().message());
  } else if (!(*made)->Pin(pinning.pin, pinning.unpin)) {
    why = "the GPU did not register it";
  } else {
    push_region_ = *std::move(made);
    ps()->SetPushRegion(push_region_);  // (it takes one: above)
  }
  if (told_push_region_) return;
  told_push_region_ = true;
  if (push_region_ != nullptr) {
    PSLOG(INFO) << "gradients are copied from the GPU into shared memory (" << bytes
                << " bytes), and pushes send them from there";
  } else {
    PSLOG(WARNING) << "no shared memory for the gradients (" << why
                   << "): each push copies them into a region of its own";
  }
}

absl::StatusOr<model::Network::Result> Trainer::StepCopyingGradients(const float* images,
                                                                     const int32_t* labels,
                                                                     int batch) {
  PSFLOW_RETURN_IF_ERROR(net_->SetInputs(images, labels, batch));
  PSFLOW_RETURN_IF_ERROR(net_->StartTrainStep(batch));
  // The step is queued: from now on the lanes' uploads wait for its
  // events, and each bucket's copies wait on their own stream for the
  // backward pass to reach the bucket's event.
  exchange_->StepQueued();
  const std::vector<float*> device = net_->DeviceGradients();
  absl::Status s;
  std::vector<kernels::HostCopy> copies;
  for (size_t b = 0; s.ok() && b < host_buckets_.size(); ++b) {
    copies.clear();
    for (int v : host_buckets_[b].variables) {
      if (narrowed_.empty()) {
        copies.push_back({device[v], grads_[v], static_cast<size_t>(variable_floats_[v])});
      } else {  // the 16-bit values the step rounded, in whole floats
        copies.push_back(
            {narrowed_[v].device->data(), narrowed_[v].host->data(), narrowed_[v].host->size()});
      }
    }
    s = backend_->CopyToHostAfter(host_buckets_[b].ready.get(), copies);
    if (s.ok() && copy_events_) s = backend_->RecordCopiesDone(host_buckets_[b].copied.get());
  }
  // The lanes push each bucket once it is on the host, in the order the
  // backward pass completes them.
  for (size_t b = 0; s.ok() && copy_events_ && b < host_buckets_.size(); ++b) {
    TraceSpan span(options_.trace, "bucket to the host", trace_step_);
    span.Arg("bucket", b);
    s = backend_->WaitEvent(host_buckets_[b].copied.get());
    span.End();
    if (!s.ok()) break;
    exchange_->GradientsOnHost(host_buckets_[b].variables);
  }
  TraceSpan finish_span(options_.trace, "finish step", trace_step_);
  absl::StatusOr<model::Network::Result> result = net_->FinishStep(batch);
  finish_span.End();
  // The copies end before the buffers are read or written again, whatever
  // happened.
  const absl::Status copied = backend_->WaitCopies();
  PSFLOW_RETURN_IF_ERROR(s);
  if (!result.ok()) return result.status();
  PSFLOW_RETURN_IF_ERROR(copied);
  return result;
}

absl::Status Trainer::PrepareDeviceReplica() {
  device_.reset();
  auto replica = std::make_unique<DeviceReplica>();
  absl::StatusOr<std::unique_ptr<ps::Optimizer>> optimizer =
      ps::Optimizer::Create(job_.optimizer());
  if (!optimizer.ok()) return Permanent(optimizer.status());
  replica->optimizer = *std::move(optimizer);
  absl::StatusOr<float> bn_momentum = ps::BnMomentum(job_);
  if (!bn_momentum.ok()) return Permanent(bn_momentum.status());
  replica->bn_momentum = *bn_momentum;
  replica->slots = static_cast<int>(replica->optimizer->SlotNames().size());
  auto allocate = [](kernels::Backend* b, int64_t n, bool host,
                     std::vector<std::unique_ptr<kernels::Buffer>>* into) -> absl::Status {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> buffer =
        host ? b->AllocateHost(n) : b->Allocate(n);
    if (!buffer.ok()) return Permanent(buffer.status());
    into->push_back(*std::move(buffer));
    return absl::OkStatus();
  };
  for (const VariableShape& v : net_->variables()) {
    const int64_t n = NumElements(v.shape);
    for (int k = 0; k < replica->slots; ++k) {
      PSFLOW_RETURN_IF_ERROR(allocate(backend_.get(), n, false, &replica->slot_buffers));
    }
    for (int k = 0; k <= replica->slots; ++k) {
      PSFLOW_RETURN_IF_ERROR(allocate(backend_.get(), n, true, &replica->staging));
    }
  }
  std::vector<std::unique_ptr<kernels::Buffer>> flags;
  PSFLOW_RETURN_IF_ERROR(allocate(backend_.get(), 2, false, &flags));
  PSFLOW_RETURN_IF_ERROR(allocate(backend_.get(), 2, true, &flags));
  replica->flags = std::move(flags[0]);
  replica->host_flags = std::move(flags[1]);
  const std::vector<VariableShape>& variables = net_->variables();
  for (size_t v = 0; v < variables.size(); ++v) {
    const int64_t n = variable_floats_[v];
    float* const grad = replica_grads_[0][v];
    replica->counted.emplace_back(grad, static_cast<size_t>(n));
    (variables[v].trainable ? replica->trained : replica->averaged)
        .push_back({replica_weights_[0][v], grad, replica->slot(v, 0), replica->slot(v, 1), n});
  }
  replica->counted.emplace_back(replica->flags->data(), 1);
  if (gpu_peers_ != nullptr && group_ != nullptr) {
    // Workers of several GPUs: the gradients their GPUs averaged, as one
    // bucket once the step is done (its event recorded then).
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    kernels::PeerGroup::Bucket bucket{event->get(), replica_grads_[0], variable_floats_};
    replica->events.push_back(*std::move(event));
    replica->buckets.push_back(std::move(bucket));
  } else if (gpu_peers_ != nullptr) {
    absl::StatusOr<std::vector<GradientBucket>> buckets = GradientBuckets();
    if (!buckets.ok()) return Permanent(buckets.status());
    for (GradientBucket& b : *buckets) {
      kernels::PeerGroup::Bucket bucket;
      bucket.ready = b.ready.get();
      for (int v : b.variables) {
        bucket.buffers.push_back(replica_grads_[0][v]);
        bucket.sizes.push_back(variable_floats_[v]);
      }
      replica->events.push_back(std::move(b.ready));
      replica->buckets.push_back(std::move(bucket));
    }
  }
  device_ = std::move(replica);
  return absl::OkStatus();
}

absl::Status Trainer::LoadDeviceReplica(int64_t* version) {
  const absl::Time deadline = absl::Now() + options_.transfer_timeout;
  absl::StatusOr<PsState> state = ps()->GetState(0, deadline);
  if (!state.ok()) return FromPs(state.status());
  if (state->job_id() != job_id_) return RegisterAgain("this worker's replica holds another job");
  ReplicaTensors tensors(job_);
  PSFLOW_RETURN_IF_ERROR(FromPs(
      ps()->Snapshot(0, job_id_, state->version(), tensors.Sinks(job_.placement()), deadline)));
  const std::vector<const float*> values(tensors.pointers[0].begin(), tensors.pointers[0].end());
  absl::Status s = net_->SetWeights(values);
  for (size_t v = 0; s.ok() && v < values.size(); ++v) {
    for (int k = 0; s.ok() && k < device_->slots; ++k) {
      s = backend_->CopyToDevice(tensors.pointers[1 + k][v], variable_floats_[v],
                                 device_->slot(v, k));
    }
  }
  // The host buffers go away on return: the copies must be done.
  if (s.ok()) s = backend_->Synchronize();
  if (!s.ok()) return absl::InternalError(absl::StrCat("loading the replica: ", s.message()));
  device_->published_version = *version = state->version();
  return absl::OkStatus();
}

absl::Status Trainer::PublishReplica(int64_t version, bool wait) {
  DeviceReplica& d = *device_;
  if (d.publisher.joinable()) d.publisher.join();
  if (!d.published.ok()) {
    PSLOG(WARNING) << "publishing the replica of step " << d.published_version
                   << " failed: " << d.published.message();
  }
  // Device to page-locked memory, on the step's stream (after its apply).
  const int per_variable = 1 + d.slots;
  for (size_t v = 0; v < variable_floats_.size(); ++v) {
    for (int k = 0; k < per_variable; ++k) {
      const float* from = k == 0 ? replica_weights_[0][v] : d.slot(v, k - 1);
      PSFLOW_RETURN_IF_ERROR(
          backend_->CopyToHost(from, variable_floats_[v], d.staging[v * per_variable + k]->data()));
    }
  }
  // Cut into the shard's slices, and published, off the training thread.
  d.published_version = version;
  d.publisher = std::thread([&d, per_variable, version, shard = options_.replica,
                             job_id = job_id_.load(), slices = SlicesOnPs(job_.placement(), 0)] {
    std::vector<ps::Shard::SliceValues> values(slices.size());
    for (size_t i = 0; i < slices.size(); ++i) {
      const SliceRef& r = slices[i];
      const int64_t n = NumElements(r.slice_shape);
      for (int k = 0; k < per_variable; ++k) {
        const float* from = d.staging[r.variable_index * per_variable + k]->data() + r.float_offset;
        std::vector<float>& to = k == 0 ? values[i].value : values[i].slots.emplace_back();
        to.assign(from, from + n);
      }
    }
    d.published = shard->Mirror(job_id, version, std::move(values));
  });
  if (!wait) return absl::OkStatus();
  d.publisher.join();
  return d.published;
}

absl::Status Trainer::CreateReplicas() {
  // No copy of the last registration may still read a buffer freed below
  // (an upload of a lane that failed while others were still pulling).
  if (backend_ != nullptr) static_cast<void>(backend_->Synchronize());
  exchange_.reset();  // the lanes' events are the backend's; their regions' uploads are done
  device_.reset();    // its buffers are the backend's
  upload_after_.clear();
  host_buckets_.clear();  // so are their events
  staging_.clear();       // and the page-locked buffers (Prepare makes new ones)
  narrowed_.clear();
  // The push region's buffers are gone: no push may name it, and it is
  // unregistered before the backend goes.
  if (ps() != nullptr) ps()->SetPushRegion(nullptr);
  push_region_.reset();
  gpu_peers_.reset();  // before the backend it queues on
  replicas_.clear();
  replica_nets_.clear();
  group_.reset();
  replica_backends_.clear();
  net_.reset();
  backend_.reset();
  absl::StatusOr<std::vector<std::string>> devices = kernels::ExpandDevices(options_.device);
  if (!devices.ok()) return Permanent(devices.status());
  devices_ = *std::move(devices);
  const int replicas = ReplicasPerWorker(job_);
  if (static_cast<int>(devices_.size()) != replicas) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job runs ", replicas, replicas == 1 ? " replica" : " replicas",
        " of the model per worker (--replicas_per_worker on the chief), but this worker's "
        "--device=",
        options_.device, " names ", devices_.size(), devices_.size() == 1 ? " device" : " devices",
        ": give every worker as many GPUs"));
  }
  std::vector<kernels::Backend*> all;
  for (size_t r = 0; r < devices_.size(); ++r) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
        kernels::CreateBackend(devices_[r], job_.compute_threads());
    if (!backend.ok()) return Permanent(backend.status());
    absl::StatusOr<std::unique_ptr<model::Network>> net =
        model::Network::Create(job_.model(), backend->get());
    if (!net.ok()) return Permanent(net.status());
    all.push_back(backend->get());
    if (r == 0) {
      backend_ = *std::move(backend);
      net_ = *std::move(net);
    } else {
      replica_backends_.push_back(*std::move(backend));
      replica_nets_.push_back(*std::move(net));
    }
  }
  variable_floats_.clear();
  for (const VariableShape& v : net_->variables()) variable_floats_.push_back(NumElements(v.shape));
  replicas_ = {net_.get()};
  for (auto& n : replica_nets_) replicas_.push_back(n.get());
  replica_weights_.clear();
  replica_grads_.clear();
  for (model::Network* n : replicas_) {
    replica_weights_.push_back(n->DeviceWeights());
    replica_grads_.push_back(n->DeviceGradients());
  }
  if (all.size() > 1) {
    absl::StatusOr<std::unique_ptr<kernels::DeviceGroup>> group = kernels::CreateDeviceGroup(all);
    if (!group.ok()) return Permanent(group.status());
    group_ = *std::move(group);
  }
  return absl::OkStatus();
}

absl::StatusOr<model::Network::Result> Trainer::ReplicatedStep(const float* images,
                                                               const int32_t* labels, int batch) {
  const std::vector<model::Network*>& nets = replicas_;
  // Names the GPU whose work failed: a lost GPU ends the worker with a
  // retryable exit code (INTERNAL), to be restarted.
  auto on = [&](size_t r, const absl::Status& s) {
    return absl::InternalError(absl::StrCat(devices_[r], ": ", s.message()));
  };
  // Replica 0 holds the pulled weights (queued on its stream): the others
  // take them from it, GPU to GPU.
  absl::Status s = group_->Broadcast(replica_weights_, variable_floats_);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("copying weights among the GPUs: ", s.message()));
  const int64_t example = data_.example_floats();
  for (size_t r = 0; r < nets.size(); ++r) {
    s = nets[r]->SetInputs(images + r * batch * example, labels + r * batch, batch);
    if (s.ok()) s = nets[r]->StartTrainStep(batch);
    if (!s.ok()) return on(r, s);
  }
  s = group_->AllReduceMean(replica_grads_, variable_floats_);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("averaging gradients among the GPUs: ", s.message()));
  model::Network::Result total;
  for (size_t r = 0; r < nets.size(); ++r) {
    absl::StatusOr<model::Network::Result> got = nets[r]->FinishStep(batch);
    if (!got.ok()) return on(r, got.status());
    total.loss += got->loss / static_cast<double>(nets.size());
    total.correct += got->correct;
  }
  return total;
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
};

absl::Status Trainer::Train(int64_t start) {
  WorkerBatches batches(data_, job_, options_.worker_index);
  Position at;
  at.step = start;
  while (true) {
    PSFLOW_RETURN_IF_ERROR(Interrupted());
    if (!at.have_weights) PSFLOW_RETURN_IF_ERROR(FirstPull(&at));
    if (at.got.version >= job_.train_steps()) break;
    PSFLOW_RETURN_IF_ERROR(TrainStep(batches, &at));
  }
  return absl::OkStatus();
}

absl::Status Trainer::Interrupted() const {
  if (reporter_.job_failed()) return absl::FailedPreconditionError("the chief failed the job");
  if (reporter_.reregister()) return RegisterAgain("the chief asked for a new registration");
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
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
  if (group_ != nullptr) return ReplicatedStep(batches.images(), batches.labels(), batch);
  if (!host_buckets_.empty())
    return StepCopyingGradients(batches.images(), batches.labels(), batch);
  return net_->TrainStep(batches.images(), batches.labels(), batch);
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
  // An asynchronous job's data follow this worker's own steps:
  // steps_per_epoch counts the steps of every worker there.
  const int64_t steps_per_epoch =
      async ? std::max<int64_t>(job_.steps_per_epoch() / job_.num_workers(), 1)
            : job_.steps_per_epoch();
  absl::Status s = batches.Gather(async ? at->clock : step, steps_per_epoch);
  input_span.End();
  // The step's outcome, and its metrics, which go out once every push is
  // answered (the pull that follows belongs to the next step).
  absl::StatusOr<model::Network::Result> result = absl::UnknownError("no step");
  absl::Time t2, pushed_at;
  StepMetrics async_metrics;
  StepPush push;
  push.step = step;
  push.push_step = async ? at->clock : step;
  push.min_version = push.push_step + 1;
  push.on_pushed = [&](absl::Time last_answer, bool skip) {
    // (Pushes during the backward pass may all be answered before the
    // step ends: then nothing of them is left to count as push time.)
    pushed_at = std::max(last_answer, t2);
    StepMetrics m;
    m.set_step(step);
    m.set_nonfinite(skip);  // the chief counts the skipped steps
    m.set_loss(skip ? 0 : result->loss);
    m.set_correct(result->correct);
    m.set_examples(batches.size());
    m.set_wait_us(at->wait_us);
    m.set_pull_us(at->pull_us);
    m.set_compute_us(Micros(t2 - t1));
    m.set_push_us(Micros(pushed_at - t2));
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
  if (result.ok() && !in_place_ && host_buckets_.empty()) s = net_->GetGradients(grads_);
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
  PSFLOW_RETURN_IF_ERROR(PushStep(push, &at->got));
  // After the pushes: waiting for the version (for the other workers and
  // the ps's applies), and the pull itself.
  const int64_t after_push = Micros(absl::Now() - pushed_at);
  at->wait_us = std::min(at->got.wait_us, after_push);
  at->pull_us = after_push - at->wait_us;
  at->step = step + 1;
  register_backoff_.Reset();
  if (async) {
    // The pull waited for this gradient's apply (unless the job ended
    // first): its staleness is known.
    async_metrics.set_staleness(at->got.lag);
    reporter_.Add(std::move(async_metrics));
    at->clock = std::max(at->clock + 1, at->got.clock);
    at->step = at->got.version;
  }
  reporter_.SetStep(at->step);
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

absl::Status Trainer::TrainOnDevice() {
  DeviceReplica& d = *device_;
  int64_t step = 0;
  PSFLOW_RETURN_IF_ERROR(LoadDeviceReplica(&step));
  const int index = options_.worker_index;
  WorkerBatches batches(data_, job_, index);
  const int batch = job_.batch_size();  // per replica
  const int64_t worker_batch = batches.size();
  float* const host_flags = d.host_flags->data();
  // A stop keeps what was trained: the replica of the last whole step goes
  // to the shard, where the chief's checkpoint at the stop finds it.
  // Until a step's optimizer runs, the device holds the replica of `step`,
  // whole: when this worker stops, or its group breaks, worker 0's goes to
  // its shard first, where the chief's last checkpoint reads it (in worker
  // 0's process, the chief's duties checkpoint once the trainer returns).
  auto publish_last = [&](const char* why) {
    absl::Status s = PublishReplica(step, /*wait=*/true);
    if (!s.ok()) PSLOG(WARNING) << "publishing the replica " << why << ": " << s.message();
  };
  auto stopped = [&](int sig) {
    publish_last("at the stop");
    return StoppedBySignal(sig);
  };
  // The group is gone (a member failed): every worker restarts.
  auto group_failed = [&](const absl::Status& s) {
    options_.ring->Leave(s);
    if (index == 0) publish_last("as the group broke");
    return absl::Status(IsRetryable(s) ? s.code() : absl::StatusCode::kUnavailable,
                        absl::StrCat("all-reduce of step ", step, ": ", s.message()));
  };
  while (step < job_.train_steps()) {
    if (reporter_.job_failed()) return absl::FailedPreconditionError("the chief failed the job");
    if (reporter_.reregister()) return RegisterAgain("the chief asked for a new registration");
    if (const int sig = stop_signal(); sig != 0) return stopped(sig);
    // The shard gets the replica of this step if a snapshot waits for it,
    // and worker 0's at every multiple of kReplicaPublishSteps.
    if (step != d.published_version && ((index == 0 && step % kReplicaPublishSteps == 0) ||
                                        options_.replica->WantedSnapshot(step) == step)) {
      PSFLOW_RETURN_IF_ERROR(PublishReplica(step, /*wait=*/false));
    }
    const absl::Time t1 = absl::Now();
    absl::Status s = batches.Gather(step, job_.steps_per_epoch());
    absl::StatusOr<model::Network::Result> result = absl::UnknownError("no step");
    if (!s.ok()) {
      result = s;
    } else if (gpu_peers_ != nullptr && group_ == nullptr) {
      // The step's graph is queued; the NCCL means of its gradients follow
      // it bucket by bucket, each once the backward pass has passed the
      // bucket's event, while the rest of the backward pass runs.
      s = net_->SetInputs(batches.images(), batches.labels(), batch);
      if (s.ok()) s = net_->StartTrainStep(batch);
      if (s.ok()) {
        s = gpu_peers_->QueueAllReduceMeans(d.buckets, absl::Now() + options_.transfer_timeout,
                                            [this] { return GroupAbandoned(); });
        if (const int sig = stop_signal(); sig != 0) return stopped(sig);
        if (!s.ok()) return group_failed(s);
      }
      if (s.ok()) {
        result = net_->FinishStep(batch);
      } else {
        result = s;
      }
    } else {
      result = group_ ? ReplicatedStep(batches.images(), batches.labels(), batch)
                      : net_->TrainStep(batches.images(), batches.labels(), batch);
      if (result.ok() && gpu_peers_ != nullptr) {
        // Workers of several GPUs: their mean, after the step.
        s = backend_->RecordEvent(d.buckets[0].ready);
        if (!s.ok()) {
          result = s;
        } else {
          s = gpu_peers_->QueueAllReduceMeans(d.buckets, absl::Now() + options_.transfer_timeout,
                                              [this] { return GroupAbandoned(); });
          if (const int sig = stop_signal(); sig != 0) return stopped(sig);
          if (!s.ok()) return group_failed(s);
        }
      }
    }
    if (!result.ok()) {
      return absl::InternalError(
          absl::StrCat("step ", step, " failed: ", result.status().message()));
    }
    const absl::Time t2 = absl::Now();
    // The mean gradient and loss of every worker (the same bits on each), and
    // whether any of them is not finite: one verdict for the whole group.
    host_flags[0] = static_cast<float>(result->loss);
    host_flags[1] = 0;
    s = backend_->CopyToDevice(host_flags, 2, d.flags->data());
    if (s.ok() && gpu_peers_ != nullptr) {
      // The loss, in fp32, after the gradients' buckets: its wait is theirs.
      s = gpu_peers_->AllReduceMean({d.flags->data()}, {1}, absl::Now() + options_.transfer_timeout,
                                    [this] { return GroupAbandoned(); });
      if (const int sig = stop_signal(); sig != 0) return stopped(sig);
      if (!s.ok()) return group_failed(s);
    }
    if (s.ok()) s = backend_->CountNonFinite(d.counted, d.flags->data() + 1);
    if (s.ok()) s = backend_->CopyToHost(d.flags->data(), 2, host_flags);
    if (!s.ok()) {
      return absl::InternalError(absl::StrCat("step ", step, " failed: ", s.message()));
    }
    const bool finite = host_flags[1] == 0;
    const bool skip = !finite && job_.on_nonfinite() == JobConfig::SKIP_STEP;
    if (!finite && !skip) {
      PSLOG(ERROR) << "step " << step << ": the mean loss (" << host_flags[0]
                   << ") or the mean gradients are not finite; nothing applied";
      return NonFinite(step);
    }
    if (skip) {
      PSLOG(WARNING) << "step " << step << ": the mean loss (" << host_flags[0]
                     << ") or the mean gradients are not finite; skipping the step";
    } else {
      s = backend_->ApplyOptimizer(d.optimizer->StepAt(step), d.trained);
      if (s.ok()) s = backend_->ApplyOptimizer(ps::MovingAverageStep(d.bn_momentum), d.averaged);
      if (!s.ok()) {
        return absl::InternalError(
            absl::StrCat("step ", step, ": the optimizer failed: ", s.message()));
      }
    }
    StepMetrics m;
    m.set_step(step);
    m.set_nonfinite(skip);
    m.set_loss(skip ? 0 : result->loss);
    m.set_correct(result->correct);
    m.set_examples(worker_batch);
    m.set_compute_us(Micros(t2 - t1));
    m.set_push_us(Micros(absl::Now() - t2));  // the all-reduce and the apply
    ++step;
    register_backoff_.Reset();
    reporter_.Add(std::move(m));
    reporter_.SetStep(step);
  }
  // The final replica: the chief's final weights and every digest read it.
  absl::Status s = PublishReplica(step, /*wait=*/true);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("publishing the final replica: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::TrainAndWait() {
  while (true) {
    absl::Status s = device_ != nullptr ? TrainOnDevice() : Train(start_step_);
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
