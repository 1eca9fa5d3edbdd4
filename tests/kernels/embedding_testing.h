// Random id bags for the embedding tests (embedding_test.cc and the CUDA
// parity test): features that own their arrays, and the table values the
// tests give each id.
#ifndef PSFLOW_TESTS_KERNELS_EMBEDDING_TESTING_H_
#define PSFLOW_TESTS_KERNELS_EMBEDDING_TESTING_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/embedding_plan.h"

namespace psflow::kernels {

// One feature's bags, owning what EmbeddingFeatureBags views.
struct OwnedBags {
  std::vector<int64_t> offsets;
  std::vector<uint64_t> ids;
  std::vector<float> weights;
  Combiner combiner = Combiner::kSum;

  EmbeddingFeatureBags view() const { return {offsets, ids, weights, combiner}; }
};

// `batch` bags of 0 to max_len ids each (so some are empty) out of `vocab`
// ids spread over the 64-bit range, a few of them hot (in about half the
// draws), with weights in [0.25, 2) when `weighted`.
inline OwnedBags RandomBags(std::mt19937& gen, int batch, int max_len, uint64_t vocab,
                            Combiner combiner, bool weighted) {
  std::uniform_int_distribution<int> len(0, max_len);
  std::uniform_int_distribution<uint64_t> any(0, vocab - 1), hot(0, 3);
  std::bernoulli_distribution pick_hot(0.5);
  std::uniform_real_distribution<float> weight(0.25f, 2.0f);
  OwnedBags bags;
  bags.combiner = combiner;
  bags.offsets.push_back(0);
  for (int b = 0; b < batch; ++b) {
    const int n = len(gen);
    for (int i = 0; i < n; ++i) {
      const uint64_t id = pick_hot(gen) ? hot(gen) : any(gen);
      bags.ids.push_back(id * 0x9E3779B97F4A7C15ull);  // distinct for distinct draws
      if (weighted) bags.weights.push_back(weight(gen));
    }
    bags.offsets.push_back(static_cast<int64_t>(bags.ids.size()));
  }
  return bags;
}

inline std::vector<EmbeddingFeatureBags> Views(const std::vector<OwnedBags>& features) {
  std::vector<EmbeddingFeatureBags> views;
  for (const OwnedBags& f : features) views.push_back(f.view());
  return views;
}

// The table's value at column j of id's row: a hash of both, in [-1, 1).
inline float TableValue(uint64_t id, int64_t j) {
  uint64_t x = id ^ (static_cast<uint64_t>(j) * 0xBF58476D1CE4E5B9ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 40) / double{1ull << 23} - 1.0);
}

// The rows [plan.unique(), dim] of the plan's unique ids.
inline std::vector<float> TableRows(const EmbeddingPlan& plan, int64_t dim) {
  std::vector<float> rows(plan.unique_ids.size() * dim);
  for (size_t u = 0; u < plan.unique_ids.size(); ++u) {
    for (int64_t j = 0; j < dim; ++j) rows[u * dim + j] = TableValue(plan.unique_ids[u], j);
  }
  return rows;
}

}  // namespace psflow::kernels

#endif  // PSFLOW_TESTS_KERNELS_EMBEDDING_TESTING_H_
