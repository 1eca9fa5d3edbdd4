// psflow's own CUDA kernels; see cuda_kernels.h for the contract.
//
// Every kernel loops grid-stride (elementwise) or warp-stride (one warp per
// row), so the grid can be capped and any size is covered. Reductions run in a
// fixed order (warp butterflies, then a fixed tree), so results are bitwise
// reproducible from run to run.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_kernels.h"

namespace psflow::kernels::cuda_internal {
namespace {

constexpr int kThreads = 256;  // threads per block
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr int64_t kMaxBlocks = 4096;  // grid cap; loops cover the rest
constexpr unsigned kFullMask = 0xffffffffu;

int BlocksFor(int64_t work_items, int64_t items_per_block) {
  return static_cast<int>(
      std::min<int64_t>((work_items + items_per_block - 1) / items_per_block, kMaxBlocks));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__device__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ int64_t GridThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------- elementwise

// y[i] = f(a[i], b[i]); a unary op ignores b (passed as a).
template <typename F>
__global__ void Map2Kernel(const float* a, const float* b, float* y, int64_t n, F f) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) y[i] = f(a[i], b[i]);
}

// The same over float4 (n4 = n / 4), for 16-byte aligned pointers.
template <typename F>
__global__ void Map2Kernel4(const float4* a, const float4* b, float4* y, int64_t n4, F f) {
  for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
    const float4 va = a[i], vb = b[i];
    y[i] = make_float4(f(va.x, vb.x), f(va.y, vb.y), f(va.z, vb.z), f(va.w, vb.w));
  }
}

template <typename F>
cudaError_t LaunchMap2(const float* a, const float* b, float* y, int64_t n, F f,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (n % 4 == 0 && Aligned16(a) && Aligned16(b) && Aligned16(y)) {
    const int64_t n4 = n / 4;
    Map2Kernel4<<<BlocksFor(n4, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(a), reinterpret_cast<const float4*>(b),
        reinterpret_cast<float4*>(y), n4, f);
  } else {
    Map2Kernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(a, b, y, n, f);
  }
  return cudaGetLastError();
}

struct AddFn {
  __device__ float operator()(float a, float b) const { return a + b; }
};

struct AffineFn {
  float scale, shift;
  __device__ float operator()(float x, float) const { return x * scale + shift; }
};

struct SgdFn {
  float learning_rate;
  __device__ float operator()(float w, float g) const { return w - learning_rate * g; }
};

// Tensors of one launch, passed by value as the kernel's argument.
struct OptimizerChunk {
  OptimizerArgs t[kMaxTensorsPerLaunch];
};
struct CountChunk {
  const float* x[kMaxTensorsPerLaunch];
  int64_t n[kMaxTensorsPerLaunch];
};
// Within the 4 KB of kernel arguments every CUDA version takes.
static_assert(sizeof(OptimizerStep) + sizeof(OptimizerChunk) <= 4096);
static_assert(sizeof(CountChunk) + sizeof(float*) <= 4096);

// blockIdx.y picks the tensor; the x blocks stride over its elements.
__device__ int64_t ChunkThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ int64_t ChunkThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void ApplyOptimizerKernel(OptimizerStep step, OptimizerChunk chunk) {
  const OptimizerArgs& a = chunk.t[blockIdx.y];
  float unused0 = 0, unused1 = 0;
  for (int64_t i = ChunkThread(); i < a.n; i += ChunkThreads()) {
    float wi = a.w[i];
    float& s0 = a.s0 != nullptr ? a.s0[i] : unused0;
    float& s1 = a.s1 != nullptr ? a.s1[i] : unused1;
    ApplyElement(step, wi, a.g[i], s0, s1);
    a.w[i] = wi;
  }
}

__global__ void CountNonFiniteKernel(CountChunk chunk, float* count) {
  const float* x = chunk.x[blockIdx.y];
  const int64_t n = chunk.n[blockIdx.y];
  unsigned bad = 0;
  for (int64_t i = ChunkThread(); i < n; i += ChunkThreads()) bad += isfinite(x[i]) ? 0u : 1u;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    bad += __shfl_xor_sync(kFullMask, bad, offset);
  }
  if (threadIdx.x % kWarpSize == 0 && bad > 0) atomicAdd(count, static_cast<float>(bad));
}

__global__ void AddRowBiasKernel(float* y, const float* b, int64_t n, int64_t cols) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) y[i] += b[i % cols];
}

// ---------------------------------------------------------------- warp helpers

__device__ float WarpSum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;  // the same in every lane (a + b == b + a bitwise)
}

// Arg-max over the warp: the larger value wins, equal values go to the
// smaller index (so the result is the first maximum, like std::max_element).
__device__ void WarpArgMax(float& value, int& index) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other_value = __shfl_xor_sync(kFullMask, value, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

__device__ int64_t GlobalWarp() { return GlobalThread() / kWarpSize; }
__device__ int64_t GridWarps() { return GridThreads() / kWarpSize; }
__device__ int Lane() { return static_cast<int>(threadIdx.x % kWarpSize); }

// ---------------------------------------------------------------- global average pooling

// One warp per row; the loop bound is the same for all lanes of a warp, so
// every lane reaches the shuffles.
__global__ void GlobalAvgPoolForwardKernel(const float* x, float* y, int64_t rows, int64_t hw) {
  const int lane = Lane();
  for (int64_t row = GlobalWarp(); row < rows; row += GridWarps()) {
    const float* in = x + row * hw;
    float sum = 0.0f;
    for (int64_t j = lane; j < hw; j += kWarpSize) sum += in[j];
    sum = WarpSum(sum);
    if (lane == 0) y[row] = sum / static_cast<float>(hw);
  }
}

__global__ void GlobalAvgPoolBackwardKernel(const float* dy, float* dx, int64_t n, int64_t hw) {
  const float inv = 1.0f / static_cast<float>(hw);
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dx[i] = dy[i / hw] * inv;
}

// ---------------------------------------------------------------- embedding bags

__global__ void GatherSumKernel(const int32_t* offsets, const int32_t* index, const float* coefs,
                                const float* src, int64_t dim, int64_t n, float* dst) {
  const int lane = Lane();
  for (int64_t row = GlobalWarp(); row < n; row += GridWarps()) {
    const int32_t begin = offsets[row], end = offsets[row + 1];
    float* out = dst + row * dim;
    for (int64_t j = lane; j < dim; j += kWarpSize) {
      float sum = 0.0f;
      for (int32_t k = begin; k < end; ++k) sum += coefs[k] * src[index[k] * dim + j];
      out[j] = sum;
    }
  }
}

// ---------------------------------------------------------------- softmax cross-entropy

// One warp per example: max and first arg-max, sum of exp(x - max), then the
// probabilities, the example's loss and whether it is classified correctly.
__global__ void SoftmaxCrossEntropyRowsKernel(const float* logits, const int32_t* labels,
                                              float* probs, float* loss, float* correct, int batch,
                                              int classes) {
  const int lane = Lane();
  for (int64_t row = GlobalWarp(); row < batch; row += GridWarps()) {
    const float* x = logits + row * classes;
    float* p = probs + row * classes;

    // A lane without any element keeps (-inf, INT_MAX), which loses every
    // comparison, ties with a -inf logit included.
    float best = -INFINITY;
    int best_index = INT_MAX;
    for (int j = lane; j < classes; j += kWarpSize) {
      const float v = x[j];
      if (best_index == INT_MAX || v > best) {  // strict: the first maximum of this lane
        best = v;
        best_index = j;
      }
    }
    WarpArgMax(best, best_index);  // every lane now holds the row's max (a NaN logit
                                   // makes the probabilities and the loss NaN anyway)
    const float max = best;

    float sum = 0.0f;
    for (int j = lane; j < classes; j += kWarpSize) sum += expf(x[j] - max);
    sum = WarpSum(sum);
    const float inv_sum = 1.0f / sum;
    for (int j = lane; j < classes; j += kWarpSize) p[j] = expf(x[j] - max) * inv_sum;

    if (lane == 0) {
      const int32_t label = labels[row];
      if (label >= 0 && label < classes) {
        // log-sum-exp minus the label's logit: exact even where a probability
        // underflows to 0.
        loss[row] = max + logf(sum) - x[label];
        correct[row] = best_index == label ? 1.0f : 0.0f;
      } else {
        loss[row] = NAN;  // out-of-range label: visible in the mean loss
        correct[row] = 0.0f;
      }
    }
  }
}

// One block: thread t sums elements t, t + kThreads, ... in order, then a
// fixed tree adds the partial sums. Loss in double, the count exactly.
__global__ void SoftmaxCrossEntropyStatsKernel(const float* loss, const float* correct,
                                               float* stats, int batch) {
  __shared__ double loss_sum[kThreads];
  __shared__ int correct_sum[kThreads];
  const int t = threadIdx.x;
  double l = 0.0;
  int c = 0;
  for (int i = t; i < batch; i += kThreads) {
    l += loss[i];
    c += correct[i] != 0.0f ? 1 : 0;
  }
  loss_sum[t] = l;
  correct_sum[t] = c;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (t < half) {
      loss_sum[t] += loss_sum[t + half];
      correct_sum[t] += correct_sum[t + half];
    }
    __syncthreads();
  }
  if (t == 0) {
    stats[0] = static_cast<float>(loss_sum[0] / batch);
    stats[1] = static_cast<float>(correct_sum[0]);
  }
}

__global__ void SoftmaxCrossEntropyBackwardKernel(const float* probs, const int32_t* labels,
                                                  float* dlogits, int64_t n, int classes,
                                                  float scale) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t row = i / classes;
    const int j = static_cast<int>(i - row * classes);
    const float onehot = labels[row] == j ? 1.0f : 0.0f;  // never true out of range
    dlogits[i] = (probs[i] - onehot) * scale;
  }
}

// ---------------------------------------------------------------- per-channel reductions

// Blocks per channel: enough channel x slice blocks to fill the GPU a few
// times over, never more slices than images.
constexpr int64_t kTargetBlocks = 1024;

int64_t SlicesFor(int64_t n, int64_t channels) {
  return std::max<int64_t>(1, std::min<int64_t>(n, (kTargetBlocks + channels - 1) / channels));
}

// Sums two values over a block; the result is valid in thread 0.
__device__ void BlockSum2(float& a, float& b) {
  __shared__ float sa[kWarpsPerBlock], sb[kWarpsPerBlock];
  a = WarpSum(a);
  b = WarpSum(b);
  const int warp = threadIdx.x / kWarpSize;
  if (Lane() == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = 0.0f;
    b = 0.0f;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      a += sa[w];
      b += sb[w];
    }
  }
}

// Per channel c (blockIdx.y) and slice of images (blockIdx.x): two sums
// over the slice's values of channel c, f(x, y, c) giving both terms.
// partial[(c * slices + slice) * 2 + {0, 1}].
// Index: uint32_t when the whole tensor has fewer than 2^31 values (the
// divisions below then cost a few instructions instead of a 64-bit routine).
template <typename Index, typename F>
__global__ void ChannelPartialKernel(const float* x, const float* y, float* partial, int64_t n,
                                     int64_t channels, int64_t hw, F f) {
  const int64_t c = blockIdx.y, slices = gridDim.x, slice = blockIdx.x;
  const int64_t first = slice * n / slices, last = (slice + 1) * n / slices;
  const Index count = static_cast<Index>((last - first) * hw), hw_i = static_cast<Index>(hw);
  const int64_t base = (first * channels + c) * hw, image_stride = channels * hw;
  float a = 0.0f, b = 0.0f;
  for (Index i = threadIdx.x; i < count; i += blockDim.x) {
    const Index img = i / hw_i;
    const int64_t at = base + static_cast<int64_t>(img) * image_stride + (i - img * hw_i);
    const float2 v = f(x[at], y == nullptr ? 0.0f : y[at], c);
    a += v.x;
    b += v.y;
  }
  BlockSum2(a, b);
  if (threadIdx.x == 0) {
    partial[(c * slices + slice) * 2] = a;
    partial[(c * slices + slice) * 2 + 1] = b;
  }
}

// Adds a channel's partial sums in double, in slice order: out[c] = {a, b}.
__device__ void ChannelTotals(const float* partial, int64_t slices, int64_t c, double& a,
                              double& b) {
  a = 0.0;
  b = 0.0;
  for (int64_t s = 0; s < slices; ++s) {
    a += partial[(c * slices + s) * 2];
    b += partial[(c * slices + s) * 2 + 1];
  }
}

struct SumFn {
  __device__ float2 operator()(float v, float, int64_t) const { return make_float2(v, 0.0f); }
};

__global__ void ChannelSumFinishKernel(const float* partial, float* out, int64_t channels,
                                       int64_t slices) {
  for (int64_t c = GlobalThread(); c < channels; c += GridThreads()) {
    double a, b;
    ChannelTotals(partial, slices, c, a, b);
    out[c] = static_cast<float>(a);
  }
}

// Sums of (x - shift) and its square, shift being the channel's first value
// (so that a large mean does not cancel the variance away).
struct ShiftedMomentsFn {
  const float* x;
  int64_t hw;
  __device__ float2 operator()(float v, float, int64_t c) const {
    const float d = v - x[c * hw];
    return make_float2(d, d * d);
  }
};

// saved = [mean | inv_std]; coef = [scale | shift] for y = x * scale + shift;
// batch_mean and batch_var (unless null) the mean and unbiased variance.
__global__ void BatchNormStatsKernel(const float* x, const float* gamma, const float* beta,
                                     const float* partial, float* saved, float* coef,
                                     float* batch_mean, float* batch_var, int64_t channels,
                                     int64_t slices, int64_t hw, double count, float epsilon) {
  for (int64_t c = GlobalThread(); c < channels; c += GridThreads()) {
    double s1, s2;
    ChannelTotals(partial, slices, c, s1, s2);
    const double shifted_mean = s1 / count;
    const double var = fmax(s2 / count - shifted_mean * shifted_mean, 0.0);
    const double mean = shifted_mean + x[c * hw];
    const double inv_std = rsqrt(var + epsilon);
    saved[c] = static_cast<float>(mean);
    saved[channels + c] = static_cast<float>(inv_std);
    const double scale = gamma[c] * inv_std;
    coef[c] = static_cast<float>(scale);
    coef[channels + c] = static_cast<float>(beta[c] - mean * scale);
    if (batch_mean != nullptr) batch_mean[c] = static_cast<float>(mean);
    if (batch_var != nullptr) {
      batch_var[c] = static_cast<float>(count > 1 ? var * count / (count - 1) : var);
    }
  }
}

// coef = [scale | shift] from given statistics.
__global__ void BatchNormInferenceCoefKernel(const float* gamma, const float* beta,
                                             const float* mean, const float* var, float* coef,
                                             int64_t channels, float epsilon) {
  for (int64_t c = GlobalThread(); c < channels; c += GridThreads()) {
    const double scale = gamma[c] * rsqrt(static_cast<double>(var[c]) + epsilon);
    coef[c] = static_cast<float>(scale);
    coef[channels + c] = static_cast<float>(beta[c] - mean[c] * scale);
  }
}

// y = a[c] * x + b[c] * z + d[c] over an NCHW tensor (z may be null: b unused).
template <typename Index>
__global__ void ChannelAffineKernel(const float* x, const float* z, float* y, const float* a,
                                    const float* b, const float* d, int64_t total, int64_t channels,
                                    int64_t hw) {
  const Index hw_i = static_cast<Index>(hw), channels_i = static_cast<Index>(channels);
  for (Index i = static_cast<Index>(GlobalThread()); i < static_cast<Index>(total);
       i += static_cast<Index>(GridThreads())) {
    const Index c = (i / hw_i) % channels_i;
    float v = a[c] * x[i] + d[c];
    if (z != nullptr) v += b[c] * z[i];
    y[i] = v;
  }
}

// Sums of dy and dy * (x - mean).
struct BackwardSumsFn {
  const float* saved;
  __device__ float2 operator()(float dy, float x, int64_t c) const {
    return make_float2(dy, dy * (x - saved[c]));
  }
};

// dgamma, dbeta, and dx = a*dy + b*x + d per channel into coef [a | b | d].
__global__ void BatchNormBackwardCoefKernel(const float* gamma, const float* saved,
                                            const float* partial, float* dgamma, float* dbeta,
                                            float* coef, int64_t channels, int64_t slices,
                                            double count) {
  for (int64_t c = GlobalThread(); c < channels; c += GridThreads()) {
    double sum_dy, sum_dy_xc;
    ChannelTotals(partial, slices, c, sum_dy, sum_dy_xc);
    const double mean = saved[c], inv_std = saved[channels + c];
    const double dg = sum_dy_xc * inv_std;  // sum dy * xhat
    dgamma[c] = static_cast<float>(dg);
    dbeta[c] = static_cast<float>(sum_dy);
    const double k = gamma[c] * inv_std;
    // dx = k * (dy - sum_dy/M - (x - mean) * inv_std * dg/M)
    const double b = -k * inv_std * dg / count;
    coef[c] = static_cast<float>(k);
    coef[channels + c] = static_cast<float>(b);
    coef[2 * channels + c] = static_cast<float>(-k * sum_dy / count - b * mean);
  }
}
}  // namespace

cudaError_t LaunchAdd(const float* a, const float* b, float* y, int64_t n, cudaStream_t stream) {
  return LaunchMap2(a, b, y, n, AddFn{}, stream);
}

cudaError_t LaunchAffine(const float* x, float scale, float shift, float* y, int64_t n,
                         cudaStream_t stream) {
  return LaunchMap2(x, x, y, n, AffineFn{scale, shift}, stream);
}

cudaError_t LaunchSgd(float* w, const float* g, float learning_rate, int64_t n,
                      cudaStream_t stream) {
  return LaunchMap2(w, g, w, n, SgdFn{learning_rate}, stream);
}

namespace {

// The blocks along x of a chunk's grid: enough for its largest tensor, at
// most 512 (the y blocks of the small tensors end at once).
constexpr int64_t kMaxChunkBlocks = 512;

// A launch over `tensors` tensors (blockIdx.y) of at most `largest` elements.
dim3 ChunkGrid(int64_t largest, int tensors) {
  const int64_t blocks = std::min<int64_t>(BlocksFor(largest, kThreads), kMaxChunkBlocks);
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(tensors));
}

// The launches over `count` tensors, kMaxTensorsPerLaunch at a time: for
// each chunk, a fresh Chunk that fill(chunk, k, i) fills with tensor i in
// place k (returning its elements), then launch(grid, chunk), unless every
// tensor of the chunk is empty.
template <typename Chunk, typename Fill, typename Launch>
cudaError_t LaunchInChunks(int count, Fill fill, Launch launch) {
  for (int first = 0; first < count; first += kMaxTensorsPerLaunch) {
    const int in_chunk = std::min(count - first, kMaxTensorsPerLaunch);
    Chunk chunk{};
    int64_t largest = 0;
    for (int k = 0; k < in_chunk; ++k) largest = std::max(largest, fill(chunk, k, first + k));
    if (largest <= 0) continue;
    launch(ChunkGrid(largest, in_chunk), chunk);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t LaunchApplyOptimizer(const OptimizerStep& step, const OptimizerArgs* tensors, int count,
                                 cudaStream_t stream) {
  return LaunchInChunks<OptimizerChunk>(
      count,
      [&](OptimizerChunk& chunk, int k, int i) {
        chunk.t[k] = tensors[i];
        return chunk.t[k].n;
      },
      [&](dim3 grid, const OptimizerChunk& chunk) {
        ApplyOptimizerKernel<<<grid, kThreads, 0, stream>>>(step, chunk);
      });
}

cudaError_t LaunchCountNonFinite(const float* const* x, const int64_t* n, int num, float* count,
                                 cudaStream_t stream) {
  return LaunchInChunks<CountChunk>(
      num,
      [&](CountChunk& chunk, int k, int i) {
        chunk.x[k] = x[i];
        chunk.n[k] = n[i];
        return chunk.n[k];
      },
      [&](dim3 grid, const CountChunk& chunk) {
        CountNonFiniteKernel<<<grid, kThreads, 0, stream>>>(chunk, count);
      });
}

namespace {

// Block b adds the squares of its stride of x to partial[b] (kThreads
// threads, summed in shared memory in a fixed tree).
__global__ void SquaresKernel(const float* x, int64_t n, double* partial) {
  __shared__ double sums[kThreads];
  double sum = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = x[i];
    sum += v * v;
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] += sums[0];
}

__global__ void NormKernel(const double* partial, int blocks, float* norm) {
  double sum = 0;
  for (int b = 0; b < blocks; ++b) sum += partial[b];
  *norm = static_cast<float>(sqrt(sum));
}

}  // namespace

cudaError_t LaunchGlobalNorm(const float* const* x, const int64_t* n, int num, double* partial,
                             float* norm, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(partial, 0, kGlobalNormBlocks * sizeof(double), stream);
  for (int i = 0; i < num && e == cudaSuccess; ++i) {
    SquaresKernel<<<kGlobalNormBlocks, kThreads, 0, stream>>>(x[i], n[i], partial);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return e;
  NormKernel<<<1, 1, 0, stream>>>(partial, kGlobalNormBlocks, norm);
  return cudaGetLastError();
}

namespace {

// Element i of the 16-bit values at `wire` (bfloat16 with `bf16`, else IEEE
// half) as a float (exact).
__device__ inline float Widened(const void* wire, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(wire)[i])
              : __half2float(static_cast<const __half*>(wire)[i]);
}

// blockIdx.y picks the piece; the x blocks stride over its floats.
__global__ void PackToWireKernel(const WirePiece* pieces, bool bf16, void* wire) {
  const WirePiece p = pieces[blockIdx.y];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bf16) {
      static_cast<__nv_bfloat16*>(wire)[p.offset + i] = __float2bfloat16_rn(p.data[i]);
    } else {
      static_cast<__half*>(wire)[p.offset + i] = __float2half_rn(p.data[i]);
    }
  }
}

__global__ void UnpackFromWireKernel(const WirePiece* pieces, bool bf16, const void* wire) {
  const WirePiece p = pieces[blockIdx.y];
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p.data[i] = Widened(wire, p.offset + i, bf16);
  }
}

__global__ void UploadPiecesKernel(UploadPieces pieces, PieceValues values) {
  const int k = blockIdx.y;
  const void* const src = pieces.src[k];
  float* const dst = pieces.dst[k];
  const int64_t count = pieces.count[k];
  const bool bf16 = values == PieceValues::kBfloat16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] =
        values == PieceValues::kFloat ? static_cast<const float*>(src)[i] : Widened(src, i, bf16);
  }
}

__global__ void NarrowFromFloatKernel(const float* in, bool bf16, void* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bf16) {
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(in[i]);
    } else {
      static_cast<__half*>(out)[i] = __float2half_rn(in[i]);
    }
  }
}

// The grid of a pack or unpack: (blocks per piece, pieces); y is capped by
// CUDA at 65535.
bool WireGrid(int num_pieces, int64_t max_count, dim3* grid) {
  if (num_pieces <= 0 || max_count <= 0) return false;
  // At most 256 blocks a piece: the small pieces' blocks end at once, and
  // a bucket may hold a whole model's.
  *grid = dim3(static_cast<unsigned>(std::min(BlocksFor(max_count, kThreads), 256)),
               static_cast<unsigned>(num_pieces));
  return true;
}

}  // namespace

cudaError_t LaunchPackToWire(const WirePiece* pieces, int num_pieces, int64_t max_count, bool bf16,
                             void* wire, cudaStream_t stream) {
  if (num_pieces > 65535) return cudaErrorInvalidValue;
  dim3 grid;
  if (!WireGrid(num_pieces, max_count, &grid)) return cudaSuccess;
  PackToWireKernel<<<grid, kThreads, 0, stream>>>(pieces, bf16, wire);
  return cudaGetLastError();
}

cudaError_t LaunchUnpackFromWire(const WirePiece* pieces, int num_pieces, int64_t max_count,
                                 bool bf16, const void* wire, cudaStream_t stream) {
  if (num_pieces > 65535) return cudaErrorInvalidValue;
  dim3 grid;
  if (!WireGrid(num_pieces, max_count, &grid)) return cudaSuccess;
  UnpackFromWireKernel<<<grid, kThreads, 0, stream>>>(pieces, bf16, wire);
  return cudaGetLastError();
}

cudaError_t LaunchUploadPieces(const UploadPieces& pieces, int num, int64_t max_count,
                               PieceValues values, cudaStream_t stream) {
  if (num > kMaxUploadPieces) return cudaErrorInvalidValue;
  dim3 grid;
  if (!WireGrid(num, max_count, &grid)) return cudaSuccess;
  UploadPiecesKernel<<<grid, kThreads, 0, stream>>>(pieces, values);
  return cudaGetLastError();
}

cudaError_t LaunchNarrowFromFloat(const float* in, bool bf16, void* out, int64_t n,
                                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  NarrowFromFloatKernel<<<std::min(BlocksFor(n, kThreads), 1024), kThreads, 0, stream>>>(in, bf16,
                                                                                         out, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddRowBias(float* y, const float* b, int64_t rows, int64_t cols,
                             cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t n = rows * cols;
  AddRowBiasKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(y, b, n, cols);
  return cudaGetLastError();
}

cudaError_t LaunchGlobalAvgPoolForward(const float* x, float* y, int64_t rows, int64_t hw,
                                       cudaStream_t stream) {
  if (rows <= 0 || hw <= 0) return cudaSuccess;
  GlobalAvgPoolForwardKernel<<<BlocksFor(rows, kWarpsPerBlock), kThreads, 0, stream>>>(x, y, rows,
                                                                                       hw);
  return cudaGetLastError();
}

cudaError_t LaunchGlobalAvgPoolBackward(const float* dy, float* dx, int64_t rows, int64_t hw,
                                        cudaStream_t stream) {
  if (rows <= 0 || hw <= 0) return cudaSuccess;
  const int64_t n = rows * hw;
  GlobalAvgPoolBackwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(dy, dx, n, hw);
  return cudaGetLastError();
}

cudaError_t LaunchGatherSum(const int32_t* offsets, const int32_t* index, const float* coefs,
                            const float* src, int64_t dim, int64_t n, float* dst,
                            cudaStream_t stream) {
  if (n <= 0 || dim <= 0) return cudaSuccess;
  GatherSumKernel<<<BlocksFor(n, kWarpsPerBlock), kThreads, 0, stream>>>(offsets, index, coefs, src,
                                                                         dim, n, dst);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropyForward(const float* logits, const int32_t* labels,
                                             float* probs, float* scratch, float* stats, int batch,
                                             int classes, cudaStream_t stream) {
  if (batch <= 0 || classes <= 0) return cudaSuccess;
  float* loss = scratch;
  float* correct = scratch + batch;
  SoftmaxCrossEntropyRowsKernel<<<BlocksFor(batch, kWarpsPerBlock), kThreads, 0, stream>>>(
      logits, labels, probs, loss, correct, batch, classes);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  SoftmaxCrossEntropyStatsKernel<<<1, kThreads, 0, stream>>>(loss, correct, stats, batch);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxCrossEntropyBackward(const float* probs, const int32_t* labels,
                                              float* dlogits, int batch, int classes,
                                              cudaStream_t stream) {
  if (batch <= 0 || classes <= 0) return cudaSuccess;
  const int64_t n = static_cast<int64_t>(batch) * classes;
  SoftmaxCrossEntropyBackwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(
      probs, labels, dlogits, n, classes, 1.0f / static_cast<float>(batch));
  return cudaGetLastError();
}

namespace {

constexpr int64_t kSmallIndex = int64_t{1} << 31;

template <typename F>
void ChannelPartial(const float* x, const float* y, float* partial, int64_t n, int64_t channels,
                    int64_t hw, F f, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(SlicesFor(n, channels)), static_cast<unsigned>(channels));
  if (n * channels * hw < kSmallIndex) {
    ChannelPartialKernel<uint32_t>
        <<<grid, kThreads, 0, stream>>>(x, y, partial, n, channels, hw, f);
  } else {
    ChannelPartialKernel<int64_t><<<grid, kThreads, 0, stream>>>(x, y, partial, n, channels, hw, f);
  }
}

void ChannelAffine(const float* x, const float* z, float* y, const float* a, const float* b,
                   const float* d, int64_t n, int64_t channels, int64_t hw, cudaStream_t stream) {
  const int64_t total = n * channels * hw;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65536));
  if (total < kSmallIndex) {
    ChannelAffineKernel<uint32_t>
        <<<blocks, kThreads, 0, stream>>>(x, z, y, a, b, d, total, channels, hw);
  } else {
    ChannelAffineKernel<int64_t>
        <<<blocks, kThreads, 0, stream>>>(x, z, y, a, b, d, total, channels, hw);
  }
}

}  // namespace

int64_t ChannelPartialFloats(int64_t n, int64_t channels) {
  return 2 * channels * SlicesFor(n, channels);
}

cudaError_t LaunchChannelSum(const float* dy, float* db, float* partial, int64_t n,
                             int64_t channels, int64_t hw, cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || hw <= 0) return cudaSuccess;
  const int64_t slices = SlicesFor(n, channels);
  ChannelPartial(dy, nullptr, partial, n, channels, hw, SumFn{}, stream);
  ChannelSumFinishKernel<<<BlocksFor(channels, kThreads), kThreads, 0, stream>>>(partial, db,
                                                                                 channels, slices);
  return cudaGetLastError();
}

cudaError_t LaunchChannelAffine(const float* x, const float* scale, const float* shift, float* y,
                                int64_t n, int64_t channels, int64_t hw, cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || hw <= 0) return cudaSuccess;
  ChannelAffine(x, nullptr, y, scale, nullptr, shift, n, channels, hw, stream);
  return cudaGetLastError();
}

cudaError_t LaunchBatchNormForward(const float* x, const float* gamma, const float* beta, float* y,
                                   float* saved, float* coef, float* partial, float* batch_mean,
                                   float* batch_var, int64_t n, int64_t channels, int64_t hw,
                                   float epsilon, cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || hw <= 0) return cudaSuccess;
  const int64_t slices = SlicesFor(n, channels);
  ChannelPartial(x, nullptr, partial, n, channels, hw, ShiftedMomentsFn{x, hw}, stream);
  BatchNormStatsKernel<<<BlocksFor(channels, kThreads), kThreads, 0, stream>>>(
      x, gamma, beta, partial, saved, coef, batch_mean, batch_var, channels, slices, hw,
      static_cast<double>(n * hw), epsilon);
  ChannelAffine(x, nullptr, y, coef, nullptr, coef + channels, n, channels, hw, stream);
  return cudaGetLastError();
}

cudaError_t LaunchBatchNormInference(const float* x, const float* gamma, const float* beta,
                                     const float* mean, const float* var, float* y, float* coef,
                                     int64_t n, int64_t channels, int64_t hw, float epsilon,
                                     cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || hw <= 0) return cudaSuccess;
  BatchNormInferenceCoefKernel<<<BlocksFor(channels, kThreads), kThreads, 0, stream>>>(
      gamma, beta, mean, var, coef, channels, epsilon);
  ChannelAffine(x, nullptr, y, coef, nullptr, coef + channels, n, channels, hw, stream);
  return cudaGetLastError();
}

cudaError_t LaunchBatchNormBackward(const float* x, const float* gamma, const float* dy, float* dx,
                                    float* dgamma, float* dbeta, const float* saved, float* coef,
                                    float* partial, int64_t n, int64_t channels, int64_t hw,
                                    cudaStream_t stream) {
  if (n <= 0 || channels <= 0 || hw <= 0) return cudaSuccess;
  const int64_t slices = SlicesFor(n, channels);
  ChannelPartial(dy, x, partial, n, channels, hw, BackwardSumsFn{saved}, stream);
  BatchNormBackwardCoefKernel<<<BlocksFor(channels, kThreads), kThreads, 0, stream>>>(
      gamma, saved, partial, dgamma, dbeta, coef, channels, slices, static_cast<double>(n * hw));
  ChannelAffine(dy, x, dx, coef, coef + channels, coef + 2 * channels, n, channels, hw, stream);
  return cudaGetLastError();
}

// ---------------------------------------------------------------- concat and interaction

// The operand whose columns hold column c of a concat's output.
__device__ int OperandOf(const JoinOperands& ops, int64_t c) {
  int k = 0;
  while (k + 1 < ops.n && ops.offset[k + 1] <= c) ++k;
  return k;
}

__global__ void ConcatForwardKernel(JoinOperands ops, float* y, int64_t n, int64_t out) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t e = i / out, c = i % out;
    const int k = OperandOf(ops, c);
    y[i] = ops.x[k][e * ops.width[k] + (c - ops.offset[k])];
  }
}

__global__ void ConcatBackwardKernel(JoinOperands ops, const float* dy, int64_t n, int64_t out) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int64_t e = i / out, c = i % out;
    const int k = OperandOf(ops, c);
    float* d = ops.dx[k];
    if (d == nullptr) continue;
    float& dst = d[e * ops.width[k] + (c - ops.offset[k])];
    dst = ops.add[k] != 0 ? dst + dy[i] : dy[i];
  }
}

// The output index of pair (i, j), i > j (i >= j with self), as
// kernels::InteractionShape orders the pairs.
__device__ int64_t PairIndex(int64_t i, int64_t j, bool self) {
  return (self ? i * (i + 1) / 2 : i * (i - 1) / 2) + j;
}

// The pair at output index p: the largest i whose first index is <= p.
__device__ void PairAt(int64_t p, bool self, int64_t* i, int64_t* j) {
  int64_t r =
      static_cast<int64_t>(self ? (sqrt(8.0 * p + 1) - 1) / 2 : (1 + sqrt(8.0 * p + 1)) / 2);
  while (r > 0 && PairIndex(r, 0, self) > p) --r;
  while (PairIndex(r + 1, 0, self) <= p) ++r;
  *i = r;
  *j = p - PairIndex(r, 0, self);
}

__global__ void InteractionForwardKernel(JoinOperands ops, float* y, int64_t batch, int dim,
                                         bool self, int64_t out) {
  const int64_t n = batch * out;
  for (int64_t t = GlobalThread(); t < n; t += GridThreads()) {
    const int64_t e = t / out, c = t % out;
    if (c < dim) {
      y[t] = ops.x[0][e * dim + c];
      continue;
    }
    int64_t i = 0, j = 0;
    PairAt(c - dim, self, &i, &j);
    const float* a = ops.x[i] + e * dim;
    const float* b = ops.x[j] + e * dim;
    float dot = 0.0f;
    for (int k = 0; k < dim; ++k) dot += a[k] * b[k];
    y[t] = dot;
  }
}

// One thread per (example, operand f, element k): the x0 part of dy for
// f = 0, plus each pair's gradient times the other vector of the pair (twice
// the vector itself for (f, f)). No atomics: every gradient element is
// summed by one thread in a fixed order.
__global__ void InteractionBackwardKernel(JoinOperands ops, const float* dy, int64_t batch, int dim,
                                          bool self, int64_t out) {
  const int64_t f_count = ops.n, n = batch * f_count * dim;
  for (int64_t t = GlobalThread(); t < n; t += GridThreads()) {
    const int64_t k = t % dim, f = (t / dim) % f_count, e = t / (dim * f_count);
    float* d = ops.dx[f];
    if (d == nullptr) continue;
    const float* g = dy + e * out;
    float sum = f == 0 ? g[k] : 0.0f;
    for (int64_t m = 0; m < f_count; ++m) {
      if (m == f && !self) continue;
      const int64_t p = m < f ? PairIndex(f, m, self) : PairIndex(m, f, self);
      const float other = ops.x[m][e * dim + k];
      sum += g[dim + p] * (m == f ? 2.0f * other : other);
    }
    float& dst = d[e * dim + k];
    dst = ops.add[f] != 0 ? dst + sum : sum;
  }
}

cudaError_t LaunchConcatForward(const JoinOperands& ops, float* y, int64_t batch, int64_t out,
                                cudaStream_t stream) {
  const int64_t n = batch * out;
  if (n <= 0) return cudaSuccess;
  ConcatForwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(ops, y, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchConcatBackward(const JoinOperands& ops, const float* dy, int64_t batch,
                                 int64_t out, cudaStream_t stream) {
  const int64_t n = batch * out;
  if (n <= 0) return cudaSuccess;
  ConcatBackwardKernel<<<BlocksFor(n, kThreads), kThreads, 0, stream>>>(ops, dy, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchInteractionForward(const JoinOperands& ops, float* y, int64_t batch, int dim,
                                     bool self, cudaStream_t stream) {
  const int64_t f = ops.n, out = dim + (self ? f * (f + 1) / 2 : f * (f - 1) / 2);
  if (batch <= 0) return cudaSuccess;
  InteractionForwardKernel<<<BlocksFor(batch * out, kThreads), kThreads, 0, stream>>>(
      ops, y, batch, dim, self, out);
  return cudaGetLastError();
}

cudaError_t LaunchInteractionBackward(const JoinOperands& ops, const float* dy, int64_t batch,
                                      int dim, bool self, cudaStream_t stream) {
  const int64_t f = ops.n, out = dim + (self ? f * (f + 1) / 2 : f * (f - 1) / 2);
  if (batch <= 0) return cudaSuccess;
  InteractionBackwardKernel<<<BlocksFor(batch * f * dim, kThreads), kThreads, 0, stream>>>(
      ops, dy, batch, dim, self, out);
  return cudaGetLastError();
}

}  // namespace psflow::kernels::cuda_internal
