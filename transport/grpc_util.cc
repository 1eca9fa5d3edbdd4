#include "transport/grpc_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/match.h"
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

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address, Role peer,
                                           const SecurityOptions& security, bool own_connection) {
  grpc::ChannelArguments args;
  // The server proves its role, not its host name: pods are reached by
  // addresses that no certificate could list in advance.
  if (security.tls()) args.SetSslTargetNameOverride(RoleName(peer));
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
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, MakeChannelCredentials(security), args, MakeClientInterceptors(security));
}

std::string ListenAddress(const std::string& self_address) {
  std::string host;
  int port = 0;
  if (!ParseHostPort(self_address, &host, &port).ok()) return self_address;
  const std::string any = absl::StrCat("0.0.0.0:", port);
  // "localhost" means this machine to every caller; listening beyond
  // loopback for it would surprise, and would need security it does not.
  if (absl::EqualsIgnoreCase(host, "localhost")) return absl::StrCat("127.0.0.1:", port);
  // An IP address of this machine is one a socket can bind to.
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    len = sizeof(*v4);
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    family = AF_INET6;
    v6->sin6_family = AF_INET6;
    len = sizeof(*v6);
  } else {
    return any;  // a DNS name
  }
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return any;
  const bool local = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0;
  ::close(fd);
  if (!local) return any;
  return family == AF_INET6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

bool IsLoopbackListenAddress(const std::string& listen_address) {
  std::string host;
  int port = 0;
  if (!ParseHostPort(listen_address, &host, &port).ok()) return false;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  // ::ffff:127.x.x.x, an IPv4 loopback address in IPv6 form.
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

absl::Status CheckListenSecurity(const std::string& self_address, const SecurityOptions& security) {
  if (security.tls() || !security.token.empty() || security.insecure) return absl::OkStatus();
  const std::string listen = ListenAddress(self_address);
  if (IsLoopbackListenAddress(listen)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to listen on ", listen,
      listen == self_address ? "" : absl::StrCat(" (for ", self_address, ")"),
      " in plaintext without a job token: anyone who reaches the port could act as a member. "
      "Give --tls_cert, --tls_key and --tls_ca (scripts/make-certs.sh makes them) or "
      "--auth_token_file, or --insecure to accept that"));
}

std::vector<int> FreePorts(const std::string& host, int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = 0;
    ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
    socklen_t len = sizeof(addr);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      if (fd >= 0) ::close(fd);
      break;
    }
    fds.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(const std::string& self_address,
                                                          grpc::Service* service,
                                                          const SecurityOptions& security,
                                                          const CallerRoles& callers) {
  return StartServer(self_address, std::vector<grpc::Service*>{service}, security, callers);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    const std::string& self_address, const std::vector<grpc::Service*>& services,
    const SecurityOptions& security, const CallerRoles& callers) {
  const std::string listen = ListenAddress(self_address);
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(self_address, &host, &port); !s.ok()) return s;
  if (absl::Status s = CheckListenSecurity(self_address, security); !s.ok()) return s;
  // A process-wide switch that servers built from now on read.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(
      listen, MakeServerCredentials(security, std::make_shared<CallGate>(security, callers)),
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
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on port ", port, " (", listen,
                                               "): it is in use or not allowed"));
  // The default health service starts SERVING: not ready until the role says
  // so (a probe in the moment between the two sees SERVING).
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health != nullptr) {
    health->SetServingStatus("", false);
    health->SetServingStatus(kLivenessService, true);
  }
  return server;
}

void Readiness::Set(bool ready) {
  absl::MutexLock lock(&mu_);
  ready_ = ready;
  if (health_ != nullptr) health_->SetServingStatus("", ready);
}

bool Readiness::ready() const {
  absl::MutexLock lock(&mu_);
  return ready_;
}

void Readiness::Attach(grpc::Server* server) {
  absl::MutexLock lock(&mu_);
  health_ = server->GetHealthCheckService();
  if (health_ != nullptr) health_->SetServingStatus("", ready_);
}

void Readiness::Detach() {
  absl::MutexLock lock(&mu_);
  health_ = nullptr;
}

absl::Status RpcErrors::Count(absl::string_view method, absl::Status status) const {
  if (status.ok() || registry_ == nullptr) return status;
  // absl and gRPC share the canonical codes and their upper-case names.
  registry_
      ->GetCounter("psflow_rpc_errors_total",
                   "Calls of this process to its peers that failed, by the gRPC status code.",
                   {{"service", service_},
                    {"method", std::string(method)},
                    {"code", absl::StatusCodeToString(status.code())}})
      ->Add();
  return status;
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
