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
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/placement.h"
#include "common/thread_pool.h"
#include "model/spec.h"
#include "ps/grpc_client.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "role/command_line.h"
#include "role/process_setup.h"
#include "transport/grpc_util.h"

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

constexpr uint64_t kJobId = 7;
constexpr absl::Duration kTimeout = absl::Seconds(60);

// The flags, checked.
struct WireOptions {
  std::string model;
  int num_ps = 0;
  int workers = 0;
  int lanes_per_ps = 0;  // resolved: never 0
  int steps = 0;
  int apply_threads = 0;
  bool shared_memory = true;
  std::string wire;  // the --wire_dtype as printed
  psflow::DataType dtype = psflow::DT_FLOAT;
  psflow::JobConfig::WireDtype job_dtype = psflow::JobConfig::FP32;
};

absl::Status ParseWireDtype(WireOptions& o) {
  o.wire = absl::AsciiStrToLower(absl::GetFlag(FLAGS_wire_dtype));
  if (o.wire == "fp32") {
    o.dtype = psflow::DT_FLOAT;
    o.job_dtype = psflow::JobConfig::FP32;
  } else if (o.wire == "bf16") {
    o.dtype = psflow::DT_BFLOAT16;
    o.job_dtype = psflow::JobConfig::BF16;
  } else if (o.wire == "fp16") {
    o.dtype = psflow::DT_HALF;
    o.job_dtype = psflow::JobConfig::FP16;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown --wire_dtype '", o.wire, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<WireOptions> WireOptionsFromFlags() {
  WireOptions o;
  o.model = absl::GetFlag(FLAGS_model);
  o.num_ps = absl::GetFlag(FLAGS_ps);
  o.workers = absl::GetFlag(FLAGS_workers);
  const int lanes_flag = absl::GetFlag(FLAGS_lanes_per_ps);
  // As psflow-worker picks them (worker/main.cc).
  o.lanes_per_ps = lanes_flag > 0 ? lanes_flag : std::clamp(16 / std::max(o.num_ps, 1), 1, 8);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  o.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  if (o.num_ps <= 0 || o.workers <= 0 || lanes_flag < 0 || o.steps <= 0 || o.apply_threads <= 0) {
    return absl::InvalidArgumentError(
        "--ps, --workers, --steps and --apply_threads must be positive, --lanes_per_ps not "
        "negative");
  }
  if (absl::Status s = ParseWireDtype(o); !s.ok()) return s;
  return o;
}

// The model's variables placed over the ps as the chief places them.
struct ModelLayout {
  std::vector<psflow::InitHeader> headers;        // [ps]: its slices and the placement
  std::vector<std::vector<int64_t>> slice_sizes;  // [ps][slice]: floats
  int64_t floats = 0;
};

absl::StatusOr<ModelLayout> PlaceModel(const WireOptions& o) {
  absl::StatusOr<psflow::ModelSpec> spec = psflow::model::ResolveModelSpec(o.model);
  if (!spec.ok()) return spec.status();
  absl::StatusOr<psflow::Placement> placement =
      psflow::PlaceVariables(psflow::model::ModelVariables(*spec), o.num_ps);
  if (!placement.ok()) return placement.status();
  ModelLayout layout;
  layout.headers.resize(o.num_ps);
  layout.slice_sizes.resize(o.num_ps);
  for (int p = 0; p < o.num_ps; ++p) {
    for (psflow::SliceSpec& s : psflow::SliceSpecs(*placement, p)) {
      layout.slice_sizes[p].push_back(psflow::NumElements(s.shape()));
      layout.floats += layout.slice_sizes[p].back();
      *layout.headers[p].add_slice() = std::move(s);
    }
    *layout.headers[p].mutable_job()->mutable_placement() = *placement;
  }
  return layout;
}

// One parameter server in this process, as psflow-ps sets it up.
struct Server {
  std::unique_ptr<psflow::ThreadPool> apply_pool;
  std::unique_ptr<psflow::ThreadPool> appliers;
  std::unique_ptr<psflow::ps::Shard> shard;
  std::unique_ptr<psflow::ps::PsService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

absl::Status StartServer(int p, int port, int apply_threads, Server& s) {
  if (apply_threads > 1) s.apply_pool = std::make_unique<psflow::ThreadPool>(apply_threads - 1);
  s.appliers = std::make_unique<psflow::ThreadPool>(std::min(4, apply_threads));
  s.shard = std::make_unique<psflow::ps::Shard>(
      s.apply_pool.get(), psflow::ps::Shard::kDefaultApplyRange, s.appliers.get());
  s.service = std::make_unique<psflow::ps::PsService>(s.shard.get(),
                                                      psflow::ps::PsServiceOptions{.ps_index = p});
  s.address = absl::StrCat("127.0.0.1:", port);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      psflow::StartServer(s.address, s.service.get(), psflow::SecurityOptions{});
  if (!server.ok()) return server.status();
  s.server = std::move(*server);
  return absl::OkStatus();
}

// Starts --ps servers into `servers` and returns their addresses.
absl::StatusOr<std::vector<std::string>> StartServers(const WireOptions& o,
                                                      std::vector<Server>& servers) {
  servers.resize(o.num_ps);
  const std::vector<int> ports = psflow::FreePorts("127.0.0.1", o.num_ps);
  if (static_cast<int>(ports.size()) != o.num_ps) {
    return absl::UnavailableError("no free loopback ports");
  }
  std::vector<std::string> addresses;
  for (int p = 0; p < o.num_ps; ++p) {
    if (absl::Status s = StartServer(p, ports[p], o.apply_threads, servers[p]); !s.ok()) return s;
    addresses.push_back(servers[p].address);
  }
  return addresses;
}

void StopServers(std::vector<Server>& servers) {
  for (Server& s : servers) {
    s.shard->Shutdown();
    s.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
}

// Fills ps `p`'s header for the job: SGD, every worker live.
void FillInitHeader(const WireOptions& o, int p, psflow::InitHeader& h) {
  h.set_job_id(kJobId);
  h.set_ps_index(p);
  h.set_version(0);
  psflow::JobConfig* job = h.mutable_job();
  job->mutable_optimizer()->set_kind(psflow::OptimizerConfig::SGD);
  job->mutable_optimizer()->set_learning_rate(1e-6f);
  job->set_wire_dtype(o.job_dtype);
  job->set_num_workers(o.workers);
  job->set_num_ps(o.num_ps);
  for (int w = 0; w < o.workers; ++w) h.add_live_workers(w);
}

// Inits every ps, as the chief would, with values zero.
absl::Status InitServers(const WireOptions& o, const std::vector<std::string>& addresses,
                         std::vector<psflow::InitHeader>& headers) {
  GrpcClient chief(addresses);
  for (int p = 0; p < o.num_ps; ++p) {
    psflow::InitHeader& h = headers[p];
    FillInitHeader(o, p, h);
    std::vector<std::vector<float>> zeros;
    std::vector<psflow::TensorRef> refs;
    zeros.reserve(h.slice_size());
    for (const psflow::SliceSpec& s : h.slice()) {
      const std::vector<int64_t> shape(s.shape().begin(), s.shape().end());
      zeros.emplace_back(psflow::NumElements(shape), 0.0f);
      refs.push_back({s.name(), "", shape, zeros.back().data(), psflow::DT_FLOAT, s.row_begin()});
    }
    absl::Status st = chief.Init(p, h, std::move(refs), absl::Now() + kTimeout);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat("init: ", st.message()));
  }
  return absl::OkStatus();
}

struct Lane {
  int ps = 0;
  std::vector<int> slices;  // indices into the ps's slices
};

// Lanes: runs of consecutive slices of one ps, about equal in floats.
std::vector<Lane> CutLanes(const std::vector<std::vector<int64_t>>& slice_sizes, int lanes_per_ps) {
  std::vector<Lane> lanes;
  for (int p = 0; p < static_cast<int>(slice_sizes.size()); ++p) {
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
  return lanes;
}

// One worker: its connections, gradients to push and weights to pull into.
struct Worker {
  std::unique_ptr<GrpcClient> client;
  std::vector<std::vector<std::vector<float>>> grads;    // [ps][slice]
  std::vector<std::vector<std::vector<float>>> weights;  // [ps][slice]
  double push_ms = 0, step_ms = 0;
  absl::Status status;
};

std::vector<Worker> MakeWorkers(const WireOptions& o, const std::vector<std::string>& addresses,
                                const std::vector<std::vector<int64_t>>& slice_sizes) {
  std::vector<Worker> ws(o.workers);
  for (Worker& w : ws) {
    w.client = std::make_unique<GrpcClient>(
        addresses, psflow::ps::GrpcClientOptions{.connections_per_ps = o.lanes_per_ps,
                                                 .shared_memory = o.shared_memory});
    w.grads.resize(o.num_ps);
    w.weights.resize(o.num_ps);
    for (int p = 0; p < o.num_ps; ++p) {
      for (int64_t n : slice_sizes[p]) {
        w.grads[p].emplace_back(n, 1e-3f);
        w.weights[p].emplace_back(n, 0.0f);
      }
    }
  }
  return ws;
}

// The workers' synchronous steps over the lanes, each worker on its own thread.
class Exchange {
 public:
  Exchange(const WireOptions& o, const std::vector<psflow::InitHeader>& headers,
           std::vector<Lane> lanes, std::vector<Worker>& workers)
      : o_(o), headers_(headers), lanes_(std::move(lanes)), workers_(workers) {}

  // Steps [first_step, first_step + count) of every worker, at once.
  void RunAll(int first_step, int count) {
    std::vector<std::thread> threads;
    for (int w = 0; w < o_.workers; ++w) {
      threads.emplace_back([&, w] { RunWorker(w, workers_[w], first_step, count); });
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  void RunWorker(int id, Worker& w, int first_step, int count) {
    psflow::ThreadPool pool(static_cast<int>(lanes_.size()));
    for (int step = first_step; step < first_step + count && w.status.ok(); ++step) {
      const absl::Time start = absl::Now();
      std::vector<absl::Time> pushed(lanes_.size());
      std::vector<absl::Status> results(lanes_.size());
      pool.ParallelFor(static_cast<int>(lanes_.size()), [&](int l) {
        results[l] = ExchangeLane(lanes_[l], id, step, w, pushed[l]);
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
  }

  // One lane of one step: pushes its gradients of `step` (noting in `pushed`
  // when the push is answered), then pulls its slices of version step + 1.
  absl::Status ExchangeLane(const Lane& lane, int id, int step, Worker& w, absl::Time& pushed) {
    psflow::PushHeader header;
    header.set_job_id(kJobId);
    header.set_worker(id);
    header.set_step(step);
    std::vector<psflow::TensorRef> refs;
    std::vector<psflow::TensorSink> sinks;
    for (int k : lane.slices) {
      header.add_slices(k);
      const psflow::SliceSpec& spec = headers_[lane.ps].slice(k);
      const std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
      refs.push_back(
          {spec.name(), "", shape, w.grads[lane.ps][k].data(), o_.dtype, spec.row_begin()});
      psflow::TensorSink sink;
      sink.name = spec.name();
      sink.shape = shape;
      sink.data = w.weights[lane.ps][k].data();
      sink.dtype = o_.dtype;
      sink.row_begin = spec.row_begin();
      sinks.push_back(std::move(sink));
    }
    absl::StatusOr<psflow::PushResponse> pushed_ok =
        w.client->Push(lane.ps, header, std::move(refs), absl::Now() + kTimeout);
    pushed = absl::Now();
    if (!pushed_ok.ok()) return pushed_ok.status();
    absl::StatusOr<GrpcClient::PullResult> pulled =
        w.client->Pull(lane.ps, kJobId, step + 1, lane.slices, std::move(sinks),
                       absl::Now() + kTimeout, absl::ZeroDuration());
    return pulled.status();
  }

  const WireOptions& o_;
  const std::vector<psflow::InitHeader>& headers_;
  const std::vector<Lane> lanes_;
  std::vector<Worker>& workers_;
};

// The process's resource usage around the timed steps.
struct Usage {
  psflow::ResourceUsage before, after;
};

// Warm-up, then the timed steps; the workers' statuses and times are in `ws`.
Usage Measure(const WireOptions& o, const ModelLayout& layout, std::vector<Worker>& ws) {
  Exchange exchange(o, layout.headers, CutLanes(layout.slice_sizes, o.lanes_per_ps), ws);
  exchange.RunAll(0, 3);  // warm-up: connections, allocations
  for (Worker& w : ws) w.push_ms = w.step_ms = 0;
  Usage usage;
  usage.before = psflow::ProcessResourceUsage();
  exchange.RunAll(3, o.steps);
  usage.after = psflow::ProcessResourceUsage();
  return usage;
}

void PrintResult(const WireOptions& o, int64_t floats, const Worker& w, const Usage& usage) {
  const psflow::ResourceUsage& before = usage.before;
  const psflow::ResourceUsage& after = usage.after;
  const double step_ms = w.step_ms / o.steps;
  const double push_ms = w.push_ms / o.steps;
  const double bytes = 2.0 * static_cast<double>(floats) * psflow::WireBytes(o.dtype);
  std::printf(
      "wire model=%s floats=%lld ps=%d workers=%d lanes_per_ps=%d dtype=%s shared_memory=%d "
      "step_ms=%.2f push_ms=%.2f gbps=%.2f cpu_ms=%.2f switches=%.0f\n",
      o.model.c_str(), static_cast<long long>(floats), o.num_ps, o.workers, o.lanes_per_ps,
      o.wire.c_str(), o.shared_memory ? 1 : 0, step_ms, push_ms, bytes / (step_ms * 1e-3) / 1e9,
      (after.cpu_s() - before.cpu_s()) * 1e3 / o.steps,
      static_cast<double>(after.switches() - before.switches()) / o.steps);
}

}  // namespace

int main(int argc, char** argv) {
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv,
                           "milliseconds per synchronous exchange (push, then pull) through "
                           "parameter servers on loopback, without a model.",
                           {"ps_wire.cc"});
  absl::StatusOr<WireOptions> options = WireOptionsFromFlags();
  if (!options.ok()) return psflow::FailWith(options.status());
  const WireOptions& o = *options;
  absl::StatusOr<ModelLayout> layout = PlaceModel(o);
  if (!layout.ok()) return psflow::FailWith(layout.status());
  std::vector<Server> servers;
  absl::StatusOr<std::vector<std::string>> addresses = StartServers(o, servers);
  if (!addresses.ok()) return psflow::FailWith(addresses.status());
  if (absl::Status s = InitServers(o, *addresses, layout->headers); !s.ok()) {
    return psflow::FailWith(s);
  }
  std::vector<Worker> ws = MakeWorkers(o, *addresses, layout->slice_sizes);
  const Usage usage = Measure(o, *layout, ws);
  for (const Worker& w : ws) {
    if (!w.status.ok()) return psflow::FailWith(w.status);
  }
  PrintResult(o, layout->floats, ws[0], usage);
  StopServers(servers);
  return 0;
}
