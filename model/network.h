// A model spec made runnable on a kernels backend: the worker trains with it,
// psflow-eval and the evaluator run it forward, the benchmarks time it. Ops
// and activation buffers are created once per batch size and reused.
// Weights and gradients are exchanged through host memory, in
// ModelVariables(spec) order.
//
// Evaluation runs on buffers of its own, apart from the training step's of
// the same batch size, and forward-only: ops without their backward state
// (kernels.h), no gradient buffers, and activations that share buffers: once
// the last layer that reads an output has run, its buffer takes a later
// output. A forward pass of a resnet so holds a few activations at a time
// instead of all of them and their gradients; ForwardMemory says how much
// it takes.
//
// Batch norm: a training step normalizes with the batch's statistics and
// leaves them, where the gradients of the non-trainable running mean and
// running variance would be, for the caller to push (the batch's mean and
// unbiased variance: the ps average them into the running statistics);
// Evaluate normalizes with the running statistics, so its results do not
// depend on how the examples are batched.
//
// Layers form a graph (a layer reads any earlier layer's output, `add` joins
// two); the backward pass visits layers in reverse order and sums the
// gradients of outputs read by more than one layer.
//
// On a backend that records graphs (CUDA), the work of a step is queued as one
// graph after the first eager step of each batch size, so a step costs one
// launch instead of one per kernel. Not for models with embedding layers:
// each batch's ids change the plan the embedding ops run on, which a graph
// would replay as recorded, so they run op by op.
//
// Embedding layers read the batch's categorical ids (SetIds), not an
// activation; a table "<layer>/table" is a dense variable like the others,
// and its gradient is dense too (zeros in the rows no id of the batch fell
// on).
//
// Not thread-safe: one Network per thread.
#ifndef PSFLOW_MODEL_NETWORK_H_
#define PSFLOW_MODEL_NETWORK_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/kernels.h"
#include "model/graph.h"
#include "model/spec.h"
#include "proto/model.pb.h"

namespace psflow::model {

struct NetworkOptions {
  // Replay each batch size's step as a recorded graph where the backend can.
  bool use_graphs = true;
  // > 0: each training step ends with w -= rate * g on the device, for
  // training without parameter servers (benchmarks); running statistics r
  // become (1 - local_bn_momentum) * r + local_bn_momentum * s instead.
  float local_sgd_learning_rate = 0;
  float local_bn_momentum = 0.1f;
  // Benchmarks: time every layer's forward and backward pass by waiting for
  // the device after each (slow; implies op-by-op steps). See LayerTimes.
  bool profile = false;
  // For evaluation alone (psflow-eval, the evaluator): no gradient buffers
  // are allocated, and TrainStep, SetInputs, StartTrainStep and
  // GetGradients are FAILED_PRECONDITION.
  bool forward_only = false;
};

class Network {
 public:
  // `spec` must be valid; `backend` must outlive the network.
  static absl::StatusOr<std::unique_ptr<Network>> Create(const ModelSpec& spec,
                                                         kernels::Backend* backend,
                                                         const NetworkOptions& options = {});
  ~Network();

  const ModelSpec& spec() const { return spec_; }
  const std::vector<VariableShape>& variables() const { return variables_; }
  int64_t input_floats() const;  // per example

  // When the backend computes in host memory: the network's own weight and
  // gradient buffers, one per variable, to fill and read in place instead of
  // SetWeights and GetGradients. Empty for other backends.
  std::vector<float*> HostWeights();
  std::vector<float*> HostGradients();

  // The weight and gradient buffers themselves, in the backend's memory (a
  // GPU's for CUDA), one per variable (no gradients when forward_only): for
  // reducing and copying among replicas of the network on several GPUs
  // (kernels::DeviceGroup), in order with the backend's queued work.
  std::vector<float*> DeviceWeights();
  std::vector<float*> DeviceGradients();

  // Copies weights in from host memory, one pointer per variable.
  absl::Status SetWeights(const std::vector<const float*>& host);
  // Copies variable `i`'s weights in from host memory. Unlike the rest of
  // the network, callable from several threads at once (the backend
  // serializes its copies), while no step runs. With host memory from
  // Backend::AllocateHost, the copy may still be under way on return: the
  // next step waits for it.
  absl::Status SetWeight(int i, const float* host);
  // As SetWeight, but the copy waits only for `after` (an event of the
  // backend, or null), not for the work queued before it
  // (Backend::CopyToDeviceAfter): pass the event SetGradientEvents gave
  // variable i, and the copy of the next step's weight overlaps the rest of
  // the running step's backward pass, which is done with that weight by
  // then (call it once that step is queued: an event stands for its latest
  // record, so before the step is queued the copy would wait only for the
  // step before). The next step, evaluation, SetWeight(s) or GetWeights
  // waits for it. With NetworkOptions.local_sgd_learning_rate (the step then writes
  // every weight after its backward pass) it is SetWeight.
  absl::Status SetWeightAfter(int i, const float* host, kernels::Event* after);
  // As SetWeightAfter, for `count` floats of variable i from its float
  // `first` on (a slice of its rows), from `host` (their values only).
  absl::Status SetWeightRangeAfter(int i, int64_t first, int64_t count, const float* host,
                                   kernels::Event* after);
  // As SetWeightRangeAfter for each of `ranges`, queued at once
  // (Backend::CopyToDeviceAfter: fewer calls, one kernel placing many
  // ranges): `count` values at `host` each, floats, or 16-bit values
  // (bfloat16 or IEEE half) that cross as they are and are widened on the
  // device (UNIMPLEMENTED on the CPU).
  struct HostRange {
    int variable = 0;
    int64_t first = 0, count = 0;
    const void* host = nullptr;
    kernels::Event* after = nullptr;
    const void* block = nullptr;  // Backend::Upload::block
  };
  absl::Status SetWeightRangesAfter(const std::vector<HostRange>& ranges,
                                    kernels::Backend::HostValues values);
  // Copies the weights out to host memory, one pointer per variable.
  absl::Status GetWeights(const std::vector<float*>& host);

  // The memory Evaluate takes on the backend's device, in bytes: `fixed`
  // whatever the batch (the weights, and their gradients unless
  // forward_only), and `per_example` for each example of a batch size it has
  // run (the activation buffers, the input, its label and the class
  // probabilities). Not counted: the backend's own state of the ops (small
  // on the CPU; a cuDNN convolution's forward workspace on a GPU), and the
  // buffers of training steps.
  struct ForwardMemory {
    int64_t fixed = 0;
    int64_t per_example = 0;
  };
  ForwardMemory forward_memory() const;

  struct Result {
    double loss = 0;      // mean over the batch
    int64_t correct = 0;  // arg-max equals the label
  };
  // Forward and backward over one batch (host memory: images [batch, C, H, W]
  // in [0, 1], standardized on the device as the spec's input says; labels
  // [batch], each in [0, num_classes)); the gradients of the mean loss (and
  // the batch statistics of the non-trainable variables) stay in the
  // network until GetGradients.
  absl::StatusOr<Result> TrainStep(const float* images, const int32_t* labels, int batch);
  // Forward only, in inference mode (batch norm with its running statistics),
  // on the forward-only buffers of this batch size (made on its first call).
  absl::StatusOr<Result> Evaluate(const float* images, const int32_t* labels, int batch);
  // The class probabilities (softmax of the logits) of the latest Evaluate
  // of this batch size, [batch, num_classes] into host memory.
  // FAILED_PRECONDITION before any.
  absl::Status ReadProbabilities(int batch, float* host);
  // Copies the latest gradients out to host memory, one pointer per
  // variable: for a non-trainable variable, the latest training step's
  // statistic of the batch (mean or unbiased variance) instead.
  absl::Status GetGradients(const std::vector<float*>& host);

  // Models with embedding layers: the ids of the next batch, host memory of
  // batch * ids-per-example ids (the InputSpec.id_feature widths summed),
  // each example's in id_feature order. The next TrainStep, SetInputs or
  // Evaluate (of this batch size) takes them with its images and labels;
  // they are used by that call alone, so every batch needs its own SetIds.
  // Those calls are FAILED_PRECONDITION for a model with embedding layers
  // without ids of their batch size. Ignored by models without embedding
  // layers. INVALID_ARGUMENT for a batch below 1.
  absl::Status SetIds(const uint64_t* ids, int batch);

  // The same step in parts, for callers that keep a batch on the device:
  // SetInputs copies a batch in; StartTrainStep queues a step on the inputs
  // last set for that batch size and returns before it finishes;
  // FinishStep waits for it and reads its loss and accuracy.
  absl::Status SetInputs(const float* images, const int32_t* labels, int batch);
  absl::Status StartTrainStep(int batch);
  absl::StatusOr<Result> FinishStep(int batch);

  // Called during TrainStep (and StartTrainStep), after each layer's backward
  // pass, with the variables whose gradients (or, for running statistics,
  // batch statistics) it completed: a caller can send them on while the rest
  // of the backward pass runs. Only on a backend of host memory, where the
  // work is done when the call returns (host_memory(); a GPU's queued or
  // recorded work is not): elsewhere it is never called. Empty: none.
  using GradientsReady = std::function<void(absl::Span<const int> variables)>;
  void SetGradientsReady(GradientsReady hook) { gradients_ready_ = std::move(hook); }
  // The order in which a backward pass completes the variables (the last
  // layer's first), each once.
  std::vector<int> BackwardOrder() const;
  // On a backend with events (a GPU's): after the backward pass of the layer
  // that completes variable v, each step records `events[v]` (if not null;
  // one per variable) on the backend, recorded steps' graphs included, so
  // that other work can wait for v's gradient while the rest of the step
  // runs. Set before the first step of a batch size (its graph is recorded
  // at the second). Empty: none.
  void SetGradientEvents(std::vector<kernels::Event*> events) {
    gradient_events_ = std::move(events);
  }
  // On a backend with 16-bit rounding (a GPU's, Backend::NarrowToHalves):
  // after the backward pass of the layer that completes variable v, and
  // before v's event, each step rounds v's gradient into `halves[v]` (if
  // not null; backend memory of that many 16-bit values), bfloat16 with
  // `bf16`, else IEEE half, recorded steps' graphs included. Set before the
  // first step of a batch size, as the events. Empty: none.
  void SetGradientHalves(std::vector<uint16_t*> halves, bool bf16) {
    gradient_halves_ = std::move(halves);
    halves_bf16_ = bf16;
  }

  // Whether steps of this batch size replay a recorded graph (after the
  // first eager step); false on backends without graphs.
  bool UsesGraph(int batch) const;

  // With NetworkOptions.profile: milliseconds spent per layer and pass
  // ("conv1 forward", "loss backward", "sgd", ...) summed over all steps
  // since the network was created, in the order first seen.
  std::vector<std::pair<std::string, double>> LayerTimes() const;

 private:
  // The device memory of `count` floats of variable i from float `first`
  // on; INVALID_ARGUMENT for a range outside the variable.
  absl::StatusOr<float*> WeightRange(int i, int64_t first, int64_t count);
  struct Node;  // a layer with the activations it reads and writes
  struct BatchState;
  Network(ModelSpec spec, kernels::Backend* backend, NetworkOptions options);
  // The training step's state of a batch size, or (forward_only) Evaluate's.
  absl::StatusOr<BatchState*> StateFor(int batch, bool forward_only);
  absl::Status CreateOps(BatchState* st);
  // Shares buffers among the activations of a forward pass: fills
  // eval_buffer_of_ and eval_buffer_floats_.
  void PlanForwardBuffers();
  // Allocates and fills channel_coef_ where the spec normalizes per channel.
  absl::Status SetUpChannelNormalization();
  // Checks the labels and copies a batch into st's inputs.
  absl::Status CopyInputs(BatchState* st, const float* images, const int32_t* labels);
  // Fills node's embedding fields (and ids_per_example_) for layer spec e.
  void SetUpEmbedding(const EmbeddingLayer& e, Node* node);
  // Builds st's plans from ids_ (FAILED_PRECONDITION without ids of its
  // batch size).
  absl::Status BuildPlans(BatchState* st);
  absl::StatusOr<Result> ReadResult(BatchState* st);
  absl::Status QueueForward(BatchState* st, bool training);
  absl::Status QueueBackward(BatchState* st);
  absl::Status QueueJoinBackward(BatchState* st, int layer, const float* dy);
  absl::Status QueueTrain(BatchState* st);
  absl::Status Run(BatchState* st, bool train);
  // Makes the work queued from now on wait for the copies of SetWeightAfter
  // (the backend knows whether any is pending: nothing to do otherwise).
  absl::Status JoinUploads();
  // Runs fn; with options_.profile, waits for the device and adds the time to
  // layer_times_ under "<layer name> <pass>" (just `pass` for layer -1).
  absl::Status Timed(int layer, const char* pass, absl::FunctionRef<absl::Status()> fn);

  ModelSpec spec_;
  kernels::Backend* backend_;
  NetworkOptions options_;
  GradientsReady gradients_ready_;
  std::vector<kernels::Event*> gradient_events_;  // by variable; may be empty
  std::vector<uint16_t*> gradient_halves_;        // by variable; may be empty
  bool halves_bf16_ = true;
  std::vector<VariableShape> variables_;
  std::unique_ptr<const ModelGraph> graph_;  // the spec's layers, read once
  std::vector<Node> nodes_;
  // The inputs' per-channel normalization, [scale | shift] (InputSpec's
  // channel_mean and channel_stddev); null where the spec has none.
  std::unique_ptr<kernels::Buffer> channel_coef_;
  std::vector<std::unique_ptr<kernels::Buffer>> weights_;
  std::vector<std::unique_ptr<kernels::Buffer>> grads_;     // empty when forward_only
  std::map<int, std::unique_ptr<BatchState>> states_;       // training steps', by batch size
  std::map<int, std::unique_ptr<BatchState>> eval_states_;  // Evaluate's, by batch size
  // Evaluate's activation buffers: per activation, the buffer it lives in;
  // per buffer, its floats per example.
  std::vector<int> eval_buffer_of_;
  std::vector<int64_t> eval_buffer_floats_;
  std::vector<std::pair<std::string, double>> layer_times_;
  // Embedding layers: whether the model has any, the ids of one example,
  // and those SetIds gave (for a batch of ids_batch_; 0: none pending).
  bool has_embeddings_ = false;
  int64_t ids_per_example_ = 0;
  std::vector<uint64_t> ids_;
  int ids_batch_ = 0;
};

}  // namespace psflow::model

#endif  // PSFLOW_MODEL_NETWORK_H_
