#include "model/spec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::model {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/", name);
  std::ofstream(path) << text;
  return path;
}

ModelSpec Parse(const std::string& text) {
  ModelSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Flatten(
    const std::vector<VariableShape>& vars) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const VariableShape& v : vars) out.emplace_back(v.name, v.shape);
  return out;
}

using Var = std::pair<std::string, std::vector<int64_t>>;

TEST(SpecTest, BuiltinsResolve) {
  EXPECT_THAT(BuiltinModelNames(), ElementsAre("cnn", "mlp", "resnet"));
  for (const std::string& name : BuiltinModelNames()) {
    absl::StatusOr<ModelSpec> spec = ResolveModelSpec(name);
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    EXPECT_EQ(spec->name(), name);
    EXPECT_EQ(spec->num_classes(), 10);
    EXPECT_TRUE(ValidateModelSpec(*spec).ok());
  }
}

TEST(SpecTest, CnnVariablesAndShapes) {
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec("cnn");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(Flatten(ModelVariables(*spec)),
              ElementsAre(Var{"conv1/weights", {20, 1, 5, 5}}, Var{"conv1/bias", {20}},
                          Var{"conv2/weights", {50, 20, 5, 5}}, Var{"conv2/bias", {50}},
                          Var{"fc1/weights", {500, 800}}, Var{"fc1/bias", {500}},
                          Var{"fc2/weights", {10, 500}}, Var{"fc2/bias", {10}}));
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(*spec);
  ASSERT_TRUE(shapes.ok());
  std::vector<std::vector<int>> got;
  for (const ActivationShape& s : *shapes) got.push_back({s.channels, s.height, s.width});
  EXPECT_EQ(got, (std::vector<std::vector<int>>{{20, 24, 24},
                                                {20, 24, 24},
                                                {20, 12, 12},
                                                {50, 8, 8},
                                                {50, 8, 8},
                                                {50, 4, 4},
                                                {500, 1, 1},
                                                {500, 1, 1},
                                                {10, 1, 1}}));
}

TEST(SpecTest, MlpVariables) {
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec("mlp");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(Flatten(ModelVariables(*spec)),
              ElementsAre(Var{"fc1/weights", {256, 784}}, Var{"fc1/bias", {256}},
                          Var{"fc2/weights", {256, 256}}, Var{"fc2/bias", {256}},
                          Var{"fc3/weights", {10, 256}}, Var{"fc3/bias", {10}}));
}

// A sample of ResNet-18's variables and their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> ResnetSampleShapes() {
  return {
      {"conv1/weights", {64, 3, 3, 3}},
      {"bn1/gamma", {64}},
      {"bn1/beta", {64}},
      {"bn1/running_mean", {64}},
      {"bn1/running_var", {64}},
      {"s4b1_proj_bn/running_var", {512}},
      {"s1b1_conv1/weights", {64, 64, 3, 3}},
      {"s1b2_conv2/weights", {64, 64, 3, 3}},
      {"s2b1_conv1/weights", {128, 64, 3, 3}},
      {"s2b1_conv2/weights", {128, 128, 3, 3}},
      {"s2b1_bn2/gamma", {128}},
      {"s2b1_proj/weights", {128, 64, 1, 1}},
      {"s2b1_proj_bn/gamma", {128}},
      {"s2b1_proj_bn/beta", {128}},
      {"s3b1_proj/weights", {256, 128, 1, 1}},
      {"s4b1_proj/weights", {512, 256, 1, 1}},
      {"s4b2_conv2/weights", {512, 512, 3, 3}},
      {"s4b2_bn2/beta", {512}},
      {"fc/weights", {10, 512}},
      {"fc/bias", {10}},
  };
}

// Each of ResNet-18's variables once, only the running statistics not
// trainable, no convolution with a bias; the shapes of a sample of them, and
// the number of trainable floats and of running statistics.
void ExpectResnetVariables(const ModelSpec& spec) {
  const std::vector<VariableShape> vars = ModelVariables(spec);
  // conv1 + bn1 (1 + 4: gamma, beta, running mean and variance), 8 blocks of
  // conv1, bn1, conv2, bn2 (10 each), the projections of stages 2-4 (conv +
  // bn: 5 each), fc (2).
  ASSERT_EQ(vars.size(), 5u + 8 * 10 + 3 * 5 + 2);
  std::map<std::string, std::vector<int64_t>> by_name;
  int64_t total = 0, statistics = 0;
  for (const VariableShape& v : vars) {
    EXPECT_TRUE(by_name.emplace(v.name, v.shape).second) << v.name << " twice";
    const bool running = v.name.find("/running_") != std::string::npos;
    EXPECT_EQ(v.trainable, !running) << v.name;
    (running ? statistics : total) += NumElements(v.shape);
    // Every convolution is followed by batch norm and has no bias.
    EXPECT_FALSE(v.name.find("conv") != std::string::npos &&
                 v.name.find("/bias") != std::string::npos)
        << v.name;
    EXPECT_FALSE(v.name.find("proj/") != std::string::npos &&
                 v.name.find("/bias") != std::string::npos)
        << v.name;
  }
  EXPECT_EQ(vars.front().name, "conv1/weights");
  EXPECT_EQ(vars.back().name, "fc/bias");
  for (const auto& [name, shape] : ResnetSampleShapes()) EXPECT_EQ(by_name[name], shape) << name;

  // Stage 1 keeps 64 channels at stride 1: identity shortcuts, no projection.
  EXPECT_EQ(by_name.count("s1b1_proj/weights"), 0u);
  EXPECT_EQ(by_name.count("s2b2_proj/weights"), 0u);

  // Counted by hand from the ResNet-18 CIFAR layout:
  //   stem:    conv 3*3*3*64 = 1,728 + bn 128                             =     1,856
  //   stage 1: 2 blocks * (2 * 3*3*64*64 + 2 bn * 128)                    =   147,968
  //   stage 2: 3*3*64*128 + 3*3*128*128 + 512 + proj 64*128 + 256
  //            + 2 * 3*3*128*128 + 512                                    =   525,568
  //   stage 3: 3*3*128*256 + 3*3*256*256 + 1,024 + proj 128*256 + 512
  //            + 2 * 3*3*256*256 + 1,024                                  = 2,099,712
  //   stage 4: 3*3*256*512 + 3*3*512*512 + 2,048 + proj 256*512 + 1,024
  //            + 2 * 3*3*512*512 + 2,048                                  = 8,393,728
  //   fc:      512*10 + 10                                                =     5,130
  // = 11,173,962 (the usual figure for ResNet-18 on CIFAR-10).
  EXPECT_EQ(total, 11173962);
  // Two running statistics per batch-norm channel: 64 (stem) + 4 * 64 +
  // 5 * 128 + 5 * 256 + 5 * 512 = 4,800 channels.
  EXPECT_EQ(statistics, 2 * 4800);
}

// Which variables the first layers of ResNet-18 own.
void ExpectResnetLayerVariables(const ModelSpec& spec) {
  const std::vector<LayerVariables> layer_vars = LayerVariableIndices(spec);
  ASSERT_EQ(static_cast<int>(layer_vars.size()), spec.layer_size());
  EXPECT_EQ(layer_vars[0].first, 0);
  EXPECT_EQ(layer_vars[0].second, -1) << "conv1 has no bias";
  EXPECT_EQ(layer_vars[1].first, 1);
  EXPECT_EQ(layer_vars[1].second, 2);
  EXPECT_EQ(layer_vars[1].running_mean, 3);
  EXPECT_EQ(layer_vars[1].running_var, 4);
  EXPECT_EQ(layer_vars[0].running_mean, -1) << "conv1 has no statistics";
  EXPECT_EQ(layer_vars[2].first, -1) << "relu has no variables";
  EXPECT_EQ(layer_vars[3].first, 5);
}

// ResNet-18's layers and a sample of their output shapes: each stage halves
// the height and width and doubles the channels.
void ExpectResnetActivationShapes(const ModelSpec& spec) {
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  ASSERT_EQ(static_cast<int>(shapes->size()), spec.layer_size());
  // Stem, 8 blocks of 7 layers, 3 projections of 2 more, pool, fc.
  EXPECT_EQ(spec.layer_size(), 3 + 8 * 7 + 3 * 2 + 2);
  std::map<std::string, std::vector<int>> act;
  for (int i = 0; i < spec.layer_size(); ++i) {
    const ActivationShape& s = (*shapes)[i];
    act[spec.layer(i).name()] = {s.channels, s.height, s.width};
  }
  const std::vector<std::pair<std::string, std::vector<int>>> want = {
      {"relu1", {64, 32, 32}},      {"s1b2_relu2", {64, 32, 32}},  {"s2b1_conv1", {128, 16, 16}},
      {"s2b1_proj", {128, 16, 16}}, {"s2b2_relu2", {128, 16, 16}}, {"s3b2_relu2", {256, 8, 8}},
      {"s4b2_relu2", {512, 4, 4}},
  };
  for (const auto& [name, shape] : want) EXPECT_EQ(act[name], shape) << name;
  const ActivationShape& pool = (*shapes)[spec.layer_size() - 2];
  EXPECT_EQ(spec.layer(spec.layer_size() - 2).name(), "pool");
  EXPECT_EQ((std::vector<int>{pool.channels, pool.height, pool.width}),
            (std::vector<int>{512, 1, 1}));
  const ActivationShape& logits = shapes->back();
  EXPECT_EQ((std::vector<int>{logits.channels, logits.height, logits.width}),
            (std::vector<int>{10, 1, 1}));
}

// The shortcut wiring: a projection reads the block input; each add reads
// the main path and the shortcut.
void ExpectResnetWiring(const ModelSpec& spec) {
  absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(spec);
  ASSERT_TRUE(wiring.ok()) << wiring.status();
  std::map<std::string, int> index;
  for (int i = 0; i < spec.layer_size(); ++i) index[spec.layer(i).name()] = i;
  auto wire = [&](const std::string& name) { return (*wiring)[index.at(name)]; };
  EXPECT_EQ(wire("conv1").input, -1) << "reads the model input";
  EXPECT_EQ(wire("s1b1_add").input, index["s1b1_bn2"]);
  EXPECT_THAT(wire("s1b1_add").others, ElementsAre(index["relu1"]));
  EXPECT_THAT(wire("s1b2_add").others, ElementsAre(index["s1b1_relu2"]));
  EXPECT_EQ(wire("s2b1_proj").input, index["s1b2_relu2"]);
  EXPECT_EQ(wire("s2b1_add").input, index["s2b1_bn2"]);
  EXPECT_THAT(wire("s2b1_add").others, ElementsAre(index["s2b1_proj_bn"]));
  EXPECT_EQ(wire("s2b1_conv1").input, index["s1b2_relu2"]);
  EXPECT_EQ(wire("s2b1_relu2").input, index["s2b1_add"]);
  EXPECT_TRUE(wire("fc").others.empty());
}

TEST(SpecTest, ResnetVariablesAndShapes) {
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec("resnet");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "resnet");
  EXPECT_EQ(spec->input().channels(), 3);
  EXPECT_EQ(spec->input().height(), 32);
  EXPECT_EQ(spec->input().width(), 32);
  EXPECT_EQ(spec->num_classes(), 10);
  ASSERT_NO_FATAL_FAILURE(ExpectResnetVariables(*spec));
  ASSERT_NO_FATAL_FAILURE(ExpectResnetLayerVariables(*spec));
  ASSERT_NO_FATAL_FAILURE(ExpectResnetActivationShapes(*spec));
  ExpectResnetWiring(*spec);
}

// A residual block in text format: every new layer kind and `input`.
constexpr char kResidualSpec[] = R"spec(
  name: "tiny_residual"
  input { channels: 2 height: 6 width: 6 }
  num_classes: 3
  layer { name: "c1" conv2d { filters: 4 kernel: 3 padding: 1 no_bias: true } }
  layer { name: "bn1" batch_norm {} }
  layer { name: "r1" relu {} }
  layer { name: "c2" conv2d { filters: 4 kernel: 3 padding: 1 no_bias: true } }
  layer { name: "bn2" batch_norm { epsilon: 1e-3 } }
  layer { name: "sum" add { other: "r1" } }
  layer { name: "r2" relu {} }
  layer { name: "down" input: "r2" conv2d { filters: 5 kernel: 1 stride: 2 } }
  layer { name: "gap" global_avg_pool {} }
  layer { name: "out" dense { units: 3 } }
)spec";

TEST(SpecTest, ResidualSpecInTextFormatLoads) {
  const std::string path = WriteTemp("residual_spec.pbtxt", kResidualSpec);
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec(path);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "tiny_residual");
  ASSERT_EQ(spec->layer_size(), 10);
  EXPECT_TRUE(spec->layer(0).conv2d().no_bias());
  EXPECT_FLOAT_EQ(spec->layer(4).batch_norm().epsilon(), 1e-3f);
  EXPECT_EQ(spec->layer(5).add().other(), "r1");
  EXPECT_EQ(spec->layer(7).input(), "r2");
  EXPECT_TRUE(spec->layer(8).has_global_avg_pool());
  EXPECT_THAT(Flatten(ModelVariables(*spec)),
              ElementsAre(Var{"c1/weights", {4, 2, 3, 3}}, Var{"bn1/gamma", {4}},
                          Var{"bn1/beta", {4}}, Var{"bn1/running_mean", {4}},
                          Var{"bn1/running_var", {4}}, Var{"c2/weights", {4, 4, 3, 3}},
                          Var{"bn2/gamma", {4}}, Var{"bn2/beta", {4}}, Var{"bn2/running_mean", {4}},
                          Var{"bn2/running_var", {4}}, Var{"down/weights", {5, 4, 1, 1}},
                          Var{"down/bias", {5}}, Var{"out/weights", {3, 5}}, Var{"out/bias", {3}}));
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(*spec);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  std::vector<std::vector<int>> got;
  for (const ActivationShape& s : *shapes) got.push_back({s.channels, s.height, s.width});
  EXPECT_EQ(got, (std::vector<std::vector<int>>{{4, 6, 6},
                                                {4, 6, 6},
                                                {4, 6, 6},
                                                {4, 6, 6},
                                                {4, 6, 6},
                                                {4, 6, 6},
                                                {4, 6, 6},
                                                {5, 3, 3},
                                                {5, 1, 1},
                                                {3, 1, 1}}));
  absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(*spec);
  ASSERT_TRUE(wiring.ok()) << wiring.status();
  std::vector<std::pair<int, int>> wires;
  for (const LayerWiring& w : *wiring) {
    wires.emplace_back(w.input, w.others.empty() ? -1 : w.others[0]);
  }
  EXPECT_EQ(wires, (std::vector<std::pair<int, int>>{{-1, -1},
                                                     {0, -1},
                                                     {1, -1},
                                                     {2, -1},
                                                     {3, -1},
                                                     {4, 2},
                                                     {5, -1},
                                                     {6, -1},
                                                     {7, -1},
                                                     {8, -1}}));
  const std::vector<LayerVariables> lv = LayerVariableIndices(*spec);
  ASSERT_EQ(lv.size(), 10u);
  EXPECT_EQ(lv[0].first, 0);
  EXPECT_EQ(lv[0].second, -1);
  EXPECT_EQ(lv[1].running_mean, 3);
  EXPECT_EQ(lv[1].running_var, 4);
  EXPECT_EQ(lv[4].first, 6);
  EXPECT_EQ(lv[4].second, 7);
  EXPECT_EQ(lv[4].running_mean, 8);
  EXPECT_EQ(lv[4].running_var, 9);
  EXPECT_EQ(lv[5].first, -1) << "add has no variables";
  EXPECT_EQ(lv[7].first, 10);
  EXPECT_EQ(lv[7].second, 11);
  EXPECT_EQ(lv[7].running_mean, -1);
  EXPECT_EQ(lv[9].first, 12);
  EXPECT_EQ(lv[9].second, 13);
}

// Wiring and add-shape mistakes: INVALID_ARGUMENT naming the layer, from
// ValidateModelSpec and ResolveModelSpec alike, and no variables. ResolveWiring
// gives the same answer for wiring mistakes and resolves the wiring of specs
// whose only fault is a shape mismatch.
TEST(SpecTest, WiringErrorsNameTheLayer) {
  struct Case {
    const char* what;
    const char* layers;
    const char* message;
    bool wiring_resolves = false;  // a shape mismatch, not a wiring mistake
  };
  const Case cases[] = {
      {"input names an unknown layer",
       "layer { name: \"a\" relu {} } layer { name: \"b\" input: \"nope\" dense { units: 3 } }",
       "layer 'b': input 'nope' is not an earlier layer"},
      {"input names a later layer",
       "layer { name: \"a\" input: \"b\" relu {} } layer { name: \"b\" dense { units: 3 } }",
       "layer 'a': input 'b' is not an earlier layer"},
      {"input names the layer itself",
       "layer { name: \"a\" input: \"a\" relu {} } layer { name: \"b\" dense { units: 3 } }",
       "layer 'a': input 'a' is not an earlier layer"},
      {"add.other unknown",
       "layer { name: \"a\" relu {} } layer { name: \"s\" add { other: \"ghost\" } } "
       "layer { name: \"d\" dense { units: 3 } }",
       "layer 's': add.other 'ghost' is not an earlier layer"},
      {"add.other a later layer",
       "layer { name: \"a\" relu {} } layer { name: \"s\" add { other: \"d\" } } "
       "layer { name: \"d\" dense { units: 3 } }",
       "layer 's': add.other 'd' is not an earlier layer"},
      {"add shapes differ",
       "layer { name: \"c\" conv2d { filters: 2 kernel: 3 padding: 1 } } layer { name: \"r\" relu "
       "{} } "
       "layer { name: \"p\" max_pool { size: 2 } } layer { name: \"s\" add { other: \"r\" } } "
       "layer { name: \"d\" dense { units: 3 } }",
       "layer 's': adds 2x8x8 from 'r' to its 2x4x4 input", true},
      {"add channels differ",
       "layer { name: \"c\" conv2d { filters: 2 kernel: 3 padding: 1 } } "
       "layer { name: \"s\" add { other: \"c\" } input: \"c\" } "
       "layer { name: \"c3\" input: \"s\" conv2d { filters: 3 kernel: 1 } } "
       "layer { name: \"s2\" add { other: \"s\" } } layer { name: \"d\" dense { units: 3 } }",
       "layer 's2': adds 2x8x8 from 's' to its 3x8x8 input", true},
      {"an output never read",
       "layer { name: \"c\" conv2d { filters: 2 kernel: 3 } } layer { name: \"dead\" relu {} } "
       "layer { name: \"d\" input: \"c\" dense { units: 3 } }",
       "layer 'dead': its output is never read"},
      {"duplicate names",
       "layer { name: \"x\" relu {} } layer { name: \"y\" relu {} } layer { name: \"x\" dense { "
       "units: 3 } }",
       "layer 'x': name used twice"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const ModelSpec spec =
        Parse(absl::StrCat("input { channels: 1 height: 8 width: 8 } num_classes: 3 ", c.layers));
    absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
    EXPECT_EQ(shapes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(shapes.status().message()), HasSubstr(c.message));
    const std::string path = WriteTemp(
        "wiring_error.pbtxt",
        absl::StrCat("input { channels: 1 height: 8 width: 8 } num_classes: 3 ", c.layers));
    absl::StatusOr<ModelSpec> resolved = ResolveModelSpec(path);
    EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(resolved.status().message()), HasSubstr(c.message));
    EXPECT_TRUE(ModelVariables(spec).empty());
    absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(spec);
    if (c.wiring_resolves) {
      EXPECT_TRUE(wiring.ok()) << wiring.status();
    } else {
      EXPECT_EQ(wiring.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(wiring.status().message()), HasSubstr(c.message));
    }
  }
  const ModelSpec unknown = Parse(
      "input { channels: 1 height: 8 width: 8 } num_classes: 3 "
      "layer { name: \"a\" relu {} } layer { name: \"b\" input: \"nope\" dense { units: 3 } }");
  EXPECT_EQ(ResolveWiring(unknown).status().code(), absl::StatusCode::kInvalidArgument);
}

constexpr char kUserSpec[] = R"spec(
  # A small model with stride and padding.
  input { channels: 3 height: 10 width: 10 }
  num_classes: 5
  layer { name: "c" conv2d { filters: 4 kernel: 3 stride: 2 padding: 1 } }
  layer { name: "r" relu {} }
  layer { name: "p" max_pool { size: 3 stride: 1 } }
  layer { name: "out" dense { units: 5 } }
)spec";

TEST(SpecTest, UserSpecFileLoads) {
  const std::string path = WriteTemp("user_spec.pbtxt", kUserSpec);
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec(path);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), path) << "an unnamed spec is named after its file";
  EXPECT_EQ(spec->layer_size(), 4);
  // conv: (10 + 2 - 3) / 2 + 1 = 5; pool 3 stride 1: 3.
  EXPECT_THAT(Flatten(ModelVariables(*spec)),
              ElementsAre(Var{"c/weights", {4, 3, 3, 3}}, Var{"c/bias", {4}},
                          Var{"out/weights", {5, 4 * 3 * 3}}, Var{"out/bias", {5}}));
}

TEST(SpecTest, MalformedTextNamesTheLine) {
  const std::string path = WriteTemp("bad_syntax.pbtxt",
                                     "input { channels: 1 height: 4 width: 4 }\n"
                                     "num_classes: 2\n"
                                     "layer { name: \"d\" dense { unitz: 2 } }\n");
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec(path);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("line 3"));
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr(path));
}

TEST(SpecTest, MissingFileIsAnError) {
  absl::StatusOr<ModelSpec> spec =
      ResolveModelSpec(absl::StrCat(::testing::TempDir(), "/no_such_spec"));
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("no_such_spec"));
  // The message lists every built-in model.
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("cnn, mlp, resnet"));
  EXPECT_FALSE(ResolveModelSpec("resnet50").ok());
  EXPECT_FALSE(ResolveModelSpec("").ok());
}

TEST(SpecTest, InvalidSpecInFileIsRejected) {
  const std::string path = WriteTemp("invalid.pbtxt",
                                     "input { channels: 1 height: 4 width: 4 }\n"
                                     "num_classes: 2\n"
                                     "layer { name: \"d\" dense { units: 3 } }\n");
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec(path);
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("num_classes"));
}

struct InvalidCase {
  const char* what;
  const char* text;
  const char* message;
};

class InvalidSpecTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidSpecTest, Rejected) {
  const InvalidCase& c = GetParam();
  absl::StatusOr<std::vector<ActivationShape>> r = ValidateModelSpec(Parse(c.text));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.message)) << c.what;
}

#define INPUT "input { channels: 1 height: 8 width: 8 } num_classes: 3 "
INSTANTIATE_TEST_SUITE_P(
    Cases, InvalidSpecTest,
    ::testing::Values(
        InvalidCase{"duplicate names",
                    INPUT "layer { name: \"a\" relu {} } layer { name: \"a\" dense { units: 3 } }",
                    "name used twice"},
        InvalidCase{"kernel too large",
                    INPUT "layer { name: \"c\" conv2d { filters: 2 kernel: 9 } } "
                          "layer { name: \"d\" dense { units: 3 } }",
                    "kernel 9 larger"},
        InvalidCase{"kernel too large after pooling",
                    INPUT "layer { name: \"p\" max_pool { size: 4 } } "
                          "layer { name: \"c\" conv2d { filters: 2 kernel: 3 } } "
                          "layer { name: \"d\" dense { units: 3 } }",
                    "layer 'c'"},
        InvalidCase{"pool too large",
                    INPUT "layer { name: \"p\" max_pool { size: 9 } } "
                          "layer { name: \"d\" dense { units: 3 } }",
                    "pool window"},
        InvalidCase{"last layer not dense",
                    INPUT "layer { name: \"d\" dense { units: 3 } } layer { name: \"r\" relu {} }",
                    "last layer"},
        InvalidCase{"last dense with the wrong units",
                    INPUT "layer { name: \"d\" dense { units: 4 } }", "num_classes (3)"},
        InvalidCase{"no layers", INPUT, "no layers"},
        InvalidCase{"layer without kind",
                    INPUT "layer { name: \"x\" } layer { name: \"d\" dense { units: 3 } }",
                    "no layer kind"},
        InvalidCase{"unnamed layer", INPUT "layer { dense { units: 3 } }", "name"},
        InvalidCase{"slash in a name", INPUT "layer { name: \"a/b\" dense { units: 3 } }", "'/'"},
        InvalidCase{"zero filters",
                    INPUT "layer { name: \"c\" conv2d { filters: 0 kernel: 3 } } "
                          "layer { name: \"d\" dense { units: 3 } }",
                    "positive"},
        InvalidCase{"negative padding",
                    INPUT "layer { name: \"c\" conv2d { filters: 1 kernel: 3 padding: -1 } } "
                          "layer { name: \"d\" dense { units: 3 } }",
                    "conv2d"},
        InvalidCase{"no input", "num_classes: 3 layer { name: \"d\" dense { units: 3 } }", "input"},
        InvalidCase{"one class",
                    "input { channels: 1 height: 8 width: 8 } num_classes: 1 "
                    "layer { name: \"d\" dense { units: 1 } }",
                    "num_classes"}),
    [](const ::testing::TestParamInfo<InvalidCase>& info) {
      std::string name = info.param.what;
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });
#undef INPUT

// Two id features (one a bag of 3) and an embedding layer on each: tables
// "<layer>/table" [rows, dim], outputs [dim, 1, 1], initial values within
// +-1/sqrt(dim).
constexpr char kEmbeddingSpec[] = R"spec(
  input {
    channels: 1 height: 1 width: 4
    id_feature { name: "city" }
    id_feature { name: "tags" width: 3 }
  }
  num_classes: 2
  layer { name: "bottom" dense { units: 8 } }
  layer { name: "city_emb" embedding { feature: "city" rows: 100 dim: 8 } }
  layer { name: "tag_emb" embedding { feature: "tags" rows: 30 dim: 8 combiner: MEAN } }
  layer { name: "inter" input: "bottom" interaction { others: "city_emb" others: "tag_emb" } }
  layer { name: "fc" dense { units: 2 } }
)spec";

TEST(EmbeddingSpecTest, TablesAreVariablesAndOutputsAreDimWide) {
  const ModelSpec spec = Parse(kEmbeddingSpec);
  absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(spec);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_EQ((*shapes)[1].channels, 8);
  EXPECT_EQ((*shapes)[1].size(), 8);
  EXPECT_EQ((*shapes)[2].size(), 8);
  EXPECT_EQ((*shapes)[3].size(), 8 + 3);
  std::vector<Var> vars;
  for (const VariableShape& v : ModelVariables(spec)) vars.emplace_back(v.name, v.shape);
  EXPECT_THAT(vars, ElementsAre(Var{"bottom/weights", {8, 4}}, Var{"bottom/bias", {8}},
                                Var{"city_emb/table", {100, 8}}, Var{"tag_emb/table", {30, 8}},
                                Var{"fc/weights", {2, 11}}, Var{"fc/bias", {2}}));
  // Embedding layers read no activation: neither the model input nor the
  // layer before them.
  absl::StatusOr<std::vector<LayerWiring>> wiring = ResolveWiring(spec);
  ASSERT_TRUE(wiring.ok()) << wiring.status();
  EXPECT_EQ((*wiring)[1].input, -1);
  EXPECT_EQ((*wiring)[2].input, -1);
  const std::vector<std::vector<float>> values = InitialValues(spec, 5);
  const float bound = 1.0f / std::sqrt(8.0f);
  float largest = 0;
  for (float x : values[2]) largest = std::max(largest, std::abs(x));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.9f * bound) << "uniform over the whole range";
}

TEST(EmbeddingSpecTest, ErrorsNameTheLayerOrFeature) {
  auto error = [](const std::string& input, const std::string& layers) {
    const std::string text = "input { channels: 1 height: 1 width: 4 " + input +
                             " } num_classes: 2 "
                             "layer { name: \"b\" dense { units: 4 } } " +
                             layers +
                             " layer { name: \"j\" input: \"b\" concat { others: \"e\" } }"
                             " layer { name: \"fc\" dense { units: 2 } }";
    absl::StatusOr<std::vector<ActivationShape>> shapes = ValidateModelSpec(Parse(text));
    return shapes.ok() ? std::string("ok") : std::string(shapes.status().message());
  };
  const std::string city = "id_feature { name: \"city\" }";
  auto emb = [](const std::string& body) {
    return "layer { name: \"e\" embedding { " + body + " } }";
  };
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 10 dim: 4")), "ok");
  EXPECT_EQ(error(city, emb("feature: \"zip\" rows: 10 dim: 4")),
            "layer 'e': feature 'zip' is not an input id_feature");
  EXPECT_EQ(error("", emb("feature: \"city\" rows: 10 dim: 4")),
            "layer 'e': feature 'city' is not an input id_feature");
  EXPECT_EQ(error(city, emb("rows: 10 dim: 4")), "layer 'e': embedding needs a feature");
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 0 dim: 4")),
            "layer 'e': embedding rows must be in [1, 1073741824], got 0");
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 2000000000 dim: 4")),
            "layer 'e': embedding rows must be in [1, 1073741824], got 2000000000");
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 10 dim: 0")),
            "layer 'e': embedding dim must be in [1, 65536], got 0");
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 10 dim: 70000")),
            "layer 'e': embedding dim must be in [1, 65536], got 70000");
  EXPECT_EQ(error(city, emb("feature: \"city\" rows: 1073741824 dim: 2")),
            "layer 'e': the model exceeds 1073741824 parameters");
  EXPECT_EQ(error(city,
                  "layer { name: \"e\" input: \"b\" embedding { feature: \"city\" rows: 10 "
                  "dim: 4 } }"),
            "layer 'e': reads ids, not an activation: its input must be empty");
  EXPECT_EQ(error(city + " " + city, emb("feature: \"city\" rows: 10 dim: 4")),
            "input id_feature 'city' is named twice");
  EXPECT_EQ(error("id_feature { width: 2 }", emb("feature: \"city\" rows: 10 dim: 4")),
            "every input id_feature needs a name");
  EXPECT_EQ(
      error("id_feature { name: \"city\" width: -1 }", emb("feature: \"city\" rows: 10 dim: 4")),
      "input id_feature 'city' needs a width in [1, 65536]");
}

TEST(SpecTest, ModelVariablesOfAnInvalidSpecIsEmpty) {
  EXPECT_TRUE(ModelVariables(ModelSpec()).empty());
}

TEST(InitialValuesTest, DeterministicPerSeed) {
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec("cnn");
  ASSERT_TRUE(spec.ok());
  const auto a = InitialValues(*spec, 1);
  const auto b = InitialValues(*spec, 1);
  const auto c = InitialValues(*spec, 2);
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), c.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i], c[i]) << "variable " << i;
  // Stable across builds and platforms: the first values of seed 1, from an
  // independent implementation of std::mt19937_64 seeded as spec.cc does.
  ASSERT_GE(a[0].size(), 3u);
  EXPECT_EQ(a[0][0], 0x1.804cd6p-7f);
  EXPECT_EQ(a[0][1], 0x1.8315bp-4f);
  EXPECT_EQ(a[0][2], -0x1.462bccp-4f);
}

TEST(InitialValuesTest, UniformWithinFanInBound) {
  for (const std::string& name : BuiltinModelNames()) {
    absl::StatusOr<ModelSpec> spec = ResolveModelSpec(name);
    ASSERT_TRUE(spec.ok());
    const std::vector<VariableShape> vars = ModelVariables(*spec);
    const auto values = InitialValues(*spec, 42);
    ASSERT_EQ(values.size(), vars.size());
    int fan_in_vars = 0, norm_vars = 0, statistics_vars = 0;
    for (size_t i = 0; i < vars.size(); ++i) {
      SCOPED_TRACE(absl::StrCat(name, " ", vars[i].name));
      ASSERT_EQ(static_cast<int64_t>(values[i].size()), NumElements(vars[i].shape));
      const std::string& var = vars[i].name;
      const std::string layer = var.substr(0, var.find('/'));
      const std::string kind = var.substr(var.find('/') + 1);
      if (kind == "gamma" || kind == "beta") {
        // Batch norm starts as the identity: gamma 1, beta 0.
        const float want = kind == "gamma" ? 1.0f : 0.0f;
        for (float x : values[i]) ASSERT_EQ(x, want);
        ++norm_vars;
        continue;
      }
      if (kind == "running_mean" || kind == "running_var") {
        // Running statistics start as PyTorch's: mean 0, variance 1.
        EXPECT_FALSE(vars[i].trainable);
        const float want = kind == "running_var" ? 1.0f : 0.0f;
        for (float x : values[i]) ASSERT_EQ(x, want);
        ++statistics_vars;
        continue;
      }
      EXPECT_TRUE(vars[i].trainable);
      ASSERT_TRUE(kind == "weights" || kind == "bias") << var;
      // The fan-in of a layer's units is its weights' size per output unit;
      // a bias follows its layer's weights.
      const size_t w_index = kind == "weights" ? i : i - 1;
      ASSERT_EQ(vars[w_index].name, layer + "/weights");
      const std::vector<int64_t>& w = vars[w_index].shape;
      const double bound = 1.0 / std::sqrt(static_cast<double>(NumElements(w) / w[0]));
      double sum = 0, max_abs = 0;
      for (float x : values[i]) {
        ASSERT_LE(std::abs(x), bound);
        sum += x;
        max_abs = std::max(max_abs, static_cast<double>(std::abs(x)));
      }
      ++fan_in_vars;
      const double n = static_cast<double>(values[i].size());
      if (n >= 400) {
        // Uniform on (-b, b): mean 0 with standard error b / sqrt(3n), and
        // values reaching close to the bound.
        EXPECT_LT(std::abs(sum / n), 5 * bound / std::sqrt(3 * n));
        EXPECT_GT(max_abs, 0.95 * bound);
      } else {
        EXPECT_GT(max_abs, 0.0);
      }
    }
    EXPECT_GT(fan_in_vars, 0);
    if (name == "resnet") {
      // conv1, bn1, then 8 blocks of 2 batch norms and 3 projection batch norms.
      EXPECT_EQ(norm_vars, 2 * (1 + 8 * 2 + 3));
      EXPECT_EQ(statistics_vars, norm_vars);
    } else {
      EXPECT_EQ(norm_vars, 0);
      EXPECT_EQ(statistics_vars, 0);
    }
  }
}

}  // namespace
}  // namespace psflow::model
