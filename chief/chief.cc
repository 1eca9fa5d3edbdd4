#include "chief/chief.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/random/distributions.h"
#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "chief/checkpoint.h"
#include "chief/progress.h"
#include "common/file_util.h"
#include "common/grpc_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_chunks.h"
#include "data/mnist.h"
#include "data/synthetic.h"
#include "model/saved_model.h"
#include "model/spec.h"
#include "proto/chief.grpc.pb.h"
#include "ps/client.h"
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
  absl::StatusOr<data::IdxFile> labels = data::ReadIdxFileInDir(data_dir, "train-labels-idx1-ubyte");
  if (!labels.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_dir: ", labels.status().message()));
  absl::StatusOr<data::IdxFile> images = data::ReadIdxFileInDir(data_dir, "train-images-idx3-ubyte");
  if (!images.ok()) return absl::InvalidArgumentError(absl::StrCat("--data_dir: ", images.status().message()));
  if (labels->dims.size() != 1 || images->dims.size() != 3 || images->dims[0] != labels->dims[0] ||
      images->data.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the training images and labels in ", data_dir, " do not match"));
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

absl::StatusOr<OptimizerConfig> MakeOptimizer(const ChiefOptions& o) {
  OptimizerConfig config;
  const std::string name = absl::AsciiStrToLower(o.optimizer);
  if (name == "sgd") {
    config.set_kind(OptimizerConfig::SGD);
  } else if (name == "momentum") {
    config.set_kind(OptimizerConfig::MOMENTUM);
    config.set_momentum(o.momentum);
    if (!(o.momentum > 0 && o.momentum < 1)) {
      return absl::InvalidArgumentError(absl::StrCat("--momentum must be in (0, 1), got ", o.momentum));
    }
  } else if (name == "adam") {
    config.set_kind(OptimizerConfig::ADAM);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--optimizer '", o.optimizer, "' is not one of sgd, momentum, adam"));
  }
  if (!(o.learning_rate > 0) || !std::isfinite(o.learning_rate)) {
    return absl::InvalidArgumentError(absl::StrCat("--learning_rate must be positive, got ", o.learning_rate));
  }
  config.set_learning_rate(o.learning_rate);
  // The ps will build the same optimizer: refuse here what they would refuse.
  PSFLOW_RETURN_IF_ERROR(ps::Optimizer::Create(config).status());
  return config;
}

// A fresh random job id: calls that name an older one fail.
uint64_t NewJobId() { return absl::Uniform<uint64_t>(absl::BitGen()); }

}  // namespace

absl::StatusOr<JobConfig> BuildJobConfig(const ChiefOptions& o) {
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model_dir is required");
  if (o.batch_size <= 0) return absl::InvalidArgumentError("--batch_size must be positive");
  if (o.epochs < 0 || o.train_steps < 0) {
    return absl::InvalidArgumentError("--epochs and --train_steps must not be negative");
  }
  if (o.epochs > 0 && o.train_steps > 0) {
    return absl::InvalidArgumentError("give --epochs or --train_steps, not both");
  }
  if (o.log_every_steps <= 0) return absl::InvalidArgumentError("--log_every_steps must be positive");
  if (o.compute_threads < 0) return absl::InvalidArgumentError("--compute_threads must not be negative");
  const int num_workers = static_cast<int>(o.cluster.cluster.worker.size());
  const int num_ps = static_cast<int>(o.cluster.cluster.ps.size());
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
    if (!check.ok()) return absl::InvalidArgumentError(absl::StrCat("--synthetic_examples: ", check.message()));
    absl::StatusOr<data::Dataset> made =
        data::MakeSynthetic(shape, std::min<int64_t>(o.synthetic_examples, 2000), data::Split::kTrain);
    if (!made.ok()) return made.status();
    stats = StatsOf(*made);
    stats->count = o.synthetic_examples;
  } else if (o.dataset == "idx") {
    stats = ReadTrainingDataStats(o.data_dir);
    if (!stats.ok()) return stats.status();
    if (in.channels() != 1 || in.height() != stats->height || in.width() != stats->width) {
      return absl::InvalidArgumentError(absl::StrCat("model ", spec->name(), " takes ", in.channels(), "x",
                                                     in.height(), "x", in.width(), " inputs, the images in ",
                                                     o.data_dir, " are 1x", stats->height, "x", stats->width));
    }
    if (spec->num_classes() != 10) {
      return absl::InvalidArgumentError(absl::StrCat("model ", spec->name(), " has ", spec->num_classes(),
                                                     " classes; MNIST-format data has 10"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--dataset '", o.dataset, "' is not one of idx, synthetic"));
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
    return absl::InvalidArgumentError(absl::StrCat("--batch_size ", o.batch_size, " exceeds the ", shard,
                                                   " examples each worker sees per epoch"));
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
    return absl::InvalidArgumentError(absl::StrCat("--on_nonfinite '", o.on_nonfinite, "' is not fail"));
  }
  job.set_on_nonfinite(JobConfig::FAIL);
  PSFLOW_ASSIGN_OR_RETURN(*job.mutable_placement(), PlaceVariables(model::ModelVariables(*spec), num_ps));
  return job;
}

class Chief::Impl final : public ChiefService::Service {
 public:
  explicit Impl(ChiefOptions options) : options_(std::move(options)) {}

  int Run();
  void Stop(int signal) {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ == 0) stop_signal_ = signal;
    // Before the ps are loaded nothing needs saving: stop waiting for them.
    if (!ready_ && ps_ != nullptr) ps_->CancelAll();
  }

  grpc::Status RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                              RegisterWorkerResponse* response) override;
  grpc::Status Report(grpc::ServerContext* context, const ReportRequest* request,
                      ReportResponse* response) override;

 private:
  // Full tensors (values and optimizer slots) to load the ps with.
  struct Weights {
    int64_t step = 0;
    std::vector<CheckpointTensorData> tensors;
  };

  absl::StatusOr<Weights> InitialWeights();
  bool TryAdopt();
  int LoadParameterServers(const Weights& weights);
  int Supervise();
  void CheckWorkers();
  bool PsHealthy(int64_t* max_version);
  int Recover();
  // On success, what was written is moved into *taken when one is given.
  absl::Status TakeCheckpoint(Checkpoint* taken = nullptr);
  absl::Status TakeCheckpointOnce(Checkpoint* taken);
  // Writes the saved model from the values of `final_checkpoint` (one of
  // step train_steps), or, without one, from the values pulled from the ps.
  int SaveModel(Checkpoint* final_checkpoint);
  void ReleaseEveryone();
  absl::Status BroadcastLiveWorkers(const std::vector<int>& live, int64_t from_version);
  uint64_t job_id() {
    absl::MutexLock lock(&mu_);
    return job_id_;
  }
  bool Stopping() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_signal_ != 0; }
  // Fails the job: no more checkpoints, no saved model, exit code 1. The
  // first failure is the one logged and kept.
  void Fail(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) return;
    failure_ = why;
    PSLOG(ERROR) << "the job fails: " << why.message();
  }
  bool Failed() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return !failure_.ok();
  }
  std::string SavedModelDir() const {
    return options_.saved_model_dir.empty() ? absl::StrCat(options_.model_dir, "/saved_model")
                                            : options_.saved_model_dir;
  }

  const ChiefOptions options_;
  JobConfig job_;
  std::unique_ptr<ps::Client> ps_;  // set once in Run under mu_ (Stop reads it)
  std::unique_ptr<Progress> progress_;
  int64_t last_checkpoint_step_ = 0;  // main thread only
  absl::Time last_checkpoint_time_;   // main thread only

  // Changes of the live set are made one at a time (they call the ps).
  absl::Mutex membership_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;  // every ps holds the job
  bool done_ ABSL_GUARDED_BY(mu_) = false;   // the saved model is written
  absl::flat_hash_set<int> live_ ABSL_GUARDED_BY(mu_);  // workers the steps wait for
  std::vector<absl::Time> last_seen_ ABSL_GUARDED_BY(mu_);  // per worker
  absl::flat_hash_set<int> finished_ ABSL_GUARDED_BY(mu_);  // saw the final version
  absl::flat_hash_set<int> released_ ABSL_GUARDED_BY(mu_);  // were told to exit
  // Why the job failed for good (it diverged); OK while it has not.
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  int64_t refused_reports_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::Status Chief::Impl::BroadcastLiveWorkers(const std::vector<int>& live, int64_t from_version) {
  const uint64_t id = job_id();
  for (int p = 0; p < job_.num_ps(); ++p) {
    PSFLOW_RETURN_IF_ERROR(ps_->SetLiveWorkers(p, id, live, from_version, absl::Now() + absl::Seconds(10)));
  }
  progress_->SetLiveWorkers(live);
  return absl::OkStatus();
}

grpc::Status Chief::Impl::RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                                         RegisterWorkerResponse* response) {
  const int w = request->worker();
  if (w < 0 || w >= job_.num_workers()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("worker ", w, " is not in the cluster (", job_.num_workers(), " workers)")));
  }
  absl::MutexLock membership(&membership_mu_);
  std::vector<int> live;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(10));
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ || Stopping(); };
    mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
    if (!ready_) return ToGrpcStatus(absl::UnavailableError("the parameter servers are not loaded yet"));
    last_seen_[w] = absl::Now();
    finished_.erase(w);
    if (!live_.contains(w)) {
      live_.insert(w);
      live.assign(live_.begin(), live_.end());
    }
  }
  int64_t start = 0;  // a member already: pull whatever version the ps are at
  if (!live.empty()) {
    // A (re)joining worker takes part from the step after the newest one any
    // ps has reached, so no step waits for a push computed on other weights.
    int64_t max_version = 0;
    if (!PsHealthy(&max_version)) return ToGrpcStatus(absl::UnavailableError("a ps is not reachable"));
    start = max_version + 1;
    std::sort(live.begin(), live.end());
    absl::Status s = BroadcastLiveWorkers(live, start);
    if (!s.ok()) return ToGrpcStatus(absl::UnavailableError(s.message()));
    progress_->Rejoin(w, start);
    PSLOG(INFO) << "worker " << w << " joins at step " << start << " (" << live.size() << " live)";
  } else {
    PSLOG(INFO) << "worker " << w << " registered";
  }
  response->set_job_id(job_id());
  *response->mutable_job() = job_;
  for (const std::string& a : options_.cluster.cluster.ps) response->add_ps_address(a);
  response->set_start_step(start);
  return grpc::Status::OK;
}

grpc::Status Chief::Impl::Report(grpc::ServerContext* context, const ReportRequest* request,
                                 ReportResponse* response) {
  const int w = request->worker();
  if (w < 0 || w >= job_.num_workers()) return ToGrpcStatus(absl::InvalidArgumentError("unknown worker"));
  for (const StepMetrics& m : request->metrics()) {
    absl::Status valid = CheckStepMetrics(m, job_.train_steps(), job_.batch_size());
    if (valid.ok()) continue;
    absl::MutexLock lock(&mu_);
    // Refused, never logged as progress; the first few are named.
    if (++refused_reports_ <= 10) {
      PSLOG(WARNING) << "refused a report from worker " << w << ": " << valid.message();
    }
    return ToGrpcStatus(valid);
  }
  for (const StepMetrics& m : request->metrics()) {
    if (!m.nonfinite()) continue;
    Fail(absl::OutOfRangeError(absl::StrCat(
        "worker ", w, " computed a non-finite loss or gradients at step ", m.step(),
        " (the job diverged; lower --learning_rate?); with --on_nonfinite=fail no saved model is written")));
  }
  {
    absl::MutexLock lock(&mu_);
    if (!failure_.ok()) {
      response->set_action(ReportResponse::FAIL);
      released_.insert(w);
      return grpc::Status::OK;
    }
    if (request->job_id() != job_id_ || !ready_) {
      response->set_action(ReportResponse::REGISTER);  // the job was reloaded: its step is gone
      return grpc::Status::OK;
    }
    last_seen_[w] = absl::Now();
  }
  // Outside mu_: recording may write log lines.
  progress_->Record(w, {request->metrics().begin(), request->metrics().end()}, absl::Now());
  absl::MutexLock lock(&mu_);
  if (request->finished()) {
    finished_.insert(w);
    // Long-poll: answer when the job is over, or soon enough to serve as a heartbeat.
    const absl::Time deadline =
        std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(2));
    auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ || Stopping() || !failure_.ok(); };
    mu_.AwaitWithDeadline(absl::Condition(&over), deadline);
  }
  if (!failure_.ok()) {
    response->set_action(ReportResponse::FAIL);
    released_.insert(w);
  } else if (done_) {
    response->set_action(ReportResponse::EXIT);
    released_.insert(w);
  }
  return grpc::Status::OK;
}

absl::StatusOr<Chief::Impl::Weights> Chief::Impl::InitialWeights() {
  const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
  absl::StatusOr<Checkpoint> ckpt = ReadNewestCheckpoint(options_.model_dir);
  Weights w;
  if (!ckpt.ok()) {
    if (!absl::IsNotFound(ckpt.status())) return ckpt.status();
    std::vector<std::vector<float>> init = model::InitialValues(job_.model(), job_.seed());
    for (size_t i = 0; i < vars.size(); ++i) w.tensors.push_back({vars[i].name, "", vars[i].shape, std::move(init[i])});
    return w;
  }
  // Every variable must be there with its shape; optimizer slots are taken
  // when the optimizer is the same kind (otherwise they start at zero).
  const bool same_optimizer = ckpt->manifest.optimizer().kind() == job_.optimizer().kind();
  absl::flat_hash_set<std::string> wanted;
  for (const VariableShape& v : vars) wanted.insert(v.name);
  for (const VariableShape& v : vars) {
    auto it = std::find_if(ckpt->tensors.begin(), ckpt->tensors.end(),
                           [&](const CheckpointTensorData& t) { return t.name == v.name && t.slot.empty(); });
    if (it == ckpt->tensors.end() || it->shape != v.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the newest checkpoint in ", CheckpointsDir(options_.model_dir), " does not fit model ",
          job_.model().name(), " (variable '", v.name, "'): use another --model_dir"));
    }
  }
  for (CheckpointTensorData& t : ckpt->tensors) {
    if (wanted.contains(t.name) && (t.slot.empty() || same_optimizer)) w.tensors.push_back(std::move(t));
  }
  w.step = ckpt->manifest.step();
  PSLOG(INFO) << "restoring from the checkpoint of step " << w.step << " (saved with "
              << ckpt->manifest.num_ps() << " ps" << (same_optimizer ? "" : ", optimizer slots reset") << ")";
  return w;
}

bool Chief::Impl::TryAdopt() {
  // After a restart of the chief alone, the ps may still hold the job, all at
  // one step: take it over as it is rather than going back to a checkpoint.
  uint64_t id = 0;
  for (int attempt = 0; attempt < 40; ++attempt) {
    std::vector<PsState> states;
    for (int p = 0; p < job_.num_ps(); ++p) {
      absl::StatusOr<PsState> st = ps_->GetState(p, absl::Now() + absl::Seconds(2));
      if (!st.ok() || !st->holds_job()) return false;
      states.push_back(*std::move(st));
    }
    bool same = google::protobuf::util::MessageDifferencer::Equals(states[0].job(), job_);
    bool agree = true;
    for (const PsState& st : states) {
      same = same && st.job_id() == states[0].job_id() && st.live_workers_size() > 0;
      agree = agree && st.version() == states[0].version();
    }
    if (!same) return false;
    if (agree) {
      id = states[0].job_id();
      std::vector<int> live(states[0].live_workers().begin(), states[0].live_workers().end());
      {
        absl::MutexLock lock(&mu_);
        job_id_ = id;
        live_ = absl::flat_hash_set<int>(live.begin(), live.end());
        for (absl::Time& t : last_seen_) t = absl::Now();
      }
      progress_->Restart(states[0].version());
      progress_->SetLiveWorkers(live);
      last_checkpoint_step_ = states[0].version();
      PSLOG(INFO) << "adopting the running job at step " << states[0].version() << " (" << live.size()
                  << " live workers)";
      return true;
    }
    absl::SleepFor(absl::Milliseconds(50));  // a step is being applied: look again
  }
  return false;
}

int Chief::Impl::LoadParameterServers(const Weights& weights) {
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  std::vector<int> live;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    live.assign(live_.begin(), live_.end());
    id = job_id_;
  }
  std::sort(live.begin(), live.end());
  std::vector<absl::Status> results(job_.num_ps());
  std::vector<std::thread> threads;
  for (int p = 0; p < job_.num_ps(); ++p) {
    threads.emplace_back([&, p] {
      InitHeader header;
      header.set_job_id(id);
      header.set_ps_index(p);
      *header.mutable_job() = job_;
      header.set_version(weights.step);
      for (int w : live) header.add_live_workers(w);
      std::vector<TensorRef> tensors;
      for (const SliceRef& s : SlicesOnPs(job_.placement(), p)) {
        SliceSpec* spec = header.add_slice();
        spec->set_name(s.name);
        for (int64_t d : s.slice_shape) spec->add_shape(d);
        spec->set_row_begin(s.row_begin);
        spec->set_row_end(s.row_end);
        for (const CheckpointTensorData& t : weights.tensors) {
          if (t.name == s.name) tensors.push_back({s.name, t.slot, s.slice_shape, t.values.data() + s.float_offset});
        }
      }
      // wait_for_ready covers a ps not up yet; a connection that breaks
      // under the call (a ps going down as it is asked) is tried again.
      Backoff backoff;
      do {
        results[p] = ps_->Init(p, header, tensors, deadline);
        if (!absl::IsUnavailable(results[p]) || absl::Now() >= deadline) break;
        absl::SleepFor(backoff.Next());
      } while (absl::Now() < deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (int p = 0; p < job_.num_ps(); ++p) {
    if (results[p].ok()) continue;
    PSLOG(ERROR) << "cannot load ps " << p << " at " << options_.cluster.cluster.ps[p] << ": "
                 << results[p].message();
    {
      absl::MutexLock lock(&mu_);
      if (Stopping()) return ExitCodeForSignal(stop_signal_);
    }
    if (absl::IsDeadlineExceeded(results[p]) || absl::IsUnavailable(results[p])) return kExitUnreachable;
    // A ps that refuses the job (another task index at that address, say)
    // will refuse it again: not worth a restart.
    if (absl::IsInvalidArgument(results[p]) || absl::IsFailedPrecondition(results[p])) return kExitPermanent;
    return kExitRetryable;
  }
  progress_->Restart(weights.step);
  progress_->SetLiveWorkers(live);
  last_checkpoint_step_ = weights.step;
  last_checkpoint_time_ = absl::Now();
  absl::MutexLock lock(&mu_);
  ready_ = true;
  for (absl::Time& t : last_seen_) t = absl::Now();  // the workers' timeouts start now
  return kExitDone;
}

bool Chief::Impl::PsHealthy(int64_t* max_version) {
  const uint64_t id = job_id();
  *max_version = 0;
  for (int p = 0; p < job_.num_ps(); ++p) {
    absl::StatusOr<PsState> st = ps_->GetState(p, absl::Now() + absl::Seconds(2));
    if (!st.ok() || !st->holds_job() || st->job_id() != id) return false;
    *max_version = std::max(*max_version, st->version());
  }
  return true;
}

void Chief::Impl::CheckWorkers() {
  absl::MutexLock membership(&membership_mu_);
  std::vector<int> live;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (int w : std::vector<int>(live_.begin(), live_.end())) {
      if (now - last_seen_[w] <= options_.worker_timeout || finished_.contains(w)) continue;
      if (live_.size() == 1) break;  // the last one: nobody left to go on with
      live_.erase(w);
      PSLOG(WARNING) << "worker " << w << " sent no heartbeat for " << options_.worker_timeout
                     << "; going on with " << live_.size() << " workers";
      live.assign(live_.begin(), live_.end());
    }
  }
  if (live.empty()) return;
  std::sort(live.begin(), live.end());
  absl::Status s = BroadcastLiveWorkers(live, 0);
  if (!s.ok()) PSLOG(WARNING) << "cannot update the live workers: " << s.message();
}

int Chief::Impl::Recover() {
  PSLOG(WARNING) << "a parameter server is down or lost its shard; pausing the workers and reloading "
                    "every ps from the newest checkpoint";
  {
    absl::MutexLock lock(&mu_);
    ready_ = false;
    // A new job id: the workers' calls to the old one fail and they register again.
    job_id_ = NewJobId();
    finished_.clear();
  }
  absl::StatusOr<Weights> weights = InitialWeights();
  if (!weights.ok()) {
    PSLOG(ERROR) << weights.status().message();
    return kExitPermanent;
  }
  int code = LoadParameterServers(*weights);
  if (code == kExitDone) PSLOG(INFO) << "parameter servers reloaded at step " << weights->step << "; training";
  return code;
}

absl::Status Chief::Impl::TakeCheckpoint(Checkpoint* taken) {
  // A ps may pass the chosen step between looking and asking: look again.
  absl::Status s;
  for (int attempt = 0; attempt < 5; ++attempt) {
    s = TakeCheckpointOnce(taken);
    if (!absl::IsFailedPrecondition(s)) return s;
  }
  return s;
}

absl::Status Chief::Impl::TakeCheckpointOnce(Checkpoint* taken) {
  int64_t target = 0;
  if (!PsHealthy(&target)) return absl::UnavailableError("a ps is not reachable");
  const uint64_t id = job_id();
  // Every ps copies its slices the moment it reaches `target` (those there
  // already, at once): one consistent step across shards, taken while
  // training goes on.
  const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
  const std::vector<std::string> slots = ps::Optimizer::SlotNames(job_.optimizer().kind());
  // Variable i's value, then its slots, are ckpt.tensors[i * per_var, (i + 1) * per_var).
  const size_t per_var = slots.size() + 1;
  Checkpoint ckpt;
  for (size_t i = 0; i < vars.size(); ++i) {
    for (size_t k = 0; k < per_var; ++k) {
      ckpt.tensors.push_back({vars[i].name, k == 0 ? "" : slots[k - 1], vars[i].shape,
                              std::vector<float>(NumElements(vars[i].shape))});
    }
  }
  std::vector<absl::Status> results(job_.num_ps());
  std::vector<std::thread> threads;
  for (int p = 0; p < job_.num_ps(); ++p) {
    threads.emplace_back([&, p] {
      std::vector<TensorSink> sinks;
      for (const SliceRef& s : SlicesOnPs(job_.placement(), p)) {
        for (size_t k = 0; k < per_var; ++k) {
          CheckpointTensorData& t = ckpt.tensors[s.variable_index * per_var + k];
          sinks.push_back({s.name, t.slot, s.slice_shape, t.values.data() + s.float_offset, true});
        }
      }
      results[p] = ps_->Snapshot(p, id, target, std::move(sinks), absl::Now() + absl::Seconds(20));
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  for (const CheckpointTensorData& t : ckpt.tensors) {
    if (std::all_of(t.values.begin(), t.values.end(), [](float v) { return std::isfinite(v); })) continue;
    absl::Status diverged = absl::OutOfRangeError(
        absl::StrCat("the weights of step ", target, " are not finite (", t.name, t.slot.empty() ? "" : "/", t.slot,
                     "): the job diverged; the checkpoints before it are kept, no saved model is written"));
    Fail(diverged);
    return diverged;
  }
  CheckpointManifest& m = ckpt.manifest;
  m.set_step(target);
  *m.mutable_model() = job_.model();
  *m.mutable_optimizer() = job_.optimizer();
  m.set_steps_per_epoch(job_.steps_per_epoch());
  m.set_num_workers(job_.num_workers());
  m.set_batch_size(job_.batch_size());
  m.set_seed(job_.seed());
  m.set_num_ps(job_.num_ps());
  for (int w = 0; w < job_.num_workers(); ++w) {
    WorkerPosition* pos = m.add_worker();
    pos->set_worker(w);
    pos->set_epoch(target / job_.steps_per_epoch());
    pos->set_examples_done((target % job_.steps_per_epoch()) * job_.batch_size());
  }
  const absl::Time start = absl::Now();
  PSFLOW_RETURN_IF_ERROR(WriteCheckpoint(options_.model_dir, ckpt, options_.keep_checkpoints));
  last_checkpoint_step_ = target;
  last_checkpoint_time_ = absl::Now();
  PSLOG(INFO) << "checkpoint of step " << target << " written to " << CheckpointsDir(options_.model_dir) << " ("
              << absl::ToInt64Milliseconds(absl::Now() - start) << " ms)";
  if (taken != nullptr) *taken = std::move(ckpt);
  return absl::OkStatus();
}

int Chief::Impl::Supervise() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (Stopping() || !failure_.ok()) return true;
        for (int w : live_) {
          if (!finished_.contains(w)) return false;
        }
        return true;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Milliseconds(100));
      if (!failure_.ok()) return kExitPermanent;
      if (Stopping()) break;
      if (wake()) return kExitDone;
    }
    int64_t version = 0;
    if (!PsHealthy(&version)) {
      int code = Recover();
      if (code != kExitDone) return code;
      continue;
    }
    CheckWorkers();
    const bool by_steps = options_.checkpoint_every_steps > 0 &&
                          version >= last_checkpoint_step_ + options_.checkpoint_every_steps;
    const bool by_time = options_.checkpoint_every > absl::ZeroDuration() &&
                         absl::Now() - last_checkpoint_time_ >= options_.checkpoint_every &&
                         version > last_checkpoint_step_;
    if (by_steps || by_time) {
      absl::Status s = TakeCheckpoint();
      if (!s.ok() && !Failed()) PSLOG(WARNING) << "checkpoint failed: " << s.message();
    }
  }
  // Stopped by a signal: keep what was trained, then leave ps and workers
  // running for the chief that comes next.
  absl::Status s = TakeCheckpoint();
  if (!s.ok() && !Failed()) PSLOG(WARNING) << "no checkpoint before exiting: " << s.message();
  absl::MutexLock lock(&mu_);
  return failure_.ok() ? ExitCodeForSignal(stop_signal_) : kExitPermanent;
}

int Chief::Impl::SaveModel(Checkpoint* final_checkpoint) {
  std::vector<std::vector<float>> values;
  int64_t version = -1;
  if (final_checkpoint != nullptr) {
    // The values (slot "") come in the variables' order.
    for (CheckpointTensorData& t : final_checkpoint->tensors) {
      if (t.slot.empty()) values.push_back(std::move(t.values));
    }
    version = final_checkpoint->manifest.step();
  } else {
    const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
    for (const VariableShape& v : vars) values.emplace_back(NumElements(v.shape));
    const absl::Time deadline = absl::Now() + absl::Minutes(1);
    const uint64_t id = job_id();
    for (int p = 0; p < job_.num_ps(); ++p) {
      std::vector<TensorSink> sinks;
      for (const SliceRef& s : SlicesOnPs(job_.placement(), p)) {
        sinks.push_back({s.name, "", s.slice_shape, values[s.variable_index].data() + s.float_offset, true});
      }
      absl::StatusOr<ps::Client::PullResult> r = ps_->Pull(p, id, job_.train_steps(), std::move(sinks), deadline);
      if (!r.ok()) {
        PSLOG(ERROR) << "cannot read the final weights: " << r.status().message();
        return kExitRetryable;
      }
      version = r->version;
    }
  }
  const std::string dir = SavedModelDir();
  absl::Status s = model::WriteSavedModel(dir, job_.model(), version, values);
  if (!s.ok()) {
    PSLOG(ERROR) << "cannot write the saved model: " << s.message();
    return kExitRetryable;
  }
  PSLOG(INFO) << "saved model (step " << version << ") written to " << dir;
  return kExitDone;
}

void Chief::Impl::ReleaseEveryone() {
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    // Workers learn it from their next report; give them a little while.
    // Every finished worker, or after a failure every live one, is told.
    auto all_released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (Stopping()) return true;
      if (failure_.ok()) return released_.size() >= finished_.size();
      return std::all_of(live_.begin(), live_.end(), [this](int w) { return released_.contains(w); });
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_released), absl::Seconds(30))) {
      PSLOG(WARNING) << "not every worker collected its exit order";
    }
  }
  const uint64_t id = job_id();
  for (int p = 0; p < job_.num_ps(); ++p) {
    absl::Status s = ps_->Shutdown(p, id, absl::Now() + absl::Seconds(10));
    if (!s.ok()) PSLOG(WARNING) << "ps " << p << " did not take the exit order: " << s.message();
  }
}

int Chief::Impl::Run() {
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  if (!job.ok()) {
    PSLOG(ERROR) << job.status().message();
    return kExitPermanent;
  }
  job_ = *std::move(job);
  {
    absl::MutexLock lock(&mu_);
    job_id_ = NewJobId();
    for (int w = 0; w < job_.num_workers(); ++w) live_.insert(w);
    last_seen_.assign(job_.num_workers(), absl::Now());
    ps_ = std::make_unique<ps::GrpcClient>(options_.cluster.cluster.ps);
  }
  progress_ = std::make_unique<Progress>(job_.train_steps(), job_.steps_per_epoch(), options_.log_every_steps,
                                         job_.num_workers(), job_.num_ps(),
                                         [this] {
                                           int n = 0;
                                           for (int p = 0; p < job_.num_ps(); ++p) n += ps_->Reachable(p);
                                           return n;
                                         },
                                         [](const std::string& line) { PSLOG(INFO) << line; });
  // Find out now, not after training, that the outputs cannot be written.
  absl::Status writable = MakeDirectories(SavedModelDir());
  if (writable.ok()) writable = MakeDirectories(CheckpointsDir(options_.model_dir));
  if (!writable.ok()) {
    PSLOG(ERROR) << writable.message();
    return kExitPermanent;
  }

  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer(options_.cluster.self_port, this);
  if (!server.ok()) {
    PSLOG(ERROR) << server.status().message();
    return kExitPermanent;
  }
  int64_t params = 0;
  for (const VariableShape& v : model::ModelVariables(job_.model())) params += NumElements(v.shape);
  std::vector<int64_t> bytes = BytesPerPs(job_.placement());
  std::string per_ps;
  for (size_t p = 0; p < bytes.size(); ++p) absl::StrAppend(&per_ps, p ? ", " : "", bytes[p] / 1024, " KiB");
  PSLOG(INFO) << "job: model " << job_.model().name() << " (" << params << " parameters), "
              << job_.train_steps() << " steps (" << job_.steps_per_epoch() << " per epoch), batch "
              << job_.batch_size() << " x " << job_.num_workers() << " workers, optimizer "
              << OptimizerConfig::Kind_Name(job_.optimizer().kind()) << " lr " << job_.optimizer().learning_rate()
              << ", inputs standardized with mean " << job_.model().input().mean() << " stddev "
              << job_.model().input().stddev() << ", variables over " << job_.num_ps() << " ps (" << per_ps
              << ")";
  PSLOG(INFO) << "listening on " << options_.cluster.self_address << "; loading the parameter servers";

  int code = kExitDone;
  if (TryAdopt()) {
    absl::MutexLock lock(&mu_);
    ready_ = true;
  } else {
    absl::StatusOr<Weights> weights = InitialWeights();
    if (!weights.ok()) {
      PSLOG(ERROR) << weights.status().message();
      code = kExitPermanent;
    } else {
      code = LoadParameterServers(*weights);
      if (code == kExitDone) PSLOG(INFO) << "parameter servers loaded at step " << weights->step << "; training";
    }
  }
  if (code == kExitDone) code = Supervise();
  bool trained = code == kExitDone;
  if (trained) {
    // The last checkpoint holds the final step: a restarted job finds it done.
    Checkpoint final_checkpoint;
    absl::Status s = TakeCheckpoint(&final_checkpoint);
    if (Failed()) {
      trained = false;
      code = kExitPermanent;
    }
    if (!s.ok() && code == kExitDone) PSLOG(WARNING) << "no final checkpoint: " << s.message();
    // It holds the final weights too, unless a ps had gone past train_steps:
    // then they are pulled again.
    const bool reuse = s.ok() && final_checkpoint.manifest.step() == job_.train_steps();
    if (code == kExitDone) code = SaveModel(reuse ? &final_checkpoint : nullptr);
  }
  if (Failed()) {
    // A failed job ends for everyone: workers learn it from their next report.
    ReleaseEveryone();
    code = kExitPermanent;
  }
  {
    absl::MutexLock lock(&mu_);
    if (Stopping() && code == kExitDone) code = ExitCodeForSignal(stop_signal_);
  }
  // Once training is over, ps and workers have nothing left to do, whether
  // or not the saved model could be written.
  if (trained) ReleaseEveryone();
  if (code == kExitDone) {
    Progress::Summary s = progress_->summary();
    PSLOG(INFO) << absl::StrFormat("done: %d steps, %d examples in %.1f s, %.0f ex/s after the first interval, "
                                   "final loss %.4f acc %.3f",
                                   job_.train_steps(), s.examples, absl::ToDoubleSeconds(s.elapsed),
                                   s.examples_per_sec, s.last_loss, s.last_accuracy);
  }
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return code;
}

Chief::Chief(ChiefOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Chief::~Chief() = default;
int Chief::Run() { return impl_->Run(); }
void Chief::Stop(int signal) { impl_->Stop(signal); }

}  // namespace psflow::chief
