#include "model/spec.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_chunks.h"
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

std::vector<std::pair<std::string, std::vector<int64_t>>> Flatten(const std::vector<VariableShape>& vars) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const VariableShape& v : vars) out.emplace_back(v.name, v.shape);
  return out;
}

using Var = std::pair<std::string, std::vector<int64_t>>;

TEST(SpecTest, BuiltinsResolve) {
  EXPECT_THAT(BuiltinModelNames(), ElementsAre("cnn", "mlp"));
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
  EXPECT_EQ(got, (std::vector<std::vector<int>>{{20, 24, 24}, {20, 24, 24}, {20, 12, 12}, {50, 8, 8},
                                                 {50, 8, 8}, {50, 4, 4}, {500, 1, 1}, {500, 1, 1},
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

constexpr char kUserSpec[] = R"pb(
  # A small model with stride and padding.
  input { channels: 3 height: 10 width: 10 }
  num_classes: 5
  layer { name: "c" conv2d { filters: 4 kernel: 3 stride: 2 padding: 1 } }
  layer { name: "r" relu {} }
  layer { name: "p" max_pool { size: 3 stride: 1 } }
  layer { name: "out" dense { units: 5 } }
)pb";

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
  absl::StatusOr<ModelSpec> spec = ResolveModelSpec(absl::StrCat(::testing::TempDir(), "/no_such_spec"));
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("no_such_spec"));
  EXPECT_FALSE(ResolveModelSpec("resnet").ok());
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
        InvalidCase{"pool too large", INPUT "layer { name: \"p\" max_pool { size: 9 } } "
                                            "layer { name: \"d\" dense { units: 3 } }",
                    "pool window"},
        InvalidCase{"last layer not dense",
                    INPUT "layer { name: \"d\" dense { units: 3 } } layer { name: \"r\" relu {} }",
                    "last layer"},
        InvalidCase{"last dense with the wrong units", INPUT "layer { name: \"d\" dense { units: 4 } }",
                    "num_classes (3)"},
        InvalidCase{"no layers", INPUT, "no layers"},
        InvalidCase{"layer without kind", INPUT "layer { name: \"x\" } layer { name: \"d\" dense { units: 3 } }",
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
    for (size_t i = 0; i < vars.size(); ++i) {
      SCOPED_TRACE(absl::StrCat(name, " ", vars[i].name));
      ASSERT_EQ(static_cast<int64_t>(values[i].size()), NumElements(vars[i].shape));
      // The fan-in of a layer's units is its weights' size per output unit.
      const std::vector<int64_t>& w = vars[i - i % 2].shape;
      const double bound = 1.0 / std::sqrt(static_cast<double>(NumElements(w) / w[0]));
      double sum = 0, max_abs = 0;
      for (float x : values[i]) {
        ASSERT_LE(std::abs(x), bound);
        sum += x;
        max_abs = std::max(max_abs, static_cast<double>(std::abs(x)));
      }
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
  }
}

}  // namespace
}  // namespace psflow::model
