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
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "role/command_line.h"
#include "role/process_setup.h"
#include "data/source.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/spec.h"

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

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "psflow-bench-step: %s: %s\n", what.c_str(),
               std::string(s.message()).c_str());
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
  if (!spec.ok()) return Fail("--model", spec.status());
  std::vector<int> batches;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batch_sizes), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(b, &v) || v <= 0) {
      std::fprintf(stderr, "psflow-bench-step: bad --batch_sizes entry '%s'\n",
                   std::string(b).c_str());
      return 1;
    }
    batches.push_back(v);
  }
  std::vector<std::string> modes = absl::StrSplit(absl::GetFlag(FLAGS_modes), ',');
  for (const std::string& m : modes) {
    if (m != "eager" && m != "graph") {
      std::fprintf(stderr, "psflow-bench-step: bad --modes entry '%s'\n", m.c_str());
      return 1;
    }
  }
  const int steps = absl::GetFlag(FLAGS_steps), repeats = absl::GetFlag(FLAGS_repeats);
  if (steps <= 0 || repeats <= 0 || absl::GetFlag(FLAGS_warmup_steps) < 2) {
    std::fprintf(
        stderr, "psflow-bench-step: --steps and --repeats must be positive, --warmup_steps >= 2\n");
    return 1;
  }
  const std::string device = absl::GetFlag(FLAGS_device);
  auto backend = psflow::kernels::CreateBackend(device, absl::GetFlag(FLAGS_threads));
  if (!backend.ok()) return Fail("--device", backend.status());
  // Inputs standardized as a job would (mean and stddev of synthetic pixels).
  spec->mutable_input()->set_mean(0.5f);
  spec->mutable_input()->set_stddev(0.2f);
  const std::vector<std::vector<float>> initial = psflow::model::InitialValues(*spec, 1);
  std::vector<const float*> initial_ptrs;
  for (const auto& v : initial) initial_ptrs.push_back(v.data());

  for (int batch : batches) {
    auto data = psflow::data::LoadDataset(
        {"synthetic", "", batch}, psflow::data::ModelInputOf(*spec), psflow::data::Split::kTrain);
    if (!data.ok()) return Fail("data", data.status());
    std::vector<std::string> runs = modes;
    if (absl::GetFlag(FLAGS_profile)) runs.push_back("profile");
    for (const std::string& mode : runs) {
      psflow::model::NetworkOptions options;
      options.use_graphs = mode == "graph";
      options.profile = mode == "profile";
      options.local_sgd_learning_rate = static_cast<float>(absl::GetFlag(FLAGS_learning_rate));
      auto net = psflow::model::Network::Create(*spec, backend->get(), options);
      if (!net.ok()) return Fail("network", net.status());
      absl::Status s = (*net)->SetWeights(initial_ptrs);
      if (s.ok()) s = (*net)->SetInputs(data->images.data(), data->labels.data(), batch);
      if (!s.ok()) return Fail("inputs", s);
      for (int i = 0; i < absl::GetFlag(FLAGS_warmup_steps); ++i) {
        s = (*net)->StartTrainStep(batch);
        if (s.ok()) s = (*net)->FinishStep(batch).status();
        if (!s.ok()) return Fail("warm-up step", s);
      }
      if (mode == "graph" && !(*net)->UsesGraph(batch)) {
        std::printf("step model=%s device=%s batch=%d mode=graph unavailable\n",
                    spec->name().c_str(), device.c_str(), batch);
        continue;
      }
      if (mode == "profile") {
        for (int i = 0; i < steps && s.ok(); ++i) s = (*net)->StartTrainStep(batch);
        if (!s.ok()) return Fail("step", s);
        std::vector<std::pair<std::string, double>> times = (*net)->LayerTimes();
        double total = 0;
        for (const auto& t : times) total += t.second;
        std::sort(times.begin(), times.end(),
                  [](const auto& a, const auto& b) { return a.second > b.second; });
        std::printf("profile model=%s batch=%d: %.3f ms per step in layers (waiting after each)\n",
                    spec->name().c_str(), batch,
                    total / (steps + absl::GetFlag(FLAGS_warmup_steps)));
        for (size_t i = 0; i < times.size() && i < 15; ++i) {
          std::printf("  %-24s %8.3f ms\n", times[i].first.c_str(),
                      times[i].second / (steps + absl::GetFlag(FLAGS_warmup_steps)));
        }
        continue;
      }
      std::vector<double> ms;
      double loss = 0;
      for (int r = 0; r < repeats; ++r) {
        const absl::Time start = absl::Now();
        for (int i = 0; i < steps && s.ok(); ++i) s = (*net)->StartTrainStep(batch);
        absl::StatusOr<psflow::model::Network::Result> last = (*net)->FinishStep(batch);
        if (!s.ok()) return Fail("step", s);
        if (!last.ok()) return Fail("step", last.status());
        ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start) / steps);
        loss = last->loss;
      }
      std::sort(ms.begin(), ms.end());
      const double median = ms[ms.size() / 2];
      std::printf(
          "step model=%s device=%s batch=%d mode=%s ms=%.3f examples_per_s=%.0f loss=%.4f\n",
          spec->name().c_str(), device.c_str(), batch, mode.c_str(), median,
          batch * 1000.0 / median, loss);
      std::fflush(stdout);
    }
  }
  return 0;
}
