// The flags that say what a job's data is and how to read it, shared by
// psflow-chief (which hands the resolved DataConfig to every process) and
// psflow-eval. --data_dir and --synthetic_examples are each binary's own
// (their defaults differ); the flags of training alone (--train_files,
// --augment, --shuffle_buffer, --prefetch_batches) are the chief's.
#ifndef PSFLOW_DATA_FLAGS_H_
#define PSFLOW_DATA_FLAGS_H_

#include "data/formats.h"
#include "proto/data.pb.h"

namespace psflow::data {

// DefaultDataConfig() with the shared flags' values: format, keys, label
// offset, resize_shorter, the CSV layout, skip_bad_records.
DataConfig DataConfigFromFlags();
// --eval_files.
std::string EvalFilesFromFlags();

}  // namespace psflow::data

#endif  // PSFLOW_DATA_FLAGS_H_
