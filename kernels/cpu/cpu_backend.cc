// CPU backend on oneDNN 2.x; see cpu_backend.h for the contract.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <omp.h>
#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

#include "common/cpu_count.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/host_memory.h"
#include "kernels/shapes.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace psflow::kernels {

namespace {

using cpu_internal::Build;
using cpu_internal::CheckNonNull;
using cpu_internal::DnnlContext;
using cpu_internal::kMinParallel;
using dnnl::memory;
using Tag = memory::format_tag;
using Args = std::unordered_map<int, memory>;

constexpr size_t kAlignment = 64;

class HostBuffer final : public Buffer {
 public:
  HostBuffer(float* data, size_t size) : data_(data), size_(size) {}
  ~HostBuffer() override { std::free(data_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  float* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  float* data_;
  size_t size_;
};

memory::desc Md(const memory::dims& dims, Tag tag) {
  return memory::desc(dims, memory::data_type::f32, tag);
}

// A memory object without a buffer; each call points it at the caller's data.
memory Unbound(const memory::desc& md, const dnnl::engine& engine) {
  return memory(md, engine, DNNL_MEMORY_NONE);
}

// oneDNN only reads its source arguments, so dropping const is safe.
void Bind(const memory& m, const void* data) { m.set_data_handle(const_cast<void*>(data)); }

// What a forward-only op answers to the calls it was built without.
absl::Status NotBuiltFor(absl::string_view op) {
  return absl::FailedPreconditionError(absl::StrCat(op, ": the op was created forward-only"));
}

// ---------------------------------------------------------------- Conv2D

class DnnlConv2D final : public Conv2D {
 public:
  DnnlConv2D(std::shared_ptr<DnnlContext> ctx, const Conv2DShape& s)
      : ctx_(std::move(ctx)), forward_only_(s.forward_only) {
    const dnnl::engine& eng = ctx_->engine;
    const auto x_md = Md({s.batch, s.in_channels, s.height, s.width}, Tag::nchw);
    const auto w_md = Md({s.out_channels, s.in_channels, s.kernel_h, s.kernel_w}, Tag::oihw);
    const auto b_md = Md({s.out_channels}, Tag::x);
    const auto y_md = Md({s.batch, s.out_channels, s.out_height(), s.out_width()}, Tag::nchw);
    const memory::dims strides = {s.stride, s.stride};
    // oneDNN checks (in + pad_l + pad_r - k) / stride + 1 == out with the same
    // floor as Conv2DShape, so symmetric padding is consistent.
    const memory::dims pad = {s.padding, s.padding};
    const auto algo = dnnl::algorithm::convolution_direct;

    const auto train = dnnl::prop_kind::forward_training;

    // Both variants, with and without bias, are built here, so that a layer
    // may pick per call and no call ever creates a primitive.
    const dnnl::convolution_forward::primitive_desc fwd_pd(
        {train, algo, x_md, w_md, b_md, y_md, strides, pad, pad}, eng);
    const dnnl::convolution_forward::primitive_desc fwd_no_bias_pd(
        {train, algo, x_md, w_md, y_md, strides, pad, pad}, eng);
    fwd_ = dnnl::convolution_forward(fwd_pd);
    fwd_no_bias_ = dnnl::convolution_forward(fwd_no_bias_pd);
    if (!forward_only_) {
      const dnnl::convolution_backward_data::primitive_desc bwd_data_pd(
          {algo, x_md, w_md, y_md, strides, pad, pad}, eng, fwd_pd);
      const dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd(
          {algo, x_md, w_md, b_md, y_md, strides, pad, pad}, eng, fwd_pd);
      const dnnl::convolution_backward_weights::primitive_desc bwd_weights_no_bias_pd(
          {algo, x_md, w_md, y_md, strides, pad, pad}, eng, fwd_no_bias_pd);
      bwd_data_ = dnnl::convolution_backward_data(bwd_data_pd);
      bwd_weights_ = dnnl::convolution_backward_weights(bwd_weights_pd);
      bwd_weights_no_bias_ = dnnl::convolution_backward_weights(bwd_weights_no_bias_pd);
    }

    x_ = Unbound(x_md, eng), w_ = Unbound(w_md, eng), b_ = Unbound(b_md, eng);
    y_ = Unbound(y_md, eng), dx_ = Unbound(x_md, eng), dw_ = Unbound(w_md, eng);
    db_ = Unbound(b_md, eng), dy_ = Unbound(y_md, eng);
    // The maps hold handles to the same memory objects, so Bind() updates them.
    fwd_no_bias_args_ = {{DNNL_ARG_SRC, x_}, {DNNL_ARG_WEIGHTS, w_}, {DNNL_ARG_DST, y_}};
    fwd_args_ = fwd_no_bias_args_;
    fwd_args_.insert({DNNL_ARG_BIAS, b_});
    bwd_data_args_ = {{DNNL_ARG_DIFF_DST, dy_}, {DNNL_ARG_WEIGHTS, w_}, {DNNL_ARG_DIFF_SRC, dx_}};
    bwd_weights_no_bias_args_ = {
        {DNNL_ARG_SRC, x_}, {DNNL_ARG_DIFF_DST, dy_}, {DNNL_ARG_DIFF_WEIGHTS, dw_}};
    bwd_weights_args_ = bwd_weights_no_bias_args_;
    bwd_weights_args_.insert({DNNL_ARG_DIFF_BIAS, db_});
  }

  // b == nullptr: no bias.
  absl::Status Forward(const float* x, const float* w, const float* b, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Conv2D forward", {{"x", x}, {"w", w}, {"y", y}}));
    return ctx_->Run("Conv2D forward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(w_, w), Bind(y_, y);
      if (b != nullptr) {
        Bind(b_, b);
        fwd_.execute(stream, fwd_args_);
      } else {
        fwd_no_bias_.execute(stream, fwd_no_bias_args_);
      }
    });
  }

  // db == nullptr: the layer has no bias, so no bias gradient.
  absl::Status Backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                        float* db) override {
    if (forward_only_) return NotBuiltFor("Conv2D backward");
    PSFLOW_RETURN_IF_ERROR(
        CheckNonNull("Conv2D backward", {{"x", x}, {"w", w}, {"dy", dy}, {"dw", dw}}));
    return ctx_->Run("Conv2D backward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(w_, w), Bind(dy_, dy), Bind(dw_, dw);
      if (dx != nullptr) {  // null for a first layer: nothing consumes dx
        Bind(dx_, dx);
        bwd_data_.execute(stream, bwd_data_args_);
      }
      if (db != nullptr) {
        Bind(db_, db);
        bwd_weights_.execute(stream, bwd_weights_args_);
      } else {
        bwd_weights_no_bias_.execute(stream, bwd_weights_no_bias_args_);
      }
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const bool forward_only_;  // no backward primitives
  dnnl::convolution_forward fwd_, fwd_no_bias_;
  dnnl::convolution_backward_data bwd_data_;
  dnnl::convolution_backward_weights bwd_weights_, bwd_weights_no_bias_;
  memory x_, w_, b_, y_, dx_, dw_, db_, dy_;
  Args fwd_args_, fwd_no_bias_args_, bwd_data_args_, bwd_weights_args_, bwd_weights_no_bias_args_;
};

// ---------------------------------------------------------------- MaxPool2D

// One plane of max pooling: each output row holds the running maximum
// (and its offset in `in`, with kKeepArg) while the window's positions are
// visited in row-major order; the loops over a row are branch-free, so they
// vectorize.
template <bool kKeepArg>
void PoolPlane(const float* in, int window, int stride, int width, int out_h, int out_w, float* out,
               int32_t* arg) {
  for (int oh = 0; oh < out_h; ++oh) {
    float* m = out + oh * out_w;
    int32_t* best = kKeepArg ? arg + oh * out_w : nullptr;
    const int32_t base = oh * stride * width;
#pragma omp simd
    for (int ow = 0; ow < out_w; ++ow) {
      m[ow] = in[base + ow * stride];
      if constexpr (kKeepArg) best[ow] = base + ow * stride;
    }
    for (int kh = 0; kh < window; ++kh) {
      for (int kw = 0; kw < window; ++kw) {
        const int32_t offset = base + kh * width + kw;
#pragma omp simd
        for (int ow = 0; ow < out_w; ++ow) {
          const int32_t i = offset + ow * stride;
          const float v = in[i];
          // Larger, or the first NaN (v != v) of a window not yet NaN.
          const bool take = v > m[ow] || (v != v && m[ow] == m[ow]);
          m[ow] = take ? v : m[ow];
          if constexpr (kKeepArg) best[ow] = take ? i : best[ow];
        }
      }
    }
  }
}

// Plain loops, one (n, c) plane per iteration, OpenMP-parallel over the N*C
// planes when the input is large enough. oneDNN 2.6 has no fast max pooling
// on plain NCHW tensors: it picks its reference implementation
// (simple_nchw), which took 9.1 ms for the cnn's first pooling (64x20x24x24,
// forward_training, one thread of an AVX2 server) where this loop takes
// 1.1 ms; its JIT pooling wants blocked layouts, and with the reorders there
// and back it took 4.2 ms.
//
// The arg-max of each window is the first of its largest values in
// row-major window order; a NaN anywhere in a window is its maximum (so a
// diverged activation reaches the loss instead of being dropped here).
class LoopMaxPool2D final : public MaxPool2D {
 public:
  LoopMaxPool2D(std::shared_ptr<DnnlContext> ctx, const Pool2DShape& s)
      : ctx_(std::move(ctx)),
        shape_(s),
        planes_(int64_t{s.batch} * s.channels),
        in_size_(int64_t{s.height} * s.width),
        out_size_(int64_t{s.out_height()} * s.out_width()),
        parallel_(planes_ > 1 && planes_ * in_size_ >= kMinParallel) {
    // Forward-only: no arg-max positions kept (Backward is refused).
    if (!s.forward_only) argmax_.resize(static_cast<size_t>(planes_ * out_size_));
  }

  absl::Status Forward(const float* x, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("MaxPool2D forward", {{"x", x}, {"y", y}}));
    const int window = shape_.window, stride = shape_.stride, width = shape_.width;
    const int out_h = shape_.out_height(), out_w = shape_.out_width();
    const int64_t in_size = in_size_, out_size = out_size_;
    int32_t* const argmax = argmax_.empty() ? nullptr : argmax_.data();
    absl::Status status = ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel_)
      for (int64_t p = 0; p < planes_; ++p) {
        const float* in = x + p * in_size;
        float* out = y + p * out_size;
        if (argmax != nullptr) {
          PoolPlane<true>(in, window, stride, width, out_h, out_w, out, argmax + p * out_size);
        } else {
          PoolPlane<false>(in, window, stride, width, out_h, out_w, out, nullptr);
        }
      }
    });
    has_argmax_ = status.ok() && argmax != nullptr;
    return status;
  }

  absl::Status Backward(const float* dy, float* dx) override {
    if (shape_.forward_only) return NotBuiltFor("MaxPool2D backward");
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("MaxPool2D backward", {{"dy", dy}, {"dx", dx}}));
    if (!has_argmax_) {
      return absl::FailedPreconditionError("MaxPool2D backward: no successful Forward before it");
    }
    const int64_t in_size = in_size_, out_size = out_size_;
    const int32_t* const argmax = argmax_.data();
    return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel_)
      for (int64_t p = 0; p < planes_; ++p) {
        float* plane = dx + p * in_size;
        std::fill(plane, plane + in_size, 0.0f);
        const float* g = dy + p * out_size;
        const int32_t* arg = argmax + p * out_size;
        // Overlapping windows (stride < window) may share an arg-max.
        for (int64_t o = 0; o < out_size; ++o) plane[arg[o]] += g[o];
      }
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const Pool2DShape shape_;
  const int64_t planes_, in_size_, out_size_;
  const bool parallel_;  // large enough for OpenMP's team
  // The arg-max of every output of the latest Forward (its offset in the
  // input plane), read by Backward.
  std::vector<int32_t> argmax_;
  bool has_argmax_ = false;
};

// ---------------------------------------------------------------- Relu

class DnnlRelu final : public Relu {
 public:
  DnnlRelu(std::shared_ptr<DnnlContext> ctx, int64_t size) : ctx_(std::move(ctx)) {
    const dnnl::engine& eng = ctx_->engine;
    const auto md = Md({size}, Tag::x);
    const auto algo = dnnl::algorithm::eltwise_relu;
    const dnnl::eltwise_forward::primitive_desc fwd_pd(
        {dnnl::prop_kind::forward_training, algo, md, /*alpha=*/0.f}, eng);
    // Backward from the source (not dst), as the interface passes x.
    const dnnl::eltwise_backward::primitive_desc bwd_pd({algo, md, md, /*alpha=*/0.f}, eng, fwd_pd);
    fwd_ = dnnl::eltwise_forward(fwd_pd);
    bwd_ = dnnl::eltwise_backward(bwd_pd);

    x_ = Unbound(md, eng), y_ = Unbound(md, eng), dx_ = Unbound(md, eng), dy_ = Unbound(md, eng);
    fwd_args_ = {{DNNL_ARG_SRC, x_}, {DNNL_ARG_DST, y_}};
    bwd_args_ = {{DNNL_ARG_SRC, x_}, {DNNL_ARG_DIFF_DST, dy_}, {DNNL_ARG_DIFF_SRC, dx_}};
  }

  absl::Status Forward(const float* x, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Relu forward", {{"x", x}, {"y", y}}));
    return ctx_->Run("Relu forward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(y_, y);
      fwd_.execute(stream, fwd_args_);
    });
  }

  absl::Status Backward(const float* x, const float* dy, float* dx) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Relu backward", {{"x", x}, {"dy", dy}, {"dx", dx}}));
    return ctx_->Run("Relu backward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(dy_, dy), Bind(dx_, dx);
      bwd_.execute(stream, bwd_args_);
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  dnnl::eltwise_forward fwd_;
  dnnl::eltwise_backward bwd_;
  memory x_, y_, dx_, dy_;
  Args fwd_args_, bwd_args_;
};

// ---------------------------------------------------------------- Dense

class DnnlDense final : public Dense {
 public:
  DnnlDense(std::shared_ptr<DnnlContext> ctx, const DenseShape& s)
      : ctx_(std::move(ctx)), forward_only_(s.forward_only) {
    const dnnl::engine& eng = ctx_->engine;
    const auto x_md = Md({s.batch, s.in_features}, Tag::nc);
    const auto w_md = Md({s.out_features, s.in_features}, Tag::oi);
    const auto b_md = Md({s.out_features}, Tag::x);
    const auto y_md = Md({s.batch, s.out_features}, Tag::nc);

    const dnnl::inner_product_forward::primitive_desc fwd_pd(
        {dnnl::prop_kind::forward_training, x_md, w_md, b_md, y_md}, eng);
    fwd_ = dnnl::inner_product_forward(fwd_pd);
    if (!forward_only_) {
      const dnnl::inner_product_backward_data::primitive_desc bwd_data_pd({x_md, w_md, y_md}, eng,
                                                                          fwd_pd);
      const dnnl::inner_product_backward_weights::primitive_desc bwd_weights_pd(
          {x_md, w_md, b_md, y_md}, eng, fwd_pd);
      bwd_data_ = dnnl::inner_product_backward_data(bwd_data_pd);
      bwd_weights_ = dnnl::inner_product_backward_weights(bwd_weights_pd);
    }

    x_ = Unbound(x_md, eng), w_ = Unbound(w_md, eng), b_ = Unbound(b_md, eng);
    y_ = Unbound(y_md, eng), dx_ = Unbound(x_md, eng), dw_ = Unbound(w_md, eng);
    db_ = Unbound(b_md, eng), dy_ = Unbound(y_md, eng);
    fwd_args_ = {
        {DNNL_ARG_SRC, x_}, {DNNL_ARG_WEIGHTS, w_}, {DNNL_ARG_BIAS, b_}, {DNNL_ARG_DST, y_}};
    bwd_data_args_ = {{DNNL_ARG_DIFF_DST, dy_}, {DNNL_ARG_WEIGHTS, w_}, {DNNL_ARG_DIFF_SRC, dx_}};
    bwd_weights_args_ = {{DNNL_ARG_SRC, x_},
                         {DNNL_ARG_DIFF_DST, dy_},
                         {DNNL_ARG_DIFF_WEIGHTS, dw_},
                         {DNNL_ARG_DIFF_BIAS, db_}};
  }

  absl::Status Forward(const float* x, const float* w, const float* b, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("Dense forward", {{"x", x}, {"w", w}, {"b", b}, {"y", y}}));
    return ctx_->Run("Dense forward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(w_, w), Bind(b_, b), Bind(y_, y);
      fwd_.execute(stream, fwd_args_);
    });
  }

  absl::Status Backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                        float* db) override {
    if (forward_only_) return NotBuiltFor("Dense backward");
    PSFLOW_RETURN_IF_ERROR(
        CheckNonNull("Dense backward", {{"x", x}, {"w", w}, {"dy", dy}, {"dw", dw}, {"db", db}}));
    return ctx_->Run("Dense backward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(w_, w), Bind(dy_, dy), Bind(dw_, dw), Bind(db_, db);
      if (dx != nullptr) {
        Bind(dx_, dx);
        bwd_data_.execute(stream, bwd_data_args_);
      }
      bwd_weights_.execute(stream, bwd_weights_args_);
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const bool forward_only_;  // no backward primitives
  dnnl::inner_product_forward fwd_;
  dnnl::inner_product_backward_data bwd_data_;
  dnnl::inner_product_backward_weights bwd_weights_;
  memory x_, w_, b_, y_, dx_, dw_, db_, dy_;
  Args fwd_args_, bwd_data_args_, bwd_weights_args_;
};

// ---------------------------------------------------------------- SoftmaxCrossEntropy

class DnnlSoftmaxCrossEntropy final : public SoftmaxCrossEntropy {
 public:
  DnnlSoftmaxCrossEntropy(std::shared_ptr<DnnlContext> ctx, int batch, int classes)
      : ctx_(std::move(ctx)), batch_(batch), classes_(classes) {
    const dnnl::engine& eng = ctx_->engine;
    const auto md = Md({batch, classes}, Tag::nc);
    const dnnl::softmax_forward::primitive_desc pd(
        {dnnl::prop_kind::forward_inference, md, /*softmax_axis=*/1}, eng);
    fwd_ = dnnl::softmax_forward(pd);
    logits_ = Unbound(md, eng), probs_ = Unbound(md, eng);
    args_ = {{DNNL_ARG_SRC, logits_}, {DNNL_ARG_DST, probs_}};
  }

  // labels and stats are host memory, as all memory of this backend.
  absl::Status Forward(const float* logits, const int32_t* labels, float* probs,
                       float* stats) override {
    PSFLOW_RETURN_IF_ERROR(
        CheckNonNull("SoftmaxCrossEntropy forward",
                     {{"logits", logits}, {"labels", labels}, {"probs", probs}, {"stats", stats}}));
    PSFLOW_RETURN_IF_ERROR(CheckLabels("SoftmaxCrossEntropy forward", labels));
    PSFLOW_RETURN_IF_ERROR(ctx_->Run("SoftmaxCrossEntropy forward", [&](dnnl::stream& stream) {
      Bind(logits_, logits), Bind(probs_, probs);
      fwd_.execute(stream, args_);
    }));
    // The loss comes from the logits by log-sum-exp rather than from log(probs):
    // exact even where a probability underflows to 0.
    double total = 0;
    int64_t correct = 0;
    for (int i = 0; i < batch_; ++i) {
      const float* row = logits + static_cast<size_t>(i) * classes_;
      const int argmax = static_cast<int>(std::max_element(row, row + classes_) - row);
      const double max = row[argmax];
      double sum = 0;
      for (int j = 0; j < classes_; ++j) sum += std::exp(double{row[j]} - max);
      total += max + std::log(sum) - row[labels[i]];
      if (argmax == labels[i]) ++correct;
    }
    stats[0] = static_cast<float>(total / batch_);
    stats[1] = static_cast<float>(correct);
    return absl::OkStatus();
  }

  absl::Status Backward(const float* probs, const int32_t* labels, float* dlogits) override {
    PSFLOW_RETURN_IF_ERROR(
        CheckNonNull("SoftmaxCrossEntropy backward",
                     {{"probs", probs}, {"labels", labels}, {"dlogits", dlogits}}));
    PSFLOW_RETURN_IF_ERROR(CheckLabels("SoftmaxCrossEntropy backward", labels));
    const float scale = 1.0f / batch_;
    for (int i = 0; i < batch_; ++i) {
      const size_t row = static_cast<size_t>(i) * classes_;
      for (int j = 0; j < classes_; ++j) {
        const float onehot = j == labels[i] ? 1.0f : 0.0f;
        dlogits[row + j] = (probs[row + j] - onehot) * scale;
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status CheckLabels(absl::string_view op, const int32_t* labels) const {
    for (int i = 0; i < batch_; ++i) {
      if (labels[i] < 0 || labels[i] >= classes_) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: label %d of example %d is outside [0, %d)", op, labels[i], i, classes_));
      }
    }
    return absl::OkStatus();
  }

  std::shared_ptr<DnnlContext> ctx_;
  const int batch_, classes_;
  dnnl::softmax_forward fwd_;
  memory logits_, probs_;
  Args args_;
};

// ---------------------------------------------------------------- BatchNorm

class DnnlBatchNorm final : public BatchNorm {
 public:
  DnnlBatchNorm(std::shared_ptr<DnnlContext> ctx, const BatchNormShape& s)
      : ctx_(std::move(ctx)),
        channels_(s.channels),
        count_(static_cast<double>(s.batch) * s.height * s.width),
        forward_only_(s.forward_only) {
    const dnnl::engine& eng = ctx_->engine;
    const auto x_md = Md({s.batch, s.channels, s.height, s.width}, Tag::nchw);
    const auto c_md = Md({s.channels}, Tag::x);
    // gamma and beta are separate scale and shift memories (use_scale |
    // use_shift, not the packed [2, C] weights of use_scale_shift).
    const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    // Inference: use_global_stats makes mean and variance inputs.
    const dnnl::batch_normalization_forward::primitive_desc infer_pd(
        {dnnl::prop_kind::forward_inference, x_md, s.epsilon,
         flags | dnnl::normalization_flags::use_global_stats},
        eng);
    infer_ = dnnl::batch_normalization_forward(infer_pd);
    x_ = Unbound(x_md, eng), y_ = Unbound(x_md, eng);
    gamma_ = Unbound(c_md, eng), beta_ = Unbound(c_md, eng);
    given_mean_ = Unbound(infer_pd.mean_desc(), eng);
    given_variance_ = Unbound(infer_pd.variance_desc(), eng);
    infer_args_ = {{DNNL_ARG_SRC, x_},           {DNNL_ARG_DST, y_},
                   {DNNL_ARG_SCALE, gamma_},     {DNNL_ARG_SHIFT, beta_},
                   {DNNL_ARG_MEAN, given_mean_}, {DNNL_ARG_VARIANCE, given_variance_}};
    if (forward_only_) return;

    // Batch statistics (no use_global_stats): forward_training computes the
    // mean and the biased variance and writes them out.
    const dnnl::batch_normalization_forward::primitive_desc fwd_pd(
        {dnnl::prop_kind::forward_training, x_md, s.epsilon, flags}, eng);
    // prop_kind::backward (not backward_data): also the scale and shift diffs.
    const dnnl::batch_normalization_backward::primitive_desc bwd_pd(
        {dnnl::prop_kind::backward, x_md, x_md, s.epsilon, flags}, eng, fwd_pd);
    fwd_ = dnnl::batch_normalization_forward(fwd_pd);
    bwd_ = dnnl::batch_normalization_backward(bwd_pd);

    // The statistics of the latest Forward, read by Backward; owned by the op.
    mean_ = memory(fwd_pd.mean_desc(), eng);
    variance_ = memory(fwd_pd.variance_desc(), eng);
    // oneDNN 2.6 lists DNNL_ARG_SHIFT among the inputs of a use_shift backward
    // primitive and fails execution ("could not execute a primitive") without
    // it, although the gradients do not depend on beta and Backward is not
    // given it. It gets C zeros of its own.
    unused_shift_ = memory(c_md, eng);
    std::memset(unused_shift_.get_data_handle(), 0, c_md.get_size());
    dx_ = Unbound(x_md, eng), dy_ = Unbound(x_md, eng);
    dgamma_ = Unbound(c_md, eng), dbeta_ = Unbound(c_md, eng);
    fwd_args_ = {{DNNL_ARG_SRC, x_},      {DNNL_ARG_DST, y_},     {DNNL_ARG_SCALE, gamma_},
                 {DNNL_ARG_SHIFT, beta_}, {DNNL_ARG_MEAN, mean_}, {DNNL_ARG_VARIANCE, variance_}};
    bwd_args_ = {{DNNL_ARG_SRC, x_},           {DNNL_ARG_DIFF_DST, dy_},
                 {DNNL_ARG_MEAN, mean_},       {DNNL_ARG_VARIANCE, variance_},
                 {DNNL_ARG_SCALE, gamma_},     {DNNL_ARG_SHIFT, unused_shift_},
                 {DNNL_ARG_DIFF_SRC, dx_},     {DNNL_ARG_DIFF_SCALE, dgamma_},
                 {DNNL_ARG_DIFF_SHIFT, dbeta_}};
    // None without fuse_norm_relu; kept general in case an implementation wants one.
    if (fwd_pd.workspace_desc().get_size() != 0) {
      workspace_ = memory(fwd_pd.workspace_desc(), eng);
      fwd_args_.insert({DNNL_ARG_WORKSPACE, workspace_});
      bwd_args_.insert({DNNL_ARG_WORKSPACE, workspace_});
    }
  }

  absl::Status Forward(const float* x, const float* gamma, const float* beta, float* y,
                       float* batch_mean, float* batch_var) override {
    if (forward_only_) return NotBuiltFor("BatchNorm forward");
    PSFLOW_RETURN_IF_ERROR(
        CheckNonNull("BatchNorm forward", {{"x", x}, {"gamma", gamma}, {"beta", beta}, {"y", y}}));
    absl::Status status = ctx_->Run("BatchNorm forward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(gamma_, gamma), Bind(beta_, beta), Bind(y_, y);
      fwd_.execute(stream, fwd_args_);
    });
    has_stats_ = status.ok();
    if (!status.ok()) return status;
    // oneDNN's variance is the biased one; the running statistics want the
    // unbiased one.
    const float* mean = static_cast<const float*>(mean_.get_data_handle());
    const float* variance = static_cast<const float*>(variance_.get_data_handle());
    const double unbias = count_ > 1 ? count_ / (count_ - 1) : 1.0;
    for (int c = 0; c < channels_; ++c) {
      if (batch_mean != nullptr) batch_mean[c] = mean[c];
      if (batch_var != nullptr) batch_var[c] = static_cast<float>(variance[c] * unbias);
    }
    return absl::OkStatus();
  }

  absl::Status Infer(const float* x, const float* gamma, const float* beta, const float* mean,
                     const float* var, float* y) override {
    PSFLOW_RETURN_IF_ERROR(CheckNonNull(
        "BatchNorm inference",
        {{"x", x}, {"gamma", gamma}, {"beta", beta}, {"mean", mean}, {"var", var}, {"y", y}}));
    return ctx_->Run("BatchNorm inference", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(gamma_, gamma), Bind(beta_, beta), Bind(y_, y);
      Bind(given_mean_, mean), Bind(given_variance_, var);
      infer_.execute(stream, infer_args_);
    });
  }

  absl::Status Backward(const float* x, const float* gamma, const float* dy, float* dx,
                        float* dgamma, float* dbeta) override {
    if (forward_only_) return NotBuiltFor("BatchNorm backward");
    PSFLOW_RETURN_IF_ERROR(CheckNonNull("BatchNorm backward", {{"x", x},
                                                               {"gamma", gamma},
                                                               {"dy", dy},
                                                               {"dx", dx},
                                                               {"dgamma", dgamma},
                                                               {"dbeta", dbeta}}));
    if (!has_stats_) {
      return absl::FailedPreconditionError("BatchNorm backward: no successful Forward before it");
    }
    return ctx_->Run("BatchNorm backward", [&](dnnl::stream& stream) {
      Bind(x_, x), Bind(gamma_, gamma), Bind(dy_, dy), Bind(dx_, dx);
      Bind(dgamma_, dgamma), Bind(dbeta_, dbeta);
      bwd_.execute(stream, bwd_args_);
    });
  }

 private:
  std::shared_ptr<DnnlContext> ctx_;
  const int channels_;
  const double count_;       // M = N*H*W
  const bool forward_only_;  // only infer_ (and its memories) exist
  dnnl::batch_normalization_forward fwd_, infer_;
  dnnl::batch_normalization_backward bwd_;
  memory mean_, variance_, unused_shift_, workspace_;
  memory x_, y_, dx_, dy_, gamma_, beta_, dgamma_, dbeta_, given_mean_, given_variance_;
  Args fwd_args_, bwd_args_, infer_args_;
  bool has_stats_ = false;
};

// ---------------------------------------------------------------- elementwise helpers

// n < 0 is INVALID_ARGUMENT; n == 0 is a no-op (null pointers allowed); else
// every pointer must be non-null.
absl::Status CheckHelper(absl::string_view op, int64_t n,
                         std::initializer_list<std::pair<absl::string_view, const void*>> args) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat(op, ": n = ", n, " is negative"));
  if (n == 0) return absl::OkStatus();
  return CheckNonNull(op, args);
}

}  // namespace

// ---------------------------------------------------------------- CpuBackend

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(int threads) {
  if (threads <= 0) threads = UsableCores();
  omp_set_num_threads(threads);
  try {
    auto ctx = std::make_shared<DnnlContext>(dnnl::engine(dnnl::engine::kind::cpu, 0));
    return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(ctx), threads));
  } catch (const dnnl::error& e) {
    return absl::InternalError(absl::StrCat("cannot create the oneDNN CPU engine: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("cannot create the CPU backend: ", e.what()));
  }
}

CpuBackend::CpuBackend(std::shared_ptr<DnnlContext> ctx, int threads)
    : ctx_(std::move(ctx)), threads_(threads) {}

std::string CpuBackend::Description() const {
  return absl::StrCat("cpu (", threads_, threads_ == 1 ? " kernel thread)" : " kernel threads)");
}
CpuBackend::~CpuBackend() = default;

absl::StatusOr<std::unique_ptr<Buffer>> CpuBackend::Allocate(size_t floats) {
  if (floats > (std::numeric_limits<size_t>::max() - kAlignment) / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: ", floats, " floats is too many"));
  }
  // aligned_alloc wants a multiple of the alignment; never ask for 0 bytes.
  const size_t bytes =
      std::max<size_t>(1, (floats * sizeof(float) + kAlignment - 1) / kAlignment) * kAlignment;
  void* data = std::aligned_alloc(kAlignment, bytes);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Allocate: out of memory for ", bytes, " bytes"));
  }
  // Zero-filled so that a read before the first write is deterministic.
  std::memset(data, 0, bytes);
  return std::make_unique<HostBuffer>(static_cast<float*>(data), floats);
}

absl::StatusOr<int64_t> CpuBackend::AvailableMemory() { return AvailableHostMemory(); }

absl::Status CpuBackend::CopyToDevice(const float* host, size_t floats, float* device) {
  if (floats == 0) return absl::OkStatus();
  PSFLOW_RETURN_IF_ERROR(CheckNonNull("CopyToDevice", {{"host", host}, {"device", device}}));
  std::memcpy(device, host, floats * sizeof(float));
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(const float* device, size_t floats, float* host) {
  if (floats == 0) return absl::OkStatus();
  PSFLOW_RETURN_IF_ERROR(CheckNonNull("CopyToHost", {{"device", device}, {"host", host}}));
  std::memcpy(host, device, floats * sizeof(float));
  return absl::OkStatus();
}

// The helpers run their loops under the context's mutex, like the ops. Each
// element is read before it is written at the same index, so an output may be
// the same array as an input.
absl::Status CpuBackend::Add(const float* a, const float* b, float* y, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckHelper("Add", n, {{"a", a}, {"b", b}, {"y", y}}));
  if (n == 0) return absl::OkStatus();
  return ctx_->RunLoops([&] {
#pragma omp parallel for simd if (parallel : n >= kMinParallel)
    for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
  });
}

absl::Status CpuBackend::Affine(const float* x, float scale, float shift, float* y, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckHelper("Affine", n, {{"x", x}, {"y", y}}));
  if (n == 0) return absl::OkStatus();
  return ctx_->RunLoops([&] {
#pragma omp parallel for simd if (parallel : n >= kMinParallel)
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale + shift;
  });
}

absl::Status CpuBackend::ChannelAffine(const float* x, const float* scale, const float* shift,
                                       float* y, int64_t n, int64_t channels, int64_t plane) {
  const int64_t total = n * channels * plane;
  PSFLOW_RETURN_IF_ERROR(CheckHelper("ChannelAffine", total, {{"x", x}, {"y", y}}));
  if (total == 0) return absl::OkStatus();
  if (scale == nullptr || shift == nullptr) {
    return absl::InvalidArgumentError("ChannelAffine: null scale or shift");
  }
  const int64_t planes = n * channels;
  return ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel : total >= kMinParallel)
    for (int64_t p = 0; p < planes; ++p) {
      const float a = scale[p % channels], b = shift[p % channels];
      const float* in = x + p * plane;
      float* out = y + p * plane;
#pragma omp simd
      for (int64_t i = 0; i < plane; ++i) out[i] = in[i] * a + b;
    }
  });
}

absl::Status CpuBackend::Sgd(float* w, const float* g, float learning_rate, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckHelper("Sgd", n, {{"w", w}, {"g", g}}));
  if (n == 0) return absl::OkStatus();
  return ctx_->RunLoops([&] {
#pragma omp parallel for simd if (parallel : n >= kMinParallel)
    for (int64_t i = 0; i < n; ++i) w[i] -= learning_rate * g[i];
  });
}

absl::Status CpuBackend::ApplyOptimizer(const OptimizerStep& step,
                                        const std::vector<OptimizerTensor>& tensors) {
  PSFLOW_RETURN_IF_ERROR(CheckOptimizerTensors(step, tensors));
  for (const OptimizerTensor& t : tensors) {
    const int64_t n = t.n;
    if (n == 0) continue;
    const absl::Status applied = ctx_->RunLoops([&] {
#pragma omp parallel for if (parallel : n >= kMinParallel)
      for (int64_t i = 0; i < n; ++i) {
        float unused0 = 0, unused1 = 0;
        ApplyElement(step, t.w[i], t.g[i], step.slots() >= 1 ? t.s0[i] : unused0,
                     step.slots() >= 2 ? t.s1[i] : unused1);
      }
    });
    PSFLOW_RETURN_IF_ERROR(applied);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::GlobalNorm(const std::vector<absl::Span<const float>>& xs, float* scratch,
                                    float* norm) {
  PSFLOW_RETURN_IF_ERROR(CheckGlobalNorm(xs, scratch, norm));
  // In order, on one thread: the same sum every time.
  double sum = 0;
  for (absl::Span<const float> x : xs) {
    for (float v : x) sum += static_cast<double>(v) * static_cast<double>(v);
  }
  *norm = static_cast<float>(std::sqrt(sum));
  return absl::OkStatus();
}

absl::Status CpuBackend::CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                                        float* count) {
  PSFLOW_RETURN_IF_ERROR(CheckNonFiniteCount(xs, count));
  int64_t total = 0;  // added once all are counted
  for (absl::Span<const float> x : xs) {
    const int64_t n = static_cast<int64_t>(x.size());
    if (n == 0) continue;
    int64_t bad = 0;
    const absl::Status counted = ctx_->RunLoops([&] {
#pragma omp parallel for reduction(+ : bad) if (parallel : n >= kMinParallel)
      for (int64_t i = 0; i < n; ++i) bad += std::isfinite(x[i]) ? 0 : 1;
    });
    PSFLOW_RETURN_IF_ERROR(counted);
    total += bad;
  }
  *count += static_cast<float>(total);
  return absl::OkStatus();
}

absl::Status CpuBackend::Copy(const float* src, float* dst, int64_t n) {
  PSFLOW_RETURN_IF_ERROR(CheckHelper("Copy", n, {{"src", src}, {"dst", dst}}));
  if (n == 0) return absl::OkStatus();
  if (src == dst) return absl::OkStatus();
  return ctx_->RunLoops([&] {
    // Overlapping ranges (not just the same array) need memmove's ordering.
    const auto from = reinterpret_cast<uintptr_t>(src), to = reinterpret_cast<uintptr_t>(dst);
    const uintptr_t bytes = static_cast<uintptr_t>(n) * sizeof(float);
    if (from < to + bytes && to < from + bytes) {
      std::memmove(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    }
#pragma omp parallel for simd if (parallel : n >= kMinParallel)
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  });
}

absl::StatusOr<std::unique_ptr<Conv2D>> CpuBackend::CreateConv2D(const Conv2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<Conv2D>(what, [&] { return std::make_unique<DnnlConv2D>(ctx_, shape); });
}

absl::StatusOr<std::unique_ptr<MaxPool2D>> CpuBackend::CreateMaxPool2D(const Pool2DShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<MaxPool2D>(what, [&] { return std::make_unique<LoopMaxPool2D>(ctx_, shape); });
}

absl::StatusOr<std::unique_ptr<Relu>> CpuBackend::CreateRelu(int64_t size) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckRelu(size));
  return Build<Relu>(what, [&] { return std::make_unique<DnnlRelu>(ctx_, size); });
}

absl::StatusOr<std::unique_ptr<Dense>> CpuBackend::CreateDense(const DenseShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<Dense>(what, [&] { return std::make_unique<DnnlDense>(ctx_, shape); });
}

absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CpuBackend::CreateSoftmaxCrossEntropy(
    int batch, int classes) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckSoftmaxCrossEntropy(batch, classes));
  return Build<SoftmaxCrossEntropy>(
      what, [&] { return std::make_unique<DnnlSoftmaxCrossEntropy>(ctx_, batch, classes); });
}

absl::StatusOr<std::unique_ptr<BatchNorm>> CpuBackend::CreateBatchNorm(
    const BatchNormShape& shape) {
  PSFLOW_ASSIGN_OR_RETURN(const std::string what, CheckShape(shape));
  return Build<BatchNorm>(what, [&] { return std::make_unique<DnnlBatchNorm>(ctx_, shape); });
}

}  // namespace psflow::kernels
