#include "chief/metrics.h"

namespace psflow::chief {

ChiefMetrics::ChiefMetrics(metrics::Registry* registry) {
  metrics::Registry* m = metrics::Registry::OrPrivate(registry, own_);
  global_step_ = m->GetGauge("psflow_global_step",
                             "Training steps applied: the newest version any ps has reached.");
  checkpoint_seconds_ = m->GetHistogram(
      "psflow_checkpoint_seconds",
      "Time to take one checkpoint: the snapshot from every ps and the write (fsync and rename "
      "included).",
      {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600});
  checkpoint_bytes_ = m->GetGauge("psflow_checkpoint_bytes",
                                  "Tensor bytes (values and optimizer slots) of the newest "
                                  "checkpoint this chief wrote.");
  checkpoint_step_ =
      m->GetGauge("psflow_checkpoint_step", "Step of the newest checkpoint this chief wrote.");
}

void ChiefMetrics::SetGlobalStep(int64_t step) { global_step_->Set(static_cast<double>(step)); }

void ChiefMetrics::Checkpointed(int64_t step, absl::Duration took, int64_t bytes) {
  checkpoint_seconds_->Observe(absl::ToDoubleSeconds(took));
  checkpoint_bytes_->Set(static_cast<double>(bytes));
  checkpoint_step_->Set(static_cast<double>(step));
}

}  // namespace psflow::chief
