// Optimizers applied on the parameter servers, element-wise over one slice
// at a time: SGD, momentum (heavy ball, as torch.optim.SGD) and Adam (as
// torch.optim.Adam). Slot variables (momentum, Adam's m and v) live next to
// the weights on the ps. Stateless apart from its config; thread-safe.
#ifndef PSFLOW_PS_OPTIMIZER_H_
#define PSFLOW_PS_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"

namespace psflow::ps {

class Optimizer {
 public:
  // Checks the config (positive learning rate, betas in [0, 1), ...) and
  // fills the usual defaults for fields left at 0.
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config);
  virtual ~Optimizer() = default;

  // Names of the slot variables of an optimizer of `kind`, each the size of
  // the weights, without building one (none for a kind Create refuses).
  static std::vector<std::string> SlotNames(OptimizerConfig::Kind kind);
  // SlotNames(kind) for this optimizer's kind.
  virtual std::vector<std::string> SlotNames() const = 0;
  // Applies one step computed from version `step` (0-based) to n weights.
  // slots follow SlotNames().
  virtual void Apply(int64_t step, float* weights, const float* grad, int64_t n,
                     const std::vector<float*>& slots) const = 0;
};

// Element-wise helpers for gradient averaging, vectorized like the optimizers.
void AddInto(float* sum, const float* x, int64_t n);
void ScaleInPlace(float* x, float factor, int64_t n);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_OPTIMIZER_H_
