// A training cluster on loopback attacked from outside by a client built
// from psflow's own protos, as anyone who can reach its ports could, without
// TLS or a job token: the numeric and resource guards must hold. A NaN push,
// forged reports (impossible values, "finished" before the end), an Init
// header that declares a gigabyte and sends nothing, and hundreds of pulls
// held open: each is refused (or harmless), and the job ends exactly as the
// same job without the attacks — the same saved model, to the last digit of
// psflow-eval.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/chief.grpc.pb.h"
#include "proto/ps.grpc.pb.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;

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

// The saved model's "accuracy loss" as psflow-eval prints them.
std::string EvalOf(const std::string& model_dir) {
  RunResult eval = RunProcess(Bin("psflow-eval"), {"--saved_model=" + model_dir + "/saved_model"},
                              {}, seconds(60));
  std::smatch m;
  if (eval.exit_code != 0 ||
      !std::regex_search(eval.out, m, std::regex(R"(accuracy: ([0-9.]+)\nloss: ([0-9.]+)\n)"))) {
    ADD_FAILURE() << eval.description;
    return "";
  }
  return m[1].str() + " " + m[2].str();
}

class AttackTest : public TempDirTest {
 protected:
  // Runs the job (2 ps, 2 workers) to its end, calling `attack` once the
  // workers train; returns whether every process exited 0.
  template <typename Attack>
  bool RunJob(const std::string& model_dir, const Attack& attack) {
    ports_ = FreePorts(5);
    if (ports_.size() != 5) return false;
    const std::vector<std::string> hosts = {
        "--chief_hosts=" + Addr(ports_[0]), "--ps_hosts=" + Addr(ports_[1]) + "," + Addr(ports_[2]),
        "--worker_hosts=" + Addr(ports_[3]) + "," + Addr(ports_[4])};
    auto start = [&](const std::string& role, int index, std::vector<std::string> extra = {}) {
      std::vector<std::string> args = {"--job_name=" + role, "--task_id=" + std::to_string(index)};
      args.insert(args.end(), hosts.begin(), hosts.end());
      args.insert(args.end(), extra.begin(), extra.end());
      return std::make_unique<Process>(Bin("psflow-" + role), args);
    };
    std::vector<std::unique_ptr<Process>> procs;
    procs.push_back(start("ps", 0));
    procs.push_back(start("ps", 1));
    procs.push_back(start("worker", 0));
    procs.push_back(start("worker", 1));
    procs.push_back(
        start("chief", 0,
              {"--model=mlp", "--train_steps=1500", "--optimizer=adam", "--learning_rate=0.001",
               "--log_every_steps=500", "--compute_threads=1", "--model_dir=" + model_dir}));
    Process& chief = *procs.back();
    if (!chief.WaitForOutput("worker 1 registered", seconds(60))) {
      ADD_FAILURE() << chief.Describe();
      return false;
    }
    attack();
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

  std::vector<int> ports_;
  std::string outputs_;  // of every process of the latest job
};

TEST_F(AttackTest, NumericAndResourceGuardsHoldWithoutTls) {
  const std::string reference_dir = dir_ + "/reference";
  ASSERT_TRUE(RunJob(reference_dir, [] {}));
  const std::string reference = EvalOf(reference_dir);
  ASSERT_NE(reference, "");

  const std::string model_dir = dir_ + "/attacked";
  ASSERT_TRUE(RunJob(model_dir, [&] {
    auto ps = ParameterServer::NewStub(
        MakeChannel(Addr(ports_[1]), Role::kPs, SecurityOptions{}, /*own_connection=*/true));
    auto chief = ChiefService::NewStub(
        MakeChannel(Addr(ports_[0]), Role::kChief, SecurityOptions{}, /*own_connection=*/true));
    auto deadline = [] { return absl::ToChronoTime(absl::Now() + absl::Seconds(10)); };
    // GetState hands out the job id (and the version) to anyone.
    PsState state;
    {
      grpc::ClientContext context;
      context.set_deadline(deadline());
      ASSERT_TRUE(ps->GetState(&context, GetStateRequest(), &state).ok());
    }
    ASSERT_TRUE(state.holds_job());

    // 1. A push of NaN gradients as live worker 0: refused, counted.
    {
      grpc::ClientContext context;
      context.set_deadline(deadline());
      PushResponse response;
      auto writer = ps->Push(&context, &response);
      PushRequest header;
      header.mutable_header()->set_job_id(state.job_id());
      header.mutable_header()->set_worker(0);
      header.mutable_header()->set_step(state.version());
      header.mutable_header()->add_slices(0);
      ASSERT_TRUE(writer->Write(header));
      // ps 0's first slice (index 0 of its slices), in the job's placement order.
      const VariablePlacement* first = nullptr;
      int64_t rows = 0;
      for (const VariablePlacement& p : state.job().placement().variable()) {
        for (const VariableSlice& s : p.slice()) {
          if (s.ps() == 0 && first == nullptr) {
            first = &p;
            rows = s.row_end() - s.row_begin();
          }
        }
      }
      ASSERT_NE(first, nullptr);
      const VariablePlacement& v = *first;
      int64_t n = rows;
      for (int d = 1; d < v.shape_size(); ++d) n *= v.shape(d);
      PushRequest data;
      TensorChunk* chunk = data.add_chunk();
      chunk->set_name(v.name());
      chunk->set_dtype(DT_FLOAT);
      chunk->add_shape(rows);
      for (int d = 1; d < v.shape_size(); ++d) chunk->add_shape(v.shape(d));
      std::vector<float> nan(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
      chunk->set_data(reinterpret_cast<const char*>(nan.data()), nan.size() * sizeof(float));
      writer->Write(data);
      writer->WritesDone();
      const grpc::Status s = writer->Finish();
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("non-finite"));
    }

    // 2. Reports with impossible values: a NaN loss, 2^62 examples.
    {
      grpc::ClientContext context;
      context.set_deadline(deadline());
      ReportRequest report;
      report.set_job_id(state.job_id());
      report.set_worker(0);
      StepMetrics* m = report.add_metrics();
      m->set_step(state.version());
      m->set_loss(std::numeric_limits<double>::quiet_NaN());
      m->set_examples(int64_t{1} << 62);
      ReportResponse response;
      const grpc::Status s = chief->Report(&context, report, &response);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    }

    // 3. "Finished" for every worker, long before the last step: ends nothing.
    for (int w : {0, 1}) {
      grpc::ClientContext context;
      context.set_deadline(deadline());
      ReportRequest report;
      report.set_job_id(state.job_id());
      report.set_worker(w);
      report.set_finished(true);
      ReportResponse response;
      const grpc::Status s = chief->Report(&context, report, &response);
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(response.action(), ReportResponse::CONTINUE);
    }

    // 4. An Init header that declares 1 GiB of values (and 2 GiB of Adam's
    //    slots) under its own placement, then sends nothing: ps 0 allocates
    //    nothing for it. One with no job id is refused at once.
    const std::vector<pid_t> ps_pids =
        FindProcesses("--job_name=ps --task_id=0 --chief_hosts=" + Addr(ports_[0]));
    ASSERT_EQ(ps_pids.size(), 1u);
    const int64_t rss_before = ResidentBytes(ps_pids[0]);
    {
      InitHeader h;
      h.set_job_id(0x5eed);
      h.set_ps_index(0);
      h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::ADAM);
      h.add_live_workers(0);
      Placement* placement = h.mutable_job()->mutable_placement();
      placement->set_num_ps(1);
      VariablePlacement* v = placement->add_variable();
      v->set_name("huge");
      SliceSpec* spec = h.add_slice();
      spec->set_name("huge");
      for (int64_t d : {16384, 16384}) {
        v->add_shape(d);
        spec->add_shape(d);
      }
      v->add_slice()->set_row_end(16384);
      spec->set_row_end(16384);
      grpc::ClientContext context;
      context.set_deadline(deadline());
      InitResponse response;
      auto writer = ps->Init(&context, &response);
      InitRequest request;
      *request.mutable_header() = h;
      ASSERT_TRUE(writer->Write(request));
      absl::SleepFor(absl::Milliseconds(500));
      EXPECT_LT(ResidentBytes(ps_pids[0]) - rss_before, int64_t{100} << 20);
      context.TryCancel();
      writer->Finish().error_code();

      h.set_job_id(0);
      grpc::ClientContext context2;
      context2.set_deadline(deadline());
      auto writer2 = ps->Init(&context2, &response);
      *request.mutable_header() = h;
      writer2->Write(request);
      writer2->WritesDone();
      const grpc::Status s = writer2->Finish();
      EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    }

    // 5. 600 pulls of a version that does not come, held open on one
    //    connection: past the bound they are refused at once; the ones held
    //    cost the ps no thread and the workers train on.
    {
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
        h->reader = ps->AsyncPull(&h->context, pull, &cq, nullptr);
        h->reader->Finish(&h->status, h.get());
        held.push_back(std::move(h));
      }
      int refused = 0;
      const absl::Time until = absl::Now() + absl::Seconds(5);
      while (absl::Now() < until && refused < 600 - 64) {
        void* tag = nullptr;
        bool ok = false;
        if (cq.AsyncNext(&tag, &ok, absl::ToChronoTime(until)) !=
            grpc::CompletionQueue::GOT_EVENT) {
          break;
        }
        if (tag == nullptr) continue;  // a call started
        auto* h = static_cast<Held*>(tag);
        EXPECT_EQ(h->status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
        ++refused;
      }
      EXPECT_EQ(refused, 600 - 64);
      // Held while the job trains on for a second, then let go.
      absl::SleepFor(absl::Seconds(1));
      for (auto& h : held) h->context.TryCancel();
      cq.Shutdown();
      void* tag = nullptr;
      bool ok = false;
      while (cq.Next(&tag, &ok)) {
      }
    }
  }));
  // The same model as without the attacks, and each refusal logged.
  EXPECT_EQ(EvalOf(model_dir), reference);
  EXPECT_THAT(outputs_, HasSubstr("refused a report from worker 0")) << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("refused a stream of")) << outputs_;
  EXPECT_THAT(outputs_, HasSubstr("refused for non-finite gradients 1")) << outputs_;
}

}  // namespace
}  // namespace psflow::itest
