// A worker's batches: the examples of its step k, from its share of the
// epoch that step falls in. Data held whole (IDX, synthetic) is sampled as
// data::ShardSampler says (the share's order drawn once per epoch) and
// gathered into buffers of its own; streamed data (TFRecord, image folders,
// CSV) comes from a data::Pipeline reading the worker's pieces of the files.
//
// Thread-safety: none (the training thread's). `data` and `format` are not
// owned and outlive the batches. Errors: Gather's, from data::GatherBatch or
// the pipeline (a record that cannot be read or decoded).
#ifndef PSFLOW_WORKER_BATCHES_H_
#define PSFLOW_WORKER_BATCHES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "data/formats.h"
#include "data/mnist.h"
#include "data/pipeline.h"
#include "data/source.h"
#include "proto/job.pb.h"

namespace psflow::worker {

class WorkerBatches {
 public:
  // Batches of data held whole.
  WorkerBatches(const data::Dataset& data, const JobConfig& job, int worker);
  // Batches of streamed data, `steps_per_epoch` of them in an epoch, decoded
  // on `input_threads` threads.
  static absl::StatusOr<std::unique_ptr<WorkerBatches>> Streamed(const data::DataFormat* format,
                                                                 const JobConfig& job, int worker,
                                                                 int64_t steps_per_epoch,
                                                                 int input_threads);

  // Gathers the batch of `step` (of `steps_per_epoch` in an epoch).
  absl::Status Gather(int64_t step, int64_t steps_per_epoch);
  const float* images() const { return images_; }
  // The batch's ids that the model's embedding layers read, model_ids() per
  // example in the model's id-feature order (data::IdSelection); null when
  // it reads none.
  const uint64_t* ids() const { return model_ids_.empty() ? nullptr : model_ids_.data(); }
  int64_t model_ids() const { return selection_.model_ids(); }
  const int32_t* labels() const { return labels_; }
  int64_t size() const { return batch_; }
  int64_t example_floats() const { return example_floats_; }
  // Streamed data: one line on the time waited for batches and the records
  // skipped as corrupt, for the log; empty for data held whole.
  std::string Summary() const;

 private:
  WorkerBatches(const JobConfig& job, std::unique_ptr<data::Pipeline> pipeline,
                int64_t example_floats, const std::vector<data::IdFeature>& id_features);
  // Picks the model's ids out of the data's (`id_features`); an error
  // (the data lacks one) is kept for Gather to return.
  void SelectIds(const JobConfig& job, const std::vector<data::IdFeature>& id_features);
  // The latest batch's model ids out of its data ids.
  void PickIds(const uint64_t* data_ids);

  const data::Dataset* const data_ = nullptr;
  const int64_t batch_;
  const int64_t example_floats_;
  const int64_t example_ids_;
  // Data held whole.
  std::unique_ptr<data::ShardSampler> sampler_;
  std::vector<float> own_images_;
  std::vector<uint64_t> own_ids_;
  std::vector<int32_t> own_labels_;
  std::vector<int64_t> order_;
  int64_t epoch_ = -1;
  // Streamed data.
  std::unique_ptr<data::Pipeline> pipeline_;
  // The latest batch.
  const float* images_ = nullptr;
  data::IdSelection selection_;
  absl::Status selection_status_;
  std::vector<uint64_t> model_ids_;
  const int32_t* labels_ = nullptr;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_BATCHES_H_
