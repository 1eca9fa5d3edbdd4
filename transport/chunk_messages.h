// Messages of tensor chunks (PushRequest, PullResponse: a few small fields
// and a repeated TensorChunk field) as gRPC byte buffers, written and read
// without the copies that going through protobuf objects costs: a protobuf
// bytes field is a std::string, so sending one copies the tensor into the
// message and gRPC copies the message into its buffer, and receiving one
// copies the buffer into the message before the data reaches its tensor.
//
// Here the bytes on the wire are exactly protobuf's encoding of the message
// (either side may be a plain protobuf stub or service), but an fp32 chunk's
// data goes out as a gRPC slice pointing at the tensor itself, and a
// received chunk's data is decoded from gRPC's slices straight into its sink
// (one copy, or one conversion for a 16-bit wire dtype), checked by
// ChunkAssembler before any of it is read.
#ifndef PSFLOW_TRANSPORT_CHUNK_MESSAGES_H_
#define PSFLOW_TRANSPORT_CHUNK_MESSAGES_H_

#include <atomic>
#include <limits>
#include <memory>
#include <string>

#include <google/protobuf/message_lite.h>
#include <grpcpp/completion_queue.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "transport/message_call.h"
#include "transport/shared_region.h"
#include "transport/tensor_chunks.h"

namespace psflow {

// `fields` (its repeated chunk field, number `chunk_field`, left empty)
// followed by `pieces` as that field. DT_FLOAT data is not copied: the
// buffer's slices point into the pieces' tensors, and each holds a copy of
// `keep` until gRPC lets it go, so `keep` (a shared owner of the memory, or
// a handle whose last release the caller waits for) says how long the
// memory must stay unchanged. 16-bit data is encoded into the buffer.
grpc::ByteBuffer EncodeChunkMessage(const google::protobuf::MessageLite& fields, int chunk_field,
                                    absl::Span<const ChunkPiece> pieces,
                                    const std::shared_ptr<const void>& keep);

// As EncodeChunkMessage, for a call with a shared region (common/
// shared_region.h): each piece's data is written (fp32) or encoded (16-bit)
// into `region` from *cursor on (each piece at a multiple of 64 bytes;
// *cursor ends past the last), and its chunk carries only its place there
// (TensorChunk.shared_offset and shared_bytes). INVALID_ARGUMENT when the
// region is too small. With `all_below`, each block of the values is also
// checked (AllBelow) as it is copied, and *all_below made false for one
// that is not below `below` in magnitude.
absl::StatusOr<grpc::ByteBuffer> EncodeSharedChunkMessage(
    const google::protobuf::MessageLite& fields, int chunk_field,
    absl::Span<const ChunkPiece> pieces, SharedSpan region, int64_t* cursor,
    bool* all_below = nullptr, float below = std::numeric_limits<float>::infinity());

// As EncodeSharedChunkMessage, for pieces whose bytes already lie in
// `region` as they go on the wire (TensorRef data or encoded values placed
// there by their producer): each chunk names where its piece lies, and no
// byte is copied. INVALID_ARGUMENT for a piece that does not lie wholly in
// the region. With `all_below`, every value is checked (AllBelow) where it
// lies, and *all_below made false for one that is not below `below`.
absl::StatusOr<grpc::ByteBuffer> EncodeInPlaceChunkMessage(
    const google::protobuf::MessageLite& fields, int chunk_field,
    absl::Span<const ChunkPiece> pieces, SharedSpan region, bool* all_below = nullptr,
    float below = std::numeric_limits<float>::infinity());

// Whether the wire bytes of every tensor of `refs` lie wholly in `region`
// (WireValuesAt), so that EncodeInPlaceChunkMessage takes all their pieces.
bool AllLieIn(absl::Span<const TensorRef> refs, SharedSpan region);

// Reads one message written as above (or by protobuf itself). The fields
// other than the chunks are parsed into `fields` (cleared first); then
// `assembler()` is called once, when the first chunk comes (or at the end
// if none does), with the fields before it already in `fields`: those
// after it (protobuf writes fields in number order, so a field numbered
// above the chunks', such as PullResponse's clock, lag and ready, comes
// after them) are only added at the end. assembler() gives the assembler
// the chunks go to (null: chunks are refused) or an error that ends the
// read. Each chunk of field `chunk_field` goes to the
// assembler in turn, its data decoded straight from the buffer's slices into
// its sink, and `on_complete(i)` runs for each sink `i` a chunk completed (an
// error from it ends the read and is returned). A chunk's fields may come in
// any order: data that other fields follow (protobuf's own serializer puts
// row_begin after them) are copied out and decoded once the chunk has been
// read. *data_bytes adds up the chunks' data bytes. INVALID_ARGUMENT for
// bytes that are not the message's wire format, or for a chunk the assembler
// refuses. A chunk whose data lie in shared
// memory is decoded from `*region`, read when that chunk comes (so a
// reader may set it on seeing the first message's fields); it is
// INVALID_ARGUMENT without a region, or reaching outside it.
absl::Status ReadChunkMessage(grpc::ByteBuffer* buffer, int chunk_field,
                              google::protobuf::MessageLite* fields,
                              absl::FunctionRef<absl::StatusOr<ChunkAssembler*>()> assembler,
                              absl::FunctionRef<absl::Status(int)> on_complete, int64_t* data_bytes,
                              const SharedSpan* region = nullptr);

// One client call of raw messages over gRPC (any of the four kinds, on a
// grpc::GenericStub), driven from the calling thread on a completion queue
// of its own (see MessageCall).
class RawCall final : public MessageCall {
 public:
  // `method` is the full name, "/package.Service/Method"; `context` (its
  // deadline, metadata) must outlive the call.
  RawCall(grpc::GenericStub* stub, grpc::ClientContext* context, const std::string& method);
  // Finishes the call if Finish was not called (cancelling it first).
  ~RawCall() override;
  RawCall(const RawCall&) = delete;
  RawCall& operator=(const RawCall&) = delete;

  void CancelWhen(const std::atomic<bool>* flag) override { cancel_when_ = flag; }
  bool Write(const grpc::ByteBuffer& message) override;
  bool WritesDone() override;
  bool Read(grpc::ByteBuffer* message) override;
  grpc::Status Finish() override;

 private:
  bool Wait();

  grpc::ClientContext* context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
  const std::atomic<bool>* cancel_when_ = nullptr;
  bool cancelled_ = false;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_CHUNK_MESSAGES_H_
