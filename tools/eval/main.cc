// psflow-eval: loads a saved model and reports its accuracy and loss (and, for
// a model of two classes, its AUC) on the test split of its data.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/cpu_count.h"
#include "common/log.h"
#include "data/flags.h"
#include "data/source.h"
#include "evaluator/evaluation.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "model/saved_model.h"
#include "role/command_line.h"
#include "role/flag_checks.h"

ABSL_FLAG(std::string, saved_model, "",
          "Saved-model directory (<model_dir>/saved_model) or its model.pb file.");
ABSL_FLAG(std::string, data_dir, "/usr/share/datasets/fashion-mnist",
          "Directory with MNIST-format IDX files; the t10k-* (test) files are used.");
ABSL_FLAG(int, batch_size, 500,
          "Examples per forward pass; fewer where a pass that large would not fit "
          "--eval_memory_limit (the figures stay the same).");
ABSL_FLAG(int64_t, synthetic_examples, 2000, "Test examples of --data_format=synthetic.");
ABSL_FLAG(std::string, device, "cpu", "Where to compute: cpu, or cuda:N in builds with CUDA.");
ABSL_FLAG(std::string, eval_memory_limit, "auto",
          "Memory the evaluation may take on --device: the model's weights and the buffers of a "
          "forward pass (the dataset itself is not counted). A size such as 2GiB, 512MiB or "
          "1073741824 (bytes), or auto: half of the memory available when it starts "
          "(MemAvailable or the cgroup's limit less its usage, whichever is smaller, for cpu; "
          "the GPU's free memory for cuda:N). A --batch_size that does not fit is evaluated in "
          "smaller batches; a model of which one example does not fit is refused, naming the "
          "memory it needs.");

namespace {

constexpr char kUsage[] =
    "prints the accuracy and mean loss of a saved model on the test split.\n"
    "  psflow-eval --saved_model=/tmp/run/saved_model [--data_dir=DIR]\n"
    "Output: 'accuracy: X' and 'loss: Y', one per line; for a model of two classes also\n"
    "'auc: Z', the ROC AUC of the probabilities of class 1.";

// What to evaluate, and how, from the flags.
struct EvalOptions {
  std::string saved_model;
  psflow::DataConfig source;
  int input_threads = 1;
  std::string device;
  int batch_size = 500;
  std::string memory_limit_flag;  // as given, for messages
  int64_t memory_limit = 0;       // 0: auto (resolved on the device)
};

// The memory budget on `backend`: `limit`, or with 0 half of what it has free.
absl::StatusOr<int64_t> MemoryBudget(int64_t limit, psflow::kernels::Backend* backend) {
  if (limit != 0) return limit;
  absl::StatusOr<int64_t> half = psflow::evaluator::DefaultMemoryBudget(backend);
  if (!half.ok()) {
    return absl::Status(half.status().code(),
                        absl::StrCat(half.status().message(), "; give --eval_memory_limit=SIZE"));
  }
  return *half;
}

// Evaluates and prints; the exit code.
int Evaluate(const EvalOptions& o) {
  absl::StatusOr<psflow::model::LoadedModel> loaded = psflow::model::ReadSavedModel(o.saved_model);
  if (!loaded.ok()) return psflow::FailWith(loaded.status());
  absl::StatusOr<psflow::data::Dataset> test =
      psflow::data::LoadDataset(o.source, psflow::data::ModelInputOf(loaded->spec),
                                psflow::data::Split::kTest, o.input_threads);
  if (!test.ok()) return psflow::FailWith(test.status());
  absl::StatusOr<std::unique_ptr<psflow::kernels::Backend>> backend =
      psflow::kernels::CreateBackend(o.device);
  if (!backend.ok()) return psflow::FailWith(backend.status());
  absl::StatusOr<int64_t> budget = MemoryBudget(o.memory_limit, backend->get());
  if (!budget.ok()) return psflow::FailWith(budget.status());
  psflow::model::NetworkOptions options;
  options.forward_only = true;
  absl::StatusOr<std::unique_ptr<psflow::model::Network>> net =
      psflow::model::Network::Create(loaded->spec, backend->get(), options);
  if (!net.ok()) return psflow::FailWith(net.status());
  absl::StatusOr<int> pass =
      psflow::evaluator::EvaluationBatch(**net, test->count, o.batch_size, *budget);
  if (!pass.ok()) {
    return psflow::FailWith(
        absl::StrCat(pass.status().message(), " (--eval_memory_limit=", o.memory_limit_flag, ")"));
  }
  if (*pass < std::min<int64_t>(o.batch_size, test->count)) {
    PSLOG(INFO) << "evaluating in batches of " << *pass << ": --batch_size=" << o.batch_size
                << " does not fit the memory budget of " << psflow::FormatByteSize(*budget) << " ("
                << psflow::FormatByteSize((*net)->forward_memory().per_example) << " per example)";
  }
  std::vector<const float*> weights;
  for (const auto& v : loaded->values) weights.push_back(v.data());
  absl::Status s = (*net)->SetWeights(weights);
  if (!s.ok()) return psflow::FailWith(s);
  absl::StatusOr<psflow::evaluator::Evaluation> e =
      psflow::evaluator::EvaluateDataset(net->get(), *test, o.batch_size, *budget);
  if (!e.ok()) return psflow::FailWith(e.status());
  std::printf("model: %s (step %lld)\n", loaded->spec.name().c_str(),
              static_cast<long long>(loaded->global_step));
  std::printf("examples: %lld\n", static_cast<long long>(e->examples));
  std::printf("accuracy: %.4f\n", e->accuracy());
  std::printf("loss: %.4f\n", e->loss);
  if (e->binary) {
    if (e->auc.has_value()) {
      std::printf("auc: %.4f\n", *e->auc);
    } else {
      std::printf("auc: undefined (the examples are of one class, or a probability is NaN)\n");
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest =
      psflow::ParseCommandLine(argc, argv, kUsage, {"main.cc", "data/flags.cc"});
  if (rest.size() > 1) {
    return psflow::FailWith(std::string("unexpected argument '") + rest[1] + "'");
  }
  EvalOptions o;
  o.saved_model = absl::GetFlag(FLAGS_saved_model);
  if (o.saved_model.empty()) return psflow::FailWith("--saved_model is required");
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  if (o.batch_size <= 0) return psflow::FailWith("--batch_size must be positive");
  o.memory_limit_flag = absl::GetFlag(FLAGS_eval_memory_limit);
  absl::StatusOr<int64_t> limit =
      psflow::MemoryLimitFlag("--eval_memory_limit", o.memory_limit_flag);
  if (!limit.ok()) return psflow::FailWith(limit.status());
  o.memory_limit = *limit;
  o.source = psflow::data::DataConfigFromFlags();
  o.source.set_data_dir(absl::GetFlag(FLAGS_data_dir));
  o.source.set_synthetic_examples(absl::GetFlag(FLAGS_synthetic_examples));
  absl::Status resolved =
      psflow::data::ResolveEvalFiles(psflow::data::EvalFilesFromFlags(), &o.source);
  if (!resolved.ok()) return psflow::FailWith(resolved);
  o.input_threads = psflow::UsableCores();
  o.device = absl::GetFlag(FLAGS_device);
  return Evaluate(o);
}
