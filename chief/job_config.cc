#include "chief/job_config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cpu_count.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "data/mnist.h"
#include "data/pipeline.h"
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
  int64_t share = 0;  // the examples of the worker that reads fewest
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

// --optimizer and the settings of its kind.
absl::Status SetOptimizerKind(const JobOptions& o, OptimizerConfig* config) {
  const std::string name = absl::AsciiStrToLower(o.optimizer);
  if (name == "sgd") {
    config->set_kind(OptimizerConfig::SGD);
  } else if (name == "momentum") {
    config->set_kind(OptimizerConfig::MOMENTUM);
    config->set_momentum(o.momentum);
    if (!(o.momentum > 0 && o.momentum < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--momentum must be in (0, 1), got ", o.momentum));
    }
    config->set_nesterov(o.nesterov);
  } else if (name == "adam" || name == "adamw") {
    config->set_kind(name == "adam" ? OptimizerConfig::ADAM : OptimizerConfig::ADAMW);
    if (!(o.beta1 > 0 && o.beta1 < 1 && o.beta2 > 0 && o.beta2 < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--beta1 and --beta2 must be in (0, 1), got ", o.beta1, " and ", o.beta2));
    }
    config->set_beta1(o.beta1);
    config->set_beta2(o.beta2);
  } else if (name == "adagrad") {
    config->set_kind(OptimizerConfig::ADAGRAD);
  } else if (name == "rmsprop") {
    config->set_kind(OptimizerConfig::RMSPROP);
    if (!(o.rmsprop_alpha > 0 && o.rmsprop_alpha < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rmsprop_alpha must be in (0, 1), got ", o.rmsprop_alpha));
    }
    config->set_alpha(o.rmsprop_alpha);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer '", o.optimizer,
                     "' is not one of sgd, momentum, adam, adamw, adagrad, rmsprop"));
  }
  if (o.nesterov && config->kind() != OptimizerConfig::MOMENTUM) {
    return absl::InvalidArgumentError("--nesterov needs --optimizer=momentum");
  }
  return absl::OkStatus();
}

// --learning_rate, --weight_decay and --epsilon.
absl::Status SetOptimizerRates(const JobOptions& o, OptimizerConfig* config) {
  if (!(o.learning_rate > 0) || !std::isfinite(o.learning_rate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--learning_rate must be positive, got ", o.learning_rate));
  }
  config->set_learning_rate(o.learning_rate);
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight_decay must be finite and not negative, got ", o.weight_decay));
  }
  config->set_weight_decay(o.weight_decay);
  if (!(o.epsilon >= 0) || !std::isfinite(o.epsilon)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--epsilon must not be negative (0: the optimizer's own), got ", o.epsilon));
  }
  config->set_epsilon(o.epsilon);
  return absl::OkStatus();
}

// The learning-rate schedule: --lr_decay, its warmup, steps, rate and floor.
absl::Status SetSchedule(const JobOptions& o, OptimizerConfig* config) {
  const std::string decay = absl::AsciiStrToLower(o.lr_decay);
  if (decay == "constant") {
    config->set_lr_decay(OptimizerConfig::CONSTANT);
  } else if (decay == "step") {
    config->set_lr_decay(OptimizerConfig::STEP);
  } else if (decay == "exponential") {
    config->set_lr_decay(OptimizerConfig::EXPONENTIAL);
  } else if (decay == "cosine") {
    config->set_lr_decay(OptimizerConfig::COSINE);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--lr_decay '", o.lr_decay, "' is not one of constant, step, exponential, cosine"));
  }
  if (o.lr_warmup_steps < 0 || o.lr_decay_steps < 0) {
    return absl::InvalidArgumentError(
        "--lr_warmup_steps and --lr_decay_steps must not be negative");
  }
  config->set_lr_warmup_steps(o.lr_warmup_steps);
  config->set_lr_decay_steps(o.lr_decay_steps);
  if (decay == "step" || decay == "exponential") {
    if (o.lr_decay_steps == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lr_decay=", decay, " needs --lr_decay_steps"));
    }
    if (!(o.lr_decay_rate > 0 && o.lr_decay_rate <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--lr_decay_rate must be in (0, 1], got ", o.lr_decay_rate));
    }
    config->set_lr_decay_rate(o.lr_decay_rate);
  }
  if (decay == "cosine") {
    if (!(o.lr_min >= 0 && o.lr_min <= o.learning_rate)) {
      return absl::InvalidArgumentError(absl::StrCat("--lr_min must be in [0, --learning_rate ",
                                                     o.learning_rate, "], got ", o.lr_min));
    }
    config->set_lr_min(o.lr_min);
  }
  return absl::OkStatus();
}

// The optimizer of the flags, checked flag by flag; a cosine decay without
// --lr_decay_steps is completed by FinishOptimizer once the steps are known.
absl::StatusOr<OptimizerConfig> MakeOptimizer(const JobOptions& o) {
  OptimizerConfig config;
  PSFLOW_RETURN_IF_ERROR(SetOptimizerKind(o, &config));
  PSFLOW_RETURN_IF_ERROR(SetOptimizerRates(o, &config));
  PSFLOW_RETURN_IF_ERROR(SetSchedule(o, &config));
  return config;
}

// Gives a cosine decay without --lr_decay_steps the steps from the end of
// the warmup to the job's last, then checks the optimizer as the ps will.
absl::Status FinishOptimizer(int64_t train_steps, OptimizerConfig* config) {
  if (config->lr_decay() == OptimizerConfig::COSINE && config->lr_decay_steps() == 0) {
    if (config->lr_warmup_steps() >= train_steps) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--lr_warmup_steps ", config->lr_warmup_steps(), " leaves none of the job's ",
          train_steps, " steps to the cosine decay; give --lr_decay_steps"));
    }
    config->set_lr_decay_steps(train_steps - config->lr_warmup_steps());
  }
  // The ps will build the same optimizer: refuse here what they would refuse.
  absl::Status s = ps::Optimizer::Create(*config).status();
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("optimizer: ", s.message()));
  return absl::OkStatus();
}

// The flags checked, before any file is read: the JobConfig fields that
// follow from them alone, and the flags the model and the data complete it
// with.
struct CheckedOptions {
  // All but the model, the data's measures, the steps and the placement
  // (batch_size already the per-replica batch of a global one).
  JobConfig job;
  std::string model;
  int64_t synthetic_examples = 0;
  data::DataFiles data_files;
  std::string input_mean, input_stddev;
  int64_t epochs = 0, train_steps = 0;  // at most one of them positive
  int64_t slice_bytes = 0;
};

// The cluster's size, the batch and the job's length.
absl::Status CheckBatchAndLength(const JobOptions& o, int num_workers, JobConfig* job) {
  if (o.replicas_per_worker < 1 || o.replicas_per_worker > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replicas_per_worker must be in [1, 64], got ", o.replicas_per_worker));
  }
  if (num_workers == 0) return absl::InvalidArgumentError("the cluster has no workers");
  if (o.global_batch_size < 0) {
    return absl::InvalidArgumentError("--global_batch_size must not be negative");
  }
  int batch_size = o.batch_size;
  if (o.global_batch_size > 0) {
    const int64_t replicas = static_cast<int64_t>(num_workers) * o.replicas_per_worker;
    if (o.global_batch_size % replicas != 0 || o.global_batch_size / replicas > (1 << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--global_batch_size ", o.global_batch_size, " is not a multiple of the ",
                       replicas, " replicas (", num_workers, " workers x ", o.replicas_per_worker,
                       ") or gives a batch above 2^24"));
    }
    batch_size = static_cast<int>(o.global_batch_size / replicas);
  }
  if (batch_size <= 0) return absl::InvalidArgumentError("--batch_size must be positive");
  if (o.epochs < 0 || o.train_steps < 0) {
    return absl::InvalidArgumentError("--epochs and --train_steps must not be negative");
  }
  if (o.epochs > 0 && o.train_steps > 0) {
    return absl::InvalidArgumentError("give --epochs or --train_steps, not both");
  }
  if (o.compute_threads < 0)
    return absl::InvalidArgumentError("--compute_threads must not be negative");
  job->set_batch_size(batch_size);
  job->set_replicas_per_worker(o.replicas_per_worker);
  job->set_num_workers(num_workers);
  job->set_compute_threads(o.compute_threads);
  return absl::OkStatus();
}

// --mode and --staleness, and the exchange: a cluster without ps
// all-reduces, synchronously.
absl::Status CheckModeAndExchange(const JobOptions& o, int num_ps, JobConfig* job) {
  const std::string mode = absl::AsciiStrToLower(o.mode);
  if (mode == "sync") {
    job->set_mode(JobConfig::SYNC);
  } else if (mode == "async") {
    job->set_mode(JobConfig::ASYNC);
  } else if (mode == "ssp") {
    job->set_mode(JobConfig::SSP);
    if (o.staleness < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--staleness must not be negative, got ", o.staleness));
    }
    job->set_staleness(o.staleness);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--mode '", o.mode, "' is not one of sync, async, ssp"));
  }
  if (num_ps == 0) {
    // Every worker holds a replica, placed as one ps holding everything.
    if (job->mode() != JobConfig::SYNC) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mode ", o.mode,
                       " needs parameter servers; a cluster without ps trains synchronously"));
    }
    job->set_exchange(JobConfig::ALL_REDUCE);
    num_ps = 1;
  }
  job->set_num_ps(num_ps);
  return absl::OkStatus();
}

// --on_nonfinite, --max_skipped_steps, --max_gradient_abs,
// --clip_gradient_norm, --wire_dtype and --bn_momentum.
absl::Status CheckNumerics(const JobOptions& o, JobConfig* job) {
  if (o.on_nonfinite == "fail") {
    job->set_on_nonfinite(JobConfig::FAIL);
  } else if (o.on_nonfinite == "skip_step") {
    job->set_on_nonfinite(JobConfig::SKIP_STEP);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--on_nonfinite '", o.on_nonfinite, "' is not fail or skip_step"));
  }
  if (o.max_skipped_steps < 0) {
    return absl::InvalidArgumentError("--max_skipped_steps must not be negative");
  }
  job->set_max_skipped_steps(o.max_skipped_steps);
  if (!(o.max_gradient_abs >= 0) || !std::isfinite(o.max_gradient_abs) ||
      o.max_gradient_abs > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max_gradient_abs must be 0 (no bound) or a positive float, got ", o.max_gradient_abs));
  }
  job->set_max_gradient_abs(static_cast<float>(o.max_gradient_abs));
  if (!(o.clip_gradient_norm >= 0) || !std::isfinite(o.clip_gradient_norm) ||
      o.clip_gradient_norm > std::numeric_limits<float>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--clip_gradient_norm must be 0 (off) or a positive float, got ", o.clip_gradient_norm));
  }
  job->set_clip_gradient_norm(static_cast<float>(o.clip_gradient_norm));
  const std::string wire = absl::AsciiStrToLower(o.wire_dtype);
  if (wire == "fp32") {
    job->set_wire_dtype(JobConfig::FP32);
  } else if (wire == "bf16") {
    job->set_wire_dtype(JobConfig::BF16);
  } else if (wire == "fp16") {
    job->set_wire_dtype(JobConfig::FP16);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire_dtype '", o.wire_dtype, "' is not one of fp32, bf16, fp16"));
  }
  if (!(o.bn_momentum > 0 && o.bn_momentum <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--bn_momentum must be in (0, 1], got ", o.bn_momentum));
  }
  job->set_bn_momentum(o.bn_momentum);
  return absl::OkStatus();
}

// --allreduce_bucket_mb and --slice_mb; the slice's bytes go to *slice_bytes.
absl::Status CheckMessageSizes(const JobOptions& o, JobConfig* job, int64_t* slice_bytes) {
  // A ring message carries at most half a bucket, within gRPC's 64 MiB.
  if (!(o.allreduce_bucket_mb >= kMinBucketMb && o.allreduce_bucket_mb <= kMaxBucketMb)) {
    return absl::InvalidArgumentError(absl::StrCat("--allreduce_bucket_mb must be in [",
                                                   kMinBucketMb, ", ", kMaxBucketMb, "], got ",
                                                   o.allreduce_bucket_mb));
  }
  job->set_allreduce_bucket_bytes(std::llround(o.allreduce_bucket_mb * (1 << 20)));
  if (o.slice_mb != 0 && !(o.slice_mb >= kMinSliceMb && o.slice_mb <= kMaxSliceMb)) {
    return absl::InvalidArgumentError(absl::StrCat("--slice_mb must be 0 or in [", kMinSliceMb,
                                                   ", ", kMaxSliceMb, "], got ", o.slice_mb));
  }
  *slice_bytes = std::llround(o.slice_mb * (1 << 20));
  return absl::OkStatus();
}

// The data flags that need no file: the format's name and the streaming
// settings.
absl::Status CheckData(const JobOptions& o, JobConfig* job) {
  DataConfig& d = *job->mutable_data();
  d = o.data;
  d.set_data_dir(o.data_dir);
  d.set_synthetic_examples(o.synthetic_examples);
  const std::string& f = d.format();
  if (!f.empty() && f != "idx" && f != "synthetic" && !data::IsStreamed(f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_format '", f, "' is not one of ", data::kDataFormats));
  }
  if (d.shuffle_buffer() < 0 || d.shuffle_buffer() > 10'000'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shuffle_buffer must be in [0, 10000000], got ", d.shuffle_buffer()));
  }
  if (d.prefetch_batches() < 1 || d.prefetch_batches() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefetch_batches must be in [1, 64], got ", d.prefetch_batches()));
  }
  if (d.resize_shorter() < 0 || d.label_offset() < 0) {
    return absl::InvalidArgumentError("--resize_shorter and --label_offset must be >= 0");
  }
  return absl::OkStatus();
}

// Every check that needs neither the model nor the data.
absl::StatusOr<CheckedOptions> CheckJobOptions(const JobOptions& o, int num_workers, int num_ps) {
  CheckedOptions checked;
  JobConfig& job = checked.job;
  PSFLOW_RETURN_IF_ERROR(CheckBatchAndLength(o, num_workers, &job));
  PSFLOW_ASSIGN_OR_RETURN(*job.mutable_optimizer(), MakeOptimizer(o));
  PSFLOW_RETURN_IF_ERROR(CheckData(o, &job));
  PSFLOW_RETURN_IF_ERROR(CheckModeAndExchange(o, num_ps, &job));
  PSFLOW_RETURN_IF_ERROR(CheckNumerics(o, &job));
  PSFLOW_RETURN_IF_ERROR(CheckMessageSizes(o, &job, &checked.slice_bytes));
  job.set_seed(o.seed);
  checked.model = o.model;
  checked.synthetic_examples = o.synthetic_examples;
  checked.data_files = o.data_files;
  checked.input_mean = o.input_mean;
  checked.input_stddev = o.input_stddev;
  checked.epochs = o.epochs;
  checked.train_steps = o.train_steps;
  return checked;
}

// The training data's measures for `spec`'s inputs: the synthetic set's
// (checked to be makeable) or the IDX files' (checked to fit the model).
absl::StatusOr<TrainingDataStats> MeasureInMemory(const JobConfig& job, const ModelSpec& spec) {
  const int64_t synthetic_examples = job.data().synthetic_examples();
  if (job.data().format() == "synthetic") {
    const InputSpec& in = spec.input();
    data::SyntheticShape shape{in.channels(), in.height(), in.width(), spec.num_classes()};
    // Check that the whole set can be made, then measure the pixels of its
    // first examples (made the same way as the rest) rather than of all.
    absl::Status check = data::CheckSynthetic(shape, synthetic_examples);
    if (!check.ok())
      return absl::InvalidArgumentError(absl::StrCat("--synthetic_examples: ", check.message()));
    absl::StatusOr<data::Dataset> made = data::MakeSynthetic(
        shape, std::min<int64_t>(synthetic_examples, 2000), data::Split::kTrain);
    if (!made.ok()) return made.status();
    TrainingDataStats stats = StatsOf(*made);
    stats.count = synthetic_examples;
    return stats;
  }
  absl::StatusOr<TrainingDataStats> stats = ReadTrainingDataStats(job.data().data_dir());
  if (!stats.ok()) return stats.status();
  PSFLOW_RETURN_IF_ERROR(
      data::CheckFitsModel({1, static_cast<int>(stats->height), static_cast<int>(stats->width), 10},
                           data::DescribeSource(job.data()), data::ModelInputOf(spec)));
  return stats;
}

// The examples of streamed data sets whose pixels give the inputs' mean and
// standard deviation: the first ones of files spread over the set.
constexpr int64_t kStatsSample = 1000;

// The same for streamed data: its records counted (by ResolveDataFiles), the
// share of the worker that reads fewest, and the pixels of a sample.
absl::StatusOr<TrainingDataStats> MeasureStreamed(const JobConfig& job, const ModelSpec& spec) {
  const data::ModelInput input = data::ModelInputOf(spec);
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<data::DataFormat> format,
                          data::OpenDataFormat(job.data(), input.shape, data::Split::kTrain));
  // The ids the model's embedding layers read must be in the data.
  PSFLOW_RETURN_IF_ERROR(
      data::IdSelection::Create(format->id_features(), data::DescribeSource(job.data()), spec)
          .status());
  // Spread over the files: an image folder's images come class by class.
  const std::unique_ptr<data::DataFormat> spread =
      data::EveryNthFile(*format, format->num_files() / kStatsSample);
  PSFLOW_ASSIGN_OR_RETURN(data::Dataset sample,
                          data::ReadExamples(*spread, input.shape, kStatsSample, UsableCores()));
  TrainingDataStats stats = StatsOf(sample);
  std::vector<int64_t> records;
  stats.count = 0;
  for (int64_t f = 0; f < format->num_files(); ++f) {
    records.push_back(format->records(f));
    stats.count += records.back();
  }
  stats.share = data::SmallestShare(records, job.num_workers());
  return stats;
}

absl::StatusOr<TrainingDataStats> MeasureTrainingData(JobConfig* job, const data::DataFiles& files,
                                                      const ModelSpec& spec) {
  PSFLOW_RETURN_IF_ERROR(data::ResolveDataFiles(files, job->mutable_data()));
  if (data::IsStreamed(job->data().format())) return MeasureStreamed(*job, spec);
  // Data held whole carries no ids.
  PSFLOW_RETURN_IF_ERROR(
      data::IdSelection::Create({}, data::DescribeSource(job->data()), spec).status());
  PSFLOW_ASSIGN_OR_RETURN(TrainingDataStats stats, MeasureInMemory(*job, spec));
  // DistributedSampler: each worker sees ceil(count / workers) examples.
  stats.share = (stats.count + job->num_workers() - 1) / job->num_workers();
  return stats;
}

// The values of --input_mean or --input_stddev (`flag`): one, or one per
// channel of the model's input, each finite (stddev: positive).
absl::StatusOr<std::vector<float>> ChannelValues(const std::string& text, const char* flag,
                                                 int channels, bool positive) {
  std::vector<float> values;
  for (absl::string_view v : absl::StrSplit(text, ',')) {
    float f = 0;
    if (!absl::SimpleAtof(absl::StripAsciiWhitespace(v), &f) || !std::isfinite(f) ||
        (positive && !(f > 0))) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": '", v, "' is not a ", positive ? "positive " : "", "number"));
    }
    values.push_back(f);
  }
  if (values.size() == 1) values.resize(channels, values[0]);
  if (static_cast<int>(values.size()) != channels) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " has ", values.size(),
                                                   " values; the model's input has ", channels,
                                                   " channels (give 1 or ", channels, ")"));
  }
  return values;
}

// The inputs' normalization: per channel from the flags, else the measured
// mean and stddev of the training data.
absl::Status SetInputNormalization(const CheckedOptions& c, const TrainingDataStats& stats,
                                   InputSpec* in) {
  if (c.input_mean.empty() && c.input_stddev.empty()) {
    if (stats.stddev > 0) {
      in->set_mean(static_cast<float>(stats.mean));
      in->set_stddev(static_cast<float>(stats.stddev));
    }
    return absl::OkStatus();
  }
  if (c.input_mean.empty() || c.input_stddev.empty()) {
    return absl::InvalidArgumentError("--input_mean and --input_stddev go together");
  }
  PSFLOW_ASSIGN_OR_RETURN(std::vector<float> mean,
                          ChannelValues(c.input_mean, "--input_mean", in->channels(), false));
  PSFLOW_ASSIGN_OR_RETURN(std::vector<float> stddev,
                          ChannelValues(c.input_stddev, "--input_stddev", in->channels(), true));
  in->set_mean(0);
  in->set_stddev(0);
  *in->mutable_channel_mean() = {mean.begin(), mean.end()};
  *in->mutable_channel_stddev() = {stddev.begin(), stddev.end()};
  return absl::OkStatus();
}

// Steps per epoch and in all, from the examples each worker sees.
absl::Status SetSteps(const CheckedOptions& c, int64_t shard, JobConfig* job) {
  // Each worker takes `shard` examples per epoch (the fewest any worker
  // reads), in full batches.
  const int64_t num_workers = job->num_workers();
  // A worker's step takes a batch for each of its replicas.
  const int64_t worker_batch = static_cast<int64_t>(job->batch_size()) * job->replicas_per_worker();
  const int64_t steps_per_epoch = shard / worker_batch;
  if (steps_per_epoch == 0) {
    return absl::InvalidArgumentError(
        job->replicas_per_worker() > 1
            ? absl::StrCat("--batch_size ", job->batch_size(), " times ",
                           job->replicas_per_worker(), " replicas exceeds the ", shard,
                           " examples each worker sees per epoch")
            : absl::StrCat("--batch_size ", job->batch_size(), " exceeds the ", shard,
                           " examples each worker sees per epoch"));
  }
  // A global step of a job that applies each gradient alone is one worker's
  // batch: an epoch is every worker's steps.
  job->set_steps_per_epoch(AppliesEachGradient(*job) ? steps_per_epoch * num_workers
                                                     : steps_per_epoch);
  const int64_t global_steps_per_epoch = job->steps_per_epoch();
  const int64_t epochs = std::max<int64_t>(c.epochs, 1);
  if (c.train_steps == 0 && epochs > std::numeric_limits<int64_t>::max() / global_steps_per_epoch) {
    return absl::InvalidArgumentError(absl::StrCat("--epochs ", c.epochs, " is too large"));
  }
  job->set_train_steps(c.train_steps > 0 ? c.train_steps : epochs * global_steps_per_epoch);
  return absl::OkStatus();
}

// The JobConfig of checked options: the model resolved, the data measured,
// the steps counted, the variables placed.
absl::StatusOr<JobConfig> AssembleJobConfig(CheckedOptions checked) {
  JobConfig job = std::move(checked.job);
  absl::StatusOr<ModelSpec> spec = model::ResolveModelSpec(checked.model);
  if (!spec.ok()) return spec.status();
  *job.mutable_model() = *spec;
  PSFLOW_ASSIGN_OR_RETURN(const TrainingDataStats stats,
                          MeasureTrainingData(&job, checked.data_files, *spec));
  PSFLOW_RETURN_IF_ERROR(
      SetInputNormalization(checked, stats, job.mutable_model()->mutable_input()));
  job.set_num_examples(stats.count);
  PSFLOW_RETURN_IF_ERROR(SetSteps(checked, stats.share, &job));
  PSFLOW_RETURN_IF_ERROR(FinishOptimizer(job.train_steps(), job.mutable_optimizer()));
  PSFLOW_ASSIGN_OR_RETURN(*job.mutable_placement(),
                          PlaceVariables(model::ModelVariables(*spec), job.num_ps(),
                                         kDefaultSplitBytes, checked.slice_bytes));
  return job;
}

}  // namespace

absl::StatusOr<JobConfig> BuildJobConfig(const JobOptions& options, int num_workers, int num_ps) {
  PSFLOW_ASSIGN_OR_RETURN(CheckedOptions checked, CheckJobOptions(options, num_workers, num_ps));
  return AssembleJobConfig(std::move(checked));
}

namespace {

// The job's --mode as the log names it.
std::string ModeName(const JobConfig& job) {
  switch (job.mode()) {
    case JobConfig::ASYNC:
      return "async";
    case JobConfig::SSP:
      return absl::StrCat("ssp (staleness ", job.staleness(), ")");
    default:
      return "sync";
  }
}

// Where the variables are: over the ps in slices, or in every worker's
// replica; with the bytes each ps (replica) holds.
std::string DescribePlacement(const JobConfig& job) {
  std::vector<int64_t> bytes = BytesPerPs(job.placement());
  int slices = 0;
  for (const VariablePlacement& v : job.placement().variable()) slices += v.slice_size();
  std::string per_ps;
  for (size_t p = 0; p < bytes.size(); ++p)
    absl::StrAppend(&per_ps, p ? ", " : "", bytes[p] / 1024, " KiB");
  if (job.exchange() == JobConfig::ALL_REDUCE) {
    return absl::StrCat(", gradients all-reduced among the workers, each holding a replica (",
                        per_ps, ")");
  }
  return absl::StrCat(", variables over ", job.num_ps(), " ps in ", slices, " slices (", per_ps,
                      ")");
}

}  // namespace

namespace {

// ", inputs standardized with mean M stddev S", or per channel.
std::string DescribeNormalization(const InputSpec& in) {
  if (in.channel_mean_size() > 0) {
    return absl::StrCat(", inputs standardized per channel with mean ",
                        absl::StrJoin(in.channel_mean(), ","), " stddev ",
                        absl::StrJoin(in.channel_stddev(), ","));
  }
  std::ostringstream line;  // the numbers as the log has always written them
  line << ", inputs standardized with mean " << in.mean() << " stddev " << in.stddev();
  return line.str();
}

}  // namespace

std::string DescribeJob(const JobConfig& job) {
  int64_t params = 0, statistics = 0;
  for (const VariableShape& v : model::ModelVariables(job.model()))
    (v.trainable ? params : statistics) += NumElements(v.shape);
  const std::string bn =
      statistics == 0 ? ""
                      : absl::StrCat(", ", statistics, " batch-norm running statistics, momentum ",
                                     job.bn_momentum());
  std::ostringstream line;  // the numbers as the log has always written them
  line << "job: model " << job.model().name() << " (" << params << " parameters" << bn << "), "
       << job.train_steps() << " steps = "
       << absl::StrFormat("%.2f", static_cast<double>(job.train_steps()) /
                                      static_cast<double>(job.steps_per_epoch()))
       << " epochs of " << job.steps_per_epoch() << " steps = "
       << job.train_steps() * WorkerBatch(job) * (AppliesEachGradient(job) ? 1 : job.num_workers())
       << " examples, batch " << job.batch_size() << " x " << job.num_workers() << " workers"
       << (ReplicasPerWorker(job) > 1
               ? absl::StrCat(" x ", ReplicasPerWorker(job), " replicas (GPUs) each")
               : "")
       << ", mode " << ModeName(job) << ", optimizer "
       << OptimizerConfig::Kind_Name(job.optimizer().kind()) << " lr "
       << job.optimizer().learning_rate() << " ("
       << OptimizerConfig::Decay_Name(job.optimizer().lr_decay()) << ", warmup "
       << job.optimizer().lr_warmup_steps() << ") weight decay " << job.optimizer().weight_decay()
       << (job.clip_gradient_norm() > 0
               ? absl::StrCat(", gradients clipped to global norm ", job.clip_gradient_norm())
               : "")
       << DescribeNormalization(job.model().input()) << DescribePlacement(job)
       << "; data: " << data::DescribeData(job.data());
  return line.str();
}

}  // namespace psflow::chief
