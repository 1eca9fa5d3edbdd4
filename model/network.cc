#include "model/network.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_chunks.h"

namespace psflow::model {

// Activation 0 is the (standardized) model input; activation i + 1 is the
// output of layer i.
struct Network::Node {
  const Layer* layer = nullptr;    // owned by graph_
  int in_act = 0, other_act = -1;  // activations read (other_act: second operand)
  ActivationShape in, out;
  int first = -1, second = -1;  // variables: weights/bias or gamma/beta
  int running_mean = -1, running_var = -1;
};

// Ops and buffers for one batch size. acts[i] is activation i, dacts[i] its
// gradient (none for the model input).
struct Network::BatchState {
  int batch = 0;
  std::vector<std::unique_ptr<LayerOps>> ops;  // per layer
  std::unique_ptr<kernels::SoftmaxCrossEntropy> loss;
  std::unique_ptr<kernels::Buffer> images, labels, probs, stats, scratch;
  std::vector<std::unique_ptr<kernels::Buffer>> acts, dacts;
  std::vector<bool> grad_written;  // by activation, while queueing a backward pass
  std::unique_ptr<kernels::Graph> train_graph, eval_graph;
  bool eager_train_done = false, eager_eval_done = false;
  bool graphs_off = false;  // the backend has none, or recording failed
  bool inputs_set = false;
  bool step_queued = false;  // a step or evaluation whose stats FinishStep may read
};

Network::Network(ModelSpec spec, kernels::Backend* backend, NetworkOptions options)
    : spec_(std::move(spec)), backend_(backend), options_(options) {}

Network::~Network() = default;

absl::StatusOr<std::unique_ptr<Network>> Network::Create(const ModelSpec& spec,
                                                         kernels::Backend* backend,
                                                         const NetworkOptions& options) {
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec);
  if (!graph.ok()) return graph.status();
  std::unique_ptr<Network> net(new Network(spec, backend, options));
  net->graph_ = std::make_unique<ModelGraph>(*std::move(graph));
  const ModelGraph& g = *net->graph_;
  for (const GraphVariable& v : g.variables) net->variables_.push_back(v.shape);
  for (int i = 0; i < spec.layer_size(); ++i) {
    Node node;
    node.layer = g.layers[i].get();
    node.in_act = g.wiring[i].input + 1;
    if (g.wiring[i].other >= 0) node.other_act = g.wiring[i].other + 1;
    node.in = g.input_of(i);
    node.out = g.shapes[i];
    node.first = g.layer_vars[i].first;
    node.second = g.layer_vars[i].second;
    node.running_mean = g.layer_vars[i].running_mean;
    node.running_var = g.layer_vars[i].running_var;
    net->nodes_.push_back(node);
  }
  for (const VariableShape& v : net->variables_) {
    for (auto* list : {&net->weights_, &net->grads_}) {
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf =
          backend->Allocate(NumElements(v.shape));
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
  if (host.size() != weights_.size())
    return absl::InvalidArgumentError("wrong number of weight tensors");
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(
        backend_->CopyToDevice(host[i], weights_[i]->size(), weights_[i]->data()));
  }
  return absl::OkStatus();
}

absl::Status Network::SetWeight(int i, const float* host) {
  if (i < 0 || static_cast<size_t>(i) >= weights_.size())
    return absl::InvalidArgumentError(absl::StrCat("no weight tensor ", i));
  return backend_->CopyToDevice(host, weights_[i]->size(), weights_[i]->data());
}

absl::Status Network::GetWeights(const std::vector<float*>& host) {
  if (host.size() != weights_.size())
    return absl::InvalidArgumentError("wrong number of weight tensors");
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(backend_->CopyToHost(weights_[i]->data(), weights_[i]->size(), host[i]));
  }
  return absl::OkStatus();
}

absl::Status Network::GetGradients(const std::vector<float*>& host) {
  if (host.size() != grads_.size())
    return absl::InvalidArgumentError("wrong number of gradient tensors");
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
  PSFLOW_RETURN_IF_ERROR(CreateOps(state.get()));
  BatchState* raw = state.get();
  states_[batch] = std::move(state);
  return raw;
}

absl::Status Network::CreateOps(BatchState* st) {
  const int batch = st->batch;
  const size_t n = nodes_.size();
  st->ops.resize(n);
  auto alloc = [&](int64_t floats, std::unique_ptr<kernels::Buffer>* out) -> absl::Status {
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf =
        backend_->Allocate(static_cast<size_t>(floats));
    if (!buf.ok()) return buf.status();
    *out = *std::move(buf);
    return absl::OkStatus();
  };
  int64_t largest = 0;
  st->acts.resize(n + 1);
  st->dacts.resize(n + 1);
  for (size_t i = 0; i <= n; ++i) {
    const int64_t floats = int64_t{batch} * (i == 0 ? input_floats() : nodes_[i - 1].out.size());
    largest = std::max(largest, floats);
    PSFLOW_RETURN_IF_ERROR(alloc(floats, &st->acts[i]));
    if (i > 0) PSFLOW_RETURN_IF_ERROR(alloc(floats, &st->dacts[i]));
  }
  PSFLOW_RETURN_IF_ERROR(alloc(largest, &st->scratch));
  PSFLOW_RETURN_IF_ERROR(alloc(int64_t{batch} * input_floats(), &st->images));
  PSFLOW_RETURN_IF_ERROR(alloc(batch, &st->labels));  // int32 bits in float slots
  PSFLOW_RETURN_IF_ERROR(alloc(int64_t{batch} * spec_.num_classes(), &st->probs));
  PSFLOW_RETURN_IF_ERROR(alloc(2, &st->stats));
  for (size_t i = 0; i < n; ++i) {
    PSFLOW_ASSIGN_OR_RETURN(st->ops[i], nodes_[i].layer->CreateOps(backend_, batch, nodes_[i].in));
  }
  PSFLOW_ASSIGN_OR_RETURN(st->loss,
                          backend_->CreateSoftmaxCrossEntropy(batch, spec_.num_classes()));
  return absl::OkStatus();
}

absl::Status Network::SetInputs(const float* images, const int32_t* labels, int batch) {
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch));
  for (int i = 0; i < batch; ++i) {
    if (labels[i] < 0 || labels[i] >= spec_.num_classes()) {
      return absl::InvalidArgumentError(absl::StrCat("label ", labels[i], " of example ", i,
                                                     " is outside [0, ", spec_.num_classes(), ")"));
    }
  }
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(images, st->images->size(), st->images->data()));
  static_assert(sizeof(int32_t) == sizeof(float));
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(reinterpret_cast<const float*>(labels),
                                                static_cast<size_t>(batch), st->labels->data()));
  st->inputs_set = true;
  return absl::OkStatus();
}

absl::Status Network::QueueForward(BatchState* st, bool training) {
  const InputSpec& in = spec_.input();
  const int64_t input_size = static_cast<int64_t>(st->images->size());
  if (in.stddev() > 0) {
    const float scale = 1.0f / in.stddev();
    PSFLOW_RETURN_IF_ERROR(backend_->Affine(st->images->data(), scale, -in.mean() * scale,
                                            st->acts[0]->data(), input_size));
  } else {
    PSFLOW_RETURN_IF_ERROR(backend_->Copy(st->images->data(), st->acts[0]->data(), input_size));
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& l = nodes_[i];
    ForwardArgs args;
    args.x = st->acts[l.in_act]->data();
    if (l.other_act >= 0) args.other = st->acts[l.other_act]->data();
    args.y = st->acts[i + 1]->data();
    if (l.first >= 0) args.w = weights_[l.first]->data();
    if (l.second >= 0) args.b = weights_[l.second]->data();
    args.training = training;
    if (l.running_mean >= 0) {
      args.running_mean = weights_[l.running_mean]->data();
      args.batch_mean = grads_[l.running_mean]->data();
    }
    if (l.running_var >= 0) {
      args.running_var = weights_[l.running_var]->data();
      args.batch_var = grads_[l.running_var]->data();
    }
    PSFLOW_RETURN_IF_ERROR(
        Timed(static_cast<int>(i), "forward", [&] { return st->ops[i]->Forward(args); }));
  }
  return Timed(-1, "loss forward", [&] {
    return st->loss->Forward(st->acts.back()->data(),
                             reinterpret_cast<const int32_t*>(st->labels->data()),
                             st->probs->data(), st->stats->data());
  });
}

absl::Status Network::QueueBackward(BatchState* st) {
  const size_t n = nodes_.size();
  st->grad_written.assign(n + 1, false);
  const int32_t* labels = reinterpret_cast<const int32_t*>(st->labels->data());
  PSFLOW_RETURN_IF_ERROR(Timed(-1, "loss backward", [&] {
    return st->loss->Backward(st->probs->data(), labels, st->dacts[n]->data());
  }));
  st->grad_written[n] = true;
  for (size_t i = n; i-- > 0;) {
    const Node& l = nodes_[i];
    if (!st->grad_written[i + 1])
      return absl::InternalError(absl::StrCat("no gradient reaches layer ", i));
    const float* dy = st->dacts[i + 1]->data();
    if (l.layer->passes_gradient()) {
      // Each operand's gradient is dy: copied to the first contribution,
      // added to a later one.
      PSFLOW_RETURN_IF_ERROR(Timed(static_cast<int>(i), "backward", [&]() -> absl::Status {
        const int64_t size = static_cast<int64_t>(st->dacts[i + 1]->size());
        for (int act : {l.in_act, l.other_act}) {
          if (act <= 0) continue;
          float* d = st->dacts[act]->data();
          if (!st->grad_written[act]) {
            PSFLOW_RETURN_IF_ERROR(backend_->Copy(dy, d, size));
            st->grad_written[act] = true;
          } else {
            PSFLOW_RETURN_IF_ERROR(backend_->Add(d, dy, d, size));
          }
        }
        return absl::OkStatus();
      }));
      continue;
    }
    // The gradient of the layer's input (the model input's is never needed).
    // The first contribution to an activation's gradient is written in place;
    // later ones go to scratch and are added to it.
    const bool need_dx = l.in_act > 0;
    const bool acc = need_dx && st->grad_written[l.in_act];
    BackwardArgs args;
    args.x = st->acts[l.in_act]->data();
    args.dy = dy;
    args.dx = !need_dx ? nullptr : acc ? st->scratch->data() : st->dacts[l.in_act]->data();
    args.scratch = st->scratch->data();
    if (l.first >= 0) {
      args.w = weights_[l.first]->data();
      args.dw = grads_[l.first]->data();
    }
    if (l.second >= 0) args.db = grads_[l.second]->data();
    PSFLOW_RETURN_IF_ERROR(Timed(static_cast<int>(i), "backward", [&]() -> absl::Status {
      PSFLOW_RETURN_IF_ERROR(st->ops[i]->Backward(args));
      if (need_dx) {
        if (acc) {
          float* d = st->dacts[l.in_act]->data();
          PSFLOW_RETURN_IF_ERROR(backend_->Add(d, st->scratch->data(), d,
                                               static_cast<int64_t>(st->dacts[l.in_act]->size())));
        }
        st->grad_written[l.in_act] = true;
      }
      return absl::OkStatus();
    }));
  }
  return absl::OkStatus();
}

absl::Status Network::QueueTrain(BatchState* st) {
  PSFLOW_RETURN_IF_ERROR(QueueForward(st, /*training=*/true));
  PSFLOW_RETURN_IF_ERROR(QueueBackward(st));
  if (options_.local_sgd_learning_rate > 0) {
    return Timed(-1, "sgd", [&]() -> absl::Status {
      const float m = options_.local_bn_momentum;
      for (size_t v = 0; v < weights_.size(); ++v) {
        float* w = weights_[v]->data();
        const float* g = grads_[v]->data();
        const int64_t n = static_cast<int64_t>(weights_[v]->size());
        if (variables_[v].trainable) {
          PSFLOW_RETURN_IF_ERROR(backend_->Sgd(w, g, options_.local_sgd_learning_rate, n));
        } else {
          // r = (1 - m) r + m s, as the ps would: r -= -m * s after scaling.
          PSFLOW_RETURN_IF_ERROR(backend_->Affine(w, 1 - m, 0, w, n));
          PSFLOW_RETURN_IF_ERROR(backend_->Sgd(w, g, -m, n));
        }
      }
      return absl::OkStatus();
    });
  }
  return absl::OkStatus();
}

absl::Status Network::Timed(int layer, const char* pass, absl::FunctionRef<absl::Status()> fn) {
  if (!options_.profile) return fn();
  const std::string name = layer < 0 ? pass : absl::StrCat(spec_.layer(layer).name(), " ", pass);
  PSFLOW_RETURN_IF_ERROR(backend_->Synchronize());
  const absl::Time start = absl::Now();
  PSFLOW_RETURN_IF_ERROR(fn());
  PSFLOW_RETURN_IF_ERROR(backend_->Synchronize());
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  for (auto& [n, total] : layer_times_) {
    if (n == name) {
      total += ms;
      return absl::OkStatus();
    }
  }
  layer_times_.emplace_back(name, ms);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, double>> Network::LayerTimes() const { return layer_times_; }

absl::Status Network::Run(BatchState* st, bool train) {
  std::unique_ptr<kernels::Graph>& graph = train ? st->train_graph : st->eval_graph;
  bool& eager_done = train ? st->eager_train_done : st->eager_eval_done;
  auto queue = [this, st, train]() {
    return train ? QueueTrain(st) : QueueForward(st, /*training=*/false);
  };
  if (graph != nullptr) return graph->Launch();
  // The first step of a batch size runs eagerly: it creates the workspaces
  // and lazily initialised library state that a recording must not.
  if (!options_.use_graphs || options_.profile || st->graphs_off || !eager_done) {
    PSFLOW_RETURN_IF_ERROR(queue());
    eager_done = true;
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<kernels::Graph>> recorded = backend_->Capture(queue);
  if (!recorded.ok()) {
    st->graphs_off = true;
    if (!absl::IsUnimplemented(recorded.status())) {
      PSLOG(WARNING) << "recording the step as a graph failed (" << recorded.status().message()
                     << "); running it op by op";
    }
    return queue();
  }
  graph = *std::move(recorded);
  return graph->Launch();
}

absl::Status Network::StartTrainStep(int batch) {
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch));
  if (!st->inputs_set) return absl::FailedPreconditionError("StartTrainStep before SetInputs");
  st->step_queued = false;
  PSFLOW_RETURN_IF_ERROR(Run(st, /*train=*/true));
  st->step_queued = true;
  return absl::OkStatus();
}

absl::StatusOr<Network::Result> Network::FinishStep(int batch) {
  auto it = states_.find(batch);
  if (it == states_.end() || !it->second->step_queued) {
    return absl::FailedPreconditionError(
        absl::StrCat("FinishStep without a step of batch size ", batch));
  }
  BatchState* st = it->second.get();
  float stats[2] = {0, 0};
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToHost(st->stats->data(), 2, stats));
  return Result{stats[0], std::llround(stats[1])};
}

bool Network::UsesGraph(int batch) const {
  auto it = states_.find(batch);
  return it != states_.end() && it->second->train_graph != nullptr;
}

absl::StatusOr<Network::Result> Network::TrainStep(const float* images, const int32_t* labels,
                                                   int batch) {
  PSFLOW_RETURN_IF_ERROR(SetInputs(images, labels, batch));
  PSFLOW_RETURN_IF_ERROR(StartTrainStep(batch));
  return FinishStep(batch);
}

absl::StatusOr<Network::Result> Network::Evaluate(const float* images, const int32_t* labels,
                                                  int batch) {
  PSFLOW_RETURN_IF_ERROR(SetInputs(images, labels, batch));
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch));
  st->step_queued = false;
  PSFLOW_RETURN_IF_ERROR(Run(st, /*train=*/false));
  st->step_queued = true;
  return FinishStep(batch);
}

}  // namespace psflow::model
