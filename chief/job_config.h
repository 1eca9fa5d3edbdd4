// The job configuration the chief hands to every ps and worker, built from
// the chief's flags: the flags checked, then the model resolved, the training
// data measured (its size and pixel statistics, with which the model's inputs
// are standardized), steps per epoch and in all, the optimizer completed, the
// variables placed over the ps. A pure function of its inputs and the data
// files; also the job's description for the log.
#ifndef PSFLOW_CHIEF_JOB_CONFIG_H_
#define PSFLOW_CHIEF_JOB_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "data/formats.h"
#include "proto/job.pb.h"

namespace psflow::chief {

inline constexpr char kDefaultDataDir[] = "/usr/share/datasets/fashion-mnist";

// The bounds of --allreduce_bucket_mb: 64 KiB (a step's buckets stay
// countable), and 64 MiB (half a bucket, one ring message, stays within
// gRPC's message limit).
inline constexpr double kMinBucketMb = 1.0 / 16;
inline constexpr double kMaxBucketMb = 64;
// The bounds of --slice_mb (besides 0, no limit): 64 KiB and 1 GiB.
inline constexpr double kMinSliceMb = 1.0 / 16;
inline constexpr double kMaxSliceMb = 1024;

// The job's settings; defaults are the chief's flags' defaults.
struct JobOptions {
  std::string model = "cnn";  // built-in name or spec file
  std::string data_dir = kDefaultDataDir;
  // The data's format (empty: recognized) and how to read it, as the data
  // flags set it (data/flags.h); data_dir and synthetic_examples go into it.
  DataConfig data = data::DefaultDataConfig();
  data::DataFiles data_files;          // --train_files, --eval_files
  int64_t synthetic_examples = 10000;  // training examples of the synthetic dataset
  // The inputs' normalization per channel (--input_mean, --input_stddev):
  // comma-separated, one value for every channel or one per channel; both
  // empty: one mean and stddev measured on the training data.
  std::string input_mean, input_stddev;
  int batch_size = 64;  // per replica
  // When positive, the global batch of one step, whatever the number of
  // workers: batch_size becomes global_batch_size / (workers * replicas),
  // which must divide it exactly (strong scaling, as DDP with a fixed global
  // batch; the gradients are averaged as ever).
  int64_t global_batch_size = 0;
  int replicas_per_worker = 1;         // GPUs each worker drives (JobConfig.replicas_per_worker)
  int64_t epochs = 0;                  // 0: not given
  int64_t train_steps = 0;             // 0: not given; exactly one of the two, else 1 epoch
  std::string optimizer = "sgd";       // sgd, momentum, adam, adamw, adagrad, rmsprop
  float learning_rate = 0.01f;         // the peak rate of the schedule
  float momentum = 0.9f;               // momentum
  bool nesterov = false;               // momentum: Nesterov's
  float weight_decay = 0;              // L2 on the gradient; adamw: decoupled (w -= lr * wd * w)
  float beta1 = 0.9f, beta2 = 0.999f;  // adam, adamw
  float epsilon = 0;                   // 0: the optimizer's own (1e-8; adagrad 1e-10)
  float rmsprop_alpha = 0.99f;         // rmsprop
  // The learning-rate schedule (ps::LearningRate): linear warmup over
  // lr_warmup_steps, then lr_decay: constant, step, exponential or cosine.
  std::string lr_decay = "constant";
  int64_t lr_warmup_steps = 0;
  int64_t lr_decay_steps = 0;  // step, exponential: required; cosine: 0 = to the last step
  float lr_decay_rate = 0.1f;  // step, exponential
  float lr_min = 0;            // cosine: the final rate
  uint64_t seed = 1;
  int compute_threads = 0;  // per worker; 0 = library default
  // What a step with a non-finite loss or gradients does: "fail" stops the
  // job with exit code 1, keeping the checkpoints taken before it;
  // "skip_step" skips it on every ps (JobConfig.on_nonfinite).
  std::string on_nonfinite = "fail";  // or "skip_step"
  int64_t max_skipped_steps = 100;    // with skip_step: more fail the job
  double max_gradient_abs = 1e9;      // the ps refuse gradients this large; 0: no bound
  double clip_gradient_norm = 0;      // workers clip each step's global norm to it; 0: off
  // The dtype of the weights and gradients on the wire: fp32, bf16 or fp16
  // (JobConfig.wire_dtype); the ps keep fp32 masters either way.
  std::string wire_dtype = "fp32";
  // Jobs without ps, on the workers' gRPC ring: the bucket size in MiB
  // (JobConfig.allreduce_bucket_bytes), in [kMinBucketMb, kMaxBucketMb].
  double allreduce_bucket_mb = 1;
  // With ps: the largest slice of a variable split over them, in MiB
  // (PlaceVariables' slice_bytes): 0 (one slice per ps) or in
  // [kMinSliceMb, kMaxSliceMb].
  double slice_mb = 1;
  // The weight of each step's batch statistics in batch norm's running
  // statistics (JobConfig.bn_momentum), in (0, 1].
  float bn_momentum = 0.1f;
  // sync, async or ssp (JobConfig.mode); staleness is ssp's bound.
  std::string mode = "sync";
  int staleness = 2;
};

// INVALID_ARGUMENT with one line naming the flag for any bad setting; the
// settings are checked before the model and the data files are read.
// num_ps 0: a cluster without ps, whose workers all-reduce their gradients
// (JobConfig.exchange ALL_REDUCE; the variables are placed as on one ps:
// each worker's replica).
absl::StatusOr<JobConfig> BuildJobConfig(const JobOptions& options, int num_workers, int num_ps);

// The job in the one line the chief logs at its start: the model and its
// sizes, steps, epochs and examples, batch, mode, optimizer, input
// statistics, and where the variables are.
std::string DescribeJob(const JobConfig& job);

}  // namespace psflow::chief

#endif  // PSFLOW_CHIEF_JOB_CONFIG_H_
