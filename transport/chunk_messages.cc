#include "transport/chunk_messages.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "common/status_macros.h"

namespace psflow {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

// Data this small is copied with the bytes around it: a slice of its own
// costs more than the copy.
constexpr int64_t kCopyBelowBytes = 4096;

// EncodeSharedChunkMessage checks and copies values in blocks of this many
// (64 KiB of fp32).
constexpr int64_t kCheckBlockFloats = 16 << 10;

// TensorChunk's field numbers (proto/tensor.proto).
enum ChunkField : int {
  kName = 1,
  kSlot = 2,
  kDtype = 3,
  kShape = 4,
  kOffset = 5,
  kData = 6,
  kSharedOffset = 7,
  kSharedBytes = 8,
  kRowBegin = 9,
};

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

int VarintSize(uint64_t v) {
  int n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void AppendLengthTag(int field, std::string* out) {
  AppendVarint(static_cast<uint64_t>(field) << 3 | WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
}

// Appends `chunk`, a whole TensorChunk with no data bytes (its data lie in
// a shared region), as field `chunk_field`.
void AppendPlacedChunk(int chunk_field, const TensorChunk& chunk, std::string* out) {
  const std::string header = chunk.SerializeAsString();
  AppendLengthTag(chunk_field, out);
  AppendVarint(header.size(), out);
  *out += header;
}

// `bytes` as a byte buffer of one slice.
grpc::ByteBuffer OneSlice(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

void ReleaseKeep(void* keep) { delete static_cast<std::shared_ptr<const void>*>(keep); }

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what));
}

// Reads `n` elements of `dtype` from `in` into `out` as fp32.
bool ReadFloats(CodedInputStream& in, DataType dtype, int64_t n, float* out) {
  if (dtype == DT_FLOAT) return in.ReadRaw(out, static_cast<int>(n * 4));
  while (n > 0) {
    const void* data = nullptr;
    int size = 0;
    if (!in.GetDirectBufferPointer(&data, &size)) return false;
    const int64_t take = std::min<int64_t>(size / 2, n);
    if (take == 0) {  // one element across two of gRPC's slices
      char two[2];
      if (!in.ReadRaw(two, 2)) return false;
      DecodeFloats(dtype, two, 1, out);
      ++out;
      --n;
      continue;
    }
    DecodeFloats(dtype, static_cast<const char*>(data), take, out);
    in.Skip(static_cast<int>(take * 2));
    out += take;
    n -= take;
  }
  return true;
}

bool ReadString(CodedInputStream& in, uint32_t tag, std::string* out) {
  return WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED &&
         WireFormatLite::ReadString(&in, out);
}

// A varint field's value; false where the field is not a varint or is cut
// short.
bool ReadVarint(CodedInputStream& in, uint32_t tag, uint64_t* v) {
  return WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_VARINT &&
         in.ReadVarint64(v);
}

// The shape field: packed, or one dimension.
bool ReadShape(CodedInputStream& in, uint32_t tag, TensorChunk* header) {
  uint64_t v = 0;
  const auto wire = WireFormatLite::GetTagWireType(tag);
  if (wire == WireFormatLite::WIRETYPE_VARINT) {
    if (!in.ReadVarint64(&v)) return false;
    header->add_shape(static_cast<int64_t>(v));
    return true;
  }
  uint32_t length = 0;
  // A limit can only shorten the chunk's: a longer one is a lie.
  if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !in.ReadVarint32(&length) ||
      static_cast<int64_t>(length) > in.BytesUntilLimit()) {
    return false;
  }
  const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
  while (in.BytesUntilLimit() > 0) {
    if (!in.ReadVarint64(&v)) return false;
    header->add_shape(static_cast<int64_t>(v));
  }
  in.PopLimit(limit);
  return true;
}

// One field of a chunk other than its data, into `header` (an unknown one
// skipped); `*shared` set by a place in shared memory.
absl::Status ReadChunkField(CodedInputStream& in, uint32_t tag, TensorChunk* header, bool* shared) {
  uint64_t v = 0;
  switch (WireFormatLite::GetTagFieldNumber(tag)) {
    case kName:
      return ReadString(in, tag, header->mutable_name()) ? absl::OkStatus()
                                                         : Malformed("chunk name");
    case kSlot:
      return ReadString(in, tag, header->mutable_slot()) ? absl::OkStatus()
                                                         : Malformed("chunk slot");
    case kDtype:
      if (!ReadVarint(in, tag, &v)) return Malformed("chunk dtype");
      // An unknown value fits no sink: the assembler refuses DT_INVALID.
      header->set_dtype(DataType_IsValid(static_cast<int>(v)) ? static_cast<DataType>(v)
                                                              : DT_INVALID);
      return absl::OkStatus();
    case kShape:
      return ReadShape(in, tag, header) ? absl::OkStatus() : Malformed("chunk shape");
    case kOffset:
      if (!ReadVarint(in, tag, &v)) return Malformed("chunk offset");
      header->set_offset(static_cast<int64_t>(v));
      return absl::OkStatus();
    case kRowBegin:
      if (!ReadVarint(in, tag, &v)) return Malformed("chunk row");
      header->set_row_begin(static_cast<int64_t>(v));
      return absl::OkStatus();
    case kSharedOffset:
      if (!ReadVarint(in, tag, &v)) return Malformed("chunk's shared place");
      *shared = true;
      header->set_shared_offset(static_cast<int64_t>(v));
      return absl::OkStatus();
    case kSharedBytes:
      if (!ReadVarint(in, tag, &v)) return Malformed("chunk's shared place");
      *shared = true;
      header->set_shared_bytes(static_cast<int64_t>(v));
      return absl::OkStatus();
    default:
      return WireFormatLite::SkipField(&in, tag) ? absl::OkStatus() : Malformed("chunk field");
  }
}

// What ReadChunk hands a chunk's data to.
struct ChunkTarget {
  ChunkAssembler* assembler;
  absl::FunctionRef<absl::Status(int)> on_complete;
  int64_t* data_bytes;
};

// A chunk whose data lie in the call's region (within it, or the chunk is
// refused), left there.
absl::Status AddShared(const TensorChunk& header, const SharedSpan* region, ChunkTarget target) {
  const int64_t at = header.shared_offset(), size = header.shared_bytes();
  if (region == nullptr || region->data == nullptr) {
    return absl::InvalidArgumentError("a chunk in shared memory, but the call has no region");
  }
  if (at < 0 || size < 0 || at > region->size || size > region->size - at) {
    return absl::InvalidArgumentError(absl::StrCat("a chunk of ", size, " bytes at byte ", at,
                                                   " of a shared region of ", region->size));
  }
  *target.data_bytes += size;
  int completed = -1;
  absl::Status s = target.assembler->AddInPlace(header, size, region->data + at, &completed);
  if (s.ok() && completed >= 0) s = target.on_complete(completed);
  return s;
}

// A chunk whose data (if any) came whole into `header`, its every field known.
absl::Status AddHeld(const TensorChunk& header, ChunkTarget target) {
  *target.data_bytes += static_cast<int64_t>(header.data().size());
  int completed = -1;
  absl::Status s = target.assembler->Add(header, &completed);
  if (s.ok() && completed >= 0) s = target.on_complete(completed);
  return s;
}

// One TensorChunk, `in` limited to it. Its fields may come in any order, as
// protobuf allows: psflow's writers put the data last, and the data are
// decoded straight from the buffer into their sink; data that other fields
// follow (protobuf's own serializer writes row_begin, field 9, after the
// data, field 6) are held in `header` until every field is known.
absl::Status ReadChunk(CodedInputStream& in, ChunkTarget target, const SharedSpan* region) {
  TensorChunk header;
  bool data_seen = false;  // a data field came, held in `header` or decoded
  bool decoded = false;    // the last field was the data, decoded into its sink
  bool shared = false;     // a shared offset or size came
  while (const uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    if ((data_seen && (field == kSharedOffset || field == kSharedBytes)) ||
        (field == kData && shared)) {
      return absl::InvalidArgumentError("a chunk has both data and a place in shared memory");
    }
    if (field != kData) {
      PSFLOW_RETURN_IF_ERROR(ReadChunkField(in, tag, &header, &shared));
      continue;
    }
    uint32_t length = 0;
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
        !in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
      return Malformed("chunk data");
    }
    data_seen = true;
    if (static_cast<int64_t>(length) < in.BytesUntilLimit()) {
      // Fields follow: a later data field replaces this one, as in protobuf.
      if (!in.ReadString(header.mutable_data(), static_cast<int>(length))) {
        return Malformed("chunk data");
      }
      continue;
    }
    header.clear_data();  // this last data field is the chunk's
    *target.data_bytes += length;
    int completed = -1;
    absl::Status s = target.assembler->AddFrom(
        header, length,
        [&](DataType dtype, int64_t n, float* out) { return ReadFloats(in, dtype, n, out); },
        &completed);
    // Data cut short is bytes that are not the wire format.
    if (absl::IsDataLoss(s)) return Malformed("chunk data");
    if (s.ok() && completed >= 0) s = target.on_complete(completed);
    if (!s.ok()) return s;
    decoded = true;
  }
  // A chunk that ends before its length: the message was cut short.
  if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() > 0) return Malformed("chunk");
  if (decoded) return absl::OkStatus();
  if (shared) return AddShared(header, region, target);
  // The data held, or none (proto3 leaves out empty bytes: a chunk of no data).
  return AddHeld(header, target);
}

}  // namespace

grpc::ByteBuffer EncodeChunkMessage(const google::protobuf::MessageLite& fields, int chunk_field,
                                    absl::Span<const ChunkPiece> pieces,
                                    const std::shared_ptr<const void>& keep) {
  std::vector<grpc::Slice> slices;
  std::string pending = fields.SerializeAsString();
  auto flush = [&] {
    if (pending.empty()) return;
    slices.emplace_back(pending);
    pending.clear();
  };
  for (const ChunkPiece& piece : pieces) {
    const TensorRef& t = *piece.tensor;
    const std::string header = ChunkHeader(piece).SerializeAsString();
    int64_t chunk_bytes = static_cast<int64_t>(header.size());
    if (piece.bytes > 0) chunk_bytes += 1 + VarintSize(piece.bytes) + piece.bytes;
    AppendLengthTag(chunk_field, &pending);
    AppendVarint(chunk_bytes, &pending);
    pending += header;
    if (piece.bytes == 0) continue;
    AppendLengthTag(kData, &pending);
    AppendVarint(piece.bytes, &pending);
    const int64_t element = WireBytes(t.dtype);
    const int64_t first = piece.offset / element;
    const int64_t n = piece.bytes / element;
    if (piece.bytes < kCopyBelowBytes) {
      const size_t at = pending.size();
      pending.resize(at + piece.bytes);
      WriteWireValues(t, first, n, pending.data() + at);
      continue;
    }
    flush();
    if (const char* lying = WireValuesAt(t, first); lying != nullptr) {
      grpc_slice borrowed =
          grpc_slice_new_with_user_data(const_cast<char*>(lying), static_cast<size_t>(piece.bytes),
                                        ReleaseKeep, new std::shared_ptr<const void>(keep));
      slices.emplace_back(borrowed, grpc::Slice::STEAL_REF);
    } else {
      grpc_slice encoded = grpc_slice_malloc(static_cast<size_t>(piece.bytes));
      WriteWireValues(t, first, n, reinterpret_cast<char*>(GRPC_SLICE_START_PTR(encoded)));
      slices.emplace_back(encoded, grpc::Slice::STEAL_REF);
    }
  }
  flush();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::StatusOr<grpc::ByteBuffer> EncodeSharedChunkMessage(
    const google::protobuf::MessageLite& fields, int chunk_field,
    absl::Span<const ChunkPiece> pieces, SharedSpan region, int64_t* cursor, bool* all_below,
    float below) {
  std::string out = fields.SerializeAsString();
  for (const ChunkPiece& piece : pieces) {
    const TensorRef& t = *piece.tensor;
    TensorChunk chunk = ChunkHeader(piece);
    if (piece.bytes > 0) {
      const int64_t at = (*cursor + kSharedAlign - 1) / kSharedAlign * kSharedAlign;
      if (at > region.size || piece.bytes > region.size - at) {
        return absl::InvalidArgumentError(absl::StrCat("a shared region of ", region.size,
                                                       " bytes is too small for ", t.name, ": ",
                                                       piece.bytes, " bytes at byte ", at));
      }
      const int64_t element = WireBytes(t.dtype);
      const int64_t first = piece.offset / element;
      const int64_t n = piece.bytes / element;
      // In blocks that stay in the cache between the check and the copy.
      for (int64_t b = 0; b < n; b += kCheckBlockFloats) {
        const int64_t len = std::min(kCheckBlockFloats, n - b);
        if (all_below != nullptr && *all_below && !WireValuesBelow(t, first + b, len, below)) {
          *all_below = false;
        }
        WriteWireValues(t, first + b, len, region.data + at + b * element);
      }
      chunk.set_shared_offset(at);
      chunk.set_shared_bytes(piece.bytes);
      *cursor = at + piece.bytes;
    }
    AppendPlacedChunk(chunk_field, chunk, &out);
  }
  return OneSlice(out);
}

namespace {

// Where `bytes` bytes at `at` lie in `region` (-1: not wholly inside it).
int64_t OffsetIn(SharedSpan region, const char* at, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(region.data);
  const auto p = reinterpret_cast<uintptr_t>(at);
  if (at == nullptr || p < begin || p - begin > static_cast<uintptr_t>(region.size)) return -1;
  const auto offset = static_cast<int64_t>(p - begin);
  return bytes <= region.size - offset ? offset : -1;
}

}  // namespace

absl::StatusOr<grpc::ByteBuffer> EncodeInPlaceChunkMessage(
    const google::protobuf::MessageLite& fields, int chunk_field,
    absl::Span<const ChunkPiece> pieces, SharedSpan region, bool* all_below, float below) {
  std::string out = fields.SerializeAsString();
  for (const ChunkPiece& piece : pieces) {
    const TensorRef& t = *piece.tensor;
    TensorChunk chunk = ChunkHeader(piece);
    if (piece.bytes > 0) {
      const int64_t element = WireBytes(t.dtype);
      const int64_t first = piece.offset / element;
      const int64_t at = OffsetIn(region, WireValuesAt(t, first), piece.bytes);
      if (at < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("bytes ", piece.offset, " to ", piece.offset + piece.bytes, " of ", t.name,
                         " do not lie in the shared region they are to be sent from"));
      }
      if (all_below != nullptr && *all_below &&
          !WireValuesBelow(t, first, piece.bytes / element, below)) {
        *all_below = false;
      }
      chunk.set_shared_offset(at);
      chunk.set_shared_bytes(piece.bytes);
    }
    AppendPlacedChunk(chunk_field, chunk, &out);
  }
  return OneSlice(out);
}

bool AllLieIn(absl::Span<const TensorRef> refs, SharedSpan region) {
  for (const TensorRef& t : refs) {
    const int64_t n = NumElements(t.shape);
    if (n > 0 && OffsetIn(region, WireValuesAt(t, 0), n * WireBytes(t.dtype)) < 0) return false;
  }
  return true;
}

absl::Status ReadChunkMessage(grpc::ByteBuffer* buffer, int chunk_field,
                              google::protobuf::MessageLite* fields,
                              absl::FunctionRef<absl::StatusOr<ChunkAssembler*>()> assembler,
                              absl::FunctionRef<absl::Status(int)> on_complete, int64_t* data_bytes,
                              const SharedSpan* region) {
  fields->Clear();
  grpc::ProtoBufferReader reader(buffer);
  if (!reader.status().ok()) return Malformed("unreadable buffer");
  CodedInputStream in(&reader);
  std::string others;  // every field but the chunks, as they came
  size_t parsed = 0;   // of `others`, into `fields`
  ChunkAssembler* target = nullptr;
  bool asked = false;  // assembler() was called
  auto ask = [&]() -> absl::Status {
    if (!fields->ParseFromString(others)) return Malformed("fields");
    parsed = others.size();
    asked = true;
    absl::StatusOr<ChunkAssembler*> got = assembler();
    if (!got.ok()) return got.status();
    target = *got;
    return absl::OkStatus();
  };
  while (const uint32_t tag = in.ReadTag()) {
    if (WireFormatLite::GetTagFieldNumber(tag) == chunk_field &&
        WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      if (!asked) {
        if (absl::Status s = ask(); !s.ok()) return s;
      }
      if (target == nullptr) return absl::InvalidArgumentError("no chunks are expected here");
      uint32_t length = 0;
      // protobuf ignores a negative limit: a length past INT_MAX would lift it.
      if (!in.ReadVarint32(&length) || length > static_cast<uint32_t>(INT_MAX)) {
        return Malformed("chunk length");
      }
      const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
      absl::Status s = ReadChunk(in, {target, on_complete, data_bytes}, region);
      if (!s.ok()) return s;
      in.PopLimit(limit);
    } else {
      StringOutputStream others_stream(&others);
      CodedOutputStream out(&others_stream);
      if (!WireFormatLite::SkipField(&in, tag, &out)) return Malformed("field");
    }
  }
  if (!in.ConsumedEntireMessage()) return Malformed("message");
  if (!asked) return ask();
  if (others.size() > parsed && !fields->MergeFromString(others.substr(parsed))) {
    return Malformed("fields");
  }
  return absl::OkStatus();
}

RawCall::RawCall(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method)
    : context_(context) {
  call_ = stub->PrepareCall(context, method, &cq_);
  call_->StartCall(this);
  started_ = Wait();
}

RawCall::~RawCall() {
  if (!finished_) {
    context_->TryCancel();
    Finish();
  }
  cq_.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq_.Next(&tag, &ok)) {
  }
}

bool RawCall::Wait() {
  void* tag = nullptr;
  bool ok = false;
  if (cancel_when_ == nullptr) return cq_.Next(&tag, &ok) && ok;
  while (true) {
    switch (cq_.AsyncNext(&tag, &ok,
                          std::chrono::system_clock::now() + std::chrono::milliseconds(50))) {
      case grpc::CompletionQueue::GOT_EVENT:
        return ok;
      case grpc::CompletionQueue::SHUTDOWN:
        return false;
      case grpc::CompletionQueue::TIMEOUT:
        if (!cancelled_ && cancel_when_->load()) {
          cancelled_ = true;
          context_->TryCancel();  // the operation then ends, not ok
        }
        break;
    }
  }
}

bool RawCall::Write(const grpc::ByteBuffer& message) {
  if (!started_) return false;
  call_->Write(message, this);
  return Wait();
}

bool RawCall::WritesDone() {
  if (!started_) return false;
  call_->WritesDone(this);
  return Wait();
}

bool RawCall::Read(grpc::ByteBuffer* message) {
  if (!started_) return false;
  call_->Read(message, this);
  return Wait();
}

grpc::Status RawCall::Finish() {
  grpc::Status status;
  finished_ = true;
  call_->Finish(&status, this);
  Wait();
  return status;
}

}  // namespace psflow
