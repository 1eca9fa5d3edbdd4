// What a tensor is to the code that moves it, apart from how it moves: its
// element count and shape as text (NumElements, ShapeString), and the two
// views the chunk codec (transport/tensor_chunks.h) works from: TensorRef,
// fp32 or already-encoded values a sender names without copying, and
// TensorSink, where a receiver wants a tensor's values to go. Plain structs
// and pure functions; model/ and the placement use them without transport.
#ifndef PSFLOW_COMMON_TENSOR_VIEW_H_
#define PSFLOW_COMMON_TENSOR_VIEW_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/tensor.pb.h"

namespace psflow {

int64_t NumElements(absl::Span<const int64_t> shape);
// NumElements for shapes from untrusted input: every dimension must be at
// least 1 and the product at most `limit` (INVALID_ARGUMENT otherwise).
absl::StatusOr<int64_t> CheckedNumElements(absl::Span<const int64_t> shape, int64_t limit);
std::string ShapeString(absl::Span<const int64_t> shape);

struct TensorRef {
  std::string name;
  std::string slot;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // NumElements(shape) floats, alive while splitting
  DataType dtype = DT_FLOAT;    // on the wire: DT_FLOAT, DT_BFLOAT16 or DT_HALF
  int64_t row_begin = 0;        // of a slice within its variable (TensorChunk.row_begin)
  // Set instead of `data`: the values already in `dtype` (NumElements(shape)
  // elements of WireBytes(dtype) bytes, little-endian, aligned to the
  // element), sent as they lie.
  const void* encoded = nullptr;
};

struct TensorSink {
  std::string name;
  std::string slot;
  std::vector<int64_t> shape;
  float* data = nullptr;      // NumElements(shape) floats, or null with `storage`
  bool required = true;       // Finish() fails if a required sink is incomplete
  DataType dtype = DT_FLOAT;  // the chunks' dtype: DT_FLOAT, DT_BFLOAT16 or DT_HALF
  // Instead of `data`, memory allocated only as the tensor's data arrives
  // (for what a peer's request declares): the whole tensor with its first
  // chunk, or, with `grow`, no more than the chunks received so far (they
  // come in order). The vector must outlive the assembler; it is empty, or
  // already of the tensor's size (a buffer reused from earlier data, written
  // over chunk by chunk: Finish() still fails unless every byte arrived).
  std::vector<float>* storage = nullptr;
  bool grow = false;
  // If set: made true when a chunk brings a NaN, an infinity or a value of
  // magnitude_limit or more (checked as each chunk is decoded, while its
  // values are in the cache).
  bool* non_finite = nullptr;
  float magnitude_limit = std::numeric_limits<float>::infinity();
  // Of a slice, its first row within the variable: chunks are matched on
  // name, slot and this (TensorChunk.row_begin).
  int64_t row_begin = 0;
  // If set: where the chunks come in memory that stays the caller's after
  // the assembler (a shared region, ChunkAssembler::AddInPlace) and lie
  // there one after another, the values are left there, in `dtype`, and
  // *borrow points at them once the sink is complete, instead of being
  // decoded into `data` (`non_finite` is then found in `dtype`, as they lie).
  // Null otherwise (set so by the assembler first): the values are in `data`.
  const void** borrow = nullptr;
};

// How errors name a tensor: 'name', then " from row R" for a slice that
// does not start at row 0, then " slot 'S'" for an optimizer slot.
std::string TensorDisplayName(const std::string& name, const std::string& slot, int64_t row_begin);

}  // namespace psflow

#endif  // PSFLOW_COMMON_TENSOR_VIEW_H_
