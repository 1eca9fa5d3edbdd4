// psflow-data synth-criteo: click logs in Criteo's layout (label, I1..I13,
// C1..C26; tab-separated, no header) drawn from a planted logistic model, so
// that the best quality any model can reach on them is known (docs/data.md).
//
// Per categorical column the ids are Zipf-distributed ranks 1..vocab, each
// written as CriteoId(column, rank); the integers are log-normal. The label is
// Bernoulli(sigmoid(logit)) with
//   logit = bias + sum_c w_c(id_c) + sum_i u_i * log1p(I_i)
//         + pair_scale * sum_(a,b) <z_a(id_a), z_b(id_b)> / 2
// over the present fields (a missing one adds nothing). w_c, u_i and the
// 4-vectors z are pure functions of (seed, column, id): nothing large is
// stored, and PlantedModel gives the probability of any row read back. The
// bias is set so that the mean probability is the target positive rate.
//
// Row i of a split is a pure function of (seed, split, i): the same options
// give the same bytes whatever the thread count, and a longer file starts
// with the rows of a shorter one. Thread-safety: PlantedModel is immutable
// after Create and may be shared.
#ifndef PSFLOW_TOOLS_DATA_SYNTH_CRITEO_H_
#define PSFLOW_TOOLS_DATA_SYNTH_CRITEO_H_

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "data/csv/csv.h"
#include "evaluator/binary_scores.h"

namespace psflow::data_tool {

inline constexpr int kCriteoIntegers = 13;
inline constexpr int kCriteoCategoricals = 26;

struct SynthColumn {
  int64_t vocab = 1000;         // ranks 1..vocab, before --vocab_scale
  double zipf_exponent = 1.05;  // P(rank k) proportional to k^-exponent; > 0
  double weight_stddev = 0.25;  // of w_c(id); psflow-data's default too
};

// The default columns: vocabularies shaped after Criteo's Kaggle set (3 to
// 10^6, its largest capped at 10^6), Zipf exponents 0.6 to 1.2.
std::vector<SynthColumn> DefaultSynthColumns();

// The pairs of categorical columns (0-based) whose interaction terms are
// planted, in order; SynthCriteoOptions::interactions takes the first ones.
const std::vector<std::pair<int, int>>& SynthInteractionPairs();

struct SynthCriteoOptions {
  std::string output;  // the folder of train.tsv, test.tsv, planted.txt; created if missing
  int64_t train_examples = 1000000;
  int64_t test_examples = 100000;
  uint64_t seed = 1;
  // Multiplies every column's vocabulary (rounded, at least 1): small for tests.
  double vocab_scale = 1;
  double positive_rate = 0.25;  // the target mean probability, in (0, 1)
  double missing_rate = 0.02;   // of each I and C field, in [0, 1)
  int interactions = 4;         // planted pairs, 0 to SynthInteractionPairs().size()
  double pair_scale = 0.5;
  std::vector<SynthColumn> columns = DefaultSynthColumns();  // kCriteoCategoricals of them
  int threads = 1;  // rows formatted at once; the bytes do not depend on it
};

// Zipf ranks 1..n, P(k) proportional to k^-exponent (exponent > 0), drawn in
// O(1) by Hormann and Derflinger's rejection-inversion ("Rejection-inversion
// to generate variates from monotone discrete distributions", 1996), as
// Apache Commons' RejectionInversionZipfSampler: no table of n entries.
class ZipfSampler {
 public:
  ZipfSampler(int64_t n, double exponent);
  // `uniform` returns doubles in [0, 1); a draw takes one or (rarely) more.
  template <typename Uniform>
  int64_t Sample(Uniform& uniform) const {
    while (true) {
      const double u = h_integral_n_ + uniform() * (h_integral_x1_ - h_integral_n_);
      const double x = HIntegralInverse(u);
      int64_t k = static_cast<int64_t>(x + 0.5);
      k = k < 1 ? 1 : k > n_ ? n_ : k;
      if (static_cast<double>(k) - x <= s_ || u >= HIntegral(static_cast<double>(k) + 0.5) - H(k))
        return k;
    }
  }

 private:
  double H(int64_t k) const;
  double HIntegral(double x) const;
  double HIntegralInverse(double x) const;

  int64_t n_;
  double exponent_, h_integral_x1_, h_integral_n_, s_;
};

// The 8 hex digits written for `rank` (1-based) of categorical column
// `column` (0-based): a 32-bit hash of both, never 0 (kMissingId). Distinct
// ranks may share one (as hashed ids do); the model is a function of the id
// written, so such ranks simply are one id.
uint32_t CriteoId(int column, int64_t rank);

// One generated row. ints[i] < 0 and ids[c] == kMissingId mark missing fields.
struct SynthRow {
  std::array<int64_t, kCriteoIntegers> ints{};
  std::array<uint64_t, kCriteoCategoricals> ids{};
  double probability = 0;
  int64_t label = 0;
};

enum class SynthSplit { kTrain = 0, kTest = 1, kCalibration = 2 };

class PlantedModel {
 public:
  // Checks the options (INVALID_ARGUMENT naming the field) and sets the bias
  // from 50,000 rows of a split of its own.
  static absl::StatusOr<PlantedModel> Create(const SynthCriteoOptions& options);

  // The planted probability of a row's features.
  double Probability(const std::array<int64_t, kCriteoIntegers>& ints,
                     const std::array<uint64_t, kCriteoCategoricals>& ids) const;
  // The same of a row read by data::CsvReader with data::CriteoFormat().
  // INVALID_ARGUMENT for a row of another shape.
  absl::StatusOr<double> Probability(const data::CsvRow& row) const;
  // Row `index` of `split`.
  void Draw(SynthSplit split, int64_t index, SynthRow* row) const;

  double bias() const { return bias_; }
  // The columns with --vocab_scale applied.
  const std::vector<SynthColumn>& columns() const { return columns_; }

 private:
  PlantedModel() = default;
  double LogitWithoutBias(const std::array<int64_t, kCriteoIntegers>& ints,
                          const std::array<uint64_t, kCriteoCategoricals>& ids) const;
  double CalibrateBias(double positive_rate) const;

  uint64_t seed_ = 0;
  double missing_rate_ = 0;
  double pair_scale_ = 0;
  double bias_ = 0;
  std::vector<SynthColumn> columns_;
  std::vector<std::pair<int, int>> pairs_;
  std::vector<ZipfSampler> zipf_;
  std::array<double, kCriteoIntegers> u_{};  // the integers' weights
};

struct SynthCriteoSummary {
  int64_t train_examples = 0, train_positives = 0;
  // The planted probabilities scored against the test labels.
  evaluator::BinaryResult bayes;
  double bias = 0;
  int64_t bytes = 0;  // of train.tsv and test.tsv
  double seconds = 0;
};

// Writes train.tsv, test.tsv and planted.txt into options.output (each as
// <name>.tmp, renamed when complete). `pool` formats rows beside the calling
// thread: give it options.threads - 1 threads.
absl::StatusOr<SynthCriteoSummary> SynthCriteo(const SynthCriteoOptions& options, ThreadPool* pool);

// "wrote 1000000 train and 100000 test rows to /out (190.2 MiB) in 3.1 s,
// 354839 rows/s; test: <bayes figures>".
std::string DescribeSynthSummary(const SynthCriteoOptions& options,
                                 const SynthCriteoSummary& summary);

}  // namespace psflow::data_tool

#endif  // PSFLOW_TOOLS_DATA_SYNTH_CRITEO_H_
