// PsService on a real in-process gRPC server on loopback, driven by ps::GrpcClient
// and by hand-built streams through the generated stub.
#include "ps/service.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/float16.h"
#include "common/metrics.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "ps/grpc_client.h"
#include "ps/shard.h"
#include "ps/snapshot_session.h"
#include "role/process_setup.h"
#include "tests/ps/huge_init.h"
#include "tests/ps/stream_flood.h"
#include "transport/call_channel.h"
#include "transport/channel_server.h"
#include "transport/grpc_util.h"
#include "transport/shared_region.h"

namespace psflow::ps {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr uint64_t kJob = 77;
// 4.4 MB: more than gRPC's 4 MB default message size, so it must be chunked.
const std::vector<int64_t> kBigShape = {1100, 1000};
const std::vector<int64_t> kBiasShape = {10};
constexpr float kLr = 0.5f;

// Small multiples of powers of two: the SGD update is exact in fp32.
std::vector<float> Pattern(int64_t n, int mod, float scale) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % mod - mod / 2) * scale;
  return v;
}

absl::Time Deadline() { return absl::Now() + absl::Seconds(20); }

// Every message of a raw server stream that `start` opens on a context with
// Deadline(), and the status the stream ended with.
template <typename Response, typename Start>
std::pair<std::vector<Response>, grpc::Status> ReadStream(const Start& start) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(Deadline()));
  std::unique_ptr<grpc::ClientReader<Response>> reader = start(&context);
  std::vector<Response> messages;
  Response response;
  while (reader->Read(&response)) messages.push_back(response);
  return {std::move(messages), reader->Finish()};
}

// A server of `service` on a free loopback port (in `*port`); null if it
// could not start. No StartServer: the server keeps gRPC's default 4 MB
// receive limit, so an Init or Push that is not chunked would fail.
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// Every method the ps's caller rules name exists: a renamed method must not
// lose its rule silently.
TEST(PsCallersTest, NameMethodsOfTheService) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          ParameterServer::service_full_name());
  ASSERT_NE(service, nullptr);
  const CallerRoles callers = PsCallers();
  EXPECT_EQ(callers.size(), 8u);
  const std::string prefix = absl::StrCat("/", ParameterServer::service_full_name(), "/");
  for (const auto& [method, roles] : callers) {
    ASSERT_EQ(method.rfind(prefix, 0), 0u) << method;
    EXPECT_NE(service->FindMethodByName(method.substr(prefix.size())), nullptr) << method;
    EXPECT_FALSE(roles.empty()) << method;
  }
  EXPECT_EQ(callers.at("/psflow.ParameterServer/Shutdown"), std::vector<Role>{Role::kChief});
  EXPECT_EQ(callers.at("/psflow.ParameterServer/CheckpointTaken"), std::vector<Role>{Role::kChief});
  // A channel carries pushes: only a worker opens one.
  EXPECT_EQ(callers.at("/psflow.ParameterServer/OpenChannel"), std::vector<Role>{Role::kWorker});
}

class PsServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Without it, the last server's destructor shuts gRPC down and can wait
    // 10 s on its backup poller (role/process_setup.h).
    KeepGrpcUntilExit();
    service_ = std::make_unique<PsService>(
        &shard_,
        PsServiceOptions{.on_shutdown = [this] { shutdown_.Notify(); },
                         .on_job = [this](bool holds_job) { job_calls_.push_back(holds_job); },
                         .metrics = &server_metrics_,
                         .channels = true});
    service_->OnCheckpointTaken([this] { ++checkpoints_taken_; });
    server_ = ServeOnLoopback(service_.get(), &port_);
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
    address_ = absl::StrCat("127.0.0.1:", port_);
    client_ = std::make_unique<GrpcClient>(std::vector<std::string>{address_},
                                           GrpcClientOptions{.metrics = &client_metrics_});
    stub_ = ParameterServer::NewStub(MakeChannel(address_, Role::kPs, SecurityOptions{}));

    big_ = Pattern(NumElements(kBigShape), 1024, 0.125f);
    bias_ = Pattern(NumElements(kBiasShape), 10, 1.0f);
  }

  void TearDown() override {
    shard_.Shutdown();  // wakes any waiting pull
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }

  InitHeader Header(int ps_index = 0) const {
    InitHeader h;
    h.set_job_id(kJob);
    h.set_ps_index(ps_index);
    h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::SGD);
    h.mutable_job()->mutable_optimizer()->set_learning_rate(kLr);
    h.add_live_workers(0);
    h.add_live_workers(1);
    // Both variables whole on ps `ps_index` (of ps_index + 1).
    Placement* placement = h.mutable_job()->mutable_placement();
    placement->set_num_ps(ps_index + 1);
    for (const auto& [name, shape] : {std::pair{"big", kBigShape}, std::pair{"bias", kBiasShape}}) {
      SliceSpec* s = h.add_slice();
      s->set_name(name);
      for (int64_t d : shape) s->add_shape(d);
      s->set_row_end(shape[0]);
      VariablePlacement* v = placement->add_variable();
      v->set_name(name);
      for (int64_t d : shape) v->add_shape(d);
      VariableSlice* slice = v->add_slice();
      slice->set_ps(ps_index);
      slice->set_row_end(shape[0]);
    }
    return h;
  }

  // A client of the service through shared memory, and through same-host
  // channels with `channels`.
  std::unique_ptr<GrpcClient> SharedClient(bool channels, int connections = 2) {
    return std::make_unique<GrpcClient>(std::vector<std::string>{address_},
                                        GrpcClientOptions{.connections_per_ps = connections,
                                                          .metrics = &client_metrics_,
                                                          .shared_memory = true,
                                                          .channels = channels});
  }

  // The job of `header` (Header() by default), big_ and bias_ its values,
  // through `client` (client_ by default).
  absl::Status InitJob() { return InitJob(Header()); }
  absl::Status InitJob(const InitHeader& header, Client* client = nullptr) {
    return (client != nullptr ? client : client_.get())
        ->Init(0, header,
               {{"big", "", kBigShape, big_.data()}, {"bias", "", kBiasShape, bias_.data()}},
               Deadline());
  }

  struct Pulled {
    int64_t version = -1;
    std::vector<float> big, bias;
  };
  absl::StatusOr<Pulled> PullAll(int64_t min_version, absl::Time deadline = Deadline()) {
    Pulled p;
    p.big.assign(NumElements(kBigShape), -1);
    p.bias.assign(NumElements(kBiasShape), -1);
    absl::StatusOr<Client::PullResult> r = client_->Pull(
        0, kJob, min_version, {},
        {{"big", "", kBigShape, p.big.data()}, {"bias", "", kBiasShape, p.bias.data()}}, deadline,
        absl::ZeroDuration());
    if (!r.ok()) return r.status();
    p.version = r->version;
    return p;
  }

  // Both gradients of one worker's step, `dtype` on the wire.
  absl::StatusOr<PushResponse> PushAll(int worker, int64_t step, const std::vector<float>& gbig,
                                       const std::vector<float>& gbias, DataType dtype = DT_FLOAT) {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(worker);
    h.set_step(step);
    return client_->Push(
        0, h,
        {{"big", "", kBigShape, gbig.data(), dtype}, {"bias", "", kBiasShape, gbias.data(), dtype}},
        Deadline());
  }

  // Worker `worker`'s push of step 0 for slice `slice` alone (0: "big",
  // 1: "bias").
  static absl::StatusOr<PushResponse> PushOneSlice(Client& client, int worker, int slice,
                                                   const std::vector<float>& gbig,
                                                   const std::vector<float>& gbias) {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(worker);
    h.set_step(0);
    h.add_slices(slice);
    std::vector<TensorRef> refs;
    if (slice == 0) refs.push_back({"big", "", kBigShape, gbig.data()});
    if (slice == 1) refs.push_back({"bias", "", kBiasShape, gbias.data()});
    return client.Push(0, h, refs, Deadline());
  }

  // Workers 0 and 1 push step `step` at once (through shared memory, the
  // ps answers a push only once its gradients are applied, which needs both).
  std::pair<absl::StatusOr<PushResponse>, absl::StatusOr<PushResponse>> PushBoth(
      int64_t step, const std::vector<float>& big0, const std::vector<float>& bias0,
      const std::vector<float>& big1, const std::vector<float>& bias1) {
    absl::StatusOr<PushResponse> r0;
    std::thread pusher([&] { r0 = PushAll(0, step, big0, bias0); });
    absl::StatusOr<PushResponse> r1 = PushAll(1, step, big1, bias1);
    pusher.join();
    return {std::move(r0), std::move(r1)};
  }

  // Sends `requests` on a raw Push stream and returns the call's status.
  grpc::Status RawPush(const std::vector<PushRequest>& requests) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(Deadline()));
    PushResponse response;
    std::unique_ptr<grpc::ClientWriter<PushRequest>> writer = stub_->Push(&context, &response);
    for (const PushRequest& r : requests) {
      if (!writer->Write(r)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // Before the service and the client, which record into them.
  metrics::Registry server_metrics_, client_metrics_;
  std::vector<bool>
      job_calls_;  // what the service told on_job (from its RPC threads, one at a time)
  Shard shard_;
  absl::Notification shutdown_;
  std::atomic<int> checkpoints_taken_{0};  // CheckpointTaken calls accepted
  std::unique_ptr<PsService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<ParameterServer::Stub> stub_;
  std::vector<float> big_, bias_;
};

std::vector<float> SgdAfter(const std::vector<float>& w, const std::vector<float>& g0,
                            const std::vector<float>& g1) {
  std::vector<float> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] - kLr * ((g0[i] + g1[i]) / 2);
  return out;
}

TEST_F(PsServiceTest, InitPullPushPull) {
  absl::Status init = InitJob();
  ASSERT_TRUE(init.ok()) << init;
  absl::StatusOr<Pulled> p0 = PullAll(0);
  ASSERT_TRUE(p0.ok()) << p0.status();
  EXPECT_EQ(p0->version, 0);
  EXPECT_EQ(p0->big, big_);
  EXPECT_EQ(p0->bias, bias_);

  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  const std::vector<float> g1_big = Pattern(big_.size(), 5, -0.5f), g1_bias = Pattern(10, 4, 0.5f);

  // A pull for version 1 waits for both workers' pushes.
  absl::Notification pulled;
  absl::StatusOr<Pulled> p1;
  std::thread puller([&] {
    p1 = PullAll(1);
    pulled.Notify();
  });
  absl::StatusOr<PushResponse> r0 = PushAll(0, 0, g0_big, g0_bias);
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_EQ(r0->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(r0->version(), 0);
  EXPECT_FALSE(pulled.WaitForNotificationWithTimeout(absl::Milliseconds(50)));

  absl::StatusOr<PushResponse> r1 = PushAll(1, 0, g1_big, g1_bias);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(r1->version(), 1);
  ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  puller.join();
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_EQ(p1->version, 1);
  EXPECT_EQ(p1->big, SgdAfter(big_, g0_big, g1_big));
  EXPECT_EQ(p1->bias, SgdAfter(bias_, g0_bias, g1_bias));

  // A retried push is a duplicate, an old one stale.
  r1 = PushAll(1, 1, g1_big, g1_bias);
  ASSERT_TRUE(r1.ok());
  r1 = PushAll(1, 1, g1_big, g1_bias);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->outcome(), PushResponse::DUPLICATE);
  r0 = PushAll(0, 0, g0_big, g0_bias);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->outcome(), PushResponse::STALE);
  EXPECT_EQ(shard_.stats().duplicate, 1);
  EXPECT_EQ(shard_.stats().stale, 1);
}

// Pushes of one slice each, over a client with several connections: a pull
// of the slice both workers pushed is answered at once, while the other
// slice still waits for its pushes; the shard's version moves with the last.
// A pull sends its slices in the order they are applied, not the order it
// asked for them: a slice applied late holds back none of the others.
TEST_F(PsServiceTest, APullSendsEachSliceAsSoonAsItIsApplied) {
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> gbig = Pattern(big_.size(), 3, 1.0f), gbias = Pattern(10, 2, 2.0f);
  auto push = [&](int worker, int slice) {
    return PushOneSlice(*client_, worker, slice, gbig, gbias);
  };
  for (int w : {0, 1}) ASSERT_TRUE(push(w, 1).ok());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  PullRequest request;
  request.set_job_id(kJob);
  request.set_min_version(1);
  request.add_slices(0);
  request.add_slices(1);
  std::unique_ptr<grpc::ClientReader<PullResponse>> reader = stub_->Pull(&context, request);
  PullResponse first;
  ASSERT_TRUE(reader->Read(&first)) << "bias is applied: it comes before big";
  ASSERT_GE(first.chunk_size(), 1);
  EXPECT_EQ(first.chunk(0).name(), "bias");
  EXPECT_TRUE(first.ready());
  EXPECT_EQ(first.version(), 1);
  for (int w : {0, 1}) ASSERT_TRUE(push(w, 0).ok());
  std::vector<std::string> names;
  for (PullResponse m; reader->Read(&m);) {
    for (const TensorChunk& c : m.chunk()) names.push_back(c.name());
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_FALSE(names.empty());
  for (const std::string& name : names) EXPECT_EQ(name, "big");
}

TEST_F(PsServiceTest, SlicesArePushedAndPulledOneByOne) {
  ASSERT_TRUE(InitJob().ok());
  GrpcClient lanes(std::vector<std::string>{address_}, GrpcClientOptions{.connections_per_ps = 3});
  const std::vector<float> gbig = Pattern(big_.size(), 3, 1.0f), gbias = Pattern(10, 2, 2.0f);
  auto push = [&](int worker, int slice) {
    return PushOneSlice(lanes, worker, slice, gbig, gbias);
  };
  for (int w : {0, 1}) {
    absl::StatusOr<PushResponse> r = push(w, 1);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->outcome(), PushResponse::ACCEPTED);
  }
  std::vector<float> bias(10, -1);
  absl::StatusOr<Client::PullResult> got = lanes.Pull(
      0, kJob, 1, {1}, {{"bias", "", kBiasShape, bias.data()}}, Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->version, 1);
  EXPECT_EQ(bias, SgdAfter(bias_, gbias, gbias));
  EXPECT_EQ(shard_.stats().version, 0) << "big is not pushed yet";
  std::vector<float> big(big_.size(), -1);
  got = lanes.Pull(0, kJob, 1, {0}, {{"big", "", kBigShape, big.data()}},
                   absl::Now() + absl::Seconds(10), absl::Milliseconds(50));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->version, 0) << "not yet";
  EXPECT_EQ(big[0], -1);
  // A push naming a slice twice, or one out of range, or chunks of a slice
  // it does not name, is refused.
  {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(0);
    h.set_step(0);
    h.add_slices(0);
    h.add_slices(0);
    EXPECT_EQ(lanes.Push(0, h, {}, Deadline()).status().code(), absl::StatusCode::kInvalidArgument);
    h.clear_slices();
    h.add_slices(2);
    EXPECT_EQ(lanes.Push(0, h, {}, Deadline()).status().code(), absl::StatusCode::kInvalidArgument);
    h.clear_slices();
    h.add_slices(1);
    EXPECT_EQ(lanes.Push(0, h, {{"big", "", kBigShape, gbig.data()}}, Deadline()).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  for (int w : {0, 1}) ASSERT_TRUE(push(w, 0).ok());
  got = lanes.Pull(0, kJob, 1, {0}, {{"big", "", kBigShape, big.data()}}, Deadline(),
                   absl::ZeroDuration());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(big, SgdAfter(big_, gbig, gbig));
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(shard_.stats().duplicate, 0);
}

TEST_F(PsServiceTest, PullIsStreamedInChunksBelowTheDefaultLimit) {
  ASSERT_TRUE(InitJob().ok());
  PullRequest request;
  request.set_job_id(kJob);
  auto [messages, status] =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, request); });
  int64_t bytes = 0;
  for (const PullResponse& response : messages) {
    EXPECT_LT(response.ByteSizeLong(), 4u << 20);
    EXPECT_EQ(response.version(), 0);
    for (const TensorChunk& c : response.chunk()) bytes += static_cast<int64_t>(c.data().size());
  }
  ASSERT_TRUE(status.ok());
  EXPECT_GE(messages.size(), 5u);  // 4.4 MB in chunks of at most 1 MB
  EXPECT_EQ(bytes, (NumElements(kBigShape) + NumElements(kBiasShape)) * 4);
}

// Slices that are ready together go in one pull message up to 256 KiB; a
// larger one goes alone, and a slice that is not ready yet is not waited for
// by those before it.
TEST_F(PsServiceTest, ReadySmallSlicesShareAPullMessageLargerOnesGoAlone) {
  // s0 s1 b0 s2 s3 b1 s4 s5: small ones of 4 KB, large ones of 400 KB.
  const std::vector<std::pair<std::string, int64_t>> vars = {
      {"s0", 1000}, {"s1", 1000},   {"b0", 100000}, {"s2", 1000},
      {"s3", 1000}, {"b1", 100000}, {"s4", 1000},   {"s5", 1000}};
  InitHeader h;
  h.set_job_id(kJob);
  h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::SGD);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(kLr);
  h.add_live_workers(0);
  Placement* placement = h.mutable_job()->mutable_placement();
  placement->set_num_ps(1);
  std::vector<std::vector<float>> values;
  std::vector<TensorRef> refs;
  for (const auto& [name, n] : vars) {
    SliceSpec* spec = h.add_slice();
    spec->set_name(name);
    spec->add_shape(n);
    spec->set_row_end(n);
    VariablePlacement* v = placement->add_variable();
    v->set_name(name);
    v->add_shape(n);
    v->add_slice()->set_row_end(n);
    values.push_back(Pattern(n, 16, 0.5f));
  }
  for (size_t i = 0; i < vars.size(); ++i) {
    refs.push_back({vars[i].first, "", {vars[i].second}, values[i].data()});
  }
  ASSERT_TRUE(client_->Init(0, h, refs, Deadline()).ok());

  PullRequest request;
  request.set_job_id(kJob);
  auto [messages, status] =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, request); });
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<std::vector<std::string>> names;
  for (const PullResponse& m : messages) {
    names.emplace_back();
    for (const TensorChunk& c : m.chunk()) {
      names.back().push_back(c.name());
      // Each chunk's data are its slice's values.
      const size_t i = std::find_if(vars.begin(), vars.end(),
                                    [&](const auto& v) { return v.first == c.name(); }) -
                       vars.begin();
      ASSERT_LT(i, vars.size());
      EXPECT_EQ(c.data(), std::string(reinterpret_cast<const char*>(values[i].data()),
                                      values[i].size() * sizeof(float)));
    }
  }
  EXPECT_EQ(names, (std::vector<std::vector<std::string>>{
                       {"s0", "s1"}, {"b0"}, {"s2", "s3"}, {"b1"}, {"s4", "s5"}}));

  // Version 1 of s0 and s1 only: they come together, and the pull then
  // waits for s2 (here until its deadline).
  const std::vector<float> grad(1000, 1.0f);
  PushHeader ph;
  ph.set_job_id(kJob);
  ph.set_worker(0);
  ph.set_step(0);
  ph.add_slices(0);
  ph.add_slices(1);
  ASSERT_TRUE(client_
                  ->Push(0, ph, {{"s0", "", {1000}, grad.data()}, {"s1", "", {1000}, grad.data()}},
                         Deadline())
                  .ok());
  request.set_min_version(1);
  request.add_slices(0);
  request.add_slices(1);
  request.add_slices(3);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
  std::unique_ptr<grpc::ClientReader<PullResponse>> reader = stub_->Pull(&context, request);
  PullResponse first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.version(), 1);
  ASSERT_EQ(first.chunk_size(), 2);
  EXPECT_EQ(first.chunk(0).name(), "s0");
  EXPECT_EQ(first.chunk(1).name(), "s1");
  PullResponse more;
  EXPECT_FALSE(reader->Read(&more)) << "s2 is not at version 1";
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(PsServiceTest, PullDeadline) {
  ASSERT_TRUE(InitJob().ok());
  absl::StatusOr<Pulled> p = PullAll(1, absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kDeadlineExceeded) << p.status();
}

TEST_F(PsServiceTest, GarbagePushesAreRejectedAndTheServerKeepsWorking) {
  ASSERT_TRUE(InitJob().ok());
  PushRequest first;
  first.mutable_header()->set_job_id(kJob);
  first.mutable_header()->set_worker(0);
  first.mutable_header()->set_step(0);
  const std::vector<float> ten(10, 1.0f);
  auto chunk = [&](PushRequest* r, const std::string& name, std::vector<int64_t> shape,
                   DataType dtype) {
    TensorChunk* c = r->add_chunk();
    c->set_name(name);
    c->set_dtype(dtype);
    for (int64_t d : shape) c->add_shape(d);
    c->set_data(reinterpret_cast<const char*>(ten.data()), ten.size() * 4);
  };
  struct Case {
    std::string what;
    std::vector<PushRequest> requests;
    std::string message;
  };
  std::vector<Case> cases;
  {
    PushRequest r = first;
    chunk(&r, "bias", {11}, DT_FLOAT);
    cases.push_back({"wrong shape", {r}, "shape"});
  }
  {
    PushRequest r = first;
    chunk(&r, "nope", {10}, DT_FLOAT);
    cases.push_back({"unknown name", {r}, "unknown tensor 'nope'"});
  }
  {
    PushRequest r = first;
    chunk(&r, "bias", {10}, DT_INVALID);
    cases.push_back({"wrong dtype", {r}, "dtype"});
  }
  {
    PushRequest r = first;
    chunk(&r, "bias", {10}, DT_FLOAT);  // "big" never arrives
    cases.push_back({"incomplete", {r}, "'big' incomplete"});
  }
  {
    PushRequest r;
    chunk(&r, "bias", {10}, DT_FLOAT);
    cases.push_back({"no header", {r}, "header"});
  }
  {
    PushRequest again = first;
    again.clear_header();
    chunk(&again, "bias", {10}, DT_FLOAT);
    PushRequest r = first;
    chunk(&r, "bias", {10}, DT_FLOAT);
    cases.push_back({"bias twice, across messages", {r, again}, "expected byte 40"});
  }
  for (const Case& c : cases) {
    grpc::Status s = RawPush(c.requests);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.what << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.what;
  }
  // Gradients of the wrong size through the client fail the same way.
  PushHeader header = first.header();
  const std::vector<float> nine(9, 0.0f);
  absl::StatusOr<PushResponse> r = client_->Push(
      0, header, {{"big", "", kBigShape, big_.data()}, {"bias", "", {9}, nine.data()}}, Deadline());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();

  // Nothing was applied. A slice that arrived complete before the bad chunk
  // stays pushed: "incomplete" and "bias twice" handed worker 0's bias of
  // ones over first, and the wrong-size push its big of big_'s values; the
  // rest of the garbage left nothing. So worker 0's good push is a
  // duplicate, and its gradients are those.
  EXPECT_EQ(shard_.stats().version, 0);
  const std::vector<float> gbig = Pattern(big_.size(), 3, 1.0f), gbias = Pattern(10, 2, 2.0f);
  ASSERT_TRUE(PushAll(0, 0, gbig, gbias).ok());
  EXPECT_EQ(shard_.stats().version, 0);
  ASSERT_TRUE(PushAll(1, 0, gbig, gbias).ok());
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, SgdAfter(big_, big_, gbig));
  EXPECT_EQ(p->bias, SgdAfter(bias_, ten, gbias));
}

// The value of an unlabelled series in `text` (Prometheus' format), or -1.
double Series(const std::string& text, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

// A push that leaves a slice short is refused even where the ps decodes it
// into a buffer of an earlier step (full-size, holding that step's values).
TEST_F(PsServiceTest, AShortPushIntoAReusedBufferIsRefused) {
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> g_big = Pattern(big_.size(), 3, 1.0f), g_bias = Pattern(10, 2, 2.0f);
  ASSERT_TRUE(PushAll(0, 0, g_big, g_bias).ok());
  ASSERT_TRUE(PushAll(1, 0, g_big, g_bias).ok());
  ASSERT_TRUE(PullAll(1).ok());
  // Step 1: worker 0 sends half of "big" and all of "bias".
  PushRequest r;
  r.mutable_header()->set_job_id(kJob);
  r.mutable_header()->set_worker(0);
  r.mutable_header()->set_step(1);
  TensorChunk* c = r.add_chunk();
  c->set_name("big");
  c->set_dtype(DT_FLOAT);
  for (int64_t d : kBigShape) c->add_shape(d);
  c->set_data(reinterpret_cast<const char*>(g_big.data()), g_big.size() * 2);
  c = r.add_chunk();
  c->set_name("bias");
  c->set_dtype(DT_FLOAT);
  c->add_shape(10);
  c->set_data(reinterpret_cast<const char*>(g_bias.data()), 40);
  grpc::Status s = RawPush({r});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("'big' incomplete"));
  // Its "big" was not handed over: the full pushes of step 1 apply exactly.
  const std::vector<float> h_big = Pattern(big_.size(), 5, 0.5f);
  ASSERT_TRUE(PushAll(0, 1, h_big, g_bias).ok());
  ASSERT_TRUE(PushAll(1, 1, h_big, g_bias).ok());
  absl::StatusOr<Pulled> p = PullAll(2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, SgdAfter(SgdAfter(big_, g_big, g_big), h_big, h_big));
}

// A client on the ps's host offers shared memory: its pushes and pulls go
// through it, with the same results as over the network; with channels,
// their messages go through same-host channels too.
class SharedPathTest : public PsServiceTest, public ::testing::WithParamInterface<bool> {};

TEST_P(SharedPathTest, PushesAndPullsThroughSharedMemoryGiveTheSameWeights) {
  const bool channels = GetParam();
  client_ = SharedClient(channels);
  ASSERT_TRUE(InitJob().ok());
  absl::StatusOr<Pulled> p0 = PullAll(0);
  ASSERT_TRUE(p0.ok()) << p0.status();
  EXPECT_EQ(p0->big, big_);
  EXPECT_EQ(p0->bias, bias_);
  EXPECT_GE(Series(server_metrics_.Render(), "psflow_ps_shared_regions"), 1);
  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  const std::vector<float> g1_big = Pattern(big_.size(), 5, -0.5f), g1_bias = Pattern(10, 4, 0.5f);
  for (int step = 0; step < 3; ++step) {
    absl::Notification pulled;
    absl::StatusOr<Pulled> next;
    std::thread puller([&] {
      next = PullAll(step + 1);
      pulled.Notify();
    });
    // The ps applies the fp32 gradients where they lie in the regions, so
    // it answers worker 0's push only once worker 1's has come too and the
    // step is applied (the region is the worker's again after the answer).
    std::atomic<bool> second_sent{false};
    absl::StatusOr<PushResponse> r0;
    bool answered_after_second = false;
    int64_t version_at_answer = -1;
    std::thread first([&] {
      r0 = PushAll(0, step, g0_big, g0_bias);
      answered_after_second = second_sent.load();
      version_at_answer = shard_.stats().version;
    });
    absl::SleepFor(absl::Milliseconds(100));
    second_sent = true;
    absl::StatusOr<PushResponse> r1 = PushAll(1, step, g1_big, g1_bias);
    first.join();
    ASSERT_TRUE(r0.ok()) << r0.status();
    EXPECT_EQ(r0->outcome(), PushResponse::ACCEPTED);
    EXPECT_TRUE(answered_after_second);
    EXPECT_EQ(version_at_answer, step + 1);
    ASSERT_TRUE(r1.ok()) << r1.status();
    EXPECT_EQ(r1->version(), step + 1);
    ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
    puller.join();
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next->version, step + 1);
    p0->big = SgdAfter(p0->big, g0_big, g1_big);
    p0->bias = SgdAfter(p0->bias, g0_bias, g1_bias);
    EXPECT_EQ(next->big, p0->big) << "step " << step;
    EXPECT_EQ(next->bias, p0->bias) << "step " << step;
  }
  // Every call went through shared memory: the first pull, then each step's
  // two pushes and one pull; with channels, through them.
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 10);
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_channel_calls_total"), channels ? 10 : 0);
  // One channel per call in flight at once (two pushes and a pull), reused.
  const int open = service_->open_channels();
  EXPECT_EQ(Series(server_metrics_.Render(), "psflow_ps_channels"), open);
  if (channels) {
    EXPECT_GE(open, 1);
    EXPECT_LE(open, 3);
  } else {
    EXPECT_EQ(open, 0);
  }
  // The regions are reused from call to call: a few for the whole run (and
  // one per channel).
  const double regions = Series(server_metrics_.Render(), "psflow_ps_shared_regions");
  EXPECT_GE(regions, 1 + open);
  EXPECT_LE(regions, 4 + open);
  // Both sides count the tensors' bytes as they would over the network.
  const double fp32_bytes = 4.0 * (NumElements(kBigShape) + NumElements(kBiasShape));
  EXPECT_EQ(client_metrics_.GetHistogram("psflow_push_bytes", "", {})->snapshot().sum,
            6 * fp32_bytes);
  EXPECT_EQ(server_metrics_.GetHistogram("psflow_ps_pull_bytes", "", {})->snapshot().sum,
            4 * fp32_bytes);
}

INSTANTIATE_TEST_SUITE_P(GrpcAndChannels, SharedPathTest, ::testing::Bool());

// A push whose gradients the ps applies in the worker's region waits for
// the step; at its deadline it ends (the worker drops that region), and the
// ps, whose mapping keeps the memory, still applies what it took. A ps with
// apply_in_place off copies them out and answers at once.
TEST_F(PsServiceTest, AHeldPushEndsAtItsDeadlineAndACopyingPsAnswersAtOnce) {
  client_ = std::make_unique<GrpcClient>(
      std::vector<std::string>{address_},
      GrpcClientOptions{.metrics = &client_metrics_, .shared_memory = true});
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  const std::vector<float> g1_big = Pattern(big_.size(), 5, -0.5f), g1_bias = Pattern(10, 4, 0.5f);
  PushHeader h;
  h.set_job_id(kJob);
  h.set_worker(0);
  h.set_step(0);
  const absl::Time asked = absl::Now();
  absl::StatusOr<PushResponse> held = client_->Push(
      0, h, {{"big", "", kBigShape, g0_big.data()}, {"bias", "", kBiasShape, g0_bias.data()}},
      asked + absl::Milliseconds(300));
  EXPECT_EQ(held.status().code(), absl::StatusCode::kDeadlineExceeded) << held.status();
  EXPECT_LT(absl::Now() - asked, absl::Seconds(5));
  EXPECT_EQ(shard_.stats().version, 0);
  absl::StatusOr<PushResponse> r1 = PushAll(1, 0, g1_big, g1_bias);
  ASSERT_TRUE(r1.ok()) << r1.status();
  absl::StatusOr<Pulled> p1 = PullAll(1);
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_EQ(p1->big, SgdAfter(big_, g0_big, g1_big));
  EXPECT_EQ(p1->bias, SgdAfter(bias_, g0_bias, g1_bias));

  Shard shard;
  PsService copying(&shard, {.apply_in_place = false});
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&copying, &port);
  ASSERT_NE(server, nullptr);
  client_ = std::make_unique<GrpcClient>(
      std::vector<std::string>{absl::StrCat("127.0.0.1:", port)},
      GrpcClientOptions{.metrics = &client_metrics_, .shared_memory = true});
  ASSERT_TRUE(InitJob().ok());
  absl::StatusOr<PushResponse> r0 = PushAll(0, 0, g0_big, g0_bias);
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_EQ(shard.stats().version, 0) << "answered before worker 1 pushed";
  ASSERT_TRUE(PushAll(1, 0, g1_big, g1_bias).ok());
  absl::StatusOr<Pulled> q1 = PullAll(1);
  ASSERT_TRUE(q1.ok()) << q1.status();
  EXPECT_EQ(q1->big, p1->big);
  EXPECT_EQ(q1->bias, p1->bias);
  EXPECT_GT(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 0);
  shard.Shutdown();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

// Pulled fp32 values may be left in the call's region where it is pinned
// (a GPU worker uploads them from there): each sink that borrows points at
// its values there, its own memory untouched, and the result's hold keeps
// the region from later calls until it is dropped. Unpinned regions, and
// the network, copy into the sinks as before.
TEST_F(PsServiceTest, PulledValuesAreLeftInPinnedRegionsWhileHeld) {
  for (const bool pin : {true, false}) {
    SCOPED_TRACE(pin ? "pinned" : "not pinned");
    client_ = std::make_unique<GrpcClient>(
        std::vector<std::string>{address_},
        GrpcClientOptions{
            .connections_per_ps = 2, .metrics = &client_metrics_, .shared_memory = true});
    int pinned = 0, unpinned = 0;
    client_->shared_memory()->SetRegionPinning(
        [&](void*, size_t) {
          pinned += pin;
          return pin;
        },
        [&](void*) { ++unpinned; });
    ASSERT_TRUE(InitJob().ok());
    auto floats = [](const void* at, size_t n) {
      const float* f = static_cast<const float*>(at);
      return std::vector<float>(f, f + n);
    };
    auto pull = [&](int64_t version, std::vector<float>* big, std::vector<float>* bias,
                    const void** big_at, const void** bias_at) {
      big->assign(NumElements(kBigShape), -1);
      bias->assign(NumElements(kBiasShape), -1);
      TensorSink big_sink{"big", "", kBigShape, big->data()};
      big_sink.borrow = big_at;
      TensorSink bias_sink{"bias", "", kBiasShape, bias->data()};
      bias_sink.borrow = bias_at;
      return client_->Pull(0, kJob, version, {}, {big_sink, bias_sink}, Deadline(),
                           absl::ZeroDuration());
    };
    std::vector<float> big0, bias0;
    const void *big0_at = big_.data(), *bias0_at = bias_.data();
    absl::StatusOr<Client::PullResult> p0 = pull(0, &big0, &bias0, &big0_at, &bias0_at);
    ASSERT_TRUE(p0.ok()) << p0.status();
    if (!pin) {
      EXPECT_EQ(p0->hold, nullptr);
      EXPECT_EQ(big0_at, nullptr);
      EXPECT_EQ(bias0_at, nullptr);
      EXPECT_EQ(big0, big_);
      EXPECT_EQ(bias0, bias_);
      continue;
    }
    EXPECT_EQ(pinned, 1);
    ASSERT_NE(p0->hold, nullptr);
    ASSERT_NE(big0_at, nullptr);
    ASSERT_NE(bias0_at, nullptr);
    EXPECT_EQ(floats(big0_at, big_.size()), big_);
    EXPECT_EQ(floats(bias0_at, 10), bias_);
    EXPECT_EQ(big0, std::vector<float>(big_.size(), -1)) << "the sink's memory is untouched";
    // A step later, the held values are still version 0's: the next pull
    // went to another region.
    const std::vector<float> g_big = Pattern(big_.size(), 7, 0.25f), g_bias = Pattern(10, 3, 1.0f);
    auto [r0, r1] = PushBoth(0, g_big, g_bias, g_big, g_bias);
    ASSERT_TRUE(r0.ok()) << r0.status();
    ASSERT_TRUE(r1.ok()) << r1.status();
    std::vector<float> big1, bias1;
    const void *big1_at = nullptr, *bias1_at = nullptr;
    absl::StatusOr<Client::PullResult> p1 = pull(1, &big1, &bias1, &big1_at, &bias1_at);
    ASSERT_TRUE(p1.ok()) << p1.status();
    ASSERT_NE(big1_at, nullptr);
    EXPECT_NE(big1_at, big0_at);
    EXPECT_EQ(floats(big1_at, big_.size()), SgdAfter(big_, g_big, g_big));
    EXPECT_EQ(floats(big0_at, big_.size()), big_);
    // Let go, a region is leased again (the pool keeps it; nothing unpinned).
    // (The two pushes each had one of their own: they were answered once
    // the step was applied, so both were leased at once.)
    p0->hold.reset();
    p1->hold.reset();
    const int made = pinned;
    EXPECT_GE(made, 3);
    std::vector<float> big2, bias2;
    const void *big2_at = nullptr, *bias2_at = nullptr;
    absl::StatusOr<Client::PullResult> p2 = pull(1, &big2, &bias2, &big2_at, &bias2_at);
    ASSERT_TRUE(p2.ok()) << p2.status();
    EXPECT_EQ(pinned, made) << "no region made for the pull";
    EXPECT_EQ(unpinned, 0);
    p2->hold.reset();
    client_.reset();  // the pool goes, and its pinned regions are unpinned
    EXPECT_EQ(unpinned, made);
  }
}

// A push in runs sends each run once its wait returns: the ps applies a
// slice whose run has arrived (from every worker) while the push's later
// runs are still to come. A wait that fails ends the push with its error,
// which is not counted as a failed call. Over the network and through
// shared memory alike.
class PushInRunsTest : public PsServiceTest, public ::testing::WithParamInterface<int> {
 protected:
  // 0: over the network; 1: through shared memory; 2: and channels.
  bool shared() const { return GetParam() >= 1; }
  bool channels() const { return GetParam() == 2; }

  void UseClientOfParam() {
    client_ = std::make_unique<GrpcClient>(std::vector<std::string>{address_},
                                           GrpcClientOptions{.connections_per_ps = 2,
                                                             .metrics = &client_metrics_,
                                                             .shared_memory = shared(),
                                                             .channels = channels()});
  }

  static PushHeader StepHeader(int worker, int64_t step) {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(worker);
    h.set_step(step);
    return h;
  }

  absl::StatusOr<PushResponse> PushInRuns(const PushHeader& h, const std::vector<float>& g_big,
                                          const std::vector<float>& g_bias,
                                          const Client::PushRuns& runs) {
    return client_->PushInRuns(
        0, h, {{"big", "", kBigShape, g_big.data()}, {"bias", "", kBiasShape, g_bias.data()}}, runs,
        Deadline());
  }

  // Step 0: worker 0 pushes in runs, "big", then "bias" once the test lets
  // it go; meanwhile "big" is applied, and a pull given up ends at once.
  // Worker 1 pushes both at once.
  void PushStepZeroInRuns(const std::vector<float>& g_big, const std::vector<float>& g_bias) {
    // (Through shared memory, worker 1's push is answered once the step is
    // applied: after worker 0's below.)
    absl::StatusOr<PushResponse> pushed1;
    std::thread pusher1([&] { pushed1 = PushAll(1, 0, g_big, g_bias); });
    absl::Notification release, waited_for_bias;
    // The client checks each run before it leaves (both within range here).
    std::vector<std::pair<int, bool>> checks;
    Client::PushRuns runs{{0, 1},
                          [&](int run) {
                            if (run == 1) {
                              waited_for_bias.Notify();
                              release.WaitForNotification();
                            }
                            return absl::OkStatus();
                          },
                          [&](int run, bool ok) {
                            checks.emplace_back(run, ok);
                            return absl::OkStatus();
                          },
                          65520.0f};
    absl::StatusOr<PushResponse> pushed;
    std::thread pusher([&] { pushed = PushInRuns(StepHeader(0, 0), g_big, g_bias, runs); });
    ASSERT_TRUE(waited_for_bias.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_NO_FATAL_FAILURE(ExpectBigAppliedWhileBiasWaits(g_big));
    ExpectAPullGivenUpEndsAtOnce();
    release.Notify();
    pusher.join();
    pusher1.join();
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    ASSERT_TRUE(pushed1.ok()) << pushed1.status();
    EXPECT_THAT(checks, ::testing::ElementsAre(std::pair(0, true), std::pair(1, true)));
  }

  // "big" is applied while the push waits for "bias".
  void ExpectBigAppliedWhileBiasWaits(const std::vector<float>& g_big) {
    std::vector<float> big(big_.size(), -1);
    absl::StatusOr<Client::PullResult> first = client_->Pull(
        0, kJob, 1, {0}, {{"big", "", kBigShape, big.data()}}, Deadline(), absl::Seconds(10));
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(big, SgdAfter(big_, g_big, g_big));
    EXPECT_EQ(shard_.stats().version, 0) << "bias is still to come";
  }

  // A pull of both, given up while the ps waits for "bias", ends at once
  // (not at its deadline) and counts as no failed call.
  void ExpectAPullGivenUpEndsAtOnce() {
    std::atomic<bool> give_up{false};
    std::vector<float> big(big_.size(), -1), bias(10, -1);
    const absl::Time asked = absl::Now();
    std::thread giver([&] {
      absl::SleepFor(absl::Milliseconds(200));
      give_up = true;
    });
    absl::StatusOr<Client::PullResult> given_up = client_->PullUnlessGivenUp(
        0, kJob, 1, {0, 1},
        {{"big", "", kBigShape, big.data()}, {"bias", "", kBiasShape, bias.data()}}, Deadline(),
        absl::Seconds(10), give_up);
    giver.join();
    EXPECT_EQ(given_up.status().code(), absl::StatusCode::kCancelled) << given_up.status();
    EXPECT_LT(absl::Now() - asked, absl::Seconds(5));
    EXPECT_THAT(client_metrics_.Render(), Not(HasSubstr("CANCELLED")));
  }

  // Step 0 applied, through shared memory and channels as the parameter says.
  void ExpectStepZeroApplied(const std::vector<float>& g_big, const std::vector<float>& g_bias) {
    absl::StatusOr<Pulled> p = PullAll(1);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->big, SgdAfter(big_, g_big, g_big));
    EXPECT_EQ(p->bias, SgdAfter(bias_, g_bias, g_bias));
    EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total") > 0, shared());
    EXPECT_EQ(Series(client_metrics_.Render(), "psflow_channel_calls_total") > 0, channels());
  }

  // Step 1: the second run's wait fails; the push ends with its error.
  void ExpectAFailingWaitEndsThePush(const std::vector<float>& g_big,
                                     const std::vector<float>& g_bias) {
    Client::PushRuns failing{{0, 1},
                             [](int run) {
                               return run == 1 ? absl::CancelledError("the step is not finite")
                                               : absl::OkStatus();
                             },
                             nullptr};
    absl::StatusOr<PushResponse> cut = PushInRuns(StepHeader(0, 1), g_big, g_bias, failing);
    EXPECT_EQ(cut.status(), absl::CancelledError("the step is not finite"));
    EXPECT_THAT(client_metrics_.Render(), Not(HasSubstr("CANCELLED")));
    EXPECT_EQ(shard_.stats().version, 1);
  }

  // Worker 1, step 1: "big" is below fp16's limit and leaves; "bias"
  // holds 70000, beyond it: checked(1, false) ends the push before any of
  // it leaves, and the step is not applied.
  void ExpectARefusedRunEndsThePush(const std::vector<float>& g_big,
                                    const std::vector<float>& g_bias) {
    std::vector<float> big_bias = g_bias;
    big_bias[3] = 70000.0f;
    std::vector<std::pair<int, bool>> checks;
    Client::PushRuns refusing{{0, 1},
                              [](int) { return absl::OkStatus(); },
                              [&](int run, bool ok) {
                                checks.emplace_back(run, ok);
                                return ok ? absl::OkStatus()
                                          : absl::CancelledError("the step is not finite");
                              },
                              65520.0f};
    absl::StatusOr<PushResponse> refused = PushInRuns(StepHeader(1, 1), g_big, big_bias, refusing);
    EXPECT_EQ(refused.status(), absl::CancelledError("the step is not finite"));
    EXPECT_THAT(checks, ::testing::ElementsAre(std::pair(0, true), std::pair(1, false)));
    EXPECT_EQ(shard_.stats().version, 1);
  }
};

TEST_P(PushInRunsTest, APushInRunsIsAppliedRunByRun) {
  {
    UseClientOfParam();
    ASSERT_TRUE(InitJob().ok());
    const std::vector<float> g_big = Pattern(big_.size(), 7, 0.25f), g_bias = Pattern(10, 3, 1.0f);
    ASSERT_NO_FATAL_FAILURE(PushStepZeroInRuns(g_big, g_bias));
    ASSERT_NO_FATAL_FAILURE(ExpectStepZeroApplied(g_big, g_bias));
    ExpectAFailingWaitEndsThePush(g_big, g_bias);
    ExpectARefusedRunEndsThePush(g_big, g_bias);
  }
}

INSTANTIATE_TEST_SUITE_P(NetworkSharedMemoryAndChannels, PushInRunsTest,
                         ::testing::Values(0, 1, 2));

// Pulls waiting for the same step (each worker's, through shared memory and
// over the network) are all answered with its weights, whether the thread
// whose apply wakes them answers them one after the other or hands all but
// the first to the service's waker threads (PsService's spread_wakes).
class SpreadWakesTest : public PsServiceTest, public ::testing::WithParamInterface<bool> {};

TEST_P(SpreadWakesTest, EveryPullThatAnApplyWakesGetsItsWeights) {
  Shard shard;
  PsService service(&shard, {.spread_wakes = GetParam()});
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&service, &port);
  ASSERT_NE(server, nullptr);
  const std::vector<std::string> address = {absl::StrCat("127.0.0.1:", port)};
  auto shared = std::make_unique<GrpcClient>(
      address, GrpcClientOptions{.connections_per_ps = 2, .shared_memory = true});
  auto network = std::make_unique<GrpcClient>(address, GrpcClientOptions{.connections_per_ps = 2});
  ASSERT_TRUE(InitJob(Header(), shared.get()).ok());
  constexpr int kPulls = 6;
  std::vector<std::vector<float>> big(kPulls, std::vector<float>(big_.size(), -1));
  std::vector<std::vector<float>> bias(kPulls, std::vector<float>(bias_.size(), -1));
  std::vector<absl::StatusOr<Client::PullResult>> pulled(kPulls, absl::UnknownError("not run"));
  std::vector<std::thread> pullers;
  for (int i = 0; i < kPulls; ++i) {
    pullers.emplace_back([&, i] {
      Client& client = i % 2 == 0 ? *shared : *network;
      pulled[i] = client.Pull(
          0, kJob, 1, {},
          {{"big", "", kBigShape, big[i].data()}, {"bias", "", kBiasShape, bias[i].data()}},
          Deadline(), absl::Seconds(10));
    });
  }
  absl::SleepFor(absl::Milliseconds(100));  // the pulls wait for version 1
  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  const std::vector<float> g1_big = Pattern(big_.size(), 5, -0.5f), g1_bias = Pattern(10, 4, 0.5f);
  auto push = [&](int worker, const std::vector<float>& gbig, const std::vector<float>& gbias) {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(worker);
    h.set_step(0);
    return shared->Push(
        0, h, {{"big", "", kBigShape, gbig.data()}, {"bias", "", kBiasShape, gbias.data()}},
        Deadline());
  };
  absl::StatusOr<PushResponse> r0 = absl::UnknownError("not run");
  std::thread first([&] { r0 = push(0, g0_big, g0_bias); });
  absl::StatusOr<PushResponse> r1 = push(1, g1_big, g1_bias);
  first.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  for (std::thread& t : pullers) t.join();
  const std::vector<float> want_big = SgdAfter(big_, g0_big, g1_big);
  const std::vector<float> want_bias = SgdAfter(bias_, g0_bias, g1_bias);
  for (int i = 0; i < kPulls; ++i) {
    ASSERT_TRUE(pulled[i].ok()) << "pull " << i << ": " << pulled[i].status();
    EXPECT_EQ(pulled[i]->version, 1) << "pull " << i;
    EXPECT_EQ(big[i], want_big) << "pull " << i;
    EXPECT_EQ(bias[i], want_bias) << "pull " << i;
  }
  shard.Shutdown();
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

INSTANTIATE_TEST_SUITE_P(OnAndOff, SpreadWakesTest, ::testing::Bool());

// A push region (SharedMemoryClient::SetPushRegion) with room for both variables' fp32
// gradients, "big" from its start and "bias" right after it.
absl::StatusOr<std::shared_ptr<const SharedRegion>> PushRegionForBoth() {
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(
      SharedBytesFor((NumElements(kBigShape) + NumElements(kBiasShape)) * 4, 2));
  if (!made.ok()) return made.status();
  return std::shared_ptr<const SharedRegion>(*std::move(made));
}

// A ps of its own on loopback beside the fixture's, taking shared memory
// and serving channels as asked, shut down as it goes.
struct OtherPs {
  explicit OtherPs(bool shared_memory, bool channels = false, StreamLimits limits = {})
      : service(&shard, {.metrics = &metrics,
                         .limits = limits,
                         .shared_memory = shared_memory,
                         .channels = channels}),
        server(ServeOnLoopback(&service, &port)) {}
  ~OtherPs() {
    shard.Shutdown();
    if (server != nullptr) server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  // A client of it that offers shared memory (and channels with `channels`).
  std::unique_ptr<GrpcClient> SharedMemoryClient(
      metrics::Registry* client_metrics, bool channels = false,
      absl::Duration retry_shared_after = absl::Seconds(60)) const {
    return std::make_unique<GrpcClient>(
        std::vector<std::string>{address()},
        GrpcClientOptions{.metrics = client_metrics,
                          .shared_memory = true,
                          .channels = channels,
                          .retry_shared_after = retry_shared_after});
  }

  metrics::Registry metrics;
  Shard shard;
  PsService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// A ps that takes no shared memory gets the tensors over the network: the
// client's first call is refused, sent again without a region, and counts
// as no failed call; the calls after it offer no region until the retry
// window has passed, and then one call does.
TEST_F(PsServiceTest, APsWithoutSharedMemoryGetsTheTensorsOverTheNetwork) {
  OtherPs ps(/*shared_memory=*/false);
  ASSERT_NE(ps.server, nullptr);
  metrics::Registry& metrics = ps.metrics;
  constexpr absl::Duration kRetry = absl::Milliseconds(500);
  std::unique_ptr<GrpcClient> client =
      ps.SharedMemoryClient(&client_metrics_, /*channels=*/false, kRetry);
  client_ = std::move(client);
  ASSERT_TRUE(InitJob().ok());
  const absl::Time first = absl::Now();
  absl::StatusOr<Pulled> p0 = PullAll(0);
  ASSERT_TRUE(p0.ok()) << p0.status();
  EXPECT_EQ(p0->big, big_);
  const std::vector<float> g_big = Pattern(big_.size(), 7, 0.25f), g_bias = Pattern(10, 3, 1.0f);
  ASSERT_TRUE(PushAll(0, 0, g_big, g_bias).ok());
  ASSERT_TRUE(PushAll(1, 0, g_big, g_bias).ok());
  absl::StatusOr<Pulled> p1 = PullAll(1);
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_EQ(p1->big, SgdAfter(big_, g_big, g_big));
  EXPECT_EQ(p1->bias, SgdAfter(bias_, g_bias, g_bias));
  if (absl::Now() - first < kRetry) {
    EXPECT_EQ(Series(metrics.Render(), "psflow_ps_refused_regions_total"), 1);
  }
  // Past the window: the next call offers a region again, refused again.
  absl::SleepFor(kRetry + absl::Milliseconds(100));
  ASSERT_TRUE(PullAll(1).ok());
  const double refused = Series(metrics.Render(), "psflow_ps_refused_regions_total");
  EXPECT_GE(refused, 2);
  ASSERT_TRUE(PullAll(1).ok());
  EXPECT_EQ(Series(metrics.Render(), "psflow_ps_refused_regions_total"), refused);
  EXPECT_EQ(Series(metrics.Render(), "psflow_ps_shared_regions"), 0);
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 0);
  EXPECT_THAT(client_metrics_.Render(), Not(HasSubstr("FAILED_PRECONDITION")));
}

// Gradients in the push region reach a ps that takes no shared memory over
// the network: the region is offered, refused, and the push goes again
// from the same memory.
TEST_F(PsServiceTest, GradientsInThePushRegionReachAPsWithoutSharedMemory) {
  OtherPs ps(/*shared_memory=*/false);
  ASSERT_NE(ps.server, nullptr);
  client_ = ps.SharedMemoryClient(&client_metrics_);
  const int64_t big_n = NumElements(kBigShape), bias_n = NumElements(kBiasShape);
  absl::StatusOr<std::shared_ptr<const SharedRegion>> made = PushRegionForBoth();
  ASSERT_TRUE(made.ok()) << made.status();
  const std::shared_ptr<const SharedRegion> region = *std::move(made);
  ASSERT_TRUE(client_->shared_memory()->SetPushRegion(region));
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> g0 = Pattern(big_n, 7, 0.25f), gb0 = Pattern(bias_n, 3, 1.0f);
  const std::vector<float> g1 = Pattern(big_n, 5, -0.5f), gb1 = Pattern(bias_n, 4, 0.5f);
  float* const in_big = reinterpret_cast<float*>(region->data().data);
  float* const in_bias = in_big + big_n;
  std::copy(g1.begin(), g1.end(), in_big);
  std::copy(gb1.begin(), gb1.end(), in_bias);
  PushHeader h;
  h.set_job_id(kJob);
  h.set_worker(1);
  h.set_step(0);
  absl::StatusOr<PushResponse> r1 = client_->Push(
      0, h, {{"big", "", kBigShape, in_big}, {"bias", "", kBiasShape, in_bias}}, Deadline());
  ASSERT_TRUE(r1.ok()) << r1.status();
  ASSERT_TRUE(PushAll(0, 0, g0, gb0).ok());
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, SgdAfter(big_, g0, g1));
  EXPECT_EQ(p->bias, SgdAfter(bias_, gb0, gb1));
  EXPECT_GE(Series(ps.metrics.Render(), "psflow_ps_refused_regions_total"), 1);
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 0);
}

// Forged regions and chunks that reach outside their region are refused;
// the ps keeps working.
TEST_F(PsServiceTest, ForgedRegionsAndChunksOutsideTheirRegionAreRefused) {
  ASSERT_TRUE(InitJob().ok());
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  PushRequest first;
  first.mutable_header()->set_job_id(kJob);
  first.mutable_header()->set_worker(0);
  first.mutable_header()->set_step(0);
  *first.mutable_header()->mutable_region() = (*region)->ref();
  auto chunk = [](PushRequest* r, int64_t offset, int64_t bytes) {
    TensorChunk* c = r->add_chunk();
    c->set_name("bias");
    c->set_dtype(DT_FLOAT);
    c->add_shape(10);
    c->set_shared_offset(offset);
    c->set_shared_bytes(bytes);
  };
  // A descriptor of this process that is not a region; a wrong token.
  PushRequest forged = first;
  forged.mutable_header()->mutable_region()->set_fd(0);
  chunk(&forged, 0, 40);
  grpc::Status s = RawPush({forged});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("shared memory: "));
  forged = first;
  forged.mutable_header()->mutable_region()->set_token(std::string(kRegionTokenBytes, 'z'));
  chunk(&forged, 0, 40);
  s = RawPush({forged});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("another token"));
  // Outside the region, and shared chunks in a push that names none.
  PushRequest outside = first;
  chunk(&outside, (1 << 20) - 8, 40);
  s = RawPush({outside});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("of a shared region of"));
  // A region whose call failed is dropped, as its worker drops it.
  EXPECT_EQ(Series(server_metrics_.Render(), "psflow_ps_shared_regions"), 0);
  PushRequest no_region = first;
  no_region.mutable_header()->clear_region();
  chunk(&no_region, 0, 40);
  s = RawPush({no_region});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("has no region"));
  // A pull into a forged region.
  PullRequest pull;
  pull.set_job_id(kJob);
  *pull.mutable_region() = (*region)->ref();
  pull.mutable_region()->set_bytes(1);
  auto [messages, status] =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, pull); });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_TRUE(messages.empty());
  // A pull whose region is too small for its answer.
  *pull.mutable_region() = (*region)->ref();
  pull.add_slices(0);  // "big": 4.4 MB
  std::tie(messages, status) =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, pull); });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("too small"));
  EXPECT_EQ(Series(server_metrics_.Render(), "psflow_ps_shared_regions"), 0);
  // Nothing was applied, and the ps goes on.
  EXPECT_EQ(shard_.stats().version, 0);
  const std::vector<float> g_big = Pattern(big_.size(), 3, 1.0f), g_bias = Pattern(10, 2, 2.0f);
  ASSERT_TRUE(PushAll(0, 0, g_big, g_bias).ok());
  ASSERT_TRUE(PushAll(1, 0, g_big, g_bias).ok());
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->bias, SgdAfter(bias_, g_bias, g_bias));
}

TEST_F(PsServiceTest, NonFiniteGradientIsRefusedAndNothingOfItsSliceIsKept) {
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> gbig = Pattern(big_.size(), 3, 1.0f), gbias = Pattern(10, 2, 2.0f);
  // A NaN past the first chunk of "big", then an infinity in "bias": the
  // chunks before and after it are well formed.
  std::vector<float> nan_big = gbig;
  nan_big[nan_big.size() - 7] = std::numeric_limits<float>::quiet_NaN();
  absl::StatusOr<PushResponse> r = PushAll(0, 0, nan_big, gbias);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("non-finite gradient"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'big'"));
  EXPECT_EQ(shard_.stats().refused_pushes, 1);

  std::vector<float> inf_bias = gbias;
  inf_bias[4] = -std::numeric_limits<float>::infinity();
  const std::vector<float> other_big = Pattern(big_.size(), 5, 1.0f);
  r = PushAll(1, 0, other_big, inf_bias);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'bias'"));
  EXPECT_EQ(shard_.stats().refused_pushes, 2);
  EXPECT_EQ(shard_.stats().version, 0);

  // Both workers' good pushes are accepted. The refused slices left no
  // trace; worker 1's "big", complete and finite before its bias was
  // refused, stayed pushed (its second push of it is ignored).
  r = PushAll(0, 0, gbig, gbias);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outcome(), PushResponse::ACCEPTED);
  r = PushAll(1, 0, gbig, gbias);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outcome(), PushResponse::ACCEPTED);
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, SgdAfter(big_, gbig, other_big));
  EXPECT_EQ(p->bias, SgdAfter(bias_, gbias, gbias));
  EXPECT_EQ(shard_.stats().refused_pushes, 2);
}

TEST_F(PsServiceTest, PushForAnotherJobFails) {
  ASSERT_TRUE(InitJob().ok());
  PushHeader h;
  h.set_job_id(kJob + 1);
  absl::StatusOr<PushResponse> r = client_->Push(0, h, {}, Deadline());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
}

TEST_F(PsServiceTest, InitForAnotherPsIsRefused) {
  absl::Status s = InitJob(Header(/*ps_index=*/1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("init for ps 1"));
  EXPECT_EQ(shard_.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition)
      << "nothing loaded";
}

// This process's resident memory, from /proc/self/statm.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// A header alone allocates nothing: an Init stream that declares 1 GiB of
// values (and 2 GiB of Adam's slots), placed by its own job, and sends no
// data leaves the ps's memory as it was; it fails when it ends, nothing
// loaded.
TEST_F(PsServiceTest, AnInitHeaderAloneAllocatesNothing) {
  const InitHeader h = HugeInitHeader(kJob);
  const int64_t before = ResidentBytes();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(Deadline()));
  InitResponse response;
  std::unique_ptr<grpc::ClientWriter<InitRequest>> writer = stub_->Init(&context, &response);
  InitRequest request;
  *request.mutable_header() = h;
  ASSERT_TRUE(writer->Write(request));
  absl::SleepFor(absl::Milliseconds(500));  // the ps has read the header and waits for data
  EXPECT_LT(ResidentBytes() - before, int64_t{64} << 20);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("incomplete"));
  EXPECT_EQ(shard_.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition);
}

// An Init must name a job id, and its slices must be the job's placement.
TEST_F(PsServiceTest, InitWithoutAJobIdOrOffThePlacementIsRefused) {
  const std::vector<TensorRef> tensors = {{"big", "", kBigShape, big_.data()},
                                          {"bias", "", kBiasShape, bias_.data()}};
  InitHeader no_id = Header();
  no_id.set_job_id(0);
  absl::Status s = client_->Init(0, no_id, tensors, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("no job id"));
  InitHeader bigger = Header();
  bigger.mutable_slice(0)->set_shape(0, kBigShape[0] * 4);
  s = client_->Init(0, bigger, tensors, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not the job's placement"));
  InitHeader extra = Header();
  *extra.add_slice() = extra.slice(0);
  extra.mutable_slice(2)->set_name("extra");
  s = client_->Init(0, extra, tensors, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(shard_.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(InitJob().ok());
}

// This process's thread count, from /proc/self/status.
int Threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Pulls held open for a version that does not come hold no thread each, a
// peer (one client connection) over its bound of streams is refused at once
// with RESOURCE_EXHAUSTED, and another peer's step goes through meanwhile.
TEST_F(PsServiceTest, WaitingPullsHoldNoThreadAndAPeerIsBounded) {
  ASSERT_TRUE(InitJob().ok());
  const int before = Threads();
  std::shared_ptr<grpc::Channel> channel =
      MakeChannel(address_, Role::kPs, SecurityOptions{}, /*own_connection=*/true);
  std::unique_ptr<ParameterServer::Stub> stub = ParameterServer::NewStub(channel);
  struct Held {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientAsyncReader<PullResponse>> reader;
  };
  grpc::CompletionQueue cq;
  const int kCalls = StreamLimits{}.per_peer + 40;
  std::vector<std::unique_ptr<Held>> held;
  PullRequest request;
  request.set_job_id(kJob);
  request.set_min_version(1000);  // never reached here
  for (int i = 0; i < kCalls; ++i) {
    auto h = std::make_unique<Held>();
    h->reader = stub->AsyncPull(&h->context, request, &cq, h.get());
    held.push_back(std::move(h));
  }
  // The calls past the bound end at once, with RESOURCE_EXHAUSTED.
  int started = 0;
  for (int i = 0; i < kCalls; ++i) {
    void* tag = nullptr;
    bool ok = false;
    ASSERT_EQ(cq.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + absl::Seconds(10))),
              grpc::CompletionQueue::GOT_EVENT);
    ++started;
  }
  EXPECT_EQ(started, kCalls);
  std::vector<grpc::Status> finished(held.size());
  for (size_t i = 0; i < held.size(); ++i) held[i]->reader->Finish(&finished[i], &finished[i]);
  int refused = 0;
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (refused < 40) {
    void* tag = nullptr;
    bool ok = false;
    if (cq.AsyncNext(&tag, &ok, absl::ToChronoTime(until)) != grpc::CompletionQueue::GOT_EVENT) {
      break;
    }
    auto* status = static_cast<grpc::Status*>(tag);
    EXPECT_EQ(status->error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << status->error_message();
    ++refused;
  }
  EXPECT_EQ(refused, 40);
  EXPECT_GE(service_->refused_streams(), 40);
  // ... and counted on the ps's /metrics.
  EXPECT_THAT(server_metrics_.Render(), HasSubstr(absl::StrCat("\npsflow_ps_refused_streams_total ",
                                                               service_->refused_streams(), "\n")));
  // The admitted ones wait without a thread each.
  EXPECT_LT(Threads() - before, 20) << before << " threads before";
  // Another peer trains a step meanwhile.
  ASSERT_TRUE(PushAll(0, 0, big_, bias_).ok());
  ASSERT_TRUE(PushAll(1, 0, big_, bias_).ok());
  absl::StatusOr<Pulled> pulled = PullAll(1);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->version, 1);
  for (auto& h : held) h->context.TryCancel();
  for (size_t i = 0; i < held.size() - 40; ++i) {
    void* tag = nullptr;
    bool ok = false;
    cq.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

// Push and Init streams that show no header within the ps's
// first_message_timeout are cancelled and counted; a push whose header came
// in time may take longer over its data.
TEST_F(PsServiceTest, SilentStreamsAreCancelledAndCounted) {
  OtherPs ps(/*shared_memory=*/false, /*channels=*/false,
             StreamLimits{.first_message_timeout = absl::Milliseconds(300)});
  ASSERT_NE(ps.server, nullptr);
  GrpcClient member({ps.address()}, GrpcClientOptions{.metrics = &client_metrics_});
  ASSERT_TRUE(InitJob(Header(), &member).ok());
  const absl::Time start = absl::Now();
  testing_flood::StreamFlood flood(
      MakeChannel(ps.address(), Role::kPs, SecurityOptions{}, /*own_connection=*/true));
  flood.SilentPushes(3);
  flood.SilentInits(2);
  ASSERT_TRUE(flood.WaitEnded(5, absl::Seconds(10)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  // (A cancelled Init's caller sees its cancel.)
  EXPECT_EQ(flood.ended(),
            (std::map<grpc::StatusCode, int>{{grpc::StatusCode::CANCELLED, 2},
                                             {grpc::StatusCode::DEADLINE_EXCEEDED, 3}}));
  EXPECT_EQ(ps.service.timed_out_streams(), 5);
  EXPECT_THAT(ps.metrics.Render(), HasSubstr("\npsflow_ps_streams_timed_out_total 5\n"));

  // A header in time, then its data later than the timeout: accepted.
  std::unique_ptr<ParameterServer::Stub> stub =
      ParameterServer::NewStub(MakeChannel(ps.address(), Role::kPs, SecurityOptions{}, true));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(Deadline()));
  PushResponse response;
  std::unique_ptr<grpc::ClientWriter<PushRequest>> writer = stub->Push(&context, &response);
  PushRequest header;
  header.mutable_header()->set_job_id(kJob);
  header.mutable_header()->set_worker(0);
  header.mutable_header()->add_slices(1);  // "bias"
  ASSERT_TRUE(writer->Write(header));
  absl::SleepFor(absl::Milliseconds(600));
  PushRequest data;
  TensorChunk* chunk = data.add_chunk();
  chunk->set_name("bias");
  chunk->set_dtype(DT_FLOAT);
  for (int64_t d : kBiasShape) chunk->add_shape(d);
  chunk->set_data(bias_.data(), bias_.size() * sizeof(float));
  ASSERT_TRUE(writer->Write(data));
  writer->WritesDone();
  const grpc::Status pushed = writer->Finish();
  EXPECT_TRUE(pushed.ok()) << pushed.error_message();
  EXPECT_EQ(ps.service.timed_out_streams(), 5);
}

// Streams of connections the ps has not vouched for (no push header or Init
// accepted on them) may hold only the pending part of the budget: strangers'
// waiting pulls (with the job id) and silent pushes are refused over it,
// and the member that loaded the job still trains its steps.
TEST_F(PsServiceTest, StrangersCannotTakeTheStreamsOfTheJobsMembers) {
  OtherPs ps(/*shared_memory=*/false, /*channels=*/false,
             StreamLimits{.per_peer = 64, .total = 8, .pending = 4});
  ASSERT_NE(ps.server, nullptr);
  GrpcClient member({ps.address()}, GrpcClientOptions{.metrics = &client_metrics_});
  ASSERT_TRUE(InitJob(Header(), &member).ok());  // its connection is vouched for
  auto connection = [&] {
    return MakeChannel(ps.address(), Role::kPs, SecurityOptions{}, /*own_connection=*/true);
  };
  testing_flood::StreamFlood pulls(connection());
  pulls.WaitingPulls(6, kJob);
  ASSERT_TRUE(pulls.WaitEnded(2, absl::Seconds(10)));
  testing_flood::StreamFlood silent(connection());
  silent.SilentPushes(3);
  ASSERT_TRUE(silent.WaitEnded(3, absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(200));  // none other ends
  EXPECT_EQ(pulls.ended(),
            (std::map<grpc::StatusCode, int>{{grpc::StatusCode::RESOURCE_EXHAUSTED, 2}}));
  EXPECT_EQ(silent.ended(),
            (std::map<grpc::StatusCode, int>{{grpc::StatusCode::RESOURCE_EXHAUSTED, 3}}));
  EXPECT_EQ(ps.service.refused_streams(), 5);
  // The member's step: both workers' pushes, and the pull of its result.
  for (int w : {0, 1}) {
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(w);
    absl::StatusOr<PushResponse> r = member.Push(
        0, h, {{"big", "", kBigShape, big_.data()}, {"bias", "", kBiasShape, bias_.data()}},
        Deadline());
    ASSERT_TRUE(r.ok()) << r.status();
  }
  std::vector<float> big(big_.size()), bias(bias_.size());
  absl::StatusOr<Client::PullResult> pulled = member.Pull(
      0, kJob, 1, {}, {{"big", "", kBigShape, big.data()}, {"bias", "", kBiasShape, bias.data()}},
      Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->version, 1);
}

TEST_F(PsServiceTest, InitWithMissingValuesIsRefused) {
  absl::Status s = client_->Init(0, Header(), {{"big", "", kBigShape, big_.data()}}, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("'bias'"));
  EXPECT_EQ(shard_.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition);
  // A correct Init afterwards works.
  EXPECT_TRUE(InitJob().ok());
}

// A ps can hold no slice at all (more ps than variables to place; see
// PlacementTest.MorePsThanVariables); workers still pull from it and compare
// its version with the other ps'.
TEST_F(PsServiceTest, PullFromAPsWithoutSlicesReportsItsVersion) {
  InitHeader h = Header();
  // Every variable on the other ps of two.
  h.clear_slice();
  Placement* placement = h.mutable_job()->mutable_placement();
  placement->set_num_ps(2);
  for (VariablePlacement& v : *placement->mutable_variable()) v.mutable_slice(0)->set_ps(1);
  ASSERT_TRUE(client_->Init(0, h, {}, Deadline()).ok());
  PushHeader push;
  push.set_job_id(kJob);
  for (int w : {0, 1}) {
    push.set_worker(w);
    ASSERT_TRUE(client_->Push(0, push, {}, Deadline()).ok());
  }
  EXPECT_EQ(shard_.stats().version, 1);
  absl::StatusOr<Client::PullResult> r =
      client_->Pull(0, kJob, 1, {}, {}, Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version, 1);
}

// The bytes and durations of pushes and pulls on both sides, the failed
// calls by code on the client's, and on_job at each accepted Init.
TEST_F(PsServiceTest, MetricsCountPushesPullsAndFailedCallsAndInitTellsTheJob) {
  EXPECT_TRUE(job_calls_.empty());
  ASSERT_TRUE(InitJob().ok());
  EXPECT_EQ(job_calls_, std::vector<bool>{true});
  const std::vector<float> gbig(NumElements(kBigShape), 0.5f), gbias(NumElements(kBiasShape), 1);
  ASSERT_TRUE(PushAll(0, 0, gbig, gbias).ok());
  ASSERT_TRUE(PushAll(1, 0, gbig, gbias).ok());
  ASSERT_TRUE(PullAll(1).ok());
  const double fp32_bytes = 4.0 * (NumElements(kBigShape) + NumElements(kBiasShape));
  auto histogram = [](metrics::Registry& r, const char* name) {
    return r.GetHistogram(name, "", {})->snapshot();
  };
  for (metrics::Registry* r : {&server_metrics_, &client_metrics_}) {
    const bool server = r == &server_metrics_;
    SCOPED_TRACE(server ? "ps side" : "client side");
    const metrics::Histogram::Snapshot push_bytes =
        histogram(*r, server ? "psflow_ps_push_bytes" : "psflow_push_bytes");
    EXPECT_EQ(push_bytes.count, 2u);
    EXPECT_EQ(push_bytes.sum, 2 * fp32_bytes);
    EXPECT_EQ(histogram(*r, server ? "psflow_ps_push_seconds" : "psflow_push_seconds").count, 2u);
    const metrics::Histogram::Snapshot pull_bytes =
        histogram(*r, server ? "psflow_ps_pull_bytes" : "psflow_pull_bytes");
    EXPECT_EQ(pull_bytes.count, 1u);
    EXPECT_EQ(pull_bytes.sum, fp32_bytes);
    EXPECT_EQ(histogram(*r, server ? "psflow_ps_pull_seconds" : "psflow_pull_seconds").count, 1u);
  }
  // A pull answered "not yet" (max_wait passed before the version came)
  // carried nothing: neither side counts it.
  std::vector<float> big(NumElements(kBigShape)), bias(NumElements(kBiasShape));
  absl::StatusOr<Client::PullResult> not_yet = client_->Pull(
      0, kJob, 5, {}, {{"big", "", kBigShape, big.data()}, {"bias", "", kBiasShape, bias.data()}},
      Deadline(), absl::Milliseconds(50));
  ASSERT_TRUE(not_yet.ok()) << not_yet.status();
  EXPECT_EQ(not_yet->version, 1);
  for (metrics::Registry* r : {&server_metrics_, &client_metrics_}) {
    const bool server = r == &server_metrics_;
    SCOPED_TRACE(server ? "ps side, not yet" : "client side, not yet");
    EXPECT_EQ(histogram(*r, server ? "psflow_ps_pull_bytes" : "psflow_pull_bytes").count, 1u);
    EXPECT_EQ(histogram(*r, server ? "psflow_ps_pull_seconds" : "psflow_pull_seconds").count, 1u);
  }
  // A pull of another job fails: counted by method and code.
  EXPECT_TRUE(absl::IsFailedPrecondition(
      client_->Pull(0, kJob + 1, 0, {}, {}, Deadline(), absl::ZeroDuration()).status()));
  EXPECT_THAT(
      client_metrics_.Render(),
      HasSubstr("psflow_rpc_errors_total{service=\"psflow.ParameterServer\",method=\"Pull\","
                "code=\"FAILED_PRECONDITION\"} 1\n"));
}

TEST_F(PsServiceTest, GetStateReportsIndexJobVersionAndWorkers) {
  absl::StatusOr<PsState> st = client_->GetState(0, Deadline());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->ps_index(), 0);
  EXPECT_FALSE(st->holds_job());
  EXPECT_EQ(st->version(), 0);
  EXPECT_EQ(st->live_workers_size(), 0);

  ASSERT_TRUE(InitJob().ok());
  st = client_->GetState(0, Deadline());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->holds_job());
  EXPECT_EQ(st->job_id(), kJob);
  EXPECT_EQ(st->version(), 0);
  EXPECT_THAT(st->live_workers(), ::testing::ElementsAre(0, 1));
  EXPECT_EQ(st->job().SerializeAsString(), Header().job().SerializeAsString());

  const std::vector<float> gbig(big_.size(), 1.0f), gbias(10, 1.0f);
  ASSERT_TRUE(PushAll(0, 0, gbig, gbias).ok());
  ASSERT_TRUE(PushAll(1, 0, gbig, gbias).ok());
  ASSERT_TRUE(client_->SetLiveWorkers(0, kJob, {1}, 1, Deadline()).ok());
  st = client_->GetState(0, Deadline());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->version(), 1);
  EXPECT_THAT(st->live_workers(), ::testing::ElementsAre(1));

  // A ps with another index reports it (0 is also the proto default).
  Shard other_shard;
  PsService other(&other_shard, {.ps_index = 3});
  int port = 0;
  std::unique_ptr<grpc::Server> server = ServeOnLoopback(&other, &port);
  ASSERT_NE(server, nullptr);
  GrpcClient other_client({absl::StrCat("127.0.0.1:", port)});
  st = other_client.GetState(0, Deadline());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->ps_index(), 3);
  EXPECT_FALSE(st->holds_job());
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

// A snapshot's tensors of one variable: its value and Adam's m and v.
struct SnapshotTensors {
  std::vector<float> value, m, v;
};

SnapshotTensors FreshSnapshotTensors(int64_t n) {
  return SnapshotTensors{std::vector<float>(n, -1), std::vector<float>(n, -1),
                         std::vector<float>(n, -1)};
}

// The snapshot is exactly the shard's own copy at version 1 (where the
// shard is: taken at once).
void ExpectTheShardsSnapshot(Shard& shard, const SnapshotTensors& big,
                             const SnapshotTensors& bias) {
  SnapshotRequest request;
  request.set_job_id(kJob);
  request.set_version(1);
  SnapshotSession session(&shard, request, Deadline());
  ASSERT_TRUE(session.Request().ok());
  ASSERT_EQ(session.Next([] {}).action, SnapshotSession::Action::kSend);
  const Shard::Snapshot& taken = *session.snapshot();
  ASSERT_EQ(taken.slot_names, (std::vector<std::string>{"m", "v"}));
  ASSERT_EQ(taken.weights->values.size(), 2u);
  ASSERT_EQ(taken.slots.size(), 2u);
  EXPECT_TRUE(big.value == *taken.weights->values[0]);
  EXPECT_TRUE(big.m == taken.slots[0][0]);
  EXPECT_TRUE(big.v == taken.slots[0][1]);
  EXPECT_EQ(bias.value, *taken.weights->values[1]);
  EXPECT_EQ(bias.m, taken.slots[1][0]);
  EXPECT_EQ(bias.v, taken.slots[1][1]);
}

// Slots by hand: m = (1 - b1) g, v = (1 - b2) g^2, g the mean of both pushes.
void ExpectAdamSlotsAfterOneStep(const std::string& what, const SnapshotTensors& t,
                                 const std::vector<float>& g0, const std::vector<float>& g1) {
  int bad = 0, nonzero = 0;
  for (size_t i = 0; i < g0.size(); ++i) {
    const float g = (g0[i] + g1[i]) / 2;
    const float m = (1 - 0.9f) * g, v = (1 - 0.999f) * g * g;
    nonzero += g != 0;
    if (std::abs(t.m[i] - m) > 1e-6f * std::abs(m) || std::abs(t.v[i] - v) > 1e-6f * std::abs(v)) {
      if (++bad <= 3)
        ADD_FAILURE() << what << "[" << i << "]: m " << t.m[i] << " v " << t.v[i] << ", want " << m
                      << " " << v;
    }
  }
  EXPECT_EQ(bad, 0) << what;
  EXPECT_GT(nonzero, static_cast<int>(g0.size() / 2)) << what;
}

// On the wire: chunked below the default 4 MB, every message at version 1.
void ExpectSnapshotStreamChunked(ParameterServer::Stub& stub) {
  SnapshotRequest request;
  request.set_job_id(kJob);
  request.set_version(1);
  auto [messages, status] = ReadStream<SnapshotResponse>(
      [&](grpc::ClientContext* c) { return stub.Snapshot(c, request); });
  int64_t bytes = 0;
  for (const SnapshotResponse& response : messages) {
    EXPECT_LT(response.ByteSizeLong(), 4u << 20);
    EXPECT_EQ(response.version(), 1);
    for (const TensorChunk& c : response.chunk()) bytes += static_cast<int64_t>(c.data().size());
  }
  ASSERT_TRUE(status.ok());
  EXPECT_GE(messages.size(), 13u);
  EXPECT_EQ(bytes, 3 * (NumElements(kBigShape) + NumElements(kBiasShape)) * 4);
}

// A past version is refused; a future one waits until the deadline; another
// job is refused.
void ExpectSnapshotsOfOtherVersionsRefused(Client& client) {
  absl::Status s = client.Snapshot(0, kJob, 0, {}, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  s = client.Snapshot(0, kJob, 2, {}, absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  s = client.Snapshot(0, kJob + 1, 1, {}, Deadline());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

TEST_F(PsServiceTest, SnapshotStreamsValuesAndAdamSlots) {
  constexpr float kAdamLr = 0.125f;
  InitHeader h = Header();
  h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::ADAM);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(kAdamLr);
  ASSERT_TRUE(InitJob(h).ok());
  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  const std::vector<float> g1_big = Pattern(big_.size(), 5, -0.5f), g1_bias = Pattern(10, 4, 0.5f);
  ASSERT_TRUE(PushAll(0, 0, g0_big, g0_bias).ok());
  ASSERT_TRUE(PushAll(1, 0, g1_big, g1_bias).ok());
  ASSERT_EQ(shard_.stats().version, 1);

  // Over gRPC: 3 x 4.4 MB for "big" (value, m, v), well over one message.
  SnapshotTensors big = FreshSnapshotTensors(big_.size()),
                  bias = FreshSnapshotTensors(bias_.size());
  absl::Status s = client_->Snapshot(0, kJob, 1,
                                     {{"big", "", kBigShape, big.value.data()},
                                      {"big", "m", kBigShape, big.m.data()},
                                      {"big", "v", kBigShape, big.v.data()},
                                      {"bias", "", kBiasShape, bias.value.data()},
                                      {"bias", "m", kBiasShape, bias.m.data()},
                                      {"bias", "v", kBiasShape, bias.v.data()}},
                                     Deadline());
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_NO_FATAL_FAILURE(ExpectTheShardsSnapshot(shard_, big, bias));
  // Values equal what a Pull gives.
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(big.value == p->big);
  EXPECT_EQ(bias.value, p->bias);
  EXPECT_FALSE(big.value == big_) << "the step moved the weights";
  ExpectAdamSlotsAfterOneStep("big", big, g0_big, g1_big);
  ExpectAdamSlotsAfterOneStep("bias", bias, g0_bias, g1_bias);
  ASSERT_NO_FATAL_FAILURE(ExpectSnapshotStreamChunked(*stub_));
  ExpectSnapshotsOfOtherVersionsRefused(*client_);
}

TEST_F(PsServiceTest, SetLiveWorkersLetsAStepCompleteWithoutADroppedWorker) {
  ASSERT_TRUE(InitJob().ok());
  const std::vector<float> g0_big = Pattern(big_.size(), 7, 0.25f), g0_bias = Pattern(10, 3, 1.0f);
  ASSERT_TRUE(PushAll(0, 0, g0_big, g0_bias).ok());

  // Someone waits for version 1, which worker 1 (gone) would never allow.
  absl::Notification pulled;
  absl::StatusOr<Pulled> p1;
  std::thread puller([&] {
    p1 = PullAll(1);
    pulled.Notify();
  });
  EXPECT_FALSE(pulled.WaitForNotificationWithTimeout(absl::Milliseconds(50)));

  EXPECT_EQ(client_->SetLiveWorkers(0, kJob, {}, 0, Deadline()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->SetLiveWorkers(0, kJob + 1, {0}, 0, Deadline()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shard_.stats().version, 0);

  absl::Status s = client_->SetLiveWorkers(0, kJob, {0}, 0, Deadline());
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  puller.join();
  ASSERT_TRUE(p1.ok()) << p1.status();
  EXPECT_EQ(p1->version, 1);
  EXPECT_EQ(p1->big, SgdAfter(big_, g0_big, g0_big)) << "worker 0's gradient alone";
  EXPECT_EQ(p1->bias, SgdAfter(bias_, g0_bias, g0_bias));

  // Worker 1 is out.
  absl::StatusOr<PushResponse> r = PushAll(1, 1, g0_big, g0_bias);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // Worker 0 alone completes the next step.
  r = PushAll(0, 1, g0_big, g0_bias);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->version(), 2);
}

TEST_F(PsServiceTest, CheckpointTakenRpc) {
  EXPECT_EQ(client_->CheckpointTaken(0, kJob, Deadline()).code(),
            absl::StatusCode::kFailedPrecondition);  // no job yet
  ASSERT_TRUE(InitJob().ok());
  EXPECT_EQ(client_->CheckpointTaken(0, kJob + 1, Deadline()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(checkpoints_taken_.load(), 0);
  EXPECT_TRUE(client_->CheckpointTaken(0, kJob, Deadline()).ok());
  EXPECT_EQ(checkpoints_taken_.load(), 1);
  // It stops nothing by itself: the job is still there.
  EXPECT_FALSE(shutdown_.HasBeenNotified());
  absl::StatusOr<PsState> state = client_->GetState(0, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_FALSE(state->stopping());
  // A ps that waits for the chief's checkpoint says so.
  service_->SetStopping();
  state = client_->GetState(0, Deadline());
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(state->stopping());
}

TEST_F(PsServiceTest, ShutdownRpc) {
  ASSERT_TRUE(InitJob().ok());
  EXPECT_EQ(client_->Shutdown(0, kJob + 1, Deadline()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(shutdown_.HasBeenNotified());
  EXPECT_TRUE(client_->Shutdown(0, kJob, Deadline()).ok());
  EXPECT_TRUE(shutdown_.HasBeenNotified());
  // A ps that idles after its job (its server up for the health service)
  // looks gone to a chief that comes later: nothing to adopt.
  EXPECT_TRUE(absl::IsUnavailable(client_->GetState(0, Deadline()).status()));
  EXPECT_TRUE(absl::IsUnavailable(client_->SetLiveWorkers(0, kJob, {0}, 0, Deadline())));
}

std::vector<float> ThroughBfloat16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bfloat16ToFloat(FloatToBfloat16(v[i]));
  return out;
}

// A bf16 job: pulls and pushes cross in bf16, the shard keeps fp32 masters,
// Init and Snapshot stay fp32.
// With the shard's wire copies (psflow-ps --wire_copies) and without: the
// bf16 pulls send the copy the apply wrote, or encode the masters as they
// go; the same bytes either way.
class WireCopiesTest : public PsServiceTest, public ::testing::WithParamInterface<bool> {};

TEST_P(WireCopiesTest, Bfloat16PullAndPushKeepFp32Masters) {
  shard_.SetWireCopies(GetParam());
  InitHeader h = Header();
  h.mutable_job()->set_wire_dtype(JobConfig::BF16);
  // Values bf16 cannot hold (9 and more significant bits): 1 + 2^-10 steps.
  std::vector<float> big = big_;
  for (size_t i = 0; i < big.size(); ++i) big[i] += static_cast<float>(i % 3) * 0x1p-10f;
  ASSERT_NE(ThroughBfloat16(big), big);
  absl::Status init = client_->Init(
      0, h, {{"big", "", kBigShape, big.data()}, {"bias", "", kBiasShape, bias_.data()}},
      Deadline());
  ASSERT_TRUE(init.ok()) << init;

  // A pull in bf16 gives the rounded values, in half the bytes.
  std::vector<float> big16(big.size(), -1), bias16(bias_.size(), -1);
  absl::StatusOr<Client::PullResult> r =
      client_->Pull(0, kJob, 0, {},
                    {{"big", "", kBigShape, big16.data(), true, DT_BFLOAT16},
                     {"bias", "", kBiasShape, bias16.data(), true, DT_BFLOAT16}},
                    Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(big16, ThroughBfloat16(big));
  EXPECT_EQ(bias16, ThroughBfloat16(bias_));

  // Gradients pushed in bf16 arrive rounded (1 + 2^-9 becomes 1); the
  // update is applied to the fp32 masters, which keep their low bits.
  std::vector<float> g0 = Pattern(big.size(), 7, 0.25f), g1 = Pattern(big.size(), 5, -0.5f);
  for (size_t i = 0; i < g0.size(); ++i) g0[i] += static_cast<float>(i % 2) * 0x1p-9f;
  const std::vector<float> gb0 = Pattern(10, 3, 1.0f), gb1 = Pattern(10, 4, 0.5f);
  for (int w : {0, 1}) {
    absl::StatusOr<PushResponse> pushed =
        PushAll(w, 0, w == 0 ? g0 : g1, w == 0 ? gb0 : gb1, DT_BFLOAT16);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    EXPECT_EQ(pushed->outcome(), PushResponse::ACCEPTED);
  }
  ASSERT_EQ(shard_.stats().version, 1);
  const std::vector<float> masters = SgdAfter(big, ThroughBfloat16(g0), ThroughBfloat16(g1));
  ASSERT_NE(masters, SgdAfter(big, g0, g1)) << "the rounding of the gradients shows";
  ASSERT_NE(ThroughBfloat16(masters), masters) << "the masters have bits bf16 drops";

  // DT_FLOAT (what the chief asks for the saved model) gives the masters exactly.
  std::vector<float> big32(big.size(), -1), bias32(bias_.size(), -1);
  r = client_->Pull(0, kJob, 1, {},
                    {{"big", "", kBigShape, big32.data()}, {"bias", "", kBiasShape, bias32.data()}},
                    Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(big32, masters);
  EXPECT_EQ(bias32, SgdAfter(bias_, gb0, gb1));
  // A snapshot (checkpoints) is fp32 too.
  std::fill(big32.begin(), big32.end(), -1.0f);
  absl::Status snap = client_->Snapshot(
      0, kJob, 1, {{"big", "", kBigShape, big32.data()}, {"bias", "", kBiasShape, bias32.data()}},
      Deadline());
  ASSERT_TRUE(snap.ok()) << snap;
  EXPECT_EQ(big32, masters);

  // A pull that names no dtype gets the job's: bf16 chunks, 2 bytes a value.
  PullRequest request;
  request.set_job_id(kJob);
  request.set_min_version(1);
  auto [messages, status] =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, request); });
  int64_t bytes = 0;
  std::vector<float> raw(big.size(), -1);
  for (const PullResponse& response : messages) {
    for (const TensorChunk& c : response.chunk()) {
      EXPECT_EQ(c.dtype(), DT_BFLOAT16);
      EXPECT_EQ(c.offset() % 2, 0);
      if (c.name() == "big") {
        DecodeFloats(DT_BFLOAT16, c.data().data(), static_cast<int64_t>(c.data().size()) / 2,
                     raw.data() + c.offset() / 2);
      }
      bytes += static_cast<int64_t>(c.data().size());
    }
  }
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(bytes, (NumElements(kBigShape) + NumElements(kBiasShape)) * 2);
  EXPECT_EQ(raw, ThroughBfloat16(masters));
}

INSTANTIATE_TEST_SUITE_P(WithAndWithout, WireCopiesTest, ::testing::Bool());

// bf16 gradients pushed through shared memory are applied where they lie,
// widened as the apply reads them: the push is answered once the step is
// applied, and the masters are exactly those of the decoded gradients.
TEST_F(PsServiceTest, Bfloat16PushesThroughSharedMemoryAreAppliedWhereTheyLie) {
  client_ = std::make_unique<GrpcClient>(
      std::vector<std::string>{address_},
      GrpcClientOptions{
          .connections_per_ps = 2, .metrics = &client_metrics_, .shared_memory = true});
  InitHeader h = Header();
  h.mutable_job()->set_wire_dtype(JobConfig::BF16);
  absl::Status init = InitJob(h);
  ASSERT_TRUE(init.ok()) << init;
  std::vector<float> g0 = Pattern(big_.size(), 7, 0.25f), g1 = Pattern(big_.size(), 5, -0.5f);
  for (size_t i = 0; i < g0.size(); ++i) g0[i] += static_cast<float>(i % 2) * 0x1p-9f;
  const std::vector<float> gb0 = Pattern(10, 3, 1.0f), gb1 = Pattern(10, 4, 0.5f);
  std::atomic<bool> second_sent{false};
  bool answered_after_second = false;
  absl::StatusOr<PushResponse> r0;
  std::thread first([&] {
    r0 = PushAll(0, 0, g0, gb0, DT_BFLOAT16);
    answered_after_second = second_sent.load();
  });
  absl::SleepFor(absl::Milliseconds(100));
  second_sent = true;
  absl::StatusOr<PushResponse> r1 = PushAll(1, 0, g1, gb1, DT_BFLOAT16);
  first.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_TRUE(answered_after_second) << "the ps copied the gradients out";
  ASSERT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(shard_.stats().changed_after_check, 0);
  std::vector<float> big32(big_.size(), -1), bias32(bias_.size(), -1);
  absl::StatusOr<Client::PullResult> r =
      client_->Pull(0, kJob, 1, {},
                    {{"big", "", kBigShape, big32.data()}, {"bias", "", kBiasShape, bias32.data()}},
                    Deadline(), absl::ZeroDuration());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(big32, SgdAfter(big_, ThroughBfloat16(g0), ThroughBfloat16(g1)));
  EXPECT_EQ(bias32, SgdAfter(bias_, ThroughBfloat16(gb0), ThroughBfloat16(gb1)));
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 3);
}

// Gradients that lie in the client's push region (where a GPU worker's
// copies from the device land) go as they lie: the push names them there,
// so the ps applies what the region holds when it applies, which a change
// made after the run was sent shows. Gradients elsewhere are still copied
// into a region of the pool as the push sends them.
TEST_F(PsServiceTest, GradientsInThePushRegionAreSentWhereTheyLie) {
  client_ = std::make_unique<GrpcClient>(
      std::vector<std::string>{address_},
      GrpcClientOptions{
          .connections_per_ps = 2, .metrics = &client_metrics_, .shared_memory = true});
  ASSERT_TRUE(InitJob().ok());
  const int64_t big_n = NumElements(kBigShape), bias_n = NumElements(kBiasShape);
  absl::StatusOr<std::shared_ptr<const SharedRegion>> made = PushRegionForBoth();
  ASSERT_TRUE(made.ok()) << made.status();
  const std::shared_ptr<const SharedRegion> region = *std::move(made);
  ASSERT_NE(client_->shared_memory(), nullptr);
  ASSERT_TRUE(client_->shared_memory()->SetPushRegion(region));
  // A client without shared memory takes no region and sends nothing from it.
  GrpcClient without({address_});
  EXPECT_EQ(without.shared_memory(), nullptr);
  EXPECT_FALSE(without.SetPushRegion(region));
  float* const in_big = reinterpret_cast<float*>(region->data().data);
  float* const in_bias = in_big + big_n;
  const std::vector<float> g0 = Pattern(big_n, 7, 0.25f), gb0 = Pattern(bias_n, 3, 1.0f);
  const std::vector<float> g1 = Pattern(big_n, 5, -0.5f), gb1 = Pattern(bias_n, 4, 0.5f);
  const std::vector<float> later = Pattern(big_n, 9, 0.75f);
  std::vector<float> want_big = big_, want_bias = bias_;
  for (const bool from_region : {true, false}) {
    SCOPED_TRACE(from_region ? "from the push region" : "from other memory");
    const int64_t step = from_region ? 0 : 1;
    std::vector<float> own_big(big_n), own_bias(bias_n);
    float* const at_big = from_region ? in_big : own_big.data();
    float* const at_bias = from_region ? in_bias : own_bias.data();
    std::copy(g1.begin(), g1.end(), at_big);
    std::copy(gb1.begin(), gb1.end(), at_bias);
    // Worker 1 sends "big" in run 0 and changes it when run 1 is asked for;
    // worker 0 pushes only then, so that neither slice is applied before.
    absl::Notification changed;
    Client::PushRuns runs{{0, 1},
                          [&](int run) {
                            if (run == 1) {
                              std::copy(later.begin(), later.end(), at_big);
                              changed.Notify();
                            }
                            return absl::OkStatus();
                          },
                          nullptr};
    PushHeader h;
    h.set_job_id(kJob);
    h.set_worker(1);
    h.set_step(step);
    absl::StatusOr<PushResponse> r1;
    std::thread second([&] {
      r1 = client_->PushInRuns(0, h,
                               {{"big", "", kBigShape, at_big}, {"bias", "", kBiasShape, at_bias}},
                               runs, Deadline());
    });
    ASSERT_TRUE(changed.WaitForNotificationWithTimeout(absl::Seconds(20)));
    absl::StatusOr<PushResponse> r0 = PushAll(0, step, g0, gb0);
    second.join();
    ASSERT_TRUE(r0.ok()) << r0.status();
    ASSERT_TRUE(r1.ok()) << r1.status();
    absl::StatusOr<Pulled> p = PullAll(step + 1);
    ASSERT_TRUE(p.ok()) << p.status();
    want_big = SgdAfter(want_big, g0, from_region ? later : g1);
    want_bias = SgdAfter(want_bias, gb0, gb1);
    EXPECT_EQ(p->big, want_big);
    EXPECT_EQ(p->bias, want_bias);
  }
  // Every push and pull went through shared memory.
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 6);
}

// A push of gradients in the wire dtype already (TensorRef::encoded: a GPU
// worker's, rounded on the device) is applied as the same values rounded on
// the host are; a run whose encoded values hold an infinity is checked as
// not finite and leaves nothing.
TEST_P(PushInRunsTest, ValuesInTheWireDtypeAlreadyArePushedAsTheyLie) {
  client_ = std::make_unique<GrpcClient>(
      std::vector<std::string>{address_},
      GrpcClientOptions{
          .connections_per_ps = 2, .metrics = &client_metrics_, .shared_memory = GetParam() != 0});
  InitHeader init = Header();
  init.mutable_job()->set_wire_dtype(JobConfig::BF16);
  ASSERT_TRUE(InitJob(init).ok());
  const std::vector<float> g0 = Pattern(big_.size(), 7, 0.3f), gb0 = Pattern(10, 3, 1.1f);
  std::vector<float> g1 = Pattern(big_.size(), 5, -0.7f), gb1 = Pattern(10, 4, 0.9f);
  auto encode = [](const std::vector<float>& v) {
    std::vector<uint16_t> out(v.size());
    EncodeFloats(DT_BFLOAT16, v.data(), static_cast<int64_t>(v.size()),
                 reinterpret_cast<char*>(out.data()));
    return out;
  };
  std::vector<uint16_t> e1 = encode(g1), eb1 = encode(gb1);
  auto encoded_refs = [&] {
    std::vector<TensorRef> refs = {{"big", "", kBigShape, nullptr, DT_BFLOAT16},
                                   {"bias", "", kBiasShape, nullptr, DT_BFLOAT16}};
    refs[0].encoded = e1.data();
    refs[1].encoded = eb1.data();
    return refs;
  };
  std::vector<std::pair<int, bool>> checks;
  Client::PushRuns runs{{0, 1},
                        [](int) { return absl::OkStatus(); },
                        [&](int run, bool ok) {
                          checks.emplace_back(run, ok);
                          return ok ? absl::OkStatus()
                                    : absl::CancelledError("the step is not finite");
                        },
                        WireOverflow(DT_BFLOAT16)};
  PushHeader h;
  h.set_job_id(kJob);
  h.set_worker(1);
  h.set_step(0);
  absl::StatusOr<PushResponse> r1;
  std::thread second([&] { r1 = client_->PushInRuns(0, h, encoded_refs(), runs, Deadline()); });
  absl::StatusOr<PushResponse> r0 = PushAll(0, 0, g0, gb0, DT_BFLOAT16);
  second.join();
  ASSERT_TRUE(r0.ok()) << r0.status();
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_THAT(checks, ::testing::ElementsAre(std::pair(0, true), std::pair(1, true)));
  absl::StatusOr<Pulled> p = PullAll(1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, SgdAfter(big_, ThroughBfloat16(g0), ThroughBfloat16(g1)));
  EXPECT_EQ(p->bias, SgdAfter(bias_, ThroughBfloat16(gb0), ThroughBfloat16(gb1)));

  // Step 1: an infinity among the encoded bias values.
  gb1[2] = std::numeric_limits<float>::infinity();
  eb1 = encode(gb1);
  checks.clear();
  h.set_step(1);
  r1 = client_->PushInRuns(0, h, encoded_refs(), runs, Deadline());
  EXPECT_EQ(r1.status(), absl::CancelledError("the step is not finite"));
  EXPECT_THAT(checks, ::testing::ElementsAre(std::pair(0, true), std::pair(1, false)));
  EXPECT_EQ(shard_.stats().version, 1);
}

TEST_F(PsServiceTest, PushInAnotherDtypeThanTheJobsIsRefused) {
  InitHeader h = Header();
  h.mutable_job()->set_wire_dtype(JobConfig::BF16);
  ASSERT_TRUE(InitJob(h).ok());
  const std::vector<float> g(big_.size(), 1.0f), gb(10, 1.0f);
  for (DataType dtype : {DT_FLOAT, DT_HALF}) {
    absl::StatusOr<PushResponse> pushed = PushAll(0, 0, g, gb, dtype);
    EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInvalidArgument) << pushed.status();
    EXPECT_THAT(std::string(pushed.status().message()), HasSubstr("expected DT_BFLOAT16"));
  }
  // Nothing was kept: worker 0 may still push, and its push counts.
  ASSERT_TRUE(PushAll(1, 0, g, gb, DT_BFLOAT16).ok());
  EXPECT_EQ(shard_.stats().version, 0);
  absl::StatusOr<PushResponse> pushed = PushAll(0, 0, g, gb, DT_BFLOAT16);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->outcome(), PushResponse::ACCEPTED);
  EXPECT_EQ(pushed->version(), 1);
}

TEST_F(PsServiceTest, UnknownWireDtypesAreRefused) {
  InitHeader h = Header();
  h.mutable_job()->set_wire_dtype(static_cast<JobConfig::WireDtype>(7));
  absl::Status init = InitJob(h);
  EXPECT_EQ(init.code(), absl::StatusCode::kInvalidArgument) << init;
  EXPECT_THAT(std::string(init.message()), HasSubstr("wire dtype"));
  ASSERT_TRUE(InitJob().ok());
  PullRequest request;
  request.set_job_id(kJob);
  request.set_dtype(static_cast<DataType>(9));
  auto [messages, status] =
      ReadStream<PullResponse>([&](grpc::ClientContext* c) { return stub_->Pull(c, request); });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Same-host channels (transport/call_channel.h, transport/channel_server.h).

// A channel region of this process, formatted, and the ps's answer to
// opening it through the raw stub. `ref` may be altered first (`edit`).
struct OpenedChannel {
  std::unique_ptr<SharedRegion> region;
  grpc::Status status;
  int32_t ps_pid = 0;
};
OpenedChannel OpenRawChannel(ParameterServer::Stub* stub,
                             const std::function<void(SharedRegionRef*)>& edit = nullptr) {
  OpenedChannel opened;
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(ChannelRegionBytes());
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return opened;
  opened.region = *std::move(made);
  EXPECT_TRUE(ChannelEnd::Format(opened.region->data()).ok());
  OpenChannelRequest request;
  *request.mutable_region() = opened.region->ref();
  if (edit) edit(request.mutable_region());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(Deadline()));
  OpenChannelResponse response;
  opened.status = stub->OpenChannel(&context, request, &response);
  opened.ps_pid = response.pid();
  return opened;
}

bool WaitFor(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time end = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > end) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

TEST_F(PsServiceTest, ForgedOrMisfitChannelsAreRefused) {
  // Too small for a channel.
  OpenedChannel small = OpenRawChannel(stub_.get(), [](SharedRegionRef* r) { r->set_bytes(4096); });
  EXPECT_EQ(small.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(small.status.error_message(), HasSubstr("shared memory"));
  // A wrong token.
  OpenedChannel forged =
      OpenRawChannel(stub_.get(), [](SharedRegionRef* r) { r->set_token(std::string(16, 'x')); });
  EXPECT_EQ(forged.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // A region that holds no channel (never formatted).
  absl::StatusOr<std::unique_ptr<SharedRegion>> blank = SharedRegion::Create(ChannelRegionBytes());
  ASSERT_TRUE(blank.ok());
  OpenChannelRequest request;
  *request.mutable_region() = (*blank)->ref();
  grpc::ClientContext context;
  OpenChannelResponse response;
  const grpc::Status unformatted = stub_->OpenChannel(&context, request, &response);
  EXPECT_EQ(unformatted.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(unformatted.error_message(), HasSubstr("channel"));
  EXPECT_EQ(service_->open_channels(), 0);
  // A good one opens, and the ps says who it is.
  OpenedChannel good = OpenRawChannel(stub_.get());
  EXPECT_TRUE(good.status.ok()) << good.status.error_message();
  EXPECT_EQ(good.ps_pid, getpid());
  EXPECT_EQ(service_->open_channels(), 1);
}

// Garbage written into a channel closes it; the ps serves on.
TEST_F(PsServiceTest, GarbageInAChannelClosesItAndThePsServesOn) {
  ASSERT_TRUE(InitJob().ok());
  for (int garbage = 0; garbage < 3; ++garbage) {
    SCOPED_TRACE(garbage);
    OpenedChannel opened = OpenRawChannel(stub_.get());
    ASSERT_TRUE(opened.status.ok()) << opened.status.error_message();
    absl::StatusOr<std::unique_ptr<ChannelEnd>> end =
        ChannelEnd::Open(opened.region->data(), ChannelEnd::Side::kClient, nullptr);
    ASSERT_TRUE(end.ok());
    const absl::Time later = absl::Now() + absl::Seconds(5);
    if (garbage == 0) {
      // A start record of the wrong size.
      ASSERT_TRUE((*end)->Write(ChannelEnd::kStart, 1, "xy", later).ok());
    } else if (garbage == 1) {
      // A server's record.
      ASSERT_TRUE(
          (*end)->Write(ChannelEnd::kFinish, 1, EncodeFinish(grpc::Status::OK), later).ok());
    } else {
      // A pull whose request is not a PullRequest: the call fails, the
      // channel stays; then a ring position past the ring breaks it.
      ChannelCall call(end->get(), 1, static_cast<uint8_t>(ChannelMethod::kPull), later);
      EXPECT_TRUE(call.Write(MessageBuffer("\xff\xff\xff")));
      EXPECT_TRUE(call.WritesDone());
      const grpc::Status status = call.Finish();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
      EXPECT_FALSE((*end)->closed());
      auto* control = reinterpret_cast<ChannelEnd::Control*>(opened.region->data().data);
      std::atomic<uint64_t>* up_head = &control->up.head;
      up_head->store(uint64_t{1} << 40);
      (*end)->RingSelf();
    }
    EXPECT_TRUE(WaitFor([&] { return (*end)->closed(); }));
    EXPECT_TRUE(WaitFor([&] { return service_->open_channels() == 0; }));
  }
  absl::StatusOr<Pulled> p = PullAll(0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->big, big_);
}

// A worker that opened a channel and went away: the ps's thread of it sees
// its process gone, cancels the pull it left waiting, and ends.
TEST_F(PsServiceTest, AChannelWhoseWorkerIsGoneEnds) {
  ASSERT_TRUE(InitJob().ok());
  absl::StatusOr<std::unique_ptr<SharedRegion>> made = SharedRegion::Create(ChannelRegionBytes());
  ASSERT_TRUE(made.ok());
  std::unique_ptr<SharedRegion> region = *std::move(made);
  ASSERT_TRUE(ChannelEnd::Format(region->data()).ok());
  // A child holds the region's descriptor (inherited) and only waits: the
  // channel is opened in its name.
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    (void)!read(go[0], &c, 1);
    _exit(0);
  }
  close(go[0]);
  OpenedChannel opened = OpenRawChannel(stub_.get(), [&](SharedRegionRef* r) {
    *r = region->ref();
    r->set_pid(child);
  });
  ASSERT_TRUE(opened.status.ok()) << opened.status.error_message();
  EXPECT_EQ(service_->open_channels(), 1);
  // A pull of version 5 waits on the channel.
  std::unique_ptr<ChannelEnd> end =
      *ChannelEnd::Open(region->data(), ChannelEnd::Side::kClient, nullptr);
  PullRequest request;
  request.set_job_id(kJob);
  request.set_min_version(5);
  const absl::Time later = absl::Now() + absl::Seconds(30);
  ASSERT_TRUE(end->Write(ChannelEnd::kStart, 1,
                         EncodeStart(static_cast<uint8_t>(ChannelMethod::kPull), later), later)
                  .ok());
  ASSERT_TRUE(end->Write(ChannelEnd::kMessage, 1, request.SerializeAsString(), later).ok());
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(service_->open_channels(), 1);
  ASSERT_EQ(write(go[1], "x", 1), 1);
  close(go[1]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  const absl::Time gone = absl::Now();
  EXPECT_TRUE(WaitFor([&] { return service_->open_channels() == 0; }));
  EXPECT_LT(absl::Now() - gone, absl::Seconds(2));
  // The thread ended once the pull it held was cancelled and done; the
  // channel is closed.
  EXPECT_TRUE(end->closed());
}

// A ps that serves no channels (an older one, or --same_host_channels=false
// there): the client's calls go through gRPC, still through shared memory.
TEST_F(PsServiceTest, APsWithoutChannelsGetsTheCallsThroughGrpc) {
  OtherPs plain(/*shared_memory=*/true, /*channels=*/false);
  ASSERT_NE(plain.server, nullptr);
  client_ = plain.SharedMemoryClient(&client_metrics_, /*channels=*/true);
  ASSERT_TRUE(InitJob().ok());
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Pulled> p = PullAll(0);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->big, big_);
  }
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_shared_memory_calls_total"), 3);
  EXPECT_EQ(Series(client_metrics_.Render(), "psflow_channel_calls_total"), 0);
  EXPECT_EQ(plain.service.open_channels(), 0);
}

// A worker may open at most per_peer channels.
TEST_F(PsServiceTest, ChannelsOfOneWorkerAreBounded) {
  OtherPs bounded(/*shared_memory=*/true, /*channels=*/true,
                  StreamLimits{/*per_peer=*/2, /*total=*/10});
  ASSERT_NE(bounded.server, nullptr);
  auto stub =
      ParameterServer::NewStub(MakeChannel(bounded.address(), Role::kPs, SecurityOptions{}));
  OpenedChannel a = OpenRawChannel(stub.get()), b = OpenRawChannel(stub.get()),
                c = OpenRawChannel(stub.get());
  EXPECT_TRUE(a.status.ok());
  EXPECT_TRUE(b.status.ok());
  EXPECT_EQ(c.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(bounded.service.open_channels(), 2);
  // A closed one makes room.
  (*ChannelEnd::Open(a.region->data(), ChannelEnd::Side::kClient, nullptr))->Close();
  EXPECT_TRUE(WaitFor([&] { return bounded.service.open_channels() == 1; }));
  OpenedChannel d = OpenRawChannel(stub.get());
  EXPECT_TRUE(d.status.ok()) << d.status.error_message();
}

}  // namespace
}  // namespace psflow::ps
