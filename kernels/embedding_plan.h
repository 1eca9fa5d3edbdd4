// The id bookkeeping of one sparse embedding table for one batch: which rows
// the batch needs (each once, in the order they are first seen: what a worker
// pulls from the ps and pushes gradients for), and which rows, with which
// coefficients, every bag sums (the forward map) and every row's gradient
// gathers (the backward map). Backend::CreateEmbeddingBag's ops run on it.
//
// Host code only; a plan is a plain value (not thread-safe to build into
// while another thread reads it).
#ifndef PSFLOW_KERNELS_EMBEDDING_PLAN_H_
#define PSFLOW_KERNELS_EMBEDDING_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace psflow::kernels {

// How a bag's rows e_i with weights w_i become one vector (TensorFlow's
// combiners): SUM = sum(w e), MEAN = sum(w e) / sum(w), SQRTN = sum(w e) /
// sqrt(sum(w^2)). An empty bag, or one whose weights are all zero, gives
// zeros.
enum class Combiner { kSum, kMean, kSqrtN };

// The bags of one feature for one batch, in CSR form (views; the caller
// keeps the memory): bag b holds ids[offsets[b] .. offsets[b+1]).
struct EmbeddingFeatureBags {
  absl::Span<const int64_t> offsets;  // batch + 1 entries, 0 first, ids.size() last
  absl::Span<const uint64_t> ids;
  // One weight per id, or empty: every weight 1. MEAN and SQRTN take no
  // negative weights; no combiner takes a NaN or infinite one.
  absl::Span<const float> weights;
  Combiner combiner = Combiner::kSum;
};

// A table's plan for one batch of `features` features sharing it. Bags are
// numbered feature-major (bag = f * batch + b), unique rows by first sight
// (scanning features, then bags, then ids in order). Both maps are CSR
// over int32 indices; an occurrence is one id of one bag, its coefficient
// its weight times its bag's combiner scale.
struct EmbeddingPlan {
  int32_t batch = 0;
  int32_t features = 0;
  std::vector<uint64_t> unique_ids;
  // Forward: bag g sums bag_rows[k] (a unique row index) times bag_coefs[k]
  // for k in [bag_offsets[g], bag_offsets[g+1]), in id order.
  std::vector<int32_t> bag_offsets;  // bags + 1
  std::vector<int32_t> bag_rows;
  std::vector<float> bag_coefs;
  // Backward: unique row u gathers row_bags[k] (a bag) times row_coefs[k]
  // for k in [row_offsets[u], row_offsets[u+1]), in ascending bag order (a
  // bag holding the id twice appears twice, in id order).
  std::vector<int32_t> row_offsets;  // unique + 1
  std::vector<int32_t> row_bags;
  std::vector<float> row_coefs;

  int64_t bags() const { return int64_t{batch} * features; }
  int64_t unique() const { return static_cast<int64_t>(unique_ids.size()); }
  int64_t occurrences() const { return static_cast<int64_t>(bag_rows.size()); }
};

// Builds the plan of `features` (at least one) for a batch of `batch` (> 0)
// bags each into *plan, reusing its vectors' memory. INVALID_ARGUMENT (one
// line naming the feature and bag) for offsets that do not start at 0, fall,
// or end elsewhere than at ids.size(); a weight count that is neither 0 nor
// ids.size(); a weight a combiner cannot take; more bags, occurrences or
// unique ids than int32 indexes. *plan is unspecified after an error.
absl::Status BuildEmbeddingPlan(int batch, absl::Span<const EmbeddingFeatureBags> features,
                                EmbeddingPlan* plan);
absl::StatusOr<EmbeddingPlan> BuildEmbeddingPlan(int batch,
                                                 absl::Span<const EmbeddingFeatureBags> features);

// Whether a plan (built above, or assembled by hand) is consistent: sizes,
// monotone offsets, every index in range, finite coefficients. The backends
// check this before they take a plan, so that a kernel never indexes out of
// bounds. INVALID_ARGUMENT naming the first fault.
absl::Status CheckEmbeddingPlan(const EmbeddingPlan& plan);

}  // namespace psflow::kernels

#endif  // PSFLOW_KERNELS_EMBEDDING_PLAN_H_
