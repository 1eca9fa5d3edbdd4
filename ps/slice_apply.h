// One slice's apply, which the shard claims under its lock and computes
// without it: the mean of the live workers' gradients and the optimizer's
// step (or a non-trainable slice's moving average), range by range, writing
// the next published value (and its 16-bit wire copy) and the slots. The
// inputs are the shard's, lent while the slice is marked applying; nothing
// else reads or writes them meanwhile.
#ifndef PSFLOW_PS_SLICE_APPLY_H_
#define PSFLOW_PS_SLICE_APPLY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/step_trace.h"
#include "common/thread_pool.h"
#include "proto/tensor.pb.h"
#include "ps/optimizer.h"
#include "ps/shard.h"

namespace psflow::ps {

// Everything an apply of one slice works on: its pushes, taken out of the
// shard, and raw pointers into the shard's members.
struct SliceApply {
  int slice = 0;
  int64_t step = 0;
  bool skip = false;                                    // a worker skipped the step: no update
  std::vector<std::pair<int, Shard::Gradient>> pushes;  // in worker-id order
  // The first worker whose borrowed values had a NaN or an infinity at the
  // apply (changed after the push was checked), or -1.
  std::atomic<int> changed_by{-1};
  int64_t n = 0;
  Shard::Value current;           // the slice's published value, which the apply reads
  std::vector<float*> slots;      // at the slice's version, which the apply reads
  std::vector<float*> slots_out;  // receive the slots after the apply
  const Optimizer* optimizer = nullptr;
  // > 0 for a non-trainable slice: the moving average's momentum, used
  // instead of the optimizer.
  float bn_momentum = 0;
  std::shared_ptr<std::vector<float>> out;  // the next published value
  // With wire copies (halves_dtype 16-bit): `out` in that dtype.
  DataType halves_dtype = DT_FLOAT;
  std::shared_ptr<std::vector<uint16_t>> halves_out;
};

// Computes `job`'s outputs (out, halves_out, slots_out; changed_by where a
// borrowed gradient was changed after its check) from its inputs, in ranges
// of `range` floats: in parallel on `pool` where it is not null, else on
// this thread. `trace` (may be null) gets the span "apply".
void ComputeSliceApply(SliceApply& job, ThreadPool* pool, int64_t range, StepTrace* trace);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SLICE_APPLY_H_
