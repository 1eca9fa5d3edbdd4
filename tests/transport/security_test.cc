#include "transport/security.h"

#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/certs.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;
using testing_certs::Options;

// Two sets of make-certs.sh files (two CAs), made once for the suite.
class SecurityTest : public testing_certs::TwoCasTest {
 protected:
  static std::string Write(const std::string& name, const std::string& text) {
    const std::string path = *dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
};

TEST_F(SecurityTest, NoFilesIsPlaintextWithoutToken) {
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions({});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_FALSE(o->tls());
  EXPECT_EQ(o->token, "");
  EXPECT_THAT(DescribeSecurity(*o, Role::kPs), HasSubstr("plaintext, no job token"));
  EXPECT_TRUE(CheckOwnCertificate(*o, Role::kPs).ok());
}

TEST_F(SecurityTest, LoadsTheFilesAndStripsTheToken) {
  SecurityFiles files{Job() + "/ps.crt", Job() + "/ps.key", Job() + "/ca.crt",
                      Write("token_with_spaces", "  abc-123 \n\n")};
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(files);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->tls());
  EXPECT_THAT(o->cert_pem, HasSubstr("BEGIN CERTIFICATE"));
  EXPECT_THAT(o->key_pem, HasSubstr("PRIVATE KEY"));
  EXPECT_EQ(o->token, "abc-123");
  EXPECT_EQ(DescribeSecurity(*o, Role::kPs),
            "security: mutual TLS as the ps, and a job token on every call");
  // A per-task certificate is named as its task.
  files.tls_cert = Job() + "/ps-1.crt";
  files.tls_key = Job() + "/ps-1.key";
  o = LoadSecurityOptions(files);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(DescribeSecurity(*o, Role::kPs),
            "security: mutual TLS as ps 1 (a certificate of this task only), and a job token on "
            "every call");
}

TEST_F(SecurityTest, BadFilesAreOneLineErrors) {
  struct Case {
    SecurityFiles files;
    std::string expect;
  };
  const Case cases[] = {
      {{Job() + "/ps.crt", "", "", ""}, "needs all of --tls_cert, --tls_key and --tls_ca"},
      {{"", Job() + "/ps.key", Job() + "/ca.crt", ""}, "needs all of"},
      {{Job() + "/ps.crt", Job() + "/ps.key", Job() + "/missing.crt", ""}, "--tls_ca: cannot open"},
      {{"", "", "", Job() + "/no_token"}, "--auth_token_file: cannot open"},
      {{"", "", "", Write("empty_token", " \n")}, "the token file is empty"},
      {{"", "", "", Write("two_lines", "abc\ndef\n")}, "one line of printable ASCII"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(c.files);
    ASSERT_FALSE(o.ok()) << c.expect;
    EXPECT_TRUE(absl::IsInvalidArgument(o.status())) << o.status();
    EXPECT_THAT(o.status().message(), HasSubstr(c.expect));
    EXPECT_EQ(std::string(o.status().message()).find('\n'), std::string::npos);
  }
}

TEST_F(SecurityTest, OwnCertificateMustFitTheRole) {
  for (const char* role : {"chief", "ps", "worker", "evaluator"}) {
    SCOPED_TRACE(role);
    absl::StatusOr<Role> r = ParseRole(role);
    ASSERT_TRUE(r.ok());
    EXPECT_TRUE(CheckOwnCertificate(Options(Job(), role), *r).ok())
        << CheckOwnCertificate(Options(Job(), role), *r);
  }
  // Another role's certificate.
  absl::Status s = CheckOwnCertificate(Options(Job(), "worker"), Role::kPs);
  EXPECT_THAT(s.message(), HasSubstr("the certificate of 'worker' (its CN), but this process is "
                                     "the ps"));
  // A key of another certificate.
  SecurityOptions mixed = Options(Job(), "ps");
  mixed.key_pem = Options(Job(), "worker").key_pem;
  EXPECT_THAT(CheckOwnCertificate(mixed, Role::kPs).message(),
              HasSubstr("--tls_key is not the private key of --tls_cert"));
  // A certificate of another CA.
  SecurityOptions foreign = Options(Other(), "ps");
  foreign.ca_pem = Options(Job(), "ps").ca_pem;
  EXPECT_THAT(CheckOwnCertificate(foreign, Role::kPs).message(),
              HasSubstr("not a valid certificate of the CA in --tls_ca"));
  // Not PEM at all.
  SecurityOptions garbage = Options(Job(), "ps");
  garbage.cert_pem = "not a certificate";
  EXPECT_THAT(CheckOwnCertificate(garbage, Role::kPs).message(),
              HasSubstr("--tls_cert holds no PEM certificate"));
}

// make-certs.sh's per-task certificates: each is good for its own role and
// task only; a per-role certificate for any task of its role.
TEST_F(SecurityTest, PerTaskCertificatesFitTheirOwnTaskOnly) {
  EXPECT_TRUE(CheckOwnCertificate(Options(Job(), "worker-1"), Role::kWorker, 1).ok())
      << CheckOwnCertificate(Options(Job(), "worker-1"), Role::kWorker, 1);
  EXPECT_TRUE(CheckOwnCertificate(Options(Job(), "ps-1"), Role::kPs, 1).ok());
  EXPECT_TRUE(CheckOwnCertificate(Options(Job(), "evaluator-0"), Role::kEvaluator, 0).ok());
  EXPECT_TRUE(CheckOwnCertificate(Options(Job(), "worker"), Role::kWorker, 3).ok());
  absl::Status s = CheckOwnCertificate(Options(Job(), "worker-0"), Role::kWorker, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("the certificate of worker 0 (CN worker-0), but this "
                                     "process is worker 1"));
  EXPECT_THAT(CheckOwnCertificate(Options(Job(), "worker-1"), Role::kPs, 1).message(),
              HasSubstr("the certificate of 'worker-1' (its CN), but this process is the ps"));
}

TEST(ParseIdentityTest, RoleAndOptionalTaskIndex) {
  absl::StatusOr<PeerIdentity> id = ParseIdentity("worker-1");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kWorker);
  EXPECT_EQ(id->index, 1);
  id = ParseIdentity("worker");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kWorker);
  EXPECT_FALSE(id->index.has_value());
  id = ParseIdentity("evaluator-12");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kEvaluator);
  EXPECT_EQ(id->index, 12);
  id = ParseIdentity("ps-0");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kPs);
  EXPECT_EQ(id->index, 0);
  id = ParseIdentity("chief");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->role, Role::kChief);
  for (const char* bad : {"worker-", "worker-01", "worker--1", "worker-+1", "worker-1x",
                          "worker-1234567", "admin-1", "-1", "", "psflow job CA", "worker 1"}) {
    EXPECT_FALSE(ParseIdentity(bad).ok()) << bad;
  }
}

TEST(CheckCallerIndexTest, APerTaskCertificateActsAsItsOwnIndexOnly) {
  const PeerIdentity worker1{Role::kWorker, 1};
  EXPECT_TRUE(CheckCallerIndex(worker1, Role::kWorker, 1).ok());
  absl::Status s = CheckCallerIndex(worker1, Role::kWorker, 0);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("the caller's certificate is worker 1's; it may not act as "
                                     "worker 0"));
  // A per-role certificate, no certificate (plaintext) and another role
  // (whose rights the CallGate decides) keep their rights.
  EXPECT_TRUE(CheckCallerIndex(PeerIdentity{Role::kWorker, std::nullopt}, Role::kWorker, 0).ok());
  EXPECT_TRUE(CheckCallerIndex(std::nullopt, Role::kWorker, 0).ok());
  EXPECT_TRUE(CheckCallerIndex(PeerIdentity{Role::kChief, std::nullopt}, Role::kWorker, 3).ok());
  EXPECT_TRUE(CheckCallerIndex(PeerIdentity{Role::kEvaluator, 0}, Role::kWorker, 3).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(
      CheckCallerIndex(PeerIdentity{Role::kEvaluator, 0}, Role::kEvaluator, 1)));
}

const CallerRoles& Callers() {
  static const auto* callers =
      new CallerRoles{{"/psflow.ParameterServer/Shutdown", {Role::kChief}},
                      {"/psflow.ParameterServer/Snapshot", {Role::kChief, Role::kEvaluator}}};
  return *callers;
}

TEST(CallGateTest, TokenIsCheckedOnEveryCall) {
  SecurityOptions o;
  o.token = "s3cret";
  CallGate gate(o, Callers());
  const std::string good = AuthorizationValue("s3cret");
  EXPECT_EQ(good, "Bearer s3cret");
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Pull", good, std::nullopt).ok());
  absl::Status missing = gate.Admit("/psflow.ParameterServer/Pull", std::nullopt, std::nullopt);
  EXPECT_TRUE(absl::IsUnauthenticated(missing)) << missing;
  EXPECT_THAT(missing.message(), HasSubstr("no job token"));
  for (const char* wrong : {"Bearer s3creT", "Bearer s3cret ", "s3cret", ""}) {
    absl::Status s = gate.Admit("/psflow.ParameterServer/Pull", wrong, std::nullopt);
    EXPECT_TRUE(absl::IsUnauthenticated(s)) << wrong << ": " << s;
  }
  // Without TLS callers have no identity: roles are not checked.
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Shutdown", good, std::nullopt).ok());
  EXPECT_EQ(gate.refused(), 5);
}

TEST(CallGateTest, WithTlsOnlyTheListedRolesMayCall) {
  SecurityOptions o;
  o.ca_pem = "(a CA)";  // tls(): the gate only reads whether there is one
  CallGate gate(o, Callers());
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Shutdown", std::nullopt, "chief").ok());
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Shutdown", std::nullopt, "master").ok());
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Snapshot", std::nullopt, "evaluator").ok());
  // Per-task certificates have their role's rights.
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Snapshot", std::nullopt, "evaluator-0").ok());
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Pull", std::nullopt, "worker-3").ok());
  // Methods not listed: any member.
  EXPECT_TRUE(gate.Admit("/psflow.ParameterServer/Pull", std::nullopt, "worker").ok());
  for (const auto& [method, cn] : std::vector<std::pair<std::string, std::optional<std::string>>>{
           {"/psflow.ParameterServer/Shutdown", "worker"},
           {"/psflow.ParameterServer/Shutdown", "ps"},
           {"/psflow.ParameterServer/Shutdown", "admin"},
           {"/psflow.ParameterServer/Shutdown", std::nullopt},
           {"/psflow.ParameterServer/Snapshot", "worker"},
           {"/psflow.ParameterServer/Snapshot", "worker-0"},
           {"/psflow.ParameterServer/Shutdown", "chief-x"}}) {
    absl::Status s = gate.Admit(method, std::nullopt, cn);
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << method << " " << cn.value_or("(none)") << ": " << s;
  }
  absl::Status s = gate.Admit("/psflow.ParameterServer/Shutdown", std::nullopt, "worker");
  EXPECT_THAT(s.message(), HasSubstr("only the chief may call /psflow.ParameterServer/Shutdown"));
  EXPECT_THAT(gate.Admit("/psflow.ParameterServer/Snapshot", std::nullopt, "ps").message(),
              HasSubstr("only the chief or evaluator may call"));
  EXPECT_EQ(gate.refused(), 9);
}

TEST(CallGateTest, TheTokenComesBeforeTheRole) {
  SecurityOptions o;
  o.ca_pem = "(a CA)";
  o.token = "t";
  CallGate gate(o, Callers());
  EXPECT_TRUE(absl::IsUnauthenticated(
      gate.Admit("/psflow.ParameterServer/Shutdown", std::nullopt, "worker")));
  EXPECT_TRUE(absl::IsPermissionDenied(
      gate.Admit("/psflow.ParameterServer/Shutdown", AuthorizationValue("t"), "worker")));
  EXPECT_TRUE(
      gate.Admit("/psflow.ParameterServer/Shutdown", AuthorizationValue("t"), "chief").ok());
}

TEST(MethodNameTest, IsTheFullName) {
  EXPECT_EQ(MethodName("psflow.ParameterServer", "Init"), "/psflow.ParameterServer/Init");
}

}  // namespace
}  // namespace psflow
