// One client call of raw messages, driven step by step from the calling
// thread: over gRPC (RawCall, transport/chunk_messages.h) or through a
// same-host channel (ChannelCall, transport/call_channel.h). Each step blocks
// until it is done; a false step means the call is over, and Finish says
// why. Not thread-safe.
#ifndef PSFLOW_TRANSPORT_MESSAGE_CALL_H_
#define PSFLOW_TRANSPORT_MESSAGE_CALL_H_

#include <atomic>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

namespace psflow {

class MessageCall {
 public:
  virtual ~MessageCall() = default;
  // From now on the call is cancelled, within about 50 ms (a channel's:
  // 100 ms), once `*flag` holds (it must outlive the call).
  virtual void CancelWhen(const std::atomic<bool>* flag) = 0;
  virtual bool Write(const grpc::ByteBuffer& message) = 0;
  virtual bool WritesDone() = 0;
  // False at the end of the server's messages, or when the call failed.
  virtual bool Read(grpc::ByteBuffer* message) = 0;
  // Reads what is left of the server's messages, then the status.
  virtual grpc::Status Finish() = 0;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_MESSAGE_CALL_H_
