// psflow-data synth-criteo: files the CSV reader's Criteo preset reads, the
// same bytes for the same flags, planted.txt's Bayes figures against the
// planted probabilities of the rows read back, Zipf ids, and the command line.
#include "tools/data/synth_criteo.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/thread_pool.h"
#include "data/csv/csv.h"
#include "evaluator/binary_scores.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/run_data_tool.h"

namespace psflow::data_tool {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class SynthCriteoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = (fs::path(::testing::TempDir()) / absl::StrCat("synth_criteo_test_", info->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Small and fast: vocabularies of 1 to 1,000.
  SynthCriteoOptions Small(const std::string& out) const {
    SynthCriteoOptions o;
    o.output = Path(out);
    o.train_examples = 20000;
    o.test_examples = 20000;
    o.vocab_scale = 0.001;
    o.missing_rate = 0.05;
    return o;
  }

  static SynthCriteoSummary Run(const SynthCriteoOptions& o) {
    ThreadPool pool(o.threads - 1);
    absl::StatusOr<SynthCriteoSummary> summary = SynthCriteo(o, &pool);
    EXPECT_TRUE(summary.ok()) << summary.status();
    return summary.value_or(SynthCriteoSummary{});
  }

  // planted.txt as a map.
  static std::map<std::string, std::string> Planted(const std::string& dir) {
    std::map<std::string, std::string> values;
    const std::string text = ReadFile(dir + "/planted.txt").value_or("");
    for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
      if (line[0] == '#') continue;
      std::vector<std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
      EXPECT_EQ(kv.size(), 2u) << line;
      if (kv.size() == 2) values[kv[0]] = kv[1];
    }
    return values;
  }

  static double Number(const std::map<std::string, std::string>& values, const std::string& key) {
    double v = std::nan("");
    const auto it = values.find(key);
    EXPECT_TRUE(it != values.end() && absl::SimpleAtod(it->second, &v)) << key;
    return v;
  }

  std::string dir_;
};

TEST_F(SynthCriteoTest, TheCriteoPresetReadsEveryRow) {
  SynthCriteoOptions o = Small("out");
  o.train_examples = 5000;
  o.test_examples = 3000;
  o.threads = 2;
  SynthCriteoSummary summary = Run(o);
  EXPECT_EQ(summary.train_examples, 5000);
  EXPECT_EQ(summary.bayes.examples, 3000);
  for (const auto& [name, rows] :
       {std::pair<std::string, int64_t>{"train.tsv", 5000}, {"test.tsv", 3000}}) {
    absl::StatusOr<std::unique_ptr<data::CsvReader>> reader =
        data::CsvReader::Open(Path("out/" + name), data::CriteoFormat());
    ASSERT_TRUE(reader.ok()) << reader.status();
    std::vector<std::string> fields;
    int64_t count = 0, empty = 0, fields_seen = 0;
    while (true) {
      absl::StatusOr<bool> more = (*reader)->NextRow(&fields);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      ++count;
      ASSERT_EQ(fields.size(), 40u);
      EXPECT_TRUE(fields[0] == "0" || fields[0] == "1");
      for (int f = 1; f < 40; ++f) {
        ++fields_seen;
        if (fields[f].empty()) {
          ++empty;
          continue;
        }
        if (f > 13) {
          EXPECT_EQ(fields[f].size(), 8u) << fields[f];
          EXPECT_EQ(fields[f].find_first_not_of("0123456789abcdef"), std::string::npos);
        } else {
          EXPECT_EQ(fields[f].find_first_not_of("0123456789"), std::string::npos) << fields[f];
        }
      }
    }
    EXPECT_EQ(count, rows) << name;
    // 5% of the fields are empty.
    EXPECT_NEAR(static_cast<double>(empty) / static_cast<double>(fields_seen), 0.05, 0.005);
    absl::StatusOr<int64_t> counted = data::CountRows(Path("out/" + name), data::CriteoFormat());
    ASSERT_TRUE(counted.ok()) << counted.status();
    EXPECT_EQ(*counted, rows);
  }
}

TEST_F(SynthCriteoTest, TheSameFlagsGiveTheSameBytesAtAnyThreadCount) {
  SynthCriteoOptions a = Small("a"), b = Small("b"), c = Small("c");
  a.threads = 1;
  b.threads = 3;
  c.seed = 2;
  Run(a);
  Run(b);
  Run(c);
  for (const std::string name : {"train.tsv", "test.tsv", "planted.txt"}) {
    const std::string bytes = ReadFile(Path("a/" + name)).value_or("");
    EXPECT_FALSE(bytes.empty());
    EXPECT_EQ(bytes, ReadFile(Path("b/" + name)).value_or("")) << name;
    EXPECT_NE(bytes, ReadFile(Path("c/" + name)).value_or("")) << name;
  }
  // A longer file starts with the shorter one's rows.
  SynthCriteoOptions longer = Small("d");
  longer.train_examples = 20001;
  Run(longer);
  const std::string more = ReadFile(Path("d/train.tsv")).value_or("");
  EXPECT_EQ(more.substr(0, ReadFile(Path("a/train.tsv")).value_or("").size()),
            ReadFile(Path("a/train.tsv")).value_or(""));
}

TEST_F(SynthCriteoTest, PlantedFiguresAreThoseOfTheRowsReadBack) {
  SynthCriteoOptions o = Small("out");
  o.positive_rate = 0.3;
  Run(o);
  absl::StatusOr<PlantedModel> model = PlantedModel::Create(o);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<data::CsvReader>> reader =
      data::CsvReader::Open(Path("out/test.tsv"), data::CriteoFormat());
  ASSERT_TRUE(reader.ok()) << reader.status();
  evaluator::BinaryScores scores;
  data::CsvRow row;
  double probability_sum = 0;
  while (true) {
    absl::StatusOr<bool> more = (*reader)->Next(&row);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    absl::StatusOr<double> p = model->Probability(row);
    ASSERT_TRUE(p.ok()) << p.status();
    probability_sum += *p;
    ASSERT_TRUE(scores.Add(*p, row.label).ok());
  }
  const evaluator::BinaryResult r = scores.Result();
  const std::map<std::string, std::string> planted = Planted(Path("out"));
  ASSERT_EQ(r.examples, 20000);
  EXPECT_EQ(planted.at("examples"), "20000");
  ASSERT_TRUE(r.auc.has_value() && r.log_loss.has_value());
  EXPECT_DOUBLE_EQ(*r.auc, Number(planted, "bayes_auc"));
  EXPECT_DOUBLE_EQ(*r.log_loss, Number(planted, "bayes_logloss"));
  // The labels follow the probabilities: well above chance, and the rates
  // near the target.
  EXPECT_GT(*r.auc, 0.7);
  EXPECT_NEAR(probability_sum / 20000, 0.3, 0.01);
  EXPECT_NEAR(Number(planted, "positive_rate"), 0.3, 0.015);
  EXPECT_NEAR(Number(planted, "train_positive_rate"), 0.3, 0.015);
  EXPECT_EQ(planted.at("seed"), "1");
  EXPECT_THAT(planted.at("vocab_sizes"), testing::StartsWith("1,1,1000,1000,"));
}

TEST_F(SynthCriteoTest, ZipfHeadIdsAreAsFrequentAsZipfSays) {
  SynthCriteoOptions o = Small("out");
  Run(o);
  absl::StatusOr<std::unique_ptr<data::CsvReader>> reader =
      data::CsvReader::Open(Path("out/train.tsv"), data::CriteoFormat());
  ASSERT_TRUE(reader.ok()) << reader.status();
  // C3: 1,000 ids (10^6 scaled by 0.001), exponent 1.15.
  const int column = 2;
  absl::flat_hash_map<uint64_t, int64_t> counts;
  data::CsvRow row;
  int64_t present = 0;
  while (*(*reader)->Next(&row)) {
    if (row.categorical[column] == data::kMissingId) continue;
    ++present;
    ++counts[row.categorical[column]];
  }
  double norm = 0;
  for (int k = 1; k <= 1000; ++k) norm += std::pow(k, -1.15);
  for (int rank = 1; rank <= 3; ++rank) {
    const double expected = std::pow(rank, -1.15) / norm;
    const double seen =
        static_cast<double>(counts[CriteoId(column, rank)]) / static_cast<double>(present);
    EXPECT_NEAR(seen, expected, 0.01) << "rank " << rank;
  }
  int64_t top = 0;
  for (const auto& [id, n] : counts) top = std::max(top, n);
  EXPECT_EQ(top, counts[CriteoId(column, 1)]);
}

TEST_F(SynthCriteoTest, ZipfSamplerMatchesTheDistribution) {
  for (const double exponent : {0.6, 1.0, 1.15, 2.0}) {
    const int n = 20;
    ZipfSampler zipf(n, exponent);
    uint64_t state = 12345;
    auto uniform = [&state] {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<double>(state >> 11) * 0x1.0p-53;
    };
    std::vector<int64_t> counts(n + 1);
    const int draws = 200000;
    for (int i = 0; i < draws; ++i) {
      const int64_t k = zipf.Sample(uniform);
      ASSERT_GE(k, 1);
      ASSERT_LE(k, n);
      ++counts[k];
    }
    double norm = 0;
    for (int k = 1; k <= n; ++k) norm += std::pow(k, -exponent);
    for (int k = 1; k <= n; ++k) {
      const double expected = std::pow(k, -exponent) / norm;
      EXPECT_NEAR(static_cast<double>(counts[k]) / draws, expected,
                  5 * std::sqrt(expected / draws) + 1e-4)
          << "exponent " << exponent << " rank " << k;
    }
  }
}

TEST_F(SynthCriteoTest, RefusesBadOptions) {
  ThreadPool pool(0);
  auto error = [&](const SynthCriteoOptions& o) {
    absl::StatusOr<SynthCriteoSummary> s = SynthCriteo(o, &pool);
    return s.ok() ? std::string("ok") : std::string(s.status().message());
  };
  SynthCriteoOptions o = Small("out");
  o.positive_rate = 1;
  EXPECT_THAT(error(o), HasSubstr("positive_rate 1 is not in (0, 1)"));
  o = Small("out");
  o.vocab_scale = 0;
  EXPECT_THAT(error(o), HasSubstr("vocab_scale 0 is not in (0, 1000]"));
  o = Small("out");
  o.columns[4].zipf_exponent = -1;
  EXPECT_THAT(error(o), HasSubstr("C5: zipf exponent -1 is not in (0, 10]"));
  o = Small("out");
  o.interactions = 9;
  EXPECT_THAT(error(o), HasSubstr("interactions 9 is not in [0, 8]"));
  o = Small("out");
  o.train_examples = -1;
  EXPECT_THAT(error(o), HasSubstr("train_examples -1 is negative"));
  EXPECT_FALSE(fs::exists(Path("out")));
  data::CsvRow short_row;
  short_row.numeric.resize(3);
  EXPECT_THAT(PlantedModel::Create(Small("x"))->Probability(short_row).status().message(),
              HasSubstr("not of Criteo's layout"));
}

TEST_F(SynthCriteoTest, BinaryWritesAndExplains) {
  Ran help = RunBinary(dir_, "--help");
  EXPECT_EQ(help.status, 0);
  for (const char* flag :
       {"psflow-data synth-criteo", "--train_examples", "--test_examples", "--seed",
        "--vocab_scale", "--positive_rate", "--missing_rate", "--interactions", "--vocab_sizes",
        "--zipf_exponents", "--weight_stddev", "--pair_scale"}) {
    EXPECT_THAT(help.out, HasSubstr(flag));
  }
  Ran ran = RunBinary(dir_, absl::StrCat("synth-criteo --output=", Path("out"),
                                         " --train_examples=300 --test_examples=200"
                                         " --vocab_scale=0.001 --threads=2 --vocab_sizes=5000"));
  EXPECT_EQ(ran.status, 0) << ran.err;
  EXPECT_THAT(ran.out, HasSubstr("wrote 300 train and 200 test rows to " + Path("out")));
  EXPECT_THAT(ran.out, HasSubstr("bayes_auc=0."));
  EXPECT_EQ(Planted(Path("out")).at("vocab_sizes"),
            "5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"synth-criteo", "--output is required"},
      {"synth-criteo --output=o --positive_rate=1.5", "positive_rate 1.5 is not in (0, 1)"},
      {"synth-criteo --output=o --vocab_sizes=1,2", "--vocab_sizes has 2 values, not 1 or 26"},
      {"synth-criteo --output=o --zipf_exponents=x", "--zipf_exponents: 'x' is not a number"},
      {"synth-criteo --output=o --records=2", "--records is a flag of inspect, not of synth"},
      {"convert --from=idx --seed=3", "--seed is a flag of synth-criteo, not of convert"},
      {"inspect f --output=o", "--output is a flag of convert and synth-criteo, not of inspect"},
      {"synth-criteo --output=o extra", "unexpected argument 'extra'"}};
  for (const auto& [args, message] : cases) {
    Ran bad = RunBinary(dir_, args);
    EXPECT_EQ(bad.status, 1) << args;
    EXPECT_THAT(bad.err, HasSubstr(message)) << args;
    EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << args << ": " << bad.err;
  }
}

}  // namespace
}  // namespace psflow::data_tool
