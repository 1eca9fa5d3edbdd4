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
  // No upload may still read a region as the regions go.
  for (Lane& lane : lanes_) static_cast<void>(ReleaseHold(lane));
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
  // Pulls and pushes to a replica (all-reduce) stay in this process: fp32.
  exchange_dtype_ = AllReduce() ? DT_FLOAT : WireDtypeOf(job_);
  const DataType wire = exchange_dtype_;
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
  // Pushes during the backward pass: where they apply, and the order in
  // which the backward pass completes the variables.
  push_early_ = options_.push_during_backward && !AllReduce() && group_ == nullptr &&
                job_.on_nonfinite() == JobConfig::FAIL && (in_place_ || !host_buckets_.empty());
  backward_pos_.assign(net_->variables().size(), 0);
  {
    const std::vector<int> order = net_->BackwardOrder();
    for (size_t k = 0; k < order.size(); ++k) backward_pos_[order[k]] = static_cast<int>(k);
  }
  net_->SetGradientsReady(nullptr);
  if (push_early_) {
    if (in_place_) {
      net_->SetGradientsReady([this](absl::Span<const int> done) {
        for (int v : done) grads_ready_.MarkReady(backward_pos_[v]);
      });
    }
    for (GradientBucket& b : host_buckets_) {
      absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
      if (!event.ok()) return Permanent(event.status());
      b.copied = *std::move(event);
    }
    if (exchange_caller_ == nullptr) exchange_caller_ = std::make_unique<ThreadPool>(1);
  }
  // Each ps's slices, cut into lanes of consecutive slices with about the
  // same bytes each: consecutive in the ps's order, or, pushing during the
  // backward pass, in the order the backward pass completes them (so that
  // each lane waits for one stretch of it).
  LanePlanOptions plan_options;
  plan_options.lanes_per_ps = options_.lanes_per_ps;
  plan_options.lane_bytes = options_.lane_bytes;
  plan_options.min_run_bytes = options_.min_run_bytes;
  plan_options.backward_pos = backward_pos_;
  plan_options.backward_order = push_early_;
  // Variables whose gradients become final together: a host bucket's (a
  // GPU's), else each alone (a CPU's, marked as its layer's backward ends).
  plan_options.bucket.assign(backward_pos_.size(), -1);
  for (size_t b = 0; b < host_buckets_.size(); ++b) {
    for (int v : host_buckets_[b].variables) plan_options.bucket[v] = static_cast<int>(b);
  }
  LanePlan plan = PlanLanes(job_.placement(), plan_options);
  const std::vector<const float*> grads(grads_.begin(), grads_.end());
  std::vector<const uint16_t*> narrowed;
  for (const NarrowedGradient& n : narrowed_) narrowed.push_back(n.host_values());
  slices_of_ = std::move(plan.slices_of);
  lanes_.clear();
  for (int p = 0; p < job_.num_ps(); ++p) {
    std::vector<TensorSink> sinks = SliceSinks(job_.placement(), p, weights_, "", wire);
    std::vector<TensorRef> refs = narrowed_.empty()
                                      ? SliceRefs(job_.placement(), p, grads, "", wire)
                                      : EncodedSliceRefs(job_.placement(), p, narrowed, wire);
    for (LaneSpec& spec : plan.lanes) {
      if (spec.ps != p) continue;
      Lane& lane = lanes_.emplace_back();
      for (int i : spec.slices) {
        lane.sinks.push_back(std::move(sinks[i]));
        lane.refs.push_back(std::move(refs[i]));
      }
      lane.spec = std::move(spec);
    }
  }
  to_come_ = std::make_unique<std::atomic<int>[]>(slices_of_.size());
  // The pulls' regions are pinned for the GPU, and its uploads read them.
  const kernels::Backend::HostPinning pinning =
      in_place_ ? kernels::Backend::HostPinning{} : backend_->host_pinning();
  borrow_pulls_ =
      options_.upload_from_shared_memory && pinning.pin != nullptr && !upload_after_.empty();
  if (borrow_pulls_) ps()->SetRegionPinning(pinning.pin, pinning.unpin);
  const std::vector<VariableShape>& variable_shapes = net_->variables();
  for (Lane& lane : lanes_) {
    for (size_t i = 0; i < lane.sinks.size(); ++i) {
      const std::vector<int64_t>& shape = variable_shapes[lane.spec.variables[i]].shape;
      const int64_t row = shape.empty() ? 1 : NumElements(shape) / std::max<int64_t>(shape[0], 1);
      lane.first_float.push_back(lane.sinks[i].row_begin * row);
    }
    if (!borrow_pulls_) continue;
    lane.borrowed.assign(lane.sinks.size(), nullptr);
    for (size_t i = 0; i < lane.sinks.size(); ++i) lane.sinks[i].borrow = &lane.borrowed[i];
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    lane.uploaded = *std::move(event);
  }
  // A lane's pull may wait for its own push, and pushing during the backward
  // pass for the step's verdict, which every lane's check is part of: every
  // lane needs a thread.
  pool_ = std::make_unique<ThreadPool>(std::max<int>(lanes_.size() - 1, 1));
  // Where weights are staged on the host and gradients pushed during the
  // backward pass, each lane's pull runs beside its push.
  pullers_.reset();
  if (push_early_ && !in_place_) {
    pullers_ = std::make_unique<ThreadPool>(static_cast<int>(lanes_.size()));
  }
  if (AllReduce()) {
    PSFLOW_RETURN_IF_ERROR(FormGpuGroup());
    // GPU workers that average on their devices (or one alone) keep the
    // replica there too; CPU workers, and a group that mixes CPUs and GPUs,
    // apply to the shard.
    device_.reset();
    if (!in_place_ && (gpu_peers_ != nullptr || options_.ring->size() == 1)) {
      PSFLOW_RETURN_IF_ERROR(PrepareDeviceReplica());
    }
    // What each step's ring all-reduce averages: the loss (so that every
    // worker agrees whether the step was finite), then the gradients, the
    // same spans every step. On a CPU the ring starts during the backward
    // pass: each variable's piece is ready once its layer's backward is done
    // (the last variables first), the loss once the step returns.
    ring_pieces_ = {absl::MakeSpan(&ring_loss_, 1)};
    const std::vector<VariableShape>& variables = net_->variables();
    for (size_t v = 0; v < variables.size(); ++v) {
      ring_pieces_.push_back(absl::MakeSpan(grads_[v], NumElements(variables[v].shape)));
    }
    overlap_ring_ = in_place_ && group_ == nullptr && options_.ring->size() > 1;
    if (overlap_ring_) {
      net_->SetGradientsReady([this](absl::Span<const int> done) {
        for (int v : done) ring_ready_.MarkReady(v + 1);
      });
      if (ring_caller_ == nullptr) ring_caller_ = std::make_unique<ThreadPool>(1);
    }
  }
  PSLOG(INFO) << "joined job: " << data_.count << " training examples, "
              << (devices_.size() > 1 ? absl::StrCat(devices_.size(), " replicas on ",
                                                     absl::StrJoin(devices_, ", "))
                                      : absl::StrCat("device ", backend_->Description()))
              << ", " << job_.num_ps() << " ps, " << lanes_.size()
              << (lanes_.size() == 1 ? " lane" : " lanes")
              << (push_early_ ? ", pushing during the backward pass" : "");
  return absl::OkStatus();
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
  SetStepQueued(true);
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
    if (s.ok() && push_early_) s = backend_->RecordCopiesDone(host_buckets_[b].copied.get());
  }
  // The lanes push each bucket once it is on the host, in the order the
  // backward pass completes them.
  for (size_t b = 0; s.ok() && push_early_ && b < host_buckets_.size(); ++b) {
    TraceSpan span(options_.trace, "bucket to the host", trace_step_);
    span.Arg("bucket", b);
    s = backend_->WaitEvent(host_buckets_[b].copied.get());
    span.End();
    if (!s.ok()) break;
    for (int v : host_buckets_[b].variables) grads_ready_.MarkReady(backward_pos_[v]);
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
  lanes_.clear();   // their events are the backend's; their regions' uploads are done
  device_.reset();  // its buffers are the backend's
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

absl::Status Trainer::PullLane(int l, int64_t min_version, StepVerdict* open_verdict, LanePull* out,
                               const std::atomic<bool>* give_up) {
  Lane& lane = lanes_[l];  // its pull's fields are this thread's alone
  const absl::Time start = absl::Now();
  ps::Client* const client = ps();
  const bool async = Async();
  absl::StatusOr<ps::Client::ClockedPull> r;
  // The lane's last pull's region, once its uploads are done, goes back for
  // this pull to use.
  PSFLOW_RETURN_IF_ERROR(ReleaseHold(lane));
  TraceSpan pull_span(options_.trace, "pull", trace_step_);
  pull_span.Arg("lane", l);
  pull_span.Arg("ps", lane.spec.ps);
  pull_span.Arg("slices", lane.spec.slices.size());
  absl::Time last_ask;
  do {  // ask again while the other workers are still on the step
    if (stop_signal() != 0) return absl::CancelledError("stopping");
    if (give_up != nullptr && give_up->load())
      return absl::CancelledError("the lane's push failed");
    // Before the step's verdict, ask often, so as to stop soon after one
    // that is not finite (the slices this worker withheld never come).
    absl::Duration max_wait = options_.pull_wait;
    if (open_verdict != nullptr) {
      if (open_verdict->Failed()) return absl::OkStatus();  // out->version stays -1
      if (!open_verdict->Decided()) max_wait = std::min(max_wait, absl::Milliseconds(100));
    }
    last_ask = absl::Now();
    const absl::Time deadline = last_ask + max_wait + options_.transfer_timeout;
    if (async) {
      r = client->PullByClock(lane.spec.ps, job_id_, options_.worker_index, min_version,
                              lane.spec.slices, lane.sinks, deadline, max_wait);
    } else {
      absl::StatusOr<ps::Client::PullResult> p =
          give_up != nullptr
              ? client->PullUnlessGivenUp(lane.spec.ps, job_id_, min_version, lane.spec.slices,
                                          lane.sinks, deadline, max_wait, *give_up)
              : client->Pull(lane.spec.ps, job_id_, min_version, lane.spec.slices, lane.sinks,
                             deadline, max_wait);
      if (p.ok()) {
        ps::Client::ClockedPull pulled;
        pulled.ready = p->version >= min_version;
        pulled.version = p->version;
        pulled.wait_us = p->wait_us;
        pulled.hold = std::move(p->hold);
        r = std::move(pulled);
      } else {
        r = p.status();
      }
    }
  } while (r.ok() && !r->ready);
  if (!r.ok()) {
    const absl::Status failed = FromPs(r.status());
    if (IsRetryable(failed) && !StopPending())
      PSLOG(WARNING) << "retrying: " << failed.message() << " ("
                     << absl::StatusCodeToString(failed.code()) << ")";
    return failed;
  }
  out->version = r->version;
  out->clock = r->clock;
  out->lag = r->lag;
  // Time spent on "not yet" answers (and retries) is waiting too.
  out->wait_us = r->wait_us + Micros(last_ask - start);
  pull_span.End();
  if (in_place_) return absl::OkStatus();
  TraceSpan upload_span(options_.trace, "queue uploads", trace_step_);
  upload_span.Arg("lane", l);
  if (!upload_after_.empty()) WaitStepQueued();
  if (borrow_pulls_) {
    // Each slice from where the pull left it: the region (kept), or its sink.
    lane.hold = std::move(r->hold);
    absl::Status s;
    // The lane's slices go to the backend in one call for each kind of
    // values (each alone costs a copy, and a kernel for 16-bit values,
    // under the backend's lock).
    std::vector<model::Network::HostRange> floats, halves;
    DataType halves_dtype = DT_BFLOAT16;
    for (size_t i = 0; i < lane.sinks.size(); ++i) {
      const int v = lane.spec.variables[i];
      const int64_t first = lane.first_float[i], count = NumElements(lane.sinks[i].shape);
      const void* const borrowed = lane.borrowed[i];
      if (borrowed == nullptr) {  // in the variable's staging buffer, floats
        floats.push_back({v, first, count, weights_[v] + first, upload_after_[v]});
        continue;
      }
      // In the pull's region (one block), in the wire dtype.
      const DataType dtype = lane.sinks[i].dtype;
      (dtype == DT_FLOAT ? floats : halves)
          .push_back({v, first, count, borrowed, upload_after_[v], lane.hold.get()});
      if (dtype != DT_FLOAT) halves_dtype = dtype;
    }
    if (!floats.empty()) {
      s = net_->SetWeightRangesAfter(floats, kernels::Backend::HostValues::kFloat);
    }
    if (s.ok() && !halves.empty()) {
      s = net_->SetWeightRangesAfter(halves, halves_dtype == DT_BFLOAT16
                                                 ? kernels::Backend::HostValues::kBfloat16
                                                 : kernels::Backend::HostValues::kHalf);
    }
    if (s.ok() && lane.hold != nullptr) {
      if (!told_borrow_.exchange(true)) {
        PSLOG(INFO) << "pulled weights go to the GPU straight from the shared memory the ps "
                       "wrote them into";
      }
      s = backend_->RecordUploadsDone(lane.uploaded.get());
    }
    if (!s.ok()) {
      // Copies queued before the failure may still read the region: wait
      // for all of them before it goes. INTERNAL whatever the device said.
      if (lane.hold != nullptr) static_cast<void>(backend_->Synchronize());
      lane.hold.reset();
      return absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
    }
    return absl::OkStatus();
  }
  // Each variable goes to the device once its last slice is in.
  for (int v : lane.spec.variables) {
    if (to_come_[v].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    absl::Status s = upload_after_.empty() ? net_->SetWeight(v, weights_[v])
                                           : net_->SetWeightAfter(v, weights_[v], upload_after_[v]);
    // INTERNAL whatever the device said: never retried (the countdown is spent).
    if (!s.ok())
      return absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::ReleaseHold(Lane& lane) {
  if (lane.hold == nullptr) return absl::OkStatus();
  absl::Status s = backend_->WaitEvent(lane.uploaded.get());
  if (!s.ok()) {
    static_cast<void>(backend_->Synchronize());
    s = absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
  }
  lane.hold.reset();
  return s;
}

void Trainer::SetStepQueued(bool queued) {
  absl::MutexLock lock(&queued_mu_);
  step_queued_ = queued;
}

void Trainer::WaitStepQueued() {
  absl::MutexLock lock(&queued_mu_);
  queued_mu_.Await(absl::Condition(&step_queued_));
}

bool Trainer::LaneFinite(int l) const { return RefsFinite(lanes_[l].refs); }

bool Trainer::RefsFinite(absl::Span<const TensorRef> refs) const {
  // A gradient the wire dtype turns into infinity (fp16 from 65520 on) is
  // as diverged as one that already is. (To a replica of an all-reduce job
  // the exchange is fp32: its ring rounds the mean through the wire dtype
  // already, so an fp16 overflow is an infinity by then.)
  const float overflow = WireOverflow(exchange_dtype_);
  for (const TensorRef& r : refs) {
    if (!WireValuesBelow(r, 0, NumElements(r.shape), overflow)) return false;
  }
  return true;
}

absl::Status Trainer::RunLanes(int64_t push_step, int64_t min_version, bool skip,
                               const std::function<void(absl::Time)>& on_pushed, Exchanged* out,
                               StepVerdict* verdict) {
  const int n = static_cast<int>(lanes_.size());
  for (size_t v = 0; v < slices_of_.size(); ++v) to_come_[v].store(slices_of_[v]);
  PushHeader header;
  header.set_job_id(job_id_);
  // A replica of an all-reduce job hears its own worker alone, as worker 0.
  header.set_worker(AllReduce() ? 0 : options_.worker_index);
  header.set_step(push_step);
  header.set_skip(skip);
  const bool async = Async();
  // Until every lane's push is answered (or this returns): a stop waits
  // for them (StopAfterPushes).
  std::atomic<int> lanes_pushed{0};
  if (push_step >= 0) OpenPushes();
  absl::Cleanup close_pushes = [&] {
    if (push_step >= 0 && lanes_pushed.load() < n) ClosePushes();
  };
  std::vector<LanePull> pulls(n);
  std::vector<char> pushed(n, push_step < 0);
  std::vector<char> checked(n, 0);      // the lane's part of the verdict is in
  std::vector<char> counted(n, 0);      // the lane's push counts for on_pushed
  std::vector<absl::Time> answered(n);  // when each lane's push was answered
  std::atomic<int> pushes_left{push_step < 0 ? 0 : n};
  // Once per lane whose push was answered (and, pushing during the
  // backward pass, whose step was found finite): the last one runs
  // on_pushed with the last answer's time.
  auto count_push = [&](int l) {
    counted[l] = 1;
    if (pushes_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && on_pushed) {
      on_pushed(*std::max_element(answered.begin(), answered.end()));
    }
  };
  // Pushing during the backward pass, a lane whose weights are staged on the
  // host (a GPU's) pulls before the verdict: the copies to the device queue
  // behind the step (and a step that is not finite ends the job anyway).
  const bool pull_early = verdict != nullptr && !in_place_;
  RetryPolicy policy;
  policy.give_up = absl::Now() + options_.startup_timeout;
  // Told to stop once the pushes are answered: a push that failed (its ps
  // stopped) is not tried again.
  policy.stop = [this] { return Stopping() || StopPending(); };
  ps::Client* const client = ps();
  // Pushing during the backward pass, a lane's push reads its gradients in
  // runs (ps::Client::PushInRuns), each once the backward pass has made it
  // final and it is checked: only finite ones leave. The lane marks the
  // verdict with its last run, or at its first run that is not finite; a
  // verdict that failed already (another lane, or a step that failed and
  // released every piece without writing it) ends the push. `stopped[l]`:
  // the lane's push ended so, rather than by the ps.
  const bool in_runs = verdict != nullptr && !skip;
  std::unique_ptr<std::atomic<bool>[]> stopped(new std::atomic<bool>[n]);
  for (int l = 0; l < n; ++l) stopped[l] = false;
  // The lane's part of the verdict, from run g's check (`finite`): marked at
  // its first run that is not finite, or with its last.
  auto mark = [&](int l, int g, bool finite) -> absl::Status {
    if (!checked[l] && (!finite || g + 1 == static_cast<int>(lanes_[l].spec.run_starts.size()))) {
      checked[l] = 1;
      verdict->Mark(finite);
    }
    if (finite) return absl::OkStatus();
    stopped[l] = true;
    return absl::CancelledError("the step is not finite");
  };
  auto wait_run = [&](int l, int g) -> absl::Status {
    const Lane& lane = lanes_[l];
    const auto [first, last] = lane.spec.run_pieces[g];
    TraceSpan wait_span(options_.trace, "run waits for its gradients", trace_step_);
    wait_span.Arg("lane", l);
    wait_span.Arg("run", g);
    const bool ready = grads_ready_.WaitReady(first, last, absl::InfiniteFuture(),
                                              [&] { return Stopping() || verdict->Failed(); });
    wait_span.End();
    if (ready && !verdict->Failed()) return absl::OkStatus();
    // Stopping, or the step failed already: the lane's part fails too.
    const absl::Status s = mark(l, g, false);
    return ready ? s : absl::CancelledError("stopping");
  };
  // The client checks each run (ps::Client::PushRuns::checked) as it reads
  // it: finite, and within the wire dtype's range. A gradient the wire
  // dtype turns into infinity (fp16 from 65520 on) is as diverged as one
  // that already is.
  const float overflow = WireOverflow(exchange_dtype_);
  // Where weights are staged on the host, the lane's pull runs beside its
  // push from the start: each slice comes as soon as the ps applied it.
  // `give_up[l]` stops a pull whose push failed (it asks again at least
  // every 100 ms while the verdict is open).
  std::unique_ptr<std::atomic<bool>[]> give_up(new std::atomic<bool>[n]);
  std::vector<char> pulled(n, 0);
  absl::Status s = FanOut(pool_.get(), n, policy, [&](int l) -> absl::Status {
    const Lane& lane = lanes_[l];
    if (!pushed[l] && verdict != nullptr && !in_runs && !checked[l]) {
      // Pushing during the backward pass: once the lane's gradients are
      // final (and on the host), check them; only finite ones leave.
      // A verdict that failed already (another lane, or a step that failed
      // and released every piece without writing it) sends nothing more.
      checked[l] = 1;
      const bool ready = grads_ready_.WaitReady(lane.spec.first_piece, lane.spec.last_piece,
                                                absl::InfiniteFuture(),
                                                [&] { return Stopping() || verdict->Failed(); });
      const bool finite = ready && !verdict->Failed() && LaneFinite(l);
      verdict->Mark(finite);
      if (!ready && Stopping()) return absl::CancelledError("stopping");
      if (!finite) return absl::OkStatus();  // the caller ends the step
    }
    if (!pushed[l]) {
      absl::Notification pull_done;
      absl::Status pull_status;
      const bool beside = pull_early && in_runs && pullers_ != nullptr && !pulled[l];
      if (beside) {
        give_up[l] = false;
        pullers_->Schedule([&, l] {
          pull_status = PullLane(l, min_version, verdict, &pulls[l], &give_up[l]);
          pull_done.Notify();
        });
      }
      // A retried push that had arrived after all is answered DUPLICATE (or
      // STALE once applied): either way the ps has this worker's gradients.
      PushHeader lane_header = header;
      for (int i : lane.spec.slices) lane_header.add_slices(i);
      if (async) lane_header.set_read_version(out->ps_versions[lane.spec.ps]);
      // A push in runs opens with the step: transfer_timeout for the step
      // itself too.
      const absl::Time deadline = absl::Now() + (in_runs ? 2 : 1) * options_.transfer_timeout;
      absl::StatusOr<PushResponse> response;
      TraceSpan push_span(options_.trace, in_runs ? "push in runs" : "push", trace_step_);
      push_span.Arg("lane", l);
      push_span.Arg("ps", lane.spec.ps);
      push_span.Arg("slices", lane.spec.slices.size());
      if (in_runs) {
        ps::Client::PushRuns runs{lane.spec.run_starts, [&](int g) { return wait_run(l, g); },
                                  [&](int g, bool ok) { return mark(l, g, ok); }, overflow};
        response = client->PushInRuns(lane.spec.ps, lane_header, lane.refs, runs, deadline);
      } else {
        response = client->Push(lane.spec.ps, lane_header,
                                skip ? std::vector<TensorRef>() : lane.refs, deadline);
      }
      push_span.End();
      const absl::Status pushed_status = FromPs(response.status());
      if (in_runs && !checked[l]) {
        // The push ended before its last run (the ps answered first): the
        // lane's part of the verdict is still owed, or the step would wait
        // for it.
        checked[l] = 1;
        const bool ready = grads_ready_.WaitReady(lane.spec.first_piece, lane.spec.last_piece,
                                                  absl::InfiniteFuture(),
                                                  [&] { return Stopping() || verdict->Failed(); });
        verdict->Mark(ready && !verdict->Failed() && LaneFinite(l));
      }
      if (!pushed_status.ok() && beside) {
        give_up[l] = true;
        pull_done.WaitForNotification();
        // A pull that ended first needed this push: it arrived after all
        // (its answer was lost), and the pull's copies to the device are
        // done; the retry's push is a duplicate and pulls nothing again.
        if (pull_status.ok() && pulls[l].version >= 0) pulled[l] = 1;
      }
      if (stopped[l]) {
        if (Stopping()) return absl::CancelledError("stopping");
        return absl::OkStatus();  // not finite: the caller ends the step
      }
      if (!pushed_status.ok()) {
        if (IsRetryable(pushed_status) && !StopPending()) {
          PSLOG(WARNING) << "retrying: " << pushed_status.message() << " ("
                         << absl::StatusCodeToString(pushed_status.code()) << ")";
        }
        return pushed_status;
      }
      answered[l] = absl::Now();
      pushed[l] = 1;
      if (lanes_pushed.fetch_add(1) + 1 == n) ClosePushes();
      if (beside) {
        pull_done.WaitForNotification();
        PSFLOW_RETURN_IF_ERROR(pull_status);
        pulled[l] = 1;
      }
    }
    if (!pull_early) {
      // No pull, nor the step's metrics, before the whole step is known finite.
      if (verdict != nullptr && !verdict->Wait()) return absl::OkStatus();
      if (!counted[l] && push_step >= 0) count_push(l);
      return PullLane(l, min_version, nullptr, &pulls[l]);
    }
    if (!pulled[l]) PSFLOW_RETURN_IF_ERROR(PullLane(l, min_version, verdict, &pulls[l]));
    if (!verdict->Wait()) return absl::OkStatus();
    if (!counted[l]) count_push(l);
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (verdict != nullptr && !verdict->Wait()) return absl::OkStatus();  // nothing pulled
  auto by = [&](auto field) {
    std::vector<int64_t> v;
    for (const LanePull& p : pulls) v.push_back(p.*field);
    return v;
  };
  const std::vector<int64_t> versions = by(&LanePull::version), waits = by(&LanePull::wait_us);
  out->version = *std::min_element(versions.begin(), versions.end());
  out->wait_us = *std::max_element(waits.begin(), waits.end());
  if (async) {
    // Each ps counts its own versions: the next push to it names the one
    // its slices were pulled at.
    out->ps_versions.assign(job_.num_ps(), std::numeric_limits<int64_t>::max());
    out->clock = std::numeric_limits<int64_t>::max();
    out->lag = 0;
    for (int l = 0; l < n; ++l) {
      int64_t& v = out->ps_versions[lanes_[l].spec.ps];
      v = std::min(v, pulls[l].version);
      out->clock = std::min(out->clock, pulls[l].clock);
      out->lag = std::max(out->lag, pulls[l].lag);
    }
    return absl::OkStatus();
  }
  const int64_t newest = *std::max_element(versions.begin(), versions.end());
  // One step apart: a worker died between its pushes of the last step to
  // different ps (some applied it, the others still wait for its push). Do
  // the older step: the ps past it answer STALE, the others get their push.
  if (newest - out->version > 1) {
    return absl::AbortedError(
        absl::StrCat("ps disagree on the version: ", out->version, " and ", newest));
  }
  return absl::OkStatus();
}

absl::Status Trainer::PullAll(int64_t min_version, Exchanged* out) {
  return RunLanes(/*push_step=*/-1, min_version, /*skip=*/false, nullptr, out);
}

absl::Status Trainer::Exchange(int64_t step, bool skip,
                               const std::function<void(absl::Time)>& on_pushed, Exchanged* out) {
  return RunLanes(step, step + 1, skip, on_pushed, out);
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

namespace {

// A worker's batches: the examples of its step k, from its shard of the
// epoch that step falls in (the shard's order is drawn once per epoch).
class WorkerBatches {
 public:
  WorkerBatches(const data::Dataset& data, const JobConfig& job, int worker)
      : data_(data),
        sampler_(data.count, job.num_workers(), worker, job.seed()),
        batch_(WorkerBatch(job)),
        images_(static_cast<size_t>(batch_) * data.example_floats()),
        labels_(batch_) {}

  // Gathers the batch of `step` (of `steps_per_epoch` in an epoch).
  absl::Status Gather(int64_t step, int64_t steps_per_epoch) {
    const int64_t epoch = step / steps_per_epoch, position = step % steps_per_epoch;
    if (epoch != epoch_) {
      order_ = sampler_.EpochIndices(epoch);
      epoch_ = epoch;
    }
    return data::GatherBatch(data_, absl::MakeConstSpan(order_).subspan(position * batch_, batch_),
                             images_.data(), labels_.data());
  }
  const float* images() const { return images_.data(); }
  const int32_t* labels() const { return labels_.data(); }
  int64_t size() const { return batch_; }

 private:
  const data::Dataset& data_;
  data::ShardSampler sampler_;
  const int64_t batch_;
  std::vector<float> images_;
  std::vector<int32_t> labels_;
  std::vector<int64_t> order_;
  int64_t epoch_ = -1;
};

}  // namespace

absl::Status Trainer::Train(int64_t start) {
  WorkerBatches batches(data_, job_, options_.worker_index);
  const int batch = job_.batch_size();  // per replica
  const int64_t worker_batch = batches.size();
  auto job_failed = [this] { return reporter_.job_failed(); };
  const absl::Status failed = absl::FailedPreconditionError("the chief failed the job");

  int64_t step = start;
  // An asynchronous job counts this worker's own steps (its clock, as the ps
  // count its gradients); its data follow them: steps_per_epoch counts the
  // steps of every worker there.
  const bool async = Async();
  const int64_t own_steps_per_epoch =
      async ? std::max<int64_t>(job_.steps_per_epoch() / job_.num_workers(), 1)
            : job_.steps_per_epoch();
  int64_t clock = 0;
  // The outcome of the latest round of pulls: the weights the next step uses,
  // and the time they took (pull and wait, reported with that step).
  Exchanged got;
  bool have_weights = false;
  int64_t pull_us = 0, wait_us = 0;
  while (true) {
    if (reporter_.job_failed()) return failed;
    if (reporter_.reregister()) return RegisterAgain("the chief asked for a new registration");
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    const absl::Time t0 = absl::Now();
    if (!have_weights) {
      // Asynchronous: whatever this worker's clock is on the ps.
      absl::Status s = PullAll(async ? 0 : step, &got);
      if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
      if (job_failed()) return failed;
      if (JobChanged(s)) return RegisterAgain(s.message());
      if (!s.ok()) return PsFailure(s, "pull");
      have_weights = true;
      clock = got.clock;
      const int64_t took = Micros(absl::Now() - t0);
      wait_us = std::min(got.wait_us, took);
      pull_us = took - wait_us;
    }
    const absl::Time t1 = absl::Now();
    if (got.version >= job_.train_steps()) break;
    step = got.version;
    trace_step_ = step;
    if (options_.trace != nullptr) options_.trace->Reached(step);
    // Until the step's exchange is over (the next weights are in).
    TraceSpan step_span(options_.trace, "step", step);
    TraceSpan input_span(options_.trace, "input", step);
    absl::Status s = batches.Gather(async ? clock : step, own_steps_per_epoch);
    input_span.End();
    // The step's outcome, and its metrics, which go out once every push is
    // answered (the pull that follows belongs to the next step).
    absl::StatusOr<model::Network::Result> result = absl::UnknownError("no step");
    absl::Time t2, pushed_at;
    bool skip = false;
    StepMetrics async_metrics;
    auto on_pushed = [&](absl::Time last_answer) {
      // (Pushes during the backward pass may all be answered before the
      // step ends: then nothing of them is left to count as push time.)
      pushed_at = std::max(last_answer, t2);
      StepMetrics m;
      m.set_step(step);
      m.set_nonfinite(skip);  // the chief counts the skipped steps
      m.set_loss(skip ? 0 : result->loss);
      m.set_correct(result->correct);
      m.set_examples(worker_batch);
      m.set_wait_us(wait_us);
      m.set_pull_us(pull_us);
      m.set_compute_us(Micros(t2 - t1));
      m.set_push_us(Micros(pushed_at - t2));
      if (async) {
        async_metrics = std::move(m);  // reported with its staleness, once pulled
        return;
      }
      reporter_.Add(std::move(m));
    };
    // Pushing during the backward pass: the lanes start now, on another
    // thread, each pushing its gradients once the backward pass has
    // completed them (StepCopyingGradients or the network's notifications
    // mark them in grads_ready_); they pull (into the network's own
    // buffers on a CPU) once this thread has found the loss finite too
    // (the verdict; on_pushed runs after it, so it reads the result and t2
    // this thread set before).
    const bool early = s.ok() && push_early_;
    absl::Notification exchanged;
    absl::Status exchange_status;
    if (early) {
      SetStepQueued(false);
      grads_ready_.Reset(static_cast<int>(backward_pos_.size()));
      verdict_.Reset(static_cast<int>(lanes_.size()) + 1);
      exchange_caller_->Schedule([&, step] {
        exchange_status = async ? RunLanes(clock, clock + 1, false, on_pushed, &got, &verdict_)
                                : RunLanes(step, step + 1, false, on_pushed, &got, &verdict_);
        exchanged.Notify();
      });
    }
    // A CPU worker of a job without ps starts the ring all-reduce of the
    // step's gradients now, on another thread: each bucket goes as soon as
    // the backward pass has completed its gradients.
    absl::Notification reduced;
    absl::Status ring_status;
    const bool overlap = s.ok() && overlap_ring_;
    if (overlap) {
      ring_ready_.Reset(static_cast<int>(ring_pieces_.size()));
      ring_caller_->Schedule([&, step] {
        ring_status = options_.ring->AllReduce(step, ring_pieces_, WireDtypeOf(job_), &ring_ready_);
        reduced.Notify();
      });
    }
    TraceSpan compute_span(options_.trace, "compute", step);
    result = !s.ok()  ? s
             : group_ ? ReplicatedStep(batches.images(), batches.labels(), batch)
             : !host_buckets_.empty()
                 ? StepCopyingGradients(batches.images(), batches.labels(), batch)
                 : net_->TrainStep(batches.images(), batches.labels(), batch);
    compute_span.End();
    SetStepQueued(true);  // (if StepCopyingGradients did not: the step failed or ran otherwise)
    // After a failed step too, so that no lane waits for gradients that
    // never come; the verdict fails first, so that none of them pushes what
    // it then finds in its buffers. (This thread's one mark of the verdict;
    // every path out of the step from here waits for the lanes.)
    if (early) {
      if (!result.ok() || !s.ok()) verdict_.Mark(false);
      grads_ready_.MarkAllReady();
    }
    if (overlap) {
      if (result.ok()) {
        ring_loss_ = static_cast<float>(result->loss);
        ring_ready_.MarkReady(0);
      } else {
        // The group cannot go on without this worker's gradients.
        options_.ring->Leave(result.status());
        ring_ready_.MarkAllReady();
      }
      reduced.WaitForNotification();
    }
    if (result.ok() && s.ok() && !in_place_ && host_buckets_.empty()) {
      s = net_->GetGradients(grads_);
    }
    if (!result.ok() || !s.ok()) {
      // (Pushing during the backward pass, gradients are never fetched
      // after the step: a failure here is the step's, marked above.)
      if (early) exchanged.WaitForNotification();
      const absl::Status& e = result.ok() ? s : result.status();
      return absl::InternalError(absl::StrCat("step ", step, " failed: ", e.message()));
    }
    t2 = absl::Now();
    // (Overlapped: the ring already replaced it by the group's mean.)
    if (!overlap) ring_loss_ = static_cast<float>(result->loss);
    if (AllReduce()) {
      // The mean gradient of every worker, the same bits on each (and the
      // mean loss, so that all of them agree on whether the step was finite).
      s = overlap ? ring_status : options_.ring->AllReduce(step, ring_pieces_, WireDtypeOf(job_));
      if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
      if (!s.ok()) {
        // The group is gone: every worker restarts (from the newest checkpoint).
        return absl::Status(IsRetryable(s) ? s.code() : absl::StatusCode::kInternal,
                            absl::StrCat("all-reduce of step ", step, ": ", s.message()));
      }
    }
    if (early) {
      verdict_.Mark(std::isfinite(result->loss));
      TraceSpan after_span(options_.trace, "exchange after the pass", step);
      exchanged.WaitForNotification();
      after_span.End();
      // (Lanes stopped by a signal or by the chief's FAIL leave the verdict
      // failed too: that is not this step's fault.)
      if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
      if (job_failed()) return failed;
      if (!verdict_.Wait()) {
        PSLOG(ERROR) << "step " << step << ": the loss (" << result->loss
                     << ") or the gradients are not finite (in the wire dtype); lanes of finite "
                        "gradients may have pushed them, the others did not";
        return NonFinite(step);
      }
      s = exchange_status;
    } else {
      // Each lane's slices are checked on the pool, as the pushes will go.
      std::vector<char> finite_on(lanes_.size(), 1);
      FanOut(pool_.get(), static_cast<int>(lanes_.size()), RetryPolicy(), [&](int l) {
        finite_on[l] = LaneFinite(l);
        return absl::OkStatus();
      }).IgnoreError();  // the calls cannot fail
      const bool finite = std::isfinite(result->loss) && std::isfinite(ring_loss_) &&
                          std::all_of(finite_on.begin(), finite_on.end(), [](char f) { return f; });
      skip = !finite && job_.on_nonfinite() == JobConfig::SKIP_STEP;
      if (!finite && !skip) {
        PSLOG(ERROR) << "step " << step << ": the loss (" << result->loss
                     << ") or the gradients are not finite (in the wire dtype); nothing pushed";
        return NonFinite(step);
      }
      if (skip) {
        PSLOG(WARNING) << "step " << step << ": the loss (" << result->loss
                       << ") or the gradients are not finite (in the wire dtype); skipping the "
                          "step";
      }
      s = async ? RunLanes(clock, clock + 1, skip, on_pushed, &got)
                : Exchange(step, skip, on_pushed, &got);
    }
    if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
    if (job_failed()) return failed;
    if (JobChanged(s)) return RegisterAgain(s.message());
    if (!s.ok()) return PsFailure(s, "exchange with the ps");
    // After the pushes: waiting for the version (for the other workers and
    // the ps's applies), and the pull itself.
    const int64_t after_push = Micros(absl::Now() - pushed_at);
    wait_us = std::min(got.wait_us, after_push);
    pull_us = after_push - wait_us;
    ++step;
    register_backoff_.Reset();
    if (async) {
      // The pull waited for this gradient's apply (unless the job ended
      // first): its staleness is known.
      async_metrics.set_staleness(got.lag);
      reporter_.Add(std::move(async_metrics));
      clock = std::max(clock + 1, got.clock);
      step = got.version;
    }
    reporter_.SetStep(step);
  }
  return absl::OkStatus();
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
