// The chief's flags: the job (model, data, optimizer, schedule, mode, ...)
// and the coordinator's settings (model_dir, checkpoints, timeouts).
// Defined once here, for psflow-chief and for psflow-worker, whose task 0
// runs the chief's duties in a cluster without a chief.
#ifndef PSFLOW_CHIEF_FLAGS_H_
#define PSFLOW_CHIEF_FLAGS_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "chief/coordinator.h"

namespace psflow::chief {

// Fills o->job and o->coordinator from the flags (o->cluster must be set:
// the coordinator's ps addresses come from it). INVALID_ARGUMENT with one
// line naming the flag for a bad value (the job itself is checked later, by
// BuildJobConfig).
absl::Status ChiefOptionsFromFlags(ChiefOptions* o);

// --startup_timeout.
absl::Duration StartupTimeoutFromFlags();

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_FLAGS_H_
