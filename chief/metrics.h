// The chief's own metrics besides the training progress (chief/progress.h
// keeps those): the global step as the ps report it, and each checkpoint's
// duration and size. Thread-safe.
#ifndef PSFLOW_CHIEF_METRICS_H_
#define PSFLOW_CHIEF_METRICS_H_

#include <cstdint>
#include <memory>

#include "absl/time/time.h"
#include "common/metrics.h"

namespace psflow::chief {

class ChiefMetrics {
 public:
  // `registry` may be null (nothing is exported); else it must outlive this.
  explicit ChiefMetrics(metrics::Registry* registry);

  // The newest version any ps has reached: steps applied.
  void SetGlobalStep(int64_t step);
  // A checkpoint of `step` was written: `took` from the look at the ps to
  // the rename, `bytes` of tensor data.
  void Checkpointed(int64_t step, absl::Duration took, int64_t bytes);

 private:
  std::unique_ptr<metrics::Registry> own_;  // when none is given
  metrics::Gauge* global_step_;
  metrics::Histogram* checkpoint_seconds_;
  metrics::Gauge* checkpoint_bytes_;
  metrics::Gauge* checkpoint_step_;
};

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_METRICS_H_
