#include "model/network.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/tensor_chunks.h"

namespace psflow::model {

struct Network::Layer {
  LayerSpec::KindCase kind;
  ActivationShape in, out;
  int weights = -1, bias = -1;  // variable indices for conv and dense
};

// Ops and activations for one batch size. acts[i] is the input of layer i
// (acts[0] the images, acts.back() the logits); dacts[i] its gradient.
struct Network::BatchState {
  int batch = 0;
  std::vector<std::unique_ptr<kernels::Conv2D>> conv;
  std::vector<std::unique_ptr<kernels::MaxPool2D>> pool;
  std::vector<std::unique_ptr<kernels::Relu>> relu;
  std::vector<std::unique_ptr<kernels::Dense>> dense;
  std::unique_ptr<kernels::SoftmaxCrossEntropy> loss;
  std::vector<std::unique_ptr<kernels::Buffer>> acts, dacts;
  std::unique_ptr<kernels::Buffer> probs;
  std::vector<int32_t> labels;
  std::vector<float> standardized;  // host staging of the batch's inputs
};

Network::Network(ModelSpec spec, kernels::Backend* backend)
    : spec_(std::move(spec)), backend_(backend) {}

Network::~Network() = default;

absl::StatusOr<std::unique_ptr<Network>> Network::Create(const ModelSpec& spec,
                                                         kernels::Backend* backend) {
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
  if (!shapes.ok()) return shapes.status();
  std::unique_ptr<Network> net(new Network(spec, backend));
  net->variables_ = ModelVariables(spec);
  ActivationShape in{spec.input().channels(), spec.input().height(), spec.input().width()};
  int var = 0;
  for (int i = 0; i < spec.layer_size(); ++i) {
    Layer layer;
    layer.kind = spec.layer(i).kind_case();
    layer.in = in;
    layer.out = (*shapes)[i];
    if (layer.kind == LayerSpec::kConv2D || layer.kind == LayerSpec::kDense) {
      layer.weights = var++;
      layer.bias = var++;
    }
    net->layers_.push_back(layer);
    in = layer.out;
  }
  for (const VariableShape& v : net->variables_) {
    for (auto* list : {&net->weights_, &net->grads_}) {
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf = backend->Allocate(NumElements(v.shape));
      if (!buf.ok()) return buf.status();
      list->push_back(*std::move(buf));
    }
  }
  return net;
}

int64_t Network::input_floats() const {
  return int64_t{spec_.input().channels()} * spec_.input().height() * spec_.input().width();
}

std::vector<float*> Network::HostWeights() {
  std::vector<float*> out;
  if (backend_->host_memory()) {
    for (auto& w : weights_) out.push_back(w->data());
  }
  return out;
}

std::vector<float*> Network::HostGradients() {
  std::vector<float*> out;
  if (backend_->host_memory()) {
    for (auto& g : grads_) out.push_back(g->data());
  }
  return out;
}

absl::Status Network::SetWeights(const std::vector<const float*>& host) {
  if (host.size() != weights_.size()) return absl::InvalidArgumentError("wrong number of weight tensors");
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(host[i], weights_[i]->size(), weights_[i]->data()));
  }
  return absl::OkStatus();
}

absl::Status Network::GetGradients(const std::vector<float*>& host) {
  if (host.size() != grads_.size()) return absl::InvalidArgumentError("wrong number of gradient tensors");
  PSFLOW_RETURN_IF_ERROR(backend_->Synchronize());
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(backend_->CopyToHost(grads_[i]->data(), grads_[i]->size(), host[i]));
  }
  return absl::OkStatus();
}

absl::StatusOr<Network::BatchState*> Network::StateFor(int batch) {
  if (batch <= 0) return absl::InvalidArgumentError(absl::StrCat("batch size ", batch));
  auto it = states_.find(batch);
  if (it != states_.end()) return it->second.get();
  auto state = std::make_unique<BatchState>();
  state->batch = batch;
  const size_t n = layers_.size();
  state->conv.resize(n);
  state->pool.resize(n);
  state->relu.resize(n);
  state->dense.resize(n);
  auto alloc = [&](int64_t floats) { return backend_->Allocate(static_cast<size_t>(floats)); };
  for (size_t i = 0; i <= n; ++i) {
    const int64_t floats = int64_t{batch} * (i == 0 ? layers_[0].in.size() : layers_[i - 1].out.size());
    for (auto* list : {&state->acts, &state->dacts}) {
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf = alloc(floats);
      if (!buf.ok()) return buf.status();
      list->push_back(*std::move(buf));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Layer& l = layers_[i];
    const LayerSpec& spec = spec_.layer(static_cast<int>(i));
    absl::Status s;
    if (l.kind == LayerSpec::kConv2D) {
      kernels::Conv2DShape shape;
      shape.batch = batch;
      shape.in_channels = l.in.channels;
      shape.height = l.in.height;
      shape.width = l.in.width;
      shape.out_channels = spec.conv2d().filters();
      shape.kernel_h = shape.kernel_w = spec.conv2d().kernel();
      shape.stride = spec.conv2d().stride() == 0 ? 1 : spec.conv2d().stride();
      shape.padding = spec.conv2d().padding();
      auto op = backend_->CreateConv2D(shape);
      if (!op.ok()) return op.status();
      state->conv[i] = *std::move(op);
    } else if (l.kind == LayerSpec::kMaxPool) {
      kernels::Pool2DShape shape;
      shape.batch = batch;
      shape.channels = l.in.channels;
      shape.height = l.in.height;
      shape.width = l.in.width;
      shape.window = spec.max_pool().size();
      shape.stride = spec.max_pool().stride() == 0 ? shape.window : spec.max_pool().stride();
      auto op = backend_->CreateMaxPool2D(shape);
      if (!op.ok()) return op.status();
      state->pool[i] = *std::move(op);
    } else if (l.kind == LayerSpec::kRelu) {
      auto op = backend_->CreateRelu(int64_t{batch} * l.in.size());
      if (!op.ok()) return op.status();
      state->relu[i] = *std::move(op);
    } else if (l.kind == LayerSpec::kDense) {
      kernels::DenseShape shape{batch, static_cast<int>(l.in.size()), l.out.channels};
      auto op = backend_->CreateDense(shape);
      if (!op.ok()) return op.status();
      state->dense[i] = *std::move(op);
    }
  }
  auto loss = backend_->CreateSoftmaxCrossEntropy(batch, spec_.num_classes());
  if (!loss.ok()) return loss.status();
  state->loss = *std::move(loss);
  auto probs = alloc(int64_t{batch} * spec_.num_classes());
  if (!probs.ok()) return probs.status();
  state->probs = *std::move(probs);
  BatchState* raw = state.get();
  states_[batch] = std::move(state);
  return raw;
}

absl::StatusOr<Network::Result> Network::Forward(BatchState* st, const float* images,
                                                 const int32_t* labels) {
  const InputSpec& in = spec_.input();
  if (in.stddev() > 0) {
    const size_t n = st->acts[0]->size();
    st->standardized.resize(n);
    const float mean = in.mean(), scale = 1.0f / in.stddev();
    for (size_t i = 0; i < n; ++i) st->standardized[i] = (images[i] - mean) * scale;
    images = st->standardized.data();
  }
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(images, st->acts[0]->size(), st->acts[0]->data()));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const float* x = st->acts[i]->data();
    float* y = st->acts[i + 1]->data();
    switch (l.kind) {
      case LayerSpec::kConv2D:
        PSFLOW_RETURN_IF_ERROR(st->conv[i]->Forward(x, weights_[l.weights]->data(), weights_[l.bias]->data(), y));
        break;
      case LayerSpec::kMaxPool:
        PSFLOW_RETURN_IF_ERROR(st->pool[i]->Forward(x, y));
        break;
      case LayerSpec::kRelu:
        PSFLOW_RETURN_IF_ERROR(st->relu[i]->Forward(x, y));
        break;
      case LayerSpec::kDense:
        PSFLOW_RETURN_IF_ERROR(st->dense[i]->Forward(x, weights_[l.weights]->data(), weights_[l.bias]->data(), y));
        break;
      case LayerSpec::KIND_NOT_SET:
        return absl::InternalError("layer without kind");
    }
  }
  st->labels.assign(labels, labels + st->batch);
  absl::StatusOr<kernels::SoftmaxCrossEntropy::Result> r =
      st->loss->Forward(st->acts.back()->data(), st->labels.data(), st->probs->data());
  if (!r.ok()) return r.status();
  return Result{r->loss, r->correct};
}

absl::StatusOr<Network::Result> Network::TrainStep(const float* images, const int32_t* labels, int batch) {
  absl::StatusOr<BatchState*> st_or = StateFor(batch);
  if (!st_or.ok()) return st_or.status();
  BatchState* st = *st_or;
  absl::StatusOr<Result> result = Forward(st, images, labels);
  if (!result.ok()) return result;
  PSFLOW_RETURN_IF_ERROR(st->loss->Backward(st->probs->data(), st->labels.data(), st->dacts.back()->data()));
  for (size_t i = layers_.size(); i-- > 0;) {
    const Layer& l = layers_[i];
    const float* x = st->acts[i]->data();
    const float* dy = st->dacts[i + 1]->data();
    // The first layer's input gradient is never used.
    float* dx = i == 0 ? nullptr : st->dacts[i]->data();
    switch (l.kind) {
      case LayerSpec::kConv2D:
        PSFLOW_RETURN_IF_ERROR(st->conv[i]->Backward(x, weights_[l.weights]->data(), dy, dx,
                                                     grads_[l.weights]->data(), grads_[l.bias]->data()));
        break;
      case LayerSpec::kDense:
        PSFLOW_RETURN_IF_ERROR(st->dense[i]->Backward(x, weights_[l.weights]->data(), dy, dx,
                                                      grads_[l.weights]->data(), grads_[l.bias]->data()));
        break;
      case LayerSpec::kMaxPool:
        if (dx != nullptr) PSFLOW_RETURN_IF_ERROR(st->pool[i]->Backward(dy, dx));
        break;
      case LayerSpec::kRelu:
        if (dx != nullptr) PSFLOW_RETURN_IF_ERROR(st->relu[i]->Backward(x, dy, dx));
        break;
      case LayerSpec::KIND_NOT_SET:
        return absl::InternalError("layer without kind");
    }
  }
  return result;
}

absl::StatusOr<Network::Result> Network::Evaluate(const float* images, const int32_t* labels, int batch) {
  absl::StatusOr<BatchState*> st = StateFor(batch);
  if (!st.ok()) return st.status();
  return Forward(*st, images, labels);
}

}  // namespace psflow::model
