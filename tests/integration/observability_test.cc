// Process-level tests of what operators watch: every role's Prometheus
// /metrics (--metrics_port) scraped while a real job trains and parsed by the
// Prometheus project's Python parser, and the standard gRPC health service,
// whose server-wide status follows each role's readiness; and the step
// trace (--trace_dir) every ps and worker writes, on one clock.
#include <signal.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/trace.pb.h"
#include "tests/common/http.h"
#include "tests/integration/process.h"

#ifndef PSFLOW_SOURCE_DIR
#error "PSFLOW_SOURCE_DIR (the source tree, for parse_metrics.py) must be defined"
#endif
#ifndef PSFLOW_PYTHON3
#error "PSFLOW_PYTHON3 (Debian's python3, which has python3-prometheus-client) must be defined"
#endif

namespace psflow::itest {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::SizeIs;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

// ---------------------------------------------------------------------------
// Scraping

// The body of GET http://127.0.0.1:<port><path> if the answer is 200; "" and
// the status line (or why there is none) in *error otherwise.
std::string HttpGet(int port, const std::string& path, std::string* error) {
  const std::string answer = testing_http::Get(port, path);
  if (answer.empty()) {
    *error = "cannot connect to port " + std::to_string(port);
    return "";
  }
  const size_t body = answer.find("\r\n\r\n");
  if (body == std::string::npos || testing_http::StatusCode(answer) != "200") {
    *error = "answer: " + answer.substr(0, answer.find("\r\n"));
    return "";
  }
  return answer.substr(body + 4);
}

// The status code of GET http://127.0.0.1:<port><path> ("200", "503"), or ""
// when nothing answers.
std::string HttpStatus(int port, const std::string& path) {
  return testing_http::StatusCode(testing_http::Get(port, path));
}

// Polls until GET <path> on `port` answers `want` (true) or `timeout` passes.
bool WaitForHttpStatus(int port, const std::string& path, const std::string& want,
                       milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (HttpStatus(port, path) == want) return true;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return HttpStatus(port, path) == want;
}

// One scrape as the Prometheus parser read it.
struct Scrape {
  std::string text;                          // as served
  std::map<std::string, std::string> types;  // family (the parser's name) -> type
  std::map<std::string, double> samples;     // "name{k=v,...}" -> value
  std::set<std::string> names;               // sample names
  // The value of sample `name` with `labels` ("k=v,..." sorted), -1 if absent.
  double Value(const std::string& name, const std::string& labels = "") const {
    auto it = samples.find(name + "{" + labels + "}");
    return it == samples.end() ? -1 : it->second;
  }
  // The sum over every series of sample `name`.
  double Sum(const std::string& name) const {
    double sum = 0;
    for (const auto& [key, value] : samples) {
      if (key.compare(0, name.size() + 1, name + "{") == 0) sum += value;
    }
    return sum;
  }
};

class ObservabilityTest : public TempDirTest {
 protected:
  // Scrapes port's /metrics and parses it with parse_metrics.py; fails the
  // test (and returns what it has) when either fails; sets skip_ when the
  // parser is not installed.
  Scrape ScrapeAndParse(int port, const std::string& what) {
    Scrape s;
    std::string error;
    s.text = HttpGet(port, "/metrics", &error);
    EXPECT_NE(s.text, "") << what << ": " << error;
    const std::string file = dir_ + "/scrape" + std::to_string(++scrapes_) + ".txt";
    std::ofstream(file) << s.text;
    RunResult r =
        RunProcess(PSFLOW_PYTHON3,
                   {std::string(PSFLOW_SOURCE_DIR) + "/tests/integration/parse_metrics.py", file},
                   {}, seconds(30));
    if (r.exit_code == 77) {
      skip_ = r.err;
      return s;
    }
    EXPECT_EQ(r.exit_code, 0) << what << " (" << file << "):\n" << r.description;
    for (const std::string& line : Lines(r.out)) {
      std::vector<std::string> f;
      size_t start = 0;
      for (size_t tab; (tab = line.find('\t', start)) != std::string::npos; start = tab + 1)
        f.push_back(line.substr(start, tab - start));
      f.push_back(line.substr(start));
      if (f[0] == "TYPE" && f.size() == 3) s.types[f[1]] = f[2];
      if (f[0] == "SAMPLE" && f.size() == 4) {
        s.samples[f[1] + "{" + f[2] + "}"] = std::stod(f[3]);
        s.names.insert(f[1]);
      }
    }
    return s;
  }

  // Every family of `wanted` (name -> type, the parser's family names) is
  // there with that type and at least one sample.
  void ExpectFamilies(const Scrape& s, const std::map<std::string, std::string>& wanted,
                      const std::string& what) {
    for (const auto& [family, type] : wanted) {
      auto it = s.types.find(family);
      if (it == s.types.end()) {
        ADD_FAILURE() << what << " serves no " << family << "\n" << s.text;
        continue;
      }
      EXPECT_EQ(it->second, type) << what << ": " << family;
      const std::string sample = type == "counter"     ? family + "_total"
                                 : type == "histogram" ? family + "_count"
                                                       : family;
      EXPECT_TRUE(s.names.count(sample)) << what << ": no sample " << sample << "\n" << s.text;
    }
  }

  // ScrapeAndParse of each (name, metrics port) of `roles`, by name.
  std::map<std::string, Scrape> ScrapeAll(const std::vector<std::pair<std::string, int>>& roles) {
    std::map<std::string, Scrape> scrapes;
    for (const auto& [name, port] : roles) scrapes[name] = ScrapeAndParse(port, name);
    return scrapes;
  }

  // The examples the chief at metrics port `port` has counted; then waits (up
  // to about 30 s) for it to count more.
  double ExamplesThenWaitForMore(int port) {
    const double examples = ScrapeAndParse(port, "chief").Value("psflow_examples_total");
    for (int i = 0; i < 300; ++i) {
      if (ScrapeAndParse(port, "chief").Value("psflow_examples_total") > examples) break;
      std::this_thread::sleep_for(milliseconds(100));
    }
    return examples;
  }

  int scrapes_ = 0;
  std::string skip_;  // why the parser could not run
};

// ---------------------------------------------------------------------------
// Health

// The serving status of `service` at `address` ("SERVING", "NOT_SERVING"),
// or the call's error code ("UNAVAILABLE", "NOT_FOUND").
std::string Health(const std::string& address, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status s = stub->Check(&context, request, &response);
  if (!s.ok()) {
    switch (s.error_code()) {
      case grpc::StatusCode::NOT_FOUND:
        return "NOT_FOUND";
      case grpc::StatusCode::UNAVAILABLE:
        return "UNAVAILABLE";
      default:
        return "error " + std::to_string(s.error_code());
    }
  }
  return HealthCheckResponse::ServingStatus_Name(response.status());
}

// Polls until `address` answers `want` for `service` (true) or `timeout`
// passes (false).
bool WaitForHealth(const std::string& address, const std::string& service, const std::string& want,
                   milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (Health(address, service) == want) return true;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return Health(address, service) == want;
}

// ---------------------------------------------------------------------------
// Metrics

// What each role serves (family -> type, as the parser names them).
const std::map<std::string, std::string> kChiefFamilies = {
    {"psflow_global_step", "gauge"},
    {"psflow_examples_per_second", "gauge"},
    {"psflow_step_seconds", "gauge"},
    {"psflow_step_phase_seconds", "counter"},
    {"psflow_examples", "counter"},
    {"psflow_loss", "gauge"},
    {"psflow_accuracy", "gauge"},
    {"psflow_live_workers", "gauge"},
    {"psflow_workers", "gauge"},
    {"psflow_live_ps", "gauge"},
    {"psflow_ps", "gauge"},
    {"psflow_checkpoint_seconds", "histogram"},
    {"psflow_checkpoint_bytes", "gauge"},
    {"psflow_checkpoint_step", "gauge"},
    {"psflow_eval_step", "gauge"},
    {"psflow_eval_loss", "gauge"},
    {"psflow_eval_accuracy", "gauge"},
    {"psflow_rpc_errors", "counter"},
};
const std::map<std::string, std::string> kPsFamilies = {
    {"psflow_ps_version", "gauge"},
    {"psflow_ps_applied_steps", "counter"},
    {"psflow_ps_stale_pushes", "counter"},
    {"psflow_ps_duplicate_pushes", "counter"},
    {"psflow_ps_refused_pushes", "counter"},
    {"psflow_ps_push_bytes", "histogram"},
    {"psflow_ps_staleness_versions", "counter"},
    {"psflow_ps_staleness_max", "gauge"},
    {"psflow_ps_worker_lead_max", "gauge"},
    {"psflow_ps_push_seconds", "histogram"},
    {"psflow_ps_pull_bytes", "histogram"},
    {"psflow_ps_pull_seconds", "histogram"},
};
const std::map<std::string, std::string> kWorkerFamilies = {
    {"psflow_push_bytes", "histogram"}, {"psflow_push_seconds", "histogram"},
    {"psflow_pull_bytes", "histogram"}, {"psflow_pull_seconds", "histogram"},
    {"psflow_worker_step", "gauge"},    {"psflow_rpc_errors", "counter"},
};
const std::map<std::string, std::string> kEvaluatorFamilies = {
    {"psflow_evaluator_step", "gauge"},        {"psflow_evaluator_loss", "gauge"},
    {"psflow_evaluator_accuracy", "gauge"},    {"psflow_evaluator_evaluations", "counter"},
    {"psflow_evaluator_seconds", "histogram"}, {"psflow_rpc_errors", "counter"},
};

// A chief, one ps, two workers and an evaluator, each with --metrics_port,
// training the mlp (evaluated every 100 steps), started on construction,
// killed (SIGKILL) on destruction if still running. Ports `p`: gRPC chief,
// ps, worker0, worker1, evaluator0 (listed: in plaintext the chief takes only
// the evaluators its cluster lists); metrics chief, ps, worker0, worker1,
// evaluator0.
class MetricsCluster {
 public:
  MetricsCluster(std::vector<int> p, const std::string& model_dir)
      : p_(std::move(p)),
        hosts_({"--chief_hosts=" + Addr(p_[0]), "--ps_hosts=" + Addr(p_[1]),
                "--worker_hosts=" + Addr(p_[2]) + "," + Addr(p_[3]),
                "--evaluator_hosts=" + Addr(p_[4])}),
        ps_(std::make_unique<Process>(Bin("psflow-ps"), Args("ps", 0, p_[6]))),
        worker0_(Bin("psflow-worker"), Args("worker", 0, p_[7])),
        worker1_(Bin("psflow-worker"), Args("worker", 1, p_[8])),
        evaluator_(Bin("psflow-evaluator"), EvaluatorArgs()),
        chief_(Bin("psflow-chief"), ChiefArgs(model_dir)) {}

  Process& chief() { return chief_; }
  Process& evaluator() { return evaluator_; }
  // Each role's name and metrics port.
  std::vector<std::pair<std::string, int>> MetricsPorts() const {
    return {{"chief", p_[5]},
            {"ps", p_[6]},
            {"worker0", p_[7]},
            {"worker1", p_[8]},
            {"evaluator", p_[9]}};
  }

  // For failure messages: every process's.
  std::string Describe() const {
    return "\n===== chief\n" + chief_.Describe() + "\n===== ps\n" + ps_->Describe() +
           "\n===== worker0\n" + worker0_.Describe() + "\n===== worker1\n" + worker1_.Describe() +
           "\n===== evaluator\n" + evaluator_.Describe();
  }

  // The ps goes away for longer than the chief's look at it may take (2 s),
  // then a new one starts on the same ports.
  void KillAndRestartPs() {
    ps_->Signal(SIGKILL);
    ps_->WaitOrKill(seconds(10));
    std::this_thread::sleep_for(milliseconds(3000));
    ps_ = std::make_unique<Process>(Bin("psflow-ps"), Args("ps", 0, p_[6]));
  }

  // SIGTERM to the chief (which exits 128 + SIGTERM), then to the others.
  void Stop() {
    chief_.Signal(SIGTERM);
    EXPECT_EQ(chief_.WaitOrKill(seconds(60)), 128 + SIGTERM) << Describe();
    for (Process* other : {ps_.get(), &worker0_, &worker1_, &evaluator_}) other->Signal(SIGTERM);
    for (Process* other : {ps_.get(), &worker0_, &worker1_, &evaluator_}) {
      other->WaitOrKill(seconds(20));
    }
  }

 private:
  std::vector<std::string> Args(const std::string& role, int index, int metrics_port) const {
    std::vector<std::string> a = {"--job_name=" + role, "--task_id=" + std::to_string(index),
                                  "--metrics_port=" + std::to_string(metrics_port)};
    a.insert(a.end(), hosts_.begin(), hosts_.end());
    return a;
  }
  std::vector<std::string> EvaluatorArgs() const {
    std::vector<std::string> a = Args("evaluator", 0, p_[9]);
    a.push_back("--compute_threads=1");
    return a;
  }
  std::vector<std::string> ChiefArgs(const std::string& model_dir) const {
    std::vector<std::string> a = Args("chief", 0, p_[5]);
    for (const char* flag : {"--model=mlp", "--train_steps=1000000", "--log_every_steps=20",
                             "--checkpoint_every_steps=40", "--eval_every_steps=100",
                             "--eval_every_secs=0", "--compute_threads=1"}) {
      a.push_back(flag);
    }
    a.push_back("--model_dir=" + model_dir);
    return a;
  }

  const std::vector<int> p_;
  const std::vector<std::string> hosts_;
  std::unique_ptr<Process> ps_;  // replaced when restarted
  Process worker0_, worker1_, evaluator_, chief_;
};

// Training moves the counters between the two scrapes.
void ExpectCountersMoved(const std::map<std::string, Scrape>& first,
                         const std::map<std::string, Scrape>& second) {
  EXPECT_GT(second.at("chief").Value("psflow_examples_total"),
            first.at("chief").Value("psflow_examples_total"));
  EXPECT_GT(second.at("chief").Value("psflow_global_step"),
            first.at("chief").Value("psflow_global_step"));
  EXPECT_GT(second.at("chief").Value("psflow_step_phase_seconds_total", "phase=compute"),
            first.at("chief").Value("psflow_step_phase_seconds_total", "phase=compute"));
  EXPECT_GT(second.at("ps").Value("psflow_ps_applied_steps_total"),
            first.at("ps").Value("psflow_ps_applied_steps_total"));
  EXPECT_GT(second.at("ps").Value("psflow_ps_push_bytes_count"),
            first.at("ps").Value("psflow_ps_push_bytes_count"));
  for (const std::string w : {"worker0", "worker1"}) {
    EXPECT_GT(second.at(w).Value("psflow_push_bytes_count"),
              first.at(w).Value("psflow_push_bytes_count"))
        << w;
    EXPECT_GT(second.at(w).Value("psflow_pull_bytes_sum"),
              first.at(w).Value("psflow_pull_bytes_sum"))
        << w;
    EXPECT_GT(second.at(w).Value("psflow_worker_step"), first.at(w).Value("psflow_worker_step"))
        << w;
  }
}

// The evaluator evaluated (every 100 steps), and the chief logged what it
// reported: the chief, scraped first, is at most at the evaluator's step.
void ExpectEvaluationsReported(const Scrape& e, const Scrape& chief) {
  EXPECT_GE(e.Value("psflow_evaluator_evaluations_total"), 1) << e.text;
  EXPECT_EQ(e.Value("psflow_evaluator_seconds_count"),
            e.Value("psflow_evaluator_evaluations_total"));
  EXPECT_GE(e.Value("psflow_evaluator_step"), 100) << e.text;
  EXPECT_EQ(static_cast<int64_t>(e.Value("psflow_evaluator_step")) % 100, 0) << e.text;
  EXPECT_GT(e.Value("psflow_evaluator_loss"), 0);
  EXPECT_GE(e.Value("psflow_evaluator_accuracy"), 0);
  EXPECT_LE(e.Value("psflow_evaluator_accuracy"), 1);
  EXPECT_GE(chief.Value("psflow_eval_step"), 100) << chief.text;
  EXPECT_LE(chief.Value("psflow_eval_step"), e.Value("psflow_evaluator_step"));
  EXPECT_GT(chief.Value("psflow_eval_loss"), 0);
  EXPECT_GE(chief.Value("psflow_eval_accuracy"), 0);
  EXPECT_LE(chief.Value("psflow_eval_accuracy"), 1);
}

// Values of the chief's (`c`) and the ps's metrics that follow from the job.
void ExpectJobValues(const Scrape& c, const Scrape& ps) {
  EXPECT_EQ(c.Value("psflow_workers"), 2);
  EXPECT_EQ(c.Value("psflow_live_workers"), 2);
  EXPECT_EQ(c.Value("psflow_ps"), 1);
  EXPECT_EQ(c.Value("psflow_live_ps"), 1);
  EXPECT_GT(c.Value("psflow_examples_per_second"), 0);
  EXPECT_GT(c.Value("psflow_loss"), 0);
  EXPECT_GE(c.Value("psflow_accuracy"), 0);
  EXPECT_LE(c.Value("psflow_accuracy"), 1);
  for (const char* phase : {"pull", "compute", "push", "wait"})
    EXPECT_GE(c.Value("psflow_step_seconds", std::string("phase=") + phase), 0) << phase;
  EXPECT_GE(c.Value("psflow_checkpoint_seconds_count"), 1);
  EXPECT_GE(c.Value("psflow_checkpoint_step"), 40);
  // The mlp's 784*256 + 256 + 256*256 + 256 + 256*10 + 10 floats, with no optimizer slots (sgd).
  EXPECT_EQ(c.Value("psflow_checkpoint_bytes"), 4.0 * (784 * 256 + 256 + 256 * 256 + 256 + 2570));
  // A histogram's +Inf bucket is its count.
  EXPECT_EQ(ps.Value("psflow_ps_push_seconds_bucket", "le=+Inf"),
            ps.Value("psflow_ps_push_seconds_count"));
}

// Failed calls, by code: the chief's look at the ps failed (UNAVAILABLE if
// it was under way when the ps died, else DEADLINE_EXCEEDED), and so did the
// workers' calls under way.
void ExpectFailedCallsCounted(const std::map<std::string, Scrape>& scrapes) {
  const Scrape& chief = scrapes.at("chief");
  EXPECT_GE(chief.Sum("psflow_rpc_errors_total"), 1) << chief.text;
  EXPECT_THAT(chief.text, ::testing::ContainsRegex(
                              "psflow_rpc_errors_total\\{service=\"psflow.ParameterServer\","
                              "method=\"GetState\",code=\"(UNAVAILABLE|DEADLINE_EXCEEDED)\"\\}"));
  for (const std::string w : {"worker0", "worker1", "evaluator"}) {
    EXPECT_GE(scrapes.at(w).Sum("psflow_rpc_errors_total"), 1) << w << "\n" << scrapes.at(w).text;
  }
}

// A chief, one ps, two workers and an evaluator, each with --metrics_port,
// train the mlp (evaluated every 100 steps). The evaluator is left out of the
// cluster, as the training operator leaves it out of TF_CONFIG: it listens on
// no gRPC port, and its metrics port answers its probes. Scraped twice while
// training, every counter that counts work has moved, and the chief's eval
// gauges follow the evaluator's. Then the ps is killed and comes back 3 s
// later (so the chief's look at it fails, or times out, and the workers' and
// the evaluator's calls fail): the chief reloads it from the checkpoint, and
// every role serves every metric, the failed calls counted by code.
TEST_F(ObservabilityTest, EveryRoleServesMetricsWhileTraining) {
  const std::vector<int> p = FreePorts(10);
  ASSERT_THAT(p, SizeIs(10));
  MetricsCluster cluster(p, dir_ + "/model");
  Process& chief = cluster.chief();
  ASSERT_TRUE(chief.WaitForOutput("checkpoint of step", seconds(120))) << cluster.Describe();
  ASSERT_TRUE(chief.WaitForOutput("chief] step 60/", seconds(60))) << cluster.Describe();
  ASSERT_TRUE(chief.WaitForOutput("chief] eval: step ", seconds(60))) << cluster.Describe();

  const std::vector<std::pair<std::string, int>> roles = cluster.MetricsPorts();
  const std::map<std::string, Scrape> first = ScrapeAll(roles);
  if (!skip_.empty()) GTEST_SKIP() << skip_;
  std::this_thread::sleep_for(milliseconds(1500));
  const std::map<std::string, Scrape> second = ScrapeAll(roles);
  ASSERT_FALSE(HasFailure()) << cluster.Describe();

  ExpectCountersMoved(first, second);
  ExpectEvaluationsReported(second.at("evaluator"), second.at("chief"));
  // Registered with the chief: ready, as its metrics port tells.
  EXPECT_EQ(HttpStatus(p[9], "/readyz"), "200");
  EXPECT_EQ(HttpStatus(p[9], "/healthz"), "200");
  for (int port : {p[5], p[6], p[7], p[8]}) {
    EXPECT_EQ(HttpStatus(port, "/readyz"), "200") << port;
    EXPECT_EQ(HttpStatus(port, "/healthz"), "200") << port;
  }
  ExpectJobValues(second.at("chief"), second.at("ps"));

  cluster.KillAndRestartPs();
  ASSERT_TRUE(chief.WaitForOutput("parameter servers reloaded", seconds(60))) << cluster.Describe();
  // Training goes on: the workers have registered again.
  const double examples = ExamplesThenWaitForMore(p[5]);
  // So has the evaluator.
  EXPECT_TRUE(WaitForHttpStatus(p[9], "/readyz", "200", seconds(30)))
      << cluster.evaluator().Describe();
  const std::map<std::string, Scrape> third = ScrapeAll(roles);
  ExpectFamilies(third.at("chief"), kChiefFamilies, "chief");
  ExpectFamilies(third.at("ps"), kPsFamilies, "the restarted ps");
  ExpectFamilies(third.at("worker0"), kWorkerFamilies, "worker0");
  ExpectFamilies(third.at("worker1"), kWorkerFamilies, "worker1");
  ExpectFamilies(third.at("evaluator"), kEvaluatorFamilies, "the evaluator");
  EXPECT_GT(third.at("chief").Value("psflow_examples_total"), examples);
  ExpectFailedCallsCounted(third);

  cluster.Stop();
  if (HasFailure()) ADD_FAILURE() << cluster.Describe();
}

// `n` consecutive ports that are free now (for psflow-launch
// --metrics_base_port), or none.
std::vector<int> ConsecutiveFreePorts(int n) {
  for (int attempt = 0; attempt < 50; ++attempt) {
    const std::vector<int> one = FreePorts(1);
    if (one.empty() || one[0] + n > 65536) continue;
    std::vector<int> fds;
    bool all = true;
    for (int i = 0; i < n && all; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(one[0] + i));
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      all = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
      fds.push_back(fd);
    }
    for (int fd : fds) ::close(fd);
    if (all) {
      std::vector<int> ports;
      for (int i = 0; i < n; ++i) ports.push_back(one[0] + i);
      return ports;
    }
  }
  return {};
}

// psflow-launch --metrics_base_port=P numbers every process's --metrics_port:
// the chief P, ps i P+1+i, worker i P+1+ps+i, evaluator i P+1+ps+workers+i.
TEST_F(ObservabilityTest, LaunchNumbersTheMetricsPortsOfEveryProcessEvaluatorsIncluded) {
  const std::vector<int> m = ConsecutiveFreePorts(4);
  ASSERT_THAT(m, SizeIs(4));
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=1", "--evaluators=1",
                  "--metrics_base_port=" + std::to_string(m[0]), "--", "--model=mlp",
                  "--train_steps=1000000", "--log_every_steps=20", "--eval_every_steps=50",
                  "--eval_every_secs=0", "--compute_threads=1", "--model_dir=" + dir_ + "/model"});
  ASSERT_TRUE(launch.WaitForOutput(" (evaluator0)", seconds(20))) << launch.Describe();
  EXPECT_THAT(
      launch.output(),
      ::testing::HasSubstr("[launch] metrics: http://127.0.0.1:" + std::to_string(m[0]) +
                           "/metrics (chief) to :" + std::to_string(m[3]) + " (evaluator0)"))
      << launch.Describe();
  ASSERT_TRUE(launch.WaitForOutput("chief] eval: step ", seconds(120))) << launch.Describe();
  const std::vector<std::pair<std::string, std::string>> wanted = {
      {"chief", "psflow_global_step"},
      {"ps0", "psflow_ps_version"},
      {"worker0", "psflow_worker_step"},
      {"evaluator0", "psflow_evaluator_evaluations_total"}};
  for (size_t i = 0; i < wanted.size(); ++i) {
    const Scrape s = ScrapeAndParse(m[i], wanted[i].first);
    if (!skip_.empty()) break;
    EXPECT_TRUE(s.names.count(wanted[i].second))
        << wanted[i].first << " on port " << m[i] << " serves no " << wanted[i].second << "\n"
        << s.text;
  }
  launch.Signal(SIGTERM);
  launch.WaitOrKill(seconds(60));
  if (!skip_.empty()) GTEST_SKIP() << skip_;
  if (HasFailure()) ADD_FAILURE() << launch.Describe();
}

// The spans of one process's step trace (file `path`), by name; fails the
// test when the file is missing or not a trace.
std::multimap<std::string, TraceEvent> TraceSpans(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no trace at " << path;
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TraceFile file;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &file).ok()) << path;
  std::multimap<std::string, TraceEvent> spans;
  for (const TraceEvent& e : file.trace_events()) {
    if (e.ph() == "X") spans.emplace(e.name(), e);
  }
  return spans;
}

// The steps of the spans named `name`.
std::set<std::string> StepsOf(const std::multimap<std::string, TraceEvent>& spans,
                              const std::string& name) {
  std::set<std::string> steps;
  auto [begin, end] = spans.equal_range(name);
  for (auto it = begin; it != end; ++it) steps.insert(it->second.args().at("step"));
  return steps;
}

// psflow-launch --trace_dir: each ps and worker writes the steps asked for,
// and nothing else; the processes' clocks agree (a synchronous step's applies
// on the ps come after both workers began computing it and before either
// worker's step ended, since each waits for the weights they make); the
// summary script lists the step across processes.
TEST_F(ObservabilityTest, EachPsAndWorkerTracesTheStepsAskedForOnOneClock) {
  const std::string trace_dir = dir_ + "/trace";
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=2", "--trace_dir=" + trace_dir, "--trace_steps=20:21", "--",
                  "--model=mlp", "--train_steps=40", "--log_every_steps=20", "--compute_threads=1",
                  "--model_dir=" + dir_ + "/model"});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  // Each process logs what it used as it exits: some CPU, and context
  // switches (its threads hand work to one another every step).
  const std::string output = launch.output();
  const std::regex usage(
      R"(\[(\w+)\] .* used ([0-9.]+) s of CPU \(user [0-9.]+, system [0-9.]+\); )"
      R"(context switches: ([0-9]+) voluntary, [0-9]+ involuntary)");
  std::set<std::string> reported;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), usage);
       it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    reported.insert(m[1]);
    EXPECT_GT(std::stod(m[2]), 0.0) << m[0];
    EXPECT_GT(std::stoll(m[3]), 40) << m[0] << ": 40 steps of a job";
  }
  EXPECT_EQ(reported, (std::set<std::string>{"chief", "ps0", "ps1", "worker0", "worker1"}))
      << output;
  const std::set<std::string> both = {"20", "21"};
  std::vector<std::multimap<std::string, TraceEvent>> workers, ps;
  for (int i = 0; i < 2; ++i) {
    workers.push_back(TraceSpans(trace_dir + "/worker" + std::to_string(i) + ".json"));
    ps.push_back(TraceSpans(trace_dir + "/ps" + std::to_string(i) + ".json"));
  }
  if (HasFailure()) return;
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("worker " + std::to_string(i));
    const auto& w = workers[i];
    EXPECT_EQ(StepsOf(w, "step"), both);
    EXPECT_EQ(StepsOf(w, "compute"), both);
    EXPECT_EQ(StepsOf(w, "pull"), both);
    // A CPU worker pushes during the backward pass: one push per lane and
    // step, each run once the backward pass has made it (the client checks
    // it as it copies it, within the push's span).
    EXPECT_EQ(StepsOf(w, "push in runs"), both);
    EXPECT_EQ(StepsOf(w, "run waits for its gradients"), both);
    EXPECT_EQ(w.count("step"), 2u);
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("ps " + std::to_string(i));
    EXPECT_EQ(StepsOf(ps[i], "apply"), both);
    EXPECT_EQ(StepsOf(ps[i], "push message"), both);
    EXPECT_EQ(StepsOf(ps[i], "pull slices"), both);
    std::set<std::string> pushers;
    auto [begin, end] = ps[i].equal_range("push message");
    for (auto it = begin; it != end; ++it) pushers.insert(it->second.args().at("worker"));
    EXPECT_EQ(pushers, (std::set<std::string>{"0", "1"}));
  }
  // Step 20 on one clock.
  auto span_of = [](const std::multimap<std::string, TraceEvent>& spans, const std::string& name) {
    auto [begin, end] = spans.equal_range(name);
    for (auto it = begin; it != end; ++it) {
      if (it->second.args().at("step") == "20") return it->second;
    }
    return TraceEvent();
  };
  for (int p = 0; p < 2; ++p) {
    auto [begin, end] = ps[p].equal_range("apply");
    for (auto it = begin; it != end; ++it) {
      const TraceEvent& apply = it->second;
      if (apply.args().at("step") != "20") continue;
      for (int w = 0; w < 2; ++w) {
        const TraceEvent compute = span_of(workers[w], "compute");
        const TraceEvent step = span_of(workers[w], "step");
        EXPECT_GT(apply.ts(), compute.ts())
            << "ps " << p << " applied step 20 before worker " << w << " began computing it";
        EXPECT_LT(apply.ts() + apply.dur(), step.ts() + step.dur())
            << "worker " << w << " ended step 20 before ps " << p << " applied it";
      }
    }
  }
  RunResult summary = RunProcess(PSFLOW_PYTHON3,
                                 {std::string(PSFLOW_SOURCE_DIR) + "/scripts/trace-summary.py",
                                  trace_dir, "--step=20", "--merge=" + dir_ + "/merged.json"},
                                 {}, seconds(30));
  ASSERT_EQ(summary.exit_code, 0) << summary.description;
  for (const char* want :
       {"step 20:", "worker 0", "worker 1", "ps 0", "ps 1", "apply", "pull slices"})
    EXPECT_THAT(summary.out, ::testing::HasSubstr(want)) << summary.out;
  EXPECT_THAT(summary.out, ::testing::Not(::testing::HasSubstr("(step 21"))) << summary.out;
  EXPECT_EQ(TraceSpans(dir_ + "/merged.json").size(),
            workers[0].size() + workers[1].size() + ps[0].size() + ps[1].size());
}

// A malformed --trace_steps is a configuration error of every role that
// takes it: exit 1 at once, saying what the flag wants.
TEST(ObservabilityCliTest, AMalformedTraceRangeExitsOne) {
  const std::vector<std::string> trace = {"--trace_dir=/tmp/psflow-no-trace", "--trace_steps=9:1"};
  for (const std::string role : {"worker", "ps", "launch"}) {
    std::vector<std::string> args;
    if (role != "launch") {
      args = {"--job_name=" + role, "--task_id=0", "--chief_hosts=127.0.0.1:1",
              "--ps_hosts=127.0.0.1:2", "--worker_hosts=127.0.0.1:3"};
    }
    args.insert(args.end(), trace.begin(), trace.end());
    RunResult r = RunProcess(Bin("psflow-" + role), args, {}, seconds(30));
    EXPECT_EQ(r.exit_code, 1) << role << ": " << r.description;
    EXPECT_THAT(r.output, ::testing::HasSubstr("FIRST:LAST")) << role << ": " << r.description;
  }
}

// A metrics port another process holds is a configuration error: exit 1 at
// once, naming the port.
TEST(ObservabilityCliTest, ABusyMetricsPortExitsOne) {
  const std::vector<int> p = FreePorts(4);
  ASSERT_THAT(p, SizeIs(4));
  const int held = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(p[3]));
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(held, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(held, 1), 0);
  RunResult r = RunProcess(
      Bin("psflow-ps"),
      {"--job_name=ps", "--task_id=0", "--chief_hosts=" + Addr(p[0]), "--ps_hosts=" + Addr(p[1]),
       "--worker_hosts=" + Addr(p[2]), "--metrics_port=" + std::to_string(p[3])},
      {}, seconds(20));
  ::close(held);
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_LT(r.seconds, 10.0) << r.description;
  EXPECT_THAT(r.output,
              ::testing::HasSubstr("cannot serve metrics on port " + std::to_string(p[3])))
      << r.description;
}

// Each role's server-wide health status is its readiness: a ps is
// NOT_SERVING until it holds a job, the chief until every ps does, a worker
// and an evaluator until they registered; the "liveness" service is SERVING
// all along; and a ps or an evaluator idling after the job
// (--exit_when_done=false) is NOT_SERVING but alive. The metrics port's
// /readyz and /healthz say the same over HTTP (ps1 and the evaluator here).
TEST_F(ObservabilityTest, HealthFollowsEachRolesReadiness) {
  const std::vector<int> p = FreePorts(7);
  ASSERT_THAT(p, SizeIs(7));
  const int ps1_metrics = p[5], evaluator_metrics = p[6];
  const std::string chief = Addr(p[0]), ps0 = Addr(p[1]), ps1 = Addr(p[2]), worker = Addr(p[3]),
                    evaluator = Addr(p[4]);
  const std::vector<std::string> hosts = {"--chief_hosts=" + chief, "--ps_hosts=" + ps0 + "," + ps1,
                                          "--worker_hosts=" + worker,
                                          "--evaluator_hosts=" + evaluator};
  auto args = [&](const std::string& role, int index, std::vector<std::string> extra = {}) {
    std::vector<std::string> a = {"--job_name=" + role, "--task_id=" + std::to_string(index)};
    a.insert(a.end(), hosts.begin(), hosts.end());
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  Process ps0_process(Bin("psflow-ps"), args("ps", 0));
  Process worker_process(Bin("psflow-worker"), args("worker", 0));
  ASSERT_TRUE(ps0_process.WaitForOutput("listening on", seconds(20))) << ps0_process.Describe();
  // Up, but no job yet.
  EXPECT_EQ(Health(ps0, ""), "NOT_SERVING");
  EXPECT_EQ(Health(ps0, "liveness"), "SERVING");
  EXPECT_EQ(Health(ps0, "no.such.Service"), "NOT_FOUND");
  // The worker serves too (its status service) and waits for the chief.
  ASSERT_TRUE(WaitForHealth(worker, "liveness", "SERVING", seconds(20)))
      << worker_process.Describe();
  EXPECT_EQ(Health(worker, ""), "NOT_SERVING");
  // So does the evaluator (it stays after the job).
  Process evaluator_process(Bin("psflow-evaluator"),
                            args("evaluator", 0,
                                 {"--exit_when_done=false", "--compute_threads=1",
                                  "--metrics_port=" + std::to_string(evaluator_metrics)}));
  ASSERT_TRUE(WaitForHealth(evaluator, "liveness", "SERVING", seconds(20)))
      << evaluator_process.Describe();
  EXPECT_EQ(Health(evaluator, ""), "NOT_SERVING");
  EXPECT_TRUE(WaitForHttpStatus(evaluator_metrics, "/healthz", "200", seconds(20)));
  EXPECT_EQ(HttpStatus(evaluator_metrics, "/readyz"), "503");

  // The chief loads ps0; ps1 is not up, so the chief is not ready.
  Process chief_process(Bin("psflow-chief"),
                        args("chief", 0,
                             {"--model=mlp", "--train_steps=200", "--log_every_steps=100",
                              "--compute_threads=1", "--model_dir=" + dir_ + "/model"}));
  EXPECT_TRUE(WaitForHealth(ps0, "", "SERVING", seconds(30))) << ps0_process.Describe();
  EXPECT_TRUE(WaitForHealth(chief, "liveness", "SERVING", seconds(20))) << chief_process.Describe();
  EXPECT_EQ(Health(chief, ""), "NOT_SERVING");
  std::this_thread::sleep_for(milliseconds(500));
  EXPECT_EQ(Health(chief, ""), "NOT_SERVING");
  EXPECT_EQ(Health(worker, ""), "NOT_SERVING");
  EXPECT_EQ(Health(evaluator, ""), "NOT_SERVING");
  EXPECT_EQ(HttpStatus(evaluator_metrics, "/readyz"), "503");

  // ps1 comes (and stays after the job): everyone becomes ready.
  Process ps1_process(
      Bin("psflow-ps"),
      args("ps", 1, {"--exit_when_done=false", "--metrics_port=" + std::to_string(ps1_metrics)}));
  EXPECT_TRUE(WaitForHealth(chief, "", "SERVING", seconds(30))) << chief_process.Describe();
  EXPECT_EQ(Health(ps1, ""), "SERVING");
  EXPECT_TRUE(WaitForHealth(worker, "", "SERVING", seconds(30))) << worker_process.Describe();
  EXPECT_TRUE(WaitForHealth(evaluator, "", "SERVING", seconds(30))) << evaluator_process.Describe();
  EXPECT_EQ(HttpStatus(evaluator_metrics, "/readyz"), "200");
  EXPECT_EQ(HttpStatus(ps1_metrics, "/readyz"), "200");

  // The job ends (after the evaluation of the final model); ps1 and the
  // evaluator idle, alive but no longer ready.
  EXPECT_EQ(chief_process.WaitOrKill(seconds(120)), 0) << chief_process.Describe();
  EXPECT_THAT(chief_process.output(), ::testing::HasSubstr("eval: step 200/200"))
      << chief_process.Describe();
  EXPECT_EQ(ps0_process.WaitOrKill(seconds(30)), 0) << ps0_process.Describe();
  EXPECT_EQ(worker_process.WaitOrKill(seconds(30)), 0) << worker_process.Describe();
  ASSERT_TRUE(ps1_process.WaitForOutput("idling until terminated", seconds(30)))
      << ps1_process.Describe();
  EXPECT_EQ(Health(ps1, ""), "NOT_SERVING");
  EXPECT_EQ(Health(ps1, "liveness"), "SERVING");
  EXPECT_EQ(HttpStatus(ps1_metrics, "/readyz"), "503");
  EXPECT_EQ(HttpStatus(ps1_metrics, "/healthz"), "200");
  ps1_process.Signal(SIGTERM);
  EXPECT_EQ(ps1_process.WaitOrKill(seconds(20)), 0) << ps1_process.Describe();
  EXPECT_EQ(Health(ps1, "liveness"), "UNAVAILABLE");
  ASSERT_TRUE(evaluator_process.WaitForOutput("idling until terminated", seconds(30)))
      << evaluator_process.Describe();
  EXPECT_EQ(Health(evaluator, ""), "NOT_SERVING");
  EXPECT_EQ(Health(evaluator, "liveness"), "SERVING");
  EXPECT_EQ(HttpStatus(evaluator_metrics, "/readyz"), "503");
  evaluator_process.Signal(SIGTERM);
  EXPECT_EQ(evaluator_process.WaitOrKill(seconds(20)), 0) << evaluator_process.Describe();
}

}  // namespace
}  // namespace psflow::itest
