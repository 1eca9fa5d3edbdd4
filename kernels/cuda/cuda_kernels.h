// psflow's own CUDA kernels, for the parts of kernels.h that cuDNN and cuBLAS
// do not cover. Plain launchers: each queues its kernel(s) on `stream` and
// returns cudaGetLastError() (the launch status; an error during execution
// surfaces at the next synchronizing call). They do not set the device: the
// caller (CudaBackend) has made the stream's device current.
//
// Counts are in floats; n <= 0 (or an empty shape) launches nothing. Pointers
// are device memory. Elementwise kernels allow an output to alias an input
// exactly (each element is read before it is written by the same thread).
#ifndef PSFLOW_KERNELS_CUDA_CUDA_KERNELS_H_
#define PSFLOW_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/optimizer_math.h"

namespace psflow::kernels::cuda_internal {

// y = a + b.
cudaError_t LaunchAdd(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream);

// y = x * scale + shift.
cudaError_t LaunchAffine(const float* x, float scale, float shift, float* y, int64_t n,
                         cudaStream_t stream);

// y = x * scale[c] + shift[c] per channel of an NCHW tensor (n, channels, hw).
cudaError_t LaunchChannelAffine(const float* x, const float* scale, const float* shift, float* y,
                                int64_t n, int64_t channels, int64_t hw, cudaStream_t stream);

// w -= learning_rate * g.
cudaError_t LaunchSgd(float* w, const float* g, float learning_rate, int64_t n,
                      cudaStream_t stream);

// One tensor of an optimizer step: n weights w, gradients g and the rule's
// slots s0, s1 (unused ones may be null).
struct OptimizerArgs {
  float* w;
  const float* g;
  float* s0;
  float* s1;
  int64_t n;
};

// One optimizer step (kernels/optimizer_math.h's ApplyElement) on each of
// the `count` tensors of `tensors` (a host array): one launch per
// kMaxTensorsPerLaunch of them, the tensors passed as kernel arguments.
inline constexpr int kMaxTensorsPerLaunch = 48;
cudaError_t LaunchApplyOptimizer(const OptimizerStep& step, const OptimizerArgs* tensors, int count,
                                 cudaStream_t stream);

// *count += the number of values that are NaN or infinite among the n[i]
// floats at x[i] for each i < num (host arrays), in launches of up to
// kMaxTensorsPerLaunch.
cudaError_t LaunchCountNonFinite(const float* const* x, const int64_t* n, int num, float* count,
                                 cudaStream_t stream);

// *norm = the L2 norm over the n[i] floats at x[i] for each i < num (host
// arrays): each block of a fixed grid of kGlobalNormBlocks sums its squares
// in double into its own element of `partial` (device memory, zeroed here),
// one launch per array in order, then one thread sums the blocks in order.
// No atomics: the same bits for the same values every time.
inline constexpr int kGlobalNormBlocks = 160;
cudaError_t LaunchGlobalNorm(const float* const* x, const int64_t* n, int num, double* partial,
                             float* norm, cudaStream_t stream);

// One float buffer of a run packed into (or unpacked from) a 16-bit wire
// buffer: `count` floats at `data`, at element `offset` of the wire buffer.
struct WirePiece {
  float* data;
  int64_t offset;
  int64_t count;
};

// For each of the `pieces` (an array in device memory) the floats rounded to
// nearest-even into the wire buffer as bfloat16 (`bf16`) or IEEE half; NaN
// stays NaN, a value the dtype cannot hold becomes an infinity.
// `max_count` is the largest piece's count (it sizes the grid).
cudaError_t LaunchPackToWire(const WirePiece* pieces, int num_pieces, int64_t max_count, bool bf16,
                             void* wire, cudaStream_t stream);
// The reverse: each piece's floats from the wire buffer (exact).
cudaError_t LaunchUnpackFromWire(const WirePiece* pieces, int num_pieces, int64_t max_count,
                                 bool bf16, const void* wire, cudaStream_t stream);

// Up to kMaxUploadPieces uploaded runs of values placed in one launch, the
// table passed by value (no copy of it to the device first): piece k's
// count[k] values at src[k] (device memory: floats, or 16-bit values that
// are widened) to the floats at dst[k].
inline constexpr int kMaxUploadPieces = 64;
enum class PieceValues { kFloat, kBfloat16, kHalf };
struct UploadPieces {
  const void* src[kMaxUploadPieces];
  float* dst[kMaxUploadPieces];
  int64_t count[kMaxUploadPieces];
};
// Pieces [0, num) of `pieces`; `max_count` is the largest count (it sizes
// the grid).
cudaError_t LaunchUploadPieces(const UploadPieces& pieces, int num, int64_t max_count,
                               PieceValues values, cudaStream_t stream);

// The `n` floats at `in` rounded to nearest-even into `out` as bfloat16
// (`bf16`) or IEEE half, as LaunchPackToWire rounds them.
cudaError_t LaunchNarrowFromFloat(const float* in, bool bf16, void* out, int64_t n,
                                  cudaStream_t stream);

// y[r, c] += b[c] for a row-major y of rows x cols (a bias broadcast over rows).
cudaError_t LaunchAddRowBias(float* y, const float* b, int64_t rows, int64_t cols,
                             cudaStream_t stream);

// y[r] = mean of x[r, 0..hw) for a row-major x of rows x hw (rows = N*C of an
// NCHW tensor, hw = H*W).
cudaError_t LaunchGlobalAvgPoolForward(const float* x, float* y, int64_t rows, int64_t hw,
                                       cudaStream_t stream);

// dx[r, i] = dy[r] / hw.
cudaError_t LaunchGlobalAvgPoolBackward(const float* dy, float* dx, int64_t rows, int64_t hw,
                                        cudaStream_t stream);

// dst[i, :] = sum over k in [offsets[i], offsets[i+1]) of coefs[k] *
// src[index[k], :] for the n rows of dim floats of dst (int32 CSR arrays in
// device memory): both directions of EmbeddingBag. One warp per row, each
// lane its columns, summing in k order: every row written (zeros for an
// empty one), no atomics, the same bits every run.
cudaError_t LaunchGatherSum(const int32_t* offsets, const int32_t* index, const float* coefs,
                            const float* src, int64_t dim, int64_t n, float* dst,
                            cudaStream_t stream);

// Softmax + cross-entropy over `batch` rows of `classes` logits.
// probs[i, :] = softmax(logits[i, :]); per example the loss
// logsumexp(logits[i, :]) - logits[i, labels[i]] and whether the first arg-max
// equals the label go to scratch[i] and scratch[batch + i] (so scratch holds
// 2 * batch floats); then one block reduces them in a fixed order into
// stats[0] = mean loss, stats[1] = number correct. A label outside
// [0, classes) is never used as an index: its example's loss is NaN (so the
// mean is NaN, visibly) and it counts as incorrect.
cudaError_t LaunchSoftmaxCrossEntropyForward(const float* logits, const int32_t* labels,
                                             float* probs, float* scratch, float* stats, int batch,
                                             int classes, cudaStream_t stream);

// dlogits[i, j] = (probs[i, j] - (j == labels[i])) / batch. A row whose label
// is out of range gets probs / batch (no one-hot term).
cudaError_t LaunchSoftmaxCrossEntropyBackward(const float* probs, const int32_t* labels,
                                              float* dlogits, int batch, int classes,
                                              cudaStream_t stream);

// Per-channel work on NCHW tensors [n, channels, hw] (hw = H*W). Each first
// reduces per channel in two fixed-order stages (channel x batch-slice blocks
// write partial sums to `partial`, then one block per channel adds them), so
// the results are reproducible; `partial` must hold
// ChannelPartialFloats(n, channels) floats.
int64_t ChannelPartialFloats(int64_t n, int64_t channels);

// db[c] = sum over n and hw of dy (a convolution's bias gradient).
cudaError_t LaunchChannelSum(const float* dy, float* db, float* partial, int64_t n,
                             int64_t channels, int64_t hw, cudaStream_t stream);

// Batch normalization with batch statistics: mean[c] and inv_std[c] =
// 1/sqrt(var + epsilon) (biased variance, computed around a per-channel shift
// to avoid cancellation) are kept in `saved` [mean | inv_std], then
// y = (x - mean) * inv_std * gamma + beta. `coef` holds 2*channels floats of
// scratch (the per-channel scale and shift of y = x * scale + shift).
// batch_mean and batch_var, unless null, receive the mean and the unbiased
// variance (times M/(M-1), M = n*hw; the biased one when M = 1).
cudaError_t LaunchBatchNormForward(const float* x, const float* gamma, const float* beta, float* y,
                                   float* saved, float* coef, float* partial, float* batch_mean,
                                   float* batch_var, int64_t n, int64_t channels, int64_t hw,
                                   float epsilon, cudaStream_t stream);

// Batch normalization with given statistics (inference):
// y = (x - mean) / sqrt(var + epsilon) * gamma + beta, through the
// per-channel scale and shift in `coef` (2*channels floats of scratch).
cudaError_t LaunchBatchNormInference(const float* x, const float* gamma, const float* beta,
                                     const float* mean, const float* var, float* y, float* coef,
                                     int64_t n, int64_t channels, int64_t hw, float epsilon,
                                     cudaStream_t stream);

// The gradients for the Forward that filled `saved`: dbeta = sum dy, dgamma =
// sum dy * xhat, dx = gamma * inv_std * (dy - dbeta/M - xhat * dgamma/M),
// M = n*hw. `coef` holds 3*channels floats of scratch.
cudaError_t LaunchBatchNormBackward(const float* x, const float* gamma, const float* dy, float* dx,
                                    float* dgamma, float* dbeta, const float* saved, float* coef,
                                    float* partial, int64_t n, int64_t channels, int64_t hw,
                                    cudaStream_t stream);

// The operands of a concat or interaction, passed to the kernels by value
// (at most kJoinOperands: kernels::kMaxJoinOperands).
inline constexpr int kJoinOperands = 64;
struct JoinOperands {
  const float* x[kJoinOperands];
  float* dx[kJoinOperands];       // null: not wanted
  int64_t offset[kJoinOperands];  // concat: the operand's first column in y
  int64_t width[kJoinOperands];   // concat: its floats per example
  uint8_t add[kJoinOperands];     // add to dx instead of writing it
  int n;
};

// y[e] = x[0][e] | x[1][e] | ... for `batch` examples of `out` floats.
cudaError_t LaunchConcatForward(const JoinOperands& ops, float* y, int64_t batch, int64_t out,
                                cudaStream_t stream);
// Each operand's part of dy into (or, with add, onto) its dx.
cudaError_t LaunchConcatBackward(const JoinOperands& ops, const float* dy, int64_t batch,
                                 int64_t out, cudaStream_t stream);
// DLRM's dot interaction of ops.n vectors of `dim` floats per example (see
// kernels::InteractionShape): y is [batch, dim + pairs].
cudaError_t LaunchInteractionForward(const JoinOperands& ops, float* y, int64_t batch, int dim,
                                     bool self, cudaStream_t stream);
cudaError_t LaunchInteractionBackward(const JoinOperands& ops, const float* dy, int64_t batch,
                                      int dim, bool self, cudaStream_t stream);

}  // namespace psflow::kernels::cuda_internal

#endif  // PSFLOW_KERNELS_CUDA_CUDA_KERNELS_H_
