#include "worker/batches.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/placement.h"
#include "common/status_macros.h"

namespace psflow::worker {

WorkerBatches::WorkerBatches(const data::Dataset& data, const JobConfig& job, int worker)
    : data_(&data),
      batch_(WorkerBatch(job)),
      example_floats_(data.example_floats()),
      example_ids_(data.example_ids()),
      sampler_(
          std::make_unique<data::ShardSampler>(data.count, job.num_workers(), worker, job.seed())),
      own_images_(static_cast<size_t>(batch_ * example_floats_)),
      own_ids_(static_cast<size_t>(batch_ * example_ids_)),
      own_labels_(static_cast<size_t>(batch_)),
      images_(own_images_.data()),
      labels_(own_labels_.data()) {
  SelectIds(job, data.id_features);
}

WorkerBatches::WorkerBatches(const JobConfig& job, std::unique_ptr<data::Pipeline> pipeline,
                             int64_t example_floats,
                             const std::vector<data::IdFeature>& id_features)
    : batch_(WorkerBatch(job)),
      example_floats_(example_floats),
      example_ids_(data::IdsPerExample(id_features)),
      pipeline_(std::move(pipeline)) {
  SelectIds(job, id_features);
}

void WorkerBatches::SelectIds(const JobConfig& job,
                              const std::vector<data::IdFeature>& id_features) {
  absl::StatusOr<data::IdSelection> s =
      data::IdSelection::Create(id_features, "the worker's data", job.model());
  if (!s.ok()) {
    selection_status_ = s.status();
    return;
  }
  selection_ = *std::move(s);
  model_ids_.resize(static_cast<size_t>(batch_ * selection_.model_ids()));
}

void WorkerBatches::PickIds(const uint64_t* data_ids) {
  if (selection_.model_ids() > 0) selection_.Select(data_ids, batch_, model_ids_.data());
}

absl::StatusOr<std::unique_ptr<WorkerBatches>> WorkerBatches::Streamed(
    const data::DataFormat* format, const JobConfig& job, int worker, int64_t steps_per_epoch,
    int input_threads) {
  data::PipelineOptions o;
  o.num_workers = job.num_workers();
  o.worker = worker;
  o.seed = job.seed();
  o.batch = WorkerBatch(job);
  o.batches_per_epoch = steps_per_epoch;
  o.train = true;
  o.shuffle_buffer = job.data().shuffle_buffer();
  o.prefetch_batches = std::max(job.data().prefetch_batches(), 1);
  o.threads = std::max(input_threads, 1);
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<data::Pipeline> pipeline,
                          data::Pipeline::Create(format, o));
  return std::unique_ptr<WorkerBatches>(
      new WorkerBatches(job, std::move(pipeline), format->example_floats(), format->id_features()));
}

std::string WorkerBatches::Summary() const {
  if (pipeline_ == nullptr) return "";
  return absl::StrCat("input: waited ", absl::FormatDuration(pipeline_->waited()), " for batches; ",
                      pipeline_->bad_records(), " corrupt records skipped");
}

absl::Status WorkerBatches::Gather(int64_t step, int64_t steps_per_epoch) {
  PSFLOW_RETURN_IF_ERROR(selection_status_);
  const int64_t epoch = step / steps_per_epoch, position = step % steps_per_epoch;
  if (pipeline_ != nullptr) {
    PSFLOW_ASSIGN_OR_RETURN(const data::Batch* b, pipeline_->Get(epoch, position));
    images_ = b->images.data();
    PickIds(b->ids.data());
    labels_ = b->labels.data();
    return absl::OkStatus();
  }
  if (epoch != epoch_) {
    order_ = sampler_->EpochIndices(epoch);
    epoch_ = epoch;
  }
  PSFLOW_RETURN_IF_ERROR(
      data::GatherBatch(*data_, absl::MakeConstSpan(order_).subspan(position * batch_, batch_),
                        own_images_.data(), own_ids_.data(), own_labels_.data()));
  PickIds(own_ids_.data());
  return absl::OkStatus();
}

}  // namespace psflow::worker
