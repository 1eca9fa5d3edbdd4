#include "worker/staging.h"

#include <algorithm>
#include <string>
#include <utility>

#include "common/exit_codes.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"

namespace psflow::worker {
namespace {

// GPU workers copy (or average) their gradients in buckets of about this
// many bytes, each as soon as the backward pass completes it.
constexpr int64_t kGpuBucketBytes = int64_t{4} << 20;
// The last buckets (of the first layers) are smaller, down to about this.
constexpr int64_t kGpuLastBucketBytes = int64_t{256} << 10;

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

}  // namespace

absl::StatusOr<std::vector<GradientBucket>> GradientBuckets(model::Network* net,
                                                            kernels::Backend* backend) {
  // Cut from the end of the backward order: the last bucket closes once it
  // holds kGpuLastBucketBytes, each earlier one at twice the next one's
  // size, up to kGpuBucketBytes (each overshoots by at most one variable;
  // the first takes what is left). What the backward pass completes last
  // is then little, and so is what the exchange still has to do after it.
  const std::vector<int> order = net->BackwardOrder();
  if (order.empty()) return std::vector<GradientBucket>();
  const std::vector<VariableShape>& variables = net->variables();
  std::vector<size_t> ends;  // into `order`, from the last bucket's
  int64_t bytes = 0;
  int64_t cap = kGpuLastBucketBytes;
  for (size_t k = order.size(); k-- > 0;) {
    if (bytes >= cap) {
      ends.push_back(k + 1);
      bytes = 0;
      cap = std::min(cap * 2, kGpuBucketBytes);
    }
    bytes += NumElements(variables[order[k]].shape) * static_cast<int64_t>(sizeof(float));
  }
  std::reverse(ends.begin(), ends.end());
  ends.push_back(order.size());
  std::vector<GradientBucket> buckets;
  std::vector<kernels::Event*> by_variable(variables.size(), nullptr);
  size_t begin = 0;
  for (size_t end : ends) {
    GradientBucket bucket;
    bucket.variables.assign(order.begin() + static_cast<std::ptrdiff_t>(begin),
                            order.begin() + static_cast<std::ptrdiff_t>(end));
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend->CreateEvent();
    if (!event.ok()) return event.status();
    bucket.ready = *std::move(event);
    by_variable[order[end - 1]] = bucket.ready.get();
    buckets.push_back(std::move(bucket));
    begin = end;
  }
  net->SetGradientEvents(std::move(by_variable));
  return buckets;
}

HostStaging::HostStaging(HostStagingOptions options, model::Network* net, kernels::Backend* backend)
    : options_(options), net_(net), backend_(backend) {
  for (const VariableShape& v : net_->variables()) variable_floats_.push_back(NumElements(v.shape));
}

absl::StatusOr<std::unique_ptr<HostStaging>> HostStaging::Create(HostStagingOptions options,
                                                                 model::Network* net,
                                                                 kernels::Backend* backend,
                                                                 ps::Client* client) {
  std::unique_ptr<HostStaging> staging(new HostStaging(options, net, backend));
  PSFLOW_RETURN_IF_ERROR(staging->Stage(client));
  return staging;
}

absl::Status HostStaging::Stage(ps::Client* client) {
  // Pull into and push from the network's own buffers when they are host
  // memory; otherwise stage on the host, in memory the device copies fast.
  weights_ = net_->HostWeights();
  grads_ = net_->HostGradients();
  in_place_ = !weights_.empty();
  if (in_place_) return absl::OkStatus();
  // (The gradients' staging comes last, once it is known whether the step
  // rounds them on the device: then they go to the host in 16 bits alone.)
  PSFLOW_RETURN_IF_ERROR(StageAll(&weights_, false));
  if (options_.copy_buckets) PSFLOW_RETURN_IF_ERROR(CopyBuckets());
  // Those buckets' gradients cross in the wire dtype, rounded by the step
  // on the device (in its graph, before each bucket's event).
  const DataType wire = options_.wire;
  const bool narrow = !buckets_.empty() && wire != DT_FLOAT && options_.narrow_on_device;
  // Their host buffers lie in the push region where the pushes send them as
  // they lie (in the wire dtype already).
  if (!buckets_.empty() && options_.gradients_to_shared_memory && (wire == DT_FLOAT || narrow)) {
    MakePushRegion(client, narrow);
  }
  if (narrow) PSFLOW_RETURN_IF_ERROR(Narrow());
  if (narrowed_.empty()) PSFLOW_RETURN_IF_ERROR(StageAll(&grads_, true));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<kernels::Buffer>> HostStaging::HostBuffer(int64_t floats,
                                                                         bool gradient) {
  if (gradient && push_region_ != nullptr) {
    const SharedSpan span = push_region_->data();
    const int64_t bytes = PushRegionBytes(floats);
    if (bytes <= span.size - region_used_) {
      auto* at = reinterpret_cast<float*>(span.data + region_used_);
      region_used_ += bytes;
      return std::make_unique<BorrowedBuffer>(at, static_cast<size_t>(floats));
    }
  }
  return backend_->AllocateHost(floats);
}

absl::Status HostStaging::StageAll(std::vector<float*>* into, bool gradients) {
  for (const int64_t floats : variable_floats_) {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> buffer = HostBuffer(floats, gradients);
    if (!buffer.ok()) return Permanent(buffer.status());
    staging_.push_back(*std::move(buffer));
    into->push_back(staging_.back()->data());
  }
  return absl::OkStatus();
}

absl::Status HostStaging::CopyBuckets() {
  absl::StatusOr<std::vector<GradientBucket>> buckets = GradientBuckets(net_, backend_);
  if (!buckets.ok()) {
    return absl::IsUnimplemented(buckets.status()) ? absl::OkStatus() : Permanent(buckets.status());
  }
  buckets_ = *std::move(buckets);
  // Each variable's next weights may go to the device once the step's
  // backward pass is past its layer (its bucket's event), while the rest
  // of the pass runs.
  upload_after_.assign(variable_floats_.size(), nullptr);
  for (GradientBucket& b : buckets_) {
    for (int v : b.variables) upload_after_[v] = b.ready.get();
  }
  return absl::OkStatus();
}

absl::Status HostStaging::Narrow() {
  const DataType wire = options_.wire;
  std::vector<uint16_t*> on_device;
  for (const int64_t n : variable_floats_) {
    const auto floats = static_cast<size_t>(HostGradientFloats(n, true));
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> device = backend_->Allocate(floats);
    if (!device.ok()) return Permanent(device.status());
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> host =
        HostBuffer(static_cast<int64_t>(floats), true);
    if (!host.ok()) return Permanent(host.status());
    on_device.push_back(reinterpret_cast<uint16_t*>((*device)->data()));
    narrowed_.push_back({*std::move(device), *std::move(host)});
  }
  net_->SetGradientHalves(std::move(on_device), wire == DT_BFLOAT16);
  PSLOG(INFO) << "gradients are rounded to " << (wire == DT_HALF ? "fp16" : "bf16")
              << " on the GPU before they cross to the host";
  return absl::OkStatus();
}

void HostStaging::MakePushRegion(ps::Client* client, bool narrow) {
  // A client without shared memory (--shared_memory=false) sends from
  // anywhere over the network: the backend's buffers do then.
  ps::SharedMemoryClient* const shared = client != nullptr ? client->shared_memory() : nullptr;
  if (shared == nullptr) return;
  const kernels::Backend::HostPinning pinning = backend_->host_pinning();
  if (pinning.pin == nullptr) return;
  int64_t bytes = 0;
  for (const int64_t n : variable_floats_) bytes += PushRegionBytes(HostGradientFloats(n, narrow));
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(bytes);
  std::string why;
  if (!made.ok()) {
    why = std::string(made.status().message());
  } else if (!(*made)->Pin(pinning.pin, pinning.unpin)) {
    why = "the GPU did not register it";
  } else {
    push_region_ = *std::move(made);
    shared->SetPushRegion(push_region_);  // (it takes one: above)
  }
  if (push_region_ != nullptr) {
    PSLOG(INFO) << "gradients are copied from the GPU into shared memory (" << bytes
                << " bytes), and pushes send them from there";
  } else {
    PSLOG(WARNING) << "no shared memory for the gradients (" << why
                   << "): each push copies them into a region of its own";
  }
}

std::vector<const uint16_t*> HostStaging::narrowed() const {
  std::vector<const uint16_t*> values;
  for (const NarrowedGradient& n : narrowed_) values.push_back(n.host_values());
  return values;
}

std::vector<std::vector<int>> HostStaging::bucket_variables() const {
  std::vector<std::vector<int>> variables;
  for (const GradientBucket& b : buckets_) variables.push_back(b.variables);
  return variables;
}

absl::Status HostStaging::RecordCopies() {
  copy_events_ = true;
  for (GradientBucket& b : buckets_) {
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = backend_->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    b.copied = *std::move(event);
  }
  return absl::OkStatus();
}

absl::Status HostStaging::FetchGradients() {
  if (in_place_ || !buckets_.empty()) return absl::OkStatus();
  return net_->GetGradients(grads_);
}

absl::StatusOr<model::Network::Result> HostStaging::StepCopyingGradients(
    const float* images, const int32_t* labels, int batch, Exchange* exchange, StepTrace* trace,
    int64_t trace_step) {
  PSFLOW_RETURN_IF_ERROR(net_->SetInputs(images, labels, batch));
  PSFLOW_RETURN_IF_ERROR(net_->StartTrainStep(batch));
  // The step is queued: from now on the lanes' uploads wait for its
  // events, and each bucket's copies wait on their own stream for the
  // backward pass to reach the bucket's event.
  PSFLOW_RETURN_IF_ERROR(exchange->StepQueued());
  const std::vector<float*> device = net_->DeviceGradients();
  absl::Status s;
  std::vector<kernels::HostCopy> copies;
  for (size_t b = 0; s.ok() && b < buckets_.size(); ++b) {
    copies.clear();
    for (int v : buckets_[b].variables) {
      if (narrowed_.empty()) {
        copies.push_back({device[v], grads_[v], static_cast<size_t>(variable_floats_[v])});
      } else {  // the 16-bit values the step rounded, in whole floats
        copies.push_back(
            {narrowed_[v].device->data(), narrowed_[v].host->data(), narrowed_[v].host->size()});
      }
    }
    s = backend_->CopyToHostAfter(buckets_[b].ready.get(), copies);
    if (s.ok() && copy_events_) s = backend_->RecordCopiesDone(buckets_[b].copied.get());
  }
  // The lanes push each bucket once it is on the host, in the order the
  // backward pass completes them.
  for (size_t b = 0; s.ok() && copy_events_ && b < buckets_.size(); ++b) {
    TraceSpan span(trace, "bucket to the host", trace_step);
    span.Arg("bucket", b);
    s = backend_->WaitEvent(buckets_[b].copied.get());
    span.End();
    if (!s.ok()) break;
    exchange->GradientsOnHost(buckets_[b].variables);
  }
  TraceSpan finish_span(trace, "finish step", trace_step);
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

}  // namespace psflow::worker
