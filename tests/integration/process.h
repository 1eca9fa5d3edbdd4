// Test helpers for process-level integration tests: where the built binaries
// are, run one as a child process with its output captured, wait for it with a
// deadline, free ports, a /proc scan for processes left behind, a fixture with
// a fresh directory per test, and the lines of psflow-launch and psflow-eval
// that tests read.
#ifndef PSFLOW_TESTS_INTEGRATION_PROCESS_H_
#define PSFLOW_TESTS_INTEGRATION_PROCESS_H_

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace psflow::itest {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using std::chrono::seconds;

#ifndef PSFLOW_BIN_DIR
#error \
    "PSFLOW_BIN_DIR (the build's bin directory) must be defined: see psflow_test() in tests/CMakeLists.txt"
#endif

// The path of the built binary `name`: in $PSFLOW_BIN_DIR where that is set
// and not empty (for test binaries carried to another machine), else in the
// build's bin directory (the PSFLOW_BIN_DIR compile definition).
inline std::string Bin(const std::string& name) {
  const char* dir = std::getenv("PSFLOW_BIN_DIR");
  return std::string(dir != nullptr && dir[0] != '\0' ? dir : PSFLOW_BIN_DIR) + "/" + name;
}

// A child process running `binary` with `args` (argv[1..]). It inherits this
// process's environment minus TF_CONFIG, CLUSTER_CONFIG and POD_NAME (so the
// caller's environment cannot change what a test runs), plus `env`. Its stdout
// and stderr are captured (separately and interleaved). It runs in its own
// process group and is SIGKILLed if the test process dies.
class Process {
 public:
  Process(const std::string& binary, const std::vector<std::string>& args,
          const std::map<std::string, std::string>& env = {});
  ~Process();  // SIGKILLs the process (group) if it still runs, and reaps it.
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  bool running();

  // Waits up to `timeout` for the process to exit; false if it still runs.
  bool WaitFor(milliseconds timeout);
  // Waits up to `timeout`; past it, SIGKILLs the process group and reaps it
  // (timed_out() is then true). Returns exit_code().
  int WaitOrKill(milliseconds timeout);
  // Waits until the interleaved output contains `text`, the process exits, or
  // `timeout` passes. True if the text was seen.
  bool WaitForOutput(const std::string& text, milliseconds timeout);

  void Signal(int sig);  // to the process only (not its group)

  // The exit status, or 128 + signal if a signal ended it; -1 while running.
  int exit_code() const { return exit_code_; }
  bool timed_out() const { return timed_out_; }
  // Seconds from start to exit (or to now while running).
  double elapsed_seconds() const;

  std::string output() const;  // stdout and stderr, interleaved as read
  std::string stdout_text() const;
  std::string stderr_text() const;
  // For failure messages: command line, exit code and output.
  std::string Describe() const;

 private:
  void ReadLoop();
  bool Reap(bool block);
  void FinishOutput();

  std::string command_;
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1, wake_fd_ = -1;
  int exit_code_ = -1;
  bool timed_out_ = false;
  Clock::time_point start_, end_;

  mutable std::mutex mu_;
  std::condition_variable eof_cv_;
  bool eof_ = false;
  std::string out_, err_, all_;
  std::thread reader_;
};

struct RunResult {
  int exit_code = -1;
  bool timed_out = false;
  double seconds = 0;
  std::string output, out, err, description;
};

// Runs a process to completion (killing it after `timeout`).
RunResult RunProcess(const std::string& binary, const std::vector<std::string>& args,
                     const std::map<std::string, std::string>& env = {},
                     milliseconds timeout = seconds(30));

// `n` distinct TCP ports that were free on 127.0.0.1 a moment ago (all bound
// at once while picking).
std::vector<int> FreePorts(int n);

// Pids of live (non-zombie) processes other than this one whose command line
// (arguments joined by spaces) contains `text`.
std::vector<pid_t> FindProcesses(const std::string& text);

// Pids of the live members of the cluster whose chief is at `chief`
// (host:port) with that role ("chief", "ps", "worker") and task index,
// found by each of those three arguments alone: a worker that executes
// itself again (for its kernel threads' wait policy, on hosts of 8 cores
// or more) passes its flags in another order.
std::vector<pid_t> FindMember(const std::string& chief, const std::string& role, int index);

// Waits up to 3 s for every process whose command line contains `text` to
// be gone; kills (by pid) the ones that remain and fails the current test.
void ExpectNoProcessesLeft(const std::string& text);

// Lines of `text` (without the '\n').
std::vector<std::string> Lines(const std::string& text);

// The chief's address ("127.0.0.1:<port>") in psflow-launch's line
// "[launch] cluster: chief 127.0.0.1:<port>, ps ..., workers ..." within
// `output`; "" if there is none.
std::string LaunchChiefAddress(const std::string& output);

// Runs psflow-eval to completion on the saved model of the job whose
// --model_dir is `model_dir`, with `flags` after --saved_model.
RunResult RunEval(const std::string& model_dir, const std::vector<std::string>& flags = {},
                  milliseconds timeout = seconds(60));

// The accuracy in psflow-eval's "accuracy: <a>" line of `eval_stdout`, as
// printed; "" if there is none.
std::string EvalAccuracyText(const std::string& eval_stdout);

// psflow-eval's figures of the saved model in `model_dir` (on the CPU), as
// printed: "<accuracy> <loss>"; "" (and a test failure) when it fails.
std::string SavedModelFigures(const std::string& model_dir);

// Jobs without ps: asserts that `output` holds the line "worker<i>] replica
// at step N: crc32c X" of each of `workers` workers, all with one X (the
// replicas ended bit-identical).
void ExpectIdenticalReplicas(const std::string& output, int workers);

// Jobs without ps: both workers of a job that `start(w)` starts (w = 0, 1)
// are told to stop (SIGTERM, as Kubernetes stops pods) once worker 0 logs
// `at`: worker 0 checkpoints, both exit 143; started again, they resume from
// that checkpoint (of step `min_step` or later) and reach `steps` with
// identical replicas.
void ExpectStoppedWorkersResume(const std::function<std::unique_ptr<Process>(int)>& start,
                                const std::string& at, int64_t min_step, int64_t steps);

// A fixture with a fresh directory dir_ for each test (under
// ::testing::TempDir(), named after the test and this pid); it is removed
// after a test that passed and kept (and named) after one that failed.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  // The job's flags for processes started by hand (not by psflow-launch):
  // the mlp for `steps` steps with adam, logging and checkpointing every 100
  // steps, into dir_/model. One kernel thread each, as psflow-launch divides
  // the cores: they share the machine's, and a worker's default (every core
  // it may use) would have their OpenMP threads spin against each other (300
  // steps took 20 s instead of 3).
  std::vector<std::string> HandStartedMlpArgs(int64_t steps) const;

  std::string dir_;
};

}  // namespace psflow::itest

#endif  // PSFLOW_TESTS_INTEGRATION_PROCESS_H_
