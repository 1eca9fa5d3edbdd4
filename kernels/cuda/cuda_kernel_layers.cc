// The ops on psflow's own kernels (cuda_kernels.cu): BatchNorm,
// GlobalAvgPool, SoftmaxCrossEntropy and EmbeddingBag, each owning its
// scratch memory. See
// cuda_backend.h for the contract.
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_ops_internal.h"
#include "kernels/embedding_plan.h"
#include "kernels/shapes.h"

namespace psflow::kernels::cuda_internal {
namespace {

// ---------------------------------------------------------------- BatchNorm

// Own kernels (cuda_kernels.h): per-channel partial sums over slices of the
// batch, then one elementwise pass. cuDNN's legacy NCHW batch norm took
// several times longer on the H100 for the large activations of a resnet.
// Inference (given statistics) is the same elementwise pass after one small
// kernel for the per-channel scale and shift: no reduction at all.
class CudaBatchNorm final : public BatchNorm {
 public:
  CudaBatchNorm(std::shared_ptr<CudaContext> ctx, absl::string_view what, const BatchNormShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  absl::Status Init() {
    const int64_t c = shape_.channels;
    partial_floats_ = cuda_internal::ChannelPartialFloats(shape_.batch, c);
    // saved: [mean | inv_std]; scratch: partial sums, then 3 floats of
    // coefficients per channel.
    PSFLOW_RETURN_IF_ERROR(AllocateDevice(ctx_, 2 * c * sizeof(float), true, saved_));
    return AllocateDevice(ctx_, (partial_floats_ + 3 * c) * sizeof(float), false, scratch_);
  }

  absl::Status Forward(const float* x, const float* gamma, const float* beta, float* y,
                       float* batch_mean, float* batch_var) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"gamma", gamma}, {"beta", beta}, {"y", y}}));
      has_forward_ = false;
      float* scratch = Floats(scratch_);
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormForward(
          x, gamma, beta, y, Floats(saved_), scratch + partial_floats_, scratch, batch_mean,
          batch_var, shape_.batch, shape_.channels, int64_t{shape_.height} * shape_.width,
          shape_.epsilon, ctx_->stream));
      has_forward_ = true;
      return absl::OkStatus();
    });
  }

  absl::Status Infer(const float* x, const float* gamma, const float* beta, const float* mean,
                     const float* var, float* y) override {
    return RunIn(*ctx_, what_, "inference", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull(
          {{"x", x}, {"gamma", gamma}, {"beta", beta}, {"mean", mean}, {"var", var}, {"y", y}}));
      // The coefficients go where Backward computes its own: saved_ stays
      // the latest Forward's.
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormInference(
          x, gamma, beta, mean, var, y, Floats(scratch_) + partial_floats_, shape_.batch,
          shape_.channels, int64_t{shape_.height} * shape_.width, shape_.epsilon, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* x, const float* gamma, const float* dy, float* dx,
                        float* dgamma, float* dbeta) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      if (shape_.forward_only) return absl::FailedPreconditionError("the op is forward-only");
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x},
                                           {"gamma", gamma},
                                           {"dy", dy},
                                           {"dx", dx},
                                           {"dgamma", dgamma},
                                           {"dbeta", dbeta}}));
      if (!has_forward_) return absl::FailedPreconditionError("no successful Forward before it");
      float* scratch = Floats(scratch_);
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchBatchNormBackward(
          x, gamma, dy, dx, dgamma, dbeta, Floats(saved_), scratch + partial_floats_, scratch,
          shape_.batch, shape_.channels, int64_t{shape_.height} * shape_.width, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const BatchNormShape shape_;
  const std::string what_;
  int64_t partial_floats_ = 0;
  DevicePtr saved_, scratch_;
  bool has_forward_ = false;
};

// ---------------------------------------------------------------- GlobalAvgPool

class CudaGlobalAvgPool final : public GlobalAvgPool {
 public:
  CudaGlobalAvgPool(std::shared_ptr<CudaContext> ctx, absl::string_view what,
                    const GlobalAvgPoolShape& s)
      : ctx_(std::move(ctx)),
        rows_(int64_t{s.batch} * s.channels),
        hw_(int64_t{s.height} * s.width),
        what_(what) {}

  absl::Status Init() { return absl::OkStatus(); }  // nothing to prepare

  absl::Status Forward(const float* x, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"x", x}, {"y", y}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchGlobalAvgPoolForward(x, y, rows_, hw_, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* dy, float* dx) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"dy", dy}, {"dx", dx}}));
      PSFLOW_CUDA_CHECK(
          cuda_internal::LaunchGlobalAvgPoolBackward(dy, dx, rows_, hw_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const int64_t rows_, hw_;
  const std::string what_;
};

// ---------------------------------------------------------------- Concat and Interaction

// The kernels' operand block for one call: inputs, gradients and flags
// (gradients and flags empty for a forward call).
absl::StatusOr<JoinOperands> Operands(absl::string_view what, absl::Span<const float* const> xs,
                                      absl::Span<float* const> dxs, absl::Span<const uint8_t> add,
                                      size_t n) {
  std::vector<float*> none(n, nullptr);
  std::vector<uint8_t> flags(n, 0);
  const bool forward = dxs.empty() && add.empty();
  PSFLOW_RETURN_IF_ERROR(CheckJoinArgs(what, xs, forward ? absl::MakeConstSpan(none) : dxs,
                                       forward ? absl::MakeConstSpan(flags) : add, n));
  JoinOperands ops{};
  ops.n = static_cast<int>(n);
  for (size_t i = 0; i < n; ++i) {
    ops.x[i] = xs[i];
    ops.dx[i] = forward ? nullptr : dxs[i];
    ops.add[i] = forward ? 0 : add[i];
  }
  return ops;
}

class CudaConcat final : public Concat {
 public:
  CudaConcat(std::shared_ptr<CudaContext> ctx, absl::string_view what, const ConcatShape& s)
      : ctx_(std::move(ctx)), shape_(s), out_(s.out_width()), what_(what) {}

  absl::Status Init() { return absl::OkStatus(); }  // nothing to prepare

  absl::Status Forward(absl::Span<const float* const> xs, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"y", y}}));
      PSFLOW_ASSIGN_OR_RETURN(JoinOperands ops, Operands(what_, xs, {}, {}, Count()));
      Place(ops);
      PSFLOW_CUDA_CHECK(LaunchConcatForward(ops, y, shape_.batch, out_, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* dy, absl::Span<float* const> dxs,
                        absl::Span<const uint8_t> add) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"dy", dy}}));
      std::vector<const float*> inputs(Count(), dy);
      PSFLOW_ASSIGN_OR_RETURN(JoinOperands ops, Operands(what_, inputs, dxs, add, Count()));
      Place(ops);
      PSFLOW_CUDA_CHECK(LaunchConcatBackward(ops, dy, shape_.batch, out_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  size_t Count() const { return shape_.widths.size(); }
  void Place(JoinOperands& ops) const {
    int64_t offset = 0;
    for (size_t i = 0; i < Count(); ++i) {
      ops.offset[i] = offset;
      ops.width[i] = shape_.widths[i];
      offset += shape_.widths[i];
    }
  }

  std::shared_ptr<CudaContext> ctx_;
  const ConcatShape shape_;
  const int64_t out_;
  const std::string what_;
};

class CudaInteraction final : public Interaction {
 public:
  CudaInteraction(std::shared_ptr<CudaContext> ctx, absl::string_view what,
                  const InteractionShape& s)
      : ctx_(std::move(ctx)), shape_(s), what_(what) {}

  absl::Status Init() { return absl::OkStatus(); }  // nothing to prepare

  absl::Status Forward(absl::Span<const float* const> xs, float* y) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"y", y}}));
      PSFLOW_ASSIGN_OR_RETURN(const JoinOperands ops,
                              Operands(what_, xs, {}, {}, static_cast<size_t>(shape_.features)));
      PSFLOW_CUDA_CHECK(
          LaunchInteractionForward(ops, y, shape_.batch, shape_.dim, shape_.self, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(absl::Span<const float* const> xs, const float* dy,
                        absl::Span<float* const> dxs, absl::Span<const uint8_t> add) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull({{"dy", dy}}));
      PSFLOW_ASSIGN_OR_RETURN(const JoinOperands ops,
                              Operands(what_, xs, dxs, add, static_cast<size_t>(shape_.features)));
      PSFLOW_CUDA_CHECK(
          LaunchInteractionBackward(ops, dy, shape_.batch, shape_.dim, shape_.self, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const InteractionShape shape_;
  const std::string what_;
};

// ---------------------------------------------------------------- SoftmaxCrossEntropy

class CudaSoftmaxCrossEntropy final : public SoftmaxCrossEntropy {
 public:
  CudaSoftmaxCrossEntropy(std::shared_ptr<CudaContext> ctx, absl::string_view what, int batch,
                          int classes)
      : ctx_(std::move(ctx)), batch_(batch), classes_(classes), what_(what) {}

  absl::Status Init() {
    // Per-example loss and correct flag, reduced by a second kernel.
    return AllocateDevice(ctx_, 2 * static_cast<size_t>(batch_) * sizeof(float), false, scratch_);
  }

  absl::Status Forward(const float* logits, const int32_t* labels, float* probs,
                       float* stats) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(CheckNonNull(
          {{"logits", logits}, {"labels", labels}, {"probs", probs}, {"stats", stats}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchSoftmaxCrossEntropyForward(
          logits, labels, probs, Floats(scratch_), stats, batch_, classes_, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* probs, const int32_t* labels, float* dlogits) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(
          CheckNonNull({{"probs", probs}, {"labels", labels}, {"dlogits", dlogits}}));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchSoftmaxCrossEntropyBackward(
          probs, labels, dlogits, batch_, classes_, ctx_->stream));
      return absl::OkStatus();
    });
  }

 private:
  std::shared_ptr<CudaContext> ctx_;
  const int batch_, classes_;
  const std::string what_;
  DevicePtr scratch_;
};

// ---------------------------------------------------------------- EmbeddingBag

// The plan's six arrays (4-byte words all) are packed into one page-locked
// staging block and cross in one copy into one device block; both grow to
// the largest plan so far and are reused. The staging block changes only
// once the copy out of it is done (`staged_`, recorded after that copy).
class CudaEmbeddingBag final : public EmbeddingBag {
 public:
  CudaEmbeddingBag(std::shared_ptr<CudaContext> ctx, absl::string_view what, int64_t dim)
      : ctx_(std::move(ctx)), what_(what), dim_(dim) {}

  ~CudaEmbeddingBag() override {
    Scope scope(*ctx_);
    if (staged_ != nullptr) {
      static_cast<void>(cudaEventSynchronize(staged_));
      static_cast<void>(cudaEventDestroy(staged_));
    }
    if (staging_ != nullptr) static_cast<void>(cudaFreeHost(staging_));
  }

  absl::Status Init() {
    PSFLOW_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    return absl::OkStatus();
  }

  absl::Status SetPlan(const EmbeddingPlan& plan) override {
    PSFLOW_RETURN_IF_ERROR(Annotate(CheckEmbeddingPlan(plan), what_));
    return RunIn(*ctx_, what_, "plan", [&]() -> absl::Status {
      has_plan_ = false;  // until this one is in place
      const std::array<Words, 6> arrays = {Words(plan.bag_offsets), Words(plan.bag_rows),
                                           Words(plan.bag_coefs),   Words(plan.row_offsets),
                                           Words(plan.row_bags),    Words(plan.row_coefs)};
      size_t words = 0;
      for (const Words& a : arrays) words += a.size;
      PSFLOW_RETURN_IF_ERROR(Reserve(words));
      // The previous plan's copy may still be reading the staging block.
      PSFLOW_CUDA_CHECK(cudaEventSynchronize(staged_));
      int32_t* host = static_cast<int32_t*>(staging_);
      int32_t* device = static_cast<int32_t*>(device_.get());
      std::array<int32_t*, 6> placed{};
      size_t at = 0;
      for (size_t i = 0; i < arrays.size(); ++i) {
        std::memcpy(host + at, arrays[i].data, arrays[i].size * sizeof(int32_t));
        placed[i] = device + at;
        at += arrays[i].size;
      }
      PSFLOW_CUDA_CHECK(cudaMemcpyAsync(device, host, words * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, ctx_->stream));
      PSFLOW_CUDA_CHECK(cudaEventRecord(staged_, ctx_->stream));
      forward_ = {placed[0], placed[1], reinterpret_cast<const float*>(placed[2])};
      backward_ = {placed[3], placed[4], reinterpret_cast<const float*>(placed[5])};
      bags_ = plan.bags(), unique_ = plan.unique();
      has_plan_ = true;
      return absl::OkStatus();
    });
  }

  absl::Status Forward(const float* rows, float* out) override {
    return RunIn(*ctx_, what_, "forward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(Check({"rows", rows}, unique_, {"out", out}, bags_));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchGatherSum(
          forward_.offsets, forward_.index, forward_.coefs, rows, dim_, bags_, out, ctx_->stream));
      return absl::OkStatus();
    });
  }

  absl::Status Backward(const float* dy, float* row_grads) override {
    return RunIn(*ctx_, what_, "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(Check({"dy", dy}, bags_, {"row_grads", row_grads}, unique_));
      PSFLOW_CUDA_CHECK(cuda_internal::LaunchGatherSum(backward_.offsets, backward_.index,
                                                       backward_.coefs, dy, dim_, unique_,
                                                       row_grads, ctx_->stream));
      return absl::OkStatus();
    });
  }

  int64_t bags() const override { return bags_; }
  int64_t unique() const override { return unique_; }

 private:
  // One CSR map in the device block.
  struct Map {
    const int32_t* offsets = nullptr;
    const int32_t* index = nullptr;
    const float* coefs = nullptr;
  };
  using Arg = std::pair<absl::string_view, const void*>;

  // One of the plan's arrays, as the 4-byte words it copies.
  struct Words {
    template <typename T>
    explicit Words(const std::vector<T>& v) : data(v.data()), size(v.size()) {
      static_assert(sizeof(T) == sizeof(int32_t));
    }
    const void* data;
    size_t size;
  };

  // A plan, and the pointers to its sizes (null allowed where they are 0 rows).
  absl::Status Check(Arg in, int64_t in_rows, Arg out, int64_t out_rows) const {
    if (!has_plan_) return absl::FailedPreconditionError("no plan set");
    if (in_rows > 0) PSFLOW_RETURN_IF_ERROR(CheckNonNull({in}));
    if (out_rows > 0) PSFLOW_RETURN_IF_ERROR(CheckNonNull({out}));
    return absl::OkStatus();
  }

  // Room for `words` in both blocks, half as much again as asked when they
  // grow (batches differ a little in size); the old device block is freed
  // once the work queued on it is done (DeviceDeleter).
  absl::Status Reserve(size_t words) {
    if (words <= capacity_) return absl::OkStatus();
    capacity_ = 0;
    PSFLOW_CUDA_CHECK(cudaEventSynchronize(staged_));
    if (staging_ != nullptr) PSFLOW_CUDA_CHECK(cudaFreeHost(staging_));
    staging_ = nullptr;
    device_.reset();
    const size_t grown = words + words / 2;
    PSFLOW_CUDA_CHECK(cudaHostAlloc(&staging_, grown * sizeof(int32_t), cudaHostAllocPortable));
    PSFLOW_RETURN_IF_ERROR(AllocateDevice(ctx_, grown * sizeof(int32_t), false, device_));
    capacity_ = grown;
    return absl::OkStatus();
  }

  std::shared_ptr<CudaContext> ctx_;
  const std::string what_;
  const int64_t dim_;
  cudaEvent_t staged_ = nullptr;
  void* staging_ = nullptr;  // page-locked, capacity_ words
  DevicePtr device_;         // capacity_ words
  size_t capacity_ = 0;
  Map forward_, backward_;
  int64_t bags_ = 0, unique_ = 0;
  bool has_plan_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BatchNorm>> CreateBatchNorm(const std::shared_ptr<CudaContext>& ctx,
                                                           const BatchNormShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(
      what, {{"x", int64_t{shape.batch} * shape.channels * shape.height * shape.width}}));
  return Build<BatchNorm, CudaBatchNorm>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CreateGlobalAvgPool(
    const std::shared_ptr<CudaContext>& ctx, const GlobalAvgPoolShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(
      what, {{"x", int64_t{shape.batch} * shape.channels * shape.height * shape.width}}));
  return Build<GlobalAvgPool, CudaGlobalAvgPool>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<Concat>> CreateConcat(const std::shared_ptr<CudaContext>& ctx,
                                                     const ConcatShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(
      CheckElementCount(what, {{"y", int64_t{shape.batch} * shape.out_width()}}));
  return Build<Concat, CudaConcat>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<Interaction>> CreateInteraction(
    const std::shared_ptr<CudaContext>& ctx, const InteractionShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  PSFLOW_RETURN_IF_ERROR(
      CheckElementCount(what, {{"y", int64_t{shape.batch} * shape.out_width()},
                               {"dx", int64_t{shape.batch} * shape.features * shape.dim}}));
  return Build<Interaction, CudaInteraction>(ctx, what, shape);
}

absl::StatusOr<std::unique_ptr<EmbeddingBag>> CreateEmbeddingBag(
    const std::shared_ptr<CudaContext>& ctx, int64_t dim) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckEmbeddingBag(dim));
  return Build<EmbeddingBag, CudaEmbeddingBag>(ctx, what, dim);
}

absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CreateSoftmaxCrossEntropy(
    const std::shared_ptr<CudaContext>& ctx, int batch, int classes) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckSoftmaxCrossEntropy(batch, classes));
  PSFLOW_RETURN_IF_ERROR(CheckElementCount(what, {{"logits", int64_t{batch} * classes}}));
  return Build<SoftmaxCrossEntropy, CudaSoftmaxCrossEntropy>(ctx, what, batch, classes);
}

}  // namespace psflow::kernels::cuda_internal
