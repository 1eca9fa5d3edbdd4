// A ps's side of one same-host channel (transport/call_channel.h): a thread
// that takes a worker's calls off the channel and runs each through the
// same reactor as a gRPC call of that method (ps/service.cc instantiates
// its Push and Pull reactors on the bases below as well as on gRPC's).
//
// The bases mirror grpc::ServerReadReactor and grpc::ServerWriteReactor:
// StartRead, StartWrite and Finish may be called from any thread; the
// reactions (OnReadDone, OnWriteDone, OnCancel, OnDone) run on the
// channel's thread, one at a time, and OnDone last. A write goes into the
// channel at once (the worker is woken by it, not by a thread of gRPC's);
// its OnWriteDone follows on the channel's thread. After a cancel (the
// worker's, its deadline, its process gone, or Stop) a read in flight ends
// with OnReadDone(false).
#ifndef PSFLOW_TRANSPORT_CHANNEL_SERVER_H_
#define PSFLOW_TRANSPORT_CHANNEL_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "transport/call_channel.h"
#include "transport/shared_region.h"

namespace psflow {

class ChannelServer;

// A call's reactor: the reactions the channel's thread calls, as gRPC's
// reactors name them (a read reactor's writes and a write reactor's reads
// never complete, so those stay empty).
class ChannelReactor {
 public:
  virtual ~ChannelReactor() = default;
  ChannelReactor(const ChannelReactor&) = delete;
  ChannelReactor& operator=(const ChannelReactor&) = delete;
  virtual void OnReadDone(bool ok) {}
  virtual void OnWriteDone(bool ok) {}
  virtual void OnCancel() {}
  virtual void OnDone() = 0;

 protected:
  // Becomes the host's call in flight.
  explicit ChannelReactor(ChannelServer* host);
  // Writes the answer's status (after `response`, if not null and the status
  // is OK) and lets the host call OnDone; once.
  void FinishCall(const grpc::Status& status, const grpc::ByteBuffer* response);

  ChannelServer* const host_;

 private:
  std::atomic<bool> finished_{false};
};

// A client-streaming call (Push): messages in, one answer out.
class ChannelReadReactor : public ChannelReactor {
 public:
  explicit ChannelReadReactor(ChannelServer* host) : ChannelReactor(host) {}
  // The answer sent before an OK status (none unless set); it must live
  // until OnDone.
  void SetResponse(const grpc::ByteBuffer* response) { response_ = response; }
  void StartRead(grpc::ByteBuffer* message);
  void Finish(const grpc::Status& status) { FinishCall(status, response_); }

 private:
  const grpc::ByteBuffer* response_ = nullptr;
};

// A server-streaming call (Pull): its request comes with the call (the
// factory is given it), messages out.
class ChannelWriteReactor : public ChannelReactor {
 public:
  explicit ChannelWriteReactor(ChannelServer* host) : ChannelReactor(host) {}
  void StartWrite(const grpc::ByteBuffer* message);
  void Finish(const grpc::Status& status) { FinishCall(status, nullptr); }
};

class ChannelServer {
 public:
  // Makes the reactor of a call that starts, which it must (the reactor
  // registers itself with the host through its base's constructor; it
  // ends the call itself where the request is bad): `request` is a Pull's
  // request, null for a Push. `peer` names the caller, as gRPC's peer does.
  using StartCall =
      std::function<void(ChannelServer* host, ChannelMethod method, const std::string& peer,
                         absl::Time deadline, const grpc::ByteBuffer* request)>;

  // Serves `end` (mapped by `mapping`, kept until the thread ends) on a
  // thread of its own: a channel is a connection, which waits on its
  // doorbell for as long as the worker keeps it open.
  ChannelServer(std::unique_ptr<ChannelEnd> end, std::shared_ptr<const SharedMapping> mapping,
                std::string peer, StartCall start);
  // Stops, then waits for the thread.
  ~ChannelServer();
  ChannelServer(const ChannelServer&) = delete;
  ChannelServer& operator=(const ChannelServer&) = delete;

  // Cancels the call in flight and closes the channel; the thread ends once
  // that call is done.
  void Stop();
  // The thread has ended (the channel closed, its peer gone, or Stop).
  bool ended() const { return ended_.load(); }
  const std::string& peer() const { return peer_; }

 private:
  friend class ChannelReactor;
  friend class ChannelReadReactor;
  friend class ChannelWriteReactor;
  struct Event {
    enum Kind { kWriteDone, kDone } kind;
    bool ok;
  };

  void Register(ChannelReactor* reactor) ABSL_LOCKS_EXCLUDED(mu_);
  void WantRead(grpc::ByteBuffer* into) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes a record of the current call; false if it could not.
  bool WriteRecord(ChannelEnd::Kind kind, absl::string_view payload) ABSL_LOCKS_EXCLUDED(write_mu_);
  bool WriteMessage(const grpc::ByteBuffer& message) ABSL_LOCKS_EXCLUDED(write_mu_);
  // Queues an event for the thread (and wakes it when posted from another).
  void Post(Event event) ABSL_LOCKS_EXCLUDED(mu_);

  void Loop();
  // Handles one record of the worker's; false when the channel must close.
  bool Handle(ChannelEnd::Record record);
  // Starts the call in call_ (until deadline_) through start_.
  void Begin(ChannelMethod method, const grpc::ByteBuffer* request);
  // Cancels the call in flight, once.
  void Cancel();

  const std::unique_ptr<ChannelEnd> end_;
  const std::shared_ptr<const SharedMapping> mapping_;
  const std::string peer_;
  const StartCall start_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> ended_{false};

  absl::Mutex write_mu_;  // one writer of the channel at a time
  absl::Mutex mu_;
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  ChannelReactor* active_ ABSL_GUARDED_BY(mu_) = nullptr;
  grpc::ByteBuffer* read_into_ ABSL_GUARDED_BY(mu_) = nullptr;  // a read in flight
  // The rest is the thread's own.
  std::vector<Event> taken_;                      // events_ swapped out (keeps its capacity)
  uint64_t call_ = 0;                             // the number of the call in flight (or last)
  absl::Time deadline_;                           // its deadline
  bool cancelled_ = false;                        // it was cancelled
  bool writes_done_ = false;                      // its worker half-closed
  bool is_writer_ = false;                        // it is a Pull (reads only its request)
  bool awaiting_request_ = false;                 // a Pull started, its request not yet in
  std::optional<ChannelEnd::Record> next_start_;  // came before the last call was done
  std::thread thread_;
};

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_CHANNEL_SERVER_H_
