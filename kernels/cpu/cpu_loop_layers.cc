// The CPU backend's layer ops that oneDNN has no primitive for: global
// average pooling, embedding bags, concat and interaction, as plain loops
// (OpenMP-parallel where the size pays for it). See cpu_backend.h for the
// contract.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>
#include "common/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/embedding_plan.h"
#include "kernels/shapes.h"

namespace psflow::kernels {
namespace {

using cpu_internal::Build;
using cpu_internal::CheckNonNull;
using cpu_internal::DnnlContext;
using cpu_internal::kMinParallel;

// ---------------------------------------------------------------- GlobalAvgPool

// Plain loops: one (n, c) plane per iteration, OpenMP-parallel over the N*C
// planes when the input is large enough.
class LoopGlobalAvgPool final : public GlobalAvgPool {
 public:
  LoopGlobalAvgPool(std::shared_ptr<DnnlContext> ctx, const GlobalAvgPoolShape& s)
      : ctx_(std::move(ctx)),
        planes_(int64_t{s.batch} * s.channels),
        plane_size_(int64_t{s.height} * s.width) {}

  absl::Status Forward(const float* x, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("GlobalAvgPool forward", {{"x", x}, {"y", y}}));
    const int64_t planes = planes_, hw = plane_size_;
    const double scale = 1.0 / static_cast<double>(hw);
    const bool parallel = planes > 1 && planes * hw >= kMinParallel;
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel)
      for (int64_t p = 0; p < planes; ++p) {
        const float* plane = x + p * hw;
        double sum = 0;  // double: exact enough for any plane size
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hw; ++i) sum += plane[i];
        y[p] = static_cast<float>(sum * scale);
      }
    });
  }

  absl::Status Backward(const float* dy, float* dx) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("GlobalAvgPool backward", {{"dy", dy}, {"dx", dx}}));
    const int64_t planes = planes_, hw = plane_size_;
    const float scale = 1.0f / static_cast<float>(hw);
    const bool parallel = planes > 1 && planes * hw >= kMinParallel;
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel)
      for (int64_t p = 0; p < planes; ++p) {
        const float g = dy[p] * scale;
        float* plane = dx + p * hw;
#pragma omp simd
        for (int64_t i = 0; i < hw; ++i) plane[i] = g;
      }
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const int64_t planes_, plane_size_;
};

// ---------------------------------------------------------------- EmbeddingBag

// dst[i] = sum over k in [offsets[i], offsets[i+1]) of coefs[k] *
// src[index[k]], for n rows of dim floats: both directions of EmbeddingBag
// (the backward map is the forward one transposed). One thread per output
// row, summing in k order, so the bits do not depend on the team size.
void GatherSum(const int32_t* offsets, const int32_t* index, const float* coefs, const float* src,
               int64_t dim, int64_t n, float* dst, bool parallel) {
#pragma omp parallel for schedule(dynamic, 16) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    float* out = dst + i * dim;
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j) out[j] = 0.0f;
    for (int32_t k = offsets[i]; k < offsets[i + 1]; ++k) {
      const float c = coefs[k];
      const float* in = src + static_cast<int64_t>(index[k]) * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) out[j] += c * in[j];
    }
  }
}

// Keeps a copy of the plan's maps (host memory is the backend's memory).
class LoopEmbeddingBag final : public EmbeddingBag {
 public:
  LoopEmbeddingBag(std::shared_ptr<DnnlContext> ctx, int64_t dim)
      : ctx_(std::move(ctx)), dim_(dim) {}

  absl::Status SetPlan(const EmbeddingPlan& plan) override {
    PSFLOW_RETURN_IF_ERROR(CheckEmbeddingPlan(plan));
    has_plan_ = false;  // until this one is in place
    plan_.batch = plan.batch;
    plan_.features = plan.features;
    plan_.bag_offsets = plan.bag_offsets;
    plan_.bag_rows = plan.bag_rows;
    plan_.bag_coefs = plan.bag_coefs;
    plan_.row_offsets = plan.row_offsets;
    plan_.row_bags = plan.row_bags;
    plan_.row_coefs = plan.row_coefs;
    unique_ = plan.unique();
    has_plan_ = true;
    return absl::OkStatus();
  }

  absl::Status Forward(const float* rows, float* out) override {
    PSFLOW_RETURN_IF_ERROR(
        Check("EmbeddingBag forward", {"rows", rows}, unique_, {"out", out}, bags()));
    return Run(plan_.bag_offsets, plan_.bag_rows, plan_.bag_coefs, rows, bags(), out);
  }

  absl::Status Backward(const float* dy, float* row_grads) override {
    PSFLOW_RETURN_IF_ERROR(
        Check("EmbeddingBag backward", {"dy", dy}, bags(), {"row_grads", row_grads}, unique_));
    return Run(plan_.row_offsets, plan_.row_bags, plan_.row_coefs, dy, unique_, row_grads);
  }

  int64_t bags() const override { return plan_.bags(); }
  int64_t unique() const override { return unique_; }

 private:
  using Arg = std::pair<absl::string_view, const void*>;

  // A plan, and the pointers to its sizes (null allowed where they are 0 rows).
  absl::Status Check(absl::string_view op, Arg in, int64_t in_rows, Arg out,
                     int64_t out_rows) const {
    if (!has_plan_) return absl::FailedPreconditionError(absl::StrCat(op, ": no plan set"));
    if (in_rows > 0) PSFLOW_RETURN_IF_ERROR(CheckNonNull(op, {in}));
    if (out_rows > 0) PSFLOW_RETURN_IF_ERROR(CheckNonNull(op, {out}));
    return absl::OkStatus();
  }

  absl::Status Run(const std::vector<int32_t>& offsets, const std::vector<int32_t>& index,
                   const std::vector<float>& coefs, const float* src, int64_t n, float* dst) {
    if (n == 0) return absl::OkStatus();
    const bool parallel = n > 1 && (static_cast<int64_t>(index.size()) + n) * dim_ >= kMinParallel;
    return ctx_->RunLoops([&] {
      GatherSum(offsets.data(), index.data(), coefs.data(), src, dim_, n, dst, parallel);
    });
  }

  std::shared_ptr<DnnlContext> ctx_;
  const int64_t dim_;
  EmbeddingPlan plan_;  // its maps; unique_ids stay empty (the op never needs them)
  int64_t unique_ = 0;
  bool has_plan_ = false;
};

// ---------------------------------------------------------------- Concat and Interaction

// Plain copies per example, OpenMP-parallel over the examples of a large
// batch.
class LoopConcat final : public Concat {
 public:
  LoopConcat(std::shared_ptr<DnnlContext> ctx, std::string what, const ConcatShape& s)
      : ctx_(std::move(ctx)), what_(std::move(what)), shape_(s), out_(s.out_width()) {}

  absl::Status Forward(absl::Span<const float* const> xs, float* y) override {
    const size_t n = shape_.widths.size();
    std::vector<float*> none(n, nullptr);
    std::vector<uint8_t> flags(n, 0);
    PSFLOW_RETURN_IF_ERROR(CheckJoinArgs(what_, xs, none, flags, n));
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Concat forward", {{"y", y}}));
    const bool parallel = shape_.batch > 1 && shape_.batch * out_ >= kMinParallel;
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel)
      for (int64_t e = 0; e < shape_.batch; ++e) {
        float* out = y + e * out_;
        for (size_t i = 0; i < n; ++i) {
          const int64_t w = shape_.widths[i];
          std::memcpy(out, xs[i] + e * w, sizeof(float) * w);
          out += w;
        }
      }
    });
  }

  absl::Status Backward(const float* dy, absl::Span<float* const> dxs,
                        absl::Span<const uint8_t> add) override {
    const size_t n = shape_.widths.size();
    std::vector<const float*> inputs(n, dy);
    PSFLOW_RETURN_IF_ERROR(CheckJoinArgs(what_, inputs, dxs, add, n));
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Concat backward", {{"dy", dy}}));
    const bool parallel = shape_.batch > 1 && shape_.batch * out_ >= kMinParallel;
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel)
      for (int64_t e = 0; e < shape_.batch; ++e) {
        const float* in = dy + e * out_;
        for (size_t i = 0; i < n; ++i) {
          const int64_t w = shape_.widths[i];
          if (dxs[i] != nullptr) {
            float* d = dxs[i] + e * w;
            if (add[i] != 0) {
#pragma omp simd
              for (int64_t k = 0; k < w; ++k) d[k] += in[k];
            } else {
              std::memcpy(d, in, sizeof(float) * w);
            }
          }
          in += w;
        }
      }
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const std::string what_;
  const ConcatShape shape_;
  const int64_t out_;
};

// The pairs of an interaction in output order: (i, j) for i > j (i >= j
// with self), i ascending, then j.
std::vector<std::pair<int, int>> InteractionPairs(const InteractionShape& s) {
  std::vector<std::pair<int, int>> pairs;
  for (int i = 0; i < s.features; ++i) {
    for (int j = 0; j < (s.self ? i + 1 : i); ++j) pairs.emplace_back(i, j);
  }
  return pairs;
}

// Per example: a copy of x0, then one dot product per pair; backward, each
// operand's gradient gathered in a buffer of the example's own. Parallel
// over the examples.
class LoopInteraction final : public Interaction {
 public:
  LoopInteraction(std::shared_ptr<DnnlContext> ctx, std::string what, const InteractionShape& s)
      : ctx_(std::move(ctx)), what_(std::move(what)), shape_(s), pairs_(InteractionPairs(s)) {}

  absl::Status Forward(absl::Span<const float* const> xs, float* y) override {
    const size_t f = static_cast<size_t>(shape_.features);
    std::vector<float*> none(f, nullptr);
    std::vector<uint8_t> flags(f, 0);
    PSFLOW_RETURN_IF_ERROR(CheckJoinArgs(what_, xs, none, flags, f));
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Interaction forward", {{"y", y}}));
    const int64_t d = shape_.dim, out = shape_.out_width();
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (Parallel())
      for (int64_t e = 0; e < shape_.batch; ++e) {
        float* row = y + e * out;
        std::memcpy(row, xs[0] + e * d, sizeof(float) * d);
        for (size_t p = 0; p < pairs_.size(); ++p) {
          const float* a = xs[pairs_[p].first] + e * d;
          const float* b = xs[pairs_[p].second] + e * d;
          float dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t k = 0; k < d; ++k) dot += a[k] * b[k];
          row[d + static_cast<int64_t>(p)] = dot;
        }
      }
    });
  }

  absl::Status Backward(absl::Span<const float* const> xs, const float* dy,
                        absl::Span<float* const> dxs, absl::Span<const uint8_t> add) override {
    PSFLOW_RETURN_IF_ERROR(
        CheckJoinArgs(what_, xs, dxs, add, static_cast<size_t>(shape_.features)));
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Interaction backward", {{"dy", dy}}));
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (Parallel())
      for (int64_t e = 0; e < shape_.batch; ++e) BackwardExample(e, xs, dy, dxs, add);
    });
  }

 private:
  bool Parallel() const {
    return shape_.batch > 1 &&
           shape_.batch * static_cast<int64_t>(pairs_.size() + 1) * shape_.dim >= kMinParallel;
  }

  void BackwardExample(int64_t e, absl::Span<const float* const> xs, const float* dy,
                       absl::Span<float* const> dxs, absl::Span<const uint8_t> add) const {
    const int64_t d = shape_.dim, f = shape_.features;
    const float* g = dy + e * shape_.out_width();
    thread_local std::vector<float> grad;
    grad.assign(static_cast<size_t>(f * d), 0.0f);
    std::memcpy(grad.data(), g, sizeof(float) * d);
    for (size_t p = 0; p < pairs_.size(); ++p) {
      const auto [i, j] = pairs_[p];
      const float gp = g[d + static_cast<int64_t>(p)];
      const float* a = xs[i] + e * d;
      const float* b = xs[j] + e * d;
      float* ga = grad.data() + i * d;
      float* gb = grad.data() + j * d;
      for (int64_t k = 0; k < d; ++k) {
        ga[k] += gp * b[k];
        gb[k] += gp * a[k];  // i == j: both terms, 2 gp x
      }
    }
    for (int64_t i = 0; i < f; ++i) {
      if (dxs[i] == nullptr) continue;
      float* out = dxs[i] + e * d;
      const float* src = grad.data() + i * d;
      for (int64_t k = 0; k < d; ++k) out[k] = add[i] != 0 ? out[k] + src[k] : src[k];
    }
  }

  std::shared_ptr<DnnlContext> ctx_;
  const std::string what_;
  const InteractionShape shape_;
  const std::vector<std::pair<int, int>> pairs_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddingBag>> CpuBackend::CreateEmbeddingBag(int64_t dim) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckEmbeddingBag(dim));
  return Build<EmbeddingBag>(what, [&] { return std::make_unique<LoopEmbeddingBag>(ctx_, dim); });
}

absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CpuBackend::CreateGlobalAvgPool(
    const GlobalAvgPoolShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<GlobalAvgPool>(what,
                              [&] { return std::make_unique<LoopGlobalAvgPool>(ctx_, shape); });
}

absl::StatusOr<std::unique_ptr<Concat>> CpuBackend::CreateConcat(const ConcatShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<Concat>(what, [&] { return std::make_unique<LoopConcat>(ctx_, what, shape); });
}

absl::StatusOr<std::unique_ptr<Interaction>> CpuBackend::CreateInteraction(
    const InteractionShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<Interaction>(what,
                            [&] { return std::make_unique<LoopInteraction>(ctx_, what, shape); });
}

}  // namespace psflow::kernels
