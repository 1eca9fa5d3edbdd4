#include "transport/channel_server.h"

#include <pthread.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace psflow {
namespace {

// How long after its deadline a call in flight is cancelled here (the
// worker's side ends it at the deadline itself).
constexpr absl::Duration kDeadlineGrace = absl::Milliseconds(100);
// The most time a write of the answer's last records may wait for room.
constexpr absl::Duration kFinishWrite = absl::Seconds(5);

}  // namespace

ChannelReactor::ChannelReactor(ChannelServer* host) : host_(host) { host_->Register(this); }

void ChannelReactor::FinishCall(const grpc::Status& status, const grpc::ByteBuffer* response) {
  if (finished_.exchange(true)) return;
  if (status.ok() && response != nullptr) host_->WriteMessage(*response);
  host_->WriteRecord(ChannelEnd::kFinish, EncodeFinish(status));
  host_->Post({ChannelServer::Event::kDone, true});
}

void ChannelReadReactor::StartRead(grpc::ByteBuffer* message) { host_->WantRead(message); }

void ChannelWriteReactor::StartWrite(const grpc::ByteBuffer* message) {
  const bool ok = host_->WriteMessage(*message);
  host_->Post({ChannelServer::Event::kWriteDone, ok});
}

ChannelServer::ChannelServer(std::unique_ptr<ChannelEnd> end,
                             std::shared_ptr<const SharedMapping> mapping, std::string peer,
                             StartCall start)
    : end_(std::move(end)),
      mapping_(std::move(mapping)),
      peer_(std::move(peer)),
      start_(std::move(start)) {
  thread_ = std::thread([this] { Loop(); });
}

ChannelServer::~ChannelServer() {
  Stop();
  if (thread_.joinable()) thread_.join();
}

void ChannelServer::Stop() {
  stopping_ = true;
  end_->RingSelf();
}

void ChannelServer::Register(ChannelReactor* reactor) {
  absl::MutexLock lock(&mu_);
  active_ = reactor;
}

void ChannelServer::WantRead(grpc::ByteBuffer* into) {
  {
    absl::MutexLock lock(&mu_);
    read_into_ = into;
  }
  end_->RingSelf();
}

bool ChannelServer::WriteRecord(ChannelEnd::Kind kind, absl::string_view payload) {
  absl::MutexLock lock(&write_mu_);
  return end_->Write(kind, call_, payload, absl::Now() + kFinishWrite).ok();
}

bool ChannelServer::WriteMessage(const grpc::ByteBuffer& message) {
  absl::MutexLock lock(&write_mu_);
  return end_->WriteMessage(call_, message, std::max(deadline_, absl::Now() + kFinishWrite)).ok();
}

void ChannelServer::Post(Event event) {
  {
    absl::MutexLock lock(&mu_);
    events_.push_back(event);
  }
  end_->RingSelf();
}

void ChannelServer::Cancel() {
  if (cancelled_) return;
  cancelled_ = true;
  ChannelReactor* active;
  {
    absl::MutexLock lock(&mu_);
    active = active_;
  }
  if (active != nullptr) active->OnCancel();
}

void ChannelServer::Begin(ChannelMethod method, const grpc::ByteBuffer* request) {
  start_(this, method, peer_, deadline_, request);
}

bool ChannelServer::Handle(ChannelEnd::Record record) {
  switch (record.kind) {
    case ChannelEnd::kStart: {
      {
        absl::MutexLock lock(&mu_);
        if (active_ != nullptr) {
          // The worker saw the last call's status before its OnDone ran here.
          if (next_start_.has_value()) return false;
          next_start_ = std::move(record);
          return true;
        }
      }
      uint8_t method = 0;
      absl::Time deadline;
      if (!DecodeStart(record.payload, &method, &deadline).ok()) return false;
      call_ = record.call;
      deadline_ = deadline;
      cancelled_ = false;
      writes_done_ = false;
      awaiting_request_ = false;
      if (method == static_cast<uint8_t>(ChannelMethod::kPush)) {
        is_writer_ = false;
        Begin(ChannelMethod::kPush, nullptr);
      } else if (method == static_cast<uint8_t>(ChannelMethod::kPull)) {
        is_writer_ = true;
        awaiting_request_ = true;
      } else {
        WriteRecord(ChannelEnd::kFinish,
                    EncodeFinish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                              absl::StrCat("no channel method ", method))));
      }
      return true;
    }
    case ChannelEnd::kMessage: {
      if (record.call != call_) return true;  // what is left of an earlier call
      if (awaiting_request_) {
        awaiting_request_ = false;
        const grpc::ByteBuffer request = MessageBuffer(record.payload);
        Begin(ChannelMethod::kPull, &request);
        return true;
      }
      ChannelReactor* active;
      grpc::ByteBuffer* into;
      {
        absl::MutexLock lock(&mu_);
        active = active_;
        into = read_into_;
        read_into_ = nullptr;
      }
      // The call ended early (a push refused at its header): the rest of
      // its messages go unread.
      if (active == nullptr) return true;
      // Messages are taken off the ring only while a read waits for one: a
      // message for a Pull past its request, or after the half-close, is
      // the worker's error.
      if (into == nullptr || writes_done_) return false;
      *into = MessageBuffer(record.payload);
      active->OnReadDone(true);
      return true;
    }
    case ChannelEnd::kWritesDone: {
      if (record.call != call_) return true;
      writes_done_ = true;
      return true;
    }
    case ChannelEnd::kCancel: {
      if (record.call != call_) return true;
      awaiting_request_ = false;
      Cancel();
      return true;
    }
    case ChannelEnd::kFinish:
      return false;  // a server's record from the worker
  }
  return false;
}

void ChannelServer::Loop() {
  pthread_setname_np(pthread_self(), "ps-channel");  // (not the opener's gRPC name)
  bool closing = false;  // the channel ends once the call in flight is done
  while (true) {
    const uint32_t seen = end_->bell();
    bool progressed = false;
    ChannelReactor* active;
    bool read_wanted;
    taken_.clear();
    {
      absl::MutexLock lock(&mu_);
      taken_.swap(events_);
      active = active_;
      read_wanted = read_into_ != nullptr;
    }
    for (const Event& e : taken_) {
      progressed = true;
      if (active == nullptr) continue;
      if (e.kind == Event::kWriteDone) {
        active->OnWriteDone(e.ok && !cancelled_);
      } else {
        {
          absl::MutexLock lock(&mu_);
          active_ = nullptr;
          read_into_ = nullptr;
        }
        active->OnDone();  // the reactor deletes itself
        active = nullptr;
        read_wanted = false;
      }
    }
    if (active == nullptr && next_start_.has_value() && !closing) {
      ChannelEnd::Record start = *std::move(next_start_);
      next_start_.reset();
      if (!Handle(std::move(start))) closing = true;
      continue;
    }
    if (progressed) continue;
    // A read that cannot be answered any more ends.
    if (active != nullptr && read_wanted && (cancelled_ || writes_done_)) {
      {
        absl::MutexLock lock(&mu_);
        read_into_ = nullptr;
      }
      active->OnReadDone(false);
      continue;
    }
    // The worker's records are taken while a call can use them: none in
    // flight, a Pull's (its request, a cancel), or a Push's read.
    if (!closing && (active == nullptr || is_writer_ || awaiting_request_ || read_wanted)) {
      absl::StatusOr<std::optional<ChannelEnd::Record>> record = end_->TryRead();
      if (!record.ok()) {
        if (!absl::IsUnavailable(record.status())) {
          PSLOG(WARNING) << peer_ << ": " << record.status().message();
        }
        closing = true;
      } else if (record->has_value()) {
        if (!Handle(**std::move(record))) {
          PSLOG(WARNING) << peer_ << " broke the channel's protocol: closing it";
          closing = true;
        }
        continue;
      }
    }
    if (!closing && (stopping_ || end_->closed() || end_->peer_gone())) closing = true;
    if (closing) {
      end_->Close();
      Cancel();
      if (active == nullptr) break;
    } else if (active != nullptr && !cancelled_ && absl::Now() > deadline_ + kDeadlineGrace) {
      Cancel();
      continue;
    }
    end_->Wait(seen, kPeerCheck);
  }
  ended_ = true;
}

}  // namespace psflow
