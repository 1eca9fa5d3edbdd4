// Optimizers applied on the parameter servers, element-wise over one slice
// at a time, each as its torch.optim namesake: SGD, momentum (SGD with
// momentum, heavy ball or Nesterov), Adam, AdamW, Adagrad and RMSprop, with
// weight decay and a learning-rate schedule of the global step. Slot
// variables (momentum, Adam's m and v, ...) live next to the weights on the
// ps. Stateless apart from its config; thread-safe.
#ifndef PSFLOW_PS_OPTIMIZER_H_
#define PSFLOW_PS_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/optimizer_math.h"
#include "proto/job.pb.h"

namespace psflow::ps {

// The learning rate of the step computed from version `step` (0-based) under
// config's schedule, for a config Create accepts (fields at 0 take Create's
// defaults). With W = lr_warmup_steps, N = lr_decay_steps, r = lr_decay_rate:
//   step < W:  lr * (step + 1) / W   (linear warmup; step W-1 gets lr)
//   else, t = step - W:
//     CONSTANT     lr
//     STEP         lr * r^floor(t / N)
//     EXPONENTIAL  lr * r^(t / N)
//     COSINE       lr_min + (lr - lr_min) * (1 + cos(pi * min(t, N) / N)) / 2
// Computed in double, rounded once to float. The chief's progress line uses
// it too.
float LearningRate(const OptimizerConfig& config, int64_t step);

class Optimizer {
 public:
  // Checks the config (positive learning rate, betas in (0, 1), a schedule
  // with positive steps, ...) and fills the usual defaults (torch.optim's)
  // for fields left at 0. INVALID_ARGUMENT naming the field otherwise.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config);
  virtual ~Optimizer() = default;

  // Names of the slot variables of an optimizer of `kind`, each the size of
  // the weights, without building one (none for a kind Create refuses).
  static std::vector<std::string> SlotNames(OptimizerConfig::Kind kind);
  // SlotNames(kind) for this optimizer's kind.
  virtual std::vector<std::string> SlotNames() const = 0;
  // The rule and scalars of the step computed from version `step` (0-based):
  // the learning rate of the schedule, Adam's bias corrections, ... What the
  // ps apply on their CPUs (Apply) and a GPU replica on its device
  // (kernels::Backend::ApplyOptimizer).
  virtual kernels::OptimizerStep StepAt(int64_t step) const = 0;
  // Applies one step computed from version `step` (0-based) to n weights and
  // their slots (which follow SlotNames()) in place:
  // ApplyStep(StepAt(step), weights, grad, n, slots, weights, slots).
  virtual void Apply(int64_t step, float* weights, const float* grad, int64_t n,
                     const std::vector<float*>& slots) const = 0;
};

// Applies `step` to n weights on this CPU, vectorized: reads the weights
// from `w` and their slots from `slots` (the optimizer's SlotNames(); none
// for kMovingAverage) and writes the updated ones to `out` and `slots_out`
// (as many as `slots`). Each output is either its input itself (in place)
// or n floats apart from every other argument: the ps reads one version's
// weights and slots and writes the next version's into other buffers.
void ApplyStep(const kernels::OptimizerStep& step, const float* w, const float* g, int64_t n,
               absl::Span<float* const> slots, float* out, absl::Span<float* const> slots_out);

// The workers' mean gradient, vectorized like the optimizers: mean =
// (0 + xs[0] + xs[1] + ...) * scale elementwise, summed in the order of xs,
// bit for bit what filling with zeros, adding each in turn and scaling give;
// one pass over memory for one or two gradients (each further one adds a
// pass). n elements each; `mean` lies apart from every xs[j].
void MeanInto(float* mean, absl::Span<const float* const> xs, float scale, int64_t n);

// Non-trainable variables (batch norm's running statistics) are no
// optimizer's: the ps keep each as a moving average of the statistic the
// workers push for it, PyTorch's convention, momentum being the weight of
// the new value.
inline constexpr float kDefaultBnMomentum = 0.1f;
// The job's momentum: JobConfig.bn_momentum, 0 (unset) meaning
// kDefaultBnMomentum. INVALID_ARGUMENT outside (0, 1].
absl::StatusOr<float> BnMomentum(const JobConfig& job);
// r = (1 - momentum) * r + momentum * x, elementwise (r apart from x).
void MovingAverageInto(float* r, const float* x, float momentum, int64_t n);
// The same as a step (kMovingAverage), for ApplyStep and ApplyOptimizer.
kernels::OptimizerStep MovingAverageStep(float momentum);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_OPTIMIZER_H_
