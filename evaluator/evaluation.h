// One evaluation pass: a network's mean loss and its correct predictions over
// every example of a dataset, in batches. psflow-eval and psflow-evaluator
// share it, so the same weights, batch size and device give both the same
// figures.
#ifndef PSFLOW_EVALUATOR_EVALUATION_H_
#define PSFLOW_EVALUATOR_EVALUATION_H_

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "data/mnist.h"
#include "model/network.h"

namespace psflow::evaluator {

struct Evaluation {
  double loss = 0;  // mean over the examples
  int64_t correct = 0;
  int64_t examples = 0;
  double accuracy() const {
    return examples > 0 ? static_cast<double>(correct) / static_cast<double>(examples) : 0;
  }
};

// Runs `net` forward over `data` in batches of `batch_size` (> 0; the last
// may be smaller). `between_batches`, if set, runs before each batch but the
// first; an error from it ends the pass with that error. Errors of the
// network are returned as they are; an empty dataset is INVALID_ARGUMENT.
absl::StatusOr<Evaluation> EvaluateDataset(
    model::Network* net, const data::Dataset& data, int batch_size,
    const std::function<absl::Status()>& between_batches = nullptr);

}  // namespace psflow::evaluator

#endif  // PSFLOW_EVALUATOR_EVALUATION_H_
