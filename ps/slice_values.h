// The values of one slice of a variable with its optimizer slots: what a
// job's Init and a replica's Mirror hand a shard. A header of its own so that
// code which fills them (the worker's device replica) needs none of the
// shard's server-side types.
#ifndef PSFLOW_PS_SLICE_VALUES_H_
#define PSFLOW_PS_SLICE_VALUES_H_

#include <vector>

namespace psflow::ps {

// One slice's values, and its slots in Optimizer::SlotNames() order; empty
// slots start at zero; those of non-trainable slices stay there.
struct SliceValues {
  std::vector<float> value;
  std::vector<std::vector<float>> slots;
};

}  // namespace psflow::ps

#endif  // PSFLOW_PS_SLICE_VALUES_H_
