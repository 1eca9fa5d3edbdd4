// worker::DeviceReplica as the exchange of a worker alone in a job without
// ps, driven through the hooks in the order the trainer's step loop calls
// them, on a CPU backend (the replica's device calls are the backend's, so
// the same code runs as on a GPU; there is no GPU group): the first Pull
// loads the served replica, PushStep applies the optimizer or skips the
// step by the verdict of Reduce, Finish publishes what was trained.
#include "worker/device_replica.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>

#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/placement.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/spec.h"
#include "ps/local_replica.h"
#include "ps/shard.h"

namespace psflow::worker {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kJobId = 1;
constexpr float kLearningRate = 0.1f;

JobConfig MakeJob(JobConfig::NonFinitePolicy on_nonfinite) {
  JobConfig job;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"spec(name: "tiny" input { channels: 1 height: 6 width: 6 } num_classes: 4
             layer { name: "fc1" dense { units: 16 } }
             layer { name: "relu1" relu {} }
             layer { name: "fc2" dense { units: 4 } })spec",
      job.mutable_model()));
  job.mutable_data()->set_format("synthetic");
  job.set_num_examples(64);
  job.set_batch_size(8);
  job.set_steps_per_epoch(8);
  job.set_train_steps(4);
  job.set_seed(7);
  job.set_num_workers(1);
  job.set_num_ps(1);
  job.set_compute_threads(1);
  job.set_exchange(JobConfig::ALL_REDUCE);
  job.mutable_optimizer()->set_kind(OptimizerConfig::SGD);
  job.mutable_optimizer()->set_learning_rate(kLearningRate);
  job.set_on_nonfinite(on_nonfinite);
  absl::StatusOr<Placement> placement = PlaceVariables(model::ModelVariables(job.model()), 1,
                                                       /*split_bytes=*/1024, kDefaultSliceBytes);
  EXPECT_TRUE(placement.ok()) << placement.status();
  if (placement.ok()) *job.mutable_placement() = *placement;
  return job;
}

// The replica a worker serves (loaded as the chief loads it), the model on
// a CPU, and the device replica over both.
class DeviceReplicaTest : public ::testing::Test {
 protected:
  void Make(JobConfig::NonFinitePolicy on_nonfinite, uint64_t worker_job_id = kJobId) {
    job_ = MakeJob(on_nonfinite);
    initial_ = model::InitialValues(job_.model(), job_.seed());
    client_ = served_.Connect();
    std::vector<const float*> buffers;
    for (const std::vector<float>& v : initial_) buffers.push_back(v.data());
    InitHeader header;
    header.set_job_id(kJobId);
    *header.mutable_job() = ReplicaJob(job_);
    header.add_live_workers(0);
    for (SliceSpec& s : SliceSpecs(job_.placement(), 0)) *header.add_slice() = std::move(s);
    ASSERT_TRUE(client_
                    ->Init(0, header, SliceRefs(job_.placement(), 0, buffers),
                           absl::Now() + absl::Seconds(5))
                    .ok());
    absl::StatusOr<std::unique_ptr<ModelReplicas>> model = ModelReplicas::Create("cpu", job_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    job_id_ = worker_job_id;
    DeviceReplicaOptions o;
    o.transfer_timeout = absl::Seconds(5);
    o.replica = &served_;
    o.client = client_.get();
    o.job_id = &job_id_;
    ExchangeHooks hooks;
    hooks.stop_signal = [] { return 0; };
    hooks.stopping = [] { return false; };
    hooks.stop_pending = [] { return false; };
    hooks.open_pushes = [] {};
    hooks.close_pushes = [] {};
    absl::StatusOr<std::unique_ptr<DeviceReplica>> replica =
        DeviceReplica::Create(job_, o, hooks, model_.get(), /*peers=*/nullptr);
    ASSERT_TRUE(replica.ok()) << replica.status();
    replica_ = *std::move(replica);
  }

  // Every gradient `g`, as if the step's backward pass had written it.
  void SetGradients(float g) {
    for (size_t v = 0; v < model_->grads()[0].size(); ++v) {
      std::fill_n(model_->grads()[0][v], model_->variable_floats()[v], g);
    }
  }

  // One step through the hooks, in the trainer's order, with this worker's
  // `loss`: the verdict, whether on_pushed ran (and said skipped), and the
  // round PushStep gave.
  struct Stepped {
    StepVerdictKind verdict = StepVerdictKind::kInterrupted;
    int pushed = 0;
    bool skipped = false;
    float mean_loss = 0;
    ExchangeRound round;
  };
  Stepped Step(int64_t step, float loss) {
    Stepped r;
    StepPush push;
    push.step = push.push_step = step;
    push.min_version = step + 1;
    push.on_pushed = [&r](absl::Time, bool skip) {
      ++r.pushed;
      r.skipped = skip;
    };
    replica_->BeginStep(push, &r.round);
    EXPECT_TRUE(replica_->StepQueued().ok());
    replica_->EndCompute(static_cast<double>(loss));
    push.loss = loss;
    push.mean_loss = loss;
    EXPECT_TRUE(replica_->Reduce(step, &push.mean_loss).ok());
    r.mean_loss = push.mean_loss;
    EXPECT_TRUE(replica_->PushStep(push, &r.verdict, &r.round).ok());
    return r;
  }

  // The served replica's version and values.
  int64_t ServedVersion() {
    absl::StatusOr<PsState> state = client_->GetState(0, absl::Now() + absl::Seconds(5));
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? state->version() : -1;
  }
  std::vector<std::vector<float>> ServedValues() {
    std::vector<std::vector<float>> values;
    std::vector<float*> buffers;
    for (const std::vector<float>& v : initial_) values.emplace_back(v.size());
    for (std::vector<float>& v : values) buffers.push_back(v.data());
    absl::StatusOr<ps::Client::PullResult> r =
        client_->Pull(0, kJobId, 0, {}, SliceSinks(job_.placement(), 0, buffers),
                      absl::Now() + absl::Seconds(5), absl::ZeroDuration());
    EXPECT_TRUE(r.ok()) << r.status();
    return values;
  }

  JobConfig job_;
  std::vector<std::vector<float>> initial_;
  ps::Shard shard_;
  ps::LocalReplica served_{&shard_};
  std::unique_ptr<ps::Client> client_;
  std::unique_ptr<ModelReplicas> model_;
  std::atomic<uint64_t> job_id_{kJobId};
  std::unique_ptr<DeviceReplica> replica_;
};

// Each variable of `values` moved by `delta`, within float rounding.
void ExpectMoved(const std::vector<std::vector<float>>& values,
                 const std::vector<std::vector<float>>& initial, float delta) {
  ASSERT_EQ(values.size(), initial.size());
  for (size_t v = 0; v < values.size(); ++v) {
    ASSERT_EQ(values[v].size(), initial[v].size());
    for (size_t i = 0; i < values[v].size(); ++i) {
      ASSERT_NEAR(values[v][i], initial[v][i] + delta, 1e-5) << "variable " << v << "[" << i << "]";
    }
  }
}

TEST_F(DeviceReplicaTest, TrainsOnTheDeviceAndPublishesTheFinalReplica) {
  Make(JobConfig::FAIL);
  EXPECT_FALSE(replica_->NeedsHostGradients());
  ExchangeRound round;
  ASSERT_TRUE(replica_->Pull(/*min_version=*/0, &round).ok());
  EXPECT_EQ(round.version, 0);
  for (int64_t step = 0; step < job_.train_steps(); ++step) {
    SetGradients(1.0f);
    const Stepped s = Step(step, 0.5f);
    EXPECT_EQ(s.verdict, StepVerdictKind::kFinite);
    EXPECT_EQ(s.pushed, 1);
    EXPECT_FALSE(s.skipped);
    EXPECT_EQ(s.mean_loss, 0.5f) << "alone, the mean is this worker's loss";
    EXPECT_EQ(s.round.version, step + 1);
  }
  // A later pull keeps the device's weights: nothing is loaded again.
  ASSERT_TRUE(replica_->Pull(job_.train_steps(), &round).ok());
  EXPECT_EQ(round.version, job_.train_steps());
  EXPECT_EQ(ServedVersion(), 0) << "nothing published before the end";

  ASSERT_TRUE(replica_->Finish(absl::OkStatus()).ok());
  EXPECT_EQ(ServedVersion(), job_.train_steps());
  ExpectMoved(ServedValues(), initial_, -kLearningRate * job_.train_steps());
}

TEST_F(DeviceReplicaTest, NotFiniteWithFailAppliesNothingAndPublishesNothing) {
  Make(JobConfig::FAIL);
  ExchangeRound round;
  ASSERT_TRUE(replica_->Pull(0, &round).ok());
  SetGradients(std::numeric_limits<float>::quiet_NaN());
  const Stepped s = Step(0, 0.5f);
  EXPECT_EQ(s.verdict, StepVerdictKind::kNotFiniteMean);
  EXPECT_EQ(s.pushed, 0);
  // The trainer ends with its own status: the replica adds nothing.
  const absl::Status failed = absl::FailedPreconditionError("not finite");
  EXPECT_EQ(replica_->Finish(failed), failed);
  EXPECT_EQ(ServedVersion(), 0);
  EXPECT_EQ(ServedValues(), initial_);
}

TEST_F(DeviceReplicaTest, SkipsANotFiniteStepAndPublishesAtAStop) {
  Make(JobConfig::SKIP_STEP);
  ExchangeRound round;
  ASSERT_TRUE(replica_->Pull(0, &round).ok());
  SetGradients(1.0f);
  const Stepped s = Step(0, std::numeric_limits<float>::infinity());
  EXPECT_EQ(s.verdict, StepVerdictKind::kSkipped);
  EXPECT_EQ(s.pushed, 1);
  EXPECT_TRUE(s.skipped);
  EXPECT_EQ(s.round.version, 1);
  SetGradients(1.0f);
  EXPECT_EQ(Step(1, 0.5f).verdict, StepVerdictKind::kFinite);

  // A stop keeps what was trained: the replica of step 2, whole, one step
  // applied.
  const absl::Status stopped = StoppedBySignal(15);
  EXPECT_EQ(replica_->Finish(stopped), stopped);
  EXPECT_EQ(ServedVersion(), 2);
  ExpectMoved(ServedValues(), initial_, -kLearningRate);
}

TEST_F(DeviceReplicaTest, AFailedLoadEndsTheTrainingAsItWas) {
  Make(JobConfig::FAIL, /*worker_job_id=*/kJobId + 1);
  ExchangeRound round;
  const absl::Status s = replica_->Pull(0, &round);
  ASSERT_TRUE(IsRegisterAgain(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("this worker's replica holds another job"));
  // However the trainer words its end, the load's own status is the one
  // training ends with, and nothing is published (nothing was loaded).
  EXPECT_EQ(replica_->Finish(absl::InternalError("pull failed")), s);
  EXPECT_EQ(ServedVersion(), 0);
}

}  // namespace
}  // namespace psflow::worker
