// Process-level tests of psflow-eval within a memory budget, on saved models
// the tests write: the built-in resnet gives the same figures at
// --batch_size=1, 100 and 10000 under a --eval_memory_limit that holds 7
// examples (the larger batches run in pieces), and a limit below one
// example, or one that is no size, is refused on one line with exit code 1.
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/saved_model.h"
#include "model/spec.h"
#include "tests/common/trained_weights.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class EvalTest : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    spec_ = model::ResolveModelSpec("resnet").value();
    // Initial weights with running statistics as after some training.
    std::vector<std::vector<float>> w = testing_weights::WithRunningStatistics(spec_, 5, 6);
    ASSERT_TRUE(model::WriteSavedModel(dir_ + "/saved_model", spec_, 42, w).ok());
    // What psflow-eval's network takes on the CPU.
    auto backend = kernels::CreateBackend("cpu", 1);
    ASSERT_TRUE(backend.ok()) << backend.status();
    model::NetworkOptions options;
    options.forward_only = true;
    auto net = model::Network::Create(spec_, backend->get(), options);
    ASSERT_TRUE(net.ok()) << net.status();
    memory_ = (*net)->forward_memory();
  }

  // psflow-eval on the saved model, on 24 synthetic examples, one CPU thread
  // (a batch-1 pass is slow to start a team of threads on a busy machine).
  RunResult Eval(const std::vector<std::string>& flags) {
    std::vector<std::string> args = {"--saved_model=" + dir_ + "/saved_model",
                                     "--data_format=synthetic", "--synthetic_examples=24"};
    args.insert(args.end(), flags.begin(), flags.end());
    return RunProcess(Bin("psflow-eval"), args, {{"OMP_NUM_THREADS", "1"}}, seconds(60));
  }

  ModelSpec spec_;
  model::Network::ForwardMemory memory_;
};

TEST_F(EvalTest, ResnetIsTheSameAtBatch1And100And10000) {
  const std::string limit =
      "--eval_memory_limit=" + std::to_string(memory_.fixed + 7 * memory_.per_example);
  std::string first;
  for (const char* batch : {"1", "100", "10000"}) {
    SCOPED_TRACE(std::string("--batch_size=") + batch);
    RunResult eval = Eval({std::string("--batch_size=") + batch, limit});
    ASSERT_EQ(eval.exit_code, 0) << eval.description;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        eval.out, m, std::regex(R"(examples: 24\naccuracy: ([0-9.]+)\nloss: ([0-9.]+)\n)")))
        << eval.description;
    const std::string figures = m[1].str() + " " + m[2].str();
    if (first.empty()) first = figures;
    EXPECT_EQ(figures, first);
    if (std::string(batch) == "1") {
      EXPECT_THAT(eval.err, Not(HasSubstr("evaluating in batches"))) << eval.description;
    } else {
      // 24 examples, room for 7: batches of 6.
      EXPECT_THAT(eval.err, HasSubstr("evaluating in batches of 6: --batch_size=" +
                                      std::string(batch) + " does not fit the memory budget"))
          << eval.description;
    }
  }
}

TEST_F(EvalTest, LimitBelowOneExampleIsOneLineNamingTheMemoryNeeded) {
  RunResult eval = Eval({"--eval_memory_limit=10MiB"});
  EXPECT_EQ(eval.exit_code, 1) << eval.description;
  EXPECT_EQ(eval.out, "") << eval.description;
  const std::vector<std::string> lines = absl::StrSplit(eval.err, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1u) << eval.description;
  EXPECT_THAT(lines[0], HasSubstr("model resnet needs "));
  EXPECT_THAT(lines[0], HasSubstr(" per example), more than the memory budget of 10.0 MiB "
                                  "(--eval_memory_limit=10MiB)"));
}

TEST_F(EvalTest, LimitThatIsNoSizeIsRefused) {
  for (const char* limit : {"lots", "0", "-5MiB"}) {
    RunResult eval = Eval({std::string("--eval_memory_limit=") + limit});
    EXPECT_EQ(eval.exit_code, 1) << eval.description;
    const std::vector<std::string> lines = absl::StrSplit(eval.err, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 1u) << eval.description;
    EXPECT_THAT(lines[0], HasSubstr("--eval_memory_limit: ")) << eval.description;
  }
}

}  // namespace
}  // namespace psflow::itest
