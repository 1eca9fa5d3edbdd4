// psflow-bench-alone: the baseline for bench/throughput.sh. One worker trains
// alone in this process, with no parameter server: the same data shard
// logic, forward/backward and optimizer as a psflow job, with the weights and
// the optimizer held locally. Prints one line: "alone <ex/s>".
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/tensor_view.h"
#include "data/source.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/spec.h"
#include "ps/optimizer.h"
#include "role/command_line.h"
#include "role/process_setup.h"

ABSL_FLAG(std::string, model, "cnn", "Model name or spec file.");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist", "MNIST-format data.");
ABSL_FLAG(int, batch_size, 64, "Examples per step.");
ABSL_FLAG(int, steps, 300, "Measured steps (after --warmup_steps).");
ABSL_FLAG(int, warmup_steps, 20, "Steps run before measuring.");
ABSL_FLAG(int, threads, 0, "CPU threads for the kernels; 0 = all cores.");

int main(int argc, char** argv) {
  // The same process settings as the role binaries, so that the figures compare.
  psflow::SetUpRoleProcess();
  psflow::ParseCommandLine(argc, argv, "examples/s of one worker training alone (no ps).",
                           {"alone_worker.cc"});
  auto spec = psflow::model::ResolveModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) return psflow::FailWith(spec.status());
  const int batch = absl::GetFlag(FLAGS_batch_size);
  if (batch <= 0) return psflow::FailWith("--batch_size must be positive");
  auto data =
      psflow::data::LoadDataset(psflow::data::InMemoryData("idx", absl::GetFlag(FLAGS_data_dir), 0),
                                psflow::data::ModelInputOf(*spec), psflow::data::Split::kTrain);
  if (!data.ok()) return psflow::FailWith(data.status());
  auto backend = psflow::kernels::CreateBackend("cpu", absl::GetFlag(FLAGS_threads));
  if (!backend.ok()) return psflow::FailWith(backend.status());
  auto net = psflow::model::Network::Create(*spec, backend->get());
  if (!net.ok()) return psflow::FailWith(net.status());
  psflow::OptimizerConfig oc;
  oc.set_kind(psflow::OptimizerConfig::ADAM);
  oc.set_learning_rate(0.001f);
  auto opt = psflow::ps::Optimizer::Create(oc);
  if (!opt.ok()) return psflow::FailWith(opt.status());

  // Like the worker, train in the network's own host buffers: the optimizer
  // updates the weights where the next step reads them.
  {
    const std::vector<std::vector<float>> initial = psflow::model::InitialValues(*spec, 1);
    std::vector<const float*> initial_ptrs;
    for (const auto& w : initial) initial_ptrs.push_back(w.data());
    absl::Status s = (*net)->SetWeights(initial_ptrs);
    if (!s.ok()) return psflow::FailWith(s);
  }
  const std::vector<float*> weights = (*net)->HostWeights();
  const std::vector<float*> grads = (*net)->HostGradients();
  if (weights.empty() || grads.size() != weights.size()) {
    return psflow::FailWith(
        "the cpu backend does not compute in host memory: cannot train in place");
  }
  std::vector<int64_t> sizes;
  std::vector<bool> trainable;
  std::vector<std::vector<float>> m, v;
  for (const psflow::VariableShape& var : (*net)->variables()) {
    sizes.push_back(psflow::NumElements(var.shape));
    trainable.push_back(var.trainable);
    m.emplace_back(sizes.back());
    v.emplace_back(sizes.back());
  }
  psflow::data::ShardSampler sampler(data->count, 1, 0, 1);
  std::vector<int64_t> order = sampler.EpochIndices(0);
  std::vector<float> images(static_cast<size_t>(batch) * data->example_floats());
  std::vector<int32_t> labels(batch);
  const int warmup = absl::GetFlag(FLAGS_warmup_steps), steps = absl::GetFlag(FLAGS_steps);
  const int64_t per_epoch = static_cast<int64_t>(order.size()) / batch;
  if (per_epoch == 0) {
    return psflow::FailWith(absl::StrCat("--batch_size ", batch, " exceeds the ", order.size(),
                                         " training examples in ", absl::GetFlag(FLAGS_data_dir)));
  }
  absl::Time start = absl::Now();
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) start = absl::Now();
    const int64_t pos = step % per_epoch;
    absl::Status s =
        psflow::data::GatherBatch(*data, absl::MakeConstSpan(order).subspan(pos * batch, batch),
                                  images.data(), nullptr, labels.data());
    if (!s.ok()) return psflow::FailWith(s);
    auto r = (*net)->TrainStep(images.data(), labels.data(), batch);
    if (!r.ok()) return psflow::FailWith(r.status());
    for (size_t i = 0; i < weights.size(); ++i) {
      if (trainable[i]) {
        (*opt)->Apply(step, weights[i], grads[i], sizes[i], {m[i].data(), v[i].data()});
      } else {  // batch norm's running statistics, as the ps keep them
        psflow::ps::MovingAverageInto(weights[i], grads[i], psflow::ps::kDefaultBnMomentum,
                                      sizes[i]);
      }
    }
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("alone %.1f\n", static_cast<double>(steps) * batch / secs);
  return 0;
}
