// psflow-data: converts data sets to TFRecord shards of tf.Examples and
// inspects TFRecord files (tools/data/convert.h, inspect.h).
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/thread_pool.h"
#include "role/command_line.h"
#include "tools/data/convert.h"
#include "tools/data/inspect.h"

ABSL_FLAG(std::string, from, "", "convert: the input's kind: idx, image_folder or csv.");
ABSL_FLAG(std::string, input, "",
          "convert: a folder of MNIST-format IDX files (idx), the root of <class>/<image> "
          "folders (image_folder) or a CSV/TSV file (csv).");
ABSL_FLAG(std::string, output, "", "convert: the folder of the shards (created if missing).");
ABSL_FLAG(int, shards, 1, "convert: the number of TFRecord files, <name>-SSSSS-of-NNNNN.");
ABSL_FLAG(int, threads, 1,
          "convert: shards written at once; writer t writes shards t, t+threads, ...");
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

namespace {

constexpr char kUsage[] =
    "converts data sets to TFRecord shards of tf.Example and inspects TFRecord files.\n"
    "  psflow-data convert --from=idx|image_folder|csv --input=PATH --output=DIR [--shards=N]\n"
    "      [--threads=T] [--name=train] [--compression=none|gzip] ...\n"
    "    Records go to the shards in input order, contiguous ranges, keys as TensorFlow's\n"
    "    build_image_data.py writes them (image/encoded, image/class/label, image/height,\n"
    "    image/width, image/channels, image/format; image/class/text and image/filename for\n"
    "    image folders, whose files are stored unchanged). CSV rows become one feature per\n"
    "    column, the label as 'label'. Prints one line: records, shards, bytes, seconds.\n"
    "  psflow-data inspect FILE [--records=3]\n"
    "    Prints the compression, the first records' offsets, sizes and features, and the\n"
    "    file's record count.";

const std::vector<std::string> kConvertFlags = {
    "from",        "input",         "output",       "shards",      "threads",
    "split",       "image_format",  "jpeg_quality", "compression", "name",
    "csv_columns", "csv_delimiter", "csv_header",   "csv_preset"};
const std::vector<std::string> kInspectFlags = {"records"};

// The first of `flags` written in argv (as -f, --f, --f=v or --nof), or "".
// absl keeps whether a flag was given private; its value may equal the default.
std::string GivenFlag(int argc, char** argv, const std::vector<std::string>& flags) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "-")) continue;
    absl::ConsumePrefix(&arg, "-");
    arg = arg.substr(0, arg.find('='));
    for (const std::string& f : flags) {
      if (arg == f || arg == absl::StrCat("no", f)) return f;
    }
  }
  return "";
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
    return psflow::FailWith("give a subcommand, convert or inspect (psflow-data --help)");
  }
  const std::string command = rest[1];
  const bool convert = command == "convert";
  if (!convert && command != "inspect") {
    return psflow::FailWith(
        absl::StrCat("unknown subcommand '", command, "': psflow-data takes convert or inspect"));
  }
  const std::string wrong = GivenFlag(argc, argv, convert ? kInspectFlags : kConvertFlags);
  if (!wrong.empty()) {
    return psflow::FailWith(absl::StrCat("--", wrong, " is a flag of ",
                                         convert ? "inspect" : "convert", ", not of ", command));
  }
  const size_t positional = convert ? 2 : 3;
  if (rest.size() > positional) {
    return psflow::FailWith(std::string("unexpected argument '") + rest[positional] + "'");
  }
  if (convert) return RunConvert();
  if (rest.size() < 3) return psflow::FailWith("inspect needs a FILE: psflow-data inspect FILE");
  return RunInspect(rest[2]);
}
