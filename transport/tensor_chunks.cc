#include "transport/tensor_chunks.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace psflow {
namespace {

std::string Key(const std::string& name, const std::string& slot, int64_t row_begin) {
  const std::string nul(1, '\0');
  return absl::StrCat(name, nul, slot, nul, row_begin);
}

// Bytes of one element of `dtype` on the wire; aborts for a dtype that is
// not a wire dtype (the caller's own refs and sinks: a broken invariant).
int64_t ElementBytes(DataType dtype) {
  const int64_t bytes = WireBytes(dtype);
  if (bytes == 0) PSLOG(FATAL) << "tensor of dtype " << DataType_Name(dtype) << " on the wire";
  return bytes;
}

}  // namespace

void WriteWireValues(const TensorRef& ref, int64_t begin, int64_t n, char* out) {
  if (n <= 0) return;
  const int64_t element = ElementBytes(ref.dtype);
  if (const char* at = WireValuesAt(ref, begin); at != nullptr) {
    std::memcpy(out, at, static_cast<size_t>(n * element));
  } else {
    EncodeFloats(ref.dtype, ref.data + begin, n, out);
  }
}

const char* WireValuesAt(const TensorRef& ref, int64_t begin) {
  if (ref.encoded != nullptr) {
    return static_cast<const char*>(ref.encoded) + begin * ElementBytes(ref.dtype);
  }
  if (ref.dtype == DT_FLOAT) return reinterpret_cast<const char*>(ref.data + begin);
  return nullptr;
}

bool WireValuesBelow(const TensorRef& ref, int64_t begin, int64_t n, float limit) {
  if (ref.encoded == nullptr) return AllBelow(ref.data + begin, n, limit);
  const char* const at = WireValuesAt(ref, begin);
  if (limit >= WireOverflow(ref.dtype)) return !AnyNonFiniteIn(ref.dtype, at, n);
  constexpr int64_t kBlock = 4096;
  float decoded[kBlock];
  const int64_t element = ElementBytes(ref.dtype);
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    DecodeFloats(ref.dtype, at + b * element, len, decoded);
    if (!AllBelow(decoded, len, limit)) return false;
  }
  return true;
}

absl::StatusOr<DataType> SinksDtype(absl::Span<const TensorSink> sinks) {
  if (sinks.empty()) return DT_FLOAT;
  const DataType dtype = sinks[0].dtype;
  for (const TensorSink& s : sinks) {
    if (s.dtype != dtype || WireBytes(s.dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sinks of dtype ", DataType_Name(dtype), " and ", DataType_Name(s.dtype)));
    }
  }
  return dtype;
}

ChunkSplitter::ChunkSplitter(std::vector<TensorRef> tensors, size_t max_bytes)
    : tensors_(std::move(tensors)), max_bytes_(std::max<size_t>(max_bytes, 4)) {
  for (const TensorRef& t : tensors_) ElementBytes(t.dtype);
}

bool ChunkSplitter::NextPieces(std::vector<ChunkPiece>* out) {
  if (tensor_ >= tensors_.size()) return false;
  size_t budget = max_bytes_;
  while (tensor_ < tensors_.size() && budget > 0) {
    const TensorRef& t = tensors_[tensor_];
    const int64_t element = WireBytes(t.dtype);
    const int64_t total = NumElements(t.shape) * element;
    // Cut on whole elements so each chunk can be applied on its own.
    int64_t take =
        std::min<int64_t>(total - offset_, static_cast<int64_t>(budget) / element * element);
    if (take <= 0 && total > 0) break;
    out->push_back({&t, offset_, take});
    offset_ += take;
    budget -= static_cast<size_t>(take);
    if (offset_ >= total) {
      ++tensor_;
      offset_ = 0;
    }
  }
  return true;
}

TensorChunk ChunkHeader(const ChunkPiece& piece) {
  const TensorRef& t = *piece.tensor;
  TensorChunk chunk;
  chunk.set_name(t.name);
  chunk.set_slot(t.slot);
  chunk.set_dtype(t.dtype);
  for (int64_t d : t.shape) chunk.add_shape(d);
  chunk.set_offset(piece.offset);
  chunk.set_row_begin(t.row_begin);
  return chunk;
}

bool ChunkSplitter::Next(google::protobuf::RepeatedPtrField<TensorChunk>* out) {
  std::vector<ChunkPiece> pieces;
  if (!NextPieces(&pieces)) return false;
  for (const ChunkPiece& piece : pieces) {
    TensorChunk* chunk = out->Add();
    *chunk = ChunkHeader(piece);
    const TensorRef& t = *piece.tensor;
    const int64_t element = WireBytes(t.dtype);
    // Encoded straight into the chunk where it is not in the wire dtype yet.
    std::string* data = chunk->mutable_data();
    data->resize(static_cast<size_t>(piece.bytes));
    WriteWireValues(t, piece.offset / element, piece.bytes / element, data->data());
  }
  return true;
}

float* SinkData(TensorSink& sink, int64_t elements) {
  if (sink.storage == nullptr) return sink.data;
  const size_t want = static_cast<size_t>(sink.grow ? elements : NumElements(sink.shape));
  if (sink.storage->size() < want) sink.storage->resize(want);
  return sink.storage->data();
}

ChunkAssembler::ChunkAssembler(std::vector<TensorSink> sinks) {
  for (size_t i = 0; i < sinks.size(); ++i) {
    TensorSink& s = sinks[i];
    Entry e;
    e.index = static_cast<int>(i);
    e.element_bytes = ElementBytes(s.dtype);
    e.bytes = NumElements(s.shape) * e.element_bytes;
    std::string key = Key(s.name, s.slot, s.row_begin);
    if (s.borrow != nullptr) *s.borrow = nullptr;
    e.sink = std::move(s);
    entries_[key] = std::move(e);
  }
  for (const auto& [key, e] : entries_) remaining_bytes_ += e.bytes;
}

absl::Status ChunkAssembler::Add(const TensorChunk& chunk) {
  int completed = -1;
  return Add(chunk, &completed);
}

absl::Status ChunkAssembler::Add(const TensorChunk& chunk, int* completed) {
  return AddFrom(
      chunk, static_cast<int64_t>(chunk.data().size()),
      [&](DataType dtype, int64_t elements, float* out) {
        DecodeFloats(dtype, chunk.data().data(), elements, out);
        return true;
      },
      completed);
}

absl::StatusOr<ChunkAssembler::Entry*> ChunkAssembler::Check(const TensorChunk& chunk,
                                                             int64_t size) {
  auto it = entries_.find(Key(chunk.name(), chunk.slot(), chunk.row_begin()));
  if (it == entries_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown tensor ", TensorDisplayName(chunk.name(), chunk.slot(), chunk.row_begin())));
  }
  Entry& e = it->second;
  auto what = [&] { return TensorDisplayName(chunk.name(), chunk.slot(), chunk.row_begin()); };
  if (chunk.dtype() != e.sink.dtype) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " has dtype ",
                                                   DataType_Name(chunk.dtype()), ", expected ",
                                                   DataType_Name(e.sink.dtype)));
  }
  if (!std::equal(chunk.shape().begin(), chunk.shape().end(), e.sink.shape.begin(),
                  e.sink.shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " has shape ",
                                                   ShapeString(chunk.shape()), ", expected ",
                                                   ShapeString(e.sink.shape)));
  }
  if (chunk.offset() != e.received) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " chunk at byte ",
                                                   chunk.offset(), ", expected byte ", e.received));
  }
  if (size < 0 || size > e.bytes - e.received || size % e.element_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", what(), " chunk of ", size,
                                                   " bytes does not fit: ", e.bytes - e.received,
                                                   " bytes remain"));
  }
  return &e;
}

void ChunkAssembler::Received(Entry& e, int64_t size, DataType dtype, const char* values,
                              int* completed) {
  if (e.sink.non_finite != nullptr &&
      AnyAtOrAboveIn(dtype, values, size / e.element_bytes, e.sink.magnitude_limit)) {
    *e.sink.non_finite = true;
  }
  e.received += size;
  remaining_bytes_ -= size;
  if (e.received == e.bytes) {
    *completed = e.index;
    if (e.in_place != nullptr) {
      *e.sink.borrow = e.in_place;
      ++borrowed_;
    }
  }
}

void ChunkAssembler::StopBorrowing(Entry& e) {
  if (e.in_place != nullptr) {
    DecodeFloats(e.sink.dtype, e.in_place, e.received / e.element_bytes,
                 SinkData(e.sink, e.received / e.element_bytes));
    e.in_place = nullptr;
  }
  e.sink.borrow = nullptr;
}

absl::Status ChunkAssembler::AddFrom(const TensorChunk& chunk, int64_t size, ChunkDecoder decode,
                                     int* completed) {
  *completed = -1;
  PSFLOW_ASSIGN_OR_RETURN(Entry * e, Check(chunk, size));
  StopBorrowing(*e);
  float* const data = SinkData(e->sink, (e->received + size) / e->element_bytes);
  float* const out = data + e->received / e->element_bytes;
  if (!decode(e->sink.dtype, size / e->element_bytes, out)) {
    return absl::DataLossError(
        absl::StrCat("tensor ", TensorDisplayName(chunk.name(), chunk.slot(), chunk.row_begin()),
                     " chunk data cut short"));
  }
  Received(*e, size, DT_FLOAT, reinterpret_cast<const char*>(out), completed);
  return absl::OkStatus();
}

absl::Status ChunkAssembler::AddInPlace(const TensorChunk& chunk, int64_t size, const char* from,
                                        int* completed) {
  *completed = -1;
  PSFLOW_ASSIGN_OR_RETURN(Entry * e, Check(chunk, size));
  const bool follows =
      e->received == 0
          ? reinterpret_cast<uintptr_t>(from) % static_cast<uintptr_t>(e->element_bytes) == 0
          : e->in_place + e->received == from;
  if (e->sink.borrow == nullptr || !follows) {
    StopBorrowing(*e);
    // The whole chunk fits (Check): decoded block by block, each checked
    // while it is in the cache.
    float* const data = SinkData(e->sink, (e->received + size) / e->element_bytes);
    int64_t done = 0;
    do {
      const int64_t take = std::min(kInPlaceBlockBytes, size - done);
      float* const out = data + e->received / e->element_bytes;
      DecodeFloats(e->sink.dtype, from + done, take / e->element_bytes, out);
      Received(*e, take, DT_FLOAT, reinterpret_cast<const char*>(out), completed);
      done += take;
    } while (done < size);
    return absl::OkStatus();
  }
  if (e->received == 0) e->in_place = from;
  // (Checked for NaN and infinity in the wire dtype, where the values lie.)
  Received(*e, size, e->sink.dtype, from, completed);
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Finish() const {
  for (const auto& [key, e] : entries_) {
    if (e.sink.required && e.received != e.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", TensorDisplayName(e.sink.name, e.sink.slot, e.sink.row_begin),
                       " incomplete: ", e.received, " of ", e.bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

bool ChunkAssembler::Complete(const std::string& name, const std::string& slot,
                              int64_t row_begin) const {
  auto it = entries_.find(Key(name, slot, row_begin));
  return it != entries_.end() && it->second.received == it->second.bytes;
}

}  // namespace psflow
