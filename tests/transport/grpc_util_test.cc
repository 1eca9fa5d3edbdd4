// MakeChannel and StartServer with each kind of security, on in-process
// servers on loopback: the generated ParameterServer base service answers
// UNIMPLEMENTED to every call that passes the server's checks, so a call's
// code says which check, if any, refused it.
#include "transport/grpc_util.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/common/certs.h"

namespace psflow {
namespace {

using testing_certs::Options;

// A TCP port that was free on 127.0.0.1 a moment ago.
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

TEST(ListenAddressTest, OwnAddressWhereLocalElseAllInterfaces) {
  EXPECT_EQ(ListenAddress("127.0.0.1:2222"), "127.0.0.1:2222");
  EXPECT_EQ(ListenAddress("0.0.0.0:2222"), "0.0.0.0:2222");
  // "localhost" names this machine only: loopback.
  EXPECT_EQ(ListenAddress("localhost:2222"), "127.0.0.1:2222");
  EXPECT_EQ(ListenAddress("LocalHost:2222"), "127.0.0.1:2222");
  // Another DNS name (even one of this machine) and an address of another machine.
  EXPECT_EQ(ListenAddress("localhost.example:2222"), "0.0.0.0:2222");
  EXPECT_EQ(ListenAddress("psflow-ps-0.psflow-ps:2222"), "0.0.0.0:2222");
  EXPECT_EQ(ListenAddress("192.0.2.1:2222"), "0.0.0.0:2222");  // TEST-NET-1
  const std::string v6 = ListenAddress("[::1]:2222");
  EXPECT_TRUE(v6 == "[::1]:2222" || v6 == "0.0.0.0:2222") << v6;  // hosts without IPv6
}

TEST(IsLoopbackListenAddressTest, OnlyLoopbackAddresses) {
  for (const char* address : {"127.0.0.1:2222", "127.1.2.3:1", "127.255.255.255:65535",
                              "[::1]:2222", "[0:0:0:0:0:0:0:1]:2222", "[::ffff:127.0.0.1]:2222"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(address)) << address;
  }
  for (const char* address :
       {"0.0.0.0:2222", "[::]:2222", "10.0.0.1:2222", "128.0.0.1:2222", "126.255.255.255:2222",
        "192.0.2.1:2222", "[::2]:2222", "[::ffff:10.0.0.1]:2222", "localhost:2222",
        "psflow-ps-0:2222", "127.0.0.1", "", "garbage"}) {
    EXPECT_FALSE(IsLoopbackListenAddress(address)) << address;
  }
}

// Beyond loopback, plaintext without a token needs --insecure.
TEST(CheckListenSecurityTest, BeyondLoopbackNeedsTlsATokenOrInsecure) {
  const SecurityOptions plaintext;
  EXPECT_TRUE(CheckListenSecurity("127.0.0.1:2222", plaintext).ok());
  EXPECT_TRUE(CheckListenSecurity("127.0.0.2:2222", plaintext).ok());
  EXPECT_TRUE(CheckListenSecurity("localhost:2222", plaintext).ok());

  const absl::Status by_name = CheckListenSecurity("psflow-ps-0.psflow-ps:2222", plaintext);
  EXPECT_TRUE(absl::IsFailedPrecondition(by_name)) << by_name;
  EXPECT_THAT(std::string(by_name.message()),
              ::testing::StartsWith(
                  "refusing to listen on 0.0.0.0:2222 (for psflow-ps-0.psflow-ps:2222) in "
                  "plaintext without a job token"));
  EXPECT_THAT(std::string(by_name.message()), ::testing::HasSubstr("--auth_token_file"));
  EXPECT_THAT(std::string(by_name.message()), ::testing::HasSubstr("--insecure"));
  EXPECT_EQ(std::string(by_name.message()).find('\n'), std::string::npos);
  const absl::Status any = CheckListenSecurity("0.0.0.0:2222", plaintext);
  EXPECT_TRUE(absl::IsFailedPrecondition(any)) << any;
  EXPECT_THAT(std::string(any.message()),
              ::testing::StartsWith("refusing to listen on 0.0.0.0:2222 in plaintext"));
  // An address of another machine (listened for on every interface).
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckListenSecurity("192.0.2.1:2222", plaintext)));

  SecurityOptions token;
  token.token = "a-token";
  EXPECT_TRUE(CheckListenSecurity("0.0.0.0:2222", token).ok());
  SecurityOptions tls;  // only whether there is TLS matters here
  tls.ca_pem = "-----BEGIN CERTIFICATE-----";
  EXPECT_TRUE(CheckListenSecurity("0.0.0.0:2222", tls).ok());
  SecurityOptions insecure;
  insecure.insecure = true;
  EXPECT_TRUE(CheckListenSecurity("0.0.0.0:2222", insecure).ok());
}

// StartServer makes the same check, before anything is bound.
TEST(CheckListenSecurityTest, StartServerRefusesPlaintextBeyondLoopback) {
  ParameterServer::Service service;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartServer(absl::StrCat("psflow-ps-0.psflow-ps:", FreePort()), &service, SecurityOptions{});
  ASSERT_FALSE(server.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(server.status())) << server.status();
  EXPECT_THAT(std::string(server.status().message()),
              ::testing::HasSubstr("refusing to listen on 0.0.0.0:"));
}

constexpr char kShutdown[] = "/psflow.ParameterServer/Shutdown";

// Calls on one server through channels made with MakeChannel.
class SecureServerTest : public testing_certs::TwoCasTest {
 protected:
  static void SetUpTestSuite() {
    grpc::EnableDefaultHealthCheckService(true);
    TwoCasTest::SetUpTestSuite();
  }

  // Starts the server on a free loopback port as `security` says; only the
  // chief may call Shutdown.
  void Start(const SecurityOptions& security) {
    port_ = FreePort();
    ASSERT_GT(port_, 0);
    absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer(
        absl::StrCat("127.0.0.1:", port_), &service_, security, {{kShutdown, {Role::kChief}}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  // The code of GetState (or Shutdown) called with `security`, through
  // `host` (the server's port), expecting a server of role `peer`. Calls
  // wait for the connection (a loaded machine may be slow to make it) unless
  // the handshake is expected to fail (UNAVAILABLE).
  grpc::StatusCode Call(const SecurityOptions& security, bool shutdown = false,
                        const std::string& host = "127.0.0.1", Role peer = Role::kPs,
                        bool connects = true) {
    auto stub =
        ParameterServer::NewStub(MakeChannel(absl::StrCat(host, ":", port_), peer, security));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.set_wait_for_ready(connects);
    if (shutdown) {
      ShutdownResponse response;
      return stub->Shutdown(&context, ShutdownRequest(), &response).error_code();
    }
    PsState response;
    return stub->GetState(&context, GetStateRequest(), &response).error_code();
  }

  // The code of the standard health service's Check, called with `security`.
  grpc::StatusCode CheckHealth(const SecurityOptions& security) {
    grpc::GenericStub stub(MakeChannel(absl::StrCat("127.0.0.1:", port_), Role::kPs, security));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.set_wait_for_ready(true);
    grpc::Slice empty("");  // an empty HealthCheckRequest: the server's overall health
    grpc::ByteBuffer request(&empty, 1), response;
    grpc::CompletionQueue cq;
    grpc::Status status;
    auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &cq);
    call->StartCall();
    call->Finish(&response, &status, nullptr);
    void* tag;
    bool ok;
    cq.Next(&tag, &ok);
    return status.error_code();
  }

  ParameterServer::Service service_;  // every method UNIMPLEMENTED
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(SecureServerTest, PlaintextServesEveryone) {
  Start(SecurityOptions{});
  EXPECT_EQ(Call(SecurityOptions{}), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Call(SecurityOptions{}, /*shutdown=*/true), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CheckHealth(SecurityOptions{}), grpc::StatusCode::OK);
}

TEST_F(SecureServerTest, TokenAloneRefusesCallsWithoutIt) {
  SecurityOptions server;
  server.token = "job-token";
  Start(server);
  SecurityOptions wrong;
  wrong.token = "another";
  EXPECT_EQ(Call(SecurityOptions{}), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(wrong), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(CheckHealth(SecurityOptions{}), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Call(server), grpc::StatusCode::UNIMPLEMENTED);
  // No identities without TLS: the token is all a control call needs.
  EXPECT_EQ(Call(server, /*shutdown=*/true), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CheckHealth(server), grpc::StatusCode::OK);
}

TEST_F(SecureServerTest, MutualTlsChecksCertificatesTokenAndRole) {
  Start(Options(Job(), "ps"));
  const SecurityOptions worker = Options(Job(), "worker");
  const SecurityOptions chief = Options(Job(), "chief");
  EXPECT_EQ(Call(worker), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Call(worker, /*shutdown=*/true), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Call(chief, /*shutdown=*/true), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(CheckHealth(worker), grpc::StatusCode::OK);
  // Any host name reaches the ps: the client checks the role, not the host.
  EXPECT_EQ(Call(worker, false, "localhost"), grpc::StatusCode::UNIMPLEMENTED);

  // The right certificate without the token, or with another.
  EXPECT_EQ(Call(Options(Job(), "worker", /*token=*/false)), grpc::StatusCode::UNAUTHENTICATED);
  SecurityOptions wrong_token = worker;
  wrong_token.token = "guess";
  EXPECT_EQ(Call(wrong_token), grpc::StatusCode::UNAUTHENTICATED);
  // Strangers do not get past the handshake.
  const bool handshake_fails = false;
  auto refused = [&](const SecurityOptions& o, Role peer = Role::kPs) {
    return Call(o, false, "127.0.0.1", peer, handshake_fails);
  };
  EXPECT_EQ(refused(SecurityOptions{}), grpc::StatusCode::UNAVAILABLE);  // plaintext
  SecurityOptions no_cert;
  no_cert.ca_pem = worker.ca_pem;
  no_cert.token = worker.token;
  EXPECT_EQ(refused(no_cert), grpc::StatusCode::UNAVAILABLE);
  SecurityOptions other_ca = Options(Other(), "worker");
  other_ca.ca_pem = worker.ca_pem;  // trusts the job's CA, holds another's certificate
  other_ca.token = worker.token;
  EXPECT_EQ(refused(other_ca), grpc::StatusCode::UNAVAILABLE);
  // A client refuses a server whose certificate is not for the role it calls.
  EXPECT_EQ(refused(chief, Role::kChief), grpc::StatusCode::UNAVAILABLE);
  // A client that does not trust the job's CA refuses the server.
  SecurityOptions distrust = worker;
  distrust.ca_pem = Options(Other(), "worker").ca_pem;
  EXPECT_EQ(refused(distrust), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(SecureServerTest, BusyPortIsAnErrorNamingIt) {
  Start(SecurityOptions{});
  absl::StatusOr<std::unique_ptr<grpc::Server>> second =
      StartServer(absl::StrCat("127.0.0.1:", port_), &service_, SecurityOptions{});
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_THAT(second.status().message(),
              ::testing::HasSubstr(absl::StrCat("cannot listen on port ", port_)));
}

}  // namespace
}  // namespace psflow
