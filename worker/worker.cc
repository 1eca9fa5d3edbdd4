#include "worker/worker.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/grpc_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/tensor_chunks.h"
#include "common/thread_pool.h"
#include "data/mnist.h"
#include "data/synthetic.h"
#include "kernels/kernels.h"
#include "model/network.h"
#include "proto/chief.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "ps/client.h"

namespace psflow::worker {
namespace {

// Train's answer when the worker must register again (not an exit code).
constexpr int kRegisterAgain = -1;
// Train's answer when a step's loss or gradients were not finite.
constexpr int kNonFinite = -2;

// How long a ps may hold a pull while the other workers finish the step
// before answering "not yet" (the worker then asks again).
constexpr absl::Duration kPullWait = absl::Seconds(5);
// Allowance for moving one shard's tensors, on top of any waiting.
constexpr absl::Duration kTransferTimeout = absl::Seconds(120);
constexpr absl::Duration kReportEvery = absl::Milliseconds(250);

bool Retryable(const absl::Status& s) { return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s); }

// A ps that holds another job (the chief reloaded it), drops this worker, or
// answers from another version than its peers (mid-reload): register again.
bool JobChanged(const absl::Status& s) { return absl::IsFailedPrecondition(s) || absl::IsAborted(s); }

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

bool AllFinite(const float* v, int64_t n) {
  // No early exit: the loop vectorizes, and a finite job reads every value anyway.
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(v[i]);
  return finite;
}

}  // namespace

class Worker::Impl final : public WorkerService::Service {
 public:
  explicit Impl(WorkerOptions options)
      : options_(std::move(options)),
        index_(options_.cluster.task_index),
        chief_(ChiefService::NewStub(MakeChannel(options_.cluster.cluster.chief[0]))) {}

  int Run();
  int RunTraining();
  grpc::Status GetStatus(grpc::ServerContext*, const WorkerStatusRequest*, WorkerStatus* status) override {
    absl::MutexLock lock(&mu_);
    status->set_worker(index_);
    status->set_job_id(job_id_);
    status->set_step(step_);
    status->set_finished(finished_);
    return grpc::Status::OK;
  }
  void Stop(int signal) {
    absl::MutexLock lock(&mu_);
    if (stop_signal_ == 0) stop_signal_ = signal;
    if (ps_ != nullptr) ps_->CancelAll();  // a pull blocked on the other workers ends now
  }

 private:
  int Register();
  int Prepare();
  // Trains from `start` to the end. kRegisterAgain when the job was reloaded
  // or this worker was dropped from it.
  int Train(int64_t start);
  absl::Status PullAll(int64_t min_version, int64_t* version, int64_t* wait_us);
  absl::Status PushAll(int64_t step);
  void ReportLoop();
  int stop_signal() {
    absl::MutexLock lock(&mu_);
    return stop_signal_;
  }
  // Runs `call` until it succeeds, fails for good, the worker is stopping, or
  // the ps has been unreachable for --startup_timeout.
  template <typename Call>
  auto WithRetries(const Call& call) -> decltype(call()) {
    const absl::Time give_up = absl::Now() + options_.startup_timeout;
    Backoff backoff;
    while (true) {
      auto result = call();
      if (result.ok() || !Retryable(result.status()) || stop_signal() != 0 || absl::Now() >= give_up) {
        return result;
      }
      PSLOG(WARNING) << "retrying: " << result.status().message();
      absl::SleepFor(backoff.Next());
    }
  }

  const WorkerOptions options_;
  const int index_;
  std::unique_ptr<ChiefService::Stub> chief_;
  std::atomic<uint64_t> job_id_{0};  // set once at registration
  JobConfig job_;
  std::unique_ptr<ps::Client> ps_;  // set once at registration, under mu_
  std::unique_ptr<ThreadPool> pool_;  // one thread per ps, for parallel pulls and pushes
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<model::Network> net_;
  data::Dataset data_;
  // Where pulls land and pushes come from, by variable: the network's own
  // buffers when in_place_, else staging_ copied to and from the device.
  std::vector<float*> weights_, grads_;
  bool in_place_ = false;
  std::vector<std::vector<float>> staging_;
  std::vector<std::vector<SliceRef>> slices_;        // by ps

  absl::Mutex mu_;
  int stop_signal_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<StepMetrics> pending_ ABSL_GUARDED_BY(mu_);  // not yet reported
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // saw the final version
  bool released_ ABSL_GUARDED_BY(mu_) = false;  // the chief said exit
  int report_error_ ABSL_GUARDED_BY(mu_) = 0;   // exit code when reporting failed for good
  bool training_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool reregister_ ABSL_GUARDED_BY(mu_) = false;  // the chief asked for a new registration
  bool nonfinite_ ABSL_GUARDED_BY(mu_) = false;   // a step was not finite: report it at once
  bool job_failed_ ABSL_GUARDED_BY(mu_) = false;  // the chief said the job failed
  int64_t start_step_ = 0;  // from the latest registration (training thread only)
  Backoff register_backoff_;  // between registrations that end in no step (training thread only)
};

int Worker::Impl::Register() {
  const absl::Time give_up = absl::Now() + options_.startup_timeout;
  Backoff backoff;
  absl::Status last;
  while (absl::Now() < give_up && stop_signal() == 0) {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    context.set_deadline(absl::ToChronoTime(std::min(give_up, absl::Now() + absl::Seconds(15))));
    RegisterWorkerRequest request;
    request.set_worker(index_);
    RegisterWorkerResponse response;
    last = FromGrpcStatus(chief_->RegisterWorker(&context, request, &response));
    if (last.ok()) {
      if (ps_ != nullptr && response.job().SerializeAsString() != job_.SerializeAsString()) {
        // Same cluster, another job config: start over as a fresh process.
        PSLOG(ERROR) << "the chief now runs another job configuration; restarting";
        return kExitRetryable;
      }
      job_id_ = response.job_id();
      job_ = response.job();
      start_step_ = response.start_step();
      absl::MutexLock lock(&mu_);
      if (ps_ == nullptr) {
        ps_ = std::make_unique<ps::GrpcClient>(
            std::vector<std::string>(response.ps_address().begin(), response.ps_address().end()));
      }
      reregister_ = false;
      return kExitDone;
    }
    if (!Retryable(last)) {
      PSLOG(ERROR) << "the chief refused registration: " << last.message();
      return kExitPermanent;
    }
    absl::SleepFor(backoff.Next());  // retry backoff towards a chief that is not up yet
  }
  if (const int sig = stop_signal(); sig != 0) return ExitCodeForSignal(sig);
  PSLOG(ERROR) << "chief " << options_.cluster.cluster.chief[0] << " unreachable after "
               << options_.startup_timeout << ": " << last.message();
  return kExitUnreachable;
}

int Worker::Impl::Prepare() {
  if (job_.num_ps() < 1 || job_.num_ps() != ps_->num_ps() || job_.batch_size() < 1 ||
      job_.steps_per_epoch() < 1 || job_.num_workers() <= index_ || job_.placement().num_ps() != job_.num_ps()) {
    PSLOG(ERROR) << "the chief sent an inconsistent job";
    return kExitPermanent;
  }
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(options_.device, job_.compute_threads());
  if (!backend.ok()) {
    PSLOG(ERROR) << backend.status().message();
    return kExitPermanent;
  }
  backend_ = *std::move(backend);
  const InputSpec& in = job_.model().input();
  absl::StatusOr<data::Dataset> data =
      job_.dataset() == "synthetic"
          ? data::MakeSynthetic({in.channels(), in.height(), in.width(), job_.model().num_classes()},
                                job_.num_examples(), data::Split::kTrain)
          : data::LoadMnist(job_.data_dir(), data::Split::kTrain);
  if (!data.ok()) {
    PSLOG(ERROR) << data.status().message();
    return kExitPermanent;
  }
  data_ = *std::move(data);
  if (data_.count != job_.num_examples()) {
    PSLOG(ERROR) << "this worker sees " << data_.count << " training examples in " << job_.data_dir()
                 << ", the chief saw " << job_.num_examples() << ": every process needs the same data";
    return kExitPermanent;
  }
  if (data_.channels != in.channels() || data_.height != in.height() || data_.width != in.width() ||
      data_.num_classes != job_.model().num_classes()) {
    PSLOG(ERROR) << "data in " << job_.data_dir() << " is " << data_.channels << "x" << data_.height << "x"
                 << data_.width << " with " << data_.num_classes << " classes; model " << job_.model().name()
                 << " expects " << in.channels() << "x" << in.height() << "x" << in.width() << " with "
                 << job_.model().num_classes();
    return kExitPermanent;
  }
  absl::StatusOr<std::unique_ptr<model::Network>> net = model::Network::Create(job_.model(), backend_.get());
  if (!net.ok()) {
    PSLOG(ERROR) << net.status().message();
    return kExitPermanent;
  }
  net_ = *std::move(net);
  // Pull into and push from the network's own buffers when they are host
  // memory; otherwise stage on the host.
  weights_ = net_->HostWeights();
  grads_ = net_->HostGradients();
  in_place_ = !weights_.empty();
  if (!in_place_) {
    for (const VariableShape& v : net_->variables()) {
      staging_.emplace_back(NumElements(v.shape));
      weights_.push_back(staging_.back().data());
      staging_.emplace_back(NumElements(v.shape));
      grads_.push_back(staging_.back().data());
    }
  }
  for (int p = 0; p < job_.num_ps(); ++p) slices_.push_back(SlicesOnPs(job_.placement(), p));
  pool_ = std::make_unique<ThreadPool>(std::max(job_.num_ps() - 1, 1));
  PSLOG(INFO) << "joined job: " << data_.count << " training examples, device " << backend_->name()
              << ", " << job_.num_ps() << " ps";
  return kExitDone;
}

absl::Status Worker::Impl::PullAll(int64_t min_version, int64_t* version, int64_t* wait_us) {
  const int n = job_.num_ps();
  std::vector<absl::StatusOr<ps::Client::PullResult>> results(n);
  pool_->ParallelFor(n, [&](int p) {
    std::vector<TensorSink> sinks;
    for (const SliceRef& s : slices_[p]) {
      sinks.push_back({s.name, "", s.slice_shape, weights_[s.variable_index] + s.float_offset, true});
    }
    const absl::Time start = absl::Now();
    absl::Time last_ask = start;
    results[p] = WithRetries([&] {
      absl::StatusOr<ps::Client::PullResult> r;
      do {  // ask again while the other workers are still on the step
        if (stop_signal() != 0) return absl::StatusOr<ps::Client::PullResult>(absl::CancelledError("stopping"));
        last_ask = absl::Now();
        r = ps_->Pull(p, job_id_, min_version, sinks, last_ask + kPullWait + kTransferTimeout, kPullWait);
      } while (r.ok() && r->version < min_version);
      return r;
    });
    // Time spent on "not yet" answers is waiting too.
    if (results[p].ok()) results[p]->wait_us += Micros(last_ask - start);
  });
  *version = -1;
  *wait_us = 0;
  int64_t newest = -1;
  for (int p = 0; p < n; ++p) {
    if (!results[p].ok()) return results[p].status();
    *version = *version < 0 ? results[p]->version : std::min(*version, results[p]->version);
    newest = std::max(newest, results[p]->version);
    *wait_us = std::max(*wait_us, results[p]->wait_us);
  }
  // One step apart: a worker died between its pushes of the last step to
  // different ps (some applied it, the others still wait for its push). Do
  // the older step: the ps past it answer STALE, the others get their push.
  if (newest - *version > 1) {
    return absl::AbortedError(absl::StrCat("ps disagree on the version: ", *version, " and ", newest));
  }
  return absl::OkStatus();
}

absl::Status Worker::Impl::PushAll(int64_t step) {
  const int n = job_.num_ps();
  std::vector<absl::Status> results(n);
  pool_->ParallelFor(n, [&](int p) {
    PushHeader header;
    header.set_job_id(job_id_);
    header.set_worker(index_);
    header.set_step(step);
    std::vector<TensorRef> grads;
    for (const SliceRef& s : slices_[p]) {
      grads.push_back({s.name, "", s.slice_shape, grads_[s.variable_index] + s.float_offset});
    }
    // A retried push that had arrived after all is answered DUPLICATE (or
    // STALE once applied): either way the ps has this worker's gradients.
    results[p] = WithRetries([&] {
      return ps_->Push(p, header, grads, absl::Now() + kTransferTimeout);
    }).status();
  });
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void Worker::Impl::ReportLoop() {
  absl::Time last_ok = absl::Now();
  while (true) {
    ReportRequest request;
    request.set_job_id(job_id_);
    request.set_worker(index_);
    {
      absl::MutexLock lock(&mu_);
      if (released_ || job_failed_ || stop_signal_ != 0 || report_error_ != 0 || training_failed_) return;
      // Wake early once the last step is done, so the exit order arrives promptly.
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return finished_ || nonfinite_ || stop_signal_ != 0;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), kReportEvery);
      for (StepMetrics& m : pending_) *request.add_metrics() = std::move(m);
      pending_.clear();
      request.set_finished(finished_);
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    ReportResponse response;
    absl::Status s = FromGrpcStatus(chief_->Report(&context, request, &response));
    absl::MutexLock lock(&mu_);
    if (s.ok()) {
      last_ok = absl::Now();
      if (response.action() == ReportResponse::EXIT) released_ = true;
      if (response.action() == ReportResponse::REGISTER) reregister_ = true;
      if (response.action() == ReportResponse::FAIL) {
        job_failed_ = true;
        if (ps_ != nullptr) ps_->CancelAll();  // a pull waiting for the failed step ends now
      }
      continue;
    }
    // Metrics of a failed report are dropped: the log is best effort.
    if (stop_signal_ != 0) return;
    if (!Retryable(s) || absl::Now() - last_ok > options_.startup_timeout) {
      PSLOG(ERROR) << "cannot report to the chief: " << s.message();
      report_error_ = Retryable(s) ? kExitUnreachable : kExitRetryable;
    }
  }
}

int Worker::Impl::Train(int64_t start) {
  data::ShardSampler sampler(data_.count, job_.num_workers(), index_, job_.seed());
  const int batch = job_.batch_size();
  const int64_t example = data_.example_floats();
  std::vector<float> images(static_cast<size_t>(batch) * example);
  std::vector<int32_t> labels(batch);
  std::vector<int64_t> order;
  int64_t order_epoch = -1;
  const std::vector<const float*> weight_ptrs(weights_.begin(), weights_.end());

  int64_t step = start;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (job_failed_) return kExitPermanent;
      if (reregister_) return kRegisterAgain;
    }
    if (const int sig = stop_signal(); sig != 0) return ExitCodeForSignal(sig);
    const absl::Time t0 = absl::Now();
    int64_t version = 0, wait_us = 0;
    absl::Status s = PullAll(step, &version, &wait_us);
    if (const int sig = stop_signal(); sig != 0) return ExitCodeForSignal(sig);
    {
      absl::MutexLock lock(&mu_);
      if (job_failed_) return kExitPermanent;
    }
    if (JobChanged(s)) return kRegisterAgain;
    if (!s.ok()) {
      PSLOG(ERROR) << "pull failed: " << s.message();
      return Retryable(s) ? kExitUnreachable : kExitRetryable;
    }
    const absl::Time t1 = absl::Now();
    if (version >= job_.train_steps()) break;
    step = version;
    const int64_t epoch = step / job_.steps_per_epoch();
    const int64_t position = step % job_.steps_per_epoch();
    if (epoch != order_epoch) {
      order = sampler.EpochIndices(epoch);
      order_epoch = epoch;
    }
    s = data::GatherBatch(data_, absl::MakeConstSpan(order).subspan(position * batch, batch), images.data(),
                          labels.data());
    if (s.ok() && !in_place_) s = net_->SetWeights(weight_ptrs);
    absl::StatusOr<model::Network::Result> result =
        s.ok() ? net_->TrainStep(images.data(), labels.data(), batch) : s;
    if (result.ok() && !in_place_) s = net_->GetGradients(grads_);
    if (!result.ok() || !s.ok()) {
      PSLOG(ERROR) << "step " << step << " failed: " << (result.ok() ? s : result.status()).message();
      return kExitRetryable;
    }
    const absl::Time t2 = absl::Now();
    bool finite = std::isfinite(result->loss);
    for (size_t i = 0; finite && i < grads_.size(); ++i) {
      finite = AllFinite(grads_[i], NumElements(net_->variables()[i].shape));
    }
    if (!finite) {
      // Nothing of this step is pushed; the chief decides what happens next.
      PSLOG(ERROR) << "step " << step << ": the loss (" << result->loss
                   << ") or the gradients are not finite; nothing pushed";
      StepMetrics m;
      m.set_step(step);
      m.set_examples(batch);
      m.set_nonfinite(true);
      absl::MutexLock lock(&mu_);
      pending_.push_back(std::move(m));
      nonfinite_ = true;
      return kNonFinite;
    }
    s = PushAll(step);
    if (const int sig = stop_signal(); sig != 0) return ExitCodeForSignal(sig);
    if (JobChanged(s)) return kRegisterAgain;
    if (!s.ok()) {
      PSLOG(ERROR) << "push failed: " << s.message();
      return Retryable(s) ? kExitUnreachable : kExitRetryable;
    }
    const absl::Time t3 = absl::Now();
    StepMetrics m;
    m.set_step(step);
    m.set_loss(result->loss);
    m.set_correct(result->correct);
    m.set_examples(batch);
    m.set_wait_us(wait_us);
    m.set_pull_us(std::max<int64_t>(Micros(t1 - t0) - wait_us, 0));
    m.set_compute_us(Micros(t2 - t1));
    m.set_push_us(Micros(t3 - t2));
    ++step;
    register_backoff_.Reset();
    {
      absl::MutexLock lock(&mu_);
      pending_.push_back(std::move(m));
      step_ = step;
    }
  }
  return kExitDone;
}

int Worker::Impl::Run() {
  // The worker listens on its own address too: the standard gRPC health
  // service answers there, for readiness probes and peers' connectivity checks.
  grpc::EnableDefaultHealthCheckService(true);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartServer(options_.cluster.self_port, this);
  if (!server.ok()) {
    PSLOG(ERROR) << server.status().message();
    return kExitPermanent;
  }
  int code = RunTraining();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return code;
}

int Worker::Impl::RunTraining() {
  int code = Register();
  if (code != kExitDone) return code;
  code = Prepare();
  if (code != kExitDone) return code;
  std::thread reporter([this] { ReportLoop(); });
  while (true) {
    code = Train(start_step_);
    if (code == kNonFinite) {
      // The job's policy is to fail: wait (a little) for the chief to confirm.
      absl::MutexLock lock(&mu_);
      auto told = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return job_failed_ || stop_signal_ != 0 || report_error_ != 0;
      };
      mu_.AwaitWithTimeout(absl::Condition(&told), absl::Seconds(30));
      code = kExitPermanent;
    }
    if (code == kRegisterAgain) {
      PSLOG(INFO) << "the job was reloaded or this worker was dropped; registering again";
      // While the chief reloads the ps, registering again at once just spins.
      absl::SleepFor(register_backoff_.Next());
      code = Register();
      if (code == kExitDone) continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (code != kExitDone) {
        training_failed_ = true;  // ends the report loop
        break;
      }
      finished_ = true;
      PSLOG(INFO) << "reached the last step; waiting for the chief's exit order";
      auto over = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return released_ || job_failed_ || stop_signal_ != 0 || report_error_ != 0 || reregister_;
      };
      mu_.Await(absl::Condition(&over));
      if (released_ || job_failed_) break;
      if (stop_signal_ != 0 || report_error_ != 0) {
        code = stop_signal_ != 0 ? ExitCodeForSignal(stop_signal_) : report_error_;
        break;
      }
      finished_ = false;  // the chief went back to a checkpoint: train on
    }
    code = Register();
    if (code != kExitDone) {
      absl::MutexLock lock(&mu_);
      training_failed_ = true;
      break;
    }
  }
  reporter.join();
  if (code == kExitDone) PSLOG(INFO) << "released by the chief; exiting";
  {
    absl::MutexLock lock(&mu_);
    if (job_failed_) {
      PSLOG(ERROR) << "the chief failed the job; exiting";
      code = kExitPermanent;
    }
  }
  return code;
}

Worker::Worker(WorkerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Worker::~Worker() = default;
int Worker::Run() { return impl_->Run(); }
void Worker::Stop(int signal) { impl_->Stop(signal); }

}  // namespace psflow::worker
