// One evaluation pass: a network's mean loss and its correct predictions over
// every example of a dataset, in batches. psflow-eval and psflow-evaluator
// share it, so the same weights, batch size and device give both the same
// figures.
//
// Memory: a pass takes what the network's ForwardMemory says, for each batch
// size it runs. A memory budget caps that: a batch too large for it is split
// into passes of the largest size that fits, which changes nothing but the
// time (evaluation normalizes with running statistics, so its figures do not
// depend on the batch), and a model of which not even one example fits is
// refused before anything is allocated for a batch.
//
// Thread-safety: as the network's (one pass at a time per network).
#ifndef PSFLOW_EVALUATOR_EVALUATION_H_
#define PSFLOW_EVALUATOR_EVALUATION_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/statusor.h"
#include "data/mnist.h"
#include "kernels/kernels.h"
#include "model/network.h"

namespace psflow::evaluator {

struct Evaluation {
  double loss = 0;  // mean over the examples
  int64_t correct = 0;
  int64_t examples = 0;
  // Models of two classes (class 1 the positive one): the ROC AUC of the
  // probabilities of class 1 (evaluator/binary_scores.h); nullopt for other
  // models and where the examples are all of one class.
  bool binary = false;
  std::optional<double> auc;
  double accuracy() const {
    return examples > 0 ? static_cast<double>(correct) / static_cast<double>(examples) : 0;
  }
};

// The share of the device's available memory that DefaultMemoryBudget gives
// an evaluation: the rest is left to the dataset, the allocator's slack, the
// backend's own workspaces and the processes beside it (psflow-launch runs
// every role on one machine).
inline constexpr double kDefaultMemoryShare = 0.5;

// The memory budget when none is given: kDefaultMemoryShare of what the
// backend's device has available now (Backend::AvailableMemory: for the CPU,
// MemAvailable or the cgroup's headroom, whichever is smaller). The error of
// a backend that cannot tell, prefixed with "cannot tell how much memory
// <backend> has available: ".
absl::StatusOr<int64_t> DefaultMemoryBudget(kernels::Backend* backend);

// The examples per forward pass when `examples` examples (> 0) are asked for
// in batches of `batch_size` (> 0) within `memory_budget` bytes (0: no
// limit): batch_size, or `examples` if fewer, where the network's fixed
// memory and the buffers of that batch size and of the last, smaller batch
// (the network keeps both) fit the budget; else the largest size for which
// they do. RESOURCE_EXHAUSTED, on one line naming both, when even one example
// needs more than the budget: "model resnet needs 46.0 MiB to evaluate one
// example (44.7 MiB for the network's weights and 1.3 MiB per example), more
// than the memory budget of 40.0 MiB".
absl::StatusOr<int> EvaluationBatch(const model::Network& net, int64_t examples, int batch_size,
                                    int64_t memory_budget);

// Runs `net` forward over `data` in batches of EvaluationBatch(net,
// data.count, batch_size, memory_budget) (the last may be smaller).
// `between_batches`, if set, runs before each batch but the first; an error
// from it ends the pass with that error. Errors of EvaluationBatch and of
// the network are returned as they are; a batch size that is not positive
// and an empty dataset are INVALID_ARGUMENT.
absl::StatusOr<Evaluation> EvaluateDataset(
    model::Network* net, const data::Dataset& data, int batch_size, int64_t memory_budget,
    const std::function<absl::Status()>& between_batches = nullptr);

}  // namespace psflow::evaluator

#endif  // PSFLOW_EVALUATOR_EVALUATION_H_
