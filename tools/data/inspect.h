// psflow-data inspect: what a TFRecord file holds, for a person to read.
#ifndef PSFLOW_TOOLS_DATA_INSPECT_H_
#define PSFLOW_TOOLS_DATA_INSPECT_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace psflow::data_tool {

// Writes to `out`, line by line as it reads: the file's compression; for each
// of its first `records` records, its offset and length and its features
// (DescribeFeatures, indented; a record that is not a tf.Example says so and
// inspection goes on); then the number of records in the whole file
// (CountRecords). A corrupt file or one that cannot be read: what was written
// before stays, and the error (one line naming the file) is returned.
absl::Status InspectFile(const std::string& path, int64_t records, std::ostream& out);

}  // namespace psflow::data_tool

#endif  // PSFLOW_TOOLS_DATA_INSPECT_H_
