// psflow-data convert: writes an input (sources.h) as TFRecord shards of
// tf.Examples, named and filled as TensorFlow's build_image_data.py does:
// <name>-SSSSS-of-NNNNN, shard s holding records [s*n/N, (s+1)*n/N) in input
// order, written by `threads` writers of which writer t writes shards t,
// t + threads, ...
//
// Each shard is written as <shard>.tmp and renamed (after an fsync) only when
// every shard is complete, so a failed run leaves no shard of its own under a
// final name (unless a rename itself fails part way); its .tmp files are
// removed. Errors are one line naming the file.
#ifndef PSFLOW_TOOLS_DATA_CONVERT_H_
#define PSFLOW_TOOLS_DATA_CONVERT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "data/csv/csv.h"
#include "data/image/image.h"
#include "data/mnist.h"
#include "data/tfrecord/record_file.h"

namespace psflow::data_tool {

struct ConvertOptions {
  std::string from;    // idx, image_folder or csv
  std::string input;   // a folder (idx, image_folder) or a file (csv)
  std::string output;  // the folder of the shards, created if missing
  // The shards' prefix; empty: "test" for the idx test split, else "train".
  std::string name;
  int shards = 1;                           // 1 to 99999
  int threads = 1;                          // writers; more than `shards` are not used
  data::Split split = data::Split::kTrain;  // idx
  data::ImageFormat image_format = data::ImageFormat::kPng;  // idx: PNG or JPEG
  int jpeg_quality = 95;                                     // idx with JPEG
  data::RecordCompression compression = data::RecordCompression::kNone;
  data::CsvFormat csv;  // csv: its columns (resolved by the header on opening)
};

struct ConvertSummary {
  int64_t records = 0;
  int shards = 0;
  int64_t bytes = 0;  // of the shard files as written (compressed, with gzip)
  double seconds = 0;
  // Files named <name>-* in the output folder that this run did not write
  // (say, shards of an earlier run with another --shards): a reader of
  // <name>-* would take them too.
  int64_t other_files = 0;
};

// The name of shard `shard` of `shards`: "train-00002-of-00010".
std::string ShardName(const std::string& name, int shard, int shards);

// Converts. `pool` runs the writers beside the calling thread: give it
// options.threads - 1 threads (fewer only makes writers wait their turn).
absl::StatusOr<ConvertSummary> Convert(const ConvertOptions& options, ThreadPool* pool);

// "wrote 10000 records to 3 shards in /out (test-*): 2.1 MiB in 0.42 s", and
// "; 2 other test-* files there are not of this run" when there are.
std::string DescribeSummary(const ConvertOptions& options, const ConvertSummary& summary);

}  // namespace psflow::data_tool

#endif  // PSFLOW_TOOLS_DATA_CONVERT_H_
