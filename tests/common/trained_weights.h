// Test weights of a model as after some training: its initial values, with
// batch norm's running statistics moved away from their starting 0 and 1
// (so that evaluation that uses them differs from one that does not).
#ifndef PSFLOW_TESTS_COMMON_TRAINED_WEIGHTS_H_
#define PSFLOW_TESTS_COMMON_TRAINED_WEIGHTS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "model/spec.h"
#include "proto/model.pb.h"

namespace psflow::testing_weights {

// One vector per model::ModelVariables(spec): the initial values of `seed`,
// running means drawn from [-0.3, 0.3) and running variances from [0.5, 2)
// with `stats_seed`.
inline std::vector<std::vector<float>> WithRunningStatistics(const ModelSpec& spec, uint64_t seed,
                                                             uint32_t stats_seed) {
  std::vector<std::vector<float>> w = model::InitialValues(spec, seed);
  const std::vector<VariableShape> vars = model::ModelVariables(spec);
  std::mt19937 rng(stats_seed);
  std::uniform_real_distribution<float> mean(-0.3f, 0.3f), var(0.5f, 2.0f);
  for (size_t v = 0; v < vars.size(); ++v) {
    if (vars[v].name.ends_with("/running_mean")) {
      for (float& x : w[v]) x = mean(rng);
    } else if (vars[v].name.ends_with("/running_var")) {
      for (float& x : w[v]) x = var(rng);
    }
  }
  return w;
}

}  // namespace psflow::testing_weights

#endif  // PSFLOW_TESTS_COMMON_TRAINED_WEIGHTS_H_
