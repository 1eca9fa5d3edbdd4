// Helpers of the network tests: weights and gradients of a Network as
// host vectors, one per variable in ModelVariables order.
#ifndef PSFLOW_TESTS_MODEL_NETWORK_TESTING_H_
#define PSFLOW_TESTS_MODEL_NETWORK_TESTING_H_

#include <vector>

#include "absl/status/status.h"
#include "common/tensor_view.h"
#include "gtest/gtest.h"
#include "model/network.h"

namespace psflow::model {

using Weights = std::vector<std::vector<float>>;

inline absl::Status SetNetWeights(Network& net, const Weights& w) {
  std::vector<const float*> ptrs;
  for (const auto& v : w) ptrs.push_back(v.data());
  return net.SetWeights(ptrs);
}
inline Weights Zeros(const Network& net) {
  Weights out;
  for (const VariableShape& v : net.variables()) out.emplace_back(NumElements(v.shape), 0.0f);
  return out;
}
// Zeros(net) filled by `get` (GetWeights or GetGradients); a failure fails the test.
inline Weights CopyOut(Network& net, absl::Status (Network::*get)(const std::vector<float*>&)) {
  Weights out = Zeros(net);
  std::vector<float*> ptrs;
  for (auto& v : out) ptrs.push_back(v.data());
  absl::Status s = (net.*get)(ptrs);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}
inline Weights NetGradients(Network& net) { return CopyOut(net, &Network::GetGradients); }
inline Weights NetWeights(Network& net) { return CopyOut(net, &Network::GetWeights); }

}  // namespace psflow::model

#endif  // PSFLOW_TESTS_MODEL_NETWORK_TESTING_H_
