// For the tests of the ps's protocol sessions (ps/pull_session.h,
// ps/push_session.h, ps/snapshot_session.h): a small job, and one shard
// reached through either of the sessions' drivers, LocalClient (false) or
// PsService on loopback through a GrpcClient (true), so that a test asks
// both the same questions.
// In psflow::ps, as the tests that use it are.
#ifndef PSFLOW_TESTS_PS_SESSION_DRIVERS_H_
#define PSFLOW_TESTS_PS_SESSION_DRIVERS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "ps/grpc_client.h"
#include "ps/local_client.h"
#include "ps/service.h"
#include "ps/shard.h"
#include "role/process_setup.h"

namespace psflow::ps {

inline constexpr uint64_t kSessionJob = 41;

inline absl::Time SessionDeadline() { return absl::Now() + absl::Seconds(20); }

// A job of workers 0 and 1 with one slice "s<i>" of sizes[i] floats each
// (Momentum, lr 0.5, so that snapshots carry a slot), each slice a whole
// variable on ps 0 of 1, as an Init through a client must say; `mode` ASYNC
// makes it asynchronous; `on_nonfinite` FAIL makes its workers push no skips.
inline InitHeader SessionHeader(const std::vector<int64_t>& sizes,
                                JobConfig::Mode mode = JobConfig::SYNC,
                                JobConfig::NonFinitePolicy on_nonfinite = JobConfig::SKIP_STEP) {
  InitHeader h;
  h.set_job_id(kSessionJob);
  h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::MOMENTUM);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(0.5f);
  h.mutable_job()->mutable_optimizer()->set_momentum(0.5f);
  h.mutable_job()->set_mode(mode);
  h.mutable_job()->set_num_workers(2);
  h.mutable_job()->set_train_steps(100);
  h.mutable_job()->set_on_nonfinite(on_nonfinite);
  h.add_live_workers(0);
  h.add_live_workers(1);
  Placement* placement = h.mutable_job()->mutable_placement();
  placement->set_num_ps(1);
  for (size_t i = 0; i < sizes.size(); ++i) {
    SliceSpec* s = h.add_slice();
    s->set_name(absl::StrCat("s", i));
    s->add_shape(sizes[i]);
    s->set_row_end(sizes[i]);
    VariablePlacement* v = placement->add_variable();
    v->set_name(s->name());
    v->add_shape(sizes[i]);
    VariableSlice* slice = v->add_slice();
    slice->set_ps(0);
    slice->set_row_end(sizes[i]);
  }
  return h;
}

// Slice i holds i + 1 everywhere.
inline std::vector<Shard::SliceValues> SessionValues(const std::vector<int64_t>& sizes) {
  std::vector<Shard::SliceValues> values(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) values[i].value.assign(sizes[i], i + 1.0f);
  return values;
}

// One shard behind LocalClient (GetParam() false) or PsService (true).
class SessionDriversTest : public ::testing::TestWithParam<bool> {
 public:
  static std::string DriverName(const ::testing::TestParamInfo<bool>& info) {
    return info.param ? "PsServiceOnLoopback" : "LocalClient";
  }

 protected:
  void SetUp() override {
    if (!GetParam()) {
      client_ = std::make_unique<LocalClient>(&shard_);
      return;
    }
    KeepGrpcUntilExit();
    service_ = std::make_unique<PsService>(&shard_, PsServiceOptions{});
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    client_ = std::make_unique<GrpcClient>(
        std::vector<std::string>{absl::StrCat("127.0.0.1:", port)}, GrpcClientOptions{});
  }
  void TearDown() override {
    shard_.Shutdown();  // wakes any waiting call
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }

  // The job of SessionHeader(sizes, SYNC, on_nonfinite), through the client.
  absl::Status InitJob(const std::vector<int64_t>& sizes,
                       JobConfig::NonFinitePolicy on_nonfinite = JobConfig::SKIP_STEP) {
    const std::vector<Shard::SliceValues> values = SessionValues(sizes);
    std::vector<TensorRef> refs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      refs.push_back({absl::StrCat("s", i), "", {sizes[i]}, values[i].value.data()});
    }
    return client_->Init(0, SessionHeader(sizes, JobConfig::SYNC, on_nonfinite), refs,
                         SessionDeadline());
  }

  Shard shard_;
  std::unique_ptr<PsService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

}  // namespace psflow::ps

#endif  // PSFLOW_TESTS_PS_SESSION_DRIVERS_H_
