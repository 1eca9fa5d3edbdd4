// Cutting fp32 tensors into TensorChunk messages and putting them back
// together, with every chunk checked against what the receiver expects.
//
// The sender describes its tensors with TensorRef (no copy until a chunk is
// filled); ChunkSplitter fills groups of chunks whose data adds up to at most
// max_bytes, cutting a larger tensor into several chunks on whole elements.
// The receiver describes where each expected tensor goes with TensorSink;
// ChunkAssembler copies each chunk's bytes into place and refuses
// (INVALID_ARGUMENT) a chunk with an unknown name/slot, another dtype than
// the sink's or another shape, an offset other than the next expected byte,
// or more bytes than the tensor holds. Tensors are told apart by name, slot
// and first row (two slices of one variable differ only there).
//
// Tensors are fp32 in memory on both sides; on the wire they are in the
// dtype of their ref or sink (common/float16.h): the splitter encodes each
// chunk straight from the fp32 source as it fills it, and the assembler
// decodes each chunk into the fp32 destination, so a 16-bit wire dtype needs
// no full-size copy. A sender whose values are in the wire dtype already (a
// GPU worker's gradients, rounded to 16 bits on the device) names them with
// TensorRef::encoded instead, and they are sent as they lie. Offsets and
// sizes count bytes of the wire encoding (2 an element for DT_BFLOAT16 and
// DT_HALF). Neither class is thread-safe.
#ifndef PSFLOW_TRANSPORT_TENSOR_CHUNKS_H_
#define PSFLOW_TRANSPORT_TENSOR_CHUNKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tensor_view.h"
#include "proto/tensor.pb.h"

namespace psflow {

// Writes elements [begin, begin + n) of `ref` in its dtype to `out`
// (n * WireBytes(ref.dtype) bytes, any alignment): encoded from `data`, or
// copied from `encoded`.
void WriteWireValues(const TensorRef& ref, int64_t begin, int64_t n, char* out);
// The bytes of elements [begin, ...) of `ref` as they go on the wire, when
// they lie in memory so (`encoded`, or fp32 `data`); null when they must be
// encoded first.
const char* WireValuesAt(const TensorRef& ref, int64_t begin);
// Whether elements [begin, begin + n) of `ref` are all below `limit` in
// magnitude (common/float16.h's AllBelow; false for a NaN). For `encoded`
// values, read as they lie when `limit` is at least WireOverflow(ref.dtype)
// (then: whether each is finite), else decoded block by block.
bool WireValuesBelow(const TensorRef& ref, int64_t begin, int64_t n, float limit);

// One chunk of a group, before anything is copied: `bytes` bytes (in the
// ref's dtype) from byte `offset` of `tensor`.
struct ChunkPiece {
  const TensorRef* tensor = nullptr;  // owned by the splitter
  int64_t offset = 0;
  int64_t bytes = 0;
};

class ChunkSplitter {
 public:
  // Every ref's dtype must be a wire dtype (a broken invariant aborts).
  ChunkSplitter(std::vector<TensorRef> tensors, size_t max_bytes);
  // Appends the next group of chunks to `out`; returns false when every byte
  // has been handed out. A tensor with no elements yields one empty chunk.
  bool Next(google::protobuf::RepeatedPtrField<TensorChunk>* out);
  // The same groups, described rather than filled (for an encoder that
  // writes the data where it goes: transport/chunk_messages.h).
  bool NextPieces(std::vector<ChunkPiece>* out);

 private:
  std::vector<TensorRef> tensors_;
  size_t max_bytes_;
  size_t tensor_ = 0;   // index of the tensor being cut
  int64_t offset_ = 0;  // next byte of that tensor
};

// Writes `message` to `writer` (a gRPC client or server writer) once per
// group of chunks from `splitter`, and once with no chunks if there are none,
// so that what the first message carries besides chunks (a header, a version)
// always gets through. Before each later group the chunks are cleared and
// `strip(message)` drops what only the first message carries. Returns false
// as soon as a write fails (nothing more is written).
template <typename Writer, typename Message, typename Strip>
bool WriteChunked(Writer* writer, ChunkSplitter& splitter, Message& message, Strip strip) {
  bool more = splitter.Next(message.mutable_chunk());
  while (true) {
    if (!writer->Write(message)) return false;
    if (!more) return true;
    message.clear_chunk();
    strip(message);
    more = splitter.Next(message.mutable_chunk());
    if (!more) return true;
  }
}

// Where a sink's first `elements` floats go: `data`, or its storage,
// allocated (or grown) to hold them.
float* SinkData(TensorSink& sink, int64_t elements);

// A chunk's fields but its data, as TensorChunk describes them: what
// ChunkAssembler checks before any data is read.
TensorChunk ChunkHeader(const ChunkPiece& piece);

// The one dtype of `sinks` (DT_FLOAT when there are none), which a pull asks
// the ps for; INVALID_ARGUMENT if they differ or one is not a wire dtype.
absl::StatusOr<DataType> SinksDtype(absl::Span<const TensorSink> sinks);

class ChunkAssembler {
 public:
  // Every sink's dtype must be a wire dtype (a broken invariant aborts).
  explicit ChunkAssembler(std::vector<TensorSink> sinks);
  absl::Status Add(const TensorChunk& chunk);
  // Add, which also sets *completed to the index (in the constructor's
  // order) of the sink this chunk completed, or to -1.
  absl::Status Add(const TensorChunk& chunk, int* completed);
  // Add for a chunk whose `size` bytes of data are not in `header` (its data
  // field is ignored) but read by `decode` straight into their place: it is
  // called once the header is checked, with the dtype on the wire, the
  // number of elements and where their fp32 values go, and returns false if
  // the data could not be read (DATA_LOSS; nothing counts as received).
  using ChunkDecoder = absl::FunctionRef<bool(DataType dtype, int64_t elements, float* out)>;
  absl::Status AddFrom(const TensorChunk& header, int64_t size, ChunkDecoder decode,
                       int* completed);
  // AddInPlace decodes what it does not leave in place in blocks of this
  // many bytes (a multiple of every element's size), each checked for NaN
  // while the copy has left it in the cache.
  static constexpr int64_t kInPlaceBlockBytes = 256 << 10;
  // AddFrom for a chunk whose `size` bytes lie at `from`, in memory that
  // outlives the assembler's caller's use of the sinks: a sink with `borrow`
  // takes the values where they lie while its chunks follow one another
  // there (otherwise, and for other sinks, they are decoded into the sink,
  // with what was left in place before).
  absl::Status AddInPlace(const TensorChunk& header, int64_t size, const char* from,
                          int* completed);
  // Sinks whose values were left in place (their *borrow set).
  int borrowed() const { return borrowed_; }
  // OK when every required sink received all its bytes.
  absl::Status Finish() const;
  // True when the sink named (name, slot, row_begin) received all its bytes.
  bool Complete(const std::string& name, const std::string& slot, int64_t row_begin = 0) const;
  // Bytes (on the wire) that the sinks still wait for.
  int64_t remaining_bytes() const { return remaining_bytes_; }

 private:
  struct Entry {
    TensorSink sink;
    int index = 0;                   // in the constructor's order
    int64_t element_bytes = 4;       // on the wire
    int64_t bytes = 0;               // total size on the wire
    int64_t received = 0;            // bytes decoded so far
    const char* in_place = nullptr;  // where the bytes received lie, if left in place
  };
  // The entry a chunk of `size` bytes is for, once its fields are checked
  // against it.
  absl::StatusOr<Entry*> Check(const TensorChunk& chunk, int64_t size);
  // Records `size` bytes of `e` received (their values at `values`, in
  // `dtype`: DT_FLOAT once decoded, the sink's dtype where left in place;
  // for the NaN check).
  void Received(Entry& e, int64_t size, DataType dtype, const char* values, int* completed);
  // Copies what `e` left in place into its sink: it takes no more in place.
  void StopBorrowing(Entry& e);
  absl::flat_hash_map<std::string, Entry> entries_;  // key: name, slot and first row
  int64_t remaining_bytes_ = 0;
  int borrowed_ = 0;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_TENSOR_CHUNKS_H_
