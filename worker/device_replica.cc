#include "worker/device_replica.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "worker/clip.h"
#include "worker/exchange.h"
#include "worker/replica_tensors.h"
#include "worker/staging.h"

namespace psflow::worker {

absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> FormGpuGroup(
    allreduce::Ring* ring, kernels::Backend* backend, bool on_gpu, int worker_index, DataType dtype,
    absl::Duration timeout, const std::function<int()>& stop_signal,
    const std::function<bool()>& abandoned) {
  if (ring->size() < 2) return nullptr;
  // Whether every worker is on GPUs: the mean of a flag, times the workers.
  float on = on_gpu ? 1.0f : 0.0f;
  std::vector<absl::Span<float>> flag = {absl::MakeSpan(&on, 1)};
  absl::Status s = ring->AllReduce(/*step=*/-2, flag, DT_FLOAT);
  if (s.ok() && std::lrint(on * static_cast<float>(ring->size())) != ring->size()) {
    return nullptr;  // the host ring it is
  }
  std::string id(kernels::kPeerGroupIdBytes, '\0');
  if (s.ok() && worker_index == 0) {
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
  const kernels::WireDtype wire = dtype == DT_BFLOAT16 ? kernels::WireDtype::kBfloat16
                                  : dtype == DT_HALF   ? kernels::WireDtype::kFloat16
                                                       : kernels::WireDtype::kFloat32;
  absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> group = kernels::JoinPeerGroup(
      backend, id, worker_index, ring->size(), wire, absl::Now() + timeout, abandoned);
  if (const int sig = stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (!group.ok()) {
    const absl::Status& e = group.status();
    return absl::Status(IsRetryable(e) ? e.code() : absl::StatusCode::kInternal,
                        absl::StrCat("joining the workers' GPU group: ", e.message()));
  }
  PSLOG(INFO) << "the " << ring->size() << " workers average their gradients on their GPUs (NCCL"
              << (wire == kernels::WireDtype::kFloat32    ? ")"
                  : wire == kernels::WireDtype::kBfloat16 ? ", in bf16)"
                                                          : ", in fp16)");
  return group;
}

DeviceReplica::DeviceReplica(const JobConfig& job, DeviceReplicaOptions options,
                             ExchangeHooks hooks, ModelReplicas* model,
                             std::unique_ptr<kernels::PeerGroup> peers)
    : job_(job),
      options_(options),
      model_(model),
      backend_(model->backend()),
      peers_(std::move(peers)),
      hooks_(std::move(hooks)) {}

DeviceReplica::~DeviceReplica() {
  if (publisher_.joinable()) publisher_.join();
}

absl::StatusOr<std::unique_ptr<DeviceReplica>> DeviceReplica::Create(
    const JobConfig& job, DeviceReplicaOptions options, ExchangeHooks hooks, ModelReplicas* model,
    std::unique_ptr<kernels::PeerGroup> peers) {
  std::unique_ptr<DeviceReplica> replica(
      new DeviceReplica(job, options, std::move(hooks), model, std::move(peers)));
  absl::StatusOr<std::unique_ptr<ps::Optimizer>> optimizer = ps::Optimizer::Create(job.optimizer());
  if (!optimizer.ok()) return Permanent(optimizer.status());
  replica->optimizer_ = *std::move(optimizer);
  absl::StatusOr<float> bn_momentum = ps::BnMomentum(job);
  if (!bn_momentum.ok()) return Permanent(bn_momentum.status());
  replica->bn_momentum_ = *bn_momentum;
  replica->slots_ = static_cast<int>(replica->optimizer_->SlotNames().size());
  PSFLOW_RETURN_IF_ERROR(replica->Allocate());
  PSFLOW_RETURN_IF_ERROR(replica->MakeBuckets());
  return replica;
}

absl::Status DeviceReplica::Allocate() {
  auto allocate = [this](int64_t n, bool host,
                         std::vector<std::unique_ptr<kernels::Buffer>>* into) -> absl::Status {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> buffer =
        host ? backend_->AllocateHost(n) : backend_->Allocate(n);
    if (!buffer.ok()) return Permanent(buffer.status());
    into->push_back(*std::move(buffer));
    return absl::OkStatus();
  };
  const std::vector<int64_t>& floats = model_->variable_floats();
  for (const int64_t n : floats) {
    for (int k = 0; k < slots_; ++k) PSFLOW_RETURN_IF_ERROR(allocate(n, false, &slot_buffers_));
    for (int k = 0; k <= slots_; ++k) PSFLOW_RETURN_IF_ERROR(allocate(n, true, &staging_));
  }
  std::vector<std::unique_ptr<kernels::Buffer>> flags;
  // The loss, the count of non-finite values, the gradients' global norm
  // and GlobalNorm's scratch.
  PSFLOW_RETURN_IF_ERROR(allocate(3 + kernels::Backend::kGlobalNormScratch, false, &flags));
  PSFLOW_RETURN_IF_ERROR(allocate(3, true, &flags));
  flags_ = std::move(flags[0]);
  host_flags_ = std::move(flags[1]);
  const std::vector<VariableShape>& variables = model_->net()->variables();
  for (size_t v = 0; v < variables.size(); ++v) {
    const int64_t n = floats[v];
    float* const grad = model_->grads()[0][v];
    counted_.emplace_back(grad, static_cast<size_t>(n));
    (variables[v].trainable ? trained_ : averaged_)
        .push_back({model_->weights()[0][v], grad, slot(v, 0), slot(v, 1), n});
  }
  counted_.emplace_back(flags_->data(), 1);
  return absl::OkStatus();
}

absl::Status DeviceReplica::MakeBuckets() {
  if (peers_ == nullptr) return absl::OkStatus();
  const std::vector<int64_t>& floats = model_->variable_floats();
  const std::vector<float*>& grads = model_->grads()[0];
  if (model_->several()) {
    // Workers of several GPUs: the gradients their GPUs averaged, as one
    // bucket once the step is done (its event recorded then).
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    kernels::PeerGroup::Bucket bucket{event->get(), grads, floats};
    events_.push_back(*std::move(event));
    buckets_.push_back(std::move(bucket));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<GradientBucket>> buckets = GradientBuckets(model_->net(), backend_);
  if (!buckets.ok()) return Permanent(buckets.status());
  for (GradientBucket& b : *buckets) {
    kernels::PeerGroup::Bucket bucket;
    bucket.ready = b.ready.get();
    for (int v : b.variables) {
      bucket.buffers.push_back(grads[v]);
      bucket.sizes.push_back(floats[v]);
    }
    events_.push_back(std::move(b.ready));
    buckets_.push_back(std::move(bucket));
  }
  return absl::OkStatus();
}

absl::Status DeviceReplica::Load(ps::Client* client) {
  const absl::Time deadline = absl::Now() + options_.transfer_timeout;
  const uint64_t job_id = options_.job_id->load();
  absl::StatusOr<PsState> state = client->GetState(0, deadline);
  if (!state.ok()) return FromPs(state.status(), hooks_.stopping());
  if (state->job_id() != job_id) return RegisterAgain("this worker's replica holds another job");
  ReplicaTensors tensors(job_);
  PSFLOW_RETURN_IF_ERROR(FromPs(
      client->Snapshot(0, job_id, state->version(), tensors.Sinks(job_.placement()), deadline),
      hooks_.stopping()));
  const std::vector<const float*> values(tensors.pointers[0].begin(), tensors.pointers[0].end());
  absl::Status s = model_->net()->SetWeights(values);
  const std::vector<int64_t>& floats = model_->variable_floats();
  for (size_t v = 0; s.ok() && v < values.size(); ++v) {
    for (int k = 0; s.ok() && k < slots_; ++k) {
      s = backend_->CopyToDevice(tensors.pointers[1 + k][v], floats[v], slot(v, k));
    }
  }
  // The host buffers go away on return: the copies must be done.
  if (s.ok()) s = backend_->Synchronize();
  if (!s.ok()) return absl::InternalError(absl::StrCat("loading the replica: ", s.message()));
  published_version_ = step_ = state->version();
  return absl::OkStatus();
}

absl::Status DeviceReplica::Ended(const absl::Status& s) {
  if (!s.ok() && ended_.ok()) ended_ = s;
  return s;
}

absl::Status DeviceReplica::Pull(int64_t /*min_version*/, ExchangeRound* out) {
  if (!loaded_) {
    PSFLOW_RETURN_IF_ERROR(Ended(Load(options_.client)));
    loaded_ = true;
  }
  *out = ExchangeRound();
  out->version = step_;
  return absl::OkStatus();
}

void DeviceReplica::BeginStep(const StepPush& /*push*/, ExchangeRound* /*out*/) {
  // The served replica gets this step's if a snapshot waits for it, and
  // worker 0's at every multiple of kReplicaPublishSteps. (A failure ends
  // the step at StepQueued, before the means are queued.)
  if (step_ != published_version_ &&
      ((options_.worker_index == 0 && step_ % kReplicaPublishSteps == 0) ||
       options_.replica->WantedSnapshot(step_) == step_)) {
    Ended(Publish(step_, /*wait=*/false)).IgnoreError();
  }
}

absl::Status DeviceReplica::StepQueued() {
  PSFLOW_RETURN_IF_ERROR(ended_);
  if (peers_ == nullptr) return absl::OkStatus();
  // Single-GPU workers: the step's graph is queued; the NCCL means of its
  // gradients follow it bucket by bucket, each once the backward pass has
  // passed the bucket's event, while the rest of the backward pass runs.
  // Workers of several GPUs: their mean, after the step (a failure to mark
  // it is the step's).
  if (model_->several()) PSFLOW_RETURN_IF_ERROR(backend_->RecordEvent(buckets_[0].ready));
  return Ended(AfterGroupCall(QueueMeans()));
}

absl::Status DeviceReplica::Reduce(int64_t /*step*/, float* mean_loss) {
  PSFLOW_RETURN_IF_ERROR(Ended(Verdict(*mean_loss, &finite_)));
  *mean_loss = host_flags_->data()[0];
  return absl::OkStatus();
}

absl::Status DeviceReplica::ClipOnDevice(float bound, bool* clipped) {
  *clipped = false;
  if (!finite_) return absl::OkStatus();  // PushStep's verdict, not a clip
  // The mean gradients are the same bits on every worker, and so is their
  // norm (GlobalNorm sums in a fixed order): every replica scales alike.
  // (Batch norm's running statistics are not gradients: left alone.)
  const std::vector<VariableShape>& variables = model_->net()->variables();
  std::vector<absl::Span<float>> grads;
  for (size_t v = 0; v < variables.size(); ++v) {
    if (!variables[v].trainable) continue;
    grads.emplace_back(model_->grads()[0][v], static_cast<size_t>(model_->variable_floats()[v]));
  }
  float* const flags = flags_->data();
  absl::Status s = backend_->GlobalNorm(
      std::vector<absl::Span<const float>>(grads.begin(), grads.end()), flags + 3, flags + 2);
  if (s.ok()) s = backend_->CopyToHost(flags + 2, 1, host_flags_->data() + 2);
  double norm = s.ok() ? host_flags_->data()[2] : 0;
  // Finite gradients whose norm overflows fp32: as far as fp32 goes.
  if (std::isinf(norm)) norm = std::numeric_limits<float>::max();
  const float scale = ClipScale(norm, bound);
  for (size_t k = 0; s.ok() && scale != 1.0f && k < grads.size(); ++k) {
    s = backend_->Affine(grads[k].data(), scale, 0, grads[k].data(),
                         static_cast<int64_t>(grads[k].size()));
  }
  if (!s.ok()) {
    return Ended(absl::InternalError(
        absl::StrCat("step ", step_, ": clipping the gradients failed: ", s.message())));
  }
  *clipped = scale != 1.0f;
  return absl::OkStatus();
}

absl::Status DeviceReplica::PushStep(const StepPush& push, StepVerdictKind* verdict,
                                     ExchangeRound* out) {
  const bool skip = !finite_ && job_.on_nonfinite() == JobConfig::SKIP_STEP;
  if (!finite_ && !skip) {
    *verdict = StepVerdictKind::kNotFiniteMean;
    return absl::OkStatus();
  }
  *verdict = skip ? StepVerdictKind::kSkipped : StepVerdictKind::kFinite;
  if (skip) {
    PSLOG(WARNING) << "step " << step_ << ": the mean loss (" << push.mean_loss
                   << ") or the mean gradients are not finite; skipping the step";
  } else {
    PSFLOW_RETURN_IF_ERROR(Ended(Apply(step_)));
  }
  // The step's push time: the all-reduce and the apply.
  if (push.on_pushed) push.on_pushed(absl::Now(), skip);
  *out = ExchangeRound();
  out->version = ++step_;
  return absl::OkStatus();
}

absl::Status DeviceReplica::Finish(const absl::Status& trained) {
  // Stopped or broken by the replica's own calls: that published what it
  // could already.
  if (!ended_.ok()) return ended_;
  if (!loaded_) return trained;
  if (SignalOf(trained).has_value()) {
    PublishLast("at the stop");
    return trained;
  }
  if (!trained.ok()) return trained;
  // The final replica: the chief's final weights and every digest read it.
  absl::Status s = Publish(step_, /*wait=*/true);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("publishing the final replica: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status DeviceReplica::QueueMeans() {
  return peers_->QueueAllReduceMeans(buckets_, absl::Now() + options_.transfer_timeout,
                                     [this] { return Abandoned(); });
}

absl::Status DeviceReplica::Verdict(float loss, bool* finite) {
  // The mean gradient and loss of every worker (the same bits on each), and
  // whether any of them is not finite: one verdict for the whole group.
  float* const host_flags = host_flags_->data();
  host_flags[0] = loss;
  host_flags[1] = 0;
  absl::Status s = backend_->CopyToDevice(host_flags, 2, flags_->data());
  if (s.ok() && peers_ != nullptr) {
    // The loss, in fp32, after the gradients' buckets: its wait is theirs.
    s = peers_->AllReduceMean({flags_->data()}, {1}, absl::Now() + options_.transfer_timeout,
                              [this] { return Abandoned(); });
    PSFLOW_RETURN_IF_ERROR(AfterGroupCall(s));
  }
  if (s.ok()) s = backend_->CountNonFinite(counted_, flags_->data() + 1);
  if (s.ok()) s = backend_->CopyToHost(flags_->data(), 2, host_flags);
  if (!s.ok()) {
    return absl::InternalError(absl::StrCat("step ", step_, " failed: ", s.message()));
  }
  *finite = host_flags[1] == 0;
  return absl::OkStatus();
}

absl::Status DeviceReplica::Apply(int64_t step) {
  absl::Status s = backend_->ApplyOptimizer(optimizer_->StepAt(step), trained_);
  if (s.ok()) s = backend_->ApplyOptimizer(ps::MovingAverageStep(bn_momentum_), averaged_);
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": the optimizer failed: ", s.message()));
  }
  return absl::OkStatus();
}

bool DeviceReplica::Abandoned() const {
  return hooks_.stopping() || (options_.ring != nullptr && !options_.ring->status().ok());
}

absl::Status DeviceReplica::AfterGroupCall(const absl::Status& s) {
  if (const int sig = hooks_.stop_signal(); sig != 0) return Stopped(sig);
  if (!s.ok()) return GroupFailed(s);
  return absl::OkStatus();
}

void DeviceReplica::PublishLast(const char* why) {
  // Until a step's optimizer runs, the device holds the replica of step_,
  // whole: when this worker stops, or its group breaks, worker 0's goes to
  // the replica it serves first, where the chief's last checkpoint reads it
  // (in worker 0's process, the chief's duties checkpoint once the trainer
  // returns).
  absl::Status s = Publish(step_, /*wait=*/true);
  if (!s.ok()) PSLOG(WARNING) << "publishing the replica " << why << ": " << s.message();
}

absl::Status DeviceReplica::Stopped(int signal) {
  PublishLast("at the stop");
  return StoppedBySignal(signal);
}

absl::Status DeviceReplica::GroupFailed(const absl::Status& s) {
  options_.ring->Leave(s);
  if (options_.worker_index == 0) PublishLast("as the group broke");
  return absl::Status(IsRetryable(s) ? s.code() : absl::StatusCode::kUnavailable,
                      absl::StrCat("all-reduce of step ", step_, ": ", s.message()));
}

absl::Status DeviceReplica::Publish(int64_t version, bool wait) {
  if (publisher_.joinable()) publisher_.join();
  if (!published_.ok()) {
    PSLOG(WARNING) << "publishing the replica of step " << published_version_
                   << " failed: " << published_.message();
  }
  // Device to page-locked memory, on the step's stream (after its apply).
  const int per_variable = 1 + slots_;
  const std::vector<int64_t>& floats = model_->variable_floats();
  for (size_t v = 0; v < floats.size(); ++v) {
    for (int k = 0; k < per_variable; ++k) {
      const float* from = k == 0 ? model_->weights()[0][v] : slot(v, k - 1);
      PSFLOW_RETURN_IF_ERROR(
          backend_->CopyToHost(from, floats[v], staging_[v * per_variable + k]->data()));
    }
  }
  // Cut into the shard's slices, and published, off the training thread.
  published_version_ = version;
  publisher_ = std::thread([this, per_variable, version, job_id = options_.job_id->load(),
                            slices = SlicesOnPs(job_.placement(), 0)] {
    std::vector<ps::SliceValues> values(slices.size());
    for (size_t i = 0; i < slices.size(); ++i) {
      const SliceRef& r = slices[i];
      const int64_t n = NumElements(r.slice_shape);
      for (int k = 0; k < per_variable; ++k) {
        const float* from = staging_[r.variable_index * per_variable + k]->data() + r.float_offset;
        std::vector<float>& to = k == 0 ? values[i].value : values[i].slots.emplace_back();
        to.assign(from, from + n);
      }
    }
    published_ = options_.replica->Mirror(job_id, version, std::move(values));
  });
  if (!wait) return absl::OkStatus();
  publisher_.join();
  return published_;
}

}  // namespace psflow::worker
