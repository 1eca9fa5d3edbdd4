// Process-level tests of the built binaries: whole clusters on 127.0.0.1,
// configured the ways README.md lists (flags, TF_CONFIG, CLUSTER_CONFIG +
// POD_NAME), bad configurations, signals and --help.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "chief/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/process.h"
#include "tests/model/test_specs.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::SizeIs;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

// The chief's progress line for `step`/`total` (among the lines that start
// with `prefix`), or "" if there is none.
std::string ChiefProgressLine(const std::string& output, int step, int total,
                              const std::string& prefix = "[chief] ") {
  const std::string needle =
      "chief] step " + std::to_string(step) + "/" + std::to_string(total) + " ";
  for (const std::string& line : Lines(output)) {
    if (line.rfind(prefix, 0) == 0 && line.find(needle) != std::string::npos) return line;
  }
  return "";
}

class ClusterTest : public TempDirTest {
 protected:
  // Runs worker0, worker1, ps0, ps1 and then the chief (with ChiefJobArgs on
  // dir_/model), each made by `member(role, index, args)`, with
  // RunSeparateCluster (below).
  template <typename MakeMember>
  void RunWorkersThenPsThenChief(const MakeMember& member);
};

// ---------------------------------------------------------------------------
// psflow-launch + psflow-eval

TEST_F(ClusterTest, LaunchTrainsAndEvalReportsAccuracy) {
  const std::string model_dir = dir_ + "/model";
  Process launch(
      Bin("psflow-launch"),
      {"--ps=2", "--workers=2", "--", "--model=mlp", "--train_steps=400", "--optimizer=adam",
       "--learning_rate=0.001", "--log_every_steps=100", "--model_dir=" + model_dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  const std::string out = launch.output();

  for (int step : {100, 200, 300, 400}) {
    const std::string line = ChiefProgressLine(out, step, 400);
    EXPECT_NE(line, "") << "no [chief] progress line for step " << step << "\n"
                        << launch.Describe();
    if (step == 400) {
      EXPECT_THAT(line, HasSubstr("workers 2/2 ps 2/2")) << line;
    }
  }
  for (const char* name : {"chief", "ps0", "ps1", "worker0", "worker1"}) {
    EXPECT_THAT(out, HasSubstr(std::string("[launch] ") + name + " exited with code 0"))
        << launch.Describe();
  }

  // Nothing of this cluster outlives the launcher: every member's command
  // line names the chief's address.
  const std::string chief = LaunchChiefAddress(out);
  ASSERT_NE(chief, "") << launch.Describe();
  ExpectNoProcessesLeft("--chief_hosts=" + chief);
  ExpectNoProcessesLeft(model_dir);

  RunResult eval = RunEval(model_dir);
  ASSERT_EQ(eval.exit_code, 0) << eval.description;
  const std::string acc = EvalAccuracyText(eval.out);
  ASSERT_NE(acc, "") << eval.description;
  std::smatch loss;
  ASSERT_TRUE(std::regex_search(eval.out, loss, std::regex(R"((^|\n)loss: ([0-9.]+)\n)")))
      << eval.description;
  // 400 Adam steps of the MLP reach about 0.84 on the Fashion-MNIST test set.
  EXPECT_GE(std::stod(acc), 0.78) << eval.description;
  EXPECT_LE(std::stod(acc), 1.0) << eval.description;
  const double loss_value = std::stod(loss[2].str());
  EXPECT_TRUE(std::isfinite(loss_value) && loss_value > 0 && loss_value < 1.0) << eval.description;
}

// A model with batch norm: the job's saved model carries the running
// statistics, and psflow-eval, normalizing with them, gives the same figures
// whatever its batch size (with the batches' own statistics, a batch of one
// would normalize every example by itself).
TEST_F(ClusterTest, BatchNormModelEvaluatesTheSameAtEveryBatchSize) {
  const std::string spec = dir_ + "/bn_spec.pbtxt";
  std::ofstream(spec) << model::kBatchNormSpec;
  const std::string model_dir = dir_ + "/model";
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=2", "--", "--model=" + spec, "--data_format=synthetic",
                  "--synthetic_examples=2000", "--batch_size=32", "--train_steps=60",
                  "--optimizer=adam", "--learning_rate=0.01", "--bn_momentum=0.2",
                  "--log_every_steps=60", "--model_dir=" + model_dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  EXPECT_THAT(launch.output(), HasSubstr("48 batch-norm running statistics, momentum 0.2"))
      << launch.Describe();
  std::string first;
  for (const char* batch : {"500", "7", "1"}) {
    RunResult eval = RunEval(model_dir, {"--data_format=synthetic", "--synthetic_examples=500",
                                         std::string("--batch_size=") + batch});
    std::smatch m;
    ASSERT_EQ(eval.exit_code, 0) << eval.description;
    ASSERT_TRUE(
        std::regex_search(eval.out, m, std::regex(R"(accuracy: ([0-9.]+)\nloss: ([0-9.]+)\n)")))
        << eval.description;
    const std::string figures = m[1].str() + " " + m[2].str();
    if (first.empty()) {
      first = figures;
      // Trained (about 0.98 after these 60 steps; chance is 0.1).
      EXPECT_GT(std::stod(m[1].str()), 0.8) << eval.description;
    }
    EXPECT_EQ(figures, first) << "--batch_size=" << batch;
  }
}

// The chief's eval lines as step -> "acc loss", and whether the closing line
// gave the evaluator's final figures as "acc loss".
std::map<int, std::string> ChiefEvalLines(const std::string& output, std::string* final_eval) {
  std::map<int, std::string> evals;
  const std::regex eval(R"(chief\] eval: step (\d+)/\d+ loss ([0-9.]+) acc ([0-9.]+) \|)");
  const std::regex done(R"(chief\] done: .* test loss ([0-9.]+) acc ([0-9.]+) \(evaluator\))");
  for (const std::string& line : Lines(output)) {
    std::smatch m;
    if (std::regex_search(line, m, eval))
      evals[std::stoi(m[1].str())] = m[3].str() + " " + m[2].str();
    if (std::regex_search(line, m, done)) *final_eval = m[2].str() + " " + m[1].str();
  }
  return evals;
}

// An evaluator beside the job (psflow-launch --evaluators=1): the chief logs
// its eval lines, never queued (each step at most once, in order), the final
// model among them; the closing line gives the final figures, which are
// exactly psflow-eval's on the saved model (same weights, batch and kernels).
TEST_F(ClusterTest, LaunchWithEvaluatorLogsEvalLinesEndingWithTheSavedModelsAccuracy) {
  const std::string model_dir = dir_ + "/model";
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=2", "--evaluators=1", "--", "--model=mlp",
                  "--train_steps=600", "--optimizer=adam", "--learning_rate=0.001",
                  "--log_every_steps=200", "--eval_every_steps=200", "--model_dir=" + model_dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  const std::string out = launch.output();
  std::string final_eval;
  const std::map<int, std::string> evals = ChiefEvalLines(out, &final_eval);
  ASSERT_TRUE(evals.count(600)) << launch.Describe();
  for (const auto& [step, figures] : evals) {
    EXPECT_EQ(step % 200, 0) << "evaluated step " << step << " (every 200 asked)";
  }
  const std::string saved = SavedModelFigures(model_dir);
  EXPECT_EQ(evals.at(600), saved) << launch.Describe();
  EXPECT_EQ(final_eval, saved) << launch.Describe();
  EXPECT_THAT(out, HasSubstr("[launch] evaluator0 exited with code 0")) << launch.Describe();
}

// The same job with bf16 on the wire trains as well as in fp32: psflow-eval's
// accuracy within 0.02 of the fp32 run's. The ps keep fp32 masters, so the
// final checkpoint (and the saved model) holds values the wire could not carry.
TEST_F(ClusterTest, LaunchWithBfloat16OnTheWireTrainsAsWellAsFp32) {
  // Trains the mlp with `wire` under <dir_>/<wire> and returns the accuracy.
  auto train = [&](const std::string& wire) -> double {
    const std::string model_dir = dir_ + "/" + wire;
    Process launch(Bin("psflow-launch"),
                   {"--ps=2", "--workers=2", "--", "--model=mlp", "--train_steps=400",
                    "--optimizer=adam", "--learning_rate=0.001", "--log_every_steps=100",
                    "--wire_dtype=" + wire, "--model_dir=" + model_dir});
    EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
    EXPECT_NE(ChiefProgressLine(launch.output(), 400, 400), "") << launch.Describe();
    RunResult eval = RunEval(model_dir);
    EXPECT_EQ(eval.exit_code, 0) << eval.description;
    const std::string acc = EvalAccuracyText(eval.out);
    EXPECT_NE(acc, "") << eval.description;
    return acc.empty() ? -1 : std::stod(acc);
  };
  const double fp32 = train("fp32");
  const double bf16 = train("bf16");
  EXPECT_GE(fp32, 0.78);
  EXPECT_NEAR(bf16, fp32, 0.02);

  absl::StatusOr<chief::Checkpoint> newest = chief::ReadNewestCheckpoint(dir_ + "/bf16");
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->manifest.step(), 400);
  int64_t values = 0, beyond_bf16 = 0;
  for (const chief::CheckpointTensorData& t : newest->tensors) {
    if (!t.slot.empty()) continue;
    for (float v : t.values) {
      uint32_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      ++values;
      beyond_bf16 += (bits & 0xFFFFu) != 0;
    }
  }
  EXPECT_GT(beyond_bf16, values / 2) << beyond_bf16 << " of " << values;
}

// A learning rate this large makes the mlp's loss NaN within a few steps:
// the job must fail (exit 1, one line naming the step) and leave neither a
// saved model nor a checkpoint of non-finite weights, which a restart would
// "recover" into.
TEST_F(ClusterTest, DivergingJobFailsWithoutSavedModel) {
  const std::string model_dir = dir_ + "/model";
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=2", "--", "--model=mlp", "--train_steps=300",
                  "--learning_rate=50", "--checkpoint_every_steps=1", "--model_dir=" + model_dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 1) << launch.Describe();
  const std::string out = launch.output();
  EXPECT_THAT(out, HasSubstr("[launch] chief exited with code 1")) << launch.Describe();
  int fail_lines = 0;
  for (const std::string& line : Lines(out)) {
    if (line.rfind("[chief] ", 0) == 0 && line.find("exiting with code 1: ") != std::string::npos)
      ++fail_lines;
    EXPECT_EQ(line.find("nan ex/s"), std::string::npos) << line;
    if (line.rfind("[chief] ", 0) == 0) {
      EXPECT_EQ(line.find("loss nan"), std::string::npos) << line;
    }
  }
  EXPECT_EQ(fail_lines, 1) << launch.Describe();
  EXPECT_THAT(
      out, ::testing::ContainsRegex(
               "chief\\] exiting with code 1: (worker [01] computed a non-finite loss or gradients "
               "at step [0-9]+|the weights of step [0-9]+ are not finite)"));
  // Not even an empty saved model directory.
  EXPECT_FALSE(std::filesystem::exists(model_dir + "/saved_model")) << launch.Describe();
  ExpectNoProcessesLeft(model_dir);

  // The checkpoints kept (if one was due before the divergence) hold finite
  // values only: a restart must not "recover" into NaN weights.
  absl::StatusOr<chief::Checkpoint> newest = chief::ReadNewestCheckpoint(model_dir);
  if (newest.ok()) {
    for (const chief::CheckpointTensorData& t : newest->tensors) {
      for (float v : t.values) ASSERT_TRUE(std::isfinite(v)) << t.name << "/" << t.slot;
    }
  } else {
    EXPECT_TRUE(absl::IsNotFound(newest.status())) << newest.status();
  }
}

// --clip_gradient_norm: each worker scales its step's gradients down to the
// bound's global norm once the backward pass is done. With a bound far
// below the mlp's gradients every step is clipped, said and counted, and
// the job trains to its end (exit 0, a saved model) on a model other than
// the same job's without a bound, which clips nothing.
TEST_F(ClusterTest, ClipGradientNormClipsEveryStepOfATinyBound) {
  std::map<std::string, std::string> outputs;
  auto train = [&](const std::string& name, const std::vector<std::string>& extra) {
    const std::string model_dir = dir_ + "/" + name;
    std::vector<std::string> args = {"--ps=1",
                                     "--workers=2",
                                     "--",
                                     "--model=mlp",
                                     "--train_steps=60",
                                     "--optimizer=sgd",
                                     "--learning_rate=0.1",
                                     "--log_every_steps=20",
                                     "--model_dir=" + model_dir};
    args.insert(args.end(), extra.begin(), extra.end());
    Process launch(Bin("psflow-launch"), args);
    EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
    outputs[name] = launch.output();
    return SavedModelFigures(model_dir);
  };
  const std::string free = train("free", {});
  const std::string clipped = train("clipped", {"--clip_gradient_norm=0.001"});
  EXPECT_NE(clipped, "");
  EXPECT_NE(clipped, free);
  EXPECT_THAT(outputs["clipped"], HasSubstr("gradients clipped to global norm 0.001"));
  EXPECT_THAT(outputs["clipped"], HasSubstr("clipping gradients to global norm 0.001"));
  EXPECT_THAT(outputs["clipped"], HasSubstr(", 120 worker steps clipped")) << outputs["clipped"];
  EXPECT_THAT(outputs["free"], Not(HasSubstr("clipped"))) << outputs["free"];
}

// --on_nonfinite=skip_step: the diverging job skips its non-finite steps
// (logged, no update) and fails once more than --max_skipped_steps were
// skipped: exit 1, one line saying so, no saved model.
TEST_F(ClusterTest, DivergingJobWithSkipStepFailsAfterTooManySkippedSteps) {
  const std::string model_dir = dir_ + "/model";
  Process launch(
      Bin("psflow-launch"),
      {"--ps=1", "--workers=2", "--", "--model=mlp", "--train_steps=300", "--learning_rate=50",
       "--on_nonfinite=skip_step", "--max_skipped_steps=5", "--model_dir=" + model_dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(120)), 1) << launch.Describe();
  const std::string out = launch.output();
  EXPECT_THAT(out, ::testing::ContainsRegex("chief\\] step [0-9]+ skipped: worker [01] computed a "
                                            "non-finite loss or gradients \\(1 steps skipped"))
      << launch.Describe();
  EXPECT_THAT(out, ::testing::ContainsRegex("chief\\] exiting with code 1: more than 5 steps were "
                                            "skipped"))
      << launch.Describe();
  EXPECT_THAT(out, Not(HasSubstr("(7 steps skipped"))) << launch.Describe();
  EXPECT_FALSE(std::filesystem::exists(model_dir + "/saved_model/model.pb")) << launch.Describe();
}

// SIGTERM to the launcher reaches the chief first, which checkpoints, and
// then every other process; none outlives the launcher.
TEST_F(ClusterTest, LaunchForwardsSigtermAndLeavesNothingBehind) {
  const std::string model_dir = dir_ + "/model";
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=2", "--", "--model=mlp", "--train_steps=1000000",
                  "--log_every_steps=50", "--model_dir=" + model_dir});
  ASSERT_TRUE(launch.WaitForOutput("chief] step 100/1000000 ", seconds(120))) << launch.Describe();
  const std::string chief = LaunchChiefAddress(launch.output());
  ASSERT_NE(chief, "") << launch.Describe();
  const std::string marker = "--chief_hosts=" + chief;
  // The scan sees the running cluster (so that its emptiness below means something).
  EXPECT_THAT(FindProcesses(marker), SizeIs(5)) << launch.Describe();

  launch.Signal(SIGTERM);
  const Clock::time_point signalled = Clock::now();
  const int code = launch.WaitOrKill(seconds(30));
  const double took = std::chrono::duration<double>(Clock::now() - signalled).count();
  EXPECT_FALSE(launch.timed_out()) << launch.Describe();
  EXPECT_LT(took, 15.0) << launch.Describe();
  // The launcher exits with the chief's code: 128 + SIGTERM.
  EXPECT_EQ(code, 128 + SIGTERM) << launch.Describe();
  // The chief gets the signal first and checkpoints while the ps still
  // answer; the rest get it once the chief has exited.
  const std::string out = launch.output();
  const size_t got = out.find("[launch] got signal 15; forwarding it to chief first");
  ASSERT_NE(got, std::string::npos) << launch.Describe();
  EXPECT_THAT(out.substr(got),
              ::testing::ContainsRegex("chief\\] checkpoint of step [0-9]+ written"))
      << launch.Describe();
  EXPECT_THAT(out, Not(HasSubstr("no checkpoint before exiting"))) << launch.Describe();
  const size_t chief_exit = out.find("[launch] chief exited with code 143");
  ASSERT_NE(chief_exit, std::string::npos) << launch.Describe();
  for (const char* name : {"ps0", "ps1", "worker0", "worker1"}) {
    const size_t exit = out.find(std::string("[launch] ") + name + " exited with code 143");
    EXPECT_GT(exit, chief_exit) << name << " exited before the chief\n" << launch.Describe();
  }
  for (const char* name : {"chief", "ps0", "ps1", "worker0", "worker1"}) {
    EXPECT_THAT(launch.output(),
                HasSubstr(std::string("[launch] ") + name + " exited with code 143"))
        << launch.Describe();
  }
  ExpectNoProcessesLeft(marker);
}

// Starts psflow-launch with `launch_args`, then after "--" an mlp job of
// `steps` steps that logs every 50 into `model_dir` (and `job_args`), and
// waits for the chief's line of step 100: *launch, and the chief's address
// in *chief.
void LaunchMlpToStep100(std::vector<std::string> launch_args, int64_t steps,
                        const std::string& model_dir, const std::vector<std::string>& job_args,
                        std::unique_ptr<Process>* launch, std::string* chief) {
  launch_args.insert(launch_args.end(),
                     {"--", "--model=mlp", "--train_steps=" + std::to_string(steps),
                      "--log_every_steps=50", "--model_dir=" + model_dir});
  launch_args.insert(launch_args.end(), job_args.begin(), job_args.end());
  *launch = std::make_unique<Process>(Bin("psflow-launch"), launch_args);
  ASSERT_TRUE(
      (*launch)->WaitForOutput("chief] step 100/" + std::to_string(steps) + " ", seconds(120)))
      << (*launch)->Describe();
  *chief = LaunchChiefAddress((*launch)->output());
  ASSERT_NE(*chief, "") << (*launch)->Describe();
}

// SIGTERM to every member at once, as Kubernetes stops a job's pods: the ps
// serve on until the chief's stop checkpoint is written and the chief says
// so, and the workers stop once their step's pushes are
// answered, so that the checkpoint is taken; the next run restores it.
TEST_F(ClusterTest, ClusterSigtermedAllAtOnceKeepsTheChiefsCheckpoint) {
  const std::string model_dir = dir_ + "/model";
  std::string marker;
  int64_t saved = -1;
  {
    std::unique_ptr<Process> started;
    std::string chief;
    ASSERT_NO_FATAL_FAILURE(LaunchMlpToStep100({"--ps=2", "--workers=2", "--restart=never"},
                                               1000000, model_dir, {}, &started, &chief));
    Process& launch = *started;
    marker = "--chief_hosts=" + chief;
    const std::vector<pid_t> members = FindProcesses(marker);
    ASSERT_THAT(members, SizeIs(5)) << launch.Describe();
    for (pid_t pid : members) ::kill(pid, SIGTERM);
    const Clock::time_point signalled = Clock::now();
    launch.WaitOrKill(seconds(30));
    const double took = std::chrono::duration<double>(Clock::now() - signalled).count();
    EXPECT_FALSE(launch.timed_out()) << launch.Describe();
    // No ps waited out its 10 s. (A worker may wait its 3 s: its push of
    // the step in flight is answered only once every worker pushed it, and
    // one that was between steps stopped at once.)
    EXPECT_LT(took, 8.0) << launch.Describe();
    const std::string out = launch.output();
    std::smatch m;
    ASSERT_TRUE(
        std::regex_search(out, m, std::regex(R"(chief\] checkpoint of step ([0-9]+) written)")))
        << launch.Describe();
    saved = std::stoll(m[1].str());
    EXPECT_GE(saved, 100) << launch.Describe();
    EXPECT_THAT(out, Not(HasSubstr("no checkpoint before exiting"))) << launch.Describe();
    EXPECT_THAT(out, HasSubstr("chief] told 2 of 2 ps that the stop checkpoint is done"))
        << launch.Describe();
    for (const char* ps : {"ps0", "ps1"}) {
      // Unless the chief had already told it when its own signal was read.
      EXPECT_THAT(out, ::testing::ContainsRegex(std::string(ps) +
                                                "\\] (the chief has taken its checkpoint|signal "
                                                "15: the chief took its checkpoint)"))
          << launch.Describe();
    }
    EXPECT_THAT(out, Not(HasSubstr("no word from the chief"))) << launch.Describe();
    for (const char* name : {"chief", "ps0", "ps1", "worker0", "worker1"}) {
      EXPECT_THAT(out, HasSubstr(std::string("[launch] ") + name + " exited with code 143"))
          << launch.Describe();
    }
  }
  ExpectNoProcessesLeft(marker);
  // The next run starts from that checkpoint and finishes.
  Process again(Bin("psflow-launch"), {"--ps=2", "--workers=2", "--restart=never", "--",
                                       "--model=mlp", "--train_steps=" + std::to_string(saved + 50),
                                       "--log_every_steps=50", "--model_dir=" + model_dir});
  EXPECT_EQ(again.WaitOrKill(seconds(120)), 0) << again.Describe();
  EXPECT_THAT(again.output(),
              HasSubstr("restoring from the checkpoint of step " + std::to_string(saved)))
      << again.Describe();
}

// A worker that exits non-zero (without --restart) stops the cluster as a
// signal to the launcher does: the chief first, which checkpoints while the
// ps answer. (SIGTERM, so that the worker exits between its pushes of a
// step; one killed half-way through them would leave the ps a step apart,
// and no checkpoint of one step could be taken until the chief dropped it.)
TEST_F(ClusterTest, AFailedWorkerStopsTheClusterChiefFirst) {
  const std::string model_dir = dir_ + "/model";
  std::unique_ptr<Process> started;
  std::string chief;
  ASSERT_NO_FATAL_FAILURE(LaunchMlpToStep100({"--ps=2", "--workers=2", "--restart=never"}, 1000000,
                                             model_dir, {}, &started, &chief));
  Process& launch = *started;
  const std::vector<pid_t> worker1 = FindMember(chief, "worker", 1);
  ASSERT_THAT(worker1, SizeIs(1)) << launch.Describe();
  ::kill(worker1[0], SIGTERM);
  EXPECT_EQ(launch.WaitOrKill(seconds(30)), 143) << launch.Describe();
  const std::string out = launch.output();
  const size_t failed = out.find("[launch] worker1 failed; stopping the cluster, chief first");
  ASSERT_NE(failed, std::string::npos) << launch.Describe();
  EXPECT_THAT(out.substr(failed),
              ::testing::ContainsRegex("chief\\] checkpoint of step [0-9]+ written"))
      << launch.Describe();
  const size_t chief_exit = out.find("[launch] chief exited with code 143");
  ASSERT_NE(chief_exit, std::string::npos) << launch.Describe();
  for (const char* name : {"ps0", "ps1", "worker0"}) {
    const size_t exit = out.find(std::string("[launch] ") + name + " exited with code 143");
    EXPECT_GT(exit, chief_exit) << name << " exited before the chief\n" << launch.Describe();
    EXPECT_NE(exit, std::string::npos) << name << launch.Describe();
  }
}

// A ps told to stop alone (its pod evicted, say) says so to the chief,
// which checkpoints at once and tells it; the ps exits, is restarted, and
// the job goes on from that checkpoint instead of an older one.
TEST_F(ClusterTest, PsSigtermedAloneIsCheckpointedBeforeItGoes) {
  const std::string model_dir = dir_ + "/model";
  std::unique_ptr<Process> started;
  std::string chief;
  ASSERT_NO_FATAL_FAILURE(LaunchMlpToStep100({"--ps=2", "--workers=2", "--restart=on-failure"}, 300,
                                             model_dir, {"--checkpoint_every_steps=100000"},
                                             &started, &chief));
  Process& launch = *started;
  const std::vector<pid_t> ps1 = FindMember(chief, "ps", 1);
  ASSERT_THAT(ps1, SizeIs(1)) << launch.Describe();
  ::kill(ps1[0], SIGTERM);
  EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  const std::string out = launch.output();
  const size_t told = out.find("chief] ps 1 told to stop: checkpointing before it goes");
  ASSERT_NE(told, std::string::npos) << launch.Describe();
  std::smatch m;
  const std::string after = out.substr(told);
  ASSERT_TRUE(
      std::regex_search(after, m, std::regex(R"(chief\] checkpoint of step ([0-9]+) written)")))
      << launch.Describe();
  const int64_t saved = std::stoll(m[1].str());
  EXPECT_GE(saved, 100) << launch.Describe();
  EXPECT_THAT(after, HasSubstr("ps1] the chief has taken its checkpoint")) << launch.Describe();
  EXPECT_THAT(after, HasSubstr("[launch] ps1 exited with code 143")) << launch.Describe();
  EXPECT_THAT(after, Not(HasSubstr("no word from the chief"))) << launch.Describe();
  EXPECT_THAT(after, HasSubstr("restoring from the checkpoint of step " + std::to_string(saved)))
      << launch.Describe();
  EXPECT_THAT(out, HasSubstr("chief] done: 300 steps")) << launch.Describe();
}

// With no chief to answer (stopped here), a ps told to stop serves on for
// --stop_grace, then exits 143.
TEST_F(ClusterTest, PsSigtermedWithoutAChiefServesOnForItsGraceThenExits) {
  const std::string model_dir = dir_ + "/model";
  std::unique_ptr<Process> started;
  std::string chief;
  ASSERT_NO_FATAL_FAILURE(
      LaunchMlpToStep100({"--ps=2", "--workers=2", "--restart=never", "--ps_args=--stop_grace=2s"},
                         1000000, model_dir, {}, &started, &chief));
  Process& launch = *started;
  const std::vector<pid_t> chief_pid = FindMember(chief, "chief", 0);
  const std::vector<pid_t> ps1 = FindMember(chief, "ps", 1);
  ASSERT_THAT(chief_pid, SizeIs(1)) << launch.Describe();
  ASSERT_THAT(ps1, SizeIs(1)) << launch.Describe();
  ::kill(chief_pid[0], SIGSTOP);
  ::kill(ps1[0], SIGTERM);
  const bool served = launch.WaitForOutput(
      "ps1] signal 15: serving on until the chief has taken a checkpoint, for at most 2s",
      seconds(30));
  const bool gave_up = launch.WaitForOutput("ps1] no word from the chief within 2s", seconds(30));
  const bool exited = launch.WaitForOutput("[launch] ps1 exited with code 143", seconds(30));
  ::kill(chief_pid[0], SIGCONT);
  EXPECT_TRUE(served) << launch.Describe();
  EXPECT_TRUE(gave_up) << launch.Describe();
  EXPECT_TRUE(exited) << launch.Describe();
  launch.WaitOrKill(milliseconds(0));  // the rest dies with the launcher
}

// ---------------------------------------------------------------------------
// One process per role, started in the "wrong" order: workers, then ps, then
// the chief (pods start in any order).

struct Member {
  std::string name;    // "worker0"
  std::string binary;  // "psflow-worker"
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
};

constexpr int kSteps = 150;

std::vector<std::string> ChiefJobArgs(const std::string& model_dir) {
  return {"--model=mlp", "--train_steps=" + std::to_string(kSteps), "--log_every_steps=50",
          "--compute_threads=1", "--model_dir=" + model_dir};
}

// Starts `members` in order (a pause whenever the binary changes), waits for
// all, and checks that every one exits 0 and the chief trained and saved
// (and, with an evaluator among them, logged its evaluation of the final
// model).
void RunSeparateCluster(const std::vector<Member>& members, const std::string& model_dir) {
  std::vector<std::unique_ptr<Process>> procs;
  Process* chief = nullptr;
  bool evaluator = false;
  for (size_t i = 0; i < members.size(); ++i) {
    evaluator |= members[i].binary == "psflow-evaluator";
    if (i > 0 && members[i].binary != members[i - 1].binary)
      std::this_thread::sleep_for(milliseconds(300));
    procs.push_back(
        std::make_unique<Process>(Bin(members[i].binary), members[i].args, members[i].env));
    if (members[i].binary == "psflow-chief") chief = procs.back().get();
  }
  ASSERT_NE(chief, nullptr);
  chief->WaitOrKill(seconds(120));
  const Clock::time_point deadline = Clock::now() + seconds(30);
  for (auto& p : procs) {
    p->WaitOrKill(std::max(milliseconds(1),
                           std::chrono::duration_cast<milliseconds>(deadline - Clock::now())));
  }
  std::string all;
  for (size_t i = 0; i < procs.size(); ++i)
    all += "\n===== " + members[i].name + "\n" + procs[i]->Describe();
  for (size_t i = 0; i < procs.size(); ++i) {
    EXPECT_EQ(procs[i]->exit_code(), 0) << members[i].name << " failed" << all;
  }
  EXPECT_NE(ChiefProgressLine(chief->output(), kSteps, kSteps, ""), "") << all;
  EXPECT_TRUE(std::filesystem::exists(model_dir + "/saved_model")) << all;
  if (evaluator) {
    EXPECT_THAT(chief->output(), HasSubstr("eval: step " + std::to_string(kSteps) + "/")) << all;
    EXPECT_THAT(chief->output(), HasSubstr("(evaluator)")) << all;
  }
}

template <typename MakeMember>
void ClusterTest::RunWorkersThenPsThenChief(const MakeMember& member) {
  const std::string model_dir = dir_ + "/model";
  RunSeparateCluster({member("worker", 0, {}), member("worker", 1, {}), member("ps", 0, {}),
                      member("ps", 1, {}), member("chief", 0, ChiefJobArgs(model_dir))},
                     model_dir);
}

struct Ports {
  Ports() : p(FreePorts(6)) {}
  std::vector<int> p;  // chief, ps0, ps1, worker0, worker1, evaluator
  std::string chief() const { return Addr(p[0]); }
  std::string ps(int i) const { return Addr(p[1 + i]); }
  std::string worker(int i) const { return Addr(p[3 + i]); }
  std::string evaluator() const { return Addr(p[5]); }
};

// TF_CONFIG exactly as the Kubeflow training operator writes it (roles in
// sorted order, "environment":"cloud"); `chief_key` is "chief" or "master".
std::string TfConfig(const Ports& ports, const std::string& chief_key, const std::string& type,
                     int index) {
  std::string c = "{\"cluster\":{";
  if (chief_key == "chief") c += "\"chief\":[\"" + ports.chief() + "\"],";
  c += "\"evaluator\":[\"" + ports.evaluator() + "\"],";
  if (chief_key == "master") c += "\"master\":[\"" + ports.chief() + "\"],";
  c += "\"ps\":[\"" + ports.ps(0) + "\",\"" + ports.ps(1) + "\"],";
  c += "\"worker\":[\"" + ports.worker(0) + "\",\"" + ports.worker(1) + "\"]},";
  c += "\"task\":{\"type\":\"" + type + "\",\"index\":" + std::to_string(index) +
       "},\"environment\":\"cloud\"}";
  return c;
}

// CLUSTER_CONFIG as a Helm template renders it: trailing commas, newlines.
std::string HelmClusterConfig(const Ports& ports) {
  return "{\n  \"chief\": [\"" + ports.chief() + "\",],\n  \"ps\": [\"" + ports.ps(0) + "\", \"" +
         ports.ps(1) + "\",],\n  \"worker\": [\"" + ports.worker(0) + "\", \"" + ports.worker(1) +
         "\",],\n}\n";
}

TEST_F(ClusterTest, SeparateProcessesWithFlags) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  const std::vector<std::string> hosts = {
      "--chief_hosts=" + ports.chief(), "--ps_hosts=" + ports.ps(0) + "," + ports.ps(1),
      "--worker_hosts=" + ports.worker(0) + "," + ports.worker(1)};
  auto member = [&](const std::string& role, int index, std::vector<std::string> extra = {}) {
    Member m{role == "chief" ? "chief" : role + std::to_string(index), "psflow-" + role, {}, {}};
    m.args = {"--job_name=" + role, "--task_id=" + std::to_string(index)};
    m.args.insert(m.args.end(), hosts.begin(), hosts.end());
    m.args.insert(m.args.end(), extra.begin(), extra.end());
    return m;
  };
  RunWorkersThenPsThenChief(member);
}

// --exit_when_done=false (the StatefulSet manifests): every role stays up once
// the job is over, and exits 0 on SIGTERM.
TEST_F(ClusterTest, RolesIdleAfterTheJobUntilTerminated) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  const std::string config = "{\"chief\": [\"" + ports.chief() + "\"], \"ps\": [\"" + ports.ps(0) +
                             "\"], \"worker\": [\"" + ports.worker(0) + "\"]}";
  auto env = [&](const std::string& pod) {
    return std::map<std::string, std::string>{{"CLUSTER_CONFIG", config},
                                              {"POD_NAME", "psflow-" + pod}};
  };
  const std::string model_dir = dir_ + "/model";
  std::vector<std::string> chief_args = ChiefJobArgs(model_dir);
  chief_args.push_back("--exit_when_done=false");
  std::vector<std::unique_ptr<Process>> procs;
  procs.push_back(std::make_unique<Process>(
      Bin("psflow-ps"), std::vector<std::string>{"--exit_when_done=false"}, env("ps-0")));
  procs.push_back(std::make_unique<Process>(
      Bin("psflow-worker"), std::vector<std::string>{"--exit_when_done=false"}, env("worker-0")));
  procs.push_back(std::make_unique<Process>(Bin("psflow-chief"), chief_args, env("chief-0")));
  for (auto& p : procs) {
    ASSERT_TRUE(p->WaitForOutput("idling until terminated", seconds(120))) << p->Describe();
  }
  EXPECT_TRUE(std::filesystem::exists(model_dir + "/saved_model"));
  std::this_thread::sleep_for(milliseconds(500));
  for (auto& p : procs) {
    EXPECT_TRUE(p->running()) << "left before it was terminated\n" << p->Describe();
    p->Signal(SIGTERM);
  }
  for (auto& p : procs) EXPECT_EQ(p->WaitOrKill(seconds(20)), 0) << p->Describe();
}

TEST_F(ClusterTest, SeparateProcessesWithTfConfig) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  auto member = [&](const std::string& role, int index, std::vector<std::string> args = {}) {
    return Member{role == "chief" ? "chief" : role + std::to_string(index),
                  "psflow-" + role,
                  std::move(args),
                  {{"TF_CONFIG", TfConfig(ports, "chief", role, index)}}};
  };
  // With the evaluator the cluster lists, configured by the same TF_CONFIG.
  const std::string model_dir = dir_ + "/model";
  RunSeparateCluster(
      {member("worker", 0), member("worker", 1), member("evaluator", 0), member("ps", 0),
       member("ps", 1), member("chief", 0, ChiefJobArgs(model_dir))},
      model_dir);
}

// "master" for the chief in TF_CONFIG, and one ps and one worker configured
// by CLUSTER_CONFIG + POD_NAME instead: all sources must agree on the cluster.
TEST_F(ClusterTest, SeparateProcessesWithMasterAndClusterConfig) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  auto tf = [&](const std::string& name, const std::string& binary, const std::string& type,
                int index, std::vector<std::string> args = {}) {
    return Member{
        name, binary, std::move(args), {{"TF_CONFIG", TfConfig(ports, "master", type, index)}}};
  };
  auto helm = [&](const std::string& name, const std::string& binary, const std::string& pod) {
    return Member{
        name, binary, {}, {{"CLUSTER_CONFIG", HelmClusterConfig(ports)}, {"POD_NAME", pod}}};
  };
  const std::string model_dir = dir_ + "/model";
  // The evaluator's TF_CONFIG in its minimal form: a cluster of the master
  // alone (the evaluator has no address of its own and listens on nothing).
  const Member evaluator{
      "evaluator0",
      "psflow-evaluator",
      {},
      {{"TF_CONFIG", "{\"cluster\":{\"master\":[\"" + ports.chief() +
                         "\"]},\"task\":{\"type\":\"evaluator\",\"index\":0}}"}}};
  RunSeparateCluster(
      {tf("worker0", "psflow-worker", "worker", 0), helm("worker1", "psflow-worker", "worker-1"),
       evaluator, tf("ps0", "psflow-ps", "ps", 0), helm("ps1", "psflow-ps", "mnist-ps-1"),
       tf("chief", "psflow-chief", "master", 0, ChiefJobArgs(model_dir))},
      model_dir);
}

// An evaluator killed with SIGKILL mid-run changes nothing for training: the
// job runs on, and its saved model is exactly the one of the same job without
// any evaluator. A new evaluator started in its place registers and
// evaluates the final model, which the chief reports.
TEST_F(ClusterTest, EvaluatorKilledMidRunChangesNothingForTraining) {
  const std::vector<std::string> job = {"--model=mlp",           "--train_steps=1500",
                                        "--optimizer=adam",      "--learning_rate=0.001",
                                        "--log_every_steps=500", "--eval_every_steps=100",
                                        "--compute_threads=1"};
  // The same job, no evaluator.
  const std::string alone_dir = dir_ + "/alone";
  {
    std::vector<std::string> args = {"--ps=2", "--workers=2", "--"};
    args.insert(args.end(), job.begin(), job.end());
    args.push_back("--model_dir=" + alone_dir);
    Process launch(Bin("psflow-launch"), args);
    ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
    EXPECT_THAT(launch.output(), Not(HasSubstr("eval:"))) << launch.Describe();
    EXPECT_THAT(launch.output(), Not(HasSubstr("waiting for the evaluation"))) << launch.Describe();
  }

  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  const std::vector<std::string> hosts = {
      "--chief_hosts=" + ports.chief(), "--ps_hosts=" + ports.ps(0) + "," + ports.ps(1),
      "--worker_hosts=" + ports.worker(0) + "," + ports.worker(1),
      "--evaluator_hosts=" + ports.evaluator()};
  auto start = [&](const std::string& role, int index, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--job_name=" + role, "--task_id=" + std::to_string(index)};
    args.insert(args.end(), hosts.begin(), hosts.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(Bin("psflow-" + role), args);
  };
  const std::string model_dir = dir_ + "/model";
  std::vector<std::string> chief_args = job;
  chief_args.push_back("--model_dir=" + model_dir);
  std::vector<std::unique_ptr<Process>> procs;
  procs.push_back(start("ps", 0));
  procs.push_back(start("ps", 1));
  procs.push_back(start("worker", 0));
  procs.push_back(start("worker", 1));
  procs.push_back(start("chief", 0, chief_args));
  Process& chief = *procs.back();
  auto evaluator = start("evaluator", 0, {"--compute_threads=1"});
  ASSERT_TRUE(chief.WaitForOutput("eval: step", seconds(60))) << chief.Describe();
  evaluator->Signal(SIGKILL);
  evaluator->WaitOrKill(seconds(10));
  ASSERT_TRUE(chief.running()) << "the job ended before the evaluator was killed\n"
                               << chief.Describe();
  // Its replacement (as Kubernetes would start one) takes over.
  auto replacement = start("evaluator", 0, {"--compute_threads=1"});
  EXPECT_EQ(chief.WaitOrKill(seconds(120)), 0) << chief.Describe();
  for (auto& p : procs) EXPECT_EQ(p->WaitOrKill(seconds(30)), 0) << p->Describe();
  EXPECT_EQ(replacement->WaitOrKill(seconds(30)), 0) << replacement->Describe();

  std::string final_eval;
  const std::map<int, std::string> evals = ChiefEvalLines(chief.output(), &final_eval);
  const std::string saved = SavedModelFigures(model_dir);
  EXPECT_EQ(saved, SavedModelFigures(alone_dir)) << chief.Describe();
  ASSERT_TRUE(evals.count(1500)) << chief.Describe();
  EXPECT_EQ(evals.at(1500), saved) << chief.Describe();
  EXPECT_EQ(final_eval, saved) << chief.Describe();
}

// ---------------------------------------------------------------------------
// Bad configurations: exit code 1 at once, with one line naming the problem.

struct BadCase {
  std::string what;
  std::string binary;
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
  std::string expect;    // a substring of the message
  bool one_line = true;  // stdout empty, stderr exactly one line
};

// A chief that refuses its flags ends the local cluster at once (the
// launcher used to wait its 15 s grace period for the others).
TEST(ClusterCliTest, LaunchStopsAtOnceWhenTheChiefFails) {
  Process launch(Bin("psflow-launch"), {"--ps=1", "--workers=1", "--", "--no_such_flag"});
  EXPECT_EQ(launch.WaitOrKill(seconds(30)), 1) << launch.Describe();
  EXPECT_LT(launch.elapsed_seconds(), 5.0) << launch.Describe();
  EXPECT_THAT(launch.output(), HasSubstr("Unknown command line flag 'no_such_flag'"))
      << launch.Describe();
}

// --worker_args reach every worker: a worker flag out of range ends the
// cluster, with the worker's own message; an argument that is no flag is
// refused before anything starts.
TEST(ClusterCliTest, LaunchPassesWorkerArgsToTheWorkers) {
  // The chief has all it needs: the worker's refusal is what ends the job.
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=1", "--worker_args=--ps_lanes=99", "--", "--model=mlp",
                  "--data_format=synthetic", "--train_steps=50",
                  "--model_dir=" + ::testing::TempDir() + "/psflow_worker_args"});
  EXPECT_EQ(launch.WaitOrKill(seconds(60)), 1) << launch.Describe();
  EXPECT_THAT(launch.output(), HasSubstr("--ps_lanes must be in [0, 64], not 99"))
      << launch.Describe();
  RunResult r = RunProcess(Bin("psflow-launch"), {"--worker_args=ps_lanes=4"}, {}, seconds(10));
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_THAT(r.output, HasSubstr("--worker_args: 'ps_lanes=4' is not a flag")) << r.description;
}

// A CPU worker asked for passive kernel-thread waits, started with another
// policy in its environment, runs again with OMP_WAIT_POLICY=passive before
// it starts anything, says so, and trains.
TEST(ClusterCliTest, WorkersSetTheirKernelThreadsWaitBeforeTheyStart) {
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=2", "--worker_args=--kernel_threads_wait=passive", "--",
                  "--model=mlp", "--data_format=synthetic", "--train_steps=20",
                  "--model_dir=" + ::testing::TempDir() + "/psflow_kernel_threads_wait"},
                 {{"OMP_WAIT_POLICY", "active"}});
  EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  for (const char* worker : {"[worker0]", "[worker1]"}) {
    EXPECT_THAT(launch.output(),
                ::testing::ContainsRegex(absl::StrCat(
                    "\\", worker, "[^\n]*kernel threads wait with OMP_WAIT_POLICY=passive")))
        << launch.Describe();
  }
}

// The chief's closing line says what a run trained: a job of one logged
// interval gives no rate (the first interval counts start-up), and the same
// job run again on its model directory, whose checkpoint holds the last
// step, trained nothing in that run and gives no loss or accuracy either.
TEST(ClusterCliTest, TheClosingLineSaysWhatThisRunTrained) {
  const std::string model_dir = ::testing::TempDir() + "/psflow_closing_line";
  std::filesystem::remove_all(model_dir);
  const std::vector<std::string> args = {"--ps=1",
                                         "--workers=1",
                                         "--",
                                         "--model=mlp",
                                         "--data_format=synthetic",
                                         "--train_steps=40",
                                         "--log_every_steps=40",
                                         "--model_dir=" + model_dir};
  Process first(Bin("psflow-launch"), args);
  ASSERT_EQ(first.WaitOrKill(seconds(120)), 0) << first.Describe();
  EXPECT_THAT(first.output(), HasSubstr("chief] done: 40 steps, 2560 examples in "))
      << first.Describe();
  EXPECT_THAT(first.output(), HasSubstr("(too few logged intervals for a rate after the first)"))
      << first.Describe();
  EXPECT_THAT(first.output(), Not(HasSubstr("ex/s after the first interval"))) << first.Describe();
  Process again(Bin("psflow-launch"), args);
  ASSERT_EQ(again.WaitOrKill(seconds(120)), 0) << again.Describe();
  EXPECT_THAT(again.output(), HasSubstr("restoring from the checkpoint of step 40"))
      << again.Describe();
  EXPECT_THAT(again.output(),
              HasSubstr("chief] done: 40 steps, all trained before this run (it started at the "
                        "last step)"))
      << again.Describe();
  EXPECT_THAT(again.output(), Not(HasSubstr("final loss"))) << again.Describe();
  std::filesystem::remove_all(model_dir);
}

// A worker that reads its flags from a pipe (--flagfile=/dev/stdin) and
// executes itself again for its kernel threads' wait policy keeps those
// flags: the pipe is used up by then, so the restarted worker gets their
// values instead. No chief answers here: it logs its task and policy, then
// gives up after its startup timeout with code 138 (without its flags it
// would exit 1, naming no cluster).
TEST(ClusterCliTest, AWorkerRestartedForItsWaitPolicyKeepsFlagsReadFromAPipe) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  const std::string flags = absl::StrJoin(
      std::vector<std::string>{"--job_name=worker", "--task_id=1", "--chief_hosts=" + ports.chief(),
                               "--ps_hosts=" + ports.ps(0),
                               "--worker_hosts=" + ports.worker(0) + "," + ports.worker(1),
                               "--kernel_threads_wait=passive", "--startup_timeout=2"},
      " ");
  RunResult r = RunProcess("/bin/sh",
                           {"-c", absl::StrCat("printf '%s\\n' ", flags, " | exec '",
                                               Bin("psflow-worker"), "' --flagfile=/dev/stdin")},
                           {}, seconds(60));
  EXPECT_EQ(r.exit_code, 138) << r.description;
  EXPECT_THAT(r.output, ::testing::ContainsRegex(
                            "worker1\\][^\n]*kernel threads wait with OMP_WAIT_POLICY=passive"))
      << r.description;
  EXPECT_THAT(r.output, HasSubstr("chief " + ports.chief() + " unreachable")) << r.description;
}

// --ps_args reach every ps (each logs the apply threads it was given), and
// an argument that is no flag is refused before anything starts.
TEST(ClusterCliTest, LaunchPassesPsArgsToThePs) {
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=1", "--ps_args=--apply_threads=3", "--", "--model=mlp",
                  "--data_format=synthetic", "--train_steps=20",
                  "--model_dir=" + ::testing::TempDir() + "/psflow_ps_args"});
  EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  for (const char* ps : {"[ps0]", "[ps1]"}) {
    EXPECT_THAT(launch.output(), ::testing::ContainsRegex(
                                     absl::StrCat("\\", ps, ".*applying each step on 3 thread")))
        << launch.Describe();
  }
  RunResult r = RunProcess(Bin("psflow-launch"), {"--ps_args=apply_threads=4"}, {}, seconds(10));
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_THAT(r.output, HasSubstr("--ps_args: 'apply_threads=4' is not a flag")) << r.description;
}

// Workers and ps on one host exchange tensors through shared memory by
// default, and over the network with --shared_memory=false; both train.
TEST(ClusterCliTest, WorkersOnThePsHostExchangeThroughSharedMemory) {
  for (const bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared memory" : "network");
    std::vector<std::string> args = {"--ps=2", "--workers=2"};
    if (!shared) args.push_back("--worker_args=--shared_memory=false");
    const std::string model_dir =
        ::testing::TempDir() + "/psflow_shared_memory_" + (shared ? "on" : "off");
    std::filesystem::remove_all(model_dir);
    for (const std::string& a :
         {std::string("--"), std::string("--model=mlp"), std::string("--data_format=synthetic"),
          std::string("--train_steps=30"), "--model_dir=" + model_dir}) {
      args.push_back(a);
    }
    Process launch(Bin("psflow-launch"), args);
    ASSERT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
    for (const char* line : {"[worker0] ", "[worker1] "}) {
      for (const char* ps : {"ps 0 maps", "ps 1 maps"}) {
        const bool found =
            launch.output().find(std::string(line)) != std::string::npos &&
            std::regex_search(launch.output(),
                              std::regex(std::string("\\") + line + ".*" + ps +
                                         " this process's shared memory: tensors go through it"));
        EXPECT_EQ(found, shared) << line << ps << "\n" << launch.Describe();
      }
    }
    EXPECT_THAT(launch.output(), Not(HasSubstr("takes no shared memory"))) << launch.Describe();
  }
}

// Two processes on one address must not share it (gRPC's default
// SO_REUSEPORT would let the second "listen" too and split connections).
TEST(ClusterCliTest, SecondProcessOnABusyPortExitsOne) {
  Ports ports;
  const std::vector<std::string> flags = {
      "--job_name=ps", "--task_id=0", "--chief_hosts=" + ports.chief(), "--ps_hosts=" + ports.ps(0),
      "--worker_hosts=" + ports.worker(0)};
  Process first(Bin("psflow-ps"), flags);
  ASSERT_TRUE(first.WaitForOutput("listening on", seconds(20))) << first.Describe();
  Process second(Bin("psflow-ps"), flags);
  EXPECT_EQ(second.WaitOrKill(seconds(20)), 1) << second.Describe();
  EXPECT_LT(second.elapsed_seconds(), 10.0) << second.Describe();
  EXPECT_THAT(second.output(), HasSubstr("cannot listen on port " + std::to_string(ports.p[1])))
      << second.Describe();
  EXPECT_THAT(second.output(), Not(HasSubstr("listening on"))) << second.Describe();
  EXPECT_TRUE(first.running()) << first.Describe();
}

// Task 0 of `job` in a cluster of one chief, ps and worker, and `extra`.
std::vector<std::string> Task0Args(const Ports& ports, const std::string& job,
                                   std::vector<std::string> extra) {
  std::vector<std::string> args = {"--job_name=" + job, "--task_id=0",
                                   "--chief_hosts=" + ports.chief(), "--ps_hosts=" + ports.ps(0),
                                   "--worker_hosts=" + ports.worker(0)};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Cluster configurations a role cannot resolve.
std::vector<BadCase> BadClusterConfigurations(const Ports& ports, const std::string& model_dir) {
  return {
      {"malformed TF_CONFIG",
       "psflow-worker",
       {},
       {{"TF_CONFIG", R"({"cluster": {"ps": ["127.0.0.1:2222")"}},
       "TF_CONFIG is not valid JSON"},
      {"TF_CONFIG for a worker given to psflow-ps",
       "psflow-ps",
       {},
       {{"TF_CONFIG", TfConfig(ports, "chief", "worker", 1)}},
       "task type 'worker' in TF_CONFIG, but this is the ps"},
      {"task index out of range",
       "psflow-worker",
       {},
       {{"TF_CONFIG", TfConfig(ports, "chief", "worker", 2)}},
       "task index 2 out of range"},
      {"flag task index out of range",
       "psflow-ps",
       {"--job_name=ps", "--task_id=5", "--chief_hosts=" + ports.chief(),
        "--ps_hosts=" + ports.ps(0), "--worker_hosts=" + ports.worker(0)},
       {},
       "task index 5 out of range"},
      {"no configuration", "psflow-ps", {}, {}, "no cluster configuration"},
      {"no configuration (chief)",
       "psflow-chief",
       {"--model_dir=" + model_dir},
       {},
       "no cluster configuration"},
      {"bad address in --ps_hosts",
       "psflow-ps",
       {"--job_name=ps", "--task_id=0", "--chief_hosts=" + ports.chief(), "--ps_hosts=nohostport",
        "--worker_hosts=" + ports.worker(0)},
       {},
       "'nohostport' is not host:port"},
      {"POD_NAME without an index",
       "psflow-worker",
       {},
       {{"CLUSTER_CONFIG", HelmClusterConfig(ports)}, {"POD_NAME", "worker"}},
       "POD_NAME 'worker'"},
  };
}

// Flags a role refuses, in a cluster it can resolve.
std::vector<BadCase> BadFlags(const Ports& ports, const std::string& model_dir) {
  auto chief = [&](std::vector<std::string> extra) {
    return Task0Args(ports, "chief", std::move(extra));
  };
  return {
      {"unknown flag", "psflow-chief", {"--bogus"}, {}, "bogus", false},
      {"--epochs and --train_steps",
       "psflow-chief",
       chief({"--model=mlp", "--epochs=1", "--train_steps=10", "--model_dir=" + model_dir}),
       {},
       "give --epochs or --train_steps, not both"},
      {"unknown model",
       "psflow-chief",
       chief({"--model=does_not_exist", "--model_dir=" + model_dir}),
       {},
       "model 'does_not_exist'"},
      {"unknown optimizer",
       "psflow-chief",
       chief({"--model=mlp", "--optimizer=adadelta", "--model_dir=" + model_dir}),
       {},
       "--optimizer 'adadelta'"},
      {"no --model_dir", "psflow-chief", chief({"--model=mlp"}), {}, "--model_dir is required"},
      {"unknown wire dtype",
       "psflow-chief",
       chief({"--model=mlp", "--wire_dtype=int8", "--model_dir=" + model_dir}),
       {},
       "--wire_dtype 'int8' is not one of fp32, bf16, fp16"},
      {"negative --clip_gradient_norm",
       "psflow-chief",
       chief({"--model=mlp", "--clip_gradient_norm=-1", "--model_dir=" + model_dir}),
       {},
       "--clip_gradient_norm must be 0 (off) or a positive float, got -1"},
      {"non-finite --clip_gradient_norm",
       "psflow-chief",
       chief({"--model=mlp", "--clip_gradient_norm=nan", "--model_dir=" + model_dir}),
       {},
       "--clip_gradient_norm must be 0 (off) or a positive float, got nan"},
      {"negative --min_push_run_bytes",
       "psflow-worker",
       Task0Args(ports, "worker", {"--min_push_run_bytes=-1"}),
       {},
       "--min_push_run_bytes must not be negative, got -1"},
      {"unknown --kernel_threads_wait",
       "psflow-worker",
       Task0Args(ports, "worker", {"--kernel_threads_wait=spin"}),
       {},
       "--kernel_threads_wait: 'spin' is not one of auto, keep, passive"},
      {"--metrics_port out of range",
       "psflow-ps",
       Task0Args(ports, "ps", {"--metrics_port=70000"}),
       {},
       "--metrics_port must be in [0, 65535], not 70000",
       false},
      {"negative --stop_grace",
       "psflow-ps",
       Task0Args(ports, "ps", {"--stop_grace=-1s"}),
       {},
       "--stop_grace must be 0 (exit at once on a signal) or positive, not -1s"},
      {"--max_pending_streams over --max_streams",
       "psflow-ps",
       Task0Args(ports, "ps", {"--max_pending_streams=5000"}),
       {},
       "--max_pending_streams must be 0 (half of --max_streams) or positive and at most "
       "--max_streams, not 5000"},
      {"negative --stream_first_message_timeout",
       "psflow-ps",
       Task0Args(ports, "ps", {"--stream_first_message_timeout=-1s"}),
       {},
       "--stream_first_message_timeout must be 0 (never) or positive, not -1s"},
  };
}

// Runs `c`: it exits 1 within 5 s with its message (alone, as one line on
// stderr, where c.one_line).
void ExpectExitsOneQuickly(const BadCase& c) {
  SCOPED_TRACE(c.what);
  RunResult r = RunProcess(Bin(c.binary), c.args, c.env, seconds(10));
  EXPECT_FALSE(r.timed_out) << r.description;
  EXPECT_EQ(r.exit_code, 1) << r.description;
  EXPECT_LT(r.seconds, 5.0) << r.description;
  EXPECT_THAT(r.output, HasSubstr(c.expect)) << r.description;
  if (c.one_line) {
    EXPECT_EQ(r.out, "") << r.description;
    EXPECT_THAT(Lines(r.err), SizeIs(1)) << r.description;
    EXPECT_TRUE(!r.err.empty() && r.err.back() == '\n') << r.description;
  }
}

TEST(ClusterCliTest, BadConfigurationsExitOneQuickly) {
  Ports ports;
  ASSERT_THAT(ports.p, SizeIs(6));
  const std::string model_dir = ::testing::TempDir() + "/psflow_bad_config_never_created";
  std::filesystem::remove_all(model_dir);  // left by an earlier failing run
  for (const BadCase& c : BadClusterConfigurations(ports, model_dir)) ExpectExitsOneQuickly(c);
  for (const BadCase& c : BadFlags(ports, model_dir)) ExpectExitsOneQuickly(c);
  EXPECT_FALSE(std::filesystem::exists(model_dir));
}

// ---------------------------------------------------------------------------
// --help

const std::map<std::string, std::vector<std::string>>& OwnFlags() {
  // What every role binary takes: the cluster, security and metrics flags.
  auto role = [](std::vector<std::string> own) {
    for (const char* flag : {"job_name", "task_id", "task_index", "chief_hosts", "ps_hosts",
                             "worker_hosts", "evaluator_hosts", "exit_when_done", "tls_cert",
                             "tls_key", "tls_ca", "auth_token_file", "insecure", "metrics_port"}) {
      own.push_back(flag);
    }
    return own;
  };
  static const auto* flags = new std::map<std::string, std::vector<std::string>>{
      {"psflow-chief", role({"model",
                             "data_dir",
                             "data_format",
                             "train_files",
                             "eval_files",
                             "image_key",
                             "label_key",
                             "label_offset",
                             "resize_shorter",
                             "augment",
                             "csv_columns",
                             "csv_delimiter",
                             "csv_header",
                             "csv_preset",
                             "skip_bad_records",
                             "shuffle_buffer",
                             "prefetch_batches",
                             "input_mean",
                             "input_stddev",
                             "synthetic_examples",
                             "batch_size",
                             "epochs",
                             "train_steps",
                             "optimizer",
                             "learning_rate",
                             "momentum",
                             "bn_momentum",
                             "seed",
                             "model_dir",
                             "saved_model_dir",
                             "log_every_steps",
                             "compute_threads",
                             "startup_timeout",
                             "checkpoint_every_steps",
                             "checkpoint_every_secs",
                             "on_nonfinite",
                             "max_skipped_steps",
                             "max_gradient_abs",
                             "clip_gradient_norm",
                             "keep_checkpoints",
                             "worker_timeout",
                             "eval_every_steps",
                             "eval_every_secs",
                             "eval_final_timeout"})},
      {"psflow-ps", role({"apply_threads", "max_streams_per_peer", "max_streams",
                          "max_pending_streams", "stream_first_message_timeout", "shared_memory",
                          "same_host_channels", "apply_in_place", "wire_copies", "stop_grace"})},
      {"psflow-worker",
       role({"device", "startup_timeout", "ps_lanes", "push_during_backward", "min_push_run_bytes",
             "shared_memory", "same_host_channels", "upload_from_shared_memory", "narrow_on_gpu",
             "gradients_to_shared_memory", "kernel_threads_wait", "input_threads"})},
      {"psflow-evaluator",
       role({"device", "eval_data_dir", "eval_files", "input_threads", "batch_size",
             "eval_memory_limit", "compute_threads", "synthetic_examples", "startup_timeout"})},
      {"psflow-launch",
       {"ps", "workers", "evaluators", "evaluator_device", "host", "bin_dir", "grace_seconds",
        "restart", "worker_devices", "worker_args", "ps_args", "max_restarts", "tls_dir",
        "token_file", "metrics_base_port"}},
      {"psflow-eval",
       {"saved_model", "data_dir", "data_format", "eval_files", "image_key", "label_key",
        "label_offset", "resize_shorter", "csv_columns", "csv_delimiter", "csv_header",
        "csv_preset", "skip_bad_records", "synthetic_examples", "batch_size", "device",
        "eval_memory_limit"}},
      {"psflow-data",
       {"from", "input", "output", "shards", "threads", "split", "image_format", "jpeg_quality",
        "compression", "name", "csv_columns", "csv_delimiter", "csv_header", "csv_preset",
        "records"}},
      {"psflow-bench-step",
       {"model", "device", "batch_sizes", "modes", "steps", "repeats", "warmup_steps",
        "learning_rate", "threads", "profile"}},
      {"psflow-bench-alone",
       {"model", "data_dir", "batch_size", "steps", "warmup_steps", "threads"}},
      {"psflow-bench-apply",
       {"threads", "floats", "slice_floats", "optimizer", "workers", "iterations"}},
  };
  return *flags;
}

// Each binary's --help exits 0 and lists every flag of its own.
TEST(ClusterCliTest, HelpExitsZeroAndListsEveryOwnFlag) {
  for (const auto& [binary, flags] : OwnFlags()) {
    SCOPED_TRACE(binary);
    RunResult r = RunProcess(Bin(binary), {"--help"}, {}, seconds(10));
    ASSERT_FALSE(r.timed_out) << r.description;
    EXPECT_EQ(r.exit_code, 0) << "(first lines) " << r.output.substr(0, 300);
    EXPECT_THAT(r.output, HasSubstr(binary)) << r.description;
    for (const std::string& flag : flags) {
      EXPECT_THAT(r.output, HasSubstr("--" + flag + " (")) << r.description;
    }
  }
}

}  // namespace
}  // namespace psflow::itest
