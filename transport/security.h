// Who may talk to a psflow process: mutual TLS between the roles, a job token
// on every call, and which roles may call which methods.
//
// Identities (with TLS). Every member holds a certificate signed by the job's
// CA whose subject common name (CN) is its role (chief, ps, worker,
// evaluator: a per-role certificate) or its role and task index ("worker-1":
// a per-task certificate), and which is valid for the DNS name of its role
// (subjectAltName DNS:<role>). A server requires a client certificate the CA
// signed and takes the caller's identity from its CN; a client verifies the
// server's certificate against the CA and checks that it is valid for the
// role it calls (the TLS target name is the role, not the host in the
// address), so peers may be addressed by any DNS name or IP.
//
// The job token (with or without TLS) travels as "authorization: Bearer
// <token>" metadata on every call; servers refuse calls without it, or with
// another, as UNAUTHENTICATED. Role checks refuse as PERMISSION_DENIED.
//
// A per-task certificate also binds the index: handlers refuse a request that
// names another task of the caller's role (CheckCallerIndex) as
// PERMISSION_DENIED. A per-role certificate acts as any task of its role.
//
// Both role and token checks run in one place, CallGate, which gRPC runs on every call of
// every service of a server (its health service included) before any handler.
#ifndef PSFLOW_TRANSPORT_SECURITY_H_
#define PSFLOW_TRANSPORT_SECURITY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/cluster_config.h"

namespace psflow {

// What secures a process's connections, passed to MakeChannel and
// StartServer. The default is plaintext without a token, as before TLS.
struct SecurityOptions {
  // PEM text. All three set: mutual TLS; all empty: plaintext.
  std::string cert_pem;  // this process's certificate (chain)
  std::string key_pem;   // its private key
  std::string ca_pem;    // the CA that signs every member's certificate
  // The job token; empty: calls carry none and servers ask for none.
  std::string token;
  // --insecure: a server without TLS and without a token may listen beyond
  // loopback (CheckListenSecurity in transport/grpc_util.h). Secures nothing.
  bool insecure = false;

  bool tls() const { return !ca_pem.empty(); }
};

// The files the flags name (--tls_cert, --tls_key, --tls_ca,
// --auth_token_file); empty: not given.
struct SecurityFiles {
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
  std::string auth_token_file;
};

// Reads the files. The token is the file's text without surrounding
// whitespace. INVALID_ARGUMENT with one line: some but not all TLS files
// given, a file that cannot be read, an empty token or one with characters
// that cannot travel in metadata (outside printable ASCII).
absl::StatusOr<SecurityOptions> LoadSecurityOptions(const SecurityFiles& files);

// Who a certificate's CN says its holder is: a role, and a task index for a
// per-task certificate.
struct PeerIdentity {
  Role role = Role::kWorker;
  std::optional<int> index;  // nullopt: a per-role certificate
};

// "worker" -> worker; "worker-1" -> worker, task 1 (decimal, below 1e6, no
// sign or leading zero); role names as ParseRole takes them. INVALID_ARGUMENT
// otherwise.
absl::StatusOr<PeerIdentity> ParseIdentity(absl::string_view cn);

// With TLS, checks this process's certificate for `role` and task
// `task_index` before anything listens or calls: it must parse, match the
// key, chain to the CA, be usable by TLS clients and servers, have the role
// (or the role and `task_index`) as its CN and be valid for the DNS name of
// the role. INVALID_ARGUMENT naming the problem. OK without TLS.
absl::Status CheckOwnCertificate(const SecurityOptions& options, Role role, int task_index = 0);

// The identity of a call's caller, from its certificate's CN; nullopt
// without TLS (or a CN that names no identity, which the CallGate refused
// wherever a role is needed).
std::optional<PeerIdentity> CallerIdentity(const grpc::ServerContextBase& context);

// Whether a caller whose certificate says `caller` may act as task
// `claimed_index` of `role`: PERMISSION_DENIED when it holds a per-task
// certificate of `role` for another index. OK without an identity (no TLS),
// for a per-role certificate, or for a caller of another role (the
// CallGate's role rules decide about those).
absl::Status CheckCallerIndex(const std::optional<PeerIdentity>& caller, Role role,
                              int claimed_index);
absl::Status CheckCallerIndex(const grpc::ServerContextBase& context, Role role, int claimed_index);

// One log line saying what protects this process's connections.
std::string DescribeSecurity(const SecurityOptions& options, Role role);

// The roles that may call a method, by its full name
// ("/psflow.ParameterServer/Init"). Methods not listed may be called by any
// member. Enforced with TLS only: without it callers have no identity.
using CallerRoles = absl::flat_hash_map<std::string, std::vector<Role>>;

// "/<service>/<method>".
std::string MethodName(absl::string_view service_full_name, absl::string_view method);

// Decides whether a call reaches the server's handlers: first the token
// (UNAUTHENTICATED when missing or wrong), then, with TLS, the caller's role
// (PERMISSION_DENIED). Counts refusals and logs them: the first at once, then
// at most one line per `log_every`, with the count. Thread-safe and
// non-blocking (it runs on gRPC's threads).
class CallGate {
 public:
  CallGate(const SecurityOptions& options, CallerRoles callers,
           absl::Duration log_every = absl::Seconds(10));

  // `method`: the call's full name. `authorization`: its authorization
  // metadata (nullopt: none). `peer_cn`: the CN of the caller's certificate
  // (nullopt: none, as without TLS).
  absl::Status Admit(absl::string_view method, std::optional<absl::string_view> authorization,
                     std::optional<absl::string_view> peer_cn);

  // Calls refused so far.
  int64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  absl::Status Refuse(absl::Status status, absl::string_view method);

  const bool tls_;
  const std::string expected_authorization_;  // empty: no token
  const CallerRoles callers_;
  const absl::Duration log_every_;
  std::atomic<int64_t> refused_{0};
  absl::Mutex mu_;
  absl::Time last_log_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t logged_ ABSL_GUARDED_BY(mu_) = 0;  // refusals counted by the last line
};

// The metadata value a client attaches for `token`: "Bearer <token>".
std::string AuthorizationValue(absl::string_view token);

// A server's credentials: TLS requiring client certificates signed by the
// CA, or plaintext; with a token or TLS, every call goes through `gate`
// first. Plaintext without a token is gRPC's insecure credentials.
std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityOptions& options,
                                                               std::shared_ptr<CallGate> gate);

// A client's credentials: TLS with this process's certificate, verifying the
// server against the CA, or plaintext. The caller sets the target name to
// check (the role called) with SslTargetNameOverride.
std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const SecurityOptions& options);

// The interceptors that attach the token to every call of a channel (none
// without a token).
std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
MakeClientInterceptors(const SecurityOptions& options);

}  // namespace psflow

#endif  // PSFLOW_TRANSPORT_SECURITY_H_
