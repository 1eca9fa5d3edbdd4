// The plan of a sparse embedding table; see embedding_plan.h.
#include "kernels/embedding_plan.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace psflow::kernels {
namespace {

constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();

absl::string_view CombinerName(Combiner c) {
  switch (c) {
    case Combiner::kSum:
      return "SUM";
    case Combiner::kMean:
      return "MEAN";
    case Combiner::kSqrtN:
      return "SQRTN";
  }
  return "an unknown combiner";
}

absl::Status Invalid(size_t feature, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("embedding feature ", feature, ": ", what));
}

// The offsets, weights and combiner of feature `f`.
absl::Status CheckFeature(size_t f, const EmbeddingFeatureBags& bags, int batch) {
  const auto& offsets = bags.offsets;
  if (offsets.size() != static_cast<size_t>(batch) + 1) {
    return Invalid(f, absl::StrCat(offsets.size(), " offsets for a batch of ", batch, " (want ",
                                   batch + 1, ")"));
  }
  if (offsets[0] != 0) return Invalid(f, absl::StrCat("offsets start at ", offsets[0], ", not 0"));
  for (int b = 0; b < batch; ++b) {
    if (offsets[b + 1] < offsets[b]) {
      return Invalid(f, absl::StrCat("offset ", b + 1, " (", offsets[b + 1], ") is below offset ",
                                     b, " (", offsets[b], ")"));
    }
  }
  if (offsets[batch] != static_cast<int64_t>(bags.ids.size())) {
    return Invalid(f, absl::StrCat("offsets end at ", offsets[batch], " but there are ",
                                   bags.ids.size(), " ids"));
  }
  if (!bags.weights.empty() && bags.weights.size() != bags.ids.size()) {
    return Invalid(f, absl::StrCat(bags.weights.size(), " weights for ", bags.ids.size(), " ids"));
  }
  if (bags.combiner != Combiner::kSum && bags.combiner != Combiner::kMean &&
      bags.combiner != Combiner::kSqrtN) {
    return Invalid(f, absl::StrCat("unknown combiner ", static_cast<int>(bags.combiner)));
  }
  const bool needs_non_negative = bags.combiner != Combiner::kSum;
  for (size_t i = 0; i < bags.weights.size(); ++i) {
    const float w = bags.weights[i];
    if (!std::isfinite(w) || (needs_non_negative && w < 0)) {
      return Invalid(f, absl::StrCat("weight ", i, " is ", w, ", which ",
                                     CombinerName(bags.combiner), " cannot take"));
    }
  }
  return absl::OkStatus();
}

// The factor every weight of a bag is multiplied by: 1 / sum(w) for MEAN,
// 1 / sqrt(sum(w^2)) for SQRTN (in double), 0 where that sum is 0.
double BagScale(Combiner combiner, absl::Span<const float> weights, int64_t begin, int64_t end) {
  if (combiner == Combiner::kSum) return 1.0;
  double sum = 0;
  for (int64_t i = begin; i < end; ++i) {
    const double w = weights.empty() ? 1.0 : weights[i];
    sum += combiner == Combiner::kMean ? w : w * w;
  }
  if (sum <= 0) return 0.0;
  return combiner == Combiner::kMean ? 1.0 / sum : 1.0 / std::sqrt(sum);
}

// Appends feature `bags`'s occurrences to the forward map, numbering ids
// not seen before.
void AppendForward(const EmbeddingFeatureBags& bags, int batch,
                   absl::flat_hash_map<uint64_t, int32_t>& index, EmbeddingPlan& plan) {
  for (int b = 0; b < batch; ++b) {
    const int64_t begin = bags.offsets[b], end = bags.offsets[b + 1];
    const double scale = BagScale(bags.combiner, bags.weights, begin, end);
    for (int64_t i = begin; i < end; ++i) {
      const auto [it, inserted] =
          index.try_emplace(bags.ids[i], static_cast<int32_t>(plan.unique_ids.size()));
      if (inserted) plan.unique_ids.push_back(bags.ids[i]);
      const double w = bags.weights.empty() ? 1.0 : bags.weights[i];
      plan.bag_rows.push_back(it->second);
      plan.bag_coefs.push_back(static_cast<float>(w * scale));
    }
    plan.bag_offsets.push_back(static_cast<int32_t>(plan.bag_rows.size()));
  }
}

// The backward map, the transpose of the forward one: a counting sort of
// the occurrences by row, stable in bag order.
void BuildBackward(EmbeddingPlan& plan) {
  const int64_t unique = plan.unique(), bags = plan.bags();
  plan.row_offsets.assign(unique + 1, 0);
  for (int32_t row : plan.bag_rows) ++plan.row_offsets[row + 1];
  for (int64_t u = 0; u < unique; ++u) plan.row_offsets[u + 1] += plan.row_offsets[u];
  plan.row_bags.resize(plan.bag_rows.size());
  plan.row_coefs.resize(plan.bag_rows.size());
  // Each row's next free slot; starts as row_offsets without the last entry.
  std::vector<int32_t> next(plan.row_offsets.begin(), plan.row_offsets.end() - 1);
  for (int64_t g = 0; g < bags; ++g) {
    for (int32_t k = plan.bag_offsets[g]; k < plan.bag_offsets[g + 1]; ++k) {
      const int32_t slot = next[plan.bag_rows[k]]++;
      plan.row_bags[slot] = static_cast<int32_t>(g);
      plan.row_coefs[slot] = plan.bag_coefs[k];
    }
  }
}

}  // namespace

absl::Status BuildEmbeddingPlan(int batch, absl::Span<const EmbeddingFeatureBags> features,
                                EmbeddingPlan* plan) {
  if (batch <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding plan: batch ", batch, " is not positive"));
  }
  if (features.empty()) return absl::InvalidArgumentError("embedding plan: no features");
  if (static_cast<int64_t>(batch) * static_cast<int64_t>(features.size()) > kMaxIndex) {
    return absl::InvalidArgumentError(absl::StrCat("embedding plan: ", features.size(),
                                                   " features of ", batch,
                                                   " bags are more bags than int32 indexes"));
  }
  int64_t occurrences = 0;
  for (size_t f = 0; f < features.size(); ++f) {
    PSFLOW_RETURN_IF_ERROR(CheckFeature(f, features[f], batch));
    occurrences += static_cast<int64_t>(features[f].ids.size());
  }
  // Unique ids are at most the occurrences, so this bounds them too.
  if (occurrences > kMaxIndex) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding plan: ", occurrences,
                     " ids are more than int32 indexes (unique rows included)"));
  }
  plan->batch = batch;
  plan->features = static_cast<int32_t>(features.size());
  plan->unique_ids.clear();
  plan->bag_offsets.assign(1, 0);
  plan->bag_rows.clear();
  plan->bag_coefs.clear();
  plan->bag_rows.reserve(occurrences);
  plan->bag_coefs.reserve(occurrences);
  absl::flat_hash_map<uint64_t, int32_t> index;
  for (const EmbeddingFeatureBags& bags : features) AppendForward(bags, batch, index, *plan);
  BuildBackward(*plan);
  return absl::OkStatus();
}

absl::StatusOr<EmbeddingPlan> BuildEmbeddingPlan(int batch,
                                                 absl::Span<const EmbeddingFeatureBags> features) {
  EmbeddingPlan plan;
  PSFLOW_RETURN_IF_ERROR(BuildEmbeddingPlan(batch, features, &plan));
  return plan;
}

namespace {

// One CSR map: `n` + 1 offsets from 0 to index.size() that never fall, every
// index below `limit`, as many finite coefficients as indices.
absl::Status CheckMap(absl::string_view name, int64_t n, const std::vector<int32_t>& offsets,
                      const std::vector<int32_t>& index, const std::vector<float>& coefs,
                      int64_t limit) {
  auto fault = [&](const auto&... what) {
    return absl::InvalidArgumentError(absl::StrCat("embedding plan: ", name, " map: ", what...));
  };
  if (static_cast<int64_t>(offsets.size()) != n + 1) {
    return fault(offsets.size(), " offsets for ", n, " entries");
  }
  if (offsets[0] != 0 || offsets[n] != static_cast<int64_t>(index.size())) {
    return fault("offsets run from ", offsets[0], " to ", offsets[n], ", not 0 to ", index.size());
  }
  if (coefs.size() != index.size()) {
    return fault(coefs.size(), " coefficients for ", index.size(), " indices");
  }
  for (int64_t i = 0; i < n; ++i) {
    if (offsets[i + 1] < offsets[i]) return fault("offset ", i + 1, " is below offset ", i);
  }
  for (size_t k = 0; k < index.size(); ++k) {
    if (index[k] < 0 || index[k] >= limit) {
      return fault("index ", k, " is ", index[k], ", outside [0, ", limit, ")");
    }
    if (!std::isfinite(coefs[k])) return fault("coefficient ", k, " is ", coefs[k]);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckEmbeddingPlan(const EmbeddingPlan& plan) {
  if (plan.batch < 0 || plan.features < 0 || plan.bags() > kMaxIndex || plan.unique() > kMaxIndex) {
    return absl::InvalidArgumentError(absl::StrCat("embedding plan: batch ", plan.batch, ", ",
                                                   plan.features, " features and ", plan.unique(),
                                                   " unique ids are not a valid size"));
  }
  if (plan.row_bags.size() != plan.bag_rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("embedding plan: ", plan.bag_rows.size(),
                                                   " occurrences forward but ",
                                                   plan.row_bags.size(), " backward"));
  }
  PSFLOW_RETURN_IF_ERROR(CheckMap("forward", plan.bags(), plan.bag_offsets, plan.bag_rows,
                                  plan.bag_coefs, plan.unique()));
  return CheckMap("backward", plan.unique(), plan.row_offsets, plan.row_bags, plan.row_coefs,
                  plan.bags());
}

}  // namespace psflow::kernels
