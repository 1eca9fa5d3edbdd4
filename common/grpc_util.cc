#include "common/grpc_util.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace psflow {
namespace {

constexpr int kFlowWindowBytes = 16 << 20;

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share the canonical numbering.
  auto code = static_cast<absl::StatusCode>(status.error_code());
  std::string message = status.error_message();
  if (message.empty()) message = "rpc failed";
  return absl::Status(code, message);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, bool own_connection) {
  grpc::ChannelArguments args;
  // A subchannel pool of the channel's own: no other channel reuses its connection.
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Reconnect quickly when a peer comes back: pods restart within seconds.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Weights and gradients move in megabytes per step: open the HTTP/2 flow
  // control window wide from the start instead of growing it per stream.
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kFlowWindowBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(int port, grpc::Service* service) {
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat("0.0.0.0:", port), grpc::InsecureServerCredentials(),
                           &bound);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kFlowWindowBytes);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // gRPC sets SO_REUSEPORT by default: a second process on a busy port would
  // then start "listening" too and the kernel would split connections
  // between the two. A port that is taken must be an error instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0)
    return absl::UnavailableError(
        absl::StrCat("cannot listen on port ", port, ": it is in use or not allowed"));
  return server;
}

ActiveCalls::Scope::Scope(ActiveCalls* calls, absl::Time deadline, bool wait_for_ready)
    : calls_(calls) {
  context_.set_deadline(absl::ToChronoTime(deadline));
  context_.set_wait_for_ready(wait_for_ready);
  absl::MutexLock lock(&calls_->mu_);
  if (calls_->cancelled_) {
    context_.TryCancel();
  } else {
    calls_->active_.insert(&context_);
  }
}

ActiveCalls::Scope::~Scope() {
  absl::MutexLock lock(&calls_->mu_);
  calls_->active_.erase(&context_);
}

void ActiveCalls::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* c : active_) c->TryCancel();
}

}  // namespace psflow
