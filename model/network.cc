#include "model/network.h"

#include <algorithm>
#include <cmath>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "kernels/embedding_plan.h"

namespace psflow::model {
namespace {

absl::Status ForwardOnly(absl::string_view call) {
  return absl::FailedPreconditionError(
      absl::StrCat(call, " on a forward-only network (NetworkOptions.forward_only)"));
}

kernels::Combiner ToCombiner(EmbeddingLayer::Combiner c) {
  switch (c) {
    case EmbeddingLayer::MEAN:
      return kernels::Combiner::kMean;
    case EmbeddingLayer::SQRTN:
      return kernels::Combiner::kSqrtN;
    default:
      return kernels::Combiner::kSum;
  }
}

// `sparse` (a plan over the unique rows a batch reads, by first sight) as a
// plan over every row of a table of `rows`, in order: the op then reads the
// table itself and writes its whole gradient, zeros where no id fell.
void DensePlan(const kernels::EmbeddingPlan& sparse, int64_t rows, kernels::EmbeddingPlan* plan) {
  plan->batch = sparse.batch;
  plan->features = sparse.features;
  // The "unique" rows are every row, in order: the same every step, so
  // written once (a plan is kept per layer and batch size).
  if (plan->unique_ids.size() != static_cast<size_t>(rows)) {
    plan->unique_ids.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) plan->unique_ids[r] = static_cast<uint64_t>(r);
  }
  plan->bag_offsets = sparse.bag_offsets;
  plan->bag_coefs = sparse.bag_coefs;
  plan->bag_rows.resize(sparse.bag_rows.size());
  for (size_t k = 0; k < sparse.bag_rows.size(); ++k) {
    plan->bag_rows[k] = static_cast<int32_t>(sparse.unique_ids[sparse.bag_rows[k]]);
  }
  // Row r's occurrences are those of the unique row that is r (none if no
  // id fell on it): count, sum up, then copy each unique row's run in place.
  plan->row_offsets.assign(static_cast<size_t>(rows) + 1, 0);
  for (int64_t u = 0; u < sparse.unique(); ++u) {
    plan->row_offsets[sparse.unique_ids[u] + 1] = sparse.row_offsets[u + 1] - sparse.row_offsets[u];
  }
  for (int64_t r = 0; r < rows; ++r) plan->row_offsets[r + 1] += plan->row_offsets[r];
  plan->row_bags.resize(sparse.row_bags.size());
  plan->row_coefs.resize(sparse.row_coefs.size());
  for (int64_t u = 0; u < sparse.unique(); ++u) {
    const int32_t from = sparse.row_offsets[u], to = sparse.row_offsets[u + 1];
    const int32_t at = plan->row_offsets[sparse.unique_ids[u]];
    std::copy(sparse.row_bags.begin() + from, sparse.row_bags.begin() + to,
              plan->row_bags.begin() + at);
    std::copy(sparse.row_coefs.begin() + from, sparse.row_coefs.begin() + to,
              plan->row_coefs.begin() + at);
  }
}

}  // namespace

// Activation 0 is the (standardized) model input; activation i + 1 is the
// output of layer i.
struct Network::Node {
  const Layer* layer = nullptr;  // owned by graph_
  int in_act = 0;                // the activation read
  std::vector<int> other_acts;   // those of the further operands
  ActivationShape in, out;
  std::vector<ActivationShape> others;  // the further operands' shapes
  int first = -1, second = -1;          // variables: weights/bias or gamma/beta
  int running_mean = -1, running_var = -1;
  // Embedding layers: the first of its feature's ids in an example's ids
  // (-1 for other layers), their number, the table's rows and the combiner.
  int64_t id_offset = -1;
  int id_width = 0;
  int64_t rows = 0;
  kernels::Combiner combiner = kernels::Combiner::kSum;
  // The activations it reads: in_act, then other_acts.
  absl::InlinedVector<int, 4> operands() const {
    absl::InlinedVector<int, 4> a{in_act};
    a.insert(a.end(), other_acts.begin(), other_acts.end());
    return a;
  }
  // The variables above that the layer has, in that order: what its
  // backward pass completes.
  absl::InlinedVector<int, 4> variables() const {
    absl::InlinedVector<int, 4> v;
    for (int i : {first, second, running_mean, running_var}) {
      if (i >= 0) v.push_back(i);
    }
    return v;
  }
};

// Ops and buffers for one batch size, of training steps or (forward_only) of
// Evaluate. acts[i] is activation i, in one of `buffers` (its own in a
// training state, a shared one in a forward-only state); dacts[i] its
// gradient (none for the model input, none at all in a forward-only state).
struct Network::BatchState {
  int batch = 0;
  bool forward_only = false;
  std::vector<std::unique_ptr<LayerOps>> ops;  // per layer
  std::unique_ptr<kernels::SoftmaxCrossEntropy> loss;
  std::unique_ptr<kernels::Buffer> images, labels, probs, stats, scratch;
  std::vector<std::unique_ptr<kernels::Buffer>> buffers, dacts;
  std::vector<float*> acts;
  std::vector<bool> grad_written;  // by activation, while queueing a backward pass
  // Per layer, an embedding layer's plan of the ids of the inputs set last.
  std::vector<kernels::EmbeddingPlan> plans;
  kernels::EmbeddingPlan sparse;     // scratch of BuildPlans
  std::vector<uint64_t> bag_ids;     // scratch of BuildPlans
  std::vector<int64_t> bag_offsets;  // scratch of BuildPlans
  std::unique_ptr<kernels::Graph> train_graph, eval_graph;
  bool eager_train_done = false, eager_eval_done = false;
  bool graphs_off = false;  // the backend has none, or recording failed
  bool inputs_set = false;
  bool step_queued = false;  // a training step whose stats FinishStep may read
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
    for (int o : g.wiring[i].others) {
      node.other_acts.push_back(o + 1);
      node.others.push_back(g.shapes[o]);
    }
    node.in = g.input_of(i);
    node.out = g.shapes[i];
    node.first = g.layer_vars[i].first;
    node.second = g.layer_vars[i].second;
    node.running_mean = g.layer_vars[i].running_mean;
    node.running_var = g.layer_vars[i].running_var;
    if (spec.layer(i).has_embedding()) net->SetUpEmbedding(spec.layer(i).embedding(), &node);
    net->nodes_.push_back(node);
  }
  net->PlanForwardBuffers();
  PSFLOW_RETURN_IF_ERROR(net->SetUpChannelNormalization());
  for (const VariableShape& v : net->variables_) {
    for (auto* list : {&net->weights_, &net->grads_}) {
      if (list == &net->grads_ && options.forward_only) continue;
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf =
          backend->Allocate(NumElements(v.shape));
      if (!buf.ok()) return buf.status();
      list->push_back(*std::move(buf));
    }
  }
  return net;
}

// Activation a is written by layer a - 1 (the model input, a = 0, before the
// first layer) and read last by the last layer that reads it (the logits by
// the loss, after every layer). The output of each layer takes a buffer none
// of the live activations is in: the smallest free one that is large enough,
// else the largest free one, grown, else a new one. Its inputs are still
// live, so no layer writes a buffer it reads. Then the buffers of the
// activations it read last are free.
void Network::PlanForwardBuffers() {
  const int n = static_cast<int>(nodes_.size());
  std::vector<int64_t> floats(n + 1);
  std::vector<int> last_read(n + 1);
  floats[0] = input_floats();
  for (int a = 0; a <= n; ++a) last_read[a] = std::max(a - 1, 0);  // read by no layer
  last_read[n] = n;                                                // the loss reads the logits
  for (int i = 0; i < n; ++i) {
    floats[i + 1] = nodes_[i].out.size();
    for (int a : nodes_[i].operands()) {
      last_read[a] = std::max(last_read[a], i);
    }
  }
  std::vector<std::vector<int>> released_after(n + 1);  // by layer: activations it read last
  for (int a = 0; a < n; ++a) released_after[last_read[a]].push_back(a);

  eval_buffer_of_.assign(n + 1, -1);
  eval_buffer_floats_.clear();
  std::vector<int> free_buffers;
  auto take = [&](int64_t need) {
    int fits = -1, largest = -1;
    for (int b : free_buffers) {
      const int64_t size = eval_buffer_floats_[b];
      if (size >= need && (fits < 0 || size < eval_buffer_floats_[fits])) fits = b;
      if (largest < 0 || size > eval_buffer_floats_[largest]) largest = b;
    }
    int b = fits >= 0 ? fits : largest;
    if (b < 0) {
      b = static_cast<int>(eval_buffer_floats_.size());
      eval_buffer_floats_.push_back(need);
      return b;
    }
    eval_buffer_floats_[b] = std::max(eval_buffer_floats_[b], need);
    free_buffers.erase(std::find(free_buffers.begin(), free_buffers.end(), b));
    return b;
  };
  eval_buffer_of_[0] = take(floats[0]);
  for (int i = 0; i < n; ++i) {
    eval_buffer_of_[i + 1] = take(floats[i + 1]);
    for (int a : released_after[i]) free_buffers.push_back(eval_buffer_of_[a]);
  }
}

Network::ForwardMemory Network::forward_memory() const {
  int64_t weights = 0;
  for (const VariableShape& v : variables_) weights += NumElements(v.shape);
  int64_t per_example = input_floats() + 1 + spec_.num_classes();  // images, labels, probs
  for (int64_t floats : eval_buffer_floats_) per_example += floats;
  constexpr int64_t kFloat = sizeof(float);
  return {weights * kFloat * (options_.forward_only ? 1 : 2), per_example * kFloat};
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
  if (backend_->host_memory() && !options_.forward_only) {
    for (auto& g : grads_) out.push_back(g->data());
  }
  return out;
}

std::vector<float*> Network::DeviceWeights() {
  std::vector<float*> out;
  for (auto& w : weights_) out.push_back(w->data());
  return out;
}

std::vector<float*> Network::DeviceGradients() {
  std::vector<float*> out;
  for (auto& g : grads_) out.push_back(g->data());
  return out;
}

absl::Status Network::SetWeights(const std::vector<const float*>& host) {
  if (host.size() != weights_.size())
    return absl::InvalidArgumentError("wrong number of weight tensors");
  PSFLOW_RETURN_IF_ERROR(JoinUploads());
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(
        backend_->CopyToDevice(host[i], weights_[i]->size(), weights_[i]->data()));
  }
  return absl::OkStatus();
}

absl::Status Network::SetWeight(int i, const float* host) {
  if (i < 0 || static_cast<size_t>(i) >= weights_.size())
    return absl::InvalidArgumentError(absl::StrCat("no weight tensor ", i));
  PSFLOW_RETURN_IF_ERROR(JoinUploads());
  return backend_->CopyToDevice(host, weights_[i]->size(), weights_[i]->data());
}

absl::Status Network::SetWeightAfter(int i, const float* host, kernels::Event* after) {
  if (i < 0 || static_cast<size_t>(i) >= weights_.size())
    return absl::InvalidArgumentError(absl::StrCat("no weight tensor ", i));
  return SetWeightRangeAfter(i, 0, static_cast<int64_t>(weights_[i]->size()), host, after);
}

absl::Status Network::SetWeightRangeAfter(int i, int64_t first, int64_t count, const float* host,
                                          kernels::Event* after) {
  return SetWeightRangesAfter({{i, first, count, host, after}},
                              kernels::Backend::HostValues::kFloat);
}

absl::Status Network::SetWeightRangesAfter(const std::vector<HostRange>& ranges,
                                           kernels::Backend::HostValues values) {
  // With local SGD, as SetWeight: the copies wait for the work queued
  // before them (the step writes every weight), and the next work waits for
  // the copies.
  const bool local_sgd = options_.local_sgd_learning_rate > 0;
  std::vector<kernels::Backend::Upload> uploads;
  uploads.reserve(ranges.size());
  for (const HostRange& r : ranges) {
    PSFLOW_ASSIGN_OR_RETURN(float* const device, WeightRange(r.variable, r.first, r.count));
    uploads.push_back(
        {local_sgd ? nullptr : r.after, r.host, static_cast<size_t>(r.count), device, r.block});
  }
  if (!local_sgd) return backend_->CopyToDeviceAfter(uploads, values);
  PSFLOW_RETURN_IF_ERROR(backend_->Synchronize());
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDeviceAfter(uploads, values));
  return JoinUploads();
}

absl::StatusOr<float*> Network::WeightRange(int i, int64_t first, int64_t count) {
  if (i < 0 || static_cast<size_t>(i) >= weights_.size())
    return absl::InvalidArgumentError(absl::StrCat("no weight tensor ", i));
  const int64_t size = static_cast<int64_t>(weights_[i]->size());
  if (first < 0 || count < 0 || count > size - first) {
    return absl::InvalidArgumentError(absl::StrCat("floats ", first, " to ", first + count,
                                                   " of weight tensor ", i, " of ", size));
  }
  return weights_[i]->data() + first;
}

absl::Status Network::JoinUploads() { return backend_->JoinUploads(); }

absl::Status Network::GetWeights(const std::vector<float*>& host) {
  if (host.size() != weights_.size())
    return absl::InvalidArgumentError("wrong number of weight tensors");
  PSFLOW_RETURN_IF_ERROR(JoinUploads());
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(backend_->CopyToHost(weights_[i]->data(), weights_[i]->size(), host[i]));
  }
  return absl::OkStatus();
}

absl::Status Network::GetGradients(const std::vector<float*>& host) {
  if (options_.forward_only) return ForwardOnly("GetGradients");
  if (host.size() != grads_.size())
    return absl::InvalidArgumentError("wrong number of gradient tensors");
  for (size_t i = 0; i < host.size(); ++i) {
    PSFLOW_RETURN_IF_ERROR(backend_->CopyToHost(grads_[i]->data(), grads_[i]->size(), host[i]));
  }
  return absl::OkStatus();
}

absl::StatusOr<Network::BatchState*> Network::StateFor(int batch, bool forward_only) {
  if (batch <= 0) return absl::InvalidArgumentError(absl::StrCat("batch size ", batch));
  std::map<int, std::unique_ptr<BatchState>>& states = forward_only ? eval_states_ : states_;
  auto it = states.find(batch);
  if (it != states.end()) return it->second.get();
  auto state = std::make_unique<BatchState>();
  state->batch = batch;
  state->forward_only = forward_only;
  PSFLOW_RETURN_IF_ERROR(CreateOps(state.get()));
  BatchState* raw = state.get();
  states[batch] = std::move(state);
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
  st->acts.resize(n + 1);
  if (st->forward_only) {
    // What forward_memory() counts per example, times the batch.
    st->buffers.resize(eval_buffer_floats_.size());
    for (size_t b = 0; b < st->buffers.size(); ++b) {
      PSFLOW_RETURN_IF_ERROR(alloc(int64_t{batch} * eval_buffer_floats_[b], &st->buffers[b]));
    }
    for (size_t i = 0; i <= n; ++i) st->acts[i] = st->buffers[eval_buffer_of_[i]]->data();
  } else {
    int64_t largest = 0;
    st->buffers.resize(n + 1);
    st->dacts.resize(n + 1);
    for (size_t i = 0; i <= n; ++i) {
      const int64_t floats = int64_t{batch} * (i == 0 ? input_floats() : nodes_[i - 1].out.size());
      largest = std::max(largest, floats);
      PSFLOW_RETURN_IF_ERROR(alloc(floats, &st->buffers[i]));
      st->acts[i] = st->buffers[i]->data();
      if (i > 0) PSFLOW_RETURN_IF_ERROR(alloc(floats, &st->dacts[i]));
    }
    PSFLOW_RETURN_IF_ERROR(alloc(largest, &st->scratch));
  }
  PSFLOW_RETURN_IF_ERROR(alloc(int64_t{batch} * input_floats(), &st->images));
  PSFLOW_RETURN_IF_ERROR(alloc(batch, &st->labels));  // int32 bits in float slots
  PSFLOW_RETURN_IF_ERROR(alloc(int64_t{batch} * spec_.num_classes(), &st->probs));
  PSFLOW_RETURN_IF_ERROR(alloc(2, &st->stats));
  for (size_t i = 0; i < n; ++i) {
    PSFLOW_ASSIGN_OR_RETURN(
        st->ops[i], nodes_[i].layer->CreateOps(backend_, batch, nodes_[i].in, nodes_[i].others,
                                               st->forward_only));
  }
  PSFLOW_ASSIGN_OR_RETURN(st->loss,
                          backend_->CreateSoftmaxCrossEntropy(batch, spec_.num_classes()));
  return absl::OkStatus();
}

void Network::SetUpEmbedding(const EmbeddingLayer& e, Node* node) {
  int64_t offset = 0;
  for (const IdFeatureSpec& f : spec_.input().id_feature()) {
    const int width = std::max(f.width(), 1);
    if (f.name() == e.feature()) {
      node->id_offset = offset;
      node->id_width = width;
    }
    offset += width;
  }
  node->rows = e.rows();
  node->combiner = ToCombiner(e.combiner());
  ids_per_example_ = offset;
  has_embeddings_ = true;
}

absl::Status Network::SetIds(const uint64_t* ids, int batch) {
  if (batch <= 0) return absl::InvalidArgumentError(absl::StrCat("SetIds for a batch of ", batch));
  ids_.assign(ids, ids + int64_t{batch} * ids_per_example_);
  ids_batch_ = batch;
  return absl::OkStatus();
}

absl::Status Network::BuildPlans(BatchState* st) {
  const int batch = st->batch;
  if (ids_batch_ == 0) {
    return absl::FailedPreconditionError(
        "the model has embedding layers: SetIds must give the batch's ids first");
  }
  if (ids_batch_ != batch) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ids set are of a batch of ", ids_batch_, ", not ", batch));
  }
  st->plans.resize(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& l = nodes_[i];
    if (l.id_offset < 0) continue;
    st->bag_ids.resize(static_cast<size_t>(batch) * l.id_width);
    st->bag_offsets.resize(static_cast<size_t>(batch) + 1);
    for (int b = 0; b < batch; ++b) {
      st->bag_offsets[b] = int64_t{b} * l.id_width;
      const uint64_t* x = ids_.data() + b * ids_per_example_ + l.id_offset;
      for (int j = 0; j < l.id_width; ++j) {
        st->bag_ids[static_cast<size_t>(b) * l.id_width + j] = x[j] % static_cast<uint64_t>(l.rows);
      }
    }
    st->bag_offsets[batch] = static_cast<int64_t>(st->bag_ids.size());
    const kernels::EmbeddingFeatureBags bags{st->bag_offsets, st->bag_ids, {}, l.combiner};
    PSFLOW_RETURN_IF_ERROR(kernels::BuildEmbeddingPlan(batch, {&bags, 1}, &st->sparse));
    DensePlan(st->sparse, l.rows, &st->plans[i]);
  }
  return absl::OkStatus();
}

absl::Status Network::SetInputs(const float* images, const int32_t* labels, int batch) {
  if (options_.forward_only) return ForwardOnly("SetInputs");
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch, /*forward_only=*/false));
  return CopyInputs(st, images, labels);
}

absl::Status Network::CopyInputs(BatchState* st, const float* images, const int32_t* labels) {
  const int batch = st->batch;
  for (int i = 0; i < batch; ++i) {
    if (labels[i] < 0 || labels[i] >= spec_.num_classes()) {
      return absl::InvalidArgumentError(absl::StrCat("label ", labels[i], " of example ", i,
                                                     " is outside [0, ", spec_.num_classes(), ")"));
    }
  }
  if (has_embeddings_) {
    // The ids go with these inputs alone: a later batch needs its own.
    absl::Status planned = BuildPlans(st);
    ids_batch_ = 0;
    PSFLOW_RETURN_IF_ERROR(planned);
  }
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(images, st->images->size(), st->images->data()));
  static_assert(sizeof(int32_t) == sizeof(float));
  PSFLOW_RETURN_IF_ERROR(backend_->CopyToDevice(reinterpret_cast<const float*>(labels),
                                                static_cast<size_t>(batch), st->labels->data()));
  st->inputs_set = true;
  return absl::OkStatus();
}

absl::Status Network::SetUpChannelNormalization() {
  const InputSpec& in = spec_.input();
  if (in.channel_mean_size() == 0) return absl::OkStatus();
  // [scale | shift] per channel: (x - mean) / stddev = x * (1 / stddev) - mean / stddev.
  std::vector<float> coef(2 * static_cast<size_t>(in.channels()));
  for (int c = 0; c < in.channels(); ++c) {
    coef[c] = 1.0f / in.channel_stddev(c);
    coef[in.channels() + c] = -in.channel_mean(c) / in.channel_stddev(c);
  }
  PSFLOW_ASSIGN_OR_RETURN(channel_coef_, backend_->Allocate(coef.size()));
  return backend_->CopyToDevice(coef.data(), coef.size(), channel_coef_->data());
}

absl::Status Network::QueueForward(BatchState* st, bool training) {
  const InputSpec& in = spec_.input();
  const int64_t input_size = static_cast<int64_t>(st->images->size());
  if (channel_coef_ != nullptr) {
    const float* coef = channel_coef_->data();
    PSFLOW_RETURN_IF_ERROR(backend_->ChannelAffine(st->images->data(), coef, coef + in.channels(),
                                                   st->acts[0], st->batch, in.channels(),
                                                   int64_t{in.height()} * in.width()));
  } else if (in.stddev() > 0) {
    const float scale = 1.0f / in.stddev();
    PSFLOW_RETURN_IF_ERROR(
        backend_->Affine(st->images->data(), scale, -in.mean() * scale, st->acts[0], input_size));
  } else {
    PSFLOW_RETURN_IF_ERROR(backend_->Copy(st->images->data(), st->acts[0], input_size));
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& l = nodes_[i];
    ForwardArgs args;
    args.x = st->acts[l.in_act];
    for (int a : l.other_acts) args.others.push_back(st->acts[a]);
    args.y = st->acts[i + 1];
    if (l.first >= 0) args.w = weights_[l.first]->data();
    if (l.second >= 0) args.b = weights_[l.second]->data();
    args.training = training;
    if (l.id_offset >= 0) args.plan = &st->plans[i];
    if (l.running_mean >= 0) {
      args.running_mean = weights_[l.running_mean]->data();
      if (training) args.batch_mean = grads_[l.running_mean]->data();
    }
    if (l.running_var >= 0) {
      args.running_var = weights_[l.running_var]->data();
      if (training) args.batch_var = grads_[l.running_var]->data();
    }
    PSFLOW_RETURN_IF_ERROR(
        Timed(static_cast<int>(i), "forward", [&] { return st->ops[i]->Forward(args); }));
  }
  return Timed(-1, "loss forward", [&] {
    return st->loss->Forward(st->acts.back(), reinterpret_cast<const int32_t*>(st->labels->data()),
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
        for (int act : l.operands()) {
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
    if (l.layer->adds_to_gradients()) {
      PSFLOW_RETURN_IF_ERROR(QueueJoinBackward(st, static_cast<int>(i), dy));
      continue;
    }
    // The gradient of the layer's input (the model input's is never needed).
    // The first contribution to an activation's gradient is written in place;
    // later ones go to scratch and are added to it.
    const bool need_dx = l.in_act > 0;
    const bool acc = need_dx && st->grad_written[l.in_act];
    BackwardArgs args;
    args.x = st->acts[l.in_act];
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
    const absl::InlinedVector<int, 4> done = l.variables();
    if (gradients_ready_ && backend_->host_memory() && !done.empty()) {
      gradients_ready_(absl::MakeConstSpan(done));
    }
    for (int i : done) {
      const size_t v = static_cast<size_t>(i);
      if (v < gradient_halves_.size() && gradient_halves_[v] != nullptr) {
        PSFLOW_RETURN_IF_ERROR(backend_->NarrowToHalves(grads_[v]->data(),
                                                        static_cast<int64_t>(grads_[v]->size()),
                                                        halves_bf16_, gradient_halves_[v]));
      }
      if (v < gradient_events_.size() && gradient_events_[v] != nullptr) {
        PSFLOW_RETURN_IF_ERROR(backend_->RecordEvent(gradient_events_[v]));
      }
    }
  }
  return absl::OkStatus();
}

// A layer of several operands computes each operand's gradient itself:
// written where it is the first contribution, added to the others (its
// operands are distinct, so no two of them share a gradient buffer).
absl::Status Network::QueueJoinBackward(BatchState* st, int i, const float* dy) {
  const Node& l = nodes_[i];
  BackwardArgs args;
  args.x = st->acts[l.in_act];
  args.dy = dy;
  args.scratch = st->scratch->data();
  auto gradient = [&](int act) -> float* {
    args.add.push_back(act > 0 && st->grad_written[act] ? 1 : 0);
    return act > 0 ? st->dacts[act]->data() : nullptr;
  };
  args.dx = gradient(l.in_act);
  for (int act : l.other_acts) {
    args.others.push_back(st->acts[act]);
    args.dothers.push_back(gradient(act));
  }
  PSFLOW_RETURN_IF_ERROR(Timed(i, "backward", [&] { return st->ops[i]->Backward(args); }));
  for (int act : l.operands()) {
    if (act > 0) st->grad_written[act] = true;
  }
  return absl::OkStatus();
}

std::vector<int> Network::BackwardOrder() const {
  std::vector<int> order;
  for (size_t i = nodes_.size(); i-- > 0;) {
    for (int v : nodes_[i].variables()) order.push_back(v);
  }
  return order;
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
  // The step reads the weights: after their uploads.
  PSFLOW_RETURN_IF_ERROR(JoinUploads());
  if (graph != nullptr) return graph->Launch();
  // The first step of a batch size runs eagerly: it creates the workspaces
  // and lazily initialised library state that a recording must not.
  // A graph would replay the plans of the batch it recorded: models with
  // embedding layers run op by op.
  if (!options_.use_graphs || options_.profile || st->graphs_off || !eager_done ||
      has_embeddings_) {
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
  if (options_.forward_only) return ForwardOnly("StartTrainStep");
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch, /*forward_only=*/false));
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
  return ReadResult(it->second.get());
}

absl::StatusOr<Network::Result> Network::ReadResult(BatchState* st) {
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
  PSFLOW_ASSIGN_OR_RETURN(BatchState * st, StateFor(batch, /*forward_only=*/true));
  PSFLOW_RETURN_IF_ERROR(CopyInputs(st, images, labels));
  PSFLOW_RETURN_IF_ERROR(Run(st, /*train=*/false));
  return ReadResult(st);
}

absl::Status Network::ReadProbabilities(int batch, float* host) {
  auto it = eval_states_.find(batch);
  if (it == eval_states_.end() || !it->second->inputs_set) {
    return absl::FailedPreconditionError(
        absl::StrCat("ReadProbabilities: no evaluation of batch size ", batch, " yet"));
  }
  kernels::Buffer& probs = *it->second->probs;
  return backend_->CopyToHost(probs.data(), probs.size(), host);
}

}  // namespace psflow::model
