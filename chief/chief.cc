#include "chief/chief.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <atomic>
#include <random>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "chief/progress.h"
#include "common/file_util.h"
#include "common/grpc_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/tensor_chunks.h"
#include "data/mnist.h"
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
  double sum = 0, sum_sq = 0;
  for (uint8_t p : images->data) {
    sum += p;
    sum_sq += static_cast<double>(p) * p;
  }
  const double n = static_cast<double>(images->data.size());
  stats.mean = sum / n / 255.0;
  stats.stddev = std::sqrt(std::max(sum_sq / n - (sum / n) * (sum / n), 0.0)) / 255.0;
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
  absl::StatusOr<std::unique_ptr<ps::Optimizer>> check = ps::Optimizer::Create(config);
  if (!check.ok()) return check.status();
  return config;
}

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
  absl::StatusOr<OptimizerConfig> opt = MakeOptimizer(o);
  if (!opt.ok()) return opt.status();
  *job.mutable_optimizer() = *opt;
  absl::StatusOr<TrainingDataStats> stats = ReadTrainingDataStats(o.data_dir);
  if (!stats.ok()) return stats.status();
  const InputSpec& in = spec->input();
  if (in.channels() != 1 || in.height() != stats->height || in.width() != stats->width) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec->name(), " takes ", in.channels(), "x",
                                                   in.height(), "x", in.width(), " inputs, the images in ",
                                                   o.data_dir, " are 1x", stats->height, "x", stats->width));
  }
  if (spec->num_classes() != 10) {
    return absl::InvalidArgumentError(absl::StrCat("model ", spec->name(), " has ", spec->num_classes(),
                                                   " classes; MNIST-format data has 10"));
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
  absl::StatusOr<Placement> placement = PlaceVariables(model::ModelVariables(*spec), num_ps);
  if (!placement.ok()) return placement.status();
  *job.mutable_placement() = *placement;
  return job;
}

class Chief::Impl final : public ::psflow::Chief::Service {
 public:
  explicit Impl(ChiefOptions options) : options_(std::move(options)) {}

  int Run();
  void Stop(int signal) {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ == 0) stop_signal_ = signal;
    if (ps_ != nullptr) ps_->CancelAll();
  }

  grpc::Status RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                              RegisterWorkerResponse* response) override;
  grpc::Status Report(grpc::ServerContext* context, const ReportRequest* request,
                      ReportResponse* response) override;

 private:
  int LoadParameterServers();
  int WaitForWorkers();
  int SaveModel();
  void ReleaseEveryone();
  bool Stopping() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_signal_ != 0; }
  std::string SavedModelDir() const {
    return options_.saved_model_dir.empty() ? absl::StrCat(options_.model_dir, "/saved_model")
                                            : options_.saved_model_dir;
  }

  const ChiefOptions options_;
  JobConfig job_;
  uint64_t job_id_ = 0;
  std::unique_ptr<PsClient> ps_;  // set once in Run under mu_ (Stop reads it)
  std::unique_ptr<Progress> progress_;

  absl::Mutex mu_;
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  bool ready_ ABSL_GUARDED_BY(mu_) = false;  // every ps holds its shard
  bool done_ ABSL_GUARDED_BY(mu_) = false;   // the saved model is written
  absl::flat_hash_set<int> registered_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> finished_ ABSL_GUARDED_BY(mu_);  // saw the final version
  absl::flat_hash_set<int> released_ ABSL_GUARDED_BY(mu_);  // were told to exit
};

grpc::Status Chief::Impl::RegisterWorker(grpc::ServerContext* context, const RegisterWorkerRequest* request,
                                         RegisterWorkerResponse* response) {
  const int w = request->worker();
  if (w < 0 || w >= job_.num_workers()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("worker ", w, " is not in the cluster (", job_.num_workers(), " workers)")));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(10));
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ || Stopping(); };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (!ready_) return ToGrpcStatus(absl::UnavailableError("the parameter servers are not loaded yet"));
  if (registered_.insert(w).second) PSLOG(INFO) << "worker " << w << " registered";
  response->set_job_id(job_id_);
  *response->mutable_job() = job_;
  for (const std::string& a : options_.cluster.cluster.ps) response->add_ps_address(a);
  return grpc::Status::OK;
}

grpc::Status Chief::Impl::Report(grpc::ServerContext* context, const ReportRequest* request,
                                 ReportResponse* response) {
  if (request->job_id() != job_id_) {
    return ToGrpcStatus(absl::FailedPreconditionError("report for another job: register again"));
  }
  const int w = request->worker();
  if (w < 0 || w >= job_.num_workers()) return ToGrpcStatus(absl::InvalidArgumentError("unknown worker"));
  progress_->Record(w, {request->metrics().begin(), request->metrics().end()}, absl::Now());
  absl::MutexLock lock(&mu_);
  if (request->finished()) {
    finished_.insert(w);
    // Long-poll: answer when the job is over, or soon enough to serve as a heartbeat.
    const absl::Time deadline =
        std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(2));
    auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ || Stopping(); };
    mu_.AwaitWithDeadline(absl::Condition(&over), deadline);
  }
  if (done_) {
    response->set_action(ReportResponse::EXIT);
    released_.insert(w);
  }
  return grpc::Status::OK;
}

int Chief::Impl::LoadParameterServers() {
  const std::vector<std::vector<float>> init = model::InitialValues(job_.model(), job_.seed());
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  std::vector<absl::Status> results(job_.num_ps());
  std::vector<std::thread> threads;
  for (int p = 0; p < job_.num_ps(); ++p) {
    threads.emplace_back([&, p] {
      InitHeader header;
      header.set_job_id(job_id_);
      header.set_ps_index(p);
      *header.mutable_job() = job_;
      header.set_version(0);
      for (int w = 0; w < job_.num_workers(); ++w) header.add_live_workers(w);
      std::vector<TensorRef> tensors;
      for (const SliceRef& s : SlicesOnPs(job_.placement(), p)) {
        SliceSpec* spec = header.add_slice();
        spec->set_name(s.name);
        for (int64_t d : s.slice_shape) spec->add_shape(d);
        spec->set_row_begin(s.row_begin);
        spec->set_row_end(s.row_end);
        tensors.push_back({s.name, "", s.slice_shape, init[s.variable_index].data() + s.float_offset});
      }
      results[p] = ps_->Init(p, header, std::move(tensors), deadline);
    });
  }
  for (auto& t : threads) t.join();
  for (int p = 0; p < job_.num_ps(); ++p) {
    if (results[p].ok()) continue;
    PSLOG(ERROR) << "cannot load ps " << p << " at " << options_.cluster.cluster.ps[p] << ": "
                 << results[p].message();
    if (absl::IsDeadlineExceeded(results[p]) || absl::IsUnavailable(results[p])) return kExitUnreachable;
    // A ps that refuses the job (another task index at that address, say)
    // will refuse it again: not worth a restart.
    if (absl::IsInvalidArgument(results[p]) || absl::IsFailedPrecondition(results[p])) return kExitPermanent;
    return kExitRetryable;
  }
  return kExitDone;
}

int Chief::Impl::WaitForWorkers() {
  absl::MutexLock lock(&mu_);
  auto all_finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Stopping() || static_cast<int>(finished_.size()) == job_.num_workers();
  };
  mu_.Await(absl::Condition(&all_finished));
  return Stopping() ? ExitCodeForSignal(stop_signal_) : kExitDone;
}

int Chief::Impl::SaveModel() {
  const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
  std::vector<std::vector<float>> values;
  for (const VariableShape& v : vars) values.emplace_back(NumElements(v.shape));
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  int64_t version = -1;
  for (int p = 0; p < job_.num_ps(); ++p) {
    std::vector<TensorSink> sinks;
    for (const SliceRef& s : SlicesOnPs(job_.placement(), p)) {
      sinks.push_back({s.name, "", s.slice_shape, values[s.variable_index].data() + s.float_offset, true});
    }
    absl::StatusOr<PsClient::PullResult> r =
        ps_->Pull(p, job_id_, job_.train_steps(), std::move(sinks), deadline);
    if (!r.ok()) {
      PSLOG(ERROR) << "cannot read the final weights: " << r.status().message();
      return kExitRetryable;
    }
    version = r->version;
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
    auto all_released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return Stopping() || released_.size() >= finished_.size();
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_released), absl::Seconds(30))) {
      PSLOG(WARNING) << "not every worker collected its exit order";
    }
  }
  for (int p = 0; p < job_.num_ps(); ++p) {
    absl::Status s = ps_->Shutdown(p, job_id_, absl::Now() + absl::Seconds(10));
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
  job_id_ = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  progress_ = std::make_unique<Progress>(job_.train_steps(), job_.steps_per_epoch(), options_.log_every_steps,
                                         job_.num_workers(), job_.num_ps(),
                                         [this] {
                                           int n = 0;
                                           for (int p = 0; p < job_.num_ps(); ++p) n += ps_->Reachable(p);
                                           return n;
                                         },
                                         [](const std::string& line) { PSLOG(INFO) << line; });
  {
    absl::MutexLock lock(&mu_);
    ps_ = std::make_unique<PsClient>(options_.cluster.cluster.ps);
  }
  // Find out now, not after training, that the outputs cannot be written.
  absl::Status writable = MakeDirectories(SavedModelDir());
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

  int code = LoadParameterServers();
  if (code == kExitDone) {
    {
      absl::MutexLock lock(&mu_);
      ready_ = true;
    }
    PSLOG(INFO) << "parameter servers loaded; training";
    code = WaitForWorkers();
  }
  const bool trained = code == kExitDone;
  if (trained) code = SaveModel();
  {
    absl::MutexLock lock(&mu_);
    if (Stopping()) code = ExitCodeForSignal(stop_signal_);
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
