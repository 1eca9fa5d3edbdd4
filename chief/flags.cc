// The chief's flags (the job's single source of truth). psflow-chief and
// psflow-worker (whose task 0 runs the chief's duties in a cluster without a
// chief) both take them.
#include "chief/flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "data/flags.h"

ABSL_FLAG(std::string, model, "cnn",
          "Model to train: cnn (conv 20@5x5, pool, conv 50@5x5, pool, dense 500, dense 10), mlp "
          "(784-256-256-10), resnet (ResNet-18 for 32x32x3 inputs; use it with "
          "--data_format=synthetic), or "
          "the path of a model spec in protobuf text format (see docs/models.md).");
ABSL_FLAG(std::string, data_dir, psflow::chief::kDefaultDataDir,
          "The folder of the data: MNIST-format IDX files (train-images-idx3-ubyte[.gz], ...), or "
          "where the default files of the other formats are looked for (see --data_format). "
          "Every process reads the data at the paths the chief resolves.");
ABSL_FLAG(int64_t, synthetic_examples, 10000, "Training examples of --data_format=synthetic.");
ABSL_FLAG(std::string, input_mean, "",
          "The inputs' mean per channel, comma-separated (one value for every channel, or one per "
          "channel; pixels are in [0, 1]), e.g. 0.485,0.456,0.406: the model feeds channel c as "
          "(x - mean[c]) / stddev[c]. Goes with --input_stddev. Empty: one mean and standard "
          "deviation measured on the training data.");
ABSL_FLAG(std::string, input_stddev, "",
          "The inputs' standard deviation per channel, as --input_mean (e.g. 0.229,0.224,0.225).");
ABSL_FLAG(std::string, train_files, "",
          "The training data: comma-separated paths or glob patterns of TFRecord or CSV files, or "
          "an image folder. Empty: train-* (tfrecord), train/ (image_folder) or train.csv/.tsv "
          "(csv) in --data_dir. The chief counts their records at start.");
ABSL_FLAG(bool, augment, false,
          "Images: train on a random part of each image (8%-100% of its area, aspect ratio "
          "3/4-4/3) resized to the model's input and flipped left to right half the time, the "
          "usual ImageNet recipe; off, training uses the evaluation transform (--resize_shorter).");
ABSL_FLAG(int, shuffle_buffer, 10000,
          "Streamed data: records each worker holds to shuffle the order it reads its files in "
          "(0: no shuffle beyond the order of the files, drawn each epoch).");
ABSL_FLAG(int, prefetch_batches, 2,
          "Streamed data: decoded batches each worker holds ready ahead of its steps (>= 1).");
ABSL_FLAG(int, batch_size, 64,
          "Examples per step on each model replica: each worker, or each GPU of a worker with "
          "several (the global batch is this times the workers times --replicas_per_worker).");
ABSL_FLAG(int64_t, global_batch_size, 0,
          "If positive, the examples of one global step whatever the number of workers: each "
          "replica's batch becomes this divided by workers x --replicas_per_worker, which must "
          "divide it exactly (strong scaling; overrides --batch_size). 0: --batch_size per "
          "replica (weak scaling).");
ABSL_FLAG(int, replicas_per_worker, 1,
          "Replicas of the model on every worker: the GPUs each worker drives (its --device "
          "list, e.g. cuda:all on a node of 2 GPUs needs 2). A worker with another count is "
          "refused when it joins.");
ABSL_FLAG(int64_t, epochs, 0,
          "Passes over the training data; exclusive with --train_steps (default: 1 epoch).");
ABSL_FLAG(int64_t, train_steps, 0, "Global steps to train; exclusive with --epochs.");
ABSL_FLAG(std::string, optimizer, "sgd",
          "sgd, momentum, adam, adamw, adagrad or rmsprop, each as its torch.optim namesake "
          "(momentum is SGD with momentum); applied on the parameter servers (without ps: by "
          "every worker to its own replica).");
ABSL_FLAG(double, learning_rate, 0.01,
          "Learning rate of the optimizer: the peak of the schedule (see --lr_decay).");
ABSL_FLAG(double, momentum, 0.9, "Momentum of --optimizer=momentum.");
ABSL_FLAG(bool, nesterov, false,
          "Nesterov momentum for --optimizer=momentum (torch.optim.SGD nesterov=True).");
ABSL_FLAG(double, weight_decay, 0,
          "L2 penalty added to the gradient (g + weight_decay * w), as torch.optim's "
          "weight_decay; with --optimizer=adamw, decoupled decay (w -= lr * weight_decay * w) "
          "instead. 0 for every optimizer, adamw included (torch.optim.AdamW's default is 0.01).");
ABSL_FLAG(double, beta1, 0.9, "Decay of the first moment of --optimizer=adam and adamw.");
ABSL_FLAG(double, beta2, 0.999, "Decay of the second moment of --optimizer=adam and adamw.");
ABSL_FLAG(double, epsilon, 0,
          "Added to the denominator of adam, adamw, adagrad and rmsprop; 0: torch.optim's "
          "default (1e-8, 1e-10 for adagrad).");
ABSL_FLAG(double, rmsprop_alpha, 0.99,
          "Smoothing constant of the squared gradients of --optimizer=rmsprop.");
ABSL_FLAG(std::string, lr_decay, "constant",
          "Learning-rate schedule after the warmup, of t = step - --lr_warmup_steps (step "
          "0-based): constant; step (lr * rate^floor(t / N)); exponential (lr * rate^(t / N)); "
          "cosine (from lr to --lr_min over N steps, then --lr_min). N is --lr_decay_steps, rate "
          "--lr_decay_rate.");
ABSL_FLAG(int64_t, lr_warmup_steps, 0,
          "Linear warmup: step s < this uses lr * (s + 1) / lr_warmup_steps.");
ABSL_FLAG(int64_t, lr_decay_steps, 0,
          "N of --lr_decay: required for step and exponential; for cosine, 0 means every step "
          "after the warmup.");
ABSL_FLAG(double, lr_decay_rate, 0.1,
          "Factor per --lr_decay_steps of --lr_decay=step/exponential.");
ABSL_FLAG(double, lr_min, 0, "The final learning rate of --lr_decay=cosine.");
ABSL_FLAG(std::string, lr_schedule, "", "Another name of --lr_decay (give one of the two).");
ABSL_FLAG(int64_t, warmup_steps, -1,
          "Another name of --lr_warmup_steps (give one of the two; -1: not given).");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the initial weights and of the data order of every epoch.");
ABSL_FLAG(
    std::string, model_dir, "",
    "Directory for the job's outputs (required): the saved model goes to <model_dir>/saved_model, "
    "checkpoints to <model_dir>/checkpoints, TensorBoard event files (the progress lines' numbers) "
    "to <model_dir>/train and (an evaluator's results) <model_dir>/eval.");
ABSL_FLAG(std::string, saved_model_dir, "",
          "Where to write the saved model instead of <model_dir>/saved_model.");
ABSL_FLAG(int, log_every_steps, 100, "Write a progress line every this many global steps.");
ABSL_FLAG(
    int, compute_threads, 0,
    "CPU threads each worker's kernels use; 0 = the cores the worker may use (its CPU affinity, "
    "lowered to its container's CPU limit, i.e. its cgroup's quota). Set it when workers share "
    "a machine.");
ABSL_FLAG(int, startup_timeout, 300,
          "Seconds to keep retrying to reach a peer (every ps; a worker also the chief) before "
          "exiting with code 138.");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "Write a checkpoint every this many steps (0: not by steps). Checkpoints go to "
          "<model_dir>/checkpoints; a job started again with the same --model_dir resumes from the "
          "newest valid one.");
ABSL_FLAG(int, checkpoint_every_secs, 600,
          "Write a checkpoint every this many seconds (0: not by time).");
ABSL_FLAG(int, keep_checkpoints, 5, "How many of the newest checkpoints to keep.");
ABSL_FLAG(
    int, worker_timeout, 30,
    "Seconds without a report from a worker after which the synchronous steps go on without it; "
    "it takes part again when it registers anew.");

ABSL_FLAG(int64_t, eval_every_steps, 0,
          "An evaluator (psflow-evaluator) evaluates the weights of every step that is a multiple "
          "of this (0: not by steps); versions that pass while it evaluates are skipped.");
ABSL_FLAG(int64_t, eval_every_secs, 60,
          "An evaluator evaluates the next version once this many seconds passed since its last "
          "evaluation began (0: not by time). The final model is always evaluated.");
ABSL_FLAG(int, eval_final_timeout, 600,
          "Seconds the end of the job waits for an evaluator's evaluation of the final model "
          "(when the cluster lists an evaluator or one registered). An evaluator not heard from "
          "for 30 s is not waited for.");

ABSL_FLAG(double, bn_momentum, 0.1,
          "Batch norm's running statistics, which evaluation uses: each step, r = (1 - m) * r + "
          "m * s, s being the mean over the workers of their batches' statistic (mean, or "
          "unbiased variance), m this flag (PyTorch's momentum convention: the weight of the new "
          "value). In (0, 1].");

ABSL_FLAG(
    std::string, on_nonfinite, "fail",
    "What a step whose loss or gradients are not finite (a diverging job) does: fail stops the "
    "job with exit code 1 and one line naming the step; the checkpoints before it are kept and "
    "no saved model is written. skip_step skips the step on every ps (no update; the weights "
    "and optimizer state stay, the step counts) and logs it; more than --max_skipped_steps "
    "skipped steps fail the job as fail does.");
ABSL_FLAG(int64_t, max_skipped_steps, 100,
          "With --on_nonfinite=skip_step: the most steps a job may skip before it fails.");
ABSL_FLAG(double, max_gradient_abs, 1e9,
          "The ps refuse a pushed gradient holding a value of this magnitude or more (finite but "
          "absurd: it would overflow the weights), as they refuse NaNs and infinities: the push "
          "fails with INVALID_ARGUMENT and is counted among the ps's refused pushes. 0: no bound "
          "but finiteness.");
ABSL_FLAG(double, clip_gradient_norm, 0,
          "Global-norm gradient clipping on the workers (as TensorFlow's clip_by_global_norm and "
          "PyTorch's clip_grad_norm_): when the L2 norm over all of a step's gradients (after "
          "averaging over a worker's GPUs, or the all-reduce) exceeds this, every gradient is "
          "scaled by this over the norm. Pushes then wait for the whole backward pass. 0: off.");

ABSL_FLAG(
    std::string, wire_dtype, "fp32",
    "The dtype of the weights workers pull and the gradients they push: fp32, bf16 (bfloat16: "
    "fp32's range, 8 significant bits) or fp16 (IEEE half: 11 significant bits, finite only below "
    "65520 in magnitude; a gradient beyond that counts as not finite). 16 bits halve the bytes on "
    "the network; values are rounded to nearest even. The ps keep fp32 master weights and "
    "optimizer state; checkpoints and the saved model are fp32. In a job without ps: the dtype "
    "of the gradients' all-reduce among the workers (the ring, or NCCL among GPU workers).");

ABSL_FLAG(double, allreduce_bucket_mb, 1,
          "Without ps, CPU workers average their gradients in a ring over gRPC in buckets of "
          "about this many MiB (fp32), each sent as soon as the backward pass has completed it "
          "(the last layers' first), so that the all-reduce overlaps the rest of the backward "
          "pass; smaller buckets start sooner, larger ones cost fewer messages. From 0.0625 to "
          "64. GPU workers average over NCCL instead, unless the job mixes CPU and GPU workers "
          "(then all use the ring, a GPU worker after its backward pass).");

ABSL_FLAG(double, slice_mb, 1,
          "The ps hold each variable above 256 KiB in slices cut by rows, at least one per ps; "
          "a variable above this many MiB per ps is cut into more (each at most this size, dealt "
          "to the ps in turn), because a ps applies and sends back each slice as soon as its "
          "gradients are in: a large variable then moves through the ps piece by piece. 0: one "
          "slice per ps whatever its size. From 0.0625 to 1024, or 0.");

ABSL_FLAG(std::string, mode, "sync",
          "How the ps apply gradients. sync: each step applies the mean of every live worker's "
          "gradient, and step k+1 reads exactly the weights after step k (a global step is one "
          "such update). async: each ps applies each worker's gradient alone as soon as it is "
          "in, and a worker never waits for the others (a global step is one worker's gradient, "
          "so an epoch takes num_workers times as many; --train_steps, --checkpoint_every_steps "
          "and the learning-rate schedule count them). ssp: as async, but a worker may be at "
          "most --staleness steps ahead of the slowest live worker (bounded staleness; "
          "--staleness=0 is sync). The progress log shows the staleness seen.");
ABSL_FLAG(int, staleness, 2,
          "With --mode=ssp: the most steps a worker may run ahead of the slowest live worker "
          "(>= 0; 0 runs the sync path).");

namespace psflow::chief {
namespace {

absl::Status JobOptionsFromFlags(JobOptions* o) {
  JobOptions& job = *o;
  job.model = absl::GetFlag(FLAGS_model);
  job.data_dir = absl::GetFlag(FLAGS_data_dir);
  job.synthetic_examples = absl::GetFlag(FLAGS_synthetic_examples);
  job.data = data::DataConfigFromFlags();
  job.input_mean = absl::GetFlag(FLAGS_input_mean);
  job.input_stddev = absl::GetFlag(FLAGS_input_stddev);
  job.data.set_augment(absl::GetFlag(FLAGS_augment));
  job.data.set_shuffle_buffer(absl::GetFlag(FLAGS_shuffle_buffer));
  job.data.set_prefetch_batches(absl::GetFlag(FLAGS_prefetch_batches));
  job.data_files = {absl::GetFlag(FLAGS_train_files), data::EvalFilesFromFlags()};
  job.batch_size = absl::GetFlag(FLAGS_batch_size);
  job.replicas_per_worker = absl::GetFlag(FLAGS_replicas_per_worker);
  job.global_batch_size = absl::GetFlag(FLAGS_global_batch_size);
  job.epochs = absl::GetFlag(FLAGS_epochs);
  job.train_steps = absl::GetFlag(FLAGS_train_steps);
  job.optimizer = absl::GetFlag(FLAGS_optimizer);
  job.learning_rate = static_cast<float>(absl::GetFlag(FLAGS_learning_rate));
  job.momentum = static_cast<float>(absl::GetFlag(FLAGS_momentum));
  job.nesterov = absl::GetFlag(FLAGS_nesterov);
  job.weight_decay = static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  job.beta1 = static_cast<float>(absl::GetFlag(FLAGS_beta1));
  job.beta2 = static_cast<float>(absl::GetFlag(FLAGS_beta2));
  job.epsilon = static_cast<float>(absl::GetFlag(FLAGS_epsilon));
  job.rmsprop_alpha = static_cast<float>(absl::GetFlag(FLAGS_rmsprop_alpha));
  job.lr_decay = absl::GetFlag(FLAGS_lr_decay);
  job.lr_warmup_steps = absl::GetFlag(FLAGS_lr_warmup_steps);
  // The other names of the schedule's flags: one name per setting.
  if (const std::string schedule = absl::GetFlag(FLAGS_lr_schedule); !schedule.empty()) {
    if (job.lr_decay != "constant" && job.lr_decay != schedule) {
      return absl::InvalidArgumentError("give --lr_decay or --lr_schedule, not both");
    }
    job.lr_decay = schedule;
  }
  if (const int64_t warmup = absl::GetFlag(FLAGS_warmup_steps); warmup != -1) {
    if (job.lr_warmup_steps != 0 && job.lr_warmup_steps != warmup) {
      return absl::InvalidArgumentError("give --lr_warmup_steps or --warmup_steps, not both");
    }
    job.lr_warmup_steps = warmup;
  }
  job.lr_decay_steps = absl::GetFlag(FLAGS_lr_decay_steps);
  job.lr_decay_rate = static_cast<float>(absl::GetFlag(FLAGS_lr_decay_rate));
  job.lr_min = static_cast<float>(absl::GetFlag(FLAGS_lr_min));
  job.seed = absl::GetFlag(FLAGS_seed);
  job.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  job.on_nonfinite = absl::GetFlag(FLAGS_on_nonfinite);
  job.max_skipped_steps = absl::GetFlag(FLAGS_max_skipped_steps);
  job.max_gradient_abs = absl::GetFlag(FLAGS_max_gradient_abs);
  job.clip_gradient_norm = absl::GetFlag(FLAGS_clip_gradient_norm);
  job.wire_dtype = absl::GetFlag(FLAGS_wire_dtype);
  job.allreduce_bucket_mb = absl::GetFlag(FLAGS_allreduce_bucket_mb);
  job.slice_mb = absl::GetFlag(FLAGS_slice_mb);
  job.mode = absl::GetFlag(FLAGS_mode);
  job.staleness = absl::GetFlag(FLAGS_staleness);
  job.bn_momentum = static_cast<float>(absl::GetFlag(FLAGS_bn_momentum));
  return absl::OkStatus();
}

absl::Status CoordinatorOptionsFromFlags(const ClusterConfig& cluster, CoordinatorOptions* o) {
  CoordinatorOptions& c = *o;
  // Without ps, worker 0's replica of the weights is the one the chief
  // loads, watches and checkpoints (JobConfig.exchange ALL_REDUCE).
  if (cluster.cluster.worker.empty()) {
    return absl::InvalidArgumentError("the cluster has no workers");
  }
  c.ps_addresses = cluster.cluster.AllReduce()
                       ? std::vector<std::string>{cluster.cluster.worker.at(0)}
                       : cluster.cluster.ps;
  c.model_dir = absl::GetFlag(FLAGS_model_dir);
  c.saved_model_dir = absl::GetFlag(FLAGS_saved_model_dir);
  c.log_every_steps = absl::GetFlag(FLAGS_log_every_steps);
  c.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  c.checkpoint_every = absl::Seconds(absl::GetFlag(FLAGS_checkpoint_every_secs));
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.eval_every_steps = absl::GetFlag(FLAGS_eval_every_steps);
  c.eval_every_secs = absl::GetFlag(FLAGS_eval_every_secs);
  c.num_evaluators = static_cast<int>(cluster.cluster.evaluator.size());
  if (absl::GetFlag(FLAGS_eval_final_timeout) < 0) {
    return absl::InvalidArgumentError("--eval_final_timeout must not be negative");
  }
  c.timeouts.final_eval = absl::Seconds(absl::GetFlag(FLAGS_eval_final_timeout));
  if (absl::GetFlag(FLAGS_startup_timeout) <= 0) {
    return absl::InvalidArgumentError("--startup_timeout must be positive");
  }
  c.timeouts.startup = absl::Seconds(absl::GetFlag(FLAGS_startup_timeout));
  c.timeouts.worker = absl::Seconds(absl::GetFlag(FLAGS_worker_timeout));
  if (c.checkpoint_every_steps < 0 || absl::GetFlag(FLAGS_checkpoint_every_secs) < 0 ||
      c.keep_checkpoints < 1 || absl::GetFlag(FLAGS_worker_timeout) <= 0) {
    return absl::InvalidArgumentError(
        "--checkpoint_every_steps/secs must not be negative, --keep_checkpoints and "
        "--worker_timeout must be positive");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ChiefOptionsFromFlags(ChiefOptions* o) {
  PSFLOW_RETURN_IF_ERROR(JobOptionsFromFlags(&o->job));
  return CoordinatorOptionsFromFlags(o->cluster, &o->coordinator);
}

absl::Duration StartupTimeoutFromFlags() {
  return absl::Seconds(absl::GetFlag(FLAGS_startup_timeout));
}

}  // namespace psflow::chief
