// worker::Trainer against an in-memory ps cluster and chief (tests/fakes):
// the step loop, its retries and re-registrations, and the status it ends
// with, without processes.
#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/float16.h"
#include "common/placement.h"
#include "data/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/spec.h"
#include "ps/local_replica.h"
#include "tests/fakes/fake_chief.h"
#include "tests/fakes/fake_ps.h"
#include "worker/service.h"

namespace psflow::worker {
namespace {

using fakes::FakeChief;
using fakes::FakePs;
using Method = FakePs::Method;
using ::testing::HasSubstr;

// Two dense layers on 6x6 images of 4 classes: a step takes well under a
// millisecond. fc1/weights (16x36 floats) is split over the ps.
constexpr char kTinyModel[] = R"spec(
  name: "tiny" input { channels: 1 height: 6 width: 6 } num_classes: 4
  layer { name: "fc1" dense { units: 16 } }
  layer { name: "relu1" relu {} }
  layer { name: "fc2" dense { units: 4 } }
)spec";

// The same with batch norm on the input: its running statistics follow the
// pixels' mean and variance.
constexpr char kTinyBatchNormModel[] = R"spec(
  name: "tiny_bn" input { channels: 1 height: 6 width: 6 } num_classes: 4
  layer { name: "bn0" batch_norm {} }
  layer { name: "fc1" dense { units: 16 } }
  layer { name: "relu1" relu {} }
  layer { name: "fc2" dense { units: 4 } }
)spec";

constexpr uint64_t kJobId = 1;

struct JobParams {
  int num_ps = 2;
  int num_workers = 1;
  int64_t train_steps = 12;
  float learning_rate = 0.1f;
  JobConfig::WireDtype wire_dtype = JobConfig::FP32;
  JobConfig::NonFinitePolicy on_nonfinite = JobConfig::FAIL;
  const char* model = kTinyModel;
  float bn_momentum = 0;                     // 0: the ps's default
  int replicas_per_worker = 0;               // 0: unset (one)
  int64_t slice_bytes = kDefaultSliceBytes;  // PlaceVariables'
};

// A job as the chief would make it: synthetic data, 256 examples, batch 8.
JobConfig MakeJob(const JobParams& p) {
  JobConfig job;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(p.model, job.mutable_model()));
  job.mutable_data()->set_format("synthetic");
  job.set_num_examples(256);
  job.set_batch_size(8);
  job.set_steps_per_epoch((256 + p.num_workers - 1) / p.num_workers / 8);
  job.set_train_steps(p.train_steps);
  job.set_seed(7);
  job.set_num_workers(p.num_workers);
  job.set_num_ps(p.num_ps);
  job.set_compute_threads(1);
  job.mutable_optimizer()->set_kind(OptimizerConfig::SGD);
  job.mutable_optimizer()->set_learning_rate(p.learning_rate);
  job.set_on_nonfinite(p.on_nonfinite);
  job.set_wire_dtype(p.wire_dtype);
  job.set_bn_momentum(p.bn_momentum);
  job.set_replicas_per_worker(p.replicas_per_worker);
  absl::StatusOr<Placement> placement = PlaceVariables(model::ModelVariables(job.model()), p.num_ps,
                                                       /*split_bytes=*/1024, p.slice_bytes);
  EXPECT_TRUE(placement.ok()) << placement.status();
  if (placement.ok()) *job.mutable_placement() = *placement;
  return job;
}

RegisterWorkerResponse Registration(const JobConfig& job, uint64_t job_id = kJobId,
                                    int64_t start_step = 0) {
  RegisterWorkerResponse r;
  r.set_job_id(job_id);
  *r.mutable_job() = job;
  for (int p = 0; p < job.num_ps(); ++p) r.add_ps_address("ps" + std::to_string(p) + ":2222");
  r.set_start_step(start_step);
  return r;
}

// Loads every ps with `values` (by variable) at `version`, as the chief does.
absl::Status LoadPs(ps::Client& ps, const JobConfig& job, uint64_t job_id, int64_t version,
                    const std::vector<std::vector<float>>& values) {
  std::vector<const float*> buffers;
  for (const std::vector<float>& v : values) buffers.push_back(v.data());
  for (int p = 0; p < job.num_ps(); ++p) {
    InitHeader header;
    header.set_job_id(job_id);
    header.set_ps_index(p);
    *header.mutable_job() = job;
    header.set_version(version);
    for (int w = 0; w < job.num_workers(); ++w) header.add_live_workers(w);
    for (SliceSpec& s : SliceSpecs(job.placement(), p)) *header.add_slice() = std::move(s);
    absl::Status s =
        ps.Init(p, header, SliceRefs(job.placement(), p, buffers), absl::Now() + absl::Seconds(5));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::vector<float>> InitialValues(const JobConfig& job) {
  return model::InitialValues(job.model(), job.seed());
}

// The values every ps holds now, by variable.
std::vector<std::vector<float>> ReadWeights(ps::Client& ps, const JobConfig& job, uint64_t job_id) {
  std::vector<std::vector<float>> values;
  std::vector<float*> buffers;
  for (const VariableShape& v : model::ModelVariables(job.model()))
    values.emplace_back(NumElements(v.shape));
  for (std::vector<float>& v : values) buffers.push_back(v.data());
  for (int p = 0; p < job.num_ps(); ++p) {
    absl::StatusOr<ps::Client::PullResult> r =
        ps.Pull(p, job_id, 0, {}, SliceSinks(job.placement(), p, buffers),
                absl::Now() + absl::Seconds(5), absl::ZeroDuration());
    EXPECT_TRUE(r.ok()) << r.status();
  }
  return values;
}

// Short waits and timeouts, so that every test takes well under a second.
TrainerOptions FastOptions(int worker = 0) {
  TrainerOptions o;
  o.worker_index = worker;
  o.startup_timeout = absl::Seconds(2);
  o.register_timeout = absl::Milliseconds(500);
  o.pull_wait = absl::Milliseconds(20);
  o.transfer_timeout = absl::Seconds(2);
  o.report_every = absl::Milliseconds(5);
  o.report_timeout = absl::Seconds(1);
  o.nonfinite_wait = absl::Seconds(1);
  return o;
}

// Makes the trainer's ps client: another client of `fake`.
PsClientFactory ClientOf(FakePs& fake) {
  return [&fake](const std::vector<std::string>& addresses) {
    EXPECT_EQ(static_cast<int>(addresses.size()), fake.num_ps());
    return fake.NewClient();
  };
}

// Trainer::Run on a thread of its own.
class Running {
 public:
  explicit Running(Trainer* trainer)
      : thread_([this, trainer] {
          status_ = trainer->Run();
          done_.Notify();
        }) {}
  ~Running() {
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_.HasBeenNotified(); }
  bool WaitFor(absl::Duration timeout) { return done_.WaitForNotificationWithTimeout(timeout); }
  absl::Status Join() {
    thread_.join();
    return status_;
  }

 private:
  absl::Status status_;
  absl::Notification done_;
  std::thread thread_;
};

std::vector<int64_t> Steps(const std::vector<StepMetrics>& metrics) {
  std::vector<int64_t> steps;
  for (const StepMetrics& m : metrics) steps.push_back(m.step());
  return steps;
}

std::vector<int64_t> Range(int64_t begin, int64_t end) {
  std::vector<int64_t> r;
  for (int64_t i = begin; i < end; ++i) r.push_back(i);
  return r;
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUpJob(const JobParams& params) {
    job_ = MakeJob(params);
    fake_ = std::make_unique<FakePs>(params.num_ps);
    chief_ = std::make_unique<FakeChief>(Registration(job_));
    initial_ = InitialValues(job_);
    ASSERT_TRUE(LoadPs(*fake_, job_, kJobId, 0, initial_).ok());
  }
  void ExpectRetriedThrough(absl::StatusCode pull_code, absl::StatusCode push_code, int failures);
  // Worker 0 of a two-worker job, waiting in its pull for worker 1 (which
  // never comes), is stopped by `stop`: it ends with SIGTERM (exit 143)
  // within 300 ms.
  void ExpectStoppedWhilePulling(const std::function<void(Trainer&)>& stop) {
    SetUpJob({.num_workers = 2});
    TrainerOptions options = FastOptions();
    options.pull_wait = absl::Seconds(5);  // the ps would hold the pull that long
    Trainer trainer(options, chief_.get(), ClientOf(*fake_));
    Running run(&trainer);
    ASSERT_TRUE(chief_->AwaitMetrics([](const std::vector<StepMetrics>& m) { return !m.empty(); },
                                     absl::Seconds(5)));
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_FALSE(run.done());
    const absl::Time stopped = absl::Now();
    stop(trainer);
    ASSERT_TRUE(run.WaitFor(absl::Seconds(5)));
    EXPECT_LT(absl::Now() - stopped, absl::Milliseconds(300));
    const absl::Status status = run.Join();
    EXPECT_EQ(SignalOf(status), SIGTERM) << status;
    EXPECT_EQ(ExitCodeFor(status), 128 + SIGTERM);
  }
  // Runs workers 0 and 1 of the job to its end with up to `lanes` lanes per
  // ps (as many as slices), pushing during the backward pass or after the
  // step: both end OK, and every ps applied each of the job's steps once.
  void RunTwoWorkers(int lanes, bool push_during_backward, int64_t min_run_bytes = 0) {
    TrainerOptions o0 = FastOptions(0), o1 = FastOptions(1);
    for (TrainerOptions* o : {&o0, &o1}) {
      o->lanes_per_ps = lanes;
      o->lane_bytes = 1;  // as many lanes as slices, up to lanes_per_ps
      o->push_during_backward = push_during_backward;
      o->min_run_bytes = min_run_bytes;
    }
    Trainer first(o0, chief_.get(), ClientOf(*fake_));
    Trainer second(o1, chief_.get(), ClientOf(*fake_));
    Running run0(&first), run1(&second);
    const absl::Status s0 = run0.Join(), s1 = run1.Join();
    ASSERT_TRUE(s0.ok()) << s0;
    ASSERT_TRUE(s1.ok()) << s1;
    for (int p = 0; p < job_.num_ps(); ++p) {
      EXPECT_EQ(fake_->stats(p).applied, job_.train_steps()) << "ps " << p;
      EXPECT_EQ(fake_->stats(p).stale + fake_->stats(p).duplicate, 0) << "ps " << p;
    }
  }

  JobConfig job_;
  std::unique_ptr<FakePs> fake_;
  std::unique_ptr<FakeChief> chief_;
  std::vector<std::vector<float>> initial_;
};

TEST_F(TrainerTest, TrainsToTheEndAndExitsWhenTheChiefSaysSo) {
  SetUpJob({});
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(ExitCodeFor(status), kExitDone);

  // Every step once, in order, finite, reported under this worker and job.
  const std::vector<StepMetrics> metrics = chief_->metrics();
  EXPECT_EQ(Steps(metrics), Range(0, 12));
  for (const StepMetrics& m : metrics) {
    EXPECT_TRUE(std::isfinite(m.loss()));
    EXPECT_FALSE(m.nonfinite());
    EXPECT_EQ(m.examples(), 8);
  }
  const std::vector<ReportRequest> reports = chief_->reports();
  ASSERT_FALSE(reports.empty());
  for (const ReportRequest& r : reports) {
    EXPECT_EQ(r.job_id(), kJobId);
    EXPECT_EQ(r.worker(), 0);
  }
  EXPECT_TRUE(reports.back().finished());
  EXPECT_EQ(chief_->registrations(), 1);

  // Each ps applied every step once: one push per step, a pull per step
  // and the one that found the last version.
  for (int p = 0; p < 2; ++p) {
    const ps::Shard::Stats stats = fake_->stats(p);
    EXPECT_EQ(stats.version, 12) << "ps " << p;
    EXPECT_EQ(stats.applied, 12) << "ps " << p;
    EXPECT_EQ(stats.stale + stats.duplicate, 0) << "ps " << p;
    EXPECT_EQ(fake_->calls(p, Method::kPush), 12) << "ps " << p;
    EXPECT_EQ(fake_->calls(p, Method::kPull), 13) << "ps " << p;
  }
  // The weights moved, and the loss went down.
  EXPECT_NE(ReadWeights(*fake_, job_, kJobId), initial_);
  double first = 0, last = 0;
  for (int i = 0; i < 4; ++i) {
    first += metrics[i].loss();
    last += metrics[metrics.size() - 1 - i].loss();
  }
  EXPECT_LT(last, first);

  // What the status service tells.
  const TrainerStatus s = trainer.Status();
  EXPECT_EQ(s.worker, 0);
  EXPECT_EQ(s.job_id, kJobId);
  EXPECT_EQ(s.step, 12);
  EXPECT_TRUE(s.finished);
  StatusService service(&trainer);
  WorkerStatusRequest request;
  WorkerStatus response;
  ASSERT_TRUE(service.GetStatus(nullptr, &request, &response).ok());
  EXPECT_EQ(response.job_id(), kJobId);
  EXPECT_EQ(response.step(), 12);
  EXPECT_TRUE(response.finished());
}

// Two workers whose slices travel in several lanes per ps (one slice each)
// end with the same weights, bit for bit, as with one lane per ps: pushes
// split and applied slice by slice change nothing of synchronous training.
// Nor do pushes during the backward pass (each lane's as soon as its
// gradients are final), against pushes after the step.
TEST_F(TrainerTest, LanesGiveTheSameWeightsAsOneStreamPerPs) {
  std::vector<std::vector<float>> weights[4];
  for (int run = 0; run < 4; ++run) {
    const int lanes = run % 2 == 0 ? 1 : 4;
    const bool early = run >= 2;
    SCOPED_TRACE(absl::StrCat(lanes, " lanes per ps, pushing during backward: ", early));
    SetUpJob({.num_workers = 2, .train_steps = 10});
    ASSERT_NO_FATAL_FAILURE(RunTwoWorkers(lanes, early));
    // Each worker pushed every step once per lane of ps 0 (cut in the order
    // of the backward pass, the lanes differ: more than one per ps here).
    const int lanes_on_ps0 =
        std::min(lanes, static_cast<int>(SlicesOnPs(job_.placement(), 0).size()));
    if (!early || lanes == 1) {
      EXPECT_EQ(fake_->calls(0, Method::kPush), 2 * 10 * lanes_on_ps0);
    } else {
      EXPECT_GT(fake_->calls(0, Method::kPush) + fake_->calls(1, Method::kPush), 2 * 10 * 2)
          << fake_->calls(1, Method::kPush);
    }
    weights[run] = ReadWeights(*fake_, job_, kJobId);
  }
  EXPECT_NE(weights[0], initial_);
  for (int run = 1; run < 4; ++run) EXPECT_EQ(weights[0], weights[run]) << "run " << run;
}

// Pushing during the backward pass on a CPU, a run goes on to the next
// variable's while it holds fewer than min_run_bytes: the tiny model's four
// variables on one ps complete in the order fc2/weights (256 bytes),
// fc2/bias (16), fc1/weights (2,304), fc1/bias (64), and travel in four runs
// a push with 0; in three with 272 (fc2's two make 272 and end a run, then
// fc1's weights end one); in two with 273 (fc2's two and fc1's weights,
// then fc1's bias); in one with more than they hold. The fake reads each
// run as soon as its wait returns, as the real client does, so a run that
// left before the backward pass had completed it would push other values:
// the weights come out the same, bit for bit.
TEST_F(TrainerTest, SmallRunsTravelWithTheNextOnesAndGiveTheSameWeights) {
  const int64_t min_bytes[] = {0, 272, 273, 1 << 20};
  const int64_t runs_per_push[] = {4, 3, 2, 1};
  std::vector<std::vector<float>> weights[4];
  for (int run = 0; run < 4; ++run) {
    SCOPED_TRACE(absl::StrCat("min_run_bytes ", min_bytes[run]));
    SetUpJob({.num_ps = 1, .num_workers = 2, .train_steps = 10});
    ASSERT_NO_FATAL_FAILURE(RunTwoWorkers(1, /*push_during_backward=*/true, min_bytes[run]));
    EXPECT_EQ(fake_->calls(0, Method::kPush), 2 * 10);
    EXPECT_EQ(fake_->runs(0), 2 * 10 * runs_per_push[run]);
    weights[run] = ReadWeights(*fake_, job_, kJobId);
  }
  EXPECT_NE(weights[0], initial_);
  for (int run = 1; run < 4; ++run) EXPECT_EQ(weights[0], weights[run]) << "run " << run;
}

// A variable cut into several slices per ps (each ps holds five of
// fc1/weights' ten, told apart by their first row) trains to the same
// weights, bit for bit, as with one slice per ps: with one lane per ps and
// with a lane per slice, pushing during the backward pass.
TEST_F(TrainerTest, SeveralSlicesOfAVariableOnAPsGiveTheSameWeights) {
  std::vector<std::vector<float>> weights[3];
  for (int run = 0; run < 3; ++run) {
    const int64_t slice_bytes = run == 0 ? 0 : 256;
    const int lanes = run == 2 ? 8 : 1;
    SCOPED_TRACE(absl::StrCat("slice_bytes ", slice_bytes, ", ", lanes, " lanes per ps"));
    SetUpJob({.num_workers = 2, .train_steps = 10, .slice_bytes = slice_bytes});
    const std::vector<SliceRef> on_ps0 = SlicesOnPs(job_.placement(), 0);
    const int64_t fc1_on_ps0 = std::count_if(
        on_ps0.begin(), on_ps0.end(), [](const SliceRef& s) { return s.name == "fc1/weights"; });
    EXPECT_EQ(fc1_on_ps0, run == 0 ? 1 : 5);
    ASSERT_NO_FATAL_FAILURE(RunTwoWorkers(lanes, /*push_during_backward=*/true));
    weights[run] = ReadWeights(*fake_, job_, kJobId);
  }
  EXPECT_NE(weights[0], initial_);
  for (int run = 1; run < 3; ++run) EXPECT_EQ(weights[0], weights[run]) << "run " << run;
}

// Batch norm's running statistics: each step both workers push their batch's
// mean and unbiased variance in place of the statistics' gradients, and the
// ps average them in (momentum 0.3 here), so a short run takes the running
// statistics of a batch norm on the input from (0, 1) to the mean and
// variance of the training pixels; gamma and beta train as ever.
TEST_F(TrainerTest, RunningStatisticsMoveTowardsTheDatas) {
  SetUpJob(
      {.num_workers = 2, .train_steps = 24, .model = kTinyBatchNormModel, .bn_momentum = 0.3f});
  Trainer first(FastOptions(0), chief_.get(), ClientOf(*fake_));
  Trainer second(FastOptions(1), chief_.get(), ClientOf(*fake_));
  Running run0(&first), run1(&second);
  const absl::Status s0 = run0.Join(), s1 = run1.Join();
  ASSERT_TRUE(s0.ok()) << s0;
  ASSERT_TRUE(s1.ok()) << s1;

  const std::vector<VariableShape> vars = model::ModelVariables(job_.model());
  ASSERT_EQ(vars.size(), 8u);
  ASSERT_EQ(vars[2].name, "bn0/running_mean");
  ASSERT_EQ(vars[3].name, "bn0/running_var");
  const std::vector<std::vector<float>> initial = InitialValues(job_);
  EXPECT_EQ(initial[2], std::vector<float>{0.0f});
  EXPECT_EQ(initial[3], std::vector<float>{1.0f});
  const std::vector<std::vector<float>> w = ReadWeights(*fake_, job_, kJobId);
  EXPECT_NE(w[0], initial[0]) << "gamma trains";

  absl::StatusOr<data::Dataset> d =
      data::MakeSynthetic(data::SyntheticShape{1, 6, 6, 4}, 256, data::Split::kTrain);
  ASSERT_TRUE(d.ok()) << d.status();
  double sum = 0, sum_sq = 0;
  for (float p : d->images) {
    sum += p;
    sum_sq += double{p} * p;
  }
  const double n = static_cast<double>(d->images.size());
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  ASSERT_GT(mean, 0.1);
  ASSERT_LT(var, 0.5);
  // Far from the start, close to the data (each batch's statistics vary with
  // its examples, so not exactly).
  EXPECT_NEAR(w[2][0], mean, 0.05 * mean) << "running mean";
  EXPECT_NEAR(w[3][0], var, 0.1 * var) << "running variance";
}

// Pulls and pushes in bf16 (the fake ps refuses a push in any other dtype):
// training goes as in fp32, close but not equal, and the ps keep fp32 masters.
TEST_F(TrainerTest, TrainsWithBfloat16OnTheWire) {
  std::vector<std::vector<float>> fp32_weights;
  {
    SetUpJob({});
    Trainer fp32(FastOptions(), chief_.get(), ClientOf(*fake_));
    ASSERT_TRUE(fp32.Run().ok());
    fp32_weights = ReadWeights(*fake_, job_, kJobId);
  }

  SetUpJob({.wire_dtype = JobConfig::BF16});
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  const std::vector<StepMetrics> metrics = chief_->metrics();
  EXPECT_EQ(Steps(metrics), Range(0, 12));
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->stats(p).applied, 12) << "ps " << p;
    EXPECT_EQ(fake_->calls(p, Method::kPush), 12) << "ps " << p;
  }
  double first = 0, last = 0;
  for (int i = 0; i < 4; ++i) {
    first += metrics[i].loss();
    last += metrics[metrics.size() - 1 - i].loss();
  }
  EXPECT_LT(last, first);

  const std::vector<std::vector<float>> weights = ReadWeights(*fake_, job_, kJobId);
  ASSERT_EQ(weights.size(), fp32_weights.size());
  bool differs = false, beyond_bf16 = false;
  for (size_t v = 0; v < weights.size(); ++v) {
    for (size_t i = 0; i < weights[v].size(); ++i) {
      const float w = weights[v][i];
      differs |= w != fp32_weights[v][i];
      beyond_bf16 |= Bfloat16ToFloat(FloatToBfloat16(w)) != w;
      ASSERT_NEAR(w, fp32_weights[v][i], 0.02f) << "variable " << v << " [" << i << "]";
    }
  }
  EXPECT_TRUE(differs) << "the weights and gradients went through bf16";
  EXPECT_TRUE(beyond_bf16) << "the masters are fp32";
}

// A gradient fp16 cannot hold (65520 and more) would reach the ps as an
// infinity: the step is not finite, and not completed on every ps. Pushing
// after the step, nothing is pushed; pushing during the backward pass, the
// lanes whose gradients fp16 holds may have pushed them (a ps that got all
// of its slices applies them), the others not.
TEST_F(TrainerTest, AGradientBeyondFp16sRangeIsANonFiniteStep) {
  for (int run = 0; run < 3; ++run) {
    const JobConfig::WireDtype wire = run == 0 ? JobConfig::FP32 : JobConfig::FP16;
    const bool early = run == 2;
    SCOPED_TRACE(
        absl::StrCat(JobConfig::WireDtype_Name(wire), ", pushing during backward: ", early));
    SetUpJob({.wire_dtype = wire});
    chief_->FailOnNonFinite(false);
    // fc1's weights at 60000 (fp16 holds that): hidden units of about 60000
    // times the pixel sum, so fc2's gradients reach far past 65520 while the
    // loss stays finite.
    std::vector<std::vector<float>> values = initial_;
    std::fill(values[0].begin(), values[0].end(), 60000.0f);
    ASSERT_TRUE(LoadPs(*fake_, job_, kJobId, 0, values).ok());
    TrainerOptions options = FastOptions();
    options.nonfinite_wait = absl::Milliseconds(50);
    options.push_during_backward = early;
    options.lanes_per_ps = 4;
    options.lane_bytes = 1;
    Trainer trainer(options, chief_.get(), ClientOf(*fake_));
    const absl::Status status = trainer.Run();
    if (wire == JobConfig::FP32) {
      // The control: in fp32 the same step is finite and pushed.
      EXPECT_TRUE(status.ok()) << status;
      EXPECT_GT(fake_->calls(0, Method::kPush), 0);
    } else {
      // (A push of an infinity would have been refused: another error.)
      EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
      EXPECT_THAT(status.message(), HasSubstr("not finite"));
      const int pushes = fake_->calls(0, Method::kPush) + fake_->calls(1, Method::kPush);
      if (early) {
        EXPECT_LT(pushes, static_cast<int>(SlicesOnPs(job_.placement(), 0).size() +
                                           SlicesOnPs(job_.placement(), 1).size()));
      } else {
        EXPECT_EQ(pushes, 0);
      }
      // A ps that got every slice (all finite) applies the step; not both.
      EXPECT_EQ(std::min(fake_->stats(0).version, fake_->stats(1).version), 0);
      if (!early) {
        for (int p = 0; p < 2; ++p) EXPECT_EQ(fake_->stats(p).version, 0) << "ps " << p;
      }
    }
  }
}

TEST_F(TrainerTest, WaitsForTheExitOrderAfterTheLastStep) {
  SetUpJob({.train_steps = 4});
  chief_->ExitWhenFinished(false);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  Running run(&trainer);
  // Finished, it reports so (heartbeats) and waits for the chief.
  ASSERT_TRUE(chief_->AwaitMetrics([](const std::vector<StepMetrics>& m) { return m.size() == 4; },
                                   absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(run.done());
  EXPECT_TRUE(trainer.Status().finished);
  const std::vector<ReportRequest> reports = chief_->reports();
  ASSERT_FALSE(reports.empty());
  EXPECT_TRUE(reports.back().finished());
  chief_->SetAction(ReportResponse::EXIT);
  const absl::Status status = run.Join();
  EXPECT_TRUE(status.ok()) << status;
}

// The first `failures` pulls of ps 0 fail with `pull_code`; later the third
// push to ps 1 and its first `failures - 1` retries fail with `push_code`.
// The trainer retries in place and trains to the end.
void TrainerTest::ExpectRetriedThrough(absl::StatusCode pull_code, absl::StatusCode push_code,
                                       int failures) {
  SetUpJob({});
  fake_->FailNext(0, pull_code, failures);
  FakePs* fake = fake_.get();
  fake_->OnCall([fake, push_code, failures](int ps, Method method) {
    if (ps == 1 && method == Method::kPush && fake->calls(1, Method::kPush) == 3) {
      fake->FailNext(1, push_code, failures);
    }
  });
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(fake_->calls(0, Method::kPull), 13 + failures);
  EXPECT_EQ(fake_->calls(1, Method::kPush), 12 + failures);
  EXPECT_EQ(fake_->calls(1, Method::kPull), 13);
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->stats(p).version, 12);
    EXPECT_EQ(fake_->stats(p).duplicate, 0);
  }
  EXPECT_EQ(Steps(chief_->metrics()), Range(0, 12));
  EXPECT_EQ(chief_->registrations(), 1);  // retried in place, not registered again
}

TEST_F(TrainerTest, RetriesPullsAndPushesThroughUnavailable) {
  ExpectRetriedThrough(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded, 2);
}

// A ps that is shutting down cancels the calls it serves: for the worker that
// is a ps going away (retried), not a failure of its own.
TEST_F(TrainerTest, RetriesCallsThePsCancelled) {
  ExpectRetriedThrough(absl::StatusCode::kCancelled, absl::StatusCode::kCancelled, 1);
}

TEST_F(TrainerTest, AsksAgainWhileThePsIsBehind) {
  SetUpJob({.num_workers = 2, .train_steps = 6});
  Trainer first(FastOptions(0), chief_.get(), ClientOf(*fake_));
  Trainer second(FastOptions(1), chief_.get(), ClientOf(*fake_));
  Running run0(&first);
  // Worker 0 did step 0 alone; step 1 needs worker 1's push of step 0 too:
  // its pulls of version 1 get "not yet" (after 20 ms each) and ask again.
  ASSERT_TRUE(chief_->AwaitMetrics([](const std::vector<StepMetrics>& m) { return !m.empty(); },
                                   absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(fake_->stats(0).version, 0);
  EXPECT_GE(fake_->calls(0, Method::kPull), 1 + 4);
  Running run1(&second);
  const absl::Status s0 = run0.Join();
  const absl::Status s1 = run1.Join();
  EXPECT_TRUE(s0.ok()) << s0;
  EXPECT_TRUE(s1.ok()) << s1;
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->stats(p).version, 6);
    EXPECT_EQ(fake_->stats(p).applied, 6);
  }
  // Each worker did every step once; worker 0's time on "not yet" answers
  // counts as waiting for the others.
  std::vector<int64_t> steps[2];
  int64_t wait_us = -1;
  for (const ReportRequest& r : chief_->reports()) {
    for (const StepMetrics& m : r.metrics()) {
      steps[r.worker()].push_back(m.step());
      if (r.worker() == 0 && m.step() == 1) wait_us = m.wait_us();
    }
  }
  EXPECT_EQ(steps[0], Range(0, 6));
  EXPECT_EQ(steps[1], Range(0, 6));
  EXPECT_GE(wait_us, 80'000);
}

TEST_F(TrainerTest, RegistersAgainAfterAPsRestartsEmptyMidStep) {
  SetUpJob({.train_steps = 10});
  // The push of step 3 finds ps 1 restarted empty.
  FakePs* fake = fake_.get();
  fake_->OnCall([fake](int ps, Method method) {
    if (ps == 1 && method == Method::kPush && fake->calls(1, Method::kPush) == 4) fake->Restart(1);
  });
  // The chief reloads every ps from its checkpoint of step 3 under a new job
  // id before it lets the worker in again.
  FakeChief* chief = chief_.get();
  const JobConfig job = job_;
  const std::vector<std::vector<float>> initial = initial_;
  absl::Status reload;
  chief_->OnRegister([&, chief, fake](int) {
    if (chief->registrations() != 1) return;
    reload = LoadPs(*fake, job, 2, 3, initial);
    chief->SetRegistration(Registration(job, 2, 3));
  });
  // Readiness: registered, then not while registering again, then again.
  std::vector<bool> registered;  // Run's thread only
  TrainerOptions options = FastOptions();
  options.on_registered = [&registered](bool r) { registered.push_back(r); };
  Trainer trainer(options, chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(registered, (std::vector<bool>{true, false, true, false}));  // false: Run returned
  EXPECT_TRUE(reload.ok()) << reload;
  EXPECT_EQ(chief_->registrations(), 2);
  EXPECT_EQ(Steps(chief_->metrics()), Range(0, 10));  // step 3 counted once, after the reload
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->stats(p).version, 10);
    EXPECT_EQ(fake_->stats(p).applied, 7);  // steps 3..9 of the reloaded job
    EXPECT_EQ(fake_->calls(p, Method::kInit), 2);
  }
  EXPECT_EQ(chief_->reports().back().job_id(), 2u);
  EXPECT_EQ(trainer.Status().job_id, 2u);
}

TEST_F(TrainerTest, RegistersAgainWhenTheChiefSaysSo) {
  SetUpJob({});
  chief_->SetAction(ReportResponse::REGISTER, 1);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  // Once more at least (a report in flight as it registers may be answered
  // REGISTER too).
  EXPECT_GE(chief_->registrations(), 2);
  // It trained on from where the ps were: no step twice.
  EXPECT_EQ(Steps(chief_->metrics()), Range(0, 12));
  EXPECT_EQ(fake_->stats(0).version, 12);
}

TEST_F(TrainerTest, AnotherJobConfigurationAtRegistrationEndsWorthARetry) {
  SetUpJob({});
  JobConfig other = job_;
  other.set_train_steps(13);
  FakeChief* chief = chief_.get();
  chief_->OnRegister([chief, other](int) {
    if (chief->registrations() == 1) chief->SetRegistration(Registration(other));
  });
  chief_->SetAction(ReportResponse::REGISTER, 1);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitRetryable) << status;
  EXPECT_THAT(status.message(), HasSubstr("another job configuration"));
}

// Today's exit codes: a ps that refuses a call for good (other than "not
// this job", which means register again) ends the worker with 140, worth a
// restart, not 1: the call names no configuration of this worker.
TEST_F(TrainerTest, ANonRetryablePsErrorEndsTheRunWithoutRetrying) {
  SetUpJob({});
  fake_->FailNext(1, absl::StatusCode::kInvalidArgument, 1);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitRetryable) << status;
  EXPECT_THAT(status.message(), HasSubstr("ps 1"));
  EXPECT_THAT(status.message(), HasSubstr("INVALID_ARGUMENT"));
  EXPECT_EQ(fake_->calls(1, Method::kPull), 1);  // not tried again
  EXPECT_EQ(chief_->registrations(), 1);         // nor taken for a reloaded job
  EXPECT_EQ(fake_->stats(0).version, 0);
}

TEST_F(TrainerTest, APsThatStaysDownEndsTheRunAsUnreachable) {
  SetUpJob({});
  fake_->SetDown(0, true);
  TrainerOptions options = FastOptions();
  options.startup_timeout = absl::Milliseconds(300);
  Trainer trainer(options, chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitUnreachable) << status;
  EXPECT_THAT(status.message(), HasSubstr("ps 0"));
  EXPECT_GE(fake_->calls(0, Method::kPull), 3);  // tried again with backoff
}

TEST_F(TrainerTest, StopEndsAPullWaitingForTheOtherWorkers) {
  ExpectStoppedWhilePulling([](Trainer& trainer) {
    trainer.Stop(SIGTERM);
    trainer.Stop(SIGINT);  // the first signal wins
  });
}

// A worker told to stop with the cluster stops once its step's pushes are
// answered: at once when they are (it waits for the other workers' pushes),
// after them when they are in flight, and after max_wait without them.
TEST_F(TrainerTest, StopAfterPushesStopsAtOnceOnceTheStepIsPushed) {
  ExpectStoppedWhilePulling(
      [](Trainer& trainer) { trainer.StopAfterPushes(SIGTERM, absl::Seconds(5)); });
}

TEST_F(TrainerTest, StopAfterPushesWaitsForThePushInFlight) {
  SetUpJob({.num_ps = 1});
  absl::Notification pushing, release;
  std::atomic<int> held{0};
  fake_->OnCall([&](int, Method m) {
    if (m != Method::kPush || held.fetch_add(1) != 3) return;
    pushing.Notify();  // the fourth push (step 3's, one lane): hold it
    release.WaitForNotification();
  });
  TrainerOptions options = FastOptions();
  options.lanes_per_ps = 1;
  Trainer trainer(options, chief_.get(), ClientOf(*fake_));
  Running run(&trainer);
  ASSERT_TRUE(pushing.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::thread stopper([&] { trainer.StopAfterPushes(SIGTERM, absl::Seconds(30)); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(run.done());  // still pushing
  EXPECT_EQ(fake_->stats(0).version, 3);
  release.Notify();
  ASSERT_TRUE(run.WaitFor(absl::Seconds(5)));
  stopper.join();
  EXPECT_EQ(SignalOf(run.Join()), SIGTERM);
  // The held push went through and its step was applied; none came after.
  EXPECT_EQ(fake_->stats(0).version, 4);
  EXPECT_EQ(fake_->calls(0, Method::kPush), 4);
}

TEST_F(TrainerTest, StopAfterPushesGivesUpAPushThatIsNotAnswered) {
  SetUpJob({.num_ps = 1});
  absl::Notification pushing, release;
  fake_->OnCall([&](int, Method m) {
    if (m != Method::kPush || pushing.HasBeenNotified()) return;
    pushing.Notify();
    release.WaitForNotification();
  });
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  Running run(&trainer);
  ASSERT_TRUE(pushing.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const absl::Time stop = absl::Now();
  trainer.StopAfterPushes(SIGTERM, absl::Milliseconds(300));
  // It returned once it gave up and stopped the trainer (whose held push
  // the fake cannot cancel: let it go).
  EXPECT_GE(absl::Now() - stop, absl::Milliseconds(300));
  release.Notify();
  ASSERT_TRUE(run.WaitFor(absl::Seconds(5)));
  EXPECT_EQ(SignalOf(run.Join()), SIGTERM);
}

TEST_F(TrainerTest, StopWhileTheChiefIsUnreachable) {
  SetUpJob({});
  chief_->FailCalls(absl::StatusCode::kUnavailable, -1);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  Running run(&trainer);
  absl::SleepFor(absl::Milliseconds(30));
  trainer.Stop(SIGINT);
  const absl::Status status = run.Join();
  EXPECT_EQ(ExitCodeFor(status), 128 + SIGINT) << status;
}

TEST_F(TrainerTest, AJobTheChiefFailsEndsWithExitCode1) {
  SetUpJob({.train_steps = 100000});
  chief_->SetAction(ReportResponse::FAIL);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  EXPECT_THAT(status.message(), HasSubstr("failed the job"));
  EXPECT_LT(fake_->stats(0).version, 100000);
}

TEST_F(TrainerTest, ANonFiniteStepIsReportedAndNothingIsPushed) {
  SetUpJob({});
  // Weights the job diverged to.
  std::vector<std::vector<float>> values = initial_;
  values[2][5] = std::numeric_limits<float>::quiet_NaN();  // fc2/weights: past the relu
  ASSERT_TRUE(LoadPs(*fake_, job_, kJobId, 4, values).ok());
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  const std::vector<StepMetrics> metrics = chief_->metrics();
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_TRUE(metrics[0].nonfinite());
  EXPECT_EQ(metrics[0].step(), 4);
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->calls(p, Method::kPush), 0);
    EXPECT_EQ(fake_->stats(p).version, 4);
  }
}

// With --on_nonfinite=skip_step a non-finite step is pushed as skips and
// reported flagged: every ps passes the step with no update and the worker
// trains on (here to the end, every step being non-finite).
TEST_F(TrainerTest, ANonFiniteStepIsSkippedWithSkipStep) {
  SetUpJob({.train_steps = 6, .on_nonfinite = JobConfig::SKIP_STEP});
  chief_->FailOnNonFinite(false);
  std::vector<std::vector<float>> values = initial_;
  values[2][5] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(LoadPs(*fake_, job_, kJobId, 2, values).ok());
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  ASSERT_TRUE(status.ok()) << status;
  const std::vector<StepMetrics> metrics = chief_->metrics();
  ASSERT_EQ(metrics.size(), 4u);
  for (size_t k = 0; k < metrics.size(); ++k) {
    EXPECT_EQ(metrics[k].step(), static_cast<int64_t>(2 + k));
    EXPECT_TRUE(metrics[k].nonfinite());
  }
  for (int p = 0; p < 2; ++p) {
    EXPECT_EQ(fake_->stats(p).version, 6);
    EXPECT_EQ(fake_->stats(p).skipped, 4);
    EXPECT_GT(fake_->calls(p, Method::kPush), 0);
  }
}

TEST_F(TrainerTest, ANonFiniteStepEndsWithExitCode1EvenWithoutTheChiefsVerdict) {
  SetUpJob({});
  chief_->FailOnNonFinite(false);
  std::vector<std::vector<float>> values = initial_;
  values[1][0] = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(LoadPs(*fake_, job_, kJobId, 0, values).ok());
  TrainerOptions options = FastOptions();
  options.nonfinite_wait = absl::Milliseconds(100);
  Trainer trainer(options, chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  EXPECT_THAT(status.message(), HasSubstr("not finite"));
  EXPECT_EQ(fake_->calls(0, Method::kPush), 0);
}

TEST_F(TrainerTest, AChiefThatStaysUnreachableEndsWith138) {
  SetUpJob({});
  chief_->FailCalls(absl::StatusCode::kUnavailable, -1);
  TrainerOptions options = FastOptions();
  options.startup_timeout = absl::Milliseconds(300);
  Trainer trainer(options, chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitUnreachable) << status;
  EXPECT_THAT(status.message(), HasSubstr("unreachable"));
  EXPECT_EQ(fake_->calls(0, Method::kPull), 0);
}

TEST_F(TrainerTest, RegistersOnceTheChiefIsUp) {
  SetUpJob({.train_steps = 3});
  chief_->FailCalls(absl::StatusCode::kUnavailable, 2);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(chief_->registrations(), 1);
}

TEST_F(TrainerTest, ARefusedRegistrationIsPermanent) {
  SetUpJob({});
  chief_->FailCalls(absl::StatusCode::kInternal, 1);  // whatever the code
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  EXPECT_THAT(status.message(), HasSubstr("refused registration"));
}

TEST_F(TrainerTest, AnInconsistentJobIsPermanent) {
  SetUpJob({});
  Trainer trainer(FastOptions(/*worker=*/1), chief_.get(),
                  ClientOf(*fake_));  // the job has one worker
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  EXPECT_EQ(fake_->calls(0, Method::kPull), 0);
}

TEST_F(TrainerTest, AWorkerWithTooFewDevicesForTheReplicasIsPermanent) {
  JobParams params;
  params.replicas_per_worker = 2;
  SetUpJob(params);
  Trainer trainer(FastOptions(), chief_.get(), ClientOf(*fake_));  // --device=cpu: one
  const absl::Status status = trainer.Run();
  EXPECT_EQ(ExitCodeFor(status), kExitPermanent) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("runs 2 replicas of the model per worker"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("names 1 device"));
  EXPECT_EQ(fake_->calls(0, Method::kPull), 0);
}

// The members of a ring in one process: a send is the receiver's Deliver.
class MemoryPeers final : public allreduce::Peers {
 public:
  explicit MemoryPeers(std::vector<allreduce::Ring*>* rings) : rings_(rings) {}
  absl::Status Send(int to, const RingPiece& piece, absl::Time deadline, bool forming) override {
    while (true) {
      if (cancelled_) return absl::CancelledError("cancelled");
      absl::Status s = (*rings_)[to]->Deliver(piece);
      if (!forming || !absl::IsUnavailable(s) || absl::Now() > deadline) return s;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  void Abort(int to, const RingAbort& abort, absl::Time) override {
    (*rings_)[to]->PeerAborted(abort).IgnoreError();
  }
  void CancelAll() override { cancelled_ = true; }

 private:
  std::vector<allreduce::Ring*>* rings_;
  std::atomic<bool> cancelled_{false};
};

// A job without ps on two CPU workers, each with its own replica
// (ps::Replica over a shard, as the worker process makes it): worker 1
// loads its replica from worker 0's (which the chief loaded), both train on
// the host ring to the end, and the two replicas end at the last step with
// the same weights, moved from the initial ones.
TEST(TrainerAllReduceTest, EachWorkerTrainsItsOwnReplica) {
  JobConfig job = MakeJob({.num_ps = 1, .num_workers = 2});
  job.set_exchange(JobConfig::ALL_REDUCE);
  ps::Shard shard0, shard1;
  ps::LocalReplica replica0(&shard0), replica1(&shard1);
  // The chief loads worker 0's replica, as pushed to by worker 0 alone.
  const std::vector<std::vector<float>> initial = InitialValues(job);
  std::unique_ptr<ps::Client> chief_ps = replica0.Connect();
  std::vector<const float*> buffers;
  for (const std::vector<float>& v : initial) buffers.push_back(v.data());
  InitHeader header;
  header.set_job_id(kJobId);
  *header.mutable_job() = ReplicaJob(job);
  header.add_live_workers(0);
  for (SliceSpec& s : SliceSpecs(job.placement(), 0)) *header.add_slice() = std::move(s);
  ASSERT_TRUE(
      chief_ps
          ->Init(0, header, SliceRefs(job.placement(), 0, buffers), absl::Now() + absl::Seconds(5))
          .ok());

  std::vector<allreduce::Ring*> rings;
  MemoryPeers peers(&rings);
  allreduce::Ring ring0({.rank = 0, .size = 2, .form_timeout = absl::Seconds(5)}, &peers);
  allreduce::Ring ring1({.rank = 1, .size = 2, .form_timeout = absl::Seconds(5)}, &peers);
  rings = {&ring0, &ring1};
  FakeChief chief(Registration(job));  // "ps 0" is worker 0's replica
  TrainerOptions o0 = FastOptions(0), o1 = FastOptions(1);
  o0.ring = &ring0;
  o0.replica = &replica0;
  o1.ring = &ring1;
  o1.replica = &replica1;
  // Both reach worker 0's replica as ps 0 (over gRPC in a real cluster);
  // worker 1 then trains on its own.
  auto worker0s = [&replica0](const std::vector<std::string>& addresses) {
    EXPECT_EQ(addresses.size(), 1u);
    return replica0.Connect();
  };
  Trainer first(o0, &chief, worker0s), second(o1, &chief, worker0s);
  Running run0(&first), run1(&second);
  const absl::Status s0 = run0.Join(), s1 = run1.Join();
  ASSERT_TRUE(s0.ok()) << s0;
  ASSERT_TRUE(s1.ok()) << s1;

  EXPECT_EQ(shard0.stats().version, job.train_steps());
  EXPECT_EQ(shard1.stats().version, job.train_steps());
  std::unique_ptr<ps::Client> read0 = replica0.Connect(), read1 = replica1.Connect();
  const std::vector<std::vector<float>> w0 = ReadWeights(*read0, job, kJobId);
  EXPECT_EQ(w0, ReadWeights(*read1, job, kJobId));
  EXPECT_NE(w0, initial);
}

}  // namespace
}  // namespace psflow::worker
