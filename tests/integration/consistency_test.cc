// The consistency modes as a user runs them: whole clusters under
// psflow-launch on 127.0.0.1 with --mode=async and --mode=ssp. One worker is
// stopped (SIGSTOP) for a few seconds mid-training, well inside
// --worker_timeout so that it stays a member: in ssp its peer must wait for
// it within the bound (the ps's largest lead of a worker over the slowest,
// in the chief's staleness line, never exceeds --staleness), in async its
// peer must not wait at all (the lead grows far past any bound). And the
// README's main job in async mode keeps its accuracy bar, with an evaluator
// evaluating as it trains.
#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;

class ConsistencyTest : public TempDirTest {
 protected:
  // Runs a 2-ps, 2-worker mlp job of `steps` global steps in `mode_args`,
  // stopping worker 1 for `stop` once the chief logged step 200; returns the
  // launcher's output (the job must end with exit 0).
  std::string RunWithAStoppedWorker(const std::vector<std::string>& mode_args, int64_t steps,
                                    milliseconds stop) {
    std::vector<std::string> args = {"--ps=2",
                                     "--workers=2",
                                     "--",
                                     "--model=mlp",
                                     "--optimizer=adam",
                                     "--learning_rate=0.001",
                                     "--train_steps=" + std::to_string(steps),
                                     "--log_every_steps=100",
                                     "--checkpoint_every_steps=200",
                                     "--model_dir=" + dir_ + "/model"};
    args.insert(args.end(), mode_args.begin(), mode_args.end());
    Process launch(Bin("psflow-launch"), args);
    EXPECT_TRUE(launch.WaitForOutput("chief] step 200/", seconds(120))) << launch.Describe();
    const std::string chief = LaunchChiefAddress(launch.output());
    EXPECT_NE(chief, "") << launch.Describe();
    std::vector<pid_t> worker1 = FindMember(chief, "worker", 1);
    EXPECT_EQ(worker1.size(), 1u) << launch.Describe();
    if (worker1.size() == 1) {
      ::kill(worker1[0], SIGSTOP);
      std::this_thread::sleep_for(stop);  // the fault's length, not a wait for something
      ::kill(worker1[0], SIGCONT);
    }
    EXPECT_EQ(launch.WaitOrKill(seconds(300)), 0) << launch.Describe();
    EXPECT_THAT(launch.output(), HasSubstr("chief] done: " + std::to_string(steps) + " steps"))
        << launch.Describe();
    ExpectNoProcessesLeft(dir_);
    return launch.output();
  }

  // The chief's staleness line: the largest lead of a worker over the slowest
  // (-1 without the line), and the mean and max staleness.
  struct Staleness {
    int64_t lead = -1;
    double mean = -1;
    int64_t max = -1;
  };
  static Staleness StalenessOf(const std::string& out) {
    const std::regex re(
        R"(staleness over the job: [0-9]+ gradients applied, versions behind mean ([0-9.]+) max ([0-9]+); largest lead of a worker over the slowest ([0-9]+) steps)");
    Staleness s;
    std::smatch m;
    if (std::regex_search(out, m, re)) {
      s.mean = std::stod(m[1].str());
      s.max = std::stoll(m[2].str());
      s.lead = std::stoll(m[3].str());
    }
    return s;
  }
};

TEST_F(ConsistencyTest, SspKeepsEveryWorkerWithinTheBound) {
  const std::string out =
      RunWithAStoppedWorker({"--mode=ssp", "--staleness=2"}, 1000, milliseconds(3000));
  const Staleness s = StalenessOf(out);
  ASSERT_GE(s.lead, 0) << "no staleness line\n" << out;
  EXPECT_LE(s.lead, 2) << out;
  EXPECT_THAT(out, HasSubstr("(ssp bound 2)"));
  // The progress lines show the staleness seen.
  EXPECT_THAT(out, testing::ContainsRegex("\\| staleness mean [0-9.]+ max [0-9]+ \\|"));
}

TEST_F(ConsistencyTest, AsyncNeverWaitsForAStoppedWorker) {
  // Long enough that the worker that goes on does not finish the job alone.
  const std::string out = RunWithAStoppedWorker({"--mode=async"}, 3000, milliseconds(1500));
  const Staleness s = StalenessOf(out);
  ASSERT_GE(s.lead, 0) << "no staleness line\n" << out;
  // A second and a half is dozens of mlp steps on the worker that went on.
  // (The staleness of the stopped worker's next gradient depends on where
  // the stop caught it: computing, it is hundreds of versions old; waiting
  // for its pull, it reads fresh weights. It is not checked.)
  EXPECT_GE(s.lead, 20) << out;
}

TEST_F(ConsistencyTest, MainJobInAsyncModeReachesTheBar) {
  const std::string model_dir = dir_ + "/model";
  RunResult run = RunProcess(
      Bin("psflow-launch"),
      {"--ps=2", "--workers=2", "--evaluators=1", "--", "--model=cnn", "--epochs=5",
       "--optimizer=adam", "--learning_rate=0.001", "--batch_size=64", "--log_every_steps=500",
       "--mode=async", "--eval_every_secs=5", "--model_dir=" + model_dir},
      {}, seconds(600));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // 5 epochs are 2 x 2340 global steps: one per worker's batch.
  EXPECT_THAT(run.output, HasSubstr("chief] done: 4680 steps"));
  // The evaluator takes versions while the job trains (the ps are never in
  // step), then the final one.
  int evaluated_while_training = 0;
  for (const std::string& line : Lines(run.output)) {
    if (line.find("chief] eval: step ") != std::string::npos &&
        line.find("eval: step 4680/") == std::string::npos) {
      ++evaluated_while_training;
    }
  }
  EXPECT_GE(evaluated_while_training, 2) << run.output;
  EXPECT_THAT(run.output, HasSubstr("chief] eval: step 4680/4680 "));
  const std::string figures = SavedModelFigures(model_dir);
  ASSERT_NE(figures, "");
  EXPECT_GE(std::stod(figures), 0.88) << figures;
}

}  // namespace
}  // namespace psflow::itest
