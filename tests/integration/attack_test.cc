// A training cluster on loopback attacked from outside by a client built
// from psflow's own protos, as anyone who can reach its ports could:
//   - a push of NaN gradients as live worker 0, and one of 1e30s (finite,
//     but over --max_gradient_abs);
//   - a skip push (no data: "my step was not finite") as worker 0, in a job
//     that fails on non-finite steps, whose workers send none;
//   - reports with impossible values (a NaN loss, 2^62 examples), and
//     "finished" for every worker long before the last step;
//   - reports that a step was not finite, of a step the worker pushed or
//     one far ahead, and plausible metrics of the last step for every
//     worker;
//   - an Init header that declares a gigabyte and sends nothing, one with no
//     job id, and a whole Init of another job (replacing the ps's);
//   - SetLiveWorkers [7], and Shutdown of a ps;
//   - 600 pulls of a version that does not come, held open;
//   - floods from 20 connections: 5,000 Push streams that never send a
//     header, and 2,000 pulls (with the job id) of a version that does not
//     come, held while the job trains.
// Without TLS or a token (plaintext) the numeric and resource guards hold:
// each is refused or harmless (Shutdown and SetLiveWorkers need TLS: they
// are left out there). With mutual TLS and the job token a stranger is
// refused at the handshake, a certificate without the token is
// UNAUTHENTICATED, and even a worker's credentials cannot call the ps's
// control RPCs. Either way the job ends exactly as the same job without the
// attacks: the same saved model, to the last digit of psflow-eval.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/allreduce.grpc.pb.h"
#include "proto/chief.grpc.pb.h"
#include "proto/ps.grpc.pb.h"
#include "tests/common/certs.h"
#include "tests/integration/process.h"
#include "tests/ps/huge_init.h"
#include "tests/ps/stream_flood.h"
#include "transport/grpc_util.h"
#include "transport/security.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

// Resident bytes of process `pid`.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

// The attacks, each as one call (or stream) with the security given. In a
// workers-only job worker 0 serves the chief's service and its replica as
// ps 0: `server_role` is then the worker (the name TLS checks).
class Attacker {
 public:
  Attacker(const std::string& chief, const std::string& ps0, const SecurityOptions& security,
           std::optional<Role> server_role = std::nullopt)
      : ps_(ParameterServer::NewStub(
            MakeChannel(ps0, server_role.value_or(Role::kPs), security, true))),
        chief_(ChiefService::NewStub(
            MakeChannel(chief, server_role.value_or(Role::kChief), security, true))),
        security_(security) {}

  grpc::Status GetState(PsState* state) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    return ps_->GetState(&context, GetStateRequest(), state);
  }

  // Worker 0's NaN gradients for the first slice of ps 0.
  grpc::Status NanPush(const PsState& state) {
    return ValuePush(state, std::numeric_limits<float>::quiet_NaN());
  }

  // Worker `w`'s gradients for the first slice of ps 0, every value `value`.
  grpc::Status ValuePush(const PsState& state, float value, int w = 0) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    PushResponse response;
    auto writer = ps_->Push(&context, &response);
    PushRequest header;
    header.mutable_header()->set_job_id(state.job_id());
    header.mutable_header()->set_worker(w);
    header.mutable_header()->set_step(state.version());
    header.mutable_header()->add_slices(0);
    writer->Write(header);
    // ps 0's first slice in the job's placement order (a made-up one when
    // the caller could not learn the job).
    std::string name = "fc1/weights";
    std::vector<int64_t> shape = {4, 4};
    for (const VariablePlacement& v : state.job().placement().variable()) {
      const auto it = std::find_if(v.slice().begin(), v.slice().end(),
                                   [](const VariableSlice& s) { return s.ps() == 0; });
      if (it == v.slice().end()) continue;
      name = v.name();
      shape.assign(v.shape().begin(), v.shape().end());
      shape[0] = it->row_end() - it->row_begin();
      break;
    }
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    PushRequest data;
    TensorChunk* chunk = data.add_chunk();
    chunk->set_name(name);
    chunk->set_dtype(DT_FLOAT);
    for (int64_t d : shape) chunk->add_shape(d);
    std::vector<float> values(static_cast<size_t>(n), value);
    chunk->set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    writer->Write(data);
    writer->WritesDone();
    return writer->Finish();
  }

  // Worker `w`'s pull of version 0 by its clock (ASYNC and SSP jobs' pull),
  // on ps 0.
  grpc::Status ClockPull(const PsState& state, int w) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    PullRequest pull;
    pull.set_job_id(state.job_id());
    pull.set_by_clock(true);
    pull.set_worker(w);
    auto reader = ps_->Pull(&context, pull);
    PullResponse response;
    while (reader->Read(&response)) {
    }
    return reader->Finish();
  }

  // Worker `w`'s registration (a rejoin, for a worker of the job).
  grpc::Status RegisterWorker(int w) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    RegisterWorkerRequest request;
    request.set_worker(w);
    RegisterWorkerResponse response;
    return chief_->RegisterWorker(&context, request, &response);
  }

  // Evaluator `e`'s registration; *lease is the chief's answer's.
  grpc::Status RegisterEvaluator(int e, uint64_t* lease) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    RegisterEvaluatorRequest request;
    request.set_evaluator(e);
    RegisterEvaluatorResponse response;
    grpc::Status s = chief_->RegisterEvaluator(&context, request, &response);
    *lease = response.lease();
    return s;
  }

  // Evaluator `e`'s evaluation of the final model (step `steps`) with an
  // accuracy of 0.9999, carrying `lease`; *action is the chief's answer.
  grpc::Status ForgedFinalEval(const PsState& state, int e, int64_t steps, uint64_t lease,
                               ReportEvalResponse::Action* action) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    ReportEvalRequest request;
    request.set_job_id(state.job_id());
    request.set_evaluator(e);
    request.set_lease(lease);
    EvalResult* r = request.mutable_result();
    r->set_step(steps);
    r->set_loss(0.001);
    r->set_correct(9999);
    r->set_examples(10000);
    r->set_duration_us(1000);
    ReportEvalResponse response;
    grpc::Status s = chief_->ReportEval(&context, request, &response);
    *action = response.action();
    return s;
  }

  // "Member `from` left the ring", to the all-reduce service at `worker`
  // (the ring's key unknown: GetState does not tell it).
  grpc::Status RingAbortAs(const PsState& state, const std::string& worker, int from) {
    auto ring = AllReduce::NewStub(MakeChannel(worker, Role::kWorker, security_, true));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    RingAbort abort;
    abort.set_job_id(state.job_id());
    abort.set_from(from);
    abort.set_reason("forged");
    RingAbortAck ack;
    return ring->Abort(&context, abort, &ack);
  }

  // A piece from member `from`, to the all-reduce service at `worker`.
  grpc::Status RingPieceAs(const PsState& state, const std::string& worker, int from) {
    auto ring = AllReduce::NewStub(MakeChannel(worker, Role::kWorker, security_, true));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    RingPiece piece;
    piece.set_job_id(state.job_id());
    piece.set_from(from);
    piece.set_step(state.version() + 1);
    piece.set_dtype(DT_FLOAT);
    piece.set_data(std::string(16, '\0'));
    RingPieceAck ack;
    return ring->Send(&context, piece, &ack);
  }

  // Worker 0's skip of every slice of ps 0 at the ps's version.
  grpc::Status SkipPush(const PsState& state) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    PushResponse response;
    auto writer = ps_->Push(&context, &response);
    PushRequest header;
    header.mutable_header()->set_job_id(state.job_id());
    header.mutable_header()->set_worker(0);
    header.mutable_header()->set_step(state.version());
    header.mutable_header()->set_skip(true);
    writer->Write(header);
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status ImpossibleReport(const PsState& state) {
    ReportRequest report;
    report.set_job_id(state.job_id());
    report.set_worker(0);
    StepMetrics* m = report.add_metrics();
    m->set_step(state.version());
    m->set_loss(std::numeric_limits<double>::quiet_NaN());
    m->set_examples(int64_t{1} << 62);
    ReportResponse response;
    return Report(report, &response);
  }

  // "Finished" for worker `w`; *action is the chief's answer.
  grpc::Status FinishedReport(const PsState& state, int w, ReportResponse::Action* action) {
    ReportRequest report;
    report.set_job_id(state.job_id());
    report.set_worker(w);
    report.set_finished(true);
    ReportResponse response;
    grpc::Status s = Report(report, &response);
    *action = response.action();
    return s;
  }

  // Worker w's report that its step `step` was not finite (what a worker
  // whose loss diverged sends, withholding its push, under
  // --on_nonfinite=fail); *action is the chief's answer.
  grpc::Status NonFiniteReport(const PsState& state, int w, int64_t step,
                               ReportResponse::Action* action) {
    ReportRequest report;
    report.set_job_id(state.job_id());
    report.set_worker(w);
    StepMetrics* m = report.add_metrics();
    m->set_step(step);
    m->set_examples(1);
    m->set_nonfinite(true);
    ReportResponse response;
    grpc::Status s = Report(report, &response);
    *action = response.action();
    return s;
  }

  // Worker w's plausible metrics of step `step`: a low loss, every example
  // right, quick.
  grpc::Status MetricsReport(const PsState& state, int w, int64_t step) {
    ReportRequest report;
    report.set_job_id(state.job_id());
    report.set_worker(w);
    StepMetrics* m = report.add_metrics();
    m->set_step(step);
    m->set_loss(0.001);
    m->set_examples(1);
    m->set_correct(1);
    m->set_compute_us(1000);
    ReportResponse response;
    return Report(report, &response);
  }

  // An Init header declaring 1 GiB of values (and Adam's 2 GiB of slots)
  // under its own placement; `during` runs while the stream is open, having
  // sent nothing else. Then the stream is let go.
  grpc::Status HeaderOnlyInit(uint64_t job_id, const std::function<void()>& during) {
    const InitHeader h = ps::HugeInitHeader(job_id);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    InitResponse response;
    auto writer = ps_->Init(&context, &response);
    InitRequest request;
    *request.mutable_header() = h;
    writer->Write(request);
    if (job_id != 0) {
      absl::SleepFor(absl::Milliseconds(500));  // the ps has the header
      during();
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // A whole Init of another job: a random id, no slices, one live worker.
  grpc::Status ReplacingInit() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    InitResponse response;
    auto writer = ps_->Init(&context, &response);
    InitRequest request;
    request.mutable_header()->set_job_id(0x0dd5eed);
    request.mutable_header()->set_ps_index(0);
    request.mutable_header()->add_live_workers(0);
    writer->Write(request);
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status SetLiveWorkers7(const PsState& state) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    SetLiveWorkersRequest request;
    request.set_job_id(state.job_id());
    request.add_live_workers(7);
    SetLiveWorkersResponse response;
    return ps_->SetLiveWorkers(&context, request, &response);
  }

  grpc::Status Shutdown(const PsState& state) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    ShutdownRequest request;
    request.set_job_id(state.job_id());
    ShutdownResponse response;
    return ps_->Shutdown(&context, request, &response);
  }

  // The job's steps per second over `window`, from ps 0's version.
  double StepsPerSecond(absl::Duration window) {
    PsState first, last;
    if (!GetState(&first).ok()) return -1;
    const absl::Time start = absl::Now();
    absl::SleepFor(window);
    if (!GetState(&last).ok()) return -1;
    return static_cast<double>(last.version() - first.version()) /
           absl::ToDoubleSeconds(absl::Now() - start);
  }

  // Waits until ps 0 is at version `version` at least (false after 60 s).
  bool AtVersion(int64_t version) {
    const absl::Time until = absl::Now() + absl::Seconds(60);
    PsState state;
    while (absl::Now() < until) {
      if (GetState(&state).ok() && state.version() >= version) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  // 600 pulls of a version that does not come, on one connection; the codes
  // of those that end within 5 s, counted. The rest are held for a second
  // (the job trains on meanwhile), then cancelled.
  std::map<grpc::StatusCode, int> HeldPulls(const PsState& state) {
    grpc::CompletionQueue cq;
    struct Held {
      grpc::ClientContext context;
      std::unique_ptr<grpc::ClientAsyncReader<PullResponse>> reader;
      grpc::Status status;
    };
    std::vector<std::unique_ptr<Held>> held;
    PullRequest pull;
    pull.set_job_id(state.job_id());
    pull.set_min_version(int64_t{1} << 40);
    for (int i = 0; i < 600; ++i) {
      auto h = std::make_unique<Held>();
      h->reader = ps_->AsyncPull(&h->context, pull, &cq, nullptr);
      h->reader->Finish(&h->status, h.get());
      held.push_back(std::move(h));
    }
    // Refusals come at once: the calls that end are counted until none has
    // for half a second (those held wait for a version that never comes).
    std::map<grpc::StatusCode, int> ended;
    const absl::Time until = absl::Now() + absl::Seconds(5);
    int count = 0;
    while (count < 600) {
      void* tag = nullptr;
      bool ok = false;
      const absl::Time next = std::min(until, absl::Now() + absl::Milliseconds(500));
      if (cq.AsyncNext(&tag, &ok, absl::ToChronoTime(next)) != grpc::CompletionQueue::GOT_EVENT)
        break;
      if (tag == nullptr) continue;  // a call started
      ++ended[static_cast<Held*>(tag)->status.error_code()];
      ++count;
    }
    absl::SleepFor(absl::Seconds(1));
    for (auto& h : held) h->context.TryCancel();
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
    return ended;
  }

 private:
  grpc::Status Report(const ReportRequest& report, ReportResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Soon()));
    return chief_->Report(&context, report, response);
  }

  std::unique_ptr<ParameterServer::Stub> ps_;
  std::unique_ptr<ChiefService::Stub> chief_;
  const SecurityOptions security_;
};

class AttackTest : public TempDirTest {
 protected:
  // Runs the job (2 ps, 2 workers, each role with `role_flags(role)`, which
  // may override the chief's defaults below) to its end, calling `attack`
  // once the workers train; returns whether every process exited 0. The
  // processes' output is in outputs_.
  template <typename RoleFlags, typename Attack>
  bool RunJob(const std::string& model_dir, const RoleFlags& role_flags, const Attack& attack) {
    ports_ = FreePorts(5);
    if (ports_.size() != 5) return false;
    const std::vector<std::string> hosts = {
        "--chief_hosts=" + Addr(ports_[0]), "--ps_hosts=" + Addr(ports_[1]) + "," + Addr(ports_[2]),
        "--worker_hosts=" + Addr(ports_[3]) + "," + Addr(ports_[4])};
    auto start = [&](const std::string& role, int index, std::vector<std::string> extra = {}) {
      std::vector<std::string> args = {"--job_name=" + role, "--task_id=" + std::to_string(index)};
      args.insert(args.end(), hosts.begin(), hosts.end());
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<std::string> flags;
      if constexpr (std::is_invocable_v<RoleFlags, const std::string&, int>) {
        flags = role_flags(role, index);  // per task
      } else {
        flags = role_flags(role);
      }
      for (const std::string& f : flags) args.push_back(f);  // (the last one counts)
      return std::make_unique<Process>(Bin("psflow-" + role), args);
    };
    std::vector<std::unique_ptr<Process>> procs;
    procs.push_back(start("ps", 0));
    procs.push_back(start("ps", 1));
    procs.push_back(start("worker", 0));
    procs.push_back(start("worker", 1));
    procs.push_back(
        start("chief", 0,
              {"--model=mlp", "--train_steps=3000", "--optimizer=adam", "--learning_rate=0.001",
               "--log_every_steps=500", "--compute_threads=1", "--model_dir=" + model_dir}));
    Process& chief = *procs.back();
    if (!chief.WaitForOutput("worker 1 registered", seconds(60))) {
      ADD_FAILURE() << chief.Describe();
      return false;
    }
    attack();
    EXPECT_TRUE(chief.running()) << "the job ended before the attacks did\n" << chief.Describe();
    bool ok = true;
    for (auto& p : procs) {
      if (p->WaitOrKill(seconds(120)) != 0) {
        ADD_FAILURE() << p->Describe();
        ok = false;
      }
    }
    outputs_.clear();
    for (auto& p : procs) outputs_ += p->output();
    return ok;
  }

  // A workers-only job (2 workers that all-reduce; worker 0 runs the chief's
  // duties), started by hand with worker w's `flags(w)`, training the mlp
  // for `steps`; `attack` runs once both train. Returns whether both exited
  // 0; their output is in outputs_, worker w's address is worker(w).
  template <typename Flags, typename Attack>
  bool RunWorkersOnlyJob(int64_t steps, const Flags& flags, const Attack& attack) {
    ports_ = FreePorts(2);
    if (ports_.size() != 2) return false;
    const std::string hosts = "--worker_hosts=" + Addr(ports_[0]) + "," + Addr(ports_[1]);
    std::vector<std::unique_ptr<Process>> workers;
    for (int w = 0; w < 2; ++w) {
      std::vector<std::string> args = {"--job_name=worker", "--task_id=" + std::to_string(w),
                                       hosts};
      for (const std::string& a : HandStartedMlpArgs(steps)) args.push_back(a);
      for (const std::string& f : flags(w)) args.push_back(f);
      workers.push_back(std::make_unique<Process>(Bin("psflow-worker"), args));
    }
    // The ring is open on both once a step is logged.
    if (!workers[0]->WaitForOutput("] step 100/", seconds(60))) {
      ADD_FAILURE() << workers[0]->Describe();
      return false;
    }
    attack();
    EXPECT_TRUE(workers[0]->running()) << "the job ended before the attacks did\n"
                                       << workers[0]->Describe();
    bool ok = true;
    for (auto& w : workers) {
      if (w->WaitOrKill(seconds(120)) != 0) {
        ADD_FAILURE() << w->Describe();
        ok = false;
      }
    }
    outputs_.clear();
    for (auto& w : workers) outputs_ += w->output();
    return ok;
  }

  std::string chief() const { return Addr(ports_[0]); }
  std::string worker(int w) const { return Addr(ports_[w]); }
  std::string ps0() const { return Addr(ports_[1]); }

  std::vector<int> ports_;
  std::string outputs_;  // of every process of the latest job
};

std::vector<std::string> NoFlags(const std::string&) { return {}; }

constexpr int kFloodJobSteps = 6000;

// The lines of `text` that contain both `a` and `b`.
std::vector<std::string> LinesOf(const std::string& text, const std::string& a,
                                 const std::string& b) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(a) != std::string::npos && line.find(b) != std::string::npos) {
      lines.push_back(line);
    }
  }
  return lines;
}

TEST_F(AttackTest, NumericAndResourceGuardsHoldWithoutTls) {
  const std::string reference_dir = dir_ + "/reference";
  ASSERT_TRUE(RunJob(reference_dir, NoFlags, [] {}));
  const std::string reference = SavedModelFigures(reference_dir);
  ASSERT_NE(reference, "");

  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, NoFlags, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    PsState state;  // GetState hands out the job id (and the version) to anyone
    ASSERT_TRUE(attacker.GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());

    grpc::Status s = attacker.NanPush(state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("non-finite"));
    // Finite but absurd: over the default --max_gradient_abs, refused alike.
    s = attacker.ValuePush(state, 1e30f);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("max_gradient_abs 1e+09"));

    s = attacker.ImpossibleReport(state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    for (int w : {0, 1}) {
      ReportResponse::Action action;
      s = attacker.FinishedReport(state, w, &action);
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(action, ReportResponse::CONTINUE);  // the ps are not at the end
    }

    const std::vector<pid_t> ps_pids =
        FindProcesses("--job_name=ps --task_id=0 --chief_hosts=" + chief());
    ASSERT_EQ(ps_pids.size(), 1u);
    const int64_t rss_before = ResidentBytes(ps_pids[0]);
    s = attacker.HeaderOnlyInit(
        0x5eed, [&] { EXPECT_LT(ResidentBytes(ps_pids[0]) - rss_before, int64_t{100} << 20); });
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("incomplete"));
    s = attacker.HeaderOnlyInit(0, [] {});
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("no job id"));
    s = attacker.ReplacingInit();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();

    const std::map<grpc::StatusCode, int> pulls = attacker.HeldPulls(state);
    EXPECT_EQ(pulls,
              (std::map<grpc::StatusCode, int>{{grpc::StatusCode::RESOURCE_EXHAUSTED, 600 - 64}}));
  }));
  // The same model as without the attacks, and each refusal logged.
  EXPECT_EQ(SavedModelFigures(model_dir), reference);
  EXPECT_THAT(outputs_, HasSubstr("refused a report from worker 0")) << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("refused a stream of")) << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("refused pushes 2")) << outputs_;  // the NaNs and the 1e30s
  EXPECT_THAT(outputs_, ::testing::ContainsRegex("ps0\\] refused a push of .*non-finite gradient"))
      << outputs_;
}

// A forged skip push in a job that fails on non-finite steps (the default)
// is refused and counted, and the job ends as usual.
TEST_F(AttackTest, ForgedSkipPushIsRefusedInAJobThatFailsOnNonFiniteSteps) {
  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, NoFlags, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    PsState state;
    ASSERT_TRUE(attacker.GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());
    const grpc::Status s = attacker.SkipPush(state);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("runs on_nonfinite=FAIL")) << s.error_message();
  }));
  EXPECT_NE(SavedModelFigures(model_dir), "");
  EXPECT_THAT(outputs_, ::testing::ContainsRegex("ps0\\] refused a push of .*skip push refused"))
      << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("refused pushes 1")) << outputs_;
}

// Floods from 20 connections, each its own peer, held on ps 0 by `open`.
using Floods = std::vector<std::unique_ptr<testing_flood::StreamFlood>>;
template <typename Open>
Floods Flood(const std::string& ps, const Open& open) {
  Floods floods;
  for (int c = 0; c < 20; ++c) {
    floods.push_back(std::make_unique<testing_flood::StreamFlood>(
        MakeChannel(ps, Role::kPs, SecurityOptions{}, /*own_connection=*/true)));
    open(*floods.back());
  }
  return floods;
}

// The calls of `floods` ended so far, by code; `*messages` gets a message
// of each code.
std::map<grpc::StatusCode, int> Ended(const Floods& floods,
                                      std::map<grpc::StatusCode, std::string>* messages) {
  std::map<grpc::StatusCode, int> ended;
  for (const auto& f : floods) {
    for (const auto& [code, n] : f->ended()) ended[code] += n;
    for (const auto& [code, m] : f->messages()) (*messages)[code] = m;
  }
  return ended;
}

// A longer job than RunJob's default, with progress lines often enough to
// see a stall.
std::vector<std::string> LongerJob(const std::string& role) {
  if (role != "chief") return {};
  return {"--train_steps=" + std::to_string(kFloodJobSteps), "--log_every_steps=1000"};
}

// 5,000 Push streams that never send a header (no job id needed), 250 from
// each of 20 connections, held on ps 0 while the job trains. They could
// take its whole stream budget and the workers' streams were refused (the
// job stopped, exit 140); now strangers hold at most the pending part, each
// silent stream is cancelled after --stream_first_message_timeout (5 s),
// the ps logs a line per burst, and the job trains on at its rate and ends.
// bench/stream_flood.sh repeats this and prints the rates.
TEST_F(AttackTest, SilentStreamFloodLeavesTheJobItsRate) {
  double before = 0;
  double during = 0;
  std::map<grpc::StatusCode, int> ended;
  std::map<grpc::StatusCode, std::string> messages;
  ASSERT_TRUE(RunJob(dir_ + "/attacked", LongerJob, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    ASSERT_TRUE(attacker.AtVersion(300));  // the workers' connections pushed
    before = attacker.StepsPerSecond(absl::Seconds(2));
    Floods floods = Flood(ps0(), [](testing_flood::StreamFlood& f) { f.SilentPushes(250); });
    during = attacker.StepsPerSecond(absl::Seconds(2));
    for (const auto& f : floods) EXPECT_TRUE(f->WaitEnded(250, absl::Seconds(20)));
    ended = Ended(floods, &messages);
  }));
  std::cout << "steps/s before the flood " << before << ", during it " << during << ", ratio "
            << during / before << std::endl;
  EXPECT_GT(before, 0);
  // The bench measures the ratio against 0.8; a loaded test machine gets slack.
  EXPECT_GT(during, 0.5 * before);
  // Over the bound per connection (64) or of the pending part (512):
  // refused at once; the rest cancelled for their silence.
  EXPECT_EQ(
      ended[grpc::StatusCode::RESOURCE_EXHAUSTED] + ended[grpc::StatusCode::DEADLINE_EXCEEDED],
      5000)
      << ::testing::PrintToString(ended);
  EXPECT_GE(ended[grpc::StatusCode::RESOURCE_EXHAUSTED], 5000 - 512);
  EXPECT_GT(ended[grpc::StatusCode::DEADLINE_EXCEEDED], 0);
  // One line as each burst begins and a summary a 10 s, not a line a call.
  const std::vector<std::string> lines = LinesOf(outputs_, "ps0] ", "stream");
  EXPECT_LE(lines.size(), 6u) << ::testing::PrintToString(lines);
  EXPECT_THAT(outputs_, HasSubstr("ps0] refused a stream of")) << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("ps0] cancelled a stream of")) << outputs_;
}

// 2,000 pulls of a version that does not come, 100 from each of 20
// connections, from a caller that learnt the job id (GetState tells it),
// held on ps 0 while the job trains: connections that never pushed hold at
// most the pending part of the budget, and the workers train on.
TEST_F(AttackTest, WaitingPullFloodDoesNotStopTheJob) {
  std::map<grpc::StatusCode, int> ended;
  std::map<grpc::StatusCode, std::string> messages;
  double before = 0;
  double during = 0;
  ASSERT_TRUE(RunJob(dir_ + "/attacked", LongerJob, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    PsState state;
    ASSERT_TRUE(attacker.GetState(&state).ok());
    ASSERT_TRUE(attacker.AtVersion(300));
    before = attacker.StepsPerSecond(absl::Seconds(2));
    Floods floods =
        Flood(ps0(), [&](testing_flood::StreamFlood& f) { f.WaitingPulls(100, state.job_id()); });
    during = attacker.StepsPerSecond(absl::Seconds(2));
    ended = Ended(floods, &messages);
  }));  // (the floods' pulls are cancelled as they go)
  std::cout << "steps/s before the flood " << before << ", during it " << during << std::endl;
  EXPECT_GT(during, 0.5 * before);
  // 36 of each connection over its bound, and 768 over the pending part.
  EXPECT_EQ(ended.size(), 1u) << ::testing::PrintToString(ended)
                              << ::testing::PrintToString(messages);
  EXPECT_GE(ended[grpc::StatusCode::RESOURCE_EXHAUSTED], 20 * 36 + 768);
}

// Forged reports that a step was not finite (GetState hands anyone the job
// id) fail the job only once the ps confirm that the worker withheld its
// gradients of the step: for a step the worker pushed, or one the ps are
// not at, they are ignored (logged) and the job ends well.
TEST_F(AttackTest, ForgedNonFiniteReportDoesNotFailAJobWithoutTls) {
  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, NoFlags, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    PsState state;
    ASSERT_TRUE(attacker.GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());
    for (const auto& [w, step] : std::vector<std::pair<int, int64_t>>{
             {0, state.version()}, {1, state.version()}, {0, 2999}}) {
      ReportResponse::Action action;
      const grpc::Status s = attacker.NonFiniteReport(state, w, step, &action);
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(action, ReportResponse::CONTINUE);
    }
  }));
  EXPECT_NE(SavedModelFigures(model_dir), "");
  EXPECT_THAT(outputs_, HasSubstr("ignored a report from worker 0 that step")) << outputs_;
  EXPECT_THAT(outputs_, Not(HasSubstr("computed a non-finite loss"))) << outputs_;
}

// Plausible forged metrics of the last step, for every worker, once gave the
// progress log its end at once (silencing it) and its final loss and
// accuracy. The chief takes a step's metrics only of a step the ps have the
// worker's gradients of, once: every line still comes, and the closing
// line's figures are the last line's, the workers' own.
TEST_F(AttackTest, ForgedLastStepMetricsLeaveTheProgressLogAndFinalFiguresAlone) {
  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, NoFlags, [&] {
    Attacker attacker(chief(), ps0(), SecurityOptions{});
    PsState state;
    ASSERT_TRUE(attacker.GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());
    for (int w : {0, 1}) {
      const grpc::Status s = attacker.MetricsReport(state, w, 2999);
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
  }));
  std::smatch last, done;
  const std::regex last_line("chief\\] step 3000/3000 epoch [0-9.]+ loss ([0-9.]+) acc ([0-9.]+)");
  const std::regex done_line("chief\\] done: .* final loss ([0-9.]+) acc ([0-9.]+)");
  ASSERT_TRUE(std::regex_search(outputs_, last, last_line)) << outputs_;
  ASSERT_TRUE(std::regex_search(outputs_, done, done_line)) << outputs_;
  EXPECT_EQ(done[1].str(), last[1].str()) << outputs_;
  EXPECT_EQ(std::stod(done[2].str()), std::stod(last[2].str())) << outputs_;
  EXPECT_NE(done[1].str(), "0.0010") << outputs_;
  for (int step : {500, 1000, 1500, 2000, 2500}) {
    const std::regex line("chief\\] step " + std::to_string(step) +
                          "/3000 .*\\| workers 2/2 ps 2/2");
    EXPECT_TRUE(std::regex_search(outputs_, line)) << step << "\n" << outputs_;
  }
  EXPECT_THAT(outputs_, HasSubstr("refused worker 0's metrics of step 2999")) << outputs_;
}

// Every attack with mutual TLS and the job token on, from three callers: a
// stranger without a certificate (refused at the handshake: UNAVAILABLE), one
// with the job's worker certificate but no token (UNAUTHENTICATED), and one
// with a worker's full credentials, whom the roles' rules and the numeric
// and resource guards stop. The model is exactly the unattacked job's.
TEST_F(AttackTest, EveryAttackFailsWithTlsAndToken) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(testing_certs::MakeCerts(certs));
  auto tls = [&](const std::string& role) {
    return std::vector<std::string>{
        "--tls_cert=" + certs + "/" + role + ".crt", "--tls_key=" + certs + "/" + role + ".key",
        "--tls_ca=" + certs + "/ca.crt", "--auth_token_file=" + certs + "/token"};
  };
  const std::string reference_dir = dir_ + "/reference";
  ASSERT_TRUE(RunJob(reference_dir, tls, [] {}));
  const std::string reference = SavedModelFigures(reference_dir);
  ASSERT_NE(reference, "");

  const SecurityOptions worker = testing_certs::Options(certs, "worker");
  SecurityOptions stranger;  // trusts the job's CA, shows no certificate
  stranger.ca_pem = worker.ca_pem;
  const SecurityOptions no_token = testing_certs::Options(certs, "worker", /*token=*/false);
  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, tls, [&] {
    PsState state;
    ASSERT_TRUE(Attacker(chief(), ps0(), worker).GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());
    for (const auto& [who, security, code] :
         {std::tuple{"a stranger", stranger, grpc::StatusCode::UNAVAILABLE},
          std::tuple{"a certificate without the token", no_token,
                     grpc::StatusCode::UNAUTHENTICATED}}) {
      SCOPED_TRACE(who);
      Attacker attacker(chief(), ps0(), security);
      PsState learned;
      EXPECT_EQ(attacker.GetState(&learned).error_code(), code);
      EXPECT_EQ(attacker.NanPush(state).error_code(), code);
      EXPECT_EQ(attacker.ImpossibleReport(state).error_code(), code);
      ReportResponse::Action action;
      EXPECT_EQ(attacker.FinishedReport(state, 0, &action).error_code(), code);
      EXPECT_EQ(attacker.HeaderOnlyInit(0x5eed, [] {}).error_code(), code);
      EXPECT_EQ(attacker.ReplacingInit().error_code(), code);
      EXPECT_EQ(attacker.SetLiveWorkers7(state).error_code(), code);
      EXPECT_EQ(attacker.Shutdown(state).error_code(), code);
      EXPECT_EQ(attacker.HeldPulls(state), (std::map<grpc::StatusCode, int>{{code, 600}}));
    }
    // A worker's credentials: the control calls are the chief's alone, and
    // the rest meet the guards.
    Attacker insider(chief(), ps0(), worker);
    const grpc::StatusCode denied = grpc::StatusCode::PERMISSION_DENIED;
    EXPECT_EQ(insider.HeaderOnlyInit(0x5eed, [] {}).error_code(), denied);
    EXPECT_EQ(insider.ReplacingInit().error_code(), denied);
    EXPECT_EQ(insider.SetLiveWorkers7(state).error_code(), denied);
    EXPECT_EQ(insider.Shutdown(state).error_code(), denied);
    EXPECT_EQ(insider.NanPush(state).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(insider.ImpossibleReport(state).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    for (int w : {0, 1}) {
      ReportResponse::Action action;
      EXPECT_TRUE(insider.FinishedReport(state, w, &action).ok());
      EXPECT_EQ(action, ReportResponse::CONTINUE);
    }
    EXPECT_EQ(insider.HeldPulls(state),
              (std::map<grpc::StatusCode, int>{{grpc::StatusCode::RESOURCE_EXHAUSTED, 600 - 64}}));
  }));
  EXPECT_EQ(SavedModelFigures(model_dir), reference);
  EXPECT_THAT(outputs_, Not(HasSubstr("reloading every ps"))) << outputs_;
}

// The mutual TLS flags of a make-certs.sh directory's certificate `name`
// ("worker-1", "chief", ...), with its token.
std::vector<std::string> TlsFlags(const std::string& certs, const std::string& name) {
  return {"--tls_cert=" + certs + "/" + name + ".crt", "--tls_key=" + certs + "/" + name + ".key",
          "--tls_ca=" + certs + "/ca.crt", "--auth_token_file=" + certs + "/token"};
}

// With per-task certificates a worker's credentials act as that worker only:
// worker 1's cannot push, pull, report (a non-finite step, which would fail
// the job) or register as worker 0, while as itself it still meets the
// numeric guards; the job ends as usual.
TEST_F(AttackTest, PerTaskCertificateCannotActAsAnotherWorker) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(testing_certs::MakeCerts(certs));
  auto per_task = [&](const std::string& role, int index) {
    return TlsFlags(certs, role == "chief" ? role : role + "-" + std::to_string(index));
  };
  ASSERT_TRUE(RunJob(dir_ + "/model", per_task, [&] {
    Attacker worker1(chief(), ps0(), testing_certs::Options(certs, "worker-1"));
    PsState state;
    ASSERT_TRUE(worker1.GetState(&state).ok());
    ASSERT_TRUE(state.holds_job());
    const grpc::StatusCode denied = grpc::StatusCode::PERMISSION_DENIED;
    grpc::Status s = worker1.NanPush(state);
    EXPECT_EQ(s.error_code(), denied) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("worker 1's; it may not act as worker 0"));
    EXPECT_EQ(worker1.ClockPull(state, 0).error_code(), denied);
    ReportResponse::Action action;
    s = worker1.NonFiniteReport(state, 0, state.version(), &action);
    EXPECT_EQ(s.error_code(), denied) << s.error_message();
    s = worker1.RegisterWorker(0);
    EXPECT_EQ(s.error_code(), denied) << s.error_message();
    EXPECT_EQ(worker1.FinishedReport(state, 0, &action).error_code(), denied);
    // As itself: past the identity check, to the guards.
    s = worker1.ValuePush(state, std::numeric_limits<float>::quiet_NaN(), 1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }));
  EXPECT_NE(SavedModelFigures(dir_ + "/model"), "");
  EXPECT_THAT(outputs_, HasSubstr("done: 3000 steps")) << outputs_;
}

// A workers-only job in plaintext, attacked by a stranger who learnt the
// job id from GetState: an abort "from worker 0" (which stopped the job in
// a fraction of a second) is refused without the ring's key, and so is a
// forged piece; an evaluator registration is refused (the cluster lists
// none, and without TLS nothing else says who is an evaluator), and so is a
// forged result of the final model ("acc 0.9999"): the job neither waits
// for it nor prints it, and ends with exit 0.
TEST_F(AttackTest, ForgedAbortAndForgedEvaluatorAreRefusedInAWorkersOnlyJob) {
  ASSERT_TRUE(RunWorkersOnlyJob(
      1500, [](int) { return std::vector<std::string>{}; },
      [&] {
        Attacker stranger(worker(0), worker(0), SecurityOptions{}, Role::kWorker);
        PsState state;
        ASSERT_TRUE(stranger.GetState(&state).ok());
        ASSERT_NE(state.job_id(), 0u);
        grpc::Status s = stranger.RingAbortAs(state, worker(1), 0);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
        EXPECT_THAT(s.error_message(), HasSubstr("not a member of this all-reduce ring"));
        s = stranger.RingAbortAs(state, worker(0), 1);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
        s = stranger.RingPieceAs(state, worker(1), 0);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();

        uint64_t lease = 0;
        s = stranger.RegisterEvaluator(0, &lease);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
        EXPECT_THAT(s.error_message(), HasSubstr("lists no evaluators"));
        ReportEvalResponse::Action action = ReportEvalResponse::CONTINUE;
        s = stranger.ForgedFinalEval(state, 0, 1500, lease, &action);
        EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      }));
  EXPECT_THAT(outputs_, HasSubstr("done: 1500 steps")) << outputs_;
  EXPECT_THAT(outputs_, Not(HasSubstr("(evaluator)"))) << outputs_;
  EXPECT_THAT(outputs_, Not(HasSubstr("acc 0.9999"))) << outputs_;
  EXPECT_THAT(outputs_, Not(HasSubstr("waiting for the evaluation of the final model")));
  EXPECT_THAT(outputs_, Not(HasSubstr("left the all-reduce group"))) << outputs_;
}

// With per-task certificates in a workers-only job, worker 1's credentials
// cannot abort the ring or send pieces as worker 0, nor report, rejoin or
// pull as it; the job ends with exit 0.
TEST_F(AttackTest, PerTaskCertificateCannotAbortTheRingAsAnotherWorker) {
  const std::string certs = dir_ + "/certs";
  ASSERT_TRUE(testing_certs::MakeCerts(certs));
  ASSERT_TRUE(RunWorkersOnlyJob(
      1500, [&](int w) { return TlsFlags(certs, "worker-" + std::to_string(w)); },
      [&] {
        Attacker worker1(worker(0), worker(0), testing_certs::Options(certs, "worker-1"),
                         Role::kWorker);
        PsState state;
        ASSERT_TRUE(worker1.GetState(&state).ok());
        const grpc::StatusCode denied = grpc::StatusCode::PERMISSION_DENIED;
        grpc::Status s = worker1.RingAbortAs(state, worker(1), 0);
        EXPECT_EQ(s.error_code(), denied) << s.error_message();
        EXPECT_THAT(s.error_message(), HasSubstr("worker 1's; it may not act as worker 0"));
        EXPECT_EQ(worker1.RingPieceAs(state, worker(1), 0).error_code(), denied);
        ReportResponse::Action action;
        EXPECT_EQ(worker1.NonFiniteReport(state, 0, state.version(), &action).error_code(), denied);
        EXPECT_EQ(worker1.RegisterWorker(0).error_code(), denied);
        EXPECT_EQ(worker1.ClockPull(state, 0).error_code(), denied);
      }));
  EXPECT_THAT(outputs_, HasSubstr("done: 1500 steps")) << outputs_;
  EXPECT_THAT(outputs_, Not(HasSubstr("left the all-reduce group"))) << outputs_;
}

}  // namespace
}  // namespace psflow::itest
