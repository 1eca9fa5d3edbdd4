#include "common/cluster_config.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// The cluster part of TF_CONFIG exactly as the Kubeflow training operator
// writes it for a job with a chief, an evaluator, 2 ps and 2 workers.
constexpr char kOperatorCluster[] =
    R"("cluster":{"chief":["mnist-chief-0.default.svc:2222"],)"
    R"("evaluator":["mnist-evaluator-0.default.svc:2222"],)"
    R"("ps":["mnist-ps-0.default.svc:2222","mnist-ps-1.default.svc:2222"],)"
    R"("worker":["mnist-worker-0.default.svc:2222","mnist-worker-1.default.svc:2222"]})";

std::string OperatorTfConfig(const std::string& type, int index) {
  return absl::StrCat("{", kOperatorCluster, R"(,"task":{"type":")", type, R"(","index":)", index,
                      R"(},"environment":"cloud"})");
}

ConfigEnv TfConfigEnv(const std::string& tf_config) {
  ConfigEnv env;
  env.tf_config = tf_config;
  return env;
}

// Asserts INVALID_ARGUMENT with a one-line message containing `substring`.
void ExpectError(const absl::StatusOr<ClusterConfig>& result, const std::string& substring) {
  ASSERT_FALSE(result.ok()) << "expected an error containing: " << substring;
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(substring));
  EXPECT_THAT(std::string(result.status().message()), Not(HasSubstr("\n")));
}

void ExpectOperatorCluster(const ClusterSpec& spec) {
  EXPECT_THAT(spec.chief, ElementsAre("mnist-chief-0.default.svc:2222"));
  EXPECT_THAT(spec.evaluator, ElementsAre("mnist-evaluator-0.default.svc:2222"));
  EXPECT_THAT(spec.ps, ElementsAre("mnist-ps-0.default.svc:2222", "mnist-ps-1.default.svc:2222"));
  EXPECT_THAT(spec.worker,
              ElementsAre("mnist-worker-0.default.svc:2222", "mnist-worker-1.default.svc:2222"));
}

TEST(RoleTest, NamesRoundTrip) {
  for (Role role : {Role::kChief, Role::kPs, Role::kWorker, Role::kEvaluator}) {
    absl::StatusOr<Role> parsed = ParseRole(RoleName(role));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, role);
  }
  EXPECT_EQ(*ParseRole("master"), Role::kChief);
  EXPECT_EQ(*ParseRole("Worker"), Role::kWorker);
  EXPECT_EQ(*ParseRole("PS"), Role::kPs);
  EXPECT_EQ(ParseRole("launcher").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseHostPortTest, AcceptsHostnamesAndIpv6) {
  std::string host;
  int port = 0;
  ASSERT_TRUE(ParseHostPort("mnist-ps-0.default.svc:2222", &host, &port).ok());
  EXPECT_EQ(host, "mnist-ps-0.default.svc");
  EXPECT_EQ(port, 2222);
  ASSERT_TRUE(ParseHostPort("[::1]:2222", &host, &port).ok());
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 2222);
  ASSERT_TRUE(ParseHostPort("127.0.0.1:65535", &host, &port).ok());
  EXPECT_EQ(port, 65535);
  ASSERT_TRUE(ParseHostPort("localhost:1", &host, &port).ok());
}

TEST(ParseHostPortTest, RejectsMalformed) {
  for (const char* bad :
       {"", "host", "host:", ":2222", "host:0", "host:65536", "host:-1", "host:22x", "host:+22",
        "::1:2222", "[::1]2222", "[::1:2222", "[]:1", "a b:1", "host:99999999999"}) {
    std::string host;
    int port = 0;
    absl::Status s = ParseHostPort(bad, &host, &port);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_THAT(std::string(s.message()), HasSubstr("is not host:port")) << bad;
  }
}

// --- TF_CONFIG as the operator writes it, for every role.

TEST(TfConfigTest, OperatorWorker) {
  auto config = ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("worker", 1)), Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectOperatorCluster(config->cluster);
  EXPECT_EQ(config->role, Role::kWorker);
  EXPECT_EQ(config->task_index, 1);
  EXPECT_EQ(config->self_address, "mnist-worker-1.default.svc:2222");
  EXPECT_EQ(config->self_port, 2222);
}

TEST(TfConfigTest, OperatorPs) {
  auto config = ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("ps", 0)), Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectOperatorCluster(config->cluster);
  EXPECT_EQ(config->role, Role::kPs);
  EXPECT_EQ(config->task_index, 0);
  EXPECT_EQ(config->self_address, "mnist-ps-0.default.svc:2222");
  EXPECT_EQ(config->self_port, 2222);
}

TEST(TfConfigTest, OperatorChief) {
  auto config = ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("chief", 0)), Role::kChief);
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectOperatorCluster(config->cluster);
  EXPECT_EQ(config->role, Role::kChief);
  EXPECT_EQ(config->self_address, "mnist-chief-0.default.svc:2222");
}

TEST(TfConfigTest, OperatorEvaluatorListed) {
  auto config =
      ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("evaluator", 0)), Role::kEvaluator);
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectOperatorCluster(config->cluster);
  EXPECT_EQ(config->role, Role::kEvaluator);
  EXPECT_EQ(config->self_address, "mnist-evaluator-0.default.svc:2222");
  EXPECT_EQ(config->self_port, 2222);
}

TEST(TfConfigTest, EvaluatorWithOnlyTheChief) {
  const std::string tf_config = R"({"cluster":{"chief":["mnist-chief-0.default.svc:2222"]},)"
                                R"("task":{"type":"evaluator","index":0},"environment":"cloud"})";
  auto config = ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kEvaluator);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->cluster.chief, ElementsAre("mnist-chief-0.default.svc:2222"));
  EXPECT_TRUE(config->cluster.ps.empty());
  EXPECT_EQ(config->role, Role::kEvaluator);
  EXPECT_EQ(config->self_address, "");
  EXPECT_EQ(config->self_port, 0);
}

TEST(TfConfigTest, MasterMeansChief) {
  const std::string tf_config =
      absl::StrReplaceAll(OperatorTfConfig("master", 0), {{R"("chief":)", R"("master":)"}});
  auto config = ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kChief);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->cluster.chief, ElementsAre("mnist-chief-0.default.svc:2222"));
  EXPECT_EQ(config->role, Role::kChief);
  EXPECT_EQ(config->self_address, "mnist-chief-0.default.svc:2222");
}

TEST(TfConfigTest, IgnoresUnknownTopLevelKeys) {
  const std::string tf_config = absl::StrCat(
      "{", kOperatorCluster,
      R"(,"task":{"type":"worker","index":0},"rpc_layer":"grpc","environment":"cloud"})");
  auto config = ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->self_address, "mnist-worker-0.default.svc:2222");
}

TEST(TfConfigTest, SparseClusterIsRefusedByName) {
  const std::string tf_config =
      R"({"sparseCluster":{"chief":["c:1"],"ps":["p:1"],"worker":{"1":"w1:1"}},)"
      R"("task":{"type":"worker","index":1},"environment":"cloud"})";
  auto config = ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kWorker);
  ASSERT_TRUE(absl::IsInvalidArgument(config.status())) << config.status();
  EXPECT_THAT(std::string(config.status().message()), ::testing::HasSubstr("sparseCluster"));
  EXPECT_THAT(std::string(config.status().message()),
              ::testing::Not(::testing::HasSubstr("no cluster configuration")));
}

TEST(TfConfigTest, ToleratesTrailingCommas) {
  const std::string tf_config =
      R"({"cluster": {"chief": ["c:1",], "ps": ["p:1", ],}, "task": {"type": "ps", "index": 0,},})";
  auto config = ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->self_address, "p:1");
}

TEST(TfConfigTest, TfConfigWinsOverClusterConfig) {
  ConfigEnv env = TfConfigEnv(OperatorTfConfig("worker", 0));
  env.cluster_config = R"({"chief": ["other:1"], "ps": ["other:2"]})";
  env.pod_name = "ps-0";
  auto config = ResolveClusterConfig({}, env, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  ExpectOperatorCluster(config->cluster);
  EXPECT_EQ(config->role, Role::kWorker);
}

// --- Flags.

ClusterFlags FullFlags() {
  ClusterFlags flags;
  flags.job_name = "worker";
  flags.task_id = 1;
  flags.chief_hosts = "localhost:5000";
  flags.ps_hosts = "localhost:5001,localhost:5002";
  flags.worker_hosts = "localhost:5003, localhost:5004";
  return flags;
}

TEST(FlagsTest, FlagsAlone) {
  auto config = ResolveClusterConfig(FullFlags(), {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->cluster.chief, ElementsAre("localhost:5000"));
  EXPECT_THAT(config->cluster.ps, ElementsAre("localhost:5001", "localhost:5002"));
  EXPECT_THAT(config->cluster.worker, ElementsAre("localhost:5003", "localhost:5004"));
  EXPECT_TRUE(config->cluster.evaluator.empty());
  EXPECT_EQ(config->role, Role::kWorker);
  EXPECT_EQ(config->task_index, 1);
  EXPECT_EQ(config->self_address, "localhost:5004");
  EXPECT_EQ(config->self_port, 5004);
}

TEST(FlagsTest, TaskIndexAliasAndAgreement) {
  ClusterFlags flags = FullFlags();
  flags.task_id.reset();
  flags.task_index = 0;
  auto config = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->self_address, "localhost:5003");

  flags.task_id = 0;  // both given, agreeing
  config = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->task_index, 0);
}

TEST(FlagsTest, EmptyHostListsAreUnset) {
  ClusterFlags flags = FullFlags();
  flags.evaluator_hosts = "";
  auto config = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->cluster.evaluator.empty());
}

TEST(FlagsTest, TaskIdAloneTakesTheBinarysRole) {
  ClusterFlags flags = FullFlags();
  flags.job_name.reset();
  flags.task_id = 1;
  auto config = ResolveClusterConfig(flags, {}, Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->role, Role::kPs);
  EXPECT_EQ(config->self_address, "localhost:5002");
}

TEST(FlagsTest, OverrideTfConfigFieldByField) {
  ClusterFlags flags;
  flags.ps_hosts = "10.0.0.1:3000,10.0.0.2:3000,10.0.0.3:3000";
  auto config =
      ResolveClusterConfig(flags, TfConfigEnv(OperatorTfConfig("worker", 1)), Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  // The ps list is replaced, the rest comes from TF_CONFIG.
  EXPECT_THAT(config->cluster.ps, ElementsAre("10.0.0.1:3000", "10.0.0.2:3000", "10.0.0.3:3000"));
  EXPECT_THAT(config->cluster.chief, ElementsAre("mnist-chief-0.default.svc:2222"));
  EXPECT_EQ(config->role, Role::kWorker);
  EXPECT_EQ(config->self_address, "mnist-worker-1.default.svc:2222");

  // --job_name/--task_id replace the task.
  flags.job_name = "ps";
  flags.task_id = 2;
  config = ResolveClusterConfig(flags, TfConfigEnv(OperatorTfConfig("worker", 1)), Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->role, Role::kPs);
  EXPECT_EQ(config->task_index, 2);
  EXPECT_EQ(config->self_address, "10.0.0.3:3000");
  EXPECT_EQ(config->self_port, 3000);

  // --task_id alone replaces only the index.
  ClusterFlags index_only;
  index_only.task_id = 0;
  config =
      ResolveClusterConfig(index_only, TfConfigEnv(OperatorTfConfig("worker", 1)), Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->self_address, "mnist-worker-0.default.svc:2222");
}

// --- CLUSTER_CONFIG + POD_NAME.

TEST(ClusterConfigEnvTest, HelmRenderedWithTrailingCommas) {
  ConfigEnv env;
  env.cluster_config = R"({
    "chief": ["chief-0.svc:2222",],
    "ps": ["ps-0:2222", "ps-1:2222",],
    "worker": ["worker-0:2222", "worker-1:2222", ],
    "evaluator": [],
  })";
  env.pod_name = "mnist-worker-1";
  auto config = ResolveClusterConfig({}, env, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_THAT(config->cluster.chief, ElementsAre("chief-0.svc:2222"));
  EXPECT_THAT(config->cluster.ps, ElementsAre("ps-0:2222", "ps-1:2222"));
  EXPECT_THAT(config->cluster.worker, ElementsAre("worker-0:2222", "worker-1:2222"));
  EXPECT_TRUE(config->cluster.evaluator.empty());
  EXPECT_EQ(config->role, Role::kWorker);
  EXPECT_EQ(config->task_index, 1);
  EXPECT_EQ(config->self_address, "worker-1:2222");
}

TEST(ClusterConfigEnvTest, CommasInsideStringsAreKept) {
  // A ",]" inside a string (with an escaped quote before it) is not a
  // trailing comma; it ends up in the address and is rejected as such.
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["x\",]:1",], })";
  env.pod_name = "chief-0";
  auto config = ResolveClusterConfig({}, env, Role::kChief);
  ExpectError(config, "CLUSTER_CONFIG: ps[0] 'x\",]:1' is not host:port");
}

TEST(ClusterConfigEnvTest, MasterPodAndIpv6) {
  ConfigEnv env;
  env.cluster_config = R"({"master": ["[::1]:2222"], "ps": ["[::1]:2223"]})";
  env.pod_name = "master-0";
  auto config = ResolveClusterConfig({}, env, Role::kChief);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->role, Role::kChief);
  EXPECT_EQ(config->self_address, "[::1]:2222");
  EXPECT_EQ(config->self_port, 2222);
}

TEST(ClusterConfigEnvTest, PsPod) {
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p0:1", "p1:1"], "worker": ["w:1"]})";
  env.pod_name = "ps-1";
  auto config = ResolveClusterConfig({}, env, Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->self_address, "p1:1");
}

// --- Errors, one per kind.

TEST(ErrorsTest, NothingConfigured) {
  ExpectError(ResolveClusterConfig({}, {}, Role::kWorker),
              "no cluster configuration: pass --job_name, --task_id and "
              "--chief_hosts/--ps_hosts/--worker_hosts, or set TF_CONFIG, or CLUSTER_CONFIG and "
              "POD_NAME");
  ConfigEnv empty;
  empty.tf_config = "";
  empty.pod_name = "";
  ExpectError(ResolveClusterConfig({}, empty, Role::kWorker), "no cluster configuration");
  ClusterFlags only_task;
  only_task.job_name = "worker";
  only_task.task_id = 0;
  ExpectError(ResolveClusterConfig(only_task, {}, Role::kWorker), "no cluster configuration");
}

TEST(ErrorsTest, NoTask) {
  ClusterFlags flags = FullFlags();
  flags.job_name.reset();
  flags.task_id.reset();
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker), "no task");
}

TEST(ErrorsTest, InvalidJson) {
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(R"({"cluster": {"chief": [)"), Role::kWorker),
              "TF_CONFIG is not valid JSON: ");
  ExpectError(ResolveClusterConfig({}, TfConfigEnv("[1, 2]"), Role::kWorker),
              "TF_CONFIG is not valid JSON: ");
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(R"({"cluster": {"chief": ["c:1" "p:1"]}})"),
                                   Role::kWorker),
              "TF_CONFIG is not valid JSON: ");
  ConfigEnv env;
  env.cluster_config = "{\"chief\": [\"c:1\"\n";
  env.pod_name = "chief-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kChief), "CLUSTER_CONFIG is not valid JSON: ");
}

TEST(ErrorsTest, WrongShapes) {
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(R"({"cluster": ["c:1"]})"), Role::kWorker),
              "TF_CONFIG: \"cluster\" is not an object");
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(R"({"cluster": {"ps": "p:1"}})"), Role::kWorker),
              "TF_CONFIG: cluster.ps is not a list");
  ExpectError(
      ResolveClusterConfig({}, TfConfigEnv(R"({"cluster": {"ps": ["p:1", 7]}})"), Role::kWorker),
      "TF_CONFIG: cluster.ps[1] is not a \"host:port\" string");
  ExpectError(ResolveClusterConfig(
                  {}, TfConfigEnv(absl::StrCat("{", kOperatorCluster, R"(,"task":{"index":0}})")),
                  Role::kWorker),
              "TF_CONFIG: task.type is missing");
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("worker", -1)), Role::kWorker),
              "TF_CONFIG: task.index -1 is not a non-negative integer");
}

TEST(ErrorsTest, UnknownRole) {
  const std::string tf_config =
      absl::StrReplaceAll(OperatorTfConfig("worker", 0), {{R"("evaluator":)", R"("launcher":)"}});
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kWorker),
              "TF_CONFIG: unknown role 'launcher' in cluster");
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("launcher", 0)), Role::kWorker),
              "TF_CONFIG: task.type: unknown role 'launcher'");
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:1"], "trainer": ["t:1"]})";
  env.pod_name = "chief-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kChief),
              "CLUSTER_CONFIG: unknown role 'trainer' in the cluster");
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:1"]})";
  env.pod_name = "mnist-launcher-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kChief),
              "POD_NAME 'mnist-launcher-0': unknown role 'launcher'");
  ClusterFlags flags = FullFlags();
  flags.job_name = "trainer";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker), "--job_name: unknown role 'trainer'");
}

TEST(ErrorsTest, ChiefAndMasterBoth) {
  const std::string tf_config =
      absl::StrReplaceAll(OperatorTfConfig("worker", 0), {{R"("evaluator":)", R"("master":)"}});
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kWorker),
              "TF_CONFIG: the cluster lists both 'chief' and 'master'");
}

TEST(ErrorsTest, BadPodName) {
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:1"]})";
  env.pod_name = "worker";
  ExpectError(ResolveClusterConfig({}, env, Role::kWorker),
              "POD_NAME 'worker' is not <role>-<index>");
  env.pod_name = "mnist-worker-x";
  ExpectError(ResolveClusterConfig({}, env, Role::kWorker),
              "POD_NAME 'mnist-worker-x': 'x' is not a task index");
  env.pod_name = "worker-+1";
  ExpectError(ResolveClusterConfig({}, env, Role::kWorker), "is not a task index");
}

TEST(ErrorsTest, RoleIsNotThisBinary) {
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("worker", 1)), Role::kPs),
              "task type 'worker' in TF_CONFIG, but this is the ps binary (psflow-ps)");
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1"]})";
  env.pod_name = "worker-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kChief),
              "task type 'worker' in POD_NAME 'worker-0', but this is the chief binary "
              "(psflow-chief)");
  ExpectError(
      ResolveClusterConfig(FullFlags(), {}, Role::kEvaluator),
      "task type 'worker' in --job_name, but this is the evaluator binary (psflow-evaluator)");
}

TEST(ErrorsTest, IndexOutOfRange) {
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(OperatorTfConfig("worker", 3)), Role::kWorker),
              "task index 3 out of range: the cluster has 2 worker tasks");
  ClusterFlags flags = FullFlags();
  flags.task_id = -1;
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "task index -1 out of range: the cluster has 2 worker tasks");
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:1"]})";
  env.pod_name = "worker-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kWorker),
              "task index 0 out of range: the cluster has 0 worker tasks");
}

TEST(ErrorsTest, NotHostPort) {
  const std::string tf_config = absl::StrReplaceAll(
      OperatorTfConfig("worker", 0), {{R"("mnist-ps-1.default.svc:2222")", R"("x")"}});
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(tf_config), Role::kWorker),
              "TF_CONFIG: cluster.ps[1] 'x' is not host:port");
  const std::string bad_port = absl::StrReplaceAll(
      OperatorTfConfig("worker", 0), {{R"("mnist-chief-0.default.svc:2222")", R"("c:70000")"}});
  ExpectError(ResolveClusterConfig({}, TfConfigEnv(bad_port), Role::kWorker),
              "TF_CONFIG: cluster.chief[0] 'c:70000' is not host:port");
  ClusterFlags flags = FullFlags();
  flags.worker_hosts = "localhost:5003,:5004";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "--worker_hosts: entry 1 ':5004' is not host:port");
  flags.worker_hosts = "localhost:5003,,localhost:5004";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "--worker_hosts: entry 1 '' is not host:port");
  ConfigEnv env;
  env.cluster_config = R"({"chief": ["c:1"], "ps": ["p:0"]})";
  env.pod_name = "chief-0";
  ExpectError(ResolveClusterConfig({}, env, Role::kChief),
              "CLUSTER_CONFIG: ps[0] 'p:0' is not host:port");
}

TEST(ErrorsTest, DuplicateAddress) {
  ClusterFlags flags = FullFlags();
  flags.worker_hosts = "a:1,localhost:5001";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "address 'localhost:5001' appears twice (ps[0] and worker[1])");
  flags.worker_hosts = "a:1,a:1";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker), "address 'a:1' appears twice");
}

TEST(ErrorsTest, NeitherChiefNorWorker) {
  ConfigEnv env =
      TfConfigEnv(R"({"cluster":{"ps":["p:1"]},"task":{"type":"evaluator","index":0}})");
  ExpectError(ResolveClusterConfig({}, env, Role::kEvaluator),
              "the cluster has neither a chief nor a worker");
}

// The Helm chart's CLUSTER_CONFIG of a TensorFlow cluster: ps and workers
// only, service names, port 8080, trailing commas; POD_NAME names the pod.
constexpr char kHelmClusterConfig[] = R"({
  "ps": ["mnist-ps-0:8080", "mnist-ps-1:8080",],
  "worker": ["mnist-worker-0:8080", "mnist-worker-1:8080",],
})";

TEST(ChieflessTest, HelmShapeMakesWorker0TheChief) {
  ConfigEnv env;
  env.cluster_config = kHelmClusterConfig;
  env.pod_name = "mnist-worker-0";
  auto config = ResolveClusterConfig({}, env, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->cluster.chief.empty());
  EXPECT_TRUE(config->cluster.ChiefInWorker0());
  EXPECT_EQ(config->cluster.ChiefAddress(), "mnist-worker-0:8080");
  EXPECT_EQ(config->cluster.ChiefHostRole(), Role::kWorker);
  EXPECT_EQ(config->self_address, "mnist-worker-0:8080");
  EXPECT_EQ(config->self_port, 8080);
  env.pod_name = "mnist-ps-1";
  config = ResolveClusterConfig({}, env, Role::kPs);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->task_index, 1);
  EXPECT_EQ(config->cluster.ChiefAddress(), "mnist-worker-0:8080");
}

TEST(ChieflessTest, TfConfigAndFlagsWithoutAChief) {
  auto config =
      ResolveClusterConfig({},
                           TfConfigEnv(R"({"cluster":{"ps":["p:1"],"worker":["w:1","w:2"]},)"
                                       R"("task":{"type":"worker","index":1}})"),
                           Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->cluster.ChiefAddress(), "w:1");
  ClusterFlags flags = FullFlags();
  flags.chief_hosts.reset();
  config = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->cluster.ChiefInWorker0());
  // With a chief, the chief is the chief.
  config = ResolveClusterConfig(FullFlags(), {}, Role::kWorker);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->cluster.ChiefInWorker0());
  EXPECT_EQ(config->cluster.ChiefHostRole(), Role::kChief);
}

TEST(ErrorsTest, TwoChiefs) {
  ClusterFlags flags = FullFlags();
  flags.chief_hosts = "c:1,c:2";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "the cluster has 2 chief tasks; there must be exactly one");
}

TEST(AllReduceTest, WithoutPsTheWorkersAllReduce) {
  ClusterFlags flags = FullFlags();
  flags.ps_hosts.reset();
  absl::StatusOr<ClusterConfig> c = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->cluster.AllReduce());
  flags.ps_hosts = "";  // empty is unset
  c = ResolveClusterConfig(flags, {}, Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->cluster.AllReduce());
  // A ps binary has no task in such a cluster.
  flags.job_name = "ps";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kPs), "the cluster has 0 ps tasks");
}

// TF_CONFIG as the operator writes it for a TFJob of workers only
// (MultiWorkerMirroredStrategy's shape).
TEST(AllReduceTest, TfConfigOfWorkersOnly) {
  absl::StatusOr<ClusterConfig> c = ResolveClusterConfig(
      {},
      TfConfigEnv(R"({"cluster":{"worker":["mw-worker-0.default.svc:2222",)"
                  R"("mw-worker-1.default.svc:2222"]},"task":{"type":"worker","index":1}})"),
      Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->cluster.AllReduce());
  EXPECT_TRUE(c->cluster.ChiefInWorker0());
  EXPECT_EQ(c->task_index, 1);
  EXPECT_EQ(c->cluster.ChiefAddress(), "mw-worker-0.default.svc:2222");
}

TEST(AllReduceTest, HelmClusterConfigOfWorkersOnly) {
  ConfigEnv env;
  env.cluster_config = R"({"worker": ["rel-worker-0:8080", "rel-worker-1:8080",],})";
  env.pod_name = "rel-worker-0";
  absl::StatusOr<ClusterConfig> c = ResolveClusterConfig({}, env, Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->cluster.AllReduce());
  EXPECT_EQ(c->task_index, 0);
  EXPECT_THAT(c->cluster.worker, ElementsAre("rel-worker-0:8080", "rel-worker-1:8080"));
}

ConfigEnv PyTorchEnv(const std::string& addr, const std::string& port, const std::string& size,
                     const std::string& rank) {
  ConfigEnv env;
  env.master_addr = addr;
  env.master_port = port;
  env.world_size = size;
  env.rank = rank;
  return env;
}

TEST(PyTorchJobTest, MasterAndWorkerPods) {
  absl::StatusOr<ClusterConfig> c =
      ResolveClusterConfig({}, PyTorchEnv("mnist-master-0", "23456", "3", "2"), Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->cluster.worker,
              ElementsAre("mnist-master-0:23456", "mnist-worker-0:23456", "mnist-worker-1:23456"));
  EXPECT_TRUE(c->cluster.AllReduce());
  EXPECT_EQ(c->task_index, 2);
  EXPECT_EQ(c->self_address, "mnist-worker-1:23456");
}

TEST(PyTorchJobTest, WorkerPodsOnly) {
  absl::StatusOr<ClusterConfig> c =
      ResolveClusterConfig({}, PyTorchEnv("mnist-worker-0", "23456", "2", "0"), Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->cluster.worker, ElementsAre("mnist-worker-0:23456", "mnist-worker-1:23456"));
}

TEST(PyTorchJobTest, LoopbackMasterPutsEveryRankOnItsOwnPort) {
  absl::StatusOr<ClusterConfig> c =
      ResolveClusterConfig({}, PyTorchEnv("127.0.0.1", "29500", "3", "1"), Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->cluster.worker,
              ElementsAre("127.0.0.1:29500", "127.0.0.1:29501", "127.0.0.1:29502"));
  EXPECT_EQ(c->self_port, 29501);
}

TEST(PyTorchJobTest, ElasticNamesAndFlagsOverride) {
  ConfigEnv env;
  env.pet_master_addr = "localhost";
  env.pet_master_port = "3000";
  env.pet_nnodes = "2";
  env.world_size = "16";  // processes: 2 nodes x 8; psflow runs one per node
  env.pet_node_rank = "1";
  absl::StatusOr<ClusterConfig> c = ResolveClusterConfig({}, env, Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->cluster.worker, ElementsAre("localhost:3000", "localhost:3001"));
  EXPECT_EQ(c->task_index, 1);
  ClusterFlags flags;
  flags.worker_hosts = "a:1,b:2";
  c = ResolveClusterConfig(flags, env, Role::kWorker);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->self_address, "b:2");
}

TEST(PyTorchJobTest, BadEnvironmentIsOneLine) {
  ExpectError(ResolveClusterConfig({}, PyTorchEnv("10.0.0.5", "23456", "2", "0"), Role::kWorker),
              "pass --worker_hosts");
  // ... which then gives the addresses.
  ClusterFlags hosts;
  hosts.worker_hosts = "10.0.0.5:23456,10.0.0.6:23456";
  absl::StatusOr<ClusterConfig> given =
      ResolveClusterConfig(hosts, PyTorchEnv("10.0.0.5", "23456", "2", "1"), Role::kWorker);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->self_address, "10.0.0.6:23456");
  ExpectError(ResolveClusterConfig({}, PyTorchEnv("job-master-0", "x", "2", "0"), Role::kWorker),
              "MASTER_PORT 'x' is not an integer");
  ExpectError(ResolveClusterConfig({}, PyTorchEnv("job-master-0", "1", "2", "2"), Role::kWorker),
              "RANK 2 out of range");
  ExpectError(ResolveClusterConfig({}, PyTorchEnv("job-master-0", "1", "0", "0"), Role::kWorker),
              "WORLD_SIZE (or PET_NNODES) '0'");
  ExpectError(ResolveClusterConfig({}, PyTorchEnv("127.0.0.1", "65535", "2", "0"), Role::kWorker),
              "runs past port 65535");
  ConfigEnv no_rank = PyTorchEnv("job-master-0", "1", "2", "");
  ExpectError(ResolveClusterConfig({}, no_rank, Role::kWorker),
              "RANK (or PET_NODE_RANK) is not set");
  // A one-process job needs no other addresses.
  EXPECT_TRUE(
      ResolveClusterConfig({}, PyTorchEnv("10.0.0.5", "23456", "1", "0"), Role::kWorker).ok());
}

TEST(ErrorsTest, JobNameWithoutTaskId) {
  ClusterFlags flags = FullFlags();
  flags.task_id.reset();
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker), "--job_name given without --task_id");
  // Even when TF_CONFIG has a task index.
  ExpectError(
      ResolveClusterConfig(flags, TfConfigEnv(OperatorTfConfig("worker", 0)), Role::kWorker),
      "--job_name given without --task_id");
}

TEST(ErrorsTest, TaskIdAndTaskIndexDisagree) {
  ClusterFlags flags = FullFlags();
  flags.task_id = 0;
  flags.task_index = 1;
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker),
              "--task_id 0 and --task_index 1 disagree");
}

TEST(ErrorsTest, NewlinesInInputStayOut) {
  ClusterFlags flags = FullFlags();
  flags.ps_hosts = "p:1,bad\nhost";
  ExpectError(ResolveClusterConfig(flags, {}, Role::kWorker), "--ps_hosts: entry 1");
}

// A ps shares the host where its address is a loopback one or names the
// host of the process's own address.
TEST(PsOnThisHostTest, LoopbackOrTheProcesssOwnHost) {
  ClusterConfig c;
  c.self_address = "node-a:2222";
  c.cluster.ps = {"job-ps-0:2222", "job-ps-1:2222"};
  EXPECT_FALSE(PsOnThisHost(c));
  c.cluster.ps = {"job-ps-0:2222", "node-a:2223"};
  EXPECT_TRUE(PsOnThisHost(c));
  for (const char* ps : {"127.0.0.1:40000", "localhost:2222", "[::1]:2222", "127.0.1.1:9"}) {
    c.cluster.ps = {ps};
    EXPECT_TRUE(PsOnThisHost(c)) << ps;
  }
  c.cluster.ps = {};
  EXPECT_FALSE(PsOnThisHost(c)) << "no ps (all-reduce)";
  c.cluster.ps = {"not an address"};
  EXPECT_FALSE(PsOnThisHost(c));
}

}  // namespace
}  // namespace psflow
