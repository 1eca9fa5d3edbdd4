// psflow-bench-step: training-step time of one model on one device, with no
// parameter server: forward, backward and a plain SGD update of the weights,
// all on the device, fp32, on a synthetic batch that stays on the device.
// bench/gpu_step.sh runs it beside the same step in PyTorch.
//
// Each (batch size, mode) pair prints one line:
//   step model=cnn device=cuda:0 batch=64 mode=graph ms=0.412 examples_per_s=155340
// mode=eager queues every kernel of every step; mode=graph replays the step
// recorded once as a graph (backends that record graphs only).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "data/source.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/spec.h"
#include "role/command_line.h"
#include "role/process_setup.h"

ABSL_FLAG(std::string, model, "cnn", "Model name or spec file.");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda:N.");
ABSL_FLAG(std::string, batch_sizes, "64", "Comma-separated batch sizes.");
ABSL_FLAG(std::string, modes, "eager,graph", "Comma-separated: eager, graph.");
ABSL_FLAG(int, steps, 200, "Timed steps per repeat.");
ABSL_FLAG(int, repeats, 5, "Repeats; the median repeat is reported.");
ABSL_FLAG(int, warmup_steps, 10, "Steps before timing.");
ABSL_FLAG(double, learning_rate, 0.01, "SGD learning rate of the local update.");
ABSL_FLAG(int, threads, 0, "CPU backend threads; 0 = all cores.");
ABSL_FLAG(
    bool, profile, false,
    "Also run each batch size op by op, waiting after every layer, and print the time per layer "
    "and pass (the device idles between layers, so the sum exceeds a real step).");

namespace {

constexpr char kProgram[] = "psflow-bench-step";

// The flags but --model, checked.
struct StepOptions {
  std::string device;
  std::vector<int> batches;
  std::vector<std::string> modes;
  int steps = 0;
  int repeats = 0;
  int warmup_steps = 0;
  float learning_rate = 0;
  int threads = 0;
  bool profile = false;
};

absl::StatusOr<StepOptions> StepOptionsFromFlags() {
  StepOptions o;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("bad --batch_sizes entry '", b, "'"));
    }
    o.batches.push_back(v);
  }
  o.modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& m : o.modes) {
    if (m != "eager" && m != "graph") {
      return absl::InvalidArgumentError(absl::StrCat("bad --modes entry '", m, "'"));
    }
  }
  o.steps = absl::GetFlag(FLAGS_steps);
  o.repeats = absl::GetFlag(FLAGS_repeats);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  if (o.steps <= 0 || o.repeats <= 0 || o.warmup_steps < 2) {
    return absl::InvalidArgumentError(
        "--steps and --repeats must be positive, --warmup_steps >= 2");
  }
  o.device = absl::GetFlag(FLAGS_device);
  o.learning_rate = static_cast<float>(absl::GetFlag(FLAGS_learning_rate));
  o.threads = absl::GetFlag(FLAGS_threads);
  o.profile = absl::GetFlag(FLAGS_profile);
  return o;
}

// `s` with `what` before its message, as the program reports it.
absl::Status In(absl::string_view what, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

// One model on one backend, with its initial weights: runs its step in each mode.
class StepBench {
 public:
  StepBench(const StepOptions& o, const psflow::ModelSpec& spec, psflow::kernels::Backend* backend)
      : o_(o), spec_(spec), backend_(backend), initial_(psflow::model::InitialValues(spec, 1)) {
    for (const auto& v : initial_) initial_ptrs_.push_back(v.data());
  }

  // Every mode (and the profile) at batch size `batch`: one line each.
  absl::Status RunBatch(int batch) {
    auto data =
        psflow::data::LoadDataset(psflow::data::InMemoryData("synthetic", "", batch),
                                  psflow::data::ModelInputOf(spec_), psflow::data::Split::kTrain);
    if (!data.ok()) return In("data", data.status());
    std::vector<std::string> runs = o_.modes;
    if (o_.profile) runs.push_back("profile");
    for (const std::string& mode : runs) {
      if (absl::Status s = RunMode(*data, batch, mode); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  // A network for `mode`, its weights and inputs set, warmed up.
  absl::StatusOr<std::unique_ptr<psflow::model::Network>> WarmNetwork(
      const psflow::data::Dataset& data, int batch, const std::string& mode) {
    psflow::model::NetworkOptions options;
    options.use_graphs = mode == "graph";
    options.profile = mode == "profile";
    options.local_sgd_learning_rate = o_.learning_rate;
    auto net = psflow::model::Network::Create(spec_, backend_, options);
    if (!net.ok()) return In("network", net.status());
    absl::Status s = (*net)->SetWeights(initial_ptrs_);
    if (s.ok()) s = (*net)->SetInputs(data.images.data(), data.labels.data(), batch);
    if (!s.ok()) return In("inputs", s);
    for (int i = 0; i < o_.warmup_steps; ++i) {
      s = (*net)->StartTrainStep(batch);
      if (s.ok()) s = (*net)->FinishStep(batch).status();
      if (!s.ok()) return In("warm-up step", s);
    }
    return std::move(*net);
  }

  absl::Status RunMode(const psflow::data::Dataset& data, int batch, const std::string& mode) {
    absl::StatusOr<std::unique_ptr<psflow::model::Network>> net = WarmNetwork(data, batch, mode);
    if (!net.ok()) return net.status();
    if (mode == "graph" && !(*net)->UsesGraph(batch)) {
      std::printf("step model=%s device=%s batch=%d mode=graph unavailable\n", spec_.name().c_str(),
                  o_.device.c_str(), batch);
      return absl::OkStatus();
    }
    if (mode == "profile") return Profile(**net, batch);
    return Time(**net, batch, mode);
  }

  // Op by op: the time per layer, the slowest 15.
  absl::Status Profile(psflow::model::Network& net, int batch) {
    absl::Status s;
    for (int i = 0; i < o_.steps && s.ok(); ++i) s = net.StartTrainStep(batch);
    if (!s.ok()) return In("step", s);
    std::vector<std::pair<std::string, double>> times = net.LayerTimes();
    double total = 0;
    for (const auto& t : times) total += t.second;
    std::sort(times.begin(), times.end(),
              [](const auto& a, const auto& b) { return a.second > b.second; });
    std::printf("profile model=%s batch=%d: %.3f ms per step in layers (waiting after each)\n",
                spec_.name().c_str(), batch, total / (o_.steps + o_.warmup_steps));
    for (size_t i = 0; i < times.size() && i < 15; ++i) {
      std::printf("  %-24s %8.3f ms\n", times[i].first.c_str(),
                  times[i].second / (o_.steps + o_.warmup_steps));
    }
    return absl::OkStatus();
  }

  // --repeats runs of --steps steps; prints the median repeat.
  absl::Status Time(psflow::model::Network& net, int batch, const std::string& mode) {
    std::vector<double> ms;
    double loss = 0;
    absl::Status s;
    for (int r = 0; r < o_.repeats; ++r) {
      const absl::Time start = absl::Now();
      for (int i = 0; i < o_.steps && s.ok(); ++i) s = net.StartTrainStep(batch);
      absl::StatusOr<psflow::model::Network::Result> last = net.FinishStep(batch);
      if (!s.ok()) return In("step", s);
      if (!last.ok()) return In("step", last.status());
      ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start) / o_.steps);
      loss = last->loss;
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    std::printf("step model=%s device=%s batch=%d mode=%s ms=%.3f examples_per_s=%.0f loss=%.4f\n",
                spec_.name().c_str(), o_.device.c_str(), batch, mode.c_str(), median,
                batch * 1000.0 / median, loss);
    std::fflush(stdout);
    return absl::OkStatus();
  }

  const StepOptions& o_;
  const psflow::ModelSpec& spec_;
  psflow::kernels::Backend* const backend_;
  const std::vector<std::vector<float>> initial_;
  std::vector<const float*> initial_ptrs_;
};

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", kProgram, std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // The same process settings as the role binaries, so that the figures compare.
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv,
                           "milliseconds per local training step (forward, backward, SGD).",
                           {"step_bench.cc"});
  auto spec = psflow::model::ResolveModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) return Fail(In("--model", spec.status()));
  absl::StatusOr<StepOptions> options = StepOptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  auto backend = psflow::kernels::CreateBackend(options->device, options->threads);
  if (!backend.ok()) return Fail(In("--device", backend.status()));
  // Inputs standardized as a job would (mean and stddev of synthetic pixels).
  spec->mutable_input()->set_mean(0.5f);
  spec->mutable_input()->set_stddev(0.2f);
  StepBench bench(*options, *spec, backend->get());
  for (int batch : options->batches) {
    if (absl::Status s = bench.RunBatch(batch); !s.ok()) return Fail(s);
  }
  return 0;
}
