// psflow-data: converts data sets to TFRecord shards of tf.Examples, inspects
// TFRecord files and writes synthetic click logs (tools/data/convert.h,
// inspect.h, synth_criteo.h).
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/thread_pool.h"
#include "role/command_line.h"
#include "tools/data/convert.h"
#include "tools/data/inspect.h"
#include "tools/data/synth_criteo.h"

ABSL_FLAG(std::string, from, "", "convert: the input's kind: idx, image_folder or csv.");
ABSL_FLAG(std::string, input, "",
          "convert: a folder of MNIST-format IDX files (idx), the root of <class>/<image> "
          "folders (image_folder) or a CSV/TSV file (csv).");
ABSL_FLAG(std::string, output, "",
          "convert: the folder of the shards; synth-criteo: of train.tsv, test.tsv and "
          "planted.txt (created if missing).");
ABSL_FLAG(int, shards, 1, "convert: the number of TFRecord files, <name>-SSSSS-of-NNNNN.");
ABSL_FLAG(int, threads, 1,
          "convert: shards written at once; writer t writes shards t, t+threads, ...; "
          "synth-criteo: threads formatting rows (the bytes do not depend on it).");
ABSL_FLAG(std::string, split, "train", "convert, idx: train (train-*) or test (t10k-*) files.");
ABSL_FLAG(std::string, image_format, "png",
          "convert, idx: how the images are encoded: png (lossless) or jpeg.");
ABSL_FLAG(int, jpeg_quality, 95, "convert, idx with --image_format=jpeg: quality in [1, 100].");
ABSL_FLAG(std::string, compression, "none", "convert: none, or gzip (whole-file, as TF's GZIP).");
ABSL_FLAG(std::string, name, "",
          "convert: the shards' prefix; empty: test for --from=idx --split=test, else train.");
ABSL_FLAG(std::string, csv_columns, "",
          "convert, csv: the columns, 'name:type,...' with types label, numeric, categorical, "
          "hex, text, ignore ('*:type' for the header's other columns).");
ABSL_FLAG(std::string, csv_delimiter, ",",
          "convert, csv: the field delimiter, one character or 'tab'.");
ABSL_FLAG(bool, csv_header, true,
          "convert, csv: the file starts with a header naming the columns; without one, "
          "--csv_columns lists every column in order.");
ABSL_FLAG(std::string, csv_preset, "",
          "convert, csv: a named layout instead of --csv_columns: criteo (tab-separated, no "
          "header, label, I1-I13 numeric, C1-C26 hex).");
ABSL_FLAG(int64_t, records, 3, "inspect: the records whose features are shown.");
ABSL_FLAG(int64_t, train_examples, 1000000, "synth-criteo: the rows of train.tsv.");
ABSL_FLAG(int64_t, test_examples, 100000, "synth-criteo: the rows of test.tsv.");
ABSL_FLAG(uint64_t, seed, 1,
          "synth-criteo: the seed of the planted model and of every row; the same flags give "
          "the same bytes.");
ABSL_FLAG(double, vocab_scale, 1,
          "synth-criteo: multiplies every column's vocabulary (rounded, at least 1), e.g. 0.001 "
          "for small tests.");
ABSL_FLAG(double, positive_rate, 0.25,
          "synth-criteo: the mean planted probability the bias is set to, in (0, 1).");
ABSL_FLAG(double, missing_rate, 0.02,
          "synth-criteo: the probability that an I or C field is empty, in [0, 1).");
ABSL_FLAG(int, interactions, 4,
          "synth-criteo: planted pairwise terms, 0 to 8 (C6xC14, C2xC5, C1xC8, C17xC25, "
          "C7xC11, C22xC23, C13xC18, C10xC26, first ones first).");
ABSL_FLAG(double, pair_scale, 0.5, "synth-criteo: the standard deviation of each pairwise term.");
ABSL_FLAG(std::string, vocab_sizes, "",
          "synth-criteo: C1..C26's vocabularies before --vocab_scale, 26 comma-separated "
          "integers or one for all; empty: Criteo's, capped at 10^6 (planted.txt lists them).");
ABSL_FLAG(std::string, zipf_exponents, "",
          "synth-criteo: C1..C26's Zipf exponents (> 0), 26 comma-separated values or one for "
          "all; empty: 0.6 to 1.15 by vocabulary.");
ABSL_FLAG(double, weight_stddev, 0.25,
          "synth-criteo: the standard deviation of each categorical id's planted weight.");

namespace {

constexpr char kUsage[] =
    "converts data sets to TFRecord shards of tf.Example, inspects TFRecord files and writes\n"
    "synthetic click logs of a known best AUC.\n"
    "  psflow-data convert --from=idx|image_folder|csv --input=PATH --output=DIR [--shards=N]\n"
    "      [--threads=T] [--name=train] [--compression=none|gzip] ...\n"
    "    Records go to the shards in input order, contiguous ranges, keys as TensorFlow's\n"
    "    build_image_data.py writes them (image/encoded, image/class/label, image/height,\n"
    "    image/width, image/channels, image/format; image/class/text and image/filename for\n"
    "    image folders, whose files are stored unchanged). CSV rows become one feature per\n"
    "    column, the label as 'label'. Prints one line: records, shards, bytes, seconds.\n"
    "  psflow-data inspect FILE [--records=3]\n"
    "    Prints the compression, the first records' offsets, sizes and features, and the\n"
    "    file's record count.\n"
    "  psflow-data synth-criteo --output=DIR [--train_examples=N] [--test_examples=N]\n"
    "      [--seed=S] [--vocab_scale=X] [--positive_rate=P] [--threads=T] ...\n"
    "    Writes train.tsv and test.tsv in Criteo's layout (tab-separated, no header: label,\n"
    "    I1-I13, C1-C26 as 8 hex digits) drawn from a planted logistic model, and\n"
    "    planted.txt: the best AUC and log-loss on test.tsv (of the true probabilities)\n"
    "    and the model's parameters (docs/data.md).";

// Each subcommand's own flags; another subcommand's flag is refused.
struct Subcommand {
  std::string name;
  std::vector<std::string> flags;
  int positional;  // arguments after the subcommand's name
};
const std::vector<Subcommand>& Subcommands() {
  static const auto* commands = new std::vector<Subcommand>{
      {"convert",
       {"from", "input", "output", "shards", "threads", "split", "image_format", "jpeg_quality",
        "compression", "name", "csv_columns", "csv_delimiter", "csv_header", "csv_preset"},
       0},
      {"inspect", {"records"}, 1},
      {"synth-criteo",
       {"output", "threads", "train_examples", "test_examples", "seed", "vocab_scale",
        "positive_rate", "missing_rate", "interactions", "pair_scale", "vocab_sizes",
        "zipf_exponents", "weight_stddev"},
       0}};
  return *commands;
}

// The first flag of another subcommand written in argv (as -f, --f, --f=v or
// --nof), with the subcommands it belongs to; "" if none. absl keeps whether
// a flag was given private; its value may equal the default.
std::pair<std::string, std::string> ForeignFlag(int argc, char** argv, const Subcommand& own) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-")) continue;
    absl::ConsumePrefix(&arg, "-");
    arg = arg.substr(0, arg.find('='));
    std::vector<std::string> owners;
    std::string flag;
    for (const Subcommand& c : Subcommands()) {
      for (const std::string& f : c.flags) {
        if (arg != f && arg != absl::StrCat("no", f)) continue;
        owners.push_back(c.name);
        flag = f;
      }
    }
    if (!owners.empty() && std::find(owners.begin(), owners.end(), own.name) == owners.end()) {
      return {flag, absl::StrJoin(owners, " and ")};
    }
  }
  return {"", ""};
}

// A comma-separated list of one value for all 26 columns or one per column.
template <typename T>
absl::StatusOr<std::vector<T>> PerColumn(const std::string& flag, const std::string& text) {
  std::vector<T> values;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    T v;
    bool ok;
    if constexpr (std::is_integral_v<T>) {
      ok = absl::SimpleAtoi(part, &v);
    } else {
      ok = absl::SimpleAtod(part, &v);
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not a number"));
    }
    values.push_back(v);
  }
  if (values.size() == 1) values.assign(psflow::data_tool::kCriteoCategoricals, values[0]);
  if (values.size() != psflow::data_tool::kCriteoCategoricals) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " has ", values.size(), " values, not 1 or 26 (C1..C26)"));
  }
  return values;
}

// The options of the convert flags; an error is the line to print.
absl::StatusOr<psflow::data_tool::ConvertOptions> ConvertOptionsFromFlags() {
  psflow::data_tool::ConvertOptions o;
  o.from = absl::GetFlag(FLAGS_from);
  if (o.from.empty())
    return absl::InvalidArgumentError("--from is required: idx, image_folder or csv");
  o.input = absl::GetFlag(FLAGS_input);
  o.output = absl::GetFlag(FLAGS_output);
  o.name = absl::GetFlag(FLAGS_name);
  o.shards = absl::GetFlag(FLAGS_shards);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.jpeg_quality = absl::GetFlag(FLAGS_jpeg_quality);
  const std::string split = absl::GetFlag(FLAGS_split);
  if (split != "train" && split != "test") {
    return absl::InvalidArgumentError(absl::StrCat("--split '", split, "' is not train or test"));
  }
  o.split = split == "test" ? psflow::data::Split::kTest : psflow::data::Split::kTrain;
  const std::string image_format = absl::GetFlag(FLAGS_image_format);
  if (image_format != "png" && image_format != "jpeg") {
    return absl::InvalidArgumentError(
        absl::StrCat("--image_format '", image_format, "' is not png or jpeg"));
  }
  o.image_format =
      image_format == "jpeg" ? psflow::data::ImageFormat::kJpeg : psflow::data::ImageFormat::kPng;
  const std::string compression = absl::GetFlag(FLAGS_compression);
  if (compression != "none" && compression != "gzip") {
    return absl::InvalidArgumentError(
        absl::StrCat("--compression '", compression, "' is not none or gzip"));
  }
  o.compression = compression == "gzip" ? psflow::data::RecordCompression::kGzip
                                        : psflow::data::RecordCompression::kNone;
  if (o.from == "csv") {
    absl::StatusOr<psflow::data::CsvFormat> csv = psflow::data::CsvFormatFromFlags(
        absl::GetFlag(FLAGS_csv_preset), absl::GetFlag(FLAGS_csv_columns),
        absl::GetFlag(FLAGS_csv_delimiter), absl::GetFlag(FLAGS_csv_header));
    if (!csv.ok()) return csv.status();
    o.csv = *std::move(csv);
  }
  return o;
}

int RunConvert() {
  absl::StatusOr<psflow::data_tool::ConvertOptions> o = ConvertOptionsFromFlags();
  if (!o.ok()) return psflow::FailWith(o.status());
  psflow::ThreadPool pool(std::max(0, o->threads - 1));
  absl::StatusOr<psflow::data_tool::ConvertSummary> summary = psflow::data_tool::Convert(*o, &pool);
  if (!summary.ok()) return psflow::FailWith(summary.status());
  std::cout << psflow::data_tool::DescribeSummary(*o, *summary) << std::endl;
  return 0;
}

// The options of the synth-criteo flags; an error is the line to print.
absl::StatusOr<psflow::data_tool::SynthCriteoOptions> SynthOptionsFromFlags() {
  psflow::data_tool::SynthCriteoOptions o;
  o.output = absl::GetFlag(FLAGS_output);
  if (o.output.empty()) return absl::InvalidArgumentError("--output is required: a folder");
  o.train_examples = absl::GetFlag(FLAGS_train_examples);
  o.test_examples = absl::GetFlag(FLAGS_test_examples);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.vocab_scale = absl::GetFlag(FLAGS_vocab_scale);
  o.positive_rate = absl::GetFlag(FLAGS_positive_rate);
  o.missing_rate = absl::GetFlag(FLAGS_missing_rate);
  o.interactions = absl::GetFlag(FLAGS_interactions);
  o.pair_scale = absl::GetFlag(FLAGS_pair_scale);
  o.threads = absl::GetFlag(FLAGS_threads);
  if (const std::string v = absl::GetFlag(FLAGS_vocab_sizes); !v.empty()) {
    absl::StatusOr<std::vector<int64_t>> sizes = PerColumn<int64_t>("vocab_sizes", v);
    if (!sizes.ok()) return sizes.status();
    for (size_t c = 0; c < sizes->size(); ++c) o.columns[c].vocab = (*sizes)[c];
  }
  if (const std::string v = absl::GetFlag(FLAGS_zipf_exponents); !v.empty()) {
    absl::StatusOr<std::vector<double>> exponents = PerColumn<double>("zipf_exponents", v);
    if (!exponents.ok()) return exponents.status();
    for (size_t c = 0; c < exponents->size(); ++c) o.columns[c].zipf_exponent = (*exponents)[c];
  }
  for (psflow::data_tool::SynthColumn& c : o.columns)
    c.weight_stddev = absl::GetFlag(FLAGS_weight_stddev);
  return o;
}

int RunSynthCriteo() {
  absl::StatusOr<psflow::data_tool::SynthCriteoOptions> o = SynthOptionsFromFlags();
  if (!o.ok()) return psflow::FailWith(o.status());
  psflow::ThreadPool pool(std::clamp(o->threads - 1, 0, 1023));
  absl::StatusOr<psflow::data_tool::SynthCriteoSummary> summary =
      psflow::data_tool::SynthCriteo(*o, &pool);
  if (!summary.ok()) return psflow::FailWith(summary.status());
  std::cout << psflow::data_tool::DescribeSynthSummary(*o, *summary) << std::endl;
  return 0;
}

int RunInspect(const std::string& path) {
  const int64_t records = absl::GetFlag(FLAGS_records);
  if (records < 0) return psflow::FailWith("--records must not be negative");
  absl::Status status = psflow::data_tool::InspectFile(path, records, std::cout);
  std::cout.flush();
  return status.ok() ? 0 : psflow::FailWith(status);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest = psflow::ParseCommandLine(argc, argv, kUsage);
  if (rest.size() < 2) {
    return psflow::FailWith(
        "give a subcommand, convert, inspect or synth-criteo (psflow-data --help)");
  }
  const std::string command = rest[1];
  const auto& commands = Subcommands();
  const auto it = std::find_if(commands.begin(), commands.end(),
                               [&](const Subcommand& c) { return c.name == command; });
  if (it == commands.end()) {
    return psflow::FailWith(absl::StrCat("unknown subcommand '", command,
                                         "': psflow-data takes convert, inspect or synth-criteo"));
  }
  const auto [wrong, owners] = ForeignFlag(argc, argv, *it);
  if (!wrong.empty()) {
    return psflow::FailWith(
        absl::StrCat("--", wrong, " is a flag of ", owners, ", not of ", command));
  }
  const size_t positional = 2 + it->positional;
  if (rest.size() > positional) {
    return psflow::FailWith(std::string("unexpected argument '") + rest[positional] + "'");
  }
  if (command == "convert") return RunConvert();
  if (command == "synth-criteo") return RunSynthCriteo();
  if (rest.size() < 3) return psflow::FailWith("inspect needs a FILE: psflow-data inspect FILE");
  return RunInspect(rest[2]);
}
