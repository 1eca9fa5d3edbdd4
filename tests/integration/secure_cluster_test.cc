// Process-level tests of mutual TLS and the job token: whole clusters on
// 127.0.0.1 with certificates from scripts/make-certs.sh, probed by clients in
// this process that lack a certificate, hold one of another CA, lack the
// token or hold a worker's certificate; the token alone; plaintext by
// default on loopback, and a refusal beyond it; where a role listens;
// psflow-launch's job token; bad security flags.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/chief.grpc.pb.h"
#include "proto/ps.grpc.pb.h"
#include "tests/common/certs.h"
#include "tests/integration/process.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::SizeIs;
using testing_certs::MakeCerts;
using testing_certs::Options;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

std::chrono::system_clock::time_point CallDeadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(10);
}

// Calls on one ps, made by a client of this process with `security`. A
// client expected to connect (past the TLS handshake) waits for the
// connection (wait-for-ready), so that a slow start on a loaded machine is not
// taken for a refusal; one expected to be refused at the handshake does not.
class PsProbe {
 public:
  PsProbe(const std::string& address, const SecurityOptions& security, bool connects = true)
      : stub_(ParameterServer::NewStub(MakeChannel(address, Role::kPs, security))),
        connects_(connects) {}

  grpc::Status GetState(PsState* state = nullptr) {
    grpc::ClientContext context;
    Prepare(&context);
    PsState response;
    return stub_->GetState(&context, GetStateRequest(), state != nullptr ? state : &response);
  }
  grpc::Status Shutdown() {
    grpc::ClientContext context;
    Prepare(&context);
    ShutdownResponse response;
    return stub_->Shutdown(&context, ShutdownRequest(), &response);
  }
  grpc::Status CheckpointTaken() {
    grpc::ClientContext context;
    Prepare(&context);
    CheckpointTakenResponse response;
    return stub_->CheckpointTaken(&context, CheckpointTakenRequest(), &response);
  }
  grpc::Status SetLiveWorkers() {
    grpc::ClientContext context;
    Prepare(&context);
    SetLiveWorkersRequest request;
    request.add_live_workers(0);
    SetLiveWorkersResponse response;
    return stub_->SetLiveWorkers(&context, request, &response);
  }
  grpc::Status Init() {
    grpc::ClientContext context;
    Prepare(&context);
    InitResponse response;
    std::unique_ptr<grpc::ClientWriter<InitRequest>> writer = stub_->Init(&context, &response);
    InitRequest request;
    request.mutable_header()->set_ps_index(0);
    writer->Write(request);
    writer->WritesDone();
    return writer->Finish();
  }

 private:
  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(CallDeadline());
    context->set_wait_for_ready(connects_);
  }

  std::unique_ptr<ParameterServer::Stub> stub_;
  const bool connects_;
};

// The call's code, and its message when it is not `want`.
::testing::AssertionResult HasCode(const grpc::Status& status, grpc::StatusCode want) {
  if (status.error_code() == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "code " << status.error_code() << " (want " << want << "): " << status.error_message();
}

// The addresses of the chief and of ps0 in psflow-launch's "[launch] cluster:
// chief A, ps B,..." line ("" when there is none).
std::pair<std::string, std::string> LaunchAddresses(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"(\[launch\] cluster: chief (\S+), ps ([^,]+),)")))
    return {"", ""};
  return {m[1].str(), m[2].str()};
}

int CountLines(const std::string& output, const std::string& text) {
  int n = 0;
  for (const std::string& line : Lines(output)) n += line.find(text) != std::string::npos;
  return n;
}

class SecureClusterTest : public TempDirTest {};

// A job with mutual TLS and the token (psflow-launch --tls_dir) trains to the
// end while strangers are refused: no certificate, a certificate of another
// CA (the handshake fails: UNAVAILABLE), the right certificate without the
// token or with another (UNAUTHENTICATED), and a worker's or an evaluator's
// certificate calling the ps's control RPCs or a worker's call on the chief
// (PERMISSION_DENIED). None of it disturbs the job.
TEST_F(SecureClusterTest, TlsAndTokenJobTrainsWhileStrangersAreRefused) {
  const std::string certs = dir_ + "/certs", other = dir_ + "/other";
  ASSERT_TRUE(MakeCerts(certs));
  ASSERT_TRUE(MakeCerts(other));
  const std::string model_dir = dir_ + "/model";
  // With an evaluator: its calls (Snapshot, RegisterEvaluator, ReportEval) are its role's.
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=2", "--evaluators=1", "--tls_dir=" + certs, "--",
                  "--model=mlp", "--train_steps=1500", "--log_every_steps=50",
                  "--eval_every_steps=500", "--compute_threads=1", "--model_dir=" + model_dir});
  ASSERT_TRUE(launch.WaitForOutput("chief] step 50/1500 ", seconds(120))) << launch.Describe();
  const auto [chief, ps0] = LaunchAddresses(launch.output());
  ASSERT_NE(ps0, "") << launch.Describe();

  const SecurityOptions worker = Options(certs, "worker");
  const SecurityOptions evaluator = Options(certs, "evaluator");
  SecurityOptions no_cert;  // trusts the job's CA, shows no certificate
  no_cert.ca_pem = worker.ca_pem;
  no_cert.token = worker.token;
  SecurityOptions other_ca = Options(other, "worker");  // a certificate of another CA
  other_ca.ca_pem = worker.ca_pem;
  other_ca.token = worker.token;
  SecurityOptions no_token = Options(certs, "worker", /*token=*/false);
  SecurityOptions wrong_token = worker;
  wrong_token.token = Options(other, "worker").token;

  const bool refused_at_handshake = false;
  EXPECT_TRUE(HasCode(PsProbe(ps0, SecurityOptions{}, refused_at_handshake).GetState(),
                      grpc::StatusCode::UNAVAILABLE));
  EXPECT_TRUE(HasCode(PsProbe(ps0, no_cert, refused_at_handshake).GetState(),
                      grpc::StatusCode::UNAVAILABLE));
  EXPECT_TRUE(HasCode(PsProbe(ps0, other_ca, refused_at_handshake).GetState(),
                      grpc::StatusCode::UNAVAILABLE));
  EXPECT_TRUE(HasCode(PsProbe(ps0, no_token).GetState(), grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_TRUE(HasCode(PsProbe(ps0, wrong_token).GetState(), grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_TRUE(HasCode(PsProbe(ps0, no_token).Shutdown(), grpc::StatusCode::UNAUTHENTICATED));

  PsProbe as_worker(ps0, worker);
  PsState state;
  grpc::Status s = as_worker.GetState(&state);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(state.holds_job());
  s = as_worker.Shutdown();
  EXPECT_TRUE(HasCode(s, grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_THAT(s.error_message(), HasSubstr("only the chief may call"));
  EXPECT_TRUE(HasCode(as_worker.SetLiveWorkers(), grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_TRUE(HasCode(as_worker.CheckpointTaken(), grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_TRUE(HasCode(as_worker.Init(), grpc::StatusCode::PERMISSION_DENIED));
  EXPECT_TRUE(HasCode(PsProbe(ps0, evaluator).Shutdown(), grpc::StatusCode::PERMISSION_DENIED));

  // The chief takes workers' calls from workers only.
  auto chief_stub = ChiefService::NewStub(MakeChannel(chief, Role::kChief, evaluator));
  grpc::ClientContext context;
  context.set_deadline(CallDeadline());
  context.set_wait_for_ready(true);
  RegisterWorkerRequest request;
  request.set_worker(1);
  RegisterWorkerResponse response;
  EXPECT_TRUE(HasCode(chief_stub->RegisterWorker(&context, request, &response),
                      grpc::StatusCode::PERMISSION_DENIED));

  EXPECT_TRUE(launch.running()) << "the job ended before the probes did\n" << launch.Describe();
  ASSERT_EQ(launch.WaitOrKill(seconds(180)), 0) << launch.Describe();
  const std::string out = launch.output();
  EXPECT_THAT(out, HasSubstr("chief] step 1500/1500 ")) << launch.Describe();
  EXPECT_THAT(out, HasSubstr("chief] eval: step 1500/1500 ")) << launch.Describe();
  EXPECT_THAT(out, HasSubstr("(evaluator)")) << launch.Describe();
  for (const char* name : {"chief", "ps0", "ps1", "worker0", "worker1", "evaluator0"}) {
    EXPECT_THAT(out, HasSubstr(std::string("[launch] ") + name + " exited with code 0"));
  }
  EXPECT_EQ(CountLines(out, "chief] security: mutual TLS as the chief, and a job token"), 1) << out;
  // psflow-launch gives each task its own certificate where --tls_dir has them.
  EXPECT_EQ(CountLines(out,
                       "ps0] security: mutual TLS as ps 0 (a certificate of this task "
                       "only), and a job token"),
            1)
      << out;
  EXPECT_EQ(CountLines(out, "worker1] security: mutual TLS as worker 1 (a certificate"), 1) << out;
  // Refusals are logged (at most a line per 10 s, with the count).
  EXPECT_THAT(out, ::testing::ContainsRegex(
                       "ps0\\] refused a call to /psflow.ParameterServer/[A-Za-z]+: "
                       "UNAUTHENTICATED \\(psflow: the call carries no job token\\); 1 refused"))
      << out;
  EXPECT_THAT(out, HasSubstr("chief] refused a call to /psflow.ChiefService/RegisterWorker: "
                             "PERMISSION_DENIED"))
      << out;
  EXPECT_TRUE(std::filesystem::exists(model_dir + "/saved_model/model.pb")) << out;
}

// The token alone (no TLS): calls without it, or with another, are refused
// (UNAUTHENTICATED); members that have it train a job to the end.
TEST_F(SecureClusterTest, TokenAloneRefusesCallsWithoutIt) {
  const std::string token_file = dir_ + "/token";
  std::ofstream(token_file) << "a-job-token-of-this-test\n";
  std::vector<int> ports = FreePorts(3);
  ASSERT_THAT(ports, SizeIs(3));
  const std::vector<std::string> flags = {
      "--chief_hosts=" + Addr(ports[0]), "--ps_hosts=" + Addr(ports[1]),
      "--worker_hosts=" + Addr(ports[2]), "--auth_token_file=" + token_file};
  auto args = [&](const std::string& role, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"--job_name=" + role, "--task_id=0"};
    a.insert(a.end(), flags.begin(), flags.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  Process ps(Bin("psflow-ps"), args("ps"));
  ASSERT_TRUE(ps.WaitForOutput("listening on", seconds(30))) << ps.Describe();

  SecurityOptions right, wrong;
  right.token = "a-job-token-of-this-test";
  wrong.token = "a-job-token-of-another-test";
  EXPECT_TRUE(HasCode(PsProbe(Addr(ports[1]), SecurityOptions{}).GetState(),
                      grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_TRUE(
      HasCode(PsProbe(Addr(ports[1]), wrong).GetState(), grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_TRUE(HasCode(PsProbe(Addr(ports[1]), SecurityOptions{}).Shutdown(),
                      grpc::StatusCode::UNAUTHENTICATED));
  PsState state;
  grpc::Status s = PsProbe(Addr(ports[1]), right).GetState(&state);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_FALSE(state.holds_job());
  EXPECT_TRUE(ps.running()) << ps.Describe();

  const std::string model_dir = dir_ + "/model";
  Process worker(Bin("psflow-worker"), args("worker"));
  Process chief(Bin("psflow-chief"),
                args("chief", {"--model=mlp", "--train_steps=100", "--log_every_steps=50",
                               "--compute_threads=1", "--model_dir=" + model_dir}));
  EXPECT_EQ(chief.WaitOrKill(seconds(120)), 0) << chief.Describe();
  EXPECT_EQ(worker.WaitOrKill(seconds(30)), 0) << worker.Describe();
  EXPECT_EQ(ps.WaitOrKill(seconds(30)), 0) << ps.Describe();
  EXPECT_THAT(chief.output(), HasSubstr("step 100/100 ")) << chief.Describe();
  EXPECT_EQ(CountLines(ps.output(), "security: a job token on every call, in plaintext"), 1)
      << ps.Describe();
  EXPECT_THAT(ps.output(), HasSubstr("refused a call to /psflow.ParameterServer/GetState: "
                                     "UNAUTHENTICATED"))
      << ps.Describe();
}

// The addresses listening on `port`, from /proc/net/tcp and tcp6: "127.0.0.1"
// (gRPC's sockets are dual-stack: ::ffff:127.0.0.1 too), "any" (every
// interface), or the kernel's hex for others.
std::vector<std::string> ListeningAddresses(int port) {
  std::vector<std::string> found;
  const std::string suffix = absl::StrFormat(":%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      if (!(fields >> slot >> local >> remote >> state) || state != "0A") continue;
      if (local.size() <= suffix.size() ||
          local.compare(local.size() - suffix.size(), suffix.size(), suffix) != 0)
        continue;
      const std::string host = local.substr(0, local.size() - suffix.size());
      if (host == "0100007F" || host == "0000000000000000FFFF00000100007F") {
        found.push_back("127.0.0.1");
      } else if (host.find_first_not_of('0') == std::string::npos ||
                 host == "0000000000000000FFFF000000000000") {
        found.push_back("any");
      } else {
        found.push_back(host);
      }
    }
  }
  return found;
}

// Without security flags a role on loopback runs in plaintext and says so in
// one line. It listens on its own address where that is an IP address of this
// machine (127.0.0.1 stays on loopback), and on 127.0.0.1 for "localhost".
TEST_F(SecureClusterTest, PlaintextByDefaultListeningOnItsOwnAddressWhereLocal) {
  std::vector<int> ports = FreePorts(4);
  ASSERT_THAT(ports, SizeIs(4));
  auto ps = [&](const std::string& host) {
    return std::make_unique<Process>(
        Bin("psflow-ps"),
        std::vector<std::string>{"--job_name=ps", "--task_id=0", "--chief_hosts=" + Addr(ports[0]),
                                 "--ps_hosts=" + host + ":" + std::to_string(ports[1]) + "," +
                                     host + ":" + std::to_string(ports[2]),
                                 "--worker_hosts=" + Addr(ports[3])});
  };
  auto on_loopback = ps("127.0.0.1");
  ASSERT_TRUE(on_loopback->WaitForOutput("listening on", seconds(30))) << on_loopback->Describe();
  EXPECT_EQ(CountLines(on_loopback->output(), "security: none (plaintext, no job token)"), 1)
      << on_loopback->Describe();
  EXPECT_EQ(ListeningAddresses(ports[1]), std::vector<std::string>{"127.0.0.1"});
  on_loopback->Signal(SIGTERM);
  EXPECT_EQ(on_loopback->WaitOrKill(seconds(20)), 128 + SIGTERM) << on_loopback->Describe();

  auto by_name = ps("localhost");
  ASSERT_TRUE(by_name->WaitForOutput("listening on", seconds(30))) << by_name->Describe();
  EXPECT_EQ(ListeningAddresses(ports[1]), std::vector<std::string>{"127.0.0.1"});
  by_name->Signal(SIGTERM);
  by_name->WaitOrKill(seconds(20));
}

// A DNS name no resolver knows: a member listens for it on every interface
// (ListenAddress), without the name ever being looked up.
constexpr char kNameBeyondLoopback[] = "psflow-member.invalid";

// Secure by default: each role that would listen beyond loopback (for a DNS
// name other than localhost, or 0.0.0.0) in plaintext without a job token
// exits 1 at once with one line naming the address and the flags that fix
// it. The check comes before anything is bound: the line is the process's
// only output.
TEST_F(SecureClusterTest, RefusesToListenBeyondLoopbackInPlaintextWithoutAToken) {
  std::vector<int> ports = FreePorts(4);
  ASSERT_THAT(ports, SizeIs(4));
  struct Case {
    std::string role;
    int self;  // the index in `ports` of its own address
    std::string host;
  };
  const std::vector<Case> cases = {{"ps", 1, kNameBeyondLoopback},
                                   {"ps", 1, "0.0.0.0"},
                                   {"worker", 2, kNameBeyondLoopback},
                                   {"chief", 0, kNameBeyondLoopback},
                                   {"evaluator", 3, kNameBeyondLoopback}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.role + " on " + c.host);
    std::vector<std::string> hosts;
    for (int i = 0; i < 4; ++i) {
      hosts.push_back(i == c.self ? c.host + ":" + std::to_string(ports[i]) : Addr(ports[i]));
    }
    const std::string self = hosts[c.self];
    std::vector<std::string> args = {"--job_name=" + c.role,       "--task_id=0",
                                     "--chief_hosts=" + hosts[0],  "--ps_hosts=" + hosts[1],
                                     "--worker_hosts=" + hosts[2], "--evaluator_hosts=" + hosts[3]};
    if (c.role == "chief") args.push_back("--model_dir=" + dir_ + "/model");
    RunResult r = RunProcess(Bin("psflow-" + c.role), args, {}, seconds(10));
    EXPECT_EQ(r.exit_code, 1) << r.description;
    EXPECT_LT(r.seconds, 5.0) << r.description;
    EXPECT_EQ(r.out, "") << r.description;
    EXPECT_THAT(Lines(r.err), SizeIs(1)) << r.description;
    const std::string listen = "0.0.0.0:" + std::to_string(ports[c.self]);
    EXPECT_THAT(r.err, HasSubstr("psflow-" + c.role + ": refusing to listen on " + listen +
                                 (c.host == "0.0.0.0" ? "" : " (for " + self + ")") +
                                 " in plaintext without a job token"))
        << r.description;
    EXPECT_THAT(r.err, HasSubstr("--tls_cert, --tls_key and --tls_ca")) << r.description;
    EXPECT_THAT(r.err, HasSubstr("--auth_token_file, or --insecure")) << r.description;
  }
}

// --insecure, or a job token, lets a role past that check to listen on every
// interface, the plaintext warning line staying for --insecure. So that no
// address beyond loopback is ever bound here, the test holds the port on
// 127.0.0.1: the ps's bind on every interface then fails, which shows it got
// past the check ("cannot listen on port P" instead of the refusal).
TEST_F(SecureClusterTest, InsecureOrATokenPassesTheCheckBeyondLoopback) {
  std::vector<int> ports = FreePorts(3);
  ASSERT_THAT(ports, SizeIs(3));
  const int held = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(held, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(ports[1]));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(held, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(held, 1), 0);
  const std::string token_file = dir_ + "/token";
  std::ofstream(token_file) << "a-job-token-of-this-test\n";
  const std::string self = std::string(kNameBeyondLoopback) + ":" + std::to_string(ports[1]);
  for (const std::string& flag : {std::string("--insecure"), "--auth_token_file=" + token_file}) {
    SCOPED_TRACE(flag);
    RunResult r = RunProcess(Bin("psflow-ps"),
                             {"--job_name=ps", "--task_id=0", "--chief_hosts=" + Addr(ports[0]),
                              "--ps_hosts=" + self, "--worker_hosts=" + Addr(ports[2]), flag},
                             {}, seconds(10));
    EXPECT_EQ(r.exit_code, 1) << r.description;
    EXPECT_THAT(r.output, Not(HasSubstr("refusing to listen"))) << r.description;
    EXPECT_THAT(r.output, HasSubstr("cannot listen on port " + std::to_string(ports[1]) +
                                    " (0.0.0.0:" + std::to_string(ports[1]) + ")"))
        << r.description;
    EXPECT_EQ(CountLines(r.output, "security: none (plaintext, no job token)"),
              flag == "--insecure" ? 1 : 0)
        << r.description;
  }
  ::close(held);
}

// psflow-launch gives every cluster a job token of its own: a random one, in
// a file only its owner may read (in a private directory), that every
// process gets as --auth_token_file. A call without it (as from another user
// of this machine) is refused UNAUTHENTICATED while the job trains; the file
// goes with the launcher, stopped here as Ctrl-C stops it.
TEST_F(SecureClusterTest, LaunchedClusterRunsWithAGeneratedToken) {
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=1", "--", "--model=mlp", "--train_steps=1000000",
                  "--log_every_steps=50", "--compute_threads=1", "--model_dir=" + dir_ + "/model"});
  ASSERT_TRUE(launch.WaitForOutput("chief] step 50/1000000 ", seconds(120))) << launch.Describe();
  std::smatch m;
  const std::string out = launch.output();
  ASSERT_TRUE(
      std::regex_search(out, m,
                        std::regex(R"(\[launch\] the cluster runs with a job token generated )"
                                   R"(for it, in (\S+) \(removed at exit\))")))
      << launch.Describe();
  const std::string token_file = m[1].str();
  struct stat st {};
  ASSERT_EQ(::stat(token_file.c_str(), &st), 0) << token_file;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const std::string token_dir = std::filesystem::path(token_file).parent_path().string();
  ASSERT_EQ(::stat(token_dir.c_str(), &st), 0) << token_dir;
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  std::ifstream in(token_file);
  std::string token;
  in >> token;
  EXPECT_THAT(token, ::testing::MatchesRegex("[0-9a-f]{64}"));

  // Every member (chief, ps0, worker0) has the token file.
  const auto [chief, ps0] = LaunchAddresses(out);
  ASSERT_NE(ps0, "") << launch.Describe();
  std::vector<pid_t> members = FindProcesses("--chief_hosts=" + chief);
  std::vector<pid_t> with_token = FindProcesses("--auth_token_file=" + token_file);
  std::sort(members.begin(), members.end());
  std::sort(with_token.begin(), with_token.end());
  EXPECT_THAT(members, SizeIs(3));
  EXPECT_EQ(with_token, members);

  EXPECT_TRUE(
      HasCode(PsProbe(ps0, SecurityOptions{}).GetState(), grpc::StatusCode::UNAUTHENTICATED));
  EXPECT_TRUE(
      HasCode(PsProbe(ps0, SecurityOptions{}).Shutdown(), grpc::StatusCode::UNAUTHENTICATED));
  SecurityOptions with_the_token;
  with_the_token.token = token;
  PsState state;
  grpc::Status s = PsProbe(ps0, with_the_token).GetState(&state);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(state.holds_job());
  EXPECT_TRUE(launch.running()) << "the job ended before the probes did\n" << launch.Describe();

  launch.Signal(SIGTERM);
  EXPECT_EQ(launch.WaitOrKill(seconds(60)), 128 + SIGTERM) << launch.Describe();
  EXPECT_EQ(CountLines(launch.output(), "ps0] security: a job token on every call"), 1)
      << launch.Describe();
  EXPECT_THAT(launch.output(),
              HasSubstr("ps0] refused a call to /psflow.ParameterServer/GetState: UNAUTHENTICATED"))
      << launch.Describe();
  EXPECT_FALSE(std::filesystem::exists(token_file));
  EXPECT_FALSE(std::filesystem::exists(token_dir));
}

// psflow-launch --token_file names the token's file and keeps it after the
// run (for clients from outside); with a --tls_dir that holds a token it is
// refused with one line.
TEST_F(SecureClusterTest, LaunchTokenFileIsKeptAndExclusiveWithTheTlsDirsToken) {
  const std::string token_file = dir_ + "/job.token";
  // The chief refuses its flags at once; the cluster stops.
  RunResult r =
      RunProcess(Bin("psflow-launch"),
                 {"--ps=1", "--workers=1", "--token_file=" + token_file, "--", "--no_such_flag"},
                 {}, seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_THAT(r.output, HasSubstr("in " + token_file + " (kept: --token_file)")) << r.description;
  struct stat st {};
  ASSERT_EQ(::stat(token_file.c_str(), &st), 0) << r.description;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  std::ifstream in(token_file);
  std::string token;
  in >> token;
  EXPECT_THAT(token, ::testing::MatchesRegex("[0-9a-f]{64}"));

  const std::string tls = dir_ + "/tls";  // only the names matter before anything starts
  std::filesystem::create_directories(tls);
  for (const char* name : {"ca.crt", "chief.crt", "chief.key", "ps.crt", "ps.key", "worker.crt",
                           "worker.key", "token"}) {
    std::ofstream(tls + "/" + name) << "x";
  }
  r = RunProcess(Bin("psflow-launch"), {"--tls_dir=" + tls, "--token_file=" + token_file}, {},
                 seconds(10));
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_EQ(r.out, "") << r.description;
  EXPECT_THAT(Lines(r.err), SizeIs(1)) << r.description;
  EXPECT_THAT(r.err, HasSubstr("--token_file: the cluster uses the token in " + tls + "/token"))
      << r.description;
}

// Security flags that cannot work exit 1 at once with one line.
TEST_F(SecureClusterTest, BadSecurityFlagsExitOneWithOneLine) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(MakeCerts(certs));
  std::vector<int> ports = FreePorts(3);
  ASSERT_THAT(ports, SizeIs(3));
  const std::vector<std::string> cluster = {"--chief_hosts=" + Addr(ports[0]),
                                            "--ps_hosts=" + Addr(ports[1]),
                                            "--worker_hosts=" + Addr(ports[2])};
  struct Case {
    std::string binary;
    std::vector<std::string> flags;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"psflow-ps", {"--tls_cert=" + certs + "/ps.crt"}, "needs all of --tls_cert, --tls_key"},
      {"psflow-ps",
       {"--tls_cert=" + certs + "/worker.crt", "--tls_key=" + certs + "/worker.key",
        "--tls_ca=" + certs + "/ca.crt"},
       "is the certificate of 'worker' (its CN), but this process is the ps"},
      {"psflow-worker",
       {"--tls_cert=" + certs + "/worker.crt", "--tls_key=" + certs + "/ps.key",
        "--tls_ca=" + certs + "/ca.crt"},
       "--tls_key is not the private key of --tls_cert"},
      {"psflow-worker", {"--auth_token_file=" + dir_ + "/none"}, "--auth_token_file: cannot open"},
      {"psflow-launch", {"--tls_dir=" + dir_ + "/none"}, "--tls_dir: no ca.crt in"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.binary + " " + c.flags[0]);
    std::vector<std::string> args = c.flags;
    if (c.binary != "psflow-launch") {
      const std::string role = c.binary.substr(std::string("psflow-").size());
      args.push_back("--job_name=" + role);
      args.push_back("--task_id=0");
      args.insert(args.end(), cluster.begin(), cluster.end());
    }
    RunResult r = RunProcess(Bin(c.binary), args, {}, seconds(10));
    EXPECT_EQ(r.exit_code, 1) << r.description;
    EXPECT_LT(r.seconds, 5.0) << r.description;
    EXPECT_EQ(r.out, "") << r.description;
    EXPECT_THAT(Lines(r.err), SizeIs(1)) << r.description;
    EXPECT_THAT(r.err, HasSubstr(c.expect)) << r.description;
  }
}

}  // namespace
}  // namespace psflow::itest
