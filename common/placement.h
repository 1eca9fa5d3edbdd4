// Placing a model's variables over the parameter servers. Variables larger
// than `split_bytes` are cut along their first dimension into contiguous row
// ranges of nearly equal size: as many as there are ps, or a multiple of
// that, the smallest for which each range holds at most `slice_bytes` (0: no
// limit), never more than the variable's rows; range k goes to ps k mod
// num_ps, so a ps may hold several slices of one variable (told apart by
// their first row). The others go whole, largest first, onto the ps holding
// the fewest bytes so far (ties to the lowest index). The result depends
// only on its inputs.
//
// Why several slices of one variable on a ps: a slice is the unit a ps
// applies and sends back, each as soon as its gradients are in, so a large
// variable in pieces flows through the ps piece by piece (copied in, applied
// on several threads, sent back) instead of as one long copy-apply-copy.
#ifndef PSFLOW_COMMON_PLACEMENT_H_
#define PSFLOW_COMMON_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor_view.h"
#include "proto/job.pb.h"
#include "proto/ps.pb.h"

namespace psflow {

struct VariableShape {
  std::string name;
  std::vector<int64_t> shape;  // at least one dimension
  // False for batch norm's running statistics: the ps average the statistic
  // workers push into them instead of applying the optimizer
  // (VariablePlacement.non_trainable).
  bool trainable = true;
};

// Variables above this many bytes are split over several ps by default.
inline constexpr int64_t kDefaultSplitBytes = 256 << 10;
// The largest slice of a split variable by default (the chief's --slice_mb).
inline constexpr int64_t kDefaultSliceBytes = 1 << 20;

absl::StatusOr<Placement> PlaceVariables(const std::vector<VariableShape>& variables, int num_ps,
                                         int64_t split_bytes = kDefaultSplitBytes,
                                         int64_t slice_bytes = kDefaultSliceBytes);

// One slice of a variable as held by one ps.
struct SliceRef {
  std::string name;
  std::vector<int64_t> variable_shape;
  std::vector<int64_t> slice_shape;  // rows [row_begin, row_end) of the variable
  int64_t row_begin = 0, row_end = 0;
  int64_t float_offset = 0;  // where the slice starts within the whole variable
  int variable_index = 0;    // index in placement.variable()
  bool trainable = true;     // !VariablePlacement.non_trainable
};

// The slices that ps `ps` holds, in placement order.
std::vector<SliceRef> SlicesOnPs(const Placement& placement, int ps);

// The one mapping between the slices a ps holds and whole-variable buffers:
// `buffers[i]` holds variable i of the placement in full (NumElements of its
// shape floats, alive while the sinks or refs are used). The sinks receive
// (and the refs send) ps `ps`'s slices of optimizer slot `slot` ("" for the
// values), in SlicesOnPs order, as `dtype` on the wire; every sink is required.
std::vector<TensorSink> SliceSinks(const Placement& placement, int ps,
                                   absl::Span<float* const> buffers, const std::string& slot = "",
                                   DataType dtype = DT_FLOAT);
std::vector<TensorRef> SliceRefs(const Placement& placement, int ps,
                                 absl::Span<const float* const> buffers,
                                 const std::string& slot = "", DataType dtype = DT_FLOAT);
// As SliceRefs for the values, from whole variables whose values lie in
// `dtype` already (bfloat16 or IEEE half: `values[i]` holds variable i's
// NumElements 16-bit values): the refs send them as they lie
// (TensorRef::encoded).
std::vector<TensorRef> EncodedSliceRefs(const Placement& placement, int ps,
                                        absl::Span<const uint16_t* const> values, DataType dtype);

// The same for a shard's whole state: ps `ps`'s slices of the values and of
// each optimizer slot, slots[k] ("" for the values) from buffers[k] (whole
// variables, as above; an empty buffers[k] leaves slot k out), in slot
// order. What an Init sends and a Snapshot with slots receives.
std::vector<TensorSink> StateSinks(const Placement& placement, int ps,
                                   const std::vector<std::vector<float*>>& buffers,
                                   const std::vector<std::string>& slots);
std::vector<TensorRef> StateRefs(const Placement& placement, int ps,
                                 const std::vector<std::vector<const float*>>& buffers,
                                 const std::vector<std::string>& slots);

// The dtype of the job's pulls and pushes (JobConfig.wire_dtype); DT_INVALID
// for a value this build does not know.
DataType WireDtypeOf(const JobConfig& job);
// The job as a replica of an all-reduce job (JobConfig.exchange ALL_REDUCE)
// holds it: its worker pushes and pulls in-process, so in fp32 whatever the
// wire dtype (which the all-reduce's messages use).
JobConfig ReplicaJob(const JobConfig& job);
// In such a job, GPU workers keep their replicas on their devices; worker
// 0's shard (which the chief and the evaluator read) is brought up to date
// at every multiple of this many steps, at the steps a snapshot asks for
// in advance, at a stop and at the end. Between those it reports the
// version it was last brought to.
inline constexpr int64_t kReplicaPublishSteps = 100;
// Whether the ps apply each worker's gradient alone (JobConfig.mode ASYNC, or
// SSP with a staleness above 0; SSP with 0 runs the synchronous path).
bool AppliesEachGradient(const JobConfig& job);
// For such a job: a version a few gradients past `newest` (the highest of
// the ps's), capped at train_steps, which every ps reaches soon. The ps are
// never in step, so a snapshot asked for `newest` itself may be passed by
// one of them before the request reaches it.
int64_t VersionAhead(const JobConfig& job, int64_t newest);
// The model replicas on each worker (JobConfig.replicas_per_worker; at
// least 1), and the examples of one worker's step: batch_size of each.
int ReplicasPerWorker(const JobConfig& job);
int64_t WorkerBatch(const JobConfig& job);
// What ps `ps` holds, as its InitHeader describes it (non_trainable from
// the placement).
std::vector<SliceSpec> SliceSpecs(const Placement& placement, int ps);

// Bytes held by each ps.
std::vector<int64_t> BytesPerPs(const Placement& placement);

}  // namespace psflow

#endif  // PSFLOW_COMMON_PLACEMENT_H_
