// psflow-check-tfrecord: prints every record of TFRecord files of tf.Example
// as psflow reads them (RecordReader, ParseExample, DecodeImage), one JSON
// object a line, for scripts/check-tfrecord-tf.sh to compare with what
// TensorFlow wrote. Not a ctest: the check needs TensorFlow from PyPI.
//
// A line: {"file": F, "index": I, "offset": O, "compression": "none"|"gzip",
//   "features": {KEY: {"type": "int64"|"float"|"bytes", "values": [...]}}}
// int64 values as numbers, floats as "%.9g" (which reads back as the same
// float), bytes as hex; a bytes value that is a JPEG or PNG also gets
// "images": {KEY: [{"height", "width", "channels", "pixels": hex}]}, decoded
// to --channels.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "data/image/image.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"
#include "role/command_line.h"

ABSL_FLAG(int, channels, 3, "The channels (1 or 3) images are decoded to.");

namespace {

using psflow::data::Example;

// Keys and paths as JSON strings: quotes, backslashes and control bytes escaped.
std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The feature's JSON, and the decoded images of its bytes values (if any) in *images.
absl::StatusOr<std::string> FeatureJson(const psflow::example::Feature& f, int channels,
                                        std::vector<std::string>* images) {
  std::vector<std::string> values;
  std::string type;
  if (f.has_int64_list()) {
    type = "int64";
    for (int64_t v : f.int64_list().value()) values.push_back(absl::StrCat(v));
  } else if (f.has_float_list()) {
    type = "float";
    for (float v : f.float_list().value()) values.push_back(Quote(absl::StrFormat("%.9g", v)));
  } else {
    type = "bytes";
    for (const std::string& v : f.bytes_list().value()) {
      values.push_back(Quote(absl::BytesToHexString(v)));
      if (psflow::data::SniffImage(v) == psflow::data::ImageFormat::kUnknown) continue;
      absl::StatusOr<psflow::data::Image> image = psflow::data::DecodeImage(v, channels);
      if (!image.ok()) return image.status();
      const psflow::data::Image& im = *image;
      images->push_back(
          absl::StrCat("{\"height\": ", im.height, ", \"width\": ", im.width,
                       ", \"channels\": ", im.channels, ", \"pixels\": ",
                       Quote(absl::BytesToHexString(absl::string_view(
                           reinterpret_cast<const char*>(im.pixels.data()), im.pixels.size()))),
                       "}"));
    }
  }
  return absl::StrCat("{\"type\": \"", type, "\", \"values\": [", absl::StrJoin(values, ", "),
                      "]}");
}

// One JSON line per record of `path`.
absl::Status PrintFile(const std::string& path, int channels) {
  absl::StatusOr<std::unique_ptr<psflow::data::RecordReader>> reader =
      psflow::data::RecordReader::Open(path);
  if (!reader.ok()) return reader.status();
  const char* compression =
      (*reader)->compression() == psflow::data::RecordCompression::kGzip ? "gzip" : "none";
  std::string record;
  for (int64_t index = 0;; ++index) {
    const int64_t offset = (*reader)->offset();
    absl::StatusOr<bool> got = (*reader)->Next(&record);
    if (!got.ok()) return got.status();
    if (!*got) return absl::OkStatus();
    absl::StatusOr<Example> example = psflow::data::ParseExample(record);
    if (!example.ok()) return example.status();
    std::vector<std::string> features, images;
    // The proto map's order is unspecified; the reader sorts by key.
    for (const auto& [key, feature] : example->features().feature()) {
      std::vector<std::string> decoded;
      absl::StatusOr<std::string> json = FeatureJson(feature, channels, &decoded);
      if (!json.ok()) {
        return absl::Status(json.status().code(), absl::StrCat(path, ", record ", index, ", ", key,
                                                               ": ", json.status().message()));
      }
      features.push_back(absl::StrCat(Quote(key), ": ", *json));
      if (!decoded.empty()) {
        images.push_back(absl::StrCat(Quote(key), ": [", absl::StrJoin(decoded, ", "), "]"));
      }
    }
    std::cout << "{\"file\": " << Quote(path) << ", \"index\": " << index
              << ", \"offset\": " << offset << ", \"compression\": \"" << compression
              << "\", \"features\": {" << absl::StrJoin(features, ", ") << "}, \"images\": {"
              << absl::StrJoin(images, ", ") << "}}\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> files = psflow::ParseCommandLine(
      argc, argv,
      "prints each tf.Example of TFRecord files as psflow reads it, one JSON line a record.\n"
      "  psflow-check-tfrecord [--channels=3] FILE...",
      {"tfrecord_check.cc"});
  const int channels = absl::GetFlag(FLAGS_channels);
  if (channels != 1 && channels != 3) return psflow::FailWith("--channels must be 1 or 3");
  if (files.size() < 2) return psflow::FailWith("give one or more TFRecord files");
  for (size_t i = 1; i < files.size(); ++i) {
    absl::Status s = PrintFile(files[i], channels);
    std::cout.flush();
    if (!s.ok()) return psflow::FailWith(s);
  }
  return 0;
}
