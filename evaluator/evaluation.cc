#include "evaluator/evaluation.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/status_macros.h"
#include "data/source.h"
#include "evaluator/binary_scores.h"

namespace psflow::evaluator {

absl::StatusOr<int64_t> DefaultMemoryBudget(kernels::Backend* backend) {
  absl::StatusOr<int64_t> available = backend->AvailableMemory();
  if (!available.ok()) {
    return absl::Status(available.status().code(),
                        absl::StrCat("cannot tell how much memory ", backend->name(),
                                     " has available: ", available.status().message()));
  }
  return static_cast<int64_t>(std::floor(static_cast<double>(*available) * kDefaultMemoryShare));
}

absl::StatusOr<int> EvaluationBatch(const model::Network& net, int64_t examples, int batch_size,
                                    int64_t memory_budget) {
  if (batch_size <= 0) return absl::InvalidArgumentError("the batch size must be positive");
  if (examples <= 0) return absl::InvalidArgumentError("the dataset has no examples");
  const int largest = static_cast<int>(std::min<int64_t>(batch_size, examples));
  if (memory_budget <= 0) return largest;
  const model::Network::ForwardMemory m = net.forward_memory();
  // The buffers of batch b and, unless b divides the examples, of the last batch.
  auto fits = [&](int64_t b) {
    return m.fixed + m.per_example * (b + examples % b) <= memory_budget;
  };
  if (!fits(1)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "model ", net.spec().name(), " needs ", FormatByteSize(m.fixed + m.per_example),
        " to evaluate one example (", FormatByteSize(m.fixed), " for the network's weights and ",
        FormatByteSize(m.per_example), " per example), more than the memory budget of ",
        FormatByteSize(memory_budget)));
  }
  if (fits(largest)) return largest;
  // A batch that fits alone; with the last batch, one of at least half of it does.
  int b = static_cast<int>(
      std::min<int64_t>(largest, (memory_budget - m.fixed) / std::max<int64_t>(m.per_example, 1)));
  while (b > 1 && !fits(b)) --b;
  return b;
}

absl::StatusOr<Evaluation> EvaluateDataset(model::Network* net, const data::Dataset& data,
                                           int batch_size, int64_t memory_budget,
                                           const std::function<absl::Status()>& between_batches) {
  PSFLOW_ASSIGN_OR_RETURN(const int batch,
                          EvaluationBatch(*net, data.count, batch_size, memory_budget));
  // A model with embedding layers reads its ids by name out of the data's.
  PSFLOW_ASSIGN_OR_RETURN(const data::IdSelection ids,
                          data::IdSelection::Create(data.id_features, "the data", net->spec()));
  std::vector<uint64_t> batch_ids(static_cast<size_t>(batch * ids.model_ids()));
  double loss_sum = 0;
  Evaluation e;
  e.binary = net->spec().num_classes() == 2;
  BinaryScores scores;
  bool scored = true;
  std::vector<float> probs(e.binary ? 2 * static_cast<size_t>(batch) : 0);
  std::vector<float> positive;
  std::vector<int64_t> labels;
  const int64_t example = data.example_floats();
  for (int64_t begin = 0; begin < data.count; begin += batch) {
    if (begin > 0 && between_batches) PSFLOW_RETURN_IF_ERROR(between_batches());
    const int n = static_cast<int>(std::min<int64_t>(batch, data.count - begin));
    if (ids.model_ids() > 0) {
      ids.Select(data.ids.data() + begin * data.example_ids(), n, batch_ids.data());
      PSFLOW_RETURN_IF_ERROR(net->SetIds(batch_ids.data(), n));
    }
    PSFLOW_ASSIGN_OR_RETURN(
        model::Network::Result r,
        net->Evaluate(data.images.data() + begin * example, data.labels.data() + begin, n));
    loss_sum += r.loss * n;
    e.correct += r.correct;
    if (e.binary) {
      PSFLOW_RETURN_IF_ERROR(net->ReadProbabilities(n, probs.data()));
      positive.resize(n);
      labels.resize(n);
      for (int i = 0; i < n; ++i) {
        // A probability a hair outside [0, 1] from rounding is still one.
        positive[i] = std::clamp(probs[2 * static_cast<size_t>(i) + 1], 0.0f, 1.0f);
        labels[i] = data.labels[begin + i];
      }
      // A probability that is not a number (a model that diverged) leaves
      // the AUC undefined; the loss says the rest.
      scored = scored && scores.AddBatch(positive, labels).ok();
    }
  }
  e.examples = data.count;
  e.loss = loss_sum / static_cast<double>(data.count);
  if (e.binary && scored) e.auc = scores.Result().auc;
  return e;
}

}  // namespace psflow::evaluator
