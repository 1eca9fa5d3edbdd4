// psflow-bench-wire: the parameter-server data path alone, without computing —
// how long one synchronous step's exchange takes when each worker pushes the
// gradients of --model (placed over the ps as the chief places it) and pulls
// as many weights back, over real gRPC on
// loopback, to --ps parameter servers that run in this process (each its own
// server, shard and appliers, as psflow-ps sets them up). Each worker cuts
// every ps's slices into lanes (up to --lanes_per_ps, each its own HTTP/2
// connection) that push their gradients of step k and at once pull their
// slices of version k+1, as a worker's trainer does. Prints one line:
//   wire model=resnet floats=11200000 ps=2 workers=1 lanes_per_ps=8 dtype=fp32
//        shared_memory=1 step_ms=9.1 push_ms=6.0 gbps=9.8
// (step_ms: whole exchange; push_ms: until the last lane's push is answered;
// gbps: bytes pushed and pulled per second by one worker, in the wire dtype;
// then cpu_ms: the CPU this process, workers and ps together, used per
// exchange, user and system; switches: its threads' context switches per
// exchange, voluntary and not — on a machine whose cores the workers also
// compute on, this is what the exchange takes from them).

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "role/command_line.h"
#include "common/float16.h"
#include "transport/grpc_util.h"
#include "common/placement.h"
#include "role/process_setup.h"
#include "common/thread_pool.h"
#include "model/spec.h"
#include "ps/grpc_client.h"
#include "ps/service.h"
#include "ps/shard.h"

ABSL_FLAG(std::string, model, "resnet", "Model whose variables are pushed and pulled.");
ABSL_FLAG(int, ps, 2, "Parameter servers (each in this process, on its own port).");
ABSL_FLAG(int, workers, 1, "Workers, each with its own connections, pushing at once.");
ABSL_FLAG(int, lanes_per_ps, 0,
          "Most lanes (connections) per ps of each worker; 0: a worker's default (up to 16 in "
          "all, at most 8 per ps).");
ABSL_FLAG(std::string, wire_dtype, "fp32", "fp32, bf16 or fp16.");
ABSL_FLAG(int, steps, 30, "Timed steps (after 3 untimed ones).");
ABSL_FLAG(int, apply_threads, 2, "Apply threads of each ps.");
ABSL_FLAG(bool, shared_memory, true,
          "Workers offer the ps shared memory for the tensors, as psflow-worker does by default "
          "(the ps are on this host); false: the tensors go over TCP on loopback.");

namespace {

using psflow::ps::GrpcClient;

struct Server {
  std::unique_ptr<psflow::ThreadPool> apply_pool;
  std::unique_ptr<psflow::ThreadPool> appliers;
  std::unique_ptr<psflow::ps::Shard> shard;
  std::unique_ptr<psflow::ps::PsService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

struct Lane {
  int ps = 0;
  std::vector<int> slices;  // indices into the ps's slices
};

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv,
                           "milliseconds per synchronous exchange (push, then pull) through "
                           "parameter servers on loopback, without a model.",
                           {"ps_wire.cc"});
  const std::string model_name = absl::GetFlag(FLAGS_model);
  const int num_ps = absl::GetFlag(FLAGS_ps);
  const int workers = absl::GetFlag(FLAGS_workers);
  const int lanes_flag = absl::GetFlag(FLAGS_lanes_per_ps);
  // As psflow-worker picks them (worker/main.cc).
  const int lanes_per_ps = lanes_flag > 0 ? lanes_flag : std::clamp(16 / std::max(num_ps, 1), 1, 8);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int apply_threads = absl::GetFlag(FLAGS_apply_threads);
  if (num_ps <= 0 || workers <= 0 || lanes_flag < 0 || steps <= 0 || apply_threads <= 0) {
    return psflow::FailWith(
        "--ps, --workers, --steps and --apply_threads must be positive, --lanes_per_ps not "
        "negative");
  }
  psflow::DataType dtype;
  psflow::JobConfig::WireDtype job_dtype;
  const std::string wire = absl::AsciiStrToLower(absl::GetFlag(FLAGS_wire_dtype));
  if (wire == "fp32") {
    dtype = psflow::DT_FLOAT;
    job_dtype = psflow::JobConfig::FP32;
  } else if (wire == "bf16") {
    dtype = psflow::DT_BFLOAT16;
    job_dtype = psflow::JobConfig::BF16;
  } else if (wire == "fp16") {
    dtype = psflow::DT_HALF;
    job_dtype = psflow::JobConfig::FP16;
  } else {
    return psflow::FailWith(absl::StrCat("unknown --wire_dtype '", wire, "'"));
  }

  // The model's variables placed over the ps as the chief places them.
  absl::StatusOr<psflow::ModelSpec> spec = psflow::model::ResolveModelSpec(model_name);
  if (!spec.ok()) return psflow::FailWith(spec.status());
  absl::StatusOr<psflow::Placement> placement =
      psflow::PlaceVariables(psflow::model::ModelVariables(*spec), num_ps);
  if (!placement.ok()) return psflow::FailWith(placement.status());
  std::vector<psflow::InitHeader> headers(num_ps);
  std::vector<std::vector<int64_t>> slice_sizes(num_ps);
  int64_t floats = 0;
  for (int p = 0; p < num_ps; ++p) {
    for (psflow::SliceSpec& s : psflow::SliceSpecs(*placement, p)) {
      slice_sizes[p].push_back(psflow::NumElements(s.shape()));
      floats += slice_sizes[p].back();
      *headers[p].add_slice() = std::move(s);
    }
    *headers[p].mutable_job()->mutable_placement() = *placement;
  }
  const uint64_t job_id = 7;
  std::vector<Server> servers(num_ps);
  std::vector<std::string> addresses;
  const std::vector<int> ports = psflow::FreePorts("127.0.0.1", num_ps);
  if (static_cast<int>(ports.size()) != num_ps) return psflow::FailWith("no free loopback ports");
  for (int p = 0; p < num_ps; ++p) {
    Server& s = servers[p];
    if (apply_threads > 1) s.apply_pool = std::make_unique<psflow::ThreadPool>(apply_threads - 1);
    s.appliers = std::make_unique<psflow::ThreadPool>(std::min(4, apply_threads));
    s.shard = std::make_unique<psflow::ps::Shard>(
        s.apply_pool.get(), psflow::ps::Shard::kDefaultApplyRange, s.appliers.get());
    s.service = std::make_unique<psflow::ps::PsService>(
        s.shard.get(), psflow::ps::PsServiceOptions{.ps_index = p});
    s.address = absl::StrCat("127.0.0.1:", ports[p]);
    absl::StatusOr<std::unique_ptr<grpc::Server>> server =
        psflow::StartServer(s.address, s.service.get(), psflow::SecurityOptions{});
    if (!server.ok()) return psflow::FailWith(std::string(server.status().message()));
    s.server = std::move(*server);
    addresses.push_back(s.address);
  }

  // Init: SGD, every worker live, values zero.
  {
    GrpcClient chief(addresses);
    for (int p = 0; p < num_ps; ++p) {
      psflow::InitHeader& h = headers[p];
      h.set_job_id(job_id);
      h.set_ps_index(p);
      h.set_version(0);
      psflow::JobConfig* job = h.mutable_job();
      job->mutable_optimizer()->set_kind(psflow::OptimizerConfig::SGD);
      job->mutable_optimizer()->set_learning_rate(1e-6f);
      job->set_wire_dtype(job_dtype);
      job->set_num_workers(workers);
      job->set_num_ps(num_ps);
      for (int w = 0; w < workers; ++w) h.add_live_workers(w);
      std::vector<std::vector<float>> zeros;
      std::vector<psflow::TensorRef> refs;
      zeros.reserve(h.slice_size());
      for (const psflow::SliceSpec& s : h.slice()) {
        const std::vector<int64_t> shape(s.shape().begin(), s.shape().end());
        zeros.emplace_back(psflow::NumElements(shape), 0.0f);
        refs.push_back({s.name(), "", shape, zeros.back().data(), psflow::DT_FLOAT, s.row_begin()});
      }
      absl::Status st = chief.Init(p, h, std::move(refs), absl::Now() + absl::Seconds(60));
      if (!st.ok()) return psflow::FailWith(absl::StrCat("init: ", st.message()));
    }
  }

  // Lanes: runs of consecutive slices of one ps, about equal in floats.
  std::vector<Lane> lanes;
  for (int p = 0; p < num_ps; ++p) {
    int64_t total = 0;
    for (int64_t n : slice_sizes[p]) total += n;
    const int count = std::min<int>(lanes_per_ps, static_cast<int>(slice_sizes[p].size()));
    const int64_t share = (total + count - 1) / count;
    Lane lane{p, {}};
    int64_t in_lane = 0;
    for (size_t k = 0; k < slice_sizes[p].size(); ++k) {
      lane.slices.push_back(static_cast<int>(k));
      in_lane += slice_sizes[p][k];
      if (in_lane >= share) {
        lanes.push_back(lane);
        lane.slices.clear();
        in_lane = 0;
      }
    }
    if (!lane.slices.empty()) lanes.push_back(lane);
  }

  struct Worker {
    std::unique_ptr<GrpcClient> client;
    std::vector<std::vector<std::vector<float>>> grads;    // [ps][slice]
    std::vector<std::vector<std::vector<float>>> weights;  // [ps][slice]
    double push_ms = 0, step_ms = 0;
    absl::Status status;
  };
  std::vector<Worker> ws(workers);
  for (Worker& w : ws) {
    w.client =
        std::make_unique<GrpcClient>(addresses, psflow::ps::GrpcClientOptions{.connections_per_ps = lanes_per_ps, .shared_memory = absl::GetFlag(FLAGS_shared_memory)});
    w.grads.resize(num_ps);
    w.weights.resize(num_ps);
    for (int p = 0; p < num_ps; ++p) {
      for (int64_t n : slice_sizes[p]) {
        w.grads[p].emplace_back(n, 1e-3f);
        w.weights[p].emplace_back(n, 0.0f);
      }
    }
  }
  const absl::Duration timeout = absl::Seconds(60);
  auto run_worker = [&](int id, Worker& w, int first_step, int count) {
    psflow::ThreadPool pool(static_cast<int>(lanes.size()));
    for (int step = first_step; step < first_step + count && w.status.ok(); ++step) {
      const absl::Time start = absl::Now();
      std::vector<absl::Time> pushed(lanes.size());
      std::vector<absl::Status> results(lanes.size());
      pool.ParallelFor(static_cast<int>(lanes.size()), [&](int l) {
        const Lane& lane = lanes[l];
        psflow::PushHeader header;
        header.set_job_id(job_id);
        header.set_worker(id);
        header.set_step(step);
        std::vector<psflow::TensorRef> refs;
        std::vector<psflow::TensorSink> sinks;
        for (int k : lane.slices) {
          header.add_slices(k);
          const psflow::SliceSpec& spec = headers[lane.ps].slice(k);
          const std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
          refs.push_back(
              {spec.name(), "", shape, w.grads[lane.ps][k].data(), dtype, spec.row_begin()});
          psflow::TensorSink sink;
          sink.name = spec.name();
          sink.shape = shape;
          sink.data = w.weights[lane.ps][k].data();
          sink.dtype = dtype;
          sink.row_begin = spec.row_begin();
          sinks.push_back(std::move(sink));
        }
        absl::StatusOr<psflow::PushResponse> pushed_ok =
            w.client->Push(lane.ps, header, std::move(refs), absl::Now() + timeout);
        pushed[l] = absl::Now();
        if (!pushed_ok.ok()) {
          results[l] = pushed_ok.status();
          return;
        }
        absl::StatusOr<GrpcClient::PullResult> pulled =
            w.client->Pull(lane.ps, job_id, step + 1, lane.slices, std::move(sinks),
                           absl::Now() + timeout, absl::ZeroDuration());
        if (!pulled.ok()) results[l] = pulled.status();
      });
      for (const absl::Status& s : results) {
        if (!s.ok() && w.status.ok()) w.status = s;
      }
      if (step >= first_step && first_step > 0) {
        w.step_ms += absl::ToDoubleMilliseconds(absl::Now() - start);
        w.push_ms +=
            absl::ToDoubleMilliseconds(*std::max_element(pushed.begin(), pushed.end()) - start);
      }
    }
  };
  auto run_all = [&](int first_step, int count) {
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] { run_worker(w, ws[w], first_step, count); });
    }
    for (std::thread& t : threads) t.join();
  };
  run_all(0, 3);  // warm-up: connections, allocations
  for (Worker& w : ws) w.push_ms = w.step_ms = 0;
  const psflow::ResourceUsage before = psflow::ProcessResourceUsage();
  run_all(3, steps);
  const psflow::ResourceUsage after = psflow::ProcessResourceUsage();
  for (const Worker& w : ws) {
    if (!w.status.ok()) return psflow::FailWith(std::string(w.status.message()));
  }
  const double step_ms = ws[0].step_ms / steps;
  const double push_ms = ws[0].push_ms / steps;
  const double bytes = 2.0 * static_cast<double>(floats) * psflow::WireBytes(dtype);
  std::printf(
      "wire model=%s floats=%lld ps=%d workers=%d lanes_per_ps=%d dtype=%s shared_memory=%d "
      "step_ms=%.2f push_ms=%.2f gbps=%.2f cpu_ms=%.2f switches=%.0f\n",
      model_name.c_str(), static_cast<long long>(floats), num_ps, workers, lanes_per_ps,
      wire.c_str(), absl::GetFlag(FLAGS_shared_memory) ? 1 : 0, step_ms, push_ms,
      bytes / (step_ms * 1e-3) / 1e9, (after.cpu_s() - before.cpu_s()) * 1e3 / steps,
      static_cast<double>(after.switches() - before.switches()) / steps);
  for (Server& s : servers) {
    s.shard->Shutdown();
    s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  return 0;
}
