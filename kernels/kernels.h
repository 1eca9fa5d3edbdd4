// The compute-kernel interface shared by every backend (CPU on oneDNN, GPU on
// cuDNN/cuBLAS). A backend creates op objects for one fixed shape; an op keeps
// its primitives (and any workspace its backward pass needs) and is executed
// many times. Layers create their ops once per batch size and reuse them.
//
// Memory: every float* handed to an op points into memory of the op's backend
// (host memory for the CPU backend), allocated with Backend::Allocate. Tensors
// are dense, fp32, row-major; images are NCHW.
//
// Errors: ops return absl::Status; exceptions from the underlying libraries
// are caught inside the backend and never cross this interface.
//
// Ordering: a backend runs the work it is given in submission order. A GPU
// backend may return before the work has finished (ops are queued on one
// stream); CopyToHost and Synchronize wait for it. Backends that support it
// can record a sequence of calls once as a Graph and replay it (CUDA graphs).
//
// Forward-only ops: an op created from a shape with forward_only set will only
// run forward (inference: a batch norm's Infer). A backend may leave out
// whatever only the other calls need (backward primitives, the pooling
// arg-max workspace, cuDNN's backward algorithms and their workspace), and
// those calls on such an op are FAILED_PRECONDITION.
//
// Thread-safety: a Backend may be shared by threads that create ops; a single
// op object must not be executed concurrently from two threads.
#ifndef PSFLOW_KERNELS_KERNELS_H_
#define PSFLOW_KERNELS_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/optimizer_math.h"

namespace psflow::kernels {

// Device memory owned by a backend; freed on destruction.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual float* data() = 0;
  virtual size_t size() const = 0;  // in floats
};

// One tensor of Backend::ApplyOptimizer: n weights w, their gradients g and
// the rule's step.slots() slot buffers s0, s1 (null where it has none).
struct OptimizerTensor {
  float* w = nullptr;
  const float* g = nullptr;
  float* s0 = nullptr;
  float* s1 = nullptr;
  int64_t n = 0;
};

// One copy of Backend::CopyToHostAfter: `floats` floats at `device` to
// `host`.
struct HostCopy {
  const float* device = nullptr;
  float* host = nullptr;
  size_t floats = 0;
};

struct Conv2DShape {
  int batch = 0;
  int in_channels = 0, height = 0, width = 0;
  int out_channels = 0, kernel_h = 0, kernel_w = 0;
  int stride = 1, padding = 0;
  bool forward_only = false;  // see "Forward-only ops" above
  int out_height() const { return (height + 2 * padding - kernel_h) / stride + 1; }
  int out_width() const { return (width + 2 * padding - kernel_w) / stride + 1; }
};

// y = conv(x, w) + b. x: [N,C,H,W], w: [K,C,R,S] (OIHW), b: [K], y: [N,K,P,Q].
// b may be null (no bias); then Backward's db must be null too.
class Conv2D {
 public:
  virtual ~Conv2D() = default;
  virtual absl::Status Forward(const float* x, const float* w, const float* b, float* y) = 0;
  // Writes (overwrites) dw, db unless it is null, and dx unless it is null.
  virtual absl::Status Backward(const float* x, const float* w, const float* dy, float* dx,
                                float* dw, float* db) = 0;
};

struct Pool2DShape {
  int batch = 0, channels = 0, height = 0, width = 0;
  int window = 2, stride = 2;
  bool forward_only = false;  // see "Forward-only ops" above
  int out_height() const { return (height - window) / stride + 1; }
  int out_width() const { return (width - window) / stride + 1; }
};

// Max pooling without padding. Backward uses state kept by the latest Forward,
// so call Backward only after Forward on the same input.
class MaxPool2D {
 public:
  virtual ~MaxPool2D() = default;
  virtual absl::Status Forward(const float* x, float* y) = 0;
  virtual absl::Status Backward(const float* dy, float* dx) = 0;
};

// y = max(x, 0) elementwise over `size` floats.
class Relu {
 public:
  virtual ~Relu() = default;
  virtual absl::Status Forward(const float* x, float* y) = 0;
  // dx = dy where x > 0, else 0. x is the forward input.
  virtual absl::Status Backward(const float* x, const float* dy, float* dx) = 0;
};

struct DenseShape {
  int batch = 0, in_features = 0, out_features = 0;
  bool forward_only = false;  // see "Forward-only ops" above
};

// y = x * w^T + b. x: [N,in], w: [out,in], b: [out], y: [N,out].
class Dense {
 public:
  virtual ~Dense() = default;
  virtual absl::Status Forward(const float* x, const float* w, const float* b, float* y) = 0;
  // Writes (overwrites) dw and db, and dx unless it is null.
  virtual absl::Status Backward(const float* x, const float* w, const float* dy, float* dx,
                                float* dw, float* db) = 0;
};

struct BatchNormShape {
  int batch = 0, channels = 0, height = 0, width = 0;
  float epsilon = 1e-5f;
  bool forward_only = false;  // Infer only; see "Forward-only ops" above
};

// Batch normalization: per channel c, over the M = N*H*W values of x,
// y = gamma[c] * (x - mean[c]) / sqrt(var[c] + epsilon) + beta[c]. x, y:
// NCHW; gamma, beta, mean, var: [C].
class BatchNorm {
 public:
  virtual ~BatchNorm() = default;
  // Training mode: mean and var are the batch's own (var biased, the sum
  // of squares over M). Keeps them for Backward. Unless null, batch_mean
  // and batch_var receive the batch's mean and its unbiased variance (the
  // sum of squares over M - 1; over M when M = 1), the statistics running
  // averages are made of (as PyTorch's batch norm makes them).
  virtual absl::Status Forward(const float* x, const float* gamma, const float* beta, float* y,
                               float* batch_mean, float* batch_var) = 0;
  // Inference mode: mean and var are given (running statistics). Leaves
  // what Backward reads alone.
  virtual absl::Status Infer(const float* x, const float* gamma, const float* beta,
                             const float* mean, const float* var, float* y) = 0;
  // After Forward on the same x: writes (overwrites) dx, dgamma and dbeta.
  virtual absl::Status Backward(const float* x, const float* gamma, const float* dy, float* dx,
                                float* dgamma, float* dbeta) = 0;
};

struct GlobalAvgPoolShape {
  int batch = 0, channels = 0, height = 0, width = 0;
};

// y[n,c] = mean over h,w of x[n,c,h,w]. x: [N,C,H,W], y: [N,C].
class GlobalAvgPool {
 public:
  virtual ~GlobalAvgPool() = default;
  virtual absl::Status Forward(const float* x, float* y) = 0;
  // dx[n,c,h,w] = dy[n,c] / (H*W).
  virtual absl::Status Backward(const float* dy, float* dx) = 0;
};

// The most operands a Concat or Interaction op takes (a GPU passes their
// pointers to its kernels by value).
inline constexpr int kMaxJoinOperands = 64;

// Per-example vectors joined end to end: operand i gives widths[i] floats
// per example.
struct ConcatShape {
  int batch = 0;
  std::vector<int64_t> widths;
  int64_t out_width() const {
    int64_t w = 0;
    for (int64_t x : widths) w += x;
    return w;
  }
};

class Concat {
 public:
  virtual ~Concat() = default;
  // y[n] = xs[0][n] | xs[1][n] | ...: xs[i] is [N, widths[i]], y is
  // [N, out_width()].
  virtual absl::Status Forward(absl::Span<const float* const> xs, float* y) = 0;
  // Operand i's part of dy, written to dxs[i] or, where add[i] is not 0,
  // added to it; a null dxs[i] is not wanted. No two dxs[i] may be equal.
  virtual absl::Status Backward(const float* dy, absl::Span<float* const> dxs,
                                absl::Span<const uint8_t> add) = 0;
};

// DLRM's dot interaction of `features` vectors of `dim` floats per example:
// y[n] = x0[n] followed by dot(x_i[n], x_j[n]) for each pair i > j (i >= j
// with `self`) in the order (1,0), (2,0), (2,1), (3,0), ... (with `self`:
// (0,0), (1,0), (1,1), (2,0), ...).
struct InteractionShape {
  int batch = 0, features = 0, dim = 0;
  bool self = false;
  int64_t pairs() const {
    const int64_t f = features;
    return self ? f * (f + 1) / 2 : f * (f - 1) / 2;
  }
  int64_t out_width() const { return dim + pairs(); }
};

class Interaction {
 public:
  virtual ~Interaction() = default;
  // xs: `features` operands of [N, dim]; y: [N, out_width()].
  virtual absl::Status Forward(absl::Span<const float* const> xs, float* y) = 0;
  // The gradient of each operand, written to dxs[i] or added to it where
  // add[i] is not 0 (null: not wanted), from the forward inputs and dy. No
  // two dxs[i] may be equal (a GPU computes them at once).
  virtual absl::Status Backward(absl::Span<const float* const> xs, const float* dy,
                                absl::Span<float* const> dxs, absl::Span<const uint8_t> add) = 0;
};

// Softmax over `classes` logits per example followed by cross-entropy against
// integer labels, averaged over the batch.
class SoftmaxCrossEntropy {
 public:
  virtual ~SoftmaxCrossEntropy() = default;
  // probs receives the softmax output [N,classes]. labels: [N] int32 in
  // backend memory (a Buffer of N floats holds them), each in [0, classes);
  // callers check the range (a backend may not). stats: 2 floats of backend
  // memory that receive the mean cross-entropy over the batch and the number
  // of examples whose arg-max logit equals the label.
  virtual absl::Status Forward(const float* logits, const int32_t* labels, float* probs,
                               float* stats) = 0;
  // dlogits = (probs - onehot(labels)) / N.
  virtual absl::Status Backward(const float* probs, const int32_t* labels, float* dlogits) = 0;
};

struct EmbeddingPlan;  // kernels/embedding_plan.h

// The sums of a sparse embedding table's rows over bags, for one table of
// `dim` floats a row, on the plan of one batch (kernels/embedding_plan.h).
// rows and row_grads: [plan.unique(), dim], the plan's unique ids in order;
// out and dy: [plan.bags(), dim], bag f * batch + b. Every output row is
// written (zeros where nothing is summed), each by one thread summing in the
// plan's order: no atomics, the same bits every run and at any thread count.
class EmbeddingBag {
 public:
  virtual ~EmbeddingBag() = default;
  // Copies the plan's index arrays into memory of the op's backend, which
  // grows to the largest plan so far and is reused; the calls after it run
  // on this plan. On a GPU the copy is queued on the backend's stream from
  // page-locked memory of the op's (the plan may change once this returns);
  // it waits for the copy of the previous SetPlan, not for the work queued
  // since. Not inside Capture. INVALID_ARGUMENT for an inconsistent plan
  // (CheckEmbeddingPlan), which leaves the previous plan in place; after
  // any other error the op has no plan.
  virtual absl::Status SetPlan(const EmbeddingPlan& plan) = 0;
  // out[g] = sum over bag g's occurrences k of bag_coefs[k] * rows[bag_rows[k]].
  virtual absl::Status Forward(const float* rows, float* out) = 0;
  // row_grads[u] = sum over row u's occurrences k of row_coefs[k] *
  // dy[row_bags[k]] (overwritten): the gradient of Forward's rows.
  virtual absl::Status Backward(const float* dy, float* row_grads) = 0;
  // The sizes of the plan set last (0 before the first SetPlan, when Forward
  // and Backward are FAILED_PRECONDITION).
  virtual int64_t bags() const = 0;
  virtual int64_t unique() const = 0;
};

// A point in a backend's queued work that other queues (a GPU group's
// communication) can wait for: RecordEvent sets it.
class Event {
 public:
  virtual ~Event() = default;
};

// A recorded sequence of backend calls, replayed with the same pointers.
class Graph {
 public:
  virtual ~Graph() = default;
  // Queues one replay; like an op, it may return before the work is done.
  virtual absl::Status Launch() = 0;
};

// A compute device. Creating an op for a shape that the backend cannot run is
// INVALID_ARGUMENT.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // name() and what a log line should say with it (a CPU backend: how many
  // kernel threads it runs).
  virtual std::string Description() const { return name(); }
  // True when buffers of this backend are plain host memory that the caller
  // may read and write directly (so host copies can be skipped).
  virtual bool host_memory() const { return false; }

  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(size_t floats) = 0;
  // Host memory (zero-filled) for staging copies to and from this backend's
  // buffers: page-locked where the backend can, so that a GPU copies it at
  // full speed and without waiting (CopyToDevice from it returns before the
  // copy is done: leave it unchanged until Synchronize, CopyToHost or a
  // finished step says the queued work is over). Plain memory by default.
  virtual absl::StatusOr<std::unique_ptr<Buffer>> AllocateHost(size_t floats);
  // Copies between host memory and a buffer of this backend.
  virtual absl::Status CopyToDevice(const float* host, size_t floats, float* device) = 0;
  virtual absl::Status CopyToHost(const float* device, size_t floats, float* host) = 0;
  // Blocks until all work submitted to this backend has finished.
  virtual absl::Status Synchronize() = 0;
  // Bytes that buffers of this backend may still take, as the system tells it
  // now: host memory for the CPU (see kernels/host_memory.h), the device's
  // free memory for a GPU. UNIMPLEMENTED where a backend cannot tell.
  virtual absl::StatusOr<int64_t> AvailableMemory() {
    return absl::UnimplementedError(name() + " cannot tell its available memory");
  }

  // Elementwise helpers over n floats of backend memory; outputs may alias
  // inputs. y = a + b.
  virtual absl::Status Add(const float* a, const float* b, float* y, int64_t n) = 0;
  // y = x * scale + shift.
  virtual absl::Status Affine(const float* x, float scale, float shift, float* y, int64_t n) = 0;
  // Per channel of an NCHW tensor of n images: y = x * scale[c] + shift[c]
  // over `plane` values of each channel; scale and shift hold `channels`
  // floats of backend memory.
  virtual absl::Status ChannelAffine(const float* x, const float* scale, const float* shift,
                                     float* y, int64_t n, int64_t channels, int64_t plane) = 0;
  // w -= learning_rate * g (plain SGD, for training without parameter servers).
  virtual absl::Status Sgd(float* w, const float* g, float learning_rate, int64_t n) = 0;
  // dst = src, both backend memory.
  virtual absl::Status Copy(const float* src, float* dst, int64_t n) = 0;
  // y = the `n` floats at `x` rounded to 16 bits (bfloat16 with `bf16`,
  // else IEEE half; to nearest even as common/float16.h's encoders: a value
  // the format cannot hold becomes an infinity, NaN stays NaN), both backend
  // memory, queued on the backend's stream (inside Capture too): a GPU
  // worker's gradients, rounded before they cross to the host.
  // UNIMPLEMENTED where the values are host memory already (the CPU: encode
  // them there).
  virtual absl::Status NarrowToHalves(const float* x, int64_t n, bool bf16, uint16_t* y) {
    return absl::UnimplementedError(name() + " has no 16-bit rounding");
  }
  // One optimizer step (kernels/optimizer_math.h, as ps::Optimizer::StepAt
  // makes it) on every tensor of `tensors` (backend memory; see
  // OptimizerTensor): the replicas of a job without ps apply it where the
  // weights live, a whole model in a few launches. Checks every tensor
  // before touching any.
  virtual absl::Status ApplyOptimizer(const OptimizerStep& step,
                                      const std::vector<OptimizerTensor>& tensors) = 0;
  // *count (one float of backend memory) += the number of floats of `xs`
  // (backend memory) that are NaN or infinite.
  virtual absl::Status CountNonFinite(const std::vector<absl::Span<const float>>& xs,
                                      float* count) = 0;
  // *norm (one float of backend memory) = the L2 norm over every float of
  // `xs` (backend memory), summed in double in a fixed order: the same bits
  // for the same values every time, so that replicas that clip their
  // gradients by it (JobConfig.clip_gradient_norm) stay equal; infinite
  // where the norm overflows fp32, NaN or infinite where a value is.
  // `scratch`: kGlobalNormScratch floats of backend memory. UNIMPLEMENTED by
  // default.
  static constexpr int64_t kGlobalNormScratch = 320;
  virtual absl::Status GlobalNorm(const std::vector<absl::Span<const float>>& xs, float* scratch,
                                  float* norm) {
    return absl::UnimplementedError(name() + " has no global norm");
  }

  // Events: CreateEvent makes one; RecordEvent marks the point after the
  // work queued so far on this backend (inside Capture too: each replay of
  // the graph marks it again). UNIMPLEMENTED on backends that run their work
  // at once (the CPU).
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() {
    return absl::UnimplementedError(name() + " has no events");
  }
  virtual absl::Status RecordEvent(Event* event) {
    return absl::UnimplementedError(name() + " has no events");
  }
  // Copies each of `copies` (backend memory to memory from AllocateHost)
  // once the backend has passed `ready` (recorded by RecordEvent, e.g.
  // inside a step's graph), on a stream of the backend's own, and returns at
  // once: the copies overlap the work queued after the event. Queue them
  // after the work that records `ready`. WaitCopies waits until every copy
  // queued so far is done (and reports a failed one). UNIMPLEMENTED on
  // backends without events.
  virtual absl::Status CopyToHostAfter(Event* ready, const std::vector<HostCopy>& copies) {
    return absl::UnimplementedError(name() + " has no events");
  }
  virtual absl::Status WaitCopies() { return absl::UnimplementedError(name() + " has no events"); }
  // Records `done` after every copy CopyToHostAfter has queued so far (on
  // their stream): WaitEvent(done) then returns once those copies are in
  // host memory, while later ones may still run. UNIMPLEMENTED on backends
  // without events.
  virtual absl::Status RecordCopiesDone(Event* done) {
    return absl::UnimplementedError(name() + " has no events");
  }
  // Blocks the calling thread until the work before `event`'s latest record
  // is done. Takes none of the backend's locks: it may wait while another
  // thread is inside a call of this backend (finishing a step). UNIMPLEMENTED
  // on backends without events.
  virtual absl::Status WaitEvent(Event* event) {
    return absl::UnimplementedError(name() + " has no events");
  }
  // What an upload's host memory holds: floats, or 16-bit values (bfloat16
  // or IEEE half) that cross as they are and are widened to floats on the
  // device (exact).
  enum class HostValues { kFloat, kBfloat16, kHalf };
  // One copy of CopyToDeviceAfter: `elements` values at `host` (memory
  // from AllocateHost, or registered through host_pinning) to the floats at
  // `device`, once the backend has passed `after`.
  struct Upload {
    Event* after = nullptr;  // null: no wait
    const void* host = nullptr;
    size_t elements = 0;
    float* device = nullptr;
    // The block of host memory (one allocation, or one region) `host` lies
    // in, as a key: uploads of one block may cross in one copy with the
    // bytes between them. Null: it crosses on its own.
    const void* block = nullptr;
  };
  // Queues each of `uploads` on a stream of uploads of the backend's own
  // and returns at once: unlike CopyToDevice's, each copy waits for its
  // `after` (an event of RecordEvent) alone, not for all the work queued
  // before it (a step's graph may still run while the weights its backward
  // pass has finished with are replaced). The work queued on the backend
  // afterwards does not wait for the copies until JoinUploads; Synchronize
  // does. Leave the host memory unchanged until then (or RecordUploadsDone).
  // One call for many uploads costs less than one call each: host ranges
  // of one block that lie close together cross in one copy, and one kernel places up to
  // 64 of them, once every event of the batch has passed. Thread-safe.
  // Backends that run their work at once just copy floats, and return
  // UNIMPLEMENTED for 16-bit values (the CPU: decode them on the host).
  virtual absl::Status CopyToDeviceAfter(const std::vector<Upload>& uploads, HostValues values) {
    if (values != HostValues::kFloat) {
      return absl::UnimplementedError(name() + " has no copies of 16-bit values");
    }
    for (const Upload& u : uploads) {
      if (u.elements == 0) continue;
      absl::Status s = CopyToDevice(static_cast<const float*>(u.host), u.elements, u.device);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // One upload of `floats` floats alone.
  absl::Status CopyToDeviceAfter(Event* after, const float* host, size_t floats, float* device) {
    return CopyToDeviceAfter({{after, host, floats, device}}, HostValues::kFloat);
  }
  // The work queued on this backend from now on waits for every copy that
  // CopyToDeviceAfter has queued so far. Nothing to do where copies run at once.
  virtual absl::Status JoinUploads() { return absl::OkStatus(); }
  // Records `done` after every copy CopyToDeviceAfter has queued so far (on
  // their stream): WaitEvent(done) then returns once their host memory may
  // change. UNIMPLEMENTED on backends without events.
  virtual absl::Status RecordUploadsDone(Event* done) {
    return absl::UnimplementedError(name() + " has no events");
  }
  // Registration of host memory this backend did not allocate (a shared
  // region) for its copies, page-locked as AllocateHost's: `pin(data,
  // bytes)` returns whether it registered the memory, `unpin(data)` undoes
  // it before the memory goes. Both are callable from any thread for as long
  // as the process runs (they hold nothing of the backend). Empty where the
  // backend has nothing to register.
  struct HostPinning {
    std::function<bool(void*, size_t)> pin;
    std::function<void(void*)> unpin;
  };
  virtual HostPinning host_pinning() const { return {}; }

  // Records the backend calls `work` makes (ops of this backend, the helpers
  // above; no copies to or from the host) into a Graph without running them.
  // Ops must have run once before, so that their workspaces exist. Backends
  // without graphs return UNIMPLEMENTED.
  virtual absl::StatusOr<std::unique_ptr<Graph>> Capture(
      const std::function<absl::Status()>& work) {
    return absl::UnimplementedError(name() + " cannot record graphs");
  }

  virtual absl::StatusOr<std::unique_ptr<Conv2D>> CreateConv2D(const Conv2DShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<MaxPool2D>> CreateMaxPool2D(const Pool2DShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<Relu>> CreateRelu(int64_t size) = 0;
  virtual absl::StatusOr<std::unique_ptr<Dense>> CreateDense(const DenseShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<SoftmaxCrossEntropy>> CreateSoftmaxCrossEntropy(
      int batch, int classes) = 0;
  virtual absl::StatusOr<std::unique_ptr<BatchNorm>> CreateBatchNorm(
      const BatchNormShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<GlobalAvgPool>> CreateGlobalAvgPool(
      const GlobalAvgPoolShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<Concat>> CreateConcat(const ConcatShape& shape) = 0;
  virtual absl::StatusOr<std::unique_ptr<Interaction>> CreateInteraction(
      const InteractionShape& shape) = 0;
  // dim: the floats of a row (> 0).
  virtual absl::StatusOr<std::unique_ptr<EmbeddingBag>> CreateEmbeddingBag(int64_t dim) = 0;
};

// Creates the backend for a device name: "cpu" (oneDNN), or "cuda:N" (cuDNN
// and cuBLAS on GPU N; "cuda" is cuda:0) in builds with CUDA. Unknown devices
// are INVALID_ARGUMENT; a device this machine lacks is UNAVAILABLE; both with
// a message. `threads` > 0 caps the CPU threads the calling thread's kernels
// use (the CPU backend's OpenMP team); 0 keeps the library default (all
// cores). GPU backends ignore it.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& device, int threads = 0);

// The devices a device list names: "cuda:all" (every GPU this process sees,
// in order; UNAVAILABLE when it sees none or the build has no CUDA backend),
// or comma-separated names ("cuda:0,cuda:1"; any single name, "cpu"
// included, is a list of one). INVALID_ARGUMENT for an empty entry or a GPU
// named twice. Names are not checked against the machine here
// (CreateBackend does).
absl::StatusOr<std::vector<std::string>> ExpandDevices(const std::string& list);

// Replicas of one model on several GPUs of this process, each computing on
// its own backend (stream): their buffers are reduced and copied among the
// GPUs directly (NCCL: NVLink or PCIe peer-to-peer), never through the host.
// Each call queues its work on every replica's stream after the work queued
// there before, and returns; it must not run while another thread queues
// work on those backends.
class DeviceGroup {
 public:
  virtual ~DeviceGroup() = default;
  // For each i: replaces the sizes[i] floats at buffers[r][i] of every
  // replica r with their mean over the replicas.
  virtual absl::Status AllReduceMean(const std::vector<std::vector<float*>>& buffers,
                                     const std::vector<int64_t>& sizes) = 0;
  // For each i: copies replica 0's buffers[0][i] (sizes[i] floats) into
  // buffers[r][i] of every other replica r.
  virtual absl::Status Broadcast(const std::vector<std::vector<float*>>& buffers,
                                 const std::vector<int64_t>& sizes) = 0;
};

// A group over `backends` (CUDA backends of distinct GPUs, at least two).
// UNIMPLEMENTED in a build without the CUDA backend; INVALID_ARGUMENT for
// other backends; INTERNAL when NCCL cannot set up its communicators.
absl::StatusOr<std::unique_ptr<DeviceGroup>> CreateDeviceGroup(
    const std::vector<Backend*>& backends);

// The GPUs of several processes (one GPU each: a worker's first replica),
// reducing device buffers among themselves: the workers of a job without ps
// (JobConfig.exchange ALL_REDUCE). On NCCL; its own transports (NVLink,
// PCIe, sockets) carry the data, and psflow's all-reduce ring carries the
// group's id (PeerGroupId) from member 0 to the others.
class PeerGroup {
 public:
  virtual ~PeerGroup() = default;
  // For each i: replaces the sizes[i] floats at buffers[i] (device memory of
  // this member's backend) with their mean over the members, queued on the
  // backend's stream after the work queued there before, and waits until it
  // is done. Every member calls it with the same sizes, in the same order.
  // A member that fails or dies must not leave the others waiting on their
  // GPUs: the wait ends UNAVAILABLE when the group reports a member's
  // failure, DEADLINE_EXCEEDED at `deadline`, CANCELLED once `abandon()` is
  // true (looked at every few microseconds); each aborts the group, and
  // every later call fails.
  virtual absl::Status AllReduceMean(const std::vector<float*>& buffers,
                                     const std::vector<int64_t>& sizes, absl::Time deadline,
                                     const std::function<bool()>& abandon) = 0;
  // The same means (in the group's WireDtype, given to JoinPeerGroup),
  // overlapped with the work that produces them: for each
  // bucket in turn, on a stream of the group's own, once the backend has
  // passed the bucket's event (recorded by the caller, e.g. inside the
  // step's graph), its buffers are averaged. Returns once the means are
  // queued, without waiting for them (nor making the backend's stream wait:
  // a member that dies must not leave this one blocked on its GPU). The
  // next AllReduceMean comes after them, orders the backend's later work
  // after them, and waits for them (ending as its wait does when a member
  // fails); call it before using the means. Every member queues the same
  // buckets in the same order.
  struct Bucket {
    Event* ready = nullptr;
    std::vector<float*> buffers;
    std::vector<int64_t> sizes;
  };
  virtual absl::Status QueueAllReduceMeans(const std::vector<Bucket>& buckets, absl::Time deadline,
                                           const std::function<bool()>& abandon) = 0;
};

// The dtype a group's QueueAllReduceMeans sends its buckets in: fp32 as
// they are, or each float rounded to nearest-even into bfloat16 or IEEE half
// (a value half cannot hold becomes an infinity) and averaged in that dtype,
// the mean written back as fp32. Every member gets the same bits.
// AllReduceMean stays fp32.
enum class WireDtype { kFloat32, kBfloat16, kFloat16 };

// The bytes of a group's id.
inline constexpr size_t kPeerGroupIdBytes = 128;
// A new group's id (kPeerGroupIdBytes to hand to every member), made by
// member 0.
// UNIMPLEMENTED in a build without the CUDA backend.
absl::StatusOr<std::string> NewPeerGroupId();
// This process's membership, as member `rank` of `size`, with its GPU
// `backend` (a CUDA backend, outliving the group); `wire` is the dtype its
// QueueAllReduceMeans averages in (every member gives the same). Waits
// until every member has joined, ending as AllReduceMean's wait does
// (`deadline`, `abandon`).
// INVALID_ARGUMENT for another backend or an id that is not one; INTERNAL
// when NCCL fails; UNIMPLEMENTED without the CUDA backend.
absl::StatusOr<std::unique_ptr<PeerGroup>> JoinPeerGroup(Backend* backend, const std::string& id,
                                                         int rank, int size, WireDtype wire,
                                                         absl::Time deadline,
                                                         const std::function<bool()>& abandon);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_KERNELS_H_
