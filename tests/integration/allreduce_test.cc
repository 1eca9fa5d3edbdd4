// Clusters without ps: the workers average their gradients in a ring
// all-reduce and each keeps a replica of the weights; worker 0 (rank 0)
// runs the chief's duties. Every shape a user brings: psflow-launch --ps=0,
// the environment of a PyTorchJob, a TF_CONFIG of workers only; and a
// worker's death, which stops every worker, after which the restarted
// group resumes from the newest checkpoint.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/certs.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class AllReduceTest : public TempDirTest {
 protected:
  // Worker w of a cluster of 2 workers at `hosts` (--worker_hosts=...),
  // training the mlp for `steps`, with `extra` flags last.
  std::unique_ptr<Process> StartWorker(int w, const std::string& hosts, int64_t steps,
                                       const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> args = {"--job_name=worker", "--task_id=" + std::to_string(w), hosts};
    for (const std::string& a : HandStartedMlpArgs(steps)) args.push_back(a);
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(Bin("psflow-worker"), args);
  }
};

// The README's main job as a cluster of 2 workers and no ps, with an
// evaluator: the accuracy bar, identical replicas on both workers, and the
// evaluator's lines as in ps mode.
TEST_F(AllReduceTest, MainJobWithoutPsReachesTheBar) {
  const std::string model_dir = dir_ + "/model";
  RunResult run =
      RunProcess(Bin("psflow-launch"),
                 {"--ps=0", "--chief=false", "--workers=2", "--evaluators=1", "--", "--model=cnn",
                  "--epochs=5", "--optimizer=adam", "--learning_rate=0.001", "--batch_size=64",
                  "--log_every_steps=500", "--eval_every_secs=10", "--model_dir=" + model_dir},
                 {}, seconds(600));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[launch] cluster: no chief (worker 0 runs its duties), no ps "
                                    "(the workers all-reduce)"));
  EXPECT_THAT(run.output, HasSubstr("gradients all-reduced among the workers, each holding a "
                                    "replica"));
  EXPECT_THAT(run.output, HasSubstr("| workers 2/2 replica 1/1 |"));
  EXPECT_THAT(run.output, HasSubstr("worker0] done: 2340 steps"));
  EXPECT_THAT(run.output, HasSubstr("worker0] eval: step 2340/2340 "));
  for (const char* member : {"worker0", "worker1", "evaluator0"}) {
    EXPECT_THAT(run.output, HasSubstr(std::string("[launch] ") + member + " exited with code 0"));
  }
  ExpectIdenticalReplicas(run.output, 2);
  const std::string figures = SavedModelFigures(model_dir);
  ASSERT_NE(figures, "");
  EXPECT_GE(std::stod(figures), 0.895) << figures;
  ExpectNoProcessesLeft(model_dir);
}

// A PyTorchJob's pods get MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK
// only; on one machine (a loopback MASTER_ADDR) rank r listens on
// MASTER_PORT + r.
TEST_F(AllReduceTest, PyTorchJobEnvironmentAloneTrains) {
  // MASTER_PORT and the two after it, free.
  auto free_at = [](int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (fd >= 0) ::close(fd);
    return ok;
  };
  int port = 0;
  for (int attempt = 0; attempt < 50 && port == 0; ++attempt) {
    const std::vector<int> one = FreePorts(1);
    ASSERT_EQ(one.size(), 1u);
    if (one[0] + 2 <= 65535 && free_at(one[0] + 1) && free_at(one[0] + 2)) port = one[0];
  }
  ASSERT_NE(port, 0);
  std::vector<std::unique_ptr<Process>> ranks;
  for (int rank = 0; rank < 3; ++rank) {
    std::map<std::string, std::string> env = {{"MASTER_ADDR", "127.0.0.1"},
                                              {"MASTER_PORT", std::to_string(port)},
                                              {"WORLD_SIZE", "3"},
                                              {"RANK", std::to_string(rank)}};
    // As a PyTorchJob's template gives every pod the same args.
    ranks.push_back(std::make_unique<Process>(Bin("psflow-worker"), HandStartedMlpArgs(300), env));
  }
  std::string all;
  for (auto& r : ranks) {
    EXPECT_EQ(r->WaitOrKill(seconds(240)), 0) << r->Describe();
    all += r->output();
  }
  EXPECT_THAT(ranks[0]->output(), HasSubstr("worker0] done: 300 steps"));
  EXPECT_THAT(all, Not(HasSubstr("worker1] done:")));
  ExpectIdenticalReplicas(all, 3);
  const std::string figures = SavedModelFigures(dir_ + "/model");
  ASSERT_NE(figures, "");
  EXPECT_GE(std::stod(figures), 0.75) << figures;
  ExpectNoProcessesLeft(dir_);
}

// A TFJob of workers only (MultiWorkerMirroredStrategy's TF_CONFIG), with a
// global batch fixed for strong scaling: 128 over 2 workers is 64 each.
TEST_F(AllReduceTest, TfConfigOfWorkersOnlyWithAGlobalBatch) {
  const std::vector<int> ports = FreePorts(2);
  ASSERT_EQ(ports.size(), 2u);
  const std::string cluster = absl::StrCat(R"({"cluster":{"worker":["127.0.0.1:)", ports[0],
                                           R"(","127.0.0.1:)", ports[1], R"("]},)");
  std::vector<std::string> args = HandStartedMlpArgs(200);
  args.push_back("--global_batch_size=128");
  args.push_back("--batch_size=7");  // overridden
  std::vector<std::unique_ptr<Process>> workers;
  for (int w = 0; w < 2; ++w) {
    workers.push_back(std::make_unique<Process>(
        Bin("psflow-worker"), args,
        std::map<std::string, std::string>{
            {"TF_CONFIG", absl::StrCat(cluster, R"("task":{"type":"worker","index":)", w, "}}")}}));
  }
  for (auto& w : workers) EXPECT_EQ(w->WaitOrKill(seconds(240)), 0) << w->Describe();
  const std::string out = workers[0]->output();
  EXPECT_THAT(out, HasSubstr("batch 64 x 2 workers"));
  EXPECT_THAT(out, HasSubstr("worker0] done: 200 steps, 25600 examples"));
  ExpectIdenticalReplicas(out + workers[1]->output(), 2);
}

// Worker 1 killed mid-job: worker 0 (the chief's duties with it) stops with
// a retryable exit code, having checkpointed; both started again, as their
// pods would be, the group re-forms from the newest checkpoint and the job
// ends well.
TEST_F(AllReduceTest, AWorkersDeathRestartsTheGroupFromTheNewestCheckpoint) {
  const std::vector<int> ports = FreePorts(2);
  ASSERT_EQ(ports.size(), 2u);
  const std::string hosts =
      absl::StrCat("--worker_hosts=127.0.0.1:", ports[0], ",127.0.0.1:", ports[1]);
  auto start = [&](int w) { return StartWorker(w, hosts, 900); };
  auto w0 = start(0);
  auto w1 = start(1);
  ASSERT_TRUE(w0->WaitForOutput("worker0] step 300/900 ", seconds(120))) << w0->Describe();
  w1->Signal(SIGKILL);
  w1->WaitOrKill(seconds(10));
  const int code = w0->WaitOrKill(seconds(60));
  EXPECT_TRUE(code == 138 || code == 140) << w0->Describe();
  EXPECT_THAT(w0->output(), HasSubstr("all-reduce of step"));
  // Both come back.
  auto r0 = start(0);
  auto r1 = start(1);
  EXPECT_EQ(r0->WaitOrKill(seconds(240)), 0) << r0->Describe();
  EXPECT_EQ(r1->WaitOrKill(seconds(60)), 0) << r1->Describe();
  const std::string out = r0->output();
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(out, m, std::regex(R"(restoring from the checkpoint of step ([0-9]+))")))
      << out;
  EXPECT_GE(std::stoll(m[1].str()), 300) << out;
  EXPECT_THAT(r1->output(),
              HasSubstr("loaded this worker's replica from worker 0's at step " + m[1].str()));
  EXPECT_THAT(out, HasSubstr("done: 900 steps"));
  ExpectIdenticalReplicas(out + r1->output(), 2);
  const std::string figures = SavedModelFigures(dir_ + "/model");
  ASSERT_NE(figures, "");
  EXPECT_GE(std::stod(figures), 0.83) << figures;
  ExpectNoProcessesLeft(dir_);
}

// Every worker told to stop (SIGTERM, as Kubernetes stops pods): worker 0
// checkpoints its replica first; every process exits 143; started again,
// they resume from that checkpoint.
TEST_F(AllReduceTest, SigtermedWorkersCheckpointAndResume) {
  const std::vector<int> ports = FreePorts(2);
  ASSERT_EQ(ports.size(), 2u);
  const std::string hosts =
      absl::StrCat("--worker_hosts=127.0.0.1:", ports[0], ",127.0.0.1:", ports[1]);
  // Only the stop's checkpoint.
  ExpectStoppedWorkersResume(
      [&](int w) { return StartWorker(w, hosts, 1200, {"--checkpoint_every_steps=0"}); },
      "worker0] step 300/1200 ", 300, 1200);
  ExpectNoProcessesLeft(dir_);
}

// Mutual TLS and the job token without ps or chief: worker 0 loads its
// replica as the chief (a worker certificate), worker 1 reads it, an
// evaluator reads it, the ring runs between worker certificates; no
// chief or ps certificate is needed.
TEST_F(AllReduceTest, MutualTlsWithWorkerCertificatesOnly) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(testing_certs::MakeCerts(certs));
  for (const char* gone : {"chief.crt", "chief.key", "ps.crt", "ps.key"}) {
    std::filesystem::remove(certs + "/" + gone);
  }
  RunResult run = RunProcess(Bin("psflow-launch"),
                             {"--ps=0", "--chief=false", "--workers=2", "--evaluators=1",
                              "--tls_dir=" + certs, "--", "--model=mlp", "--train_steps=200",
                              "--log_every_steps=100", "--model_dir=" + dir_ + "/model"},
                             {}, seconds(180));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(
      run.output,
      HasSubstr("worker0] security: mutual TLS as worker 0 (a certificate of this task only)"));
  EXPECT_THAT(run.output, HasSubstr("worker0] done: 200 steps"));
  EXPECT_THAT(run.output, HasSubstr("worker0] eval: step 200/200 "));
  EXPECT_THAT(run.output, Not(HasSubstr("PERMISSION_DENIED")));
  ExpectIdenticalReplicas(run.output, 2);
  ExpectNoProcessesLeft(dir_);
}

}  // namespace
}  // namespace psflow::itest
