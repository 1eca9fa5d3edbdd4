#include "chief/job_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "data/mnist.h"
#include "data/source.h"
#include "data/synthetic.h"
#include "model/spec.h"
#include "ps/optimizer.h"

namespace psflow::chief {
namespace {

// What the chief needs of the training data: how many examples, and the
// mean and standard deviation of their pixels (scaled to [0, 1]) for
// standardizing the model's inputs.
struct TrainingDataStats {
  int64_t count = 0;
  int64_t height = 0, width = 0;
  double mean = 0, stddev = 0;
};

// Sets stats->mean and stats->stddev from `pixels`, divided by `scale` to
// bring them to [0, 1] (255 for IDX bytes, 1 for floats already there).
template <typename Pixel>
void SetPixelStats(const std::vector<Pixel>& pixels, double scale, TrainingDataStats* stats) {
  double sum = 0, sum_sq = 0;
  for (Pixel p : pixels) {
    sum += p;
    sum_sq += static_cast<double>(p) * p;
  }
  const double n = static_cast<double>(pixels.size());
  stats->mean = sum / n / scale;
  stats->stddev = std::sqrt(std::max(sum_sq / n - (sum / n) * (sum / n), 0.0)) / scale;
}

absl::StatusOr<TrainingDataStats> ReadTrainingDataStats(const std::string& data_dir) {
  absl::StatusOr<data::IdxFile> labels =
      data::ReadIdxFileInDir(data_dir, "train-labels-idx1-ubyte");
  if (!labels.ok())
    return absl::InvalidArgumentError(absl::StrCat("--data_dir: ", labels.status().message()));
  absl::StatusOr<data::IdxFile> images =
      data::ReadIdxFileInDir(data_dir, "train-images-idx3-ubyte");
  if (!images.ok())
    return absl::InvalidArgumentError(absl::StrCat("--data_dir: ", images.status().message()));
  if (labels->dims.size() != 1 || images->dims.size() != 3 || images->dims[0] != labels->dims[0] ||
      images->data.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the training images and labels in ", data_dir, " do not match"));
  }
  TrainingDataStats stats;
  stats.count = labels->dims[0];
  stats.height = images->dims[1];
  stats.width = images->dims[2];
  SetPixelStats(images->data, 255.0, &stats);
  return stats;
}

// The same for data made in memory (the synthetic dataset).
TrainingDataStats StatsOf(const data::Dataset& d) {
  TrainingDataStats stats;
  stats.count = d.count;
  stats.height = d.height;
  stats.width = d.width;
  SetPixelStats(d.images, 1.0, &stats);
  return stats;
}

absl::StatusOr<OptimizerConfig> MakeOptimizer(const JobOptions& o) {
  OptimizerConfig config;
  const std::string name = absl::AsciiStrToLower(o.optimizer);
  if (name == "sgd") {
    config.set_kind(OptimizerConfig::SGD);
  } else if (name == "momentum") {
    config.set_kind(OptimizerConfig::MOMENTUM);
    config.set_momentum(o.momentum);
    if (!(o.momentum > 0 && o.momentum < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--momentum must be in (0, 1), got ", o.momentum));
    }
  } else if (name == "adam") {
    config.set_kind(OptimizerConfig::ADAM);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer '", o.optimizer, "' is not one of sgd, momentum, adam"));
  }
  if (!(o.learning_rate > 0) || !std::isfinite(o.learning_rate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--learning_rate must be positive, got ", o.learning_rate));
  }
  config.set_learning_rate(o.learning_rate);
  // The ps will build the same optimizer: refuse here what they would refuse.
  PSFLOW_RETURN_IF_ERROR(ps::Optimizer::Create(config).status());
  return config;
}

}  // namespace

absl::StatusOr<JobConfig> BuildJobConfig(const JobOptions& o, int num_workers, int num_ps) {
  if (o.batch_size <= 0) return absl::InvalidArgumentError("--batch_size must be positive");
  if (o.epochs < 0 || o.train_steps < 0) {
    return absl::InvalidArgumentError("--epochs and --train_steps must not be negative");
  }
  if (o.epochs > 0 && o.train_steps > 0) {
    return absl::InvalidArgumentError("give --epochs or --train_steps, not both");
  }
  if (o.compute_threads < 0)
    return absl::InvalidArgumentError("--compute_threads must not be negative");
  if (num_workers == 0) return absl::InvalidArgumentError("the cluster has no workers");

  JobConfig job;
  absl::StatusOr<ModelSpec> spec = model::ResolveModelSpec(o.model);
  if (!spec.ok()) return spec.status();
  *job.mutable_model() = *spec;
  PSFLOW_ASSIGN_OR_RETURN(*job.mutable_optimizer(), MakeOptimizer(o));
  const InputSpec& in = spec->input();
  absl::StatusOr<TrainingDataStats> stats;
  if (o.dataset == "synthetic") {
    data::SyntheticShape shape{in.channels(), in.height(), in.width(), spec->num_classes()};
    // Check that the whole set can be made, then measure the pixels of its
    // first examples (made the same way as the rest) rather than of all.
    absl::Status check = data::CheckSynthetic(shape, o.synthetic_examples);
    if (!check.ok())
      return absl::InvalidArgumentError(absl::StrCat("--synthetic_examples: ", check.message()));
    absl::StatusOr<data::Dataset> made = data::MakeSynthetic(
        shape, std::min<int64_t>(o.synthetic_examples, 2000), data::Split::kTrain);
    if (!made.ok()) return made.status();
    stats = StatsOf(*made);
    stats->count = o.synthetic_examples;
  } else if (o.dataset == "idx") {
    stats = ReadTrainingDataStats(o.data_dir);
    if (!stats.ok()) return stats.status();
    const data::DataSource source{o.dataset, o.data_dir, o.synthetic_examples};
    PSFLOW_RETURN_IF_ERROR(data::CheckFitsModel(
        {1, static_cast<int>(stats->height), static_cast<int>(stats->width), 10},
        data::DescribeSource(source), data::ModelInputOf(*spec)));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset '", o.dataset, "' is not one of idx, synthetic"));
  }
  if (stats->stddev > 0) {
    job.mutable_model()->mutable_input()->set_mean(static_cast<float>(stats->mean));
    job.mutable_model()->mutable_input()->set_stddev(static_cast<float>(stats->stddev));
  }
  // DistributedSampler: each worker sees ceil(count / workers) examples per
  // epoch, in full batches.
  const int64_t shard = (stats->count + num_workers - 1) / num_workers;
  const int64_t steps_per_epoch = shard / o.batch_size;
  if (steps_per_epoch == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--batch_size ", o.batch_size, " exceeds the ",
                                                   shard, " examples each worker sees per epoch"));
  }
  job.set_data_dir(o.data_dir);
  job.set_dataset(o.dataset);
  job.set_batch_size(o.batch_size);
  job.set_steps_per_epoch(steps_per_epoch);
  const int64_t epochs = std::max<int64_t>(o.epochs, 1);
  if (o.train_steps == 0 && epochs > std::numeric_limits<int64_t>::max() / steps_per_epoch) {
    return absl::InvalidArgumentError(absl::StrCat("--epochs ", o.epochs, " is too large"));
  }
  job.set_train_steps(o.train_steps > 0 ? o.train_steps : epochs * steps_per_epoch);
  job.set_num_examples(stats->count);
  job.set_seed(o.seed);
  job.set_num_workers(num_workers);
  job.set_num_ps(num_ps);
  job.set_compute_threads(o.compute_threads);
  if (o.on_nonfinite != "fail") {
    return absl::InvalidArgumentError(
        absl::StrCat("--on_nonfinite '", o.on_nonfinite, "' is not fail"));
  }
  job.set_on_nonfinite(JobConfig::FAIL);
  const std::string wire = absl::AsciiStrToLower(o.wire_dtype);
  if (wire == "fp32") {
    job.set_wire_dtype(JobConfig::FP32);
  } else if (wire == "bf16") {
    job.set_wire_dtype(JobConfig::BF16);
  } else if (wire == "fp16") {
    job.set_wire_dtype(JobConfig::FP16);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire_dtype '", o.wire_dtype, "' is not one of fp32, bf16, fp16"));
  }
  PSFLOW_ASSIGN_OR_RETURN(*job.mutable_placement(),
                          PlaceVariables(model::ModelVariables(*spec), num_ps));
  return job;
}

}  // namespace psflow::chief
