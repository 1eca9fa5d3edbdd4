// Clusters without a chief task, as the Helm-templated TensorFlow cluster
// renders them: CLUSTER_CONFIG lists only ps and workers (with trailing
// commas), every pod listens on port 8080 of its own address, and POD_NAME
// names the pod. Worker 0 runs the chief's duties in-process. Each "pod"
// here gets its own loopback address (127.x.y.z) with port 8080. Every
// process is started by the test, as Kubernetes would start the pods, with
// the same environment; the workers all get the job's flags.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/certs.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class ChieflessTest : public TempDirTest {
 protected:
  // Addresses on loopback nobody else uses: 127.<a>.<b>.<pod>, from this
  // process's pid, all on port 8080.
  std::string PodAddress(int pod) const {
    const int pid = static_cast<int>(::getpid());
    return absl::StrCat("127.", 100 + pid % 100, ".", (pid / 100) % 250 + 1, ".", pod + 1, ":8080");
  }

  // The Helm chart's CLUSTER_CONFIG for `ps` ps and `workers` workers.
  std::string HelmClusterConfig(int ps, int workers) const {
    std::string out = "{\n  \"ps\": [";
    for (int i = 0; i < ps; ++i) absl::StrAppend(&out, "\"", PodAddress(i), "\",");
    absl::StrAppend(&out, "],\n  \"worker\": [");
    for (int i = 0; i < workers; ++i) absl::StrAppend(&out, "\"", PodAddress(ps + i), "\",");
    absl::StrAppend(&out, "],\n}");
    return out;
  }

  // Starts pod `role`-`index` of the Helm cluster.
  std::unique_ptr<Process> StartPod(const std::string& role, int index,
                                    const std::vector<std::string>& args) {
    std::map<std::string, std::string> env = {
        {"CLUSTER_CONFIG", HelmClusterConfig(2, 2)},
        {"POD_NAME", absl::StrCat("mnist-", role, "-", index)}};
    return std::make_unique<Process>(Bin(role == "ps" ? "psflow-ps" : "psflow-worker"), args, env);
  }
};

TEST_F(ChieflessTest, HelmShapeTrainsAndEveryProcessExits0) {
  std::vector<std::unique_ptr<Process>> pods;
  pods.push_back(StartPod("ps", 0, {}));
  pods.push_back(StartPod("ps", 1, {}));
  // Every worker gets the same container args.
  pods.push_back(StartPod("worker", 0, HandStartedMlpArgs(600)));
  pods.push_back(StartPod("worker", 1, HandStartedMlpArgs(600)));
  for (auto& pod : pods) {
    EXPECT_EQ(pod->WaitOrKill(seconds(240)), 0) << pod->Describe();
  }
  const std::string chief = pods[2]->output();
  EXPECT_THAT(chief, HasSubstr("the cluster has no chief: worker 0 runs the chief's duties on " +
                               PodAddress(2)));
  EXPECT_THAT(chief, HasSubstr("worker0] step 600/600 "));
  EXPECT_THAT(chief, HasSubstr("done: 600 steps"));
  EXPECT_THAT(chief, HasSubstr("saved model (step 600) written"));
  const std::string figures = SavedModelFigures(dir_ + "/model");
  ASSERT_NE(figures, "");
  // 600 steps of the mlp reach 0.849 uninterrupted.
  EXPECT_GE(std::stod(figures), 0.82) << figures;
  ExpectNoProcessesLeft(dir_);
}

// Worker 0 killed mid-job (its chief's duties with it) and started again, as
// a pod's restart would: it takes the chief's duties up again (adopting the
// running job from the ps) and the job ends well.
TEST_F(ChieflessTest, Worker0KilledResumesTheChiefsDuties) {
  std::vector<std::unique_ptr<Process>> pods;
  pods.push_back(StartPod("ps", 0, {}));
  pods.push_back(StartPod("ps", 1, {}));
  pods.push_back(StartPod("worker", 0, HandStartedMlpArgs(900)));
  pods.push_back(StartPod("worker", 1, HandStartedMlpArgs(900)));
  ASSERT_TRUE(pods[2]->WaitForOutput("worker0] step 300/900 ", seconds(120)))
      << pods[2]->Describe();
  pods[2]->Signal(SIGKILL);
  pods[2]->WaitOrKill(seconds(10));
  auto restarted = StartPod("worker", 0, HandStartedMlpArgs(900));
  // The ps still hold the job (at most a step apart: worker 0 may have died
  // between its pushes to the two): it is adopted, not restored.
  const std::regex resumed(R"(worker0\] (adopting the running job at) step ([0-9]+))");
  ASSERT_TRUE(restarted->WaitForOutput("step", seconds(60))) << restarted->Describe();
  EXPECT_EQ(restarted->WaitOrKill(seconds(240)), 0) << restarted->Describe();
  std::smatch m;
  const std::string out = restarted->output();
  ASSERT_TRUE(std::regex_search(out, m, resumed)) << out;
  EXPECT_GE(std::stoll(m[2].str()), 300) << out;
  EXPECT_THAT(out, HasSubstr("done: 900 steps"));
  for (int i : {0, 1, 3}) EXPECT_EQ(pods[i]->WaitOrKill(seconds(60)), 0) << pods[i]->Describe();
  const std::string figures = SavedModelFigures(dir_ + "/model");
  ASSERT_NE(figures, "");
  EXPECT_GE(std::stod(figures), 0.84) << figures;
  ExpectNoProcessesLeft(dir_);
}

// psflow-launch --chief=false: the same shape on one machine.
TEST_F(ChieflessTest, LauncherRunsAClusterWithoutAChief) {
  RunResult run =
      RunProcess(Bin("psflow-launch"),
                 {"--chief=false", "--ps=2", "--workers=2", "--", "--model=mlp",
                  "--train_steps=600", "--log_every_steps=200", "--model_dir=" + dir_ + "/model"},
                 {}, seconds(120));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("[launch] cluster: no chief (worker 0 runs its duties)"));
  EXPECT_THAT(run.output, Not(HasSubstr("[chief]")));
  EXPECT_THAT(run.output, HasSubstr("[worker0] "));
  EXPECT_THAT(run.output, HasSubstr("worker0] done: 600 steps"));
  for (const char* member : {"ps0", "ps1", "worker0", "worker1"}) {
    EXPECT_THAT(run.output, HasSubstr(std::string("[launch] ") + member + " exited with code 0"));
  }
  ExpectNoProcessesLeft(dir_);
}

// Mutual TLS and the job token without a chief: worker 0 presents a worker
// certificate to the other workers (as the chief) and to the ps (with the
// chief's rights there); no chief certificate is needed at all.
TEST_F(ChieflessTest, MutualTlsWithoutAChiefCertificate) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(testing_certs::MakeCerts(certs));
  std::filesystem::remove(certs + "/chief.crt");
  std::filesystem::remove(certs + "/chief.key");
  RunResult run = RunProcess(
      Bin("psflow-launch"),
      {"--chief=false", "--tls_dir=" + certs, "--ps=2", "--workers=2", "--", "--model=mlp",
       "--train_steps=300", "--log_every_steps=100", "--model_dir=" + dir_ + "/model"},
      {}, seconds(120));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(
      run.output,
      HasSubstr("worker0] security: mutual TLS as worker 0 (a certificate of this task only)"));
  EXPECT_THAT(run.output, HasSubstr("worker0] done: 300 steps"));
  EXPECT_THAT(run.output, Not(HasSubstr("PERMISSION_DENIED")));
  ExpectNoProcessesLeft(dir_);
}

}  // namespace
}  // namespace psflow::itest
