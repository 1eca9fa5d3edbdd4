#include "tools/data/synth_criteo.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"

namespace psflow::data_tool {
namespace {

namespace fs = std::filesystem;

// The tags that keep the hashed streams apart (any distinct constants).
constexpr uint64_t kTagId = 0x1d5a7c3e9b2f4061ULL;
constexpr uint64_t kTagRow = 0x6a09e667f3bcc909ULL;
constexpr uint64_t kTagWeight = 0xbb67ae8584caa73bULL;
constexpr uint64_t kTagInteger = 0x3c6ef372fe94f82bULL;
constexpr uint64_t kTagPair = 0xa54ff53a5f1d36f1ULL;

// The rows the bias is calibrated on, and the rows a thread formats at a time.
constexpr int kCalibrationRows = 50000;
constexpr int64_t kBlockRows = 8192;
// Integers are written below 2^24, so a float (CsvRow::numeric) holds them exactly.
constexpr double kMaxInteger = (1 << 24) - 1;
// I_i is expm1 of a near-normal value with these means (standard deviation
// kIntegerLogStddev), floored: counts from about 1 to a few hundred, as Criteo's.
constexpr std::array<double, kCriteoIntegers> kIntegerLogMean = {1.0, 2.5, 1.5, 2.0, 5.5, 3.0, 1.5,
                                                                 2.5, 4.0, 0.5, 1.5, 0.5, 2.0};
constexpr double kIntegerLogStddev = 1.2;
constexpr double kIntegerWeightStddev = 0.15;
constexpr int kPairRank = 4;  // the length of the interaction vectors z

// SplitMix64's finalizer: a bijection of 64 bits that mixes every bit.
uint64_t Mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Hash(uint64_t seed, uint64_t tag, uint64_t a, uint64_t b) {
  return Mix(Mix(Mix(seed ^ tag) ^ a) ^ b);
}

// A standard-normal-like value of a hash, cheaply: the Irwin-Hall sum of its
// four 16-bit quarters as uniforms, centred and scaled to variance 1 (within
// +-3.46).
double Gaussian(uint64_t h) {
  double sum = 0;
  for (int i = 0; i < 4; ++i) sum += static_cast<double>((h >> (16 * i)) & 0xffff) + 0.5;
  return (sum / 65536.0 - 2.0) * 1.7320508075688772;
}

// The stream of one row: SplitMix64.
struct RowRng {
  uint64_t state;
  uint64_t Next() { return Mix(state += 0x9e3779b97f4a7c15ULL); }
  double operator()() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
};

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double HelperLog1pOverX(double x) {
  return std::abs(x) > 1e-8 ? std::log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - x * 0.25));
}

double HelperExpm1OverX(double x) {
  return std::abs(x) > 1e-8 ? std::expm1(x) / x
                            : 1 + x * 0.5 * (1 + x * (1.0 / 3) * (1 + x * 0.25));
}

}  // namespace

ZipfSampler::ZipfSampler(int64_t n, double exponent) : n_(n), exponent_(exponent) {
  h_integral_x1_ = HIntegral(1.5) - 1;
  h_integral_n_ = HIntegral(static_cast<double>(n) + 0.5);
  s_ = 2 - HIntegralInverse(HIntegral(2.5) - H(2));
}

double ZipfSampler::H(int64_t k) const {
  return std::exp(-exponent_ * std::log(static_cast<double>(k)));
}

double ZipfSampler::HIntegral(double x) const {
  const double log_x = std::log(x);
  return HelperExpm1OverX((1 - exponent_) * log_x) * log_x;
}

double ZipfSampler::HIntegralInverse(double x) const {
  const double t = std::max(-1.0, x * (1 - exponent_));
  return std::exp(HelperLog1pOverX(t) * x);
}

std::vector<SynthColumn> DefaultSynthColumns() {
  // Criteo Kaggle's cardinalities, C1..C26, capped at 10^6.
  constexpr std::array<int64_t, kCriteoCategoricals> kVocab = {
      1460,  583,     1000000, 1000000, 305,  24, 12517,   633, 3,  93145,  5683, 1000000, 3194, 27,
      14992, 1000000, 10,      5652,    2173, 4,  1000000, 18,  15, 286181, 105,  142572};
  std::vector<SynthColumn> columns(kCriteoCategoricals);
  for (int c = 0; c < kCriteoCategoricals; ++c) {
    const int64_t v = kVocab[c];
    columns[c].vocab = v;
    columns[c].zipf_exponent = v < 50 ? 0.6 : v < 10000 ? 0.9 : v < 200000 ? 1.05 : 1.15;
  }
  return columns;
}

const std::vector<std::pair<int, int>>& SynthInteractionPairs() {
  static const auto* pairs = new std::vector<std::pair<int, int>>{
      {5, 13}, {1, 4}, {0, 7}, {16, 24}, {6, 10}, {21, 22}, {12, 17}, {9, 25}};
  return *pairs;
}

uint32_t CriteoId(int column, int64_t rank) {
  const uint32_t id = static_cast<uint32_t>(
      Hash(kTagId, static_cast<uint64_t>(column), static_cast<uint64_t>(rank), 0) >> 32);
  return id == 0 ? 1 : id;
}

namespace {

absl::Status CheckOptions(const SynthCriteoOptions& o) {
  auto bad = [](auto... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (o.train_examples < 0) return bad("train_examples ", o.train_examples, " is negative");
  if (o.test_examples < 0) return bad("test_examples ", o.test_examples, " is negative");
  if (!(o.vocab_scale > 0 && o.vocab_scale <= 1000))
    return bad("vocab_scale ", o.vocab_scale, " is not in (0, 1000]");
  if (!(o.positive_rate > 0 && o.positive_rate < 1))
    return bad("positive_rate ", o.positive_rate, " is not in (0, 1)");
  if (!(o.missing_rate >= 0 && o.missing_rate < 1))
    return bad("missing_rate ", o.missing_rate, " is not in [0, 1)");
  const int max_pairs = static_cast<int>(SynthInteractionPairs().size());
  if (o.interactions < 0 || o.interactions > max_pairs)
    return bad("interactions ", o.interactions, " is not in [0, ", max_pairs, "]");
  if (!(o.pair_scale >= 0 && o.pair_scale <= 100))
    return bad("pair_scale ", o.pair_scale, " is not in [0, 100]");
  if (o.columns.size() != kCriteoCategoricals)
    return bad(o.columns.size(), " categorical columns, Criteo's layout has ", kCriteoCategoricals);
  for (size_t c = 0; c < o.columns.size(); ++c) {
    const SynthColumn& col = o.columns[c];
    if (col.vocab < 1 || col.vocab > (int64_t{1} << 31))
      return bad("C", c + 1, ": vocabulary ", col.vocab, " is not in [1, 2^31]");
    if (!(col.zipf_exponent > 0 && col.zipf_exponent <= 10))
      return bad("C", c + 1, ": zipf exponent ", col.zipf_exponent, " is not in (0, 10]");
    if (!(col.weight_stddev >= 0 && col.weight_stddev <= 100))
      return bad("C", c + 1, ": weight stddev ", col.weight_stddev, " is not in [0, 100]");
  }
  if (o.threads < 1 || o.threads > 1024) return bad("threads ", o.threads, " is not in [1, 1024]");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PlantedModel> PlantedModel::Create(const SynthCriteoOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  PlantedModel m;
  m.seed_ = options.seed;
  m.missing_rate_ = options.missing_rate;
  m.pair_scale_ = options.pair_scale;
  m.columns_ = options.columns;
  for (SynthColumn& col : m.columns_) {
    const double scaled = std::round(static_cast<double>(col.vocab) * options.vocab_scale);
    col.vocab =
        static_cast<int64_t>(std::clamp(scaled, 1.0, static_cast<double>(int64_t{1} << 31)));
    m.zipf_.emplace_back(col.vocab, col.zipf_exponent);
  }
  m.pairs_.assign(SynthInteractionPairs().begin(),
                  SynthInteractionPairs().begin() + options.interactions);
  for (int i = 0; i < kCriteoIntegers; ++i) {
    m.u_[i] = kIntegerWeightStddev * Gaussian(Hash(m.seed_, kTagInteger, i, 0));
  }
  m.bias_ = m.CalibrateBias(options.positive_rate);
  return m;
}

double PlantedModel::LogitWithoutBias(const std::array<int64_t, kCriteoIntegers>& ints,
                                      const std::array<uint64_t, kCriteoCategoricals>& ids) const {
  double logit = 0;
  for (int c = 0; c < kCriteoCategoricals; ++c) {
    if (ids[c] == data::kMissingId) continue;
    logit += columns_[c].weight_stddev * Gaussian(Hash(seed_, kTagWeight, c, ids[c]));
  }
  for (int i = 0; i < kCriteoIntegers; ++i) {
    if (ints[i] >= 0) logit += u_[i] * std::log1p(static_cast<double>(ints[i]));
  }
  for (const auto& [a, b] : pairs_) {
    if (ids[a] == data::kMissingId || ids[b] == data::kMissingId) continue;
    double dot = 0;
    for (int k = 0; k < kPairRank; ++k) {
      dot += Gaussian(Hash(seed_, kTagPair + k, a, ids[a])) *
             Gaussian(Hash(seed_, kTagPair + k, b, ids[b]));
    }
    // A dot product of kPairRank unit-variance products: divided by its
    // standard deviation, the term's is pair_scale.
    logit += pair_scale_ * dot / std::sqrt(static_cast<double>(kPairRank));
  }
  return logit;
}

double PlantedModel::Probability(const std::array<int64_t, kCriteoIntegers>& ints,
                                 const std::array<uint64_t, kCriteoCategoricals>& ids) const {
  return Sigmoid(bias_ + LogitWithoutBias(ints, ids));
}

absl::StatusOr<double> PlantedModel::Probability(const data::CsvRow& row) const {
  if (row.numeric.size() != kCriteoIntegers || row.numeric_missing.size() != kCriteoIntegers ||
      row.categorical.size() != kCriteoCategoricals) {
    return absl::InvalidArgumentError(
        absl::StrCat("a row of ", row.numeric.size(), " numeric and ", row.categorical.size(),
                     " categorical columns is not of Criteo's layout (13 and 26)"));
  }
  std::array<int64_t, kCriteoIntegers> ints;
  std::array<uint64_t, kCriteoCategoricals> ids;
  for (int i = 0; i < kCriteoIntegers; ++i) {
    const float v = row.numeric[i];
    if (!row.numeric_missing[i] && !(v >= 0 && v <= kMaxInteger && v == std::floor(v))) {
      return absl::InvalidArgumentError(
          absl::StrCat("I", i + 1, " ", v, " is not an integer in [0, 2^24)"));
    }
    ints[i] = row.numeric_missing[i] ? -1 : static_cast<int64_t>(v);
  }
  std::copy(row.categorical.begin(), row.categorical.end(), ids.begin());
  return Probability(ints, ids);
}

void PlantedModel::Draw(SynthSplit split, int64_t index, SynthRow* row) const {
  RowRng rng{Hash(seed_, kTagRow, static_cast<uint64_t>(split), static_cast<uint64_t>(index))};
  for (int i = 0; i < kCriteoIntegers; ++i) {
    if (rng() < missing_rate_) {
      row->ints[i] = -1;
      continue;
    }
    const double z = Gaussian(rng.Next());
    const double v = std::expm1(kIntegerLogMean[i] + kIntegerLogStddev * z);
    row->ints[i] = v <= 0 ? 0 : static_cast<int64_t>(std::min(std::floor(v), kMaxInteger));
  }
  for (int c = 0; c < kCriteoCategoricals; ++c) {
    row->ids[c] = rng() < missing_rate_ ? data::kMissingId : CriteoId(c, zipf_[c].Sample(rng));
  }
  row->probability = Probability(row->ints, row->ids);
  row->label = rng() < row->probability ? 1 : 0;
}

double PlantedModel::CalibrateBias(double positive_rate) const {
  std::vector<double> logits(kCalibrationRows);
  SynthRow row;
  for (int r = 0; r < kCalibrationRows; ++r) {
    Draw(SynthSplit::kCalibration, r, &row);
    logits[r] = LogitWithoutBias(row.ints, row.ids);
  }
  // The mean probability grows with the bias: bisect.
  double lo = -60, hi = 60;
  for (int step = 0; step < 64; ++step) {
    const double mid = (lo + hi) / 2;
    double sum = 0;
    for (const double l : logits) sum += Sigmoid(mid + l);
    (sum / kCalibrationRows < positive_rate ? lo : hi) = mid;
  }
  return (lo + hi) / 2;
}

namespace {

// Appends one row in Criteo's layout, ending in '\n'.
void AppendRow(const SynthRow& row, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  char buf[512];
  char* p = buf;
  *p++ = row.label != 0 ? '1' : '0';
  for (const int64_t v : row.ints) {
    *p++ = '\t';
    if (v >= 0) p = std::to_chars(p, buf + sizeof(buf), v).ptr;
  }
  for (const uint64_t id : row.ids) {
    *p++ = '\t';
    if (id == data::kMissingId) continue;
    for (int shift = 28; shift >= 0; shift -= 4) *p++ = kHex[(id >> shift) & 0xf];
  }
  *p++ = '\n';
  out->append(buf, p);
}

struct Block {
  std::string text;
  int64_t positives = 0;
};

// Rows [first, first + n) of `split` into `block`; their probabilities and
// labels into probabilities/labels[first...] where those are given.
void FormatBlock(const PlantedModel& model, SynthSplit split, int64_t first, int64_t n,
                 Block* block, std::vector<double>* probabilities, std::vector<int64_t>* labels) {
  block->text.clear();
  block->text.reserve(static_cast<size_t>(n) * 200);
  block->positives = 0;
  SynthRow row;
  for (int64_t i = first; i < first + n; ++i) {
    model.Draw(split, i, &row);
    AppendRow(row, &block->text);
    block->positives += row.label;
    if (probabilities != nullptr) (*probabilities)[i] = row.probability;
    if (labels != nullptr) (*labels)[i] = row.label;
  }
}

struct SplitWritten {
  int64_t positives = 0;
  int64_t bytes = 0;
};

// Writes rows [0, n) of `split` to path.tmp, formatting up to 4 blocks per
// thread at once and writing them in order.
absl::StatusOr<SplitWritten> WriteSplit(const PlantedModel& model, SynthSplit split, int64_t n,
                                        const std::string& path, int threads, ThreadPool* pool,
                                        std::vector<double>* probabilities,
                                        std::vector<int64_t>* labels) {
  const std::string tmp = path + ".tmp";
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(tmp.c_str(), "wb"), &std::fclose);
  if (file == nullptr) return absl::InternalError(absl::StrCat(tmp, ": cannot create"));
  std::vector<Block> blocks(static_cast<size_t>(threads) * 4);
  const int64_t wave_rows = static_cast<int64_t>(blocks.size()) * kBlockRows;
  SplitWritten written;
  for (int64_t wave = 0; wave < n; wave += wave_rows) {
    const int64_t rows = std::min(wave_rows, n - wave);
    const int count = static_cast<int>((rows + kBlockRows - 1) / kBlockRows);
    pool->ParallelFor(count, [&](int b) {
      const int64_t first = wave + b * kBlockRows;
      FormatBlock(model, split, first, std::min(kBlockRows, wave + rows - first), &blocks[b],
                  probabilities, labels);
    });
    for (int b = 0; b < count; ++b) {
      const std::string& text = blocks[b].text;
      if (std::fwrite(text.data(), 1, text.size(), file.get()) != text.size())
        return absl::InternalError(absl::StrCat(tmp, ": write failed"));
      written.bytes += static_cast<int64_t>(text.size());
      written.positives += blocks[b].positives;
    }
  }
  if (std::fflush(file.get()) != 0 || std::fclose(file.release()) != 0)
    return absl::InternalError(absl::StrCat(tmp, ": write failed"));
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec)
    return absl::InternalError(absl::StrCat(path, ": cannot rename into place: ", ec.message()));
  return written;
}

std::string Figure(const std::optional<double>& value) {
  return value.has_value() ? absl::StrFormat("%.17g", *value) : "undefined";
}

// planted.txt: key=value lines, the test split's figures first.
std::string PlantedText(const SynthCriteoOptions& o, const PlantedModel& model,
                        const SynthCriteoSummary& s) {
  const evaluator::BinaryResult& b = s.bayes;
  std::vector<std::string> vocab, exponents, stddevs, pairs;
  for (const SynthColumn& c : model.columns()) {
    vocab.push_back(absl::StrCat(c.vocab));
    exponents.push_back(absl::StrCat(c.zipf_exponent));
    stddevs.push_back(absl::StrCat(c.weight_stddev));
  }
  for (int i = 0; i < o.interactions; ++i) {
    const auto& [x, y] = SynthInteractionPairs()[i];
    pairs.push_back(absl::StrCat("C", x + 1, "xC", y + 1));
  }
  const double rate =
      b.examples > 0 ? static_cast<double>(b.positives) / static_cast<double>(b.examples) : 0;
  const double train_rate = s.train_examples > 0 ? static_cast<double>(s.train_positives) /
                                                       static_cast<double>(s.train_examples)
                                                 : 0;
  return absl::StrCat(
      "# psflow-data synth-criteo: the planted model of train.tsv and test.tsv.\n"
      "# examples, positive_rate and bayes_* are of test.tsv; bayes_* score the planted\n"
      "# probabilities, the best any model can do in expectation.\n",
      "examples=", b.examples, "\npositive_rate=", absl::StrFormat("%.6f", rate),
      "\nbayes_auc=", Figure(b.auc), "\nbayes_logloss=", Figure(b.log_loss),
      "\nbayes_accuracy=", Figure(b.accuracy), "\ntrain_examples=", s.train_examples,
      "\ntrain_positive_rate=", absl::StrFormat("%.6f", train_rate), "\nseed=", o.seed,
      "\nvocab_scale=", o.vocab_scale, "\ntarget_positive_rate=", o.positive_rate,
      "\nbias=", absl::StrFormat("%.17g", model.bias()), "\nmissing_rate=", o.missing_rate,
      "\ninteractions=", o.interactions, "\ninteraction_pairs=", absl::StrJoin(pairs, ","),
      "\npair_scale=", o.pair_scale, "\nvocab_sizes=", absl::StrJoin(vocab, ","),
      "\nzipf_exponents=", absl::StrJoin(exponents, ","),
      "\nweight_stddevs=", absl::StrJoin(stddevs, ","), "\n");
}

}  // namespace

absl::StatusOr<SynthCriteoSummary> SynthCriteo(const SynthCriteoOptions& options,
                                               ThreadPool* pool) {
  const absl::Time start = absl::Now();
  absl::StatusOr<PlantedModel> model = PlantedModel::Create(options);
  if (!model.ok()) return model.status();
  if (options.output.empty()) return absl::InvalidArgumentError("no output folder");
  if (absl::Status s = MakeDirectories(options.output); !s.ok()) return s;
  const fs::path dir(options.output);
  SynthCriteoSummary summary;
  summary.bias = model->bias();
  absl::StatusOr<SplitWritten> train =
      WriteSplit(*model, SynthSplit::kTrain, options.train_examples, (dir / "train.tsv").string(),
                 options.threads, pool, nullptr, nullptr);
  if (!train.ok()) return train.status();
  std::vector<double> probabilities(options.test_examples);
  std::vector<int64_t> labels(options.test_examples);
  absl::StatusOr<SplitWritten> test =
      WriteSplit(*model, SynthSplit::kTest, options.test_examples, (dir / "test.tsv").string(),
                 options.threads, pool, &probabilities, &labels);
  if (!test.ok()) return test.status();
  evaluator::BinaryScores bayes;
  if (absl::Status s =
          bayes.AddBatch(absl::MakeConstSpan(probabilities), absl::MakeConstSpan(labels));
      !s.ok()) {
    return s;
  }
  summary.train_examples = options.train_examples;
  summary.train_positives = train->positives;
  summary.bayes = bayes.Result();
  summary.bytes = train->bytes + test->bytes;
  if (absl::Status s = WriteFileAtomically((dir / "planted.txt").string(),
                                           PlantedText(options, *model, summary));
      !s.ok()) {
    return s;
  }
  summary.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return summary;
}

std::string DescribeSynthSummary(const SynthCriteoOptions& options,
                                 const SynthCriteoSummary& summary) {
  const int64_t rows = summary.train_examples + summary.bayes.examples;
  return absl::StrFormat(
      "wrote %d train and %d test rows to %s (%.1f MiB) in %.2f s, %.0f rows/s; test: %s",
      summary.train_examples, summary.bayes.examples, options.output,
      static_cast<double>(summary.bytes) / (1 << 20), summary.seconds,
      static_cast<double>(rows) / std::max(summary.seconds, 1e-9),
      absl::StrReplaceAll(
          summary.bayes.ToString(),
          {{"auc", "bayes_auc"}, {"log_loss", "bayes_logloss"}, {"accuracy", "bayes_accuracy"}}));
}

}  // namespace psflow::data_tool
