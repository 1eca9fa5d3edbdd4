// psflow-bench-alone: the baseline for bench/throughput.sh. One worker trains
// alone in this process, with no parameter server: the same data shard
// logic, forward/backward and optimizer as a psflow job, with the weights and
// the optimizer held locally. Prints one line: "alone <ex/s>".
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "common/command_line.h"
#include "data/mnist.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/spec.h"
#include "ps/optimizer.h"

ABSL_FLAG(std::string, model, "cnn", "Model name or spec file.");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist", "MNIST-format data.");
ABSL_FLAG(int, batch_size, 64, "Examples per step.");
ABSL_FLAG(int, steps, 300, "Measured steps (after --warmup_steps).");
ABSL_FLAG(int, warmup_steps, 20, "Steps run before measuring.");
ABSL_FLAG(int, threads, 0, "CPU threads for the kernels; 0 = all cores.");

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  psflow::ParseCommandLine(argc, argv,
                           "examples/s of one worker training alone (no ps).");
  auto spec = psflow::model::ResolveModelSpec(absl::GetFlag(FLAGS_model));
  if (!spec.ok()) return Fail(spec.status());
  auto data = psflow::data::LoadMnist(absl::GetFlag(FLAGS_data_dir), psflow::data::Split::kTrain);
  if (!data.ok()) return Fail(data.status());
  auto backend = psflow::kernels::CreateBackend("cpu", absl::GetFlag(FLAGS_threads));
  if (!backend.ok()) return Fail(backend.status());
  auto net = psflow::model::Network::Create(*spec, backend->get());
  if (!net.ok()) return Fail(net.status());
  psflow::OptimizerConfig oc;
  oc.set_kind(psflow::OptimizerConfig::ADAM);
  oc.set_learning_rate(0.001f);
  auto opt = psflow::ps::Optimizer::Create(oc);
  if (!opt.ok()) return Fail(opt.status());

  std::vector<std::vector<float>> weights = psflow::model::InitialValues(*spec, 1);
  std::vector<std::vector<float>> grads, m, v;
  std::vector<const float*> wp;
  std::vector<float*> gp;
  for (auto& w : weights) {
    grads.emplace_back(w.size());
    m.emplace_back(w.size());
    v.emplace_back(w.size());
    wp.push_back(w.data());
    gp.push_back(grads.back().data());
  }
  const int batch = absl::GetFlag(FLAGS_batch_size);
  psflow::data::ShardSampler sampler(data->count, 1, 0, 1);
  std::vector<int64_t> order = sampler.EpochIndices(0);
  std::vector<float> images(static_cast<size_t>(batch) * data->example_floats());
  std::vector<int32_t> labels(batch);
  const int warmup = absl::GetFlag(FLAGS_warmup_steps), steps = absl::GetFlag(FLAGS_steps);
  const int64_t per_epoch = static_cast<int64_t>(order.size()) / batch;
  absl::Time start = absl::Now();
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) start = absl::Now();
    const int64_t pos = step % per_epoch;
    absl::Status s = psflow::data::GatherBatch(
        *data, absl::MakeConstSpan(order).subspan(pos * batch, batch), images.data(), labels.data());
    if (s.ok()) s = (*net)->SetWeights(wp);
    if (!s.ok()) return Fail(s);
    auto r = (*net)->TrainStep(images.data(), labels.data(), batch);
    if (!r.ok()) return Fail(r.status());
    s = (*net)->GetGradients(gp);
    if (!s.ok()) return Fail(s);
    for (size_t i = 0; i < weights.size(); ++i) {
      (*opt)->Apply(step, weights[i].data(), grads[i].data(), static_cast<int64_t>(weights[i].size()),
                    {m[i].data(), v[i].data()});
    }
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("alone %.1f\n", static_cast<double>(steps) * batch / secs);
  return 0;
}
