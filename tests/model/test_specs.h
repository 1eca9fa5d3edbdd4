// Small model specs in text format that several tests train or evaluate, each
// written once: the network tests, the evaluation tests and the cluster tests
// must agree on them (sizes are quoted in the tests' expectations).
#ifndef PSFLOW_TESTS_MODEL_TEST_SPECS_H_
#define PSFLOW_TESTS_MODEL_TEST_SPECS_H_

#include <google/protobuf/text_format.h>

#include "gtest/gtest.h"
#include "proto/model.pb.h"

namespace psflow::model {

// input 1x8x8 -> conv 3@3x3 (3x6x6) -> relu -> max-pool 2 (3x3x3) -> dense 4:
// 142 floats of weights and 285 floats per example in a forward pass
// (tests/model/network_test.cc).
inline constexpr char kSmallSpec[] = R"spec(
  name: "small"
  input { channels: 1 height: 8 width: 8 }
  num_classes: 4
  layer { name: "conv" conv2d { filters: 3 kernel: 3 } }
  layer { name: "relu" relu {} }
  layer { name: "pool" max_pool { size: 2 } }
  layer { name: "fc" dense { units: 4 } }
)spec";

// Batch norm, so that evaluation depends on the running statistics.
inline constexpr char kBatchNormSpec[] = R"spec(
  name: "small_bn"
  input { channels: 3 height: 8 width: 8 }
  num_classes: 10
  layer { name: "conv1" conv2d { filters: 8 kernel: 3 padding: 1 no_bias: true } }
  layer { name: "bn1" batch_norm {} }
  layer { name: "relu1" relu {} }
  layer { name: "conv2" conv2d { filters: 16 kernel: 3 padding: 1 stride: 2 no_bias: true } }
  layer { name: "bn2" batch_norm {} }
  layer { name: "relu2" relu {} }
  layer { name: "pool" global_avg_pool {} }
  layer { name: "fc" dense { units: 10 } }
)spec";

// `text` parsed; a spec that does not parse fails the calling test.
inline ModelSpec ParseSpec(const char* text) {
  ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec));
  return spec;
}

}  // namespace psflow::model

#endif  // PSFLOW_TESTS_MODEL_TEST_SPECS_H_
