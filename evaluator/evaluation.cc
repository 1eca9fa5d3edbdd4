#include "evaluator/evaluation.h"

#include <algorithm>

#include "common/status_macros.h"

namespace psflow::evaluator {

absl::StatusOr<Evaluation> EvaluateDataset(model::Network* net, const data::Dataset& data,
                                           int batch_size,
                                           const std::function<absl::Status()>& between_batches) {
  if (batch_size <= 0) return absl::InvalidArgumentError("the batch size must be positive");
  if (data.count <= 0) return absl::InvalidArgumentError("the dataset has no examples");
  double loss_sum = 0;
  Evaluation e;
  const int64_t example = data.example_floats();
  for (int64_t begin = 0; begin < data.count; begin += batch_size) {
    if (begin > 0 && between_batches) PSFLOW_RETURN_IF_ERROR(between_batches());
    const int n = static_cast<int>(std::min<int64_t>(batch_size, data.count - begin));
    PSFLOW_ASSIGN_OR_RETURN(
        model::Network::Result r,
        net->Evaluate(data.images.data() + begin * example, data.labels.data() + begin, n));
    loss_sum += r.loss * n;
    e.correct += r.correct;
  }
  e.examples = data.count;
  e.loss = loss_sum / static_cast<double>(data.count);
  return e;
}

}  // namespace psflow::evaluator
