// The update rules of embedding tables, one row at a time: a row is `dim`
// floats of value and SlotFloats(dim) floats of optimizer state that only
// this row's updates read and write, so rows a batch does not touch never
// move (unlike a dense optimizer, whose Adam moments decay every step).
// The configuration and the rules are in proto/embedding.proto.
// Thread-safe: a SparseOptimizer is immutable once created; concurrent
// ApplyRow calls on different rows are fine.
#ifndef PSFLOW_PS_EMBEDDING_SPARSE_OPTIMIZER_H_
#define PSFLOW_PS_EMBEDDING_SPARSE_OPTIMIZER_H_

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/embedding.pb.h"

namespace psflow::ps::embedding {

// INVALID_ARGUMENT naming the first bad field (an unknown kind, a
// learning_rate that is not > 0, a negative or non-finite value, a beta
// not below 1).
absl::Status ValidateSparseOptimizer(const SparseOptimizerConfig& config);

// The kind an optimizer name chooses for a table: "sgd", "adagrad" or
// "rowwise_adagrad", "lazy_adam", "ftrl" (case-insensitive). Any other name
// is INVALID_ARGUMENT in one line listing these; dense names ("adam",
// "momentum", ...) are told why they are not offered: a dense rule moves
// every row's state each step, touched or not.
absl::StatusOr<SparseOptimizerConfig::Kind> ParseSparseOptimizerKind(absl::string_view name);
// The canonical name of a kind ("rowwise_adagrad" for ROWWISE_ADAGRAD).
absl::string_view SparseOptimizerName(SparseOptimizerConfig::Kind kind);

// The scalars of one step, computed once for all the rows a call updates.
struct SparseStep {
  float lr = 0;
  float eps = 0;
  float b1 = 0, b2 = 0;
  float adam_lr = 0;  // lr sqrt(1 - b2^t) / (1 - b1^t), t = step + 1
  float l1 = 0, l2 = 0;
};

class SparseOptimizer {
 public:
  // INVALID_ARGUMENT as ValidateSparseOptimizer. Fields left at 0 take
  // their documented defaults.
  static absl::StatusOr<SparseOptimizer> Create(const SparseOptimizerConfig& config);

  SparseOptimizerConfig::Kind kind() const { return config_.kind(); }
  // The configuration with every default filled in.
  const SparseOptimizerConfig& config() const { return config_; }

  // Optimizer state floats per row: 0 (SGD), 1 (ROWWISE_ADAGRAD), 2 dim
  // (LAZY_ADAM: m then v; FTRL: n then z).
  int SlotFloats(int dim) const;
  // Sets a new row's state (accumulators at initial_accumulator, moments 0).
  void InitSlots(int dim, float* slots) const;
  // The scalars of global step `step` (LAZY_ADAM's bias correction uses
  // step + 1).
  SparseStep StepAt(int64_t step) const;
  // One update of row `w` (dim floats) and its `slots` by gradient `g`.
  void ApplyRow(const SparseStep& s, int dim, const float* g, float* w, float* slots) const;

 private:
  explicit SparseOptimizer(SparseOptimizerConfig config) : config_(std::move(config)) {}
  SparseOptimizerConfig config_;
};

}  // namespace psflow::ps::embedding

#endif  // PSFLOW_PS_EMBEDDING_SPARSE_OPTIMIZER_H_
