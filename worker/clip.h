// Global-norm gradient clipping (JobConfig.clip_gradient_norm), as
// TensorFlow's clip_by_global_norm and PyTorch's clip_grad_norm_: the L2
// norm over all of a step's gradients, and, when it exceeds the bound, every
// gradient scaled by bound / norm, so that the step keeps its direction.
// For gradients in host memory (a GPU replica's stay on the device:
// kernels::Backend::GlobalNorm and Affine there). Thread-compatible: pure
// functions over the caller's buffers.
#ifndef PSFLOW_WORKER_CLIP_H_
#define PSFLOW_WORKER_CLIP_H_

#include <vector>

#include "absl/types/span.h"

namespace psflow::worker {

// The L2 norm over every value of `grads`, summed in double (no overflow
// for any finite fp32 values); infinite or NaN where a value is.
double GlobalNorm(const std::vector<absl::Span<const float>>& grads);

// The factor that clips gradients of global norm `norm` to `bound`:
// bound / norm when the norm exceeds a positive bound, else 1. A norm that
// is not finite gets 1: such a step goes to the job's on_nonfinite policy,
// not to clipping.
float ClipScale(double norm, float bound);

struct Clipped {
  double norm = 0;       // before clipping
  bool clipped = false;  // the gradients were scaled
};

// Scales every gradient of `grads` in place by ClipScale(GlobalNorm, bound).
Clipped ClipByGlobalNorm(const std::vector<absl::Span<float>>& grads, float bound);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_CLIP_H_
