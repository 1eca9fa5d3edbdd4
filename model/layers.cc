// The layer kinds, one class each, and the table that registers them.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/layer.h"

namespace psflow::model {
namespace {

// Sizes a spec names stay within kMaxSpecDim; negative ones are left to each
// kind's own check, which names the parameter.
absl::Status CheckSizes(std::initializer_list<int64_t> sizes) {
  if (std::max(sizes) > kMaxSpecDim) {
    return absl::InvalidArgumentError(absl::StrCat("sizes must be at most ", kMaxSpecDim));
  }
  return absl::OkStatus();
}

template <typename Op>
using ForwardFn = absl::Status (*)(Op&, const ForwardArgs&);
template <typename Op>
using BackwardFn = absl::Status (*)(Op&, const BackwardArgs&);

// A kernel op with the layer's forward and backward calls on it.
template <typename Op>
class BoundOps final : public LayerOps {
 public:
  BoundOps(std::unique_ptr<Op> op, ForwardFn<Op> forward, BackwardFn<Op> backward)
      : op_(std::move(op)), forward_(forward), backward_(backward) {}
  absl::Status Forward(const ForwardArgs& args) override { return forward_(*op_, args); }
  absl::Status Backward(const BackwardArgs& args) override { return backward_(*op_, args); }

 private:
  std::unique_ptr<Op> op_;
  ForwardFn<Op> forward_;
  BackwardFn<Op> backward_;
};

template <typename Op>
absl::StatusOr<std::unique_ptr<LayerOps>> Bind(absl::StatusOr<std::unique_ptr<Op>> op,
                                               std::type_identity_t<ForwardFn<Op>> forward,
                                               std::type_identity_t<BackwardFn<Op>> backward) {
  if (!op.ok()) return op.status();
  return std::make_unique<BoundOps<Op>>(*std::move(op), forward, backward);
}

class Conv2DKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    const Conv2DLayer& c = spec.conv2d();
    if (absl::Status s = CheckSizes({c.filters(), c.kernel(), c.stride(), c.padding()}); !s.ok())
      return s;
    const int stride = c.stride() == 0 ? 1 : c.stride();
    if (c.filters() <= 0 || c.kernel() <= 0 || stride <= 0 || c.padding() < 0) {
      return absl::InvalidArgumentError("conv2d needs positive filters, kernel and stride");
    }
    return std::unique_ptr<const Layer>(new Conv2DKind(spec.name(), c, stride));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape& in,
                                              absl::Span<const ActivationShape>) const override {
    if (in.height + 2 * padding_ < kernel_ || in.width + 2 * padding_ < kernel_) {
      return absl::InvalidArgumentError(absl::StrCat("kernel ", kernel_, " larger than its ",
                                                     in.height, "x", in.width, " input"));
    }
    const kernels::Conv2DShape shape = Shape(1, in);
    return ActivationShape{filters_, shape.out_height(), shape.out_width()};
  }

  std::vector<LayerVariable> Variables(const ActivationShape& in) const override {
    const int64_t k = kernel_, fan_in = in.channels * k * k;
    std::vector<LayerVariable> vars{
        {"weights", {filters_, in.channels, k, k}, LayerVariable::Init::kFanIn, fan_in}};
    if (bias_) vars.push_back({"bias", {filters_}, LayerVariable::Init::kFanIn, fan_in});
    return vars;
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateConv2D(Shape(batch, in, forward_only)),
        [](kernels::Conv2D& op, const ForwardArgs& a) { return op.Forward(a.x, a.w, a.b, a.y); },
        [](kernels::Conv2D& op, const BackwardArgs& a) {
          return op.Backward(a.x, a.w, a.dy, a.dx, a.dw, a.db);
        });
  }

 private:
  Conv2DKind(const std::string& name, const Conv2DLayer& c, int stride)
      : Layer(name),
        filters_(c.filters()),
        kernel_(c.kernel()),
        stride_(stride),
        padding_(c.padding()),
        bias_(!c.no_bias()) {}

  kernels::Conv2DShape Shape(int batch, const ActivationShape& in,
                             bool forward_only = false) const {
    return {batch,   in.channels, in.height, in.width, filters_,
            kernel_, kernel_,     stride_,   padding_, forward_only};
  }

  int filters_, kernel_, stride_, padding_;
  bool bias_;
};

class MaxPoolKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    const MaxPoolLayer& p = spec.max_pool();
    if (absl::Status s = CheckSizes({p.size(), p.stride()}); !s.ok()) return s;
    const int stride = p.stride() == 0 ? p.size() : p.stride();
    if (p.size() <= 0 || stride <= 0)
      return absl::InvalidArgumentError("max_pool needs a positive size");
    return std::unique_ptr<const Layer>(new MaxPoolKind(spec.name(), p.size(), stride));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape& in,
                                              absl::Span<const ActivationShape>) const override {
    if (in.height < size_ || in.width < size_) {
      return absl::InvalidArgumentError("pool window larger than its input");
    }
    const kernels::Pool2DShape shape = Shape(1, in);
    return ActivationShape{in.channels, shape.out_height(), shape.out_width()};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateMaxPool2D(Shape(batch, in, forward_only)),
        [](kernels::MaxPool2D& op, const ForwardArgs& a) { return op.Forward(a.x, a.y); },
        [](kernels::MaxPool2D& op, const BackwardArgs& a) {
          return a.dx == nullptr ? absl::OkStatus() : op.Backward(a.dy, a.dx);
        });
  }

 private:
  MaxPoolKind(const std::string& name, int size, int stride)
      : Layer(name), size_(size), stride_(stride) {}

  kernels::Pool2DShape Shape(int batch, const ActivationShape& in,
                             bool forward_only = false) const {
    return {batch, in.channels, in.height, in.width, size_, stride_, forward_only};
  }

  int size_, stride_;
};

class ReluKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    return std::unique_ptr<const Layer>(new ReluKind(spec.name()));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape& in,
                                              absl::Span<const ActivationShape>) const override {
    return in;
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateRelu(batch * in.size()),
        [](kernels::Relu& op, const ForwardArgs& a) { return op.Forward(a.x, a.y); },
        [](kernels::Relu& op, const BackwardArgs& a) {
          return a.dx == nullptr ? absl::OkStatus() : op.Backward(a.x, a.dy, a.dx);
        });
  }

 private:
  using Layer::Layer;
};

class DenseKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    if (absl::Status s = CheckSizes({spec.dense().units()}); !s.ok()) return s;
    if (spec.dense().units() <= 0) return absl::InvalidArgumentError("dense needs positive units");
    return std::unique_ptr<const Layer>(new DenseKind(spec.name(), spec.dense().units()));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape&,
                                              absl::Span<const ActivationShape>) const override {
    return ActivationShape{units_, 1, 1};
  }

  std::vector<LayerVariable> Variables(const ActivationShape& in) const override {
    return {{"weights", {units_, in.size()}, LayerVariable::Init::kFanIn, in.size()},
            {"bias", {units_}, LayerVariable::Init::kFanIn, in.size()}};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateDense({batch, static_cast<int>(in.size()), units_, forward_only}),
        [](kernels::Dense& op, const ForwardArgs& a) { return op.Forward(a.x, a.w, a.b, a.y); },
        [](kernels::Dense& op, const BackwardArgs& a) {
          return op.Backward(a.x, a.w, a.dy, a.dx, a.dw, a.db);
        });
  }

 private:
  DenseKind(const std::string& name, int units) : Layer(name), units_(units) {}

  int units_;
};

class BatchNormKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    const float epsilon = spec.batch_norm().epsilon();
    if (!(epsilon >= 0) || !std::isfinite(epsilon)) {
      return absl::InvalidArgumentError("batch_norm epsilon must be finite and not negative");
    }
    // 0 (unset) takes the kernels' default.
    return std::unique_ptr<const Layer>(
        new BatchNormKind(spec.name(), epsilon > 0 ? epsilon : kernels::BatchNormShape{}.epsilon));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape& in,
                                              absl::Span<const ActivationShape>) const override {
    return in;
  }

  std::vector<LayerVariable> Variables(const ActivationShape& in) const override {
    using Init = LayerVariable::Init;
    return {{"gamma", {in.channels}, Init::kOnes, 1},
            {"beta", {in.channels}, Init::kZeros, 1},
            {"running_mean", {in.channels}, Init::kZeros, 1, /*trainable=*/false},
            {"running_var", {in.channels}, Init::kOnes, 1, /*trainable=*/false}};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateBatchNorm({batch, in.channels, in.height, in.width, epsilon_, forward_only}),
        [](kernels::BatchNorm& op, const ForwardArgs& a) {
          if (a.training) return op.Forward(a.x, a.w, a.b, a.y, a.batch_mean, a.batch_var);
          return op.Infer(a.x, a.w, a.b, a.running_mean, a.running_var, a.y);
        },
        [](kernels::BatchNorm& op, const BackwardArgs& a) {
          // Batch norm always writes an input gradient: scratch takes an unneeded one.
          return op.Backward(a.x, a.w, a.dy, a.dx != nullptr ? a.dx : a.scratch, a.dw, a.db);
        });
  }

 private:
  BatchNormKind(const std::string& name, float epsilon) : Layer(name), epsilon_(epsilon) {}

  float epsilon_;
};

class AddKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    return std::unique_ptr<const Layer>(new AddKind(spec.name(), spec.add().other()));
  }

  std::vector<std::string> other_inputs() const override { return {other_}; }
  const char* other_field() const override { return "add.other"; }
  bool passes_gradient() const override { return true; }

  absl::StatusOr<ActivationShape> OutputShape(
      const ActivationShape& in, absl::Span<const ActivationShape> others) const override {
    const ActivationShape* other = &others[0];
    if (other->channels != in.channels || other->height != in.height || other->width != in.width) {
      return absl::InvalidArgumentError(
          absl::StrCat("adds ", other->channels, "x", other->height, "x", other->width, " from '",
                       other_, "' to its ", in.channels, "x", in.height, "x", in.width, " input"));
    }
    return in;
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind<Sum>(
        std::make_unique<Sum>(Sum{backend, batch * in.size()}),
        [](Sum& sum, const ForwardArgs& a) {
          return sum.backend->Add(a.x, a.others[0], a.y, sum.floats);
        },
        // Nothing to compute: the network routes dy to both operands.
        [](Sum&, const BackwardArgs&) { return absl::OkStatus(); });
  }

 private:
  struct Sum {
    kernels::Backend* backend;
    int64_t floats;
  };

  AddKind(const std::string& name, std::string other) : Layer(name), other_(std::move(other)) {}

  std::string other_;
};

class GlobalAvgPoolKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    return std::unique_ptr<const Layer>(new GlobalAvgPoolKind(spec.name()));
  }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape& in,
                                              absl::Span<const ActivationShape>) const override {
    return ActivationShape{in.channels, 1, 1};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateGlobalAvgPool({batch, in.channels, in.height, in.width}),
        [](kernels::GlobalAvgPool& op, const ForwardArgs& a) { return op.Forward(a.x, a.y); },
        [](kernels::GlobalAvgPool& op, const BackwardArgs& a) {
          return a.dx == nullptr ? absl::OkStatus() : op.Backward(a.dy, a.dx);
        });
  }

 private:
  using Layer::Layer;
};

// Layers that join the outputs of several layers: their operand list and
// its check.
absl::Status CheckOthers(const google::protobuf::RepeatedPtrField<std::string>& others,
                         const char* kind) {
  if (others.empty()) return absl::InvalidArgumentError(absl::StrCat(kind, " needs others"));
  if (others.size() + 1 > kernels::kMaxJoinOperands) {
    return absl::InvalidArgumentError(
        absl::StrCat(kind, " joins at most ", kernels::kMaxJoinOperands, " operands"));
  }
  return absl::OkStatus();
}

// Runs a join op's forward and backward calls with the layer's operands:
// the input first, then the others.
absl::InlinedVector<const float*, 4> Inputs(const float* x,
                                            const absl::InlinedVector<const float*, 4>& others) {
  absl::InlinedVector<const float*, 4> xs{x};
  xs.insert(xs.end(), others.begin(), others.end());
  return xs;
}

absl::InlinedVector<float*, 4> Gradients(const BackwardArgs& a) {
  absl::InlinedVector<float*, 4> dxs{a.dx};
  dxs.insert(dxs.end(), a.dothers.begin(), a.dothers.end());
  return dxs;
}

class ConcatKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    PSFLOW_RETURN_IF_ERROR(CheckOthers(spec.concat().others(), "concat"));
    return std::unique_ptr<const Layer>(new ConcatKind(
        spec.name(), {spec.concat().others().begin(), spec.concat().others().end()}));
  }

  std::vector<std::string> other_inputs() const override { return others_; }
  const char* other_field() const override { return "concat.others"; }
  bool adds_to_gradients() const override { return true; }

  absl::StatusOr<ActivationShape> OutputShape(
      const ActivationShape& in, absl::Span<const ActivationShape> others) const override {
    int64_t size = in.size();
    for (const ActivationShape& o : others) size += o.size();
    if (size > (int64_t{1} << 30)) {
      return absl::InvalidArgumentError(absl::StrCat("joins ", size, " values per example"));
    }
    return ActivationShape{static_cast<int>(size), 1, 1};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape> others,
                                                      bool forward_only) const override {
    kernels::ConcatShape shape{batch, {in.size()}};
    for (const ActivationShape& o : others) shape.widths.push_back(o.size());
    return Bind(
        backend->CreateConcat(shape),
        [](kernels::Concat& op, const ForwardArgs& a) {
          return op.Forward(Inputs(a.x, a.others), a.y);
        },
        [](kernels::Concat& op, const BackwardArgs& a) {
          return op.Backward(a.dy, Gradients(a), a.add);
        });
  }

 private:
  ConcatKind(const std::string& name, std::vector<std::string> others)
      : Layer(name), others_(std::move(others)) {}

  std::vector<std::string> others_;
};

class InteractionKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    const InteractionLayer& l = spec.interaction();
    PSFLOW_RETURN_IF_ERROR(CheckOthers(l.others(), "interaction"));
    return std::unique_ptr<const Layer>(new InteractionKind(
        spec.name(), {l.others().begin(), l.others().end()}, l.self_interaction()));
  }

  std::vector<std::string> other_inputs() const override { return others_; }
  const char* other_field() const override { return "interaction.others"; }
  bool adds_to_gradients() const override { return true; }

  absl::StatusOr<ActivationShape> OutputShape(
      const ActivationShape& in, absl::Span<const ActivationShape> others) const override {
    for (size_t i = 0; i < others.size(); ++i) {
      if (others[i].size() != in.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", others_[i], "' gives ", others[i].size(),
                         " values per example, its input ", in.size(), ": all must be equal"));
      }
    }
    const kernels::InteractionShape shape = Shape(1, in);
    return ActivationShape{static_cast<int>(shape.out_width()), 1, 1};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape& in,
                                                      absl::Span<const ActivationShape>,
                                                      bool forward_only) const override {
    return Bind(
        backend->CreateInteraction(Shape(batch, in)),
        [](kernels::Interaction& op, const ForwardArgs& a) {
          return op.Forward(Inputs(a.x, a.others), a.y);
        },
        [](kernels::Interaction& op, const BackwardArgs& a) {
          return op.Backward(Inputs(a.x, a.others), a.dy, Gradients(a), a.add);
        });
  }

 private:
  InteractionKind(const std::string& name, std::vector<std::string> others, bool self)
      : Layer(name), others_(std::move(others)), self_(self) {}

  kernels::InteractionShape Shape(int batch, const ActivationShape& in) const {
    return {batch, static_cast<int>(others_.size()) + 1, static_cast<int>(in.size()), self_};
  }

  std::vector<std::string> others_;
  bool self_;
};

// Rows of an embedding table: int32 indexes them (kernels/embedding_plan.h),
// and the model's parameter cap bounds rows * dim.
constexpr int64_t kMaxEmbeddingRows = int64_t{1} << 30;

class EmbeddingKind final : public Layer {
 public:
  static absl::StatusOr<std::unique_ptr<const Layer>> Create(const LayerSpec& spec) {
    const EmbeddingLayer& e = spec.embedding();
    if (e.feature().empty()) return absl::InvalidArgumentError("embedding needs a feature");
    if (e.rows() <= 0 || e.rows() > kMaxEmbeddingRows) {
      return absl::InvalidArgumentError(
          absl::StrCat("embedding rows must be in [1, ", kMaxEmbeddingRows, "], got ", e.rows()));
    }
    if (e.dim() <= 0 || e.dim() > kMaxSpecDim) {
      return absl::InvalidArgumentError(
          absl::StrCat("embedding dim must be in [1, ", kMaxSpecDim, "], got ", e.dim()));
    }
    return std::unique_ptr<const Layer>(new EmbeddingKind(spec.name(), e.rows(), e.dim()));
  }

  bool reads_input() const override { return false; }

  absl::StatusOr<ActivationShape> OutputShape(const ActivationShape&,
                                              absl::Span<const ActivationShape>) const override {
    return ActivationShape{dim_, 1, 1};
  }

  std::vector<LayerVariable> Variables(const ActivationShape&) const override {
    return {{"table", {rows_, dim_}, LayerVariable::Init::kFanIn, dim_}};
  }

  absl::StatusOr<std::unique_ptr<LayerOps>> CreateOps(kernels::Backend* backend, int batch,
                                                      const ActivationShape&,
                                                      absl::Span<const ActivationShape>,
                                                      bool) const override {
    // The plan's unique rows are the whole table, so rows are the table's
    // weights and row gradients its dense gradient (every row written).
    return Bind(
        backend->CreateEmbeddingBag(dim_),
        [](kernels::EmbeddingBag& op, const ForwardArgs& a) -> absl::Status {
          if (a.plan == nullptr) return absl::FailedPreconditionError("embedding without ids");
          PSFLOW_RETURN_IF_ERROR(op.SetPlan(*a.plan));
          return op.Forward(a.w, a.y);
        },
        [](kernels::EmbeddingBag& op, const BackwardArgs& a) { return op.Backward(a.dy, a.dw); });
  }

 private:
  EmbeddingKind(const std::string& name, int64_t rows, int dim)
      : Layer(name), rows_(rows), dim_(dim) {}

  int64_t rows_;
  int dim_;
};

// The registry: every layer kind, in the order messages list them.
struct KindEntry {
  LayerSpec::KindCase kind;
  const char* field;
  absl::StatusOr<std::unique_ptr<const Layer>> (*create)(const LayerSpec&);
};
constexpr KindEntry kKinds[] = {
    {LayerSpec::kConv2D, "conv2d", &Conv2DKind::Create},
    {LayerSpec::kMaxPool, "max_pool", &MaxPoolKind::Create},
    {LayerSpec::kRelu, "relu", &ReluKind::Create},
    {LayerSpec::kDense, "dense", &DenseKind::Create},
    {LayerSpec::kBatchNorm, "batch_norm", &BatchNormKind::Create},
    {LayerSpec::kAdd, "add", &AddKind::Create},
    {LayerSpec::kGlobalAvgPool, "global_avg_pool", &GlobalAvgPoolKind::Create},
    {LayerSpec::kConcat, "concat", &ConcatKind::Create},
    {LayerSpec::kInteraction, "interaction", &InteractionKind::Create},
    {LayerSpec::kEmbedding, "embedding", &EmbeddingKind::Create},
};

// "conv2d, max_pool, ... or global_avg_pool".
std::string KindList() {
  std::string list;
  constexpr size_t n = std::size(kKinds);
  for (size_t i = 0; i < n; ++i)
    absl::StrAppend(&list, i == 0 ? "" : i + 1 == n ? " or " : ", ", kKinds[i].field);
  return list;
}

}  // namespace

absl::Status LayerError(const LayerSpec& layer, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("layer '", layer.name(), "': ", what));
}

absl::StatusOr<std::unique_ptr<const Layer>> CreateLayer(const LayerSpec& spec) {
  for (const KindEntry& kind : kKinds) {
    if (kind.kind != spec.kind_case()) continue;
    absl::StatusOr<std::unique_ptr<const Layer>> layer = kind.create(spec);
    if (!layer.ok()) return LayerError(spec, layer.status().message());
    return layer;
  }
  return LayerError(spec, absl::StrCat("no layer kind given (", KindList(), ")"));
}

}  // namespace psflow::model
