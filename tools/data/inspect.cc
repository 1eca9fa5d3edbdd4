#include "tools/data/inspect.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"

namespace psflow::data_tool {

absl::Status InspectFile(const std::string& path, int64_t records, std::ostream& out) {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<data::RecordReader> reader,
                          data::RecordReader::Open(path));
  out << path << ": TFRecord, compression "
      << (reader->compression() == data::RecordCompression::kGzip ? "gzip" : "none") << "\n";
  std::string record;
  for (int64_t i = 0; i < records; ++i) {
    const int64_t offset = reader->offset();
    PSFLOW_ASSIGN_OR_RETURN(const bool more, reader->Next(&record));
    if (!more) break;
    out << "record " << i << " at offset " << offset << ": " << record.size() << " bytes\n";
    absl::StatusOr<data::Example> example = data::ParseExample(record);
    const std::string text =
        example.ok() ? data::DescribeFeatures(*example) : std::string(example.status().message());
    out << "  " << absl::StrReplaceAll(absl::StripSuffix(text, "\n"), {{"\n", "\n  "}}) << "\n";
    out.flush();
  }
  PSFLOW_ASSIGN_OR_RETURN(const int64_t count, data::CountRecords(path));
  out << "records: " << count << "\n";
  return absl::OkStatus();
}

}  // namespace psflow::data_tool
