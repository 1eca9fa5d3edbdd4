// The coordinator's logic against an in-memory ps cluster (tests/fakes):
// supervision, recovery, adoption, checkpoints and stopping, each without a
// process and in well under a second. The test plays the workers: it
// registers, pushes (zero) gradients straight to the fake ps and reports.
#include "chief/coordinator.h"

#include <signal.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/metrics.h"
#include "common/placement.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/saved_model.h"
#include "model/spec.h"
#include "tests/fakes/fake_ps.h"

namespace psflow::chief {
namespace {

namespace fs = std::filesystem;
using fakes::FakePs;
using ::testing::ElementsAre;

constexpr int kBatch = 32;

Timeouts ShortTimeouts() {
  Timeouts t;
  t.startup = absl::Seconds(5);
  t.worker = absl::Milliseconds(150);
  t.supervise_every = absl::Milliseconds(10);
  t.register_wait = absl::Seconds(2);
  t.report_hold = absl::Milliseconds(50);
  t.state_call = absl::Seconds(1);
  t.control_call = absl::Seconds(1);
  t.snapshot_call = absl::Seconds(2);
  t.final_pull = absl::Seconds(2);
  t.release_wait = absl::Milliseconds(300);
  t.adopt_retry = absl::Milliseconds(5);
  t.evaluator = absl::Seconds(1);
  t.final_eval = absl::Seconds(5);
  t.nonfinite_confirm = absl::Milliseconds(50);
  return t;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "psflow_coordinator_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    if (run_.joinable()) {
      coordinator_->Stop(SIGTERM);
      run_.join();
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  // An mlp on synthetic data: `steps` steps of kBatch per worker.
  void MakeJob(int workers, int num_ps, int64_t steps) {
    JobOptions o;
    o.model = "mlp";
    o.data.set_format("synthetic");
    o.synthetic_examples = 512;
    o.batch_size = kBatch;
    o.train_steps = steps;
    absl::StatusOr<JobConfig> job = BuildJobConfig(o, workers, num_ps);
    ASSERT_TRUE(job.ok()) << job.status();
    job_ = *job;
    // Without ps, the one "ps" is worker 0's replica.
    ps_ = std::make_unique<FakePs>(job_.num_ps());
    pool_ = std::make_unique<ThreadPool>(std::max(job_.num_ps() - 1, 1));  // as psflow-chief
  }

  CoordinatorOptions Options() {
    CoordinatorOptions o;
    o.model_dir = dir_ + "/model";
    o.log_every_steps = 1000;
    o.checkpoint_every = absl::ZeroDuration();
    o.timeouts = ShortTimeouts();
    for (int p = 0; p < job_.num_ps(); ++p)
      o.ps_addresses.push_back(absl::StrCat("ps-", p, ":2222"));
    return o;
  }

  // Starts Run on a thread of its own.
  void Start(CoordinatorOptions options) {
    coordinator_ = std::make_unique<Coordinator>(std::move(options), job_, ps_.get(), pool_.get());
    returned_ = std::make_unique<absl::Notification>();
    run_ = std::thread([this] {
      result_ = coordinator_->Run();
      returned_->Notify();
    });
  }
  absl::Status Join(absl::Duration timeout = absl::Seconds(5)) {
    if (!returned_->WaitForNotificationWithTimeout(timeout))
      return absl::DeadlineExceededError("Run did not return");
    run_.join();
    return result_;
  }

  RegisterWorkerResponse Register(int w) {
    absl::StatusOr<RegisterWorkerResponse> r =
        coordinator_->RegisterWorker(w, absl::Now() + absl::Seconds(3));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : RegisterWorkerResponse();
  }

  // Starts Run and registers `workers` in order; returns the job's id as the
  // first was told it.
  uint64_t StartAndRegister(CoordinatorOptions options, const std::vector<int>& workers = {0}) {
    Start(std::move(options));
    const uint64_t id = Register(workers[0]).job_id();
    for (size_t i = 1; i < workers.size(); ++i) Register(workers[i]);
    return id;
  }

  // Worker 0 trains the job's `steps` steps under `options`; returns how long
  // the end took, from the last reports to Run's return.
  absl::Duration TrainAndTimeTheEnd(CoordinatorOptions options, int64_t steps) {
    const uint64_t id = StartAndRegister(std::move(options));
    Train(id, {0}, 0, steps);
    const absl::Time start = absl::Now();
    FinishAndJoin(id, {0});
    return absl::Now() - start;
  }

  // Worker w's (zero) gradients of `step` to every ps, as a worker pushes them.
  absl::Status Push(uint64_t job_id, int w, int64_t step) {
    std::vector<std::vector<float>> zeros;
    std::vector<const float*> buffers;
    for (const VariablePlacement& v : job_.placement().variable()) {
      zeros.emplace_back(NumElements(std::vector<int64_t>(v.shape().begin(), v.shape().end())));
    }
    for (const auto& z : zeros) buffers.push_back(z.data());
    for (int p = 0; p < job_.num_ps(); ++p) {
      PushHeader h;
      h.set_job_id(job_id);
      h.set_worker(w);
      h.set_step(step);
      absl::StatusOr<PushResponse> r =
          ps_->Push(p, h, SliceRefs(job_.placement(), p, buffers), absl::Now() + absl::Seconds(1));
      if (!r.ok()) return r.status();
    }
    return absl::OkStatus();
  }

  // Worker w's report of `step` (none if negative) with this loss and count.
  static ReportRequest MakeReport(uint64_t job_id, int w, int64_t step, double loss = 1.0,
                                  int64_t examples = kBatch) {
    ReportRequest r;
    r.set_job_id(job_id);
    r.set_worker(w);
    if (step >= 0) {
      StepMetrics* m = r.add_metrics();
      m->set_step(step);
      m->set_loss(loss);
      m->set_examples(examples);
    }
    return r;
  }
  absl::StatusOr<ReportResponse> Send(const ReportRequest& r) {
    return coordinator_->Report(r, absl::Now() + absl::Seconds(1));
  }
  absl::StatusOr<ReportResponse> Report(uint64_t job_id, int w, int64_t step,
                                        bool finished = false) {
    ReportRequest r = MakeReport(job_id, w, step);
    r.set_finished(finished);
    return Send(r);
  }
  // Worker w reports `step` not finite (the job's default policy fails it,
  // once the ps confirm that w's gradients of the step never came), then
  // beats until the chief answers FAIL (or a second went by); whether it did.
  bool ReportNonFinite(uint64_t job_id, int w, int64_t step = 0) {
    ReportRequest r = MakeReport(job_id, w, step, std::nan(""));
    r.mutable_metrics(0)->set_nonfinite(true);
    absl::StatusOr<ReportResponse> answer = Send(r);
    const absl::Time give_up = absl::Now() + absl::Seconds(1);
    while (answer.ok() && answer->action() != ReportResponse::FAIL && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
      answer = Report(job_id, w, -1);
    }
    EXPECT_TRUE(answer.ok()) << answer.status();
    return answer.ok() && answer->action() == ReportResponse::FAIL;
  }

  // Every worker in `workers` trains steps [from, to) and reports them.
  void Train(uint64_t job_id, const std::vector<int>& workers, int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) {
      for (int w : workers) {
        ASSERT_TRUE(Push(job_id, w, s).ok());
        ASSERT_TRUE(Report(job_id, w, s).ok());
      }
    }
  }

  // Reports every worker finished until Run returns; the answers' actions.
  std::vector<ReportResponse::Action> FinishAll(uint64_t job_id, const std::vector<int>& workers) {
    std::vector<ReportResponse::Action> actions;
    for (int w : workers) {
      absl::StatusOr<ReportResponse> r = Report(job_id, w, -1, /*finished=*/true);
      EXPECT_TRUE(r.ok()) << r.status();
      actions.push_back(r.ok() ? r->action() : ReportResponse::CONTINUE);
    }
    // A finished report is held until the end; ask again until it comes.
    for (int i = 0; i < 40 && !returned_->HasBeenNotified(); ++i) {
      for (size_t k = 0; k < workers.size(); ++k) {
        if (actions[k] != ReportResponse::CONTINUE) continue;
        absl::StatusOr<ReportResponse> r = Report(job_id, workers[k], -1, true);
        if (r.ok()) actions[k] = r->action();
      }
    }
    return actions;
  }

  // Starts a job of one worker that checkpoints every 2 steps (with
  // `options`), trains its first 2 steps and waits for that checkpoint.
  // Returns the job id.
  uint64_t TrainToTheFirstCheckpoint(CoordinatorOptions options) {
    options.checkpoint_every_steps = 2;
    const uint64_t id = StartAndRegister(std::move(options));
    Train(id, {0}, 0, 2);
    EXPECT_TRUE(Eventually([&] { return fs::exists(dir_ + "/model/checkpoints/ckpt-2"); }));
    return id;
  }

  // Every worker reports finished; each is told EXIT and Run returns OK.
  void FinishAndJoin(uint64_t job_id, const std::vector<int>& workers) {
    for (ReportResponse::Action a : FinishAll(job_id, workers)) EXPECT_EQ(a, ReportResponse::EXIT);
    EXPECT_TRUE(Join().ok()) << result_;
  }

  PsState State(int p) {
    absl::StatusOr<PsState> st = ps_->GetState(p, absl::Now() + absl::Seconds(1));
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : PsState();
  }

  // Waits (briefly) for `pred`.
  template <typename Pred>
  bool Eventually(Pred pred, absl::Duration timeout = absl::Seconds(2)) {
    const absl::Time end = absl::Now() + timeout;
    while (absl::Now() < end) {
      if (pred()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return pred();
  }

  std::string dir_;
  JobConfig job_;
  std::unique_ptr<FakePs> ps_;
  std::unique_ptr<ThreadPool> pool_;
  metrics::Registry metrics_;  // for tests that give it to the coordinator: outlives it
  std::unique_ptr<Coordinator> coordinator_;
  std::thread run_;
  std::unique_ptr<absl::Notification> returned_;
  absl::Status result_;
};

TEST_F(CoordinatorTest, TrainsToTheEndWritesTheSavedModelAndReleasesEveryone) {
  MakeJob(2, 2, 4);
  const uint64_t id = StartAndRegister(Options());
  EXPECT_EQ(Register(1).job_id(), id);
  Train(id, {0, 1}, 0, 4);
  EXPECT_THAT(FinishAll(id, {0, 1}), ElementsAre(ReportResponse::EXIT, ReportResponse::EXIT));
  ASSERT_TRUE(Join().ok()) << result_;
  absl::StatusOr<model::LoadedModel> saved = model::ReadSavedModel(dir_ + "/model/saved_model");
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->global_step, 4);
  EXPECT_TRUE(ps_->shut_down(0));
  EXPECT_TRUE(ps_->shut_down(1));
}

// A job without ps: the one "ps" is worker 0's replica, which hears worker
// 0 alone (every worker pushes the all-reduced mean to its own replica as
// worker 0); the live set is never broadcast to it.
TEST_F(CoordinatorTest, AllReduceJobLoadsWorker0sReplicaForOnePusher) {
  MakeJob(2, /*num_ps=*/0, 4);
  ASSERT_EQ(job_.exchange(), JobConfig::ALL_REDUCE);
  const uint64_t id = StartAndRegister(Options());
  EXPECT_EQ(Register(1).job_id(), id);
  EXPECT_THAT(State(0).live_workers(), ElementsAre(0));
  Train(id, {0}, 0, 1);  // worker 0's push alone moves the replica
  EXPECT_EQ(State(0).version(), 1);
  for (int64_t s = 1; s < 4; ++s) {
    ASSERT_TRUE(Push(id, 0, s).ok());
    for (int w : {0, 1}) ASSERT_TRUE(Report(id, w, s).ok());
  }
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kSetLiveWorkers), 0);
  FinishAndJoin(id, {0, 1});
}

// Every worker is in every step of an all-reduce: one that registers again
// once all had (it restarted) or goes silent breaks the group, and the
// chief's duties end with UNAVAILABLE (a retryable exit) after a checkpoint.
TEST_F(CoordinatorTest, AllReduceGroupBrokenByARestartedWorkerEndsRetryably) {
  MakeJob(2, /*num_ps=*/0, 10);
  const uint64_t id = StartAndRegister(Options());
  Register(0);  // before the group formed: a repeat changes nothing
  Register(1);
  ASSERT_TRUE(Push(id, 0, 0).ok());
  for (int w : {0, 1}) ASSERT_TRUE(Report(id, w, 0).ok());
  absl::StatusOr<RegisterWorkerResponse> again =
      coordinator_->RegisterWorker(1, absl::Now() + absl::Seconds(1));
  EXPECT_TRUE(absl::IsUnavailable(again.status())) << again.status();
  const absl::Status s = Join();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("worker 1 registered again"), std::string::npos) << s;
  EXPECT_TRUE(fs::exists(dir_ + "/model/checkpoints/ckpt-1"));
}

// A worker is silent for the chief only once it has reported: between its
// registration and its first report it forms its group (which its peers'
// ring bounds), however long that takes.
TEST_F(CoordinatorTest, AllReduceGroupBrokenByASilentWorkerEndsRetryably) {
  MakeJob(2, /*num_ps=*/0, 10);
  const uint64_t id = StartAndRegister(Options(), {0, 1});
  // Worker 1 forms its group for over 3 worker timeouts: nothing breaks.
  const absl::Time forming_until = absl::Now() + 3 * ShortTimeouts().worker;
  while (absl::Now() < forming_until) {
    ASSERT_TRUE(Report(id, 0, -1).ok());
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_FALSE(returned_->HasBeenNotified());
  // Then it reports once and falls silent.
  ASSERT_TRUE(Report(id, 1, -1).ok());
  ASSERT_TRUE(Eventually([&] {
    Report(id, 0, -1).IgnoreError();
    return returned_->HasBeenNotified();
  }));
  const absl::Status s = Join();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("worker 1 sent no heartbeat"), std::string::npos) << s;
}

TEST_F(CoordinatorTest, WorkerThatStopsReportingIsDroppedAndTheStepsGoOn) {
  MakeJob(2, 2, 3);
  const uint64_t id = StartAndRegister(Options(), {0, 1});
  // Worker 1 never reports; worker 0 does, more often than the timeout.
  ASSERT_TRUE(Eventually([&] {
    EXPECT_TRUE(Report(id, 0, -1).ok());
    return State(0).live_workers_size() == 1 && State(1).live_workers_size() == 1;
  }));
  EXPECT_THAT(State(0).live_workers(), ElementsAre(0));
  // The steps now wait for worker 0 alone.
  Train(id, {0}, 0, 3);
  EXPECT_EQ(State(0).version(), 3);
  FinishAndJoin(id, {0});
}

TEST_F(CoordinatorTest, PsThatComesBackEmptyIsReloadedFromTheNewestCheckpoint) {
  MakeJob(1, 2, 10);
  const uint64_t id = TrainToTheFirstCheckpoint(Options());
  ps_->Restart(1);  // died and came back holding nothing
  // Every ps is reloaded at the checkpoint's step under a new job id; the
  // old id's reports are told to register again.
  ASSERT_TRUE(Eventually([&] {
    PsState a = State(0), b = State(1);
    return b.holds_job() && a.job_id() == b.job_id() && a.job_id() != id;
  }));
  EXPECT_EQ(State(0).version(), 2);
  EXPECT_EQ(State(1).version(), 2);
  absl::StatusOr<ReportResponse> old = Report(id, 0, -1);
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->action(), ReportResponse::REGISTER);
  RegisterWorkerResponse again = Register(0);
  EXPECT_NE(again.job_id(), id);
  Train(again.job_id(), {0}, 2, 10);
  FinishAndJoin(again.job_id(), {0});
}

// Readiness (on_ready) follows the ps: true once loaded, false while they are
// reloaded, true again; the metrics show the global step and checkpoints.
TEST_F(CoordinatorTest, ReadinessAndMetricsFollowLoadsAndReloads) {
  MakeJob(1, 2, 10);
  absl::Mutex mu;
  std::vector<bool> ready;
  CoordinatorOptions options = Options();
  options.metrics = &metrics_;
  options.on_ready = [&](bool r) {
    absl::MutexLock lock(&mu);
    ready.push_back(r);
  };
  auto ready_calls = [&] {
    absl::MutexLock lock(&mu);
    return ready;
  };
  const uint64_t id = TrainToTheFirstCheckpoint(options);
  EXPECT_EQ(ready_calls(), std::vector<bool>{true});
  auto gauge = [this](const char* name) { return metrics_.GetGauge(name, "")->value(); };
  EXPECT_TRUE(Eventually([&] { return gauge("psflow_global_step") == 2; }));
  // Recorded just after the checkpoint's rename.
  EXPECT_TRUE(Eventually([&] { return gauge("psflow_checkpoint_step") == 2; }));
  // The mlp's weights and biases (sgd: no slots).
  EXPECT_EQ(gauge("psflow_checkpoint_bytes"), 4.0 * (784 * 256 + 256 + 256 * 256 + 256 + 2570));
  EXPECT_EQ(metrics_.GetHistogram("psflow_checkpoint_seconds", "", {})->snapshot().count, 1u);
  EXPECT_EQ(metrics_.GetCounter("psflow_examples_total", "")->value(), 2 * kBatch);

  ps_->Restart(1);  // died and came back holding nothing: reloaded
  ASSERT_TRUE(Eventually([&] { return ready_calls().size() == 3; })) << ready_calls().size();
  EXPECT_EQ(ready_calls(), (std::vector<bool>{true, false, true}));
  RegisterWorkerResponse again = Register(0);
  EXPECT_NE(again.job_id(), id);
  Train(again.job_id(), {0}, 2, 10);
  EXPECT_TRUE(Eventually([&] { return gauge("psflow_global_step") == 10; }));
  FinishAndJoin(again.job_id(), {0});
}

TEST_F(CoordinatorTest, RestartedChiefAdoptsTheRunningJob) {
  MakeJob(1, 2, 6);
  const uint64_t id = StartAndRegister(Options());
  Train(id, {0}, 0, 3);
  // The chief goes away (SIGTERM: a checkpoint, ps and workers left running).
  coordinator_->Stop(SIGTERM);
  absl::Status stopped = Join();
  EXPECT_EQ(SignalOf(stopped), SIGTERM) << stopped;
  EXPECT_EQ(ExitCodeFor(stopped), 128 + SIGTERM);
  const int64_t inits = ps_->calls(0, FakePs::Method::kInit);
  // The next chief takes the job over as it is: no Init, same id, same step.
  Start(Options());
  RegisterWorkerResponse r = Register(0);
  EXPECT_EQ(r.job_id(), id);
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kInit), inits);
  Train(id, {0}, 3, 6);
  FinishAndJoin(id, {0});
}

TEST_F(CoordinatorTest, CheckpointWhoseStepAPsPassedIsTakenAgain) {
  MakeJob(1, 2, 4);
  CoordinatorOptions o = Options();
  // The first snapshot asked of ps 1 finds it past the chosen step.
  std::atomic<bool> injected{false};
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (p == 1 && m == FakePs::Method::kSnapshot && !injected.exchange(true)) {
      ps_->FailNext(1, absl::StatusCode::kFailedPrecondition);
    }
  });
  const uint64_t id = TrainToTheFirstCheckpoint(o);
  EXPECT_TRUE(injected);
  EXPECT_GE(ps_->calls(1, FakePs::Method::kSnapshot), 2);
  Train(id, {0}, 2, 4);
  FinishAndJoin(id, {0});
}

// A synchronous job that moves on between the chief's look and its request
// twice in a row: the third try asks for two steps on and waits for them.
TEST_F(CoordinatorTest, CheckpointPassedTwiceAsksForALaterStep) {
  MakeJob(1, 2, 8);
  CoordinatorOptions o = Options();
  o.checkpoint_every_steps = 2;
  std::atomic<int> injected{0};
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (p == 1 && m == FakePs::Method::kSnapshot && injected.load() < 2) {
      ++injected;
      ps_->FailNext(1, absl::StatusCode::kFailedPrecondition);
    }
  });
  const uint64_t id = StartAndRegister(o);
  Train(id, {0}, 0, 2);
  // The third snapshot of ps 1 waits for step 4: no checkpoint of step 2.
  ASSERT_TRUE(Eventually([&] { return ps_->calls(1, FakePs::Method::kSnapshot) >= 3; }));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(fs::exists(dir_ + "/model/checkpoints/ckpt-2"));
  EXPECT_FALSE(fs::exists(dir_ + "/model/checkpoints/ckpt-4"));
  Train(id, {0}, 2, 4);
  EXPECT_TRUE(Eventually([&] { return fs::exists(dir_ + "/model/checkpoints/ckpt-4"); }));
  EXPECT_EQ(injected, 2);
  Train(id, {0}, 4, 8);
  FinishAndJoin(id, {0});
}

TEST_F(CoordinatorTest, CorruptNewestCheckpointIsSkippedForTheOneBefore) {
  MakeJob(1, 1, 8);
  uint64_t id = TrainToTheFirstCheckpoint(Options());
  Train(id, {0}, 2, 4);
  ASSERT_TRUE(Eventually([&] { return fs::exists(dir_ + "/model/checkpoints/ckpt-4"); }));
  coordinator_->Stop(SIGTERM);
  ASSERT_EQ(SignalOf(Join()), SIGTERM);
  // Flip a byte of the newest checkpoint's data; the ps lose their state.
  const std::string newest = dir_ + "/model/checkpoints/ckpt-4/data";
  ASSERT_TRUE(fs::exists(newest));
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x5a');
  }
  ps_->Restart(0);
  Start(Options());
  id = Register(0).job_id();
  EXPECT_EQ(State(0).version(), 2);  // restored from ckpt-2
  Train(id, {0}, 2, 8);
  FinishAndJoin(id, {0});
}

TEST_F(CoordinatorTest, SigtermedChiefGivesUpItsCheckpointInTime) {
  MakeJob(1, 2, 100);
  CoordinatorOptions o = Options();
  o.timeouts.stop_checkpoint = absl::Seconds(1);
  const uint64_t id = StartAndRegister(o);
  Train(id, {0}, 0, 2);
  // The ps are stopping too: every snapshot is slow and finds its step
  // passed, which would otherwise be tried checkpoint_attempts times.
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m != FakePs::Method::kSnapshot) return;
    absl::SleepFor(absl::Milliseconds(700));
    ps_->FailNext(p, absl::StatusCode::kFailedPrecondition);
  });
  const absl::Time stopped = absl::Now();
  coordinator_->Stop(SIGTERM);
  absl::Status s = Join();
  EXPECT_EQ(SignalOf(s), SIGTERM) << s;
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(3));
  // Given up or not, the ps waiting for that checkpoint hear that it is over.
  for (int p = 0; p < 2; ++p) EXPECT_EQ(ps_->calls(p, FakePs::Method::kCheckpointTaken), 1);
}

// A chief stopped by a signal tells each ps once its stop checkpoint is
// written (ps stopping with it wait for that), and leaves them running.
TEST_F(CoordinatorTest, SigtermedChiefTellsThePsItsCheckpointIsTaken) {
  MakeJob(1, 2, 100);
  const uint64_t id = StartAndRegister(Options());
  Train(id, {0}, 0, 2);
  absl::Mutex mu;
  std::vector<std::string> calls;  // "snapshot" or "taken", in order
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m != FakePs::Method::kSnapshot && m != FakePs::Method::kCheckpointTaken) return;
    absl::MutexLock lock(&mu);
    calls.push_back(m == FakePs::Method::kSnapshot ? "snapshot" : "taken");
  });
  coordinator_->Stop(SIGTERM);
  absl::Status s = Join();
  EXPECT_EQ(SignalOf(s), SIGTERM) << s;
  EXPECT_TRUE(fs::exists(dir_ + "/model/checkpoints/checkpoint"));
  absl::MutexLock lock(&mu);
  EXPECT_THAT(calls, ElementsAre("snapshot", "snapshot", "taken", "taken"));
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(ps_->calls(p, FakePs::Method::kCheckpointTaken), 1);
    EXPECT_FALSE(ps_->shut_down(p));  // left running for the next chief
  }
}

// A ps that says it is stopping (told so by a signal) gets a checkpoint of
// the current step at once, and is told, once; the other ps is not.
TEST_F(CoordinatorTest, AStoppingPsIsCheckpointedAndTold) {
  MakeJob(1, 2, 100);
  const uint64_t id = StartAndRegister(Options());  // no checkpoints by steps or time
  Train(id, {0}, 0, 3);
  ps_->SetStopping(1, true);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ps_->calls(1, FakePs::Method::kCheckpointTaken) == 0 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(ps_->calls(1, FakePs::Method::kCheckpointTaken), 1);
  absl::StatusOr<Checkpoint> ckpt = ReadNewestCheckpoint(dir_ + "/model");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->manifest.step(), 3);
  // Rounds later, still stopping: neither taken nor told again.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(ps_->calls(1, FakePs::Method::kCheckpointTaken), 1);
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kCheckpointTaken), 0);
  coordinator_->Stop(SIGTERM);
  EXPECT_EQ(SignalOf(Join()), SIGTERM);
}

// A ps found stopping in the round in which the chief is told to stop too
// (a whole cluster stopping at once) is not told on its own, which would
// make it exit before the stop's checkpoint: every ps is told once, after
// that checkpoint.
TEST_F(CoordinatorTest, AStoppingPsOfAStoppingChiefIsToldOnceAfterTheStopCheckpoint) {
  MakeJob(1, 2, 100);
  const uint64_t id = StartAndRegister(Options());
  Train(id, {0}, 0, 3);
  std::atomic<bool> armed{true};
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m != FakePs::Method::kGetState || p != 1 || !armed.exchange(false)) return;
    ps_->SetStopping(1, true);
    coordinator_->Stop(SIGTERM);
  });
  EXPECT_EQ(SignalOf(Join()), SIGTERM);
  EXPECT_FALSE(armed.load()) << "the supervisor never looked at ps 1";
  EXPECT_EQ(ps_->calls(1, FakePs::Method::kCheckpointTaken), 1);
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kCheckpointTaken), 1);
  absl::StatusOr<Checkpoint> ckpt = ReadNewestCheckpoint(dir_ + "/model");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->manifest.step(), 3);
}

TEST_F(CoordinatorTest, SigtermDuringACheckpointEndsWithTheSignal) {
  MakeJob(1, 2, 100);
  CoordinatorOptions o = Options();
  o.checkpoint_every_steps = 1;
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m == FakePs::Method::kSnapshot && p == 0) coordinator_->Stop(SIGTERM);
  });
  const uint64_t id = StartAndRegister(o);
  Train(id, {0}, 0, 1);
  absl::Status s = Join();
  EXPECT_EQ(SignalOf(s), SIGTERM) << s;
  // The checkpoint under way, or the one taken on the way out, is written.
  EXPECT_TRUE(fs::exists(dir_ + "/model/checkpoints/checkpoint"));
  EXPECT_FALSE(fs::exists(dir_ + "/model/saved_model/" + std::string(model::kSavedModelFile)));
  EXPECT_FALSE(ps_->shut_down(0));  // left running for the next chief
}

// A ps that goes down as the chief is told to stop (the whole cluster
// stopping) is not reloaded: the chief ends with the signal, and the ps that
// is still up keeps the job it had.
TEST_F(CoordinatorTest, APsDownAtASigtermIsNotReloaded) {
  MakeJob(1, 2, 100);
  const uint64_t id = StartAndRegister(Options());
  Train(id, {0}, 0, 2);
  std::atomic<bool> armed{true};
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m != FakePs::Method::kGetState || p != 1 || !armed.exchange(false)) return;
    coordinator_->Stop(SIGTERM);
    ps_->SetDown(1, true);
  });
  absl::Status s = Join();
  EXPECT_EQ(SignalOf(s), SIGTERM) << s;
  EXPECT_FALSE(armed.load()) << "the supervisor never looked at ps 1";
  EXPECT_EQ(State(0).job_id(), id) << "ps 0 was reloaded under a new job";
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kInit), 1);
}

TEST_F(CoordinatorTest, NonFiniteStepFailsTheJobWithoutASavedModel) {
  MakeJob(2, 1, 10);
  const uint64_t id = StartAndRegister(Options(), {0, 1});
  ASSERT_TRUE(ReportNonFinite(id, 1));
  absl::StatusOr<ReportResponse> other = Report(id, 0, -1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->action(), ReportResponse::FAIL);
  absl::Status s = Join();
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_EQ(ExitCodeFor(s), 1);
  // Not even an empty directory.
  EXPECT_FALSE(fs::exists(dir_ + "/model/saved_model"));
  EXPECT_TRUE(ps_->shut_down(0));
}

// A report that a step is not finite is anyone's to send (the job id is
// public): it fails the job only once the ps confirm that the worker's
// gradients of the step never came. One of a step the worker pushed, or of
// a step the ps are not at, is ignored and the job trains on.
TEST_F(CoordinatorTest, NonFiniteReportsThePsContradictAreIgnored) {
  MakeJob(2, 2, 4);
  CoordinatorOptions o = Options();
  o.timeouts.worker = absl::Seconds(30);  // worker 0 waits out worker 1's reports
  const uint64_t id = StartAndRegister(o, {0, 1});
  ASSERT_TRUE(Push(id, 1, 0).ok());
  EXPECT_FALSE(ReportNonFinite(id, 1, 0));  // pushed whole: every ps has it
  EXPECT_FALSE(ReportNonFinite(id, 0, 3));  // far ahead of the ps
  ASSERT_TRUE(Push(id, 0, 0).ok());
  ASSERT_TRUE(Report(id, 0, 0).ok());
  ASSERT_TRUE(Report(id, 1, 0).ok());
  Train(id, {0, 1}, 1, 4);
  FinishAndJoin(id, {0, 1});
  EXPECT_TRUE(fs::exists(dir_ + "/model/saved_model"));
}

// Under --on_nonfinite=fail a real worker's non-finite step is confirmed
// though it pushed to some ps (pushing during the backward pass, its finite
// lanes go): one ps still lacks its gradients of the step.
TEST_F(CoordinatorTest, NonFiniteStepPushedToSomePsIsConfirmedByTheOthers) {
  MakeJob(1, 2, 4);
  const uint64_t id = StartAndRegister(Options(), {0});
  PushHeader h;
  h.set_job_id(id);
  h.set_worker(0);
  h.set_step(0);
  std::vector<std::vector<float>> zeros;
  std::vector<const float*> buffers;
  for (const VariablePlacement& v : job_.placement().variable()) {
    zeros.emplace_back(NumElements(std::vector<int64_t>(v.shape().begin(), v.shape().end())));
  }
  for (const auto& z : zeros) buffers.push_back(z.data());
  ASSERT_TRUE(
      ps_->Push(0, h, SliceRefs(job_.placement(), 0, buffers), absl::Now() + absl::Seconds(1))
          .ok());
  EXPECT_TRUE(ReportNonFinite(id, 0, 0));
  absl::Status s = Join();
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              ::testing::HasSubstr("worker 0 computed a non-finite loss or gradients at step 0"));
}

// Metrics of a step the ps do not have the worker's gradients of (forged
// for the last step, say), or a second report of a step, never reach the
// progress log: its counts and final figures are the workers' own.
TEST_F(CoordinatorTest, MetricsOfStepsThePsLackOrReportedTwiceAreRefused) {
  MakeJob(1, 1, 4);
  CoordinatorOptions o = Options();
  o.metrics = &metrics_;
  const uint64_t id = StartAndRegister(o, {0});
  auto examples = [this] { return metrics_.GetCounter("psflow_examples_total", "")->value(); };
  ASSERT_TRUE(Send(MakeReport(id, 0, 3, 0.01)).ok());  // the last step, forged
  EXPECT_EQ(examples(), 0);
  Train(id, {0}, 0, 2);
  EXPECT_EQ(examples(), 2 * kBatch);
  ASSERT_TRUE(Send(MakeReport(id, 0, 1, 0.01)).ok());  // step 1 again
  EXPECT_EQ(examples(), 2 * kBatch);
  Train(id, {0}, 2, 4);
  EXPECT_EQ(examples(), 4 * kBatch);
  FinishAndJoin(id, {0});
}

// A saved model's directory that could not be made fails the job at its
// start, before any ps is loaded.
TEST_F(CoordinatorTest, ASavedModelDirThatCannotBeMadeFailsAtTheStart) {
  MakeJob(1, 1, 10);
  std::ofstream(dir_ + "/file") << "not a directory";
  CoordinatorOptions o = Options();
  o.saved_model_dir = dir_ + "/file/saved_model";
  Start(std::move(o));
  absl::Status s = Join();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr(dir_ + "/file"));
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kInit), 0);
}

// The cluster stopping as the chief of a failed job sends the ps their exit
// orders (psflow-launch stops it once a worker exits for the fail order):
// the order to a ps that went away is given up at the stop, so that the
// chief exits with the job's failure within its grace instead of being
// killed first.
TEST_F(CoordinatorTest, AStopDuringTheExitOrdersEndsThemAndTheJobKeepsItsFailure) {
  MakeJob(2, 2, 10);
  CoordinatorOptions o = Options();
  o.timeouts.control_call = absl::Seconds(20);
  const uint64_t id = StartAndRegister(o, {0, 1});
  std::atomic<bool> armed{true};
  ps_->OnCall([&](int p, FakePs::Method m) {
    if (m != FakePs::Method::kShutdown || p != 1 || !armed.exchange(false)) return;
    ps_->SetGone(1, true);
    coordinator_->Stop(SIGTERM);
  });
  ASSERT_TRUE(ReportNonFinite(id, 1));
  absl::StatusOr<ReportResponse> other = Report(id, 0, -1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->action(), ReportResponse::FAIL);
  const absl::Time released = absl::Now();
  absl::Status s = Join(absl::Seconds(30));
  EXPECT_LT(absl::Now() - released, absl::Seconds(3));
  EXPECT_FALSE(armed.load()) << "no exit order reached ps 1";
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_EQ(ExitCodeFor(s), 1);
  EXPECT_FALSE(ps_->shut_down(1));
}

// A chief told to stop before it sends a failed job's ps their exit orders
// (here while it waits for a worker to collect its own) still sends them,
// but waits for a ps that is gone no longer than Timeouts::stop_release:
// the ps still up exits, and so does the chief, with the job's failure,
// within its grace.
TEST_F(CoordinatorTest, AFailedJobStoppedBeforeItsExitOrdersWaitsBrieflyForAPsThatIsGone) {
  MakeJob(2, 2, 10);
  CoordinatorOptions o = Options();
  o.timeouts.control_call = absl::Seconds(20);
  o.timeouts.release_wait = absl::Seconds(20);
  o.timeouts.stop_release = absl::Milliseconds(300);
  const uint64_t id = StartAndRegister(o, {0, 1});
  ASSERT_TRUE(ReportNonFinite(id, 1));
  ps_->SetGone(0, true);
  // Worker 0 never collects its order: the release waits for it until the stop.
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time stopped = absl::Now();
  coordinator_->Stop(SIGTERM);
  absl::Status s = Join(absl::Seconds(30));
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(3));
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_EQ(ps_->calls(0, FakePs::Method::kShutdown), 1);
  EXPECT_FALSE(ps_->shut_down(0));
  EXPECT_TRUE(ps_->shut_down(1));
}

TEST_F(CoordinatorTest, NonFiniteWeightsAreNeverCheckpointed) {
  MakeJob(1, 2, 10);
  // A job restored from weights with a NaN in them (as a diverged job's ps
  // would hold): the next checkpoint fails the job instead of keeping them.
  Checkpoint poisoned = EmptyCheckpoint(job_, 0, {});
  poisoned.tensors.back().values[3] = std::nan("");
  ASSERT_TRUE(WriteCheckpoint(dir_ + "/model", poisoned, 5).ok());
  CoordinatorOptions o = Options();
  o.checkpoint_every_steps = 1;
  const uint64_t id = StartAndRegister(o);
  Train(id, {0}, 0, 1);
  absl::Status s = Join();
  EXPECT_TRUE(absl::IsOutOfRange(s)) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("are not finite"));
  EXPECT_FALSE(fs::exists(dir_ + "/model/checkpoints/ckpt-1"));
  EXPECT_FALSE(fs::exists(dir_ + "/model/saved_model/" + std::string(model::kSavedModelFile)));
}

TEST_F(CoordinatorTest, ALiveSetThatWentWrongOnAPsIsRepaired) {
  MakeJob(2, 2, 4);
  const uint64_t id = StartAndRegister(Options(), {0, 1});
  // Someone tells ps 1 that only worker 0 counts. (A set naming a worker
  // outside the job, such as 7, the ps refuses outright.)
  ASSERT_TRUE(ps_->SetLiveWorkers(1, id, {0}, 0, absl::Now() + absl::Seconds(1)).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      ps_->SetLiveWorkers(0, id, {0, 1, 7}, 0, absl::Now() + absl::Seconds(1))));
  // ps 0 keeps both; ps 1 takes worker 1 back from the next step.
  ASSERT_TRUE(Eventually([&] {
    // Heartbeats only: what they lead to is checked in the ps's state.
    static_cast<void>(Report(id, 0, -1));
    static_cast<void>(Report(id, 1, -1));
    return State(0).live_workers_size() == 2 && State(1).joining_workers_size() == 1;
  }));
  EXPECT_THAT(State(0).live_workers(), ElementsAre(0, 1));
  EXPECT_THAT(State(1).live_workers(), ElementsAre(0));
  EXPECT_THAT(State(1).joining_workers(), ElementsAre(1));
  Train(id, {0, 1}, 0, 4);
  EXPECT_THAT(State(1).live_workers(), ElementsAre(0, 1));
  FinishAndJoin(id, {0, 1});
}

TEST_F(CoordinatorTest, AFinishedReportBeforeTheLastStepEndsNothing) {
  MakeJob(1, 1, 4);
  const uint64_t id = StartAndRegister(Options());
  Train(id, {0}, 0, 2);
  absl::StatusOr<ReportResponse> r = Report(id, 0, -1, /*finished=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportResponse::CONTINUE);
  EXPECT_FALSE(returned_->WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  EXPECT_FALSE(ps_->shut_down(0));
  Train(id, {0}, 2, 4);
  FinishAndJoin(id, {0});
}

TEST_F(CoordinatorTest, ImpossibleReportsAreRefused) {
  MakeJob(1, 1, 10);
  const uint64_t id = StartAndRegister(Options());
  ReportRequest r = MakeReport(id, 0, 0, 0.5, int64_t{1} << 62);
  EXPECT_TRUE(absl::IsInvalidArgument(Send(r).status()));
  r.set_worker(7);
  EXPECT_TRUE(absl::IsInvalidArgument(Send(r).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(coordinator_->RegisterWorker(3, absl::Now()).status()));
}

// --on_nonfinite=skip_step: a skipped step (reported by each worker) counts
// once; the job fails only past max_skipped_steps.
TEST_F(CoordinatorTest, SkippedStepsAreCountedOnceAndTooManyFailTheJob) {
  MakeJob(2, 1, 100);
  job_.set_on_nonfinite(JobConfig::SKIP_STEP);
  job_.set_max_skipped_steps(2);
  const uint64_t id = StartAndRegister(Options(), {0, 1});
  auto skip = [&](int w, int64_t step) {
    ReportRequest r = MakeReport(id, w, step, 0.0);
    r.mutable_metrics(0)->set_nonfinite(true);
    absl::StatusOr<ReportResponse> answer = Send(r);
    EXPECT_TRUE(answer.ok()) << answer.status();
    return answer.ok() ? answer->action() : ReportResponse::CONTINUE;
  };
  for (int64_t step : {3, 4}) {
    EXPECT_EQ(skip(0, step), ReportResponse::CONTINUE);
    EXPECT_EQ(skip(1, step), ReportResponse::CONTINUE);
  }
  EXPECT_FALSE(returned_->HasBeenNotified());
  EXPECT_EQ(skip(1, 5), ReportResponse::FAIL);
  const absl::Status status = Join();
  EXPECT_TRUE(absl::IsOutOfRange(status)) << status;
  EXPECT_THAT(std::string(status.message()),
              ::testing::HasSubstr("more than 2 steps were skipped"));
  EXPECT_FALSE(fs::exists(dir_ + "/model/saved_model/model.pb"));
}

// ---------------------------------------------------------------------------
// Evaluators

// A report of evaluator 0, whose registration holds `lease`.
ReportEvalRequest EvalReport(uint64_t lease, uint64_t job_id, int64_t step, double loss = 0.5,
                             int64_t correct = 90, int64_t examples = 100) {
  ReportEvalRequest r;
  r.set_job_id(job_id);
  r.set_evaluator(0);
  r.set_lease(lease);
  if (step >= 0) {
    EvalResult* e = r.mutable_result();
    e->set_step(step);
    e->set_loss(loss);
    e->set_correct(correct);
    e->set_examples(examples);
    e->set_duration_us(1000);
  }
  return r;
}

// With an evaluator in the cluster the ps keep the final weights (no exit
// order) until its evaluation of the final model comes; then the job ends.
// Each result logged sets the chief's eval gauges.
TEST_F(CoordinatorTest, TheEndWaitsForTheEvaluationOfTheFinalModel) {
  MakeJob(1, 1, 4);
  CoordinatorOptions o = Options();
  o.num_evaluators = 1;
  o.eval_every_steps = 2;
  o.metrics = &metrics_;
  Start(o);
  auto gauge = [this](const char* name) { return metrics_.GetGauge(name, "")->value(); };
  EXPECT_EQ(gauge("psflow_eval_step"), -1);
  const uint64_t id = Register(0).job_id();
  absl::StatusOr<RegisterEvaluatorResponse> e = coordinator_->RegisterEvaluator(0);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->job_id(), id);
  EXPECT_EQ(e->eval_every_steps(), 2);
  EXPECT_EQ(e->job().train_steps(), 4);
  EXPECT_EQ(e->ps_address_size(), 1);
  const uint64_t lease = e->lease();
  Train(id, {0}, 0, 4);
  ASSERT_TRUE(Report(id, 0, -1, /*finished=*/true).ok());
  EXPECT_FALSE(returned_->WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  EXPECT_FALSE(ps_->shut_down(0));
  // A result of an earlier step changes nothing; the final one ends the wait.
  absl::StatusOr<ReportEvalResponse> r = coordinator_->ReportEval(EvalReport(lease, id, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::CONTINUE);
  EXPECT_FALSE(ps_->shut_down(0));
  EXPECT_EQ(gauge("psflow_eval_step"), 2);
  EXPECT_EQ(gauge("psflow_eval_loss"), 0.5);
  EXPECT_EQ(gauge("psflow_eval_accuracy"), 0.9);
  r = coordinator_->ReportEval(EvalReport(lease, id, 4, 0.25, 95, 100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::EXIT);
  EXPECT_EQ(gauge("psflow_eval_step"), 4);
  EXPECT_EQ(gauge("psflow_eval_loss"), 0.25);
  EXPECT_EQ(gauge("psflow_eval_accuracy"), 0.95);
  FinishAndJoin(id, {0});
  EXPECT_TRUE(ps_->shut_down(0));
  // Late evaluators are told the job is over.
  e = coordinator_->RegisterEvaluator(0);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->done());
}

// An evaluator listed but never heard from (or dead) holds the end of the job
// for Timeouts::evaluator at most.
TEST_F(CoordinatorTest, TheEndGoesOnWithoutAnEvaluatorNotHeardFrom) {
  MakeJob(1, 1, 3);
  CoordinatorOptions o = Options();
  o.num_evaluators = 1;
  o.timeouts.evaluator = absl::Milliseconds(300);
  EXPECT_LT(TrainAndTimeTheEnd(o, 3), absl::Seconds(3));
  EXPECT_TRUE(ps_->shut_down(0));
}

// A listed evaluator that never called the chief (most likely never run)
// holds the end only for Timeouts::unregistered_evaluator, not for
// Timeouts::evaluator as a silent one that registered does.
TEST_F(CoordinatorTest, TheEndWaitsOnlyBrieflyForAnEvaluatorThatNeverRegistered) {
  MakeJob(1, 1, 3);
  CoordinatorOptions o = Options();
  o.num_evaluators = 1;
  o.timeouts.evaluator = absl::Seconds(30);  // the default
  o.timeouts.unregistered_evaluator = absl::Milliseconds(300);
  EXPECT_LT(TrainAndTimeTheEnd(o, 3), absl::Seconds(3));  // not final_eval's 5 s
  EXPECT_TRUE(ps_->shut_down(0));
}

// One that registered and went silent is still waited for
// Timeouts::evaluator, however short the grace of one never heard from.
TEST_F(CoordinatorTest, TheEndWaitsForARegisteredEvaluatorUntilItIsSilent) {
  MakeJob(1, 1, 3);
  CoordinatorOptions o = Options();
  o.num_evaluators = 1;
  o.timeouts.evaluator = absl::Seconds(1);
  o.timeouts.unregistered_evaluator = absl::Milliseconds(100);
  const uint64_t id = StartAndRegister(o);
  ASSERT_TRUE(coordinator_->RegisterEvaluator(0).ok());
  Train(id, {0}, 0, 3);
  const absl::Time start = absl::Now();
  FinishAndJoin(id, {0});
  const absl::Duration end = absl::Now() - start;
  EXPECT_GE(end, absl::Milliseconds(900));
  EXPECT_LT(end, absl::Seconds(4));
}

// Without an evaluator in the cluster the end waits for none.
TEST_F(CoordinatorTest, NoEvaluatorNoWait) {
  MakeJob(1, 1, 2);
  CoordinatorOptions o = Options();
  o.timeouts.evaluator = absl::Seconds(30);
  EXPECT_LT(TrainAndTimeTheEnd(o, 2), absl::Seconds(3));
}

TEST_F(CoordinatorTest, EvaluatorCallsAreCheckedAndOtherJobsResultsDropped) {
  MakeJob(1, 1, 10);
  CoordinatorOptions o = Options();
  o.num_evaluators = 1;
  const uint64_t id = StartAndRegister(o);
  EXPECT_TRUE(absl::IsInvalidArgument(coordinator_->RegisterEvaluator(1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(coordinator_->RegisterEvaluator(-1).status()));
  absl::StatusOr<RegisterEvaluatorResponse> registered = coordinator_->RegisterEvaluator(0);
  ASSERT_TRUE(registered.ok()) << registered.status();
  const uint64_t lease = registered->lease();
  ReportEvalRequest bad_index = EvalReport(lease, id, 2);
  bad_index.set_evaluator(3);
  EXPECT_TRUE(absl::IsInvalidArgument(coordinator_->ReportEval(bad_index).status()));
  for (const ReportEvalRequest& impossible :
       {EvalReport(lease, id, 11), EvalReport(lease, id, 2, NAN), EvalReport(lease, id, 2, -1.0),
        EvalReport(lease, id, 2, 0.5, 101, 100), EvalReport(lease, id, 2, 0.5, 0, 0),
        EvalReport(lease, id, 2, 0.5, -1, 100)}) {
    EXPECT_TRUE(absl::IsInvalidArgument(coordinator_->ReportEval(impossible).status()))
        << impossible.DebugString();
  }
  // A heartbeat goes on; a result of another job (reloaded since) is dropped
  // with REGISTER.
  absl::StatusOr<ReportEvalResponse> r = coordinator_->ReportEval(EvalReport(lease, id, -1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::CONTINUE);
  r = coordinator_->ReportEval(EvalReport(lease, id + 1, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->action(), ReportEvalResponse::REGISTER);
}

}  // namespace
}  // namespace psflow::chief
