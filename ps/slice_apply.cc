#include "ps/slice_apply.h"

#include <algorithm>
#include <cmath>

#include "absl/container/inlined_vector.h"
#include "common/float16.h"

namespace psflow::ps {
namespace {

// Sets the NaNs and infinities of `x` to 0; whether there were any.
bool ZeroNonFinite(float* x, int64_t n) {
  if (!AnyNonFinite(x, n)) return false;
  for (int64_t i = 0; i < n; ++i) x[i] = std::isfinite(x[i]) ? x[i] : 0.0f;
  return true;
}

}  // namespace

const float* Shard::Borrowed::Floats(int64_t begin, int64_t n, float* scratch) const {
  const char* const from = static_cast<const char*>(data);
  if (dtype == DT_FLOAT) return reinterpret_cast<const float*>(from) + begin;
  DecodeFloats(dtype, from + begin * WireBytes(dtype), n, scratch);
  return scratch;
}

void ComputeSliceApply(SliceApply& job, ThreadPool* pool, int64_t range, StepTrace* trace) {
  const int64_t n = job.n;
  TraceSpan span(trace, "apply", job.step);
  span.Arg("slice", job.slice);
  span.Arg("floats", n);
  span.Arg("workers", job.pushes.size());
  if (job.out == nullptr || static_cast<int64_t>(job.out->size()) != n) {
    job.out = std::make_shared<std::vector<float>>(n);
  }
  const float* const value = job.current->data();
  float* const published = job.out->data();
  const bool halves = job.halves_dtype != DT_FLOAT;
  if (halves && (job.halves_out == nullptr || static_cast<int64_t>(job.halves_out->size()) != n)) {
    job.halves_out = std::make_shared<std::vector<uint16_t>>(n);
  }
  char* const published_halves = halves ? reinterpret_cast<char*>(job.halves_out->data()) : nullptr;
  if (job.skip) {
    // Skipped: the value and the slots stay as they are.
    std::copy(value, value + n, published);
    if (halves) EncodeFloats(job.halves_dtype, published, n, published_halves);
    for (size_t k = 0; k < job.slots.size(); ++k)
      std::copy(job.slots[k], job.slots[k] + n, job.slots_out[k]);
    return;
  }
  const float scale = 1.0f / static_cast<float>(job.pushes.size());
  const bool borrowed = std::any_of(job.pushes.begin(), job.pushes.end(),
                                    [](const auto& p) { return !p.second.borrowed.empty(); });
  // Borrowed 16-bit values are widened one block at a time, into memory of
  // the applying thread's that stays in its cache.
  const bool widens = std::any_of(job.pushes.begin(), job.pushes.end(), [](const auto& p) {
    return !p.second.borrowed.empty() && p.second.borrowed.dtype != DT_FLOAT;
  });
  // Averaging, then the optimizer writing the copy readers get as it goes,
  // one range at a time (it stays in cache throughout). The rule and scalars
  // of this version's step, once for every range:
  const kernels::OptimizerStep step =
      job.bn_momentum > 0 ? MovingAverageStep(job.bn_momentum) : job.optimizer->StepAt(job.step);
  auto apply = [&](int r) {
    const int64_t begin = r * range;
    const int64_t end = std::min(n, begin + range);
    // The mean of each block of the range goes to a buffer of this call's
    // that stays in the core's L1 cache: the optimizer reads it from there.
    // (A buffer as large as the slice would be fetched from memory for each
    // write and written back to memory later: two passes over the slice's
    // bytes for a value that is used once.)
    alignas(64) float mean[Shard::kMeanBlock];
    absl::InlinedVector<const float*, 4> grads(job.pushes.size());
    absl::InlinedVector<float*, 2> block_slots(job.slots.size()), block_slots_out(job.slots.size());
    thread_local std::vector<float> widened;
    if (widens && widened.size() < job.pushes.size() * Shard::kMeanBlock)
      widened.resize(job.pushes.size() * Shard::kMeanBlock);
    for (int64_t b = begin; b < end; b += Shard::kMeanBlock) {
      const int64_t len = std::min(end - b, Shard::kMeanBlock);
      for (size_t w = 0; w < job.pushes.size(); ++w) {
        grads[w] =
            job.pushes[w].second.Floats(b, len, widens ? &widened[w * Shard::kMeanBlock] : nullptr);
      }
      MeanInto(mean, grads, scale, len);
      // Borrowed values were checked as they arrived, but lie in a worker's
      // memory: read again now, they must still be finite (the mean of
      // finite ones is, unless it overflows, which the check catches too).
      if (borrowed && ZeroNonFinite(mean, len)) {
        // Named: the first worker whose block is not finite (else the
        // first: a mean that overflowed).
        int changed_by = job.pushes[0].first;
        for (size_t w = 0; w < job.pushes.size(); ++w) {
          if (AnyNonFinite(grads[w], len)) {
            changed_by = job.pushes[w].first;
            break;
          }
        }
        int none = -1;
        job.changed_by.compare_exchange_strong(none, changed_by);
      }
      for (size_t k = 0; k < job.slots.size(); ++k) {
        block_slots[k] = job.slots[k] + b;
        block_slots_out[k] = job.slots_out[k] + b;
      }
      // The optimizer reads this version's values and slots and writes the
      // next version's: the values readers get (and, with wire copies,
      // encoded while in the cache) and the slots into the other buffers.
      ApplyStep(step, value + b, mean, len, block_slots, published + b, block_slots_out);
      if (halves) {
        EncodeFloats(job.halves_dtype, published + b, len,
                     published_halves + b * static_cast<int64_t>(sizeof(uint16_t)));
      }
    }
  };
  const int ranges = static_cast<int>((n + range - 1) / range);
  if (pool == nullptr || ranges <= 1) {
    for (int r = 0; r < ranges; ++r) apply(r);
  } else {
    // ParallelFor returns once every range is done, which orders their
    // writes before the lock is taken again.
    pool->ParallelFor(ranges, apply);
  }
}

}  // namespace psflow::ps
