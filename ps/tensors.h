// The shard's tensors as chunk sinks and refs (transport/tensor_chunks.h): the
// one mapping between what travels in an RPC and the shard's per-slice
// storage, shared by the gRPC service and the in-memory fake of tests. No
// gRPC here. Sinks and refs point into the storage given, which must outlive
// them and not grow.
#ifndef PSFLOW_PS_TENSORS_H_
#define PSFLOW_PS_TENSORS_H_

#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

#include "proto/ps.pb.h"
#include "ps/shard.h"
#include "transport/tensor_chunks.h"

namespace psflow::ps {

// Storage for an Init of `header` (a value per slice, slots named
// `slot_names`) and fp32 sinks into it: values required, slots optional
// (those not sent stay empty: the shard starts them at zero). Nothing is
// allocated until data arrives; each tensor grows with its chunks. Call
// CheckInitHeader first.
std::vector<TensorSink> InitSinks(const InitHeader& header,
                                  const std::vector<std::string>& slot_names,
                                  std::vector<Shard::SliceValues>* values);

// Storage for one push's gradients of the slices `indices` of `slices` (each
// a valid index) and sinks into it that decode chunks of `dtype` (the job's
// wire dtype): grads[k] is for slices[indices[k]], and so is the k-th sink.
// A gradient's memory is buffers[k] where it is not empty (a buffer of the
// shard's from an earlier step, Shard::BeginPush), or else allocated with
// its first chunk; its values are checked for NaN and infinity as they are
// decoded (finite_checked). With `borrow`, values that come in place (a
// shared region, ChunkAssembler::AddInPlace) one chunk after another are
// left there in `dtype`, checked where they lie: grads[k].borrowed.data
// points at them.
std::vector<TensorSink> GradientSinks(
    const std::vector<SliceSpec>& slices, const std::vector<int>& indices, DataType dtype,
    std::vector<Shard::SliceGradient>* grads, std::vector<std::vector<float>> buffers = {},
    bool borrow = false, float magnitude_limit = std::numeric_limits<float>::infinity());

// A skip push's gradients: a skip for each of `indices`, or for every one of
// `num_slices` slices when `indices` is empty.
std::vector<Shard::SliceGradient> SkipGradients(const std::vector<int>& indices, int num_slices);

// The slices a pull or a push names (`asked`, indices into a shard's
// `num_slices` slices; empty: all, in order). INVALID_ARGUMENT for an index
// out of range or named twice; `what` names the call.
absl::StatusOr<std::vector<int>> SliceIndices(absl::Span<const int32_t> asked, int num_slices,
                                              absl::string_view what);

// One pulled slice's value, sent as `dtype`.
TensorRef SliceValueRef(const SliceSpec& slice, const Shard::Value& value, DataType dtype);

// A snapshot's values and slots, in fp32 (checkpoints stay exact).
std::vector<TensorRef> SnapshotRefs(const Shard::Snapshot& snapshot);

}  // namespace psflow::ps

#endif  // PSFLOW_PS_TENSORS_H_
