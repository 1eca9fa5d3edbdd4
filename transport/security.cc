#include "transport/security.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <utility>

#include <grpc/grpc_security.h>
#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/log.h"

namespace psflow {
namespace {

constexpr absl::string_view kAuthorizationKey = "authorization";
constexpr absl::string_view kPathKey = ":path";

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return Invalid(absl::StrCat("--", flag, ": ", text.status().message()));
  return text;
}

// Lengths may leak, contents may not: a token is compared without an early exit.
bool SameSecret(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string RoleList(const std::vector<Role>& roles) {
  std::vector<std::string> names;
  for (Role r : roles) names.push_back(RoleName(r));
  return absl::StrJoin(names, " or ");
}

// ---------------------------------------------------------------------------
// OpenSSL, to check this process's own certificate at start.

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct X509StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_pop_free(s, X509_free); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using Bio = std::unique_ptr<BIO, BioFree>;

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate in `pem`, in order.
std::vector<std::unique_ptr<X509, X509Free>> ReadCertificates(const std::string& pem) {
  std::vector<std::unique_ptr<X509, X509Free>> certs;
  Bio bio = MemoryBio(pem);
  while (bio != nullptr) {
    X509* cert = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (cert == nullptr) break;
    certs.emplace_back(cert);
  }
  ERR_clear_error();  // the end of the text reads as an error
  return certs;
}

std::optional<std::string> CommonName(X509* cert) {
  X509_NAME* subject = X509_get_subject_name(cert);
  const int at = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (at < 0) return std::nullopt;
  ASN1_STRING* value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, at));
  return std::string(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                     ASN1_STRING_length(value));
}

// ---------------------------------------------------------------------------
// gRPC core's auth metadata processor, which (unlike the C++ API's) also runs
// on servers without TLS, and fails a call before any handler sees it.

absl::string_view View(const grpc_slice& slice) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                           GRPC_SLICE_LENGTH(slice));
}

std::optional<std::string> PeerCommonName(const grpc_auth_context* context) {
  grpc_auth_property_iterator it =
      grpc_auth_context_find_properties_by_name(context, GRPC_X509_CN_PROPERTY_NAME);
  const grpc_auth_property* property = grpc_auth_property_iterator_next(&it);
  if (property == nullptr) return std::nullopt;
  return std::string(property->value, property->value_length);
}

void ProcessCall(void* state, grpc_auth_context* context, const grpc_metadata* md, size_t num_md,
                 grpc_process_auth_metadata_done_cb done, void* user_data) {
  CallGate& gate = **static_cast<std::shared_ptr<CallGate>*>(state);
  absl::string_view method;
  const grpc_metadata* authorization = nullptr;
  for (size_t i = 0; i < num_md; ++i) {
    const absl::string_view key = View(md[i].key);
    if (key == kPathKey) method = View(md[i].value);
    if (key == kAuthorizationKey && authorization == nullptr) authorization = &md[i];
  }
  const absl::Status status = gate.Admit(
      method,
      authorization == nullptr ? std::nullopt
                               : std::optional<absl::string_view>(View(authorization->value)),
      context == nullptr ? std::nullopt : PeerCommonName(context));
  if (status.ok()) {
    // The token is consumed: handlers never see it.
    done(user_data, authorization, authorization == nullptr ? 0 : 1, nullptr, 0, GRPC_STATUS_OK,
         nullptr);
  } else {
    const std::string message(status.message());
    done(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(status.code()),
         message.c_str());
  }
}

void DestroyGate(void* state) { delete static_cast<std::shared_ptr<CallGate>*>(state); }

// grpc::ServerCredentials over credentials of gRPC core, so that the
// processor can be set on plaintext servers too (the C++ API's insecure
// credentials refuse one).
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  // Takes ownership of `creds`.
  explicit CoreServerCredentials(grpc_server_credentials* creds) : creds_(creds) {}
  ~CoreServerCredentials() override { grpc_server_credentials_release(creds_); }
  CoreServerCredentials(const CoreServerCredentials&) = delete;
  CoreServerCredentials& operator=(const CoreServerCredentials&) = delete;

  // psflow sets its processor on the core credentials; no other is taken.
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& address, grpc_server* server) override {
    return grpc_server_add_http2_port(server, address.c_str(), creds_);
  }

  grpc_server_credentials* const creds_;
};

class TokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit TokenInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(std::string(kAuthorizationKey), *value_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const value_;  // owned by the factory, which outlives the channel's calls
};

class TokenInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit TokenInterceptorFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new TokenInterceptor(&value_);
  }

 private:
  const std::string value_;
};

}  // namespace

absl::StatusOr<SecurityOptions> LoadSecurityOptions(const SecurityFiles& files) {
  SecurityOptions o;
  const int tls_given = !files.tls_cert.empty() + !files.tls_key.empty() + !files.tls_ca.empty();
  if (tls_given != 0 && tls_given != 3) {
    return Invalid("mutual TLS needs all of --tls_cert, --tls_key and --tls_ca");
  }
  if (tls_given == 3) {
    absl::StatusOr<std::string> cert = ReadFlagFile("tls_cert", files.tls_cert);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFlagFile("tls_key", files.tls_key);
    if (!key.ok()) return key.status();
    absl::StatusOr<std::string> ca = ReadFlagFile("tls_ca", files.tls_ca);
    if (!ca.ok()) return ca.status();
    if (cert->empty() || key->empty() || ca->empty()) {
      return Invalid("--tls_cert, --tls_key and --tls_ca must not be empty files");
    }
    o.cert_pem = *std::move(cert);
    o.key_pem = *std::move(key);
    o.ca_pem = *std::move(ca);
  }
  if (!files.auth_token_file.empty()) {
    absl::StatusOr<std::string> text = ReadFlagFile("auth_token_file", files.auth_token_file);
    if (!text.ok()) return text.status();
    const absl::string_view token = absl::StripAsciiWhitespace(*text);
    if (token.empty()) return Invalid("--auth_token_file: the token file is empty");
    for (char c : token) {
      if (c < 0x20 || c > 0x7e) {
        return Invalid(
            "--auth_token_file: the token must be one line of printable ASCII (metadata "
            "carries it)");
      }
    }
    o.token = std::string(token);
  }
  return o;
}

absl::StatusOr<PeerIdentity> ParseIdentity(absl::string_view cn) {
  PeerIdentity id;
  absl::string_view role = cn;
  const size_t dash = cn.rfind('-');
  if (dash != absl::string_view::npos) {
    const absl::string_view digits = cn.substr(dash + 1);
    int index = 0;
    const bool canonical = !digits.empty() && digits.size() <= 6 &&
                           absl::c_all_of(digits, absl::ascii_isdigit) &&
                           (digits.size() == 1 || digits[0] != '0');
    if (!canonical || !absl::SimpleAtoi(digits, &index)) {
      return Invalid(absl::StrCat("'", cn, "' names no task: expected <role> or <role>-<index>"));
    }
    id.index = index;
    role = cn.substr(0, dash);
  }
  absl::StatusOr<Role> parsed = ParseRole(std::string(role));
  if (!parsed.ok()) return parsed.status();
  id.role = *parsed;
  return id;
}

absl::Status CheckOwnCertificate(const SecurityOptions& options, Role role, int task_index) {
  if (!options.tls()) return absl::OkStatus();
  const std::string role_name = RoleName(role);
  std::vector<std::unique_ptr<X509, X509Free>> chain = ReadCertificates(options.cert_pem);
  if (chain.empty()) return Invalid("--tls_cert holds no PEM certificate");
  X509* cert = chain[0].get();
  Bio key_bio = MemoryBio(options.key_pem);
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      key_bio == nullptr ? nullptr
                         : PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (key == nullptr) return Invalid("--tls_key holds no PEM private key");
  if (X509_check_private_key(cert, key.get()) != 1) {
    ERR_clear_error();
    return Invalid("--tls_key is not the private key of --tls_cert");
  }
  std::vector<std::unique_ptr<X509, X509Free>> cas = ReadCertificates(options.ca_pem);
  if (cas.empty()) return Invalid("--tls_ca holds no PEM certificate");
  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (const auto& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  std::unique_ptr<STACK_OF(X509), X509StackFree> intermediates(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) {
    sk_X509_push(intermediates.get(), chain[i].release());
  }
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> verify(X509_STORE_CTX_new());
  if (store == nullptr || intermediates == nullptr || verify == nullptr ||
      X509_STORE_CTX_init(verify.get(), store.get(), cert, intermediates.get()) != 1) {
    ERR_clear_error();
    return absl::InternalError("cannot check --tls_cert: OpenSSL is out of memory");
  }
  if (X509_verify_cert(verify.get()) != 1) {
    const int error = X509_STORE_CTX_get_error(verify.get());
    ERR_clear_error();
    return Invalid(absl::StrCat("--tls_cert is not a valid certificate of the CA in --tls_ca (",
                                X509_verify_cert_error_string(error), ")"));
  }
  if (X509_check_purpose(cert, X509_PURPOSE_SSL_CLIENT, 0) != 1 ||
      X509_check_purpose(cert, X509_PURPOSE_SSL_SERVER, 0) != 1) {
    ERR_clear_error();
    return Invalid(
        "--tls_cert must allow TLS client and server use (extendedKeyUsage clientAuth and "
        "serverAuth): every role both calls and serves");
  }
  const std::optional<std::string> cn = CommonName(cert);
  absl::StatusOr<PeerIdentity> id =
      cn.has_value() ? ParseIdentity(*cn) : absl::StatusOr<PeerIdentity>(absl::NotFoundError(""));
  if (!id.ok() || id->role != role) {
    return Invalid(absl::StrCat("--tls_cert is the certificate of '", cn.value_or(""),
                                "' (its CN), but this process is the ", role_name,
                                ": give each role its own role's certificate"));
  }
  if (id->index.has_value() && *id->index != task_index) {
    return Invalid(absl::StrCat("--tls_cert is the certificate of ", role_name, " ", *id->index,
                                " (CN ", *cn, "), but this process is ", role_name, " ", task_index,
                                ": give each task its own certificate"));
  }
  if (X509_check_host(cert, role_name.data(), role_name.size(), 0, nullptr) != 1) {
    ERR_clear_error();
    return Invalid(absl::StrCat("--tls_cert is not valid for the name '", role_name,
                                "' (subjectAltName DNS:", role_name,
                                "), which peers check when they call the ", role_name));
  }
  return absl::OkStatus();
}

std::string DescribeSecurity(const SecurityOptions& options, Role role) {
  if (!options.tls() && options.token.empty()) {
    return "security: none (plaintext, no job token): anyone who reaches the port may call it; "
           "see --tls_cert and --auth_token_file";
  }
  if (!options.tls()) {
    return "security: a job token on every call, in plaintext (no TLS: callers are not "
           "identified by role)";
  }
  // A per-task certificate (CN "worker-1") is named as its task: it may act
  // only as that one.
  std::string as = absl::StrCat("the ", RoleName(role));
  if (std::vector<std::unique_ptr<X509, X509Free>> certs = ReadCertificates(options.cert_pem);
      !certs.empty()) {
    const std::optional<std::string> cn = CommonName(certs.front().get());
    absl::StatusOr<PeerIdentity> id =
        cn.has_value() ? ParseIdentity(*cn) : absl::StatusOr<PeerIdentity>(absl::NotFoundError(""));
    if (id.ok() && id->index.has_value()) {
      as = absl::StrCat(RoleName(role), " ", *id->index, " (a certificate of this task only)");
    }
  }
  return absl::StrCat("security: mutual TLS as ", as,
                      options.token.empty() ? "" : ", and a job token on every call");
}

std::string MethodName(absl::string_view service_full_name, absl::string_view method) {
  return absl::StrCat("/", service_full_name, "/", method);
}

std::string AuthorizationValue(absl::string_view token) { return absl::StrCat("Bearer ", token); }

CallGate::CallGate(const SecurityOptions& options, CallerRoles callers, absl::Duration log_every)
    : tls_(options.tls()),
      expected_authorization_(options.token.empty() ? "" : AuthorizationValue(options.token)),
      callers_(std::move(callers)),
      log_every_(log_every) {}

absl::Status CallGate::Admit(absl::string_view method,
                             std::optional<absl::string_view> authorization,
                             std::optional<absl::string_view> peer_cn) {
  if (!expected_authorization_.empty()) {
    if (!authorization.has_value()) {
      return Refuse(absl::UnauthenticatedError("psflow: the call carries no job token"), method);
    }
    if (!SameSecret(*authorization, expected_authorization_)) {
      return Refuse(absl::UnauthenticatedError("psflow: the call carries a wrong job token"),
                    method);
    }
  }
  if (!tls_) return absl::OkStatus();
  const auto allowed = callers_.find(method);
  if (allowed == callers_.end()) return absl::OkStatus();
  absl::StatusOr<PeerIdentity> caller =
      peer_cn.has_value() ? ParseIdentity(*peer_cn) : absl::NotFoundError("");
  const std::vector<Role>& roles = allowed->second;
  if (caller.ok() && std::find(roles.begin(), roles.end(), caller->role) != roles.end()) {
    return absl::OkStatus();
  }
  return Refuse(absl::PermissionDeniedError(
                    absl::StrCat("psflow: only the ", RoleList(roles), " may call ", method,
                                 "; the caller's certificate is for '", peer_cn.value_or(""), "'")),
                method);
}

std::optional<PeerIdentity> CallerIdentity(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr) return std::nullopt;
  const std::vector<grpc::string_ref> cns = auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
  if (cns.empty()) return std::nullopt;
  absl::StatusOr<PeerIdentity> id = ParseIdentity(absl::string_view(cns[0].data(), cns[0].size()));
  if (!id.ok()) return std::nullopt;
  return *id;
}

absl::Status CheckCallerIndex(const std::optional<PeerIdentity>& caller, Role role,
                              int claimed_index) {
  if (!caller.has_value() || caller->role != role || !caller->index.has_value() ||
      *caller->index == claimed_index) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("psflow: the caller's certificate is ", RoleName(role), " ", *caller->index,
                   "'s; it may not act as ", RoleName(role), " ", claimed_index));
}

absl::Status CheckCallerIndex(const grpc::ServerContextBase& context, Role role,
                              int claimed_index) {
  return CheckCallerIndex(CallerIdentity(context), role, claimed_index);
}

absl::Status CallGate::Refuse(absl::Status status, absl::string_view method) {
  const int64_t refused = refused_.fetch_add(1, std::memory_order_relaxed) + 1;
  const absl::Time now = absl::Now();
  int64_t since = 0;
  {
    absl::MutexLock lock(&mu_);
    if (now - last_log_ < log_every_) return status;
    last_log_ = now;
    since = refused - logged_;
    logged_ = refused;
  }
  PSLOG(WARNING) << "refused a call to " << (method.empty() ? "?" : method) << ": "
                 << absl::StatusCodeToString(status.code()) << " (" << status.message() << "); "
                 << refused << " refused in all"
                 << (since > 1 ? absl::StrCat(", ", since, " since the last such line") : "");
  return status;
}

std::shared_ptr<grpc::ServerCredentials> MakeServerCredentials(const SecurityOptions& options,
                                                               std::shared_ptr<CallGate> gate) {
  if (!options.tls() && options.token.empty()) return grpc::InsecureServerCredentials();
  grpc_server_credentials* creds = nullptr;
  if (options.tls()) {
    grpc_ssl_pem_key_cert_pair pair = {options.key_pem.c_str(), options.cert_pem.c_str()};
    grpc_ssl_server_certificate_config* config =
        grpc_ssl_server_certificate_config_create(options.ca_pem.c_str(), &pair, 1);
    grpc_ssl_server_credentials_options* ssl =
        grpc_ssl_server_credentials_create_options_using_config(
            GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, config);
    creds = grpc_ssl_server_credentials_create_with_options(ssl);  // takes `ssl` and `config`
  } else {
    creds = grpc_insecure_server_credentials_create();
  }
  grpc_auth_metadata_processor processor = {ProcessCall, DestroyGate,
                                            new std::shared_ptr<CallGate>(std::move(gate))};
  grpc_server_credentials_set_auth_metadata_processor(creds, processor);
  return std::make_shared<CoreServerCredentials>(creds);
}

std::shared_ptr<grpc::ChannelCredentials> MakeChannelCredentials(const SecurityOptions& options) {
  if (!options.tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.ca_pem;
  ssl.pem_private_key = options.key_pem;
  ssl.pem_cert_chain = options.cert_pem;
  return grpc::SslCredentials(ssl);
}

std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
MakeClientInterceptors(const SecurityOptions& options) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  if (!options.token.empty()) {
    factories.push_back(
        std::make_unique<TokenInterceptorFactory>(AuthorizationValue(options.token)));
  }
  return factories;
}

}  // namespace psflow
