// Two GPUs. Workers with several GPUs (--device=cuda:0,cuda:1): the NCCL
// group's mean and broadcast against the CPU, one worker on two GPUs against
// one GPU with the batch of both, the main job's recipe on workers of two
// GPUs each, and such a worker killed mid-job and restarted. GPU workers
// without ps: their group's means in each wire dtype against the host, the
// main recipe in fp32 and bf16, checkpoints, the evaluator, SIGTERM and a
// killed worker.
// Skips where the process cannot create cuda:0 and cuda:1 (fewer GPUs, or a
// build without the CUDA backend), or the data is missing. PSFLOW_BIN_DIR
// in the environment overrides where the binaries are (Bin() in process.h).
#include <unistd.h>

#include <signal.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "model/saved_model.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

constexpr char kData[] = "/usr/share/datasets/fashion-mnist";

// Skips the test unless this process sees two GPUs.
#define REQUIRE_TWO_GPUS()                                                               \
  do {                                                                                   \
    for (const char* d : {"cuda:0", "cuda:1"}) {                                         \
      absl::StatusOr<std::unique_ptr<kernels::Backend>> gpu = kernels::CreateBackend(d); \
      if (!gpu.ok()) GTEST_SKIP() << "needs two GPUs: " << gpu.status().message();       \
    }                                                                                    \
  } while (0)

// ... and the Fashion-MNIST files the recipes train on.
#define REQUIRE_TWO_GPUS_AND_DATA()                                                     \
  do {                                                                                  \
    REQUIRE_TWO_GPUS();                                                                 \
    if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) { \
      GTEST_SKIP() << "no Fashion-MNIST in " << kData;                                  \
    }                                                                                   \
  } while (0)

std::string TempDir(const std::string& what) {
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           ("psflow_multi_gpu_" + what + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(MultiGpuTest, NcclMeanAndBroadcastMatchTheCpu) {
  REQUIRE_TWO_GPUS();
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  for (const char* d : {"cuda:0", "cuda:1"}) {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::CreateBackend(d);
    ASSERT_TRUE(b.ok()) << b.status();
    backends.push_back(*std::move(b));
  }
  absl::StatusOr<std::unique_ptr<kernels::DeviceGroup>> group =
      kernels::CreateDeviceGroup({backends[0].get(), backends[1].get()});
  ASSERT_TRUE(group.ok()) << group.status();
  // Buffers of the sizes a model has: large, small, a single float.
  const std::vector<int64_t> sizes = {1 << 20, 4099, 1};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<std::vector<std::vector<float>>> host(2);  // [replica][buffer]
  std::vector<std::vector<std::unique_ptr<kernels::Buffer>>> device(2);
  std::vector<std::vector<float*>> pointers(2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t n : sizes) {
      std::vector<float> v(n);
      for (float& x : v) x = normal(rng);
      absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf = backends[r]->Allocate(n);
      ASSERT_TRUE(buf.ok()) << buf.status();
      ASSERT_TRUE(backends[r]->CopyToDevice(v.data(), n, (*buf)->data()).ok());
      pointers[r].push_back((*buf)->data());
      device[r].push_back(*std::move(buf));
      host[r].push_back(std::move(v));
    }
  }
  ASSERT_TRUE((*group)->AllReduceMean(pointers, sizes).ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int r = 0; r < 2; ++r) {
      std::vector<float> got(sizes[i]);
      ASSERT_TRUE(backends[r]->CopyToHost(pointers[r][i], sizes[i], got.data()).ok());
      for (int64_t k = 0; k < sizes[i]; ++k) {
        const float want = (host[0][i][k] + host[1][i][k]) / 2;
        ASSERT_NEAR(got[k], want, 1e-6f * (1 + std::abs(want)))
            << "replica " << r << " buffer " << i << " element " << k;
      }
    }
  }
  // Broadcast: replica 1 takes replica 0's values (new ones on replica 0).
  std::vector<float> fresh(sizes[0]);
  for (float& x : fresh) x = normal(rng);
  ASSERT_TRUE(backends[0]->CopyToDevice(fresh.data(), sizes[0], pointers[0][0]).ok());
  ASSERT_TRUE((*group)->Broadcast(pointers, sizes).ok());
  std::vector<float> got(sizes[0]);
  ASSERT_TRUE(backends[1]->CopyToHost(pointers[1][0], sizes[0], got.data()).ok());
  EXPECT_EQ(got, fresh);
}

// One wire dtype of the peer group's means.
struct PeerWireCase {
  kernels::WireDtype wire;
  DataType dtype;
  double relative;  // one unit in the last place, relative
};

using MemberBuffers = std::vector<std::vector<float>>;  // [buffer]

// Random inputs of the two members; member 0's buffer 1 opens with a NaN and
// a value over fp16's largest (65504).
std::vector<MemberBuffers> PeerGroupInputs(const std::vector<int64_t>& sizes) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<MemberBuffers> in(2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t n : sizes) {
      std::vector<float> v(n);
      for (float& x : v) x = normal(rng);
      in[r].push_back(std::move(v));
    }
  }
  in[0][1][0] = std::nanf("");
  in[0][1][1] = 70000.0f;  // over fp16's largest (65504)
  return in;
}

// A device buffer for each of `in`, holding it, and a last one of one float
// (a loss).
absl::StatusOr<std::vector<std::unique_ptr<kernels::Buffer>>> UploadBuffers(
    kernels::Backend& b, const std::vector<int64_t>& sizes, const MemberBuffers& in) {
  std::vector<std::unique_ptr<kernels::Buffer>> buffers;
  for (size_t i = 0; i <= sizes.size(); ++i) {  // the last: a loss
    absl::StatusOr<std::unique_ptr<kernels::Buffer>> buf =
        b.Allocate(i < sizes.size() ? sizes[i] : 1);
    if (!buf.ok()) return buf.status();
    if (i < sizes.size()) {
      absl::Status s = b.CopyToDevice(in[i].data(), sizes[i], (*buf)->data());
      if (!s.ok()) return s;
    }
    buffers.push_back(*std::move(buf));
  }
  return buffers;
}

// A negative size is refused before anything reaches NCCL: the group goes on.
absl::Status CheckNegativeSizeRefused(kernels::PeerGroup& group, float* loss, absl::Time deadline) {
  const absl::Status refused = group.AllReduceMean({loss}, {-1}, deadline, [] { return false; });
  if (!absl::IsInvalidArgument(refused)) {
    return absl::InternalError(absl::StrCat("a negative size gave: ", refused.ToString()));
  }
  return absl::OkStatus();
}

// Member `r` of peer group `id` on cuda:r: two steps of the buckets' means
// and a loss's, then its buffers as they end.
absl::StatusOr<MemberBuffers> RunPeerMember(int r, const std::string& id, const PeerWireCase& c,
                                            const std::vector<int64_t>& sizes,
                                            const MemberBuffers& in) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
      kernels::CreateBackend(r == 0 ? "cuda:0" : "cuda:1");
  if (!backend.ok()) return backend.status();
  kernels::Backend& b = **backend;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<kernels::PeerGroup>> group =
      kernels::JoinPeerGroup(&b, id, r, 2, c.wire, deadline, [] { return false; });
  if (!group.ok()) return group.status();
  absl::StatusOr<std::vector<std::unique_ptr<kernels::Buffer>>> buffers =
      UploadBuffers(b, sizes, in);
  if (!buffers.ok()) return buffers.status();
  std::vector<std::unique_ptr<kernels::Buffer>>& bufs = *buffers;
  absl::StatusOr<std::unique_ptr<kernels::Event>> event = b.CreateEvent();
  if (!event.ok()) return event.status();
  absl::Status s = b.RecordEvent(event->get());
  // Two buckets: the large buffer, an empty one and the small one, then
  // the single float.
  float empty = 0;
  std::vector<kernels::PeerGroup::Bucket> buckets(2);
  buckets[0] = {event->get(), {bufs[0]->data(), &empty, bufs[1]->data()}, {sizes[0], 0, sizes[1]}};
  buckets[1] = {event->get(), {bufs[2]->data()}, {sizes[2]}};
  if (s.ok()) s = CheckNegativeSizeRefused(**group, bufs[3]->data(), deadline);
  // Twice: the second step reuses the buckets' tables.
  for (int step = 0; step < 2 && s.ok(); ++step) {
    if (step == 1) {
      for (size_t i = 0; s.ok() && i < sizes.size(); ++i) {
        s = b.CopyToDevice(in[i].data(), sizes[i], bufs[i]->data());
      }
      if (s.ok()) s = b.RecordEvent(event->get());
    }
    if (s.ok()) s = (*group)->QueueAllReduceMeans(buckets, deadline, [] { return false; });
    if (s.ok()) s = (*group)->AllReduceMean({bufs[3]->data()}, {1}, deadline, [] { return false; });
  }
  MemberBuffers out;
  for (size_t i = 0; s.ok() && i < sizes.size(); ++i) {
    std::vector<float> got(sizes[i]);
    s = b.CopyToHost(bufs[i]->data(), sizes[i], got.data());
    out.push_back(std::move(got));
  }
  if (!s.ok()) return s;
  return out;
}

// `v` rounded to the wire dtype of `c` and back.
float RoundToWire(const PeerWireCase& c, float v) {
  if (c.dtype == DT_FLOAT) return v;
  char bytes[4];
  EncodeFloats(c.dtype, &v, 1, bytes);
  float back = 0;
  DecodeFloats(c.dtype, bytes, 1, &back);
  return back;
}

// Both members hold the same bits: the mean of the inputs rounded to the
// wire dtype, rounded again; NaN kept, what fp16 cannot hold an infinity.
void ExpectPeerMeans(const PeerWireCase& c, const std::vector<int64_t>& sizes,
                     const std::vector<MemberBuffers>& in, const std::vector<MemberBuffers>& out) {
  auto round = [&](float v) { return RoundToWire(c, v); };
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (int64_t k = 0; k < sizes[i]; ++k) {
      const float got = out[0][i][k];
      ASSERT_EQ(std::memcmp(&got, &out[1][i][k], sizeof(float)), 0)
          << "the members differ at buffer " << i << " element " << k;
      const double want = (static_cast<double>(round(in[0][i][k])) + round(in[1][i][k])) / 2;
      if (i == 1 && k == 0) {
        EXPECT_TRUE(std::isnan(got)) << got;
      } else if (i == 1 && k == 1 && c.dtype == DT_HALF) {
        EXPECT_TRUE(std::isinf(got)) << got;
      } else {
        ASSERT_EQ(round(got), got)
            << "not a value of the wire dtype, buffer " << i << " element " << k;
        ASSERT_NEAR(got, want, c.relative * std::abs(want) + 0x1p-24)
            << "buffer " << i << " element " << k;
      }
    }
  }
}

// The group of single-GPU workers without ps (kernels::PeerGroup), its two
// members on two threads of this process: the buckets' means in each wire
// dtype, against the host. In fp32 the mean of the inputs; in bf16 and fp16
// the mean of the inputs rounded to that dtype, rounded to it again (within
// one unit in its last place), NaN kept, what fp16 cannot hold an infinity;
// both members get the same bits every time.
TEST(MultiGpuTest, PeerGroupMeansInEachWireDtype) {
  REQUIRE_TWO_GPUS();
  const std::vector<int64_t> sizes = {1 << 20, 4099, 1};
  for (const PeerWireCase& c : {PeerWireCase{kernels::WireDtype::kFloat32, DT_FLOAT, 1e-6},
                                PeerWireCase{kernels::WireDtype::kBfloat16, DT_BFLOAT16, 0x1p-7},
                                PeerWireCase{kernels::WireDtype::kFloat16, DT_HALF, 0x1p-10}}) {
    SCOPED_TRACE(DataType_Name(c.dtype));
    absl::StatusOr<std::string> id = kernels::NewPeerGroupId();
    ASSERT_TRUE(id.ok()) << id.status();
    const std::vector<MemberBuffers> in = PeerGroupInputs(sizes);
    std::vector<absl::StatusOr<MemberBuffers>> result(2);
    std::thread other([&] { result[1] = RunPeerMember(1, *id, c, sizes, in[1]); });
    result[0] = RunPeerMember(0, *id, c, sizes, in[0]);
    other.join();
    ASSERT_TRUE(result[0].ok()) << result[0].status();
    ASSERT_TRUE(result[1].ok()) << result[1].status();
    ASSERT_NO_FATAL_FAILURE(ExpectPeerMeans(c, sizes, in, {*result[0], *result[1]}));
  }
}

// Trains --train_steps steps of the mlp with SGD (1 ps, 1 worker on
// `devices`, `batch` per replica) and returns the saved model's values.
std::vector<std::vector<float>> TrainMlp(const std::string& devices, int batch, int steps,
                                         const std::string& dir) {
  Process launch(Bin("psflow-launch"),
                 {"--ps=1", "--workers=1", "--worker_devices=" + devices, "--", "--model=mlp",
                  "--train_steps=" + std::to_string(steps), "--optimizer=sgd",
                  "--learning_rate=0.1", "--batch_size=" + std::to_string(batch),
                  "--data_dir=" + std::string(kData), "--model_dir=" + dir});
  EXPECT_EQ(launch.WaitOrKill(seconds(120)), 0) << launch.Describe();
  absl::StatusOr<model::LoadedModel> saved = model::ReadSavedModel(dir + "/saved_model");
  EXPECT_TRUE(saved.ok()) << saved.status();
  return saved.ok() ? saved->values : std::vector<std::vector<float>>{};
}

TEST(MultiGpuTest, TwoGpusOfBatchBTakeTheStepsOfOneGpuOfBatch2B) {
  REQUIRE_TWO_GPUS_AND_DATA();
  // The worker's step takes the same 2b examples either way: replica 0 the
  // first b, replica 1 the next b; the mean of the two means is the mean
  // over 2b (the mlp has no batch norm, whose statistics are per replica).
  const std::string two_dir = TempDir("two"), one_dir = TempDir("one");
  const std::vector<std::vector<float>> two = TrainMlp("cuda:0,cuda:1", 32, 5, two_dir);
  const std::vector<std::vector<float>> one = TrainMlp("cuda:0", 64, 5, one_dir);
  ASSERT_EQ(two.size(), one.size());
  ASSERT_FALSE(one.empty());
  double worst = 0;
  for (size_t v = 0; v < one.size(); ++v) {
    ASSERT_EQ(two[v].size(), one[v].size());
    for (size_t k = 0; k < one[v].size(); ++k) {
      worst = std::max(worst, static_cast<double>(std::abs(two[v][k] - one[v][k])) /
                                  (1e-3 + std::abs(one[v][k])));
    }
  }
  // fp32 sums in another order (and TF32-free GEMMs): agreement to ~1e-5.
  EXPECT_LT(worst, 1e-4) << "largest relative difference of a weight";
  std::filesystem::remove_all(two_dir);
  std::filesystem::remove_all(one_dir);
}

// The main job's recipe (cnn, 5 epochs, Adam 0.001) at batch 32 per GPU on
// `workers` workers of 2 GPUs each; returns psflow-eval's accuracy of the
// saved model ("" on failure). `while_running` runs once training logs its
// first progress line.
std::string MainRecipe(int workers, const std::string& dir,
                       const std::function<void(Process&)>& while_running = nullptr,
                       const std::vector<std::string>& launch_flags = {}) {
  std::string devices = "cuda:0,cuda:1";
  for (int w = 1; w < workers; ++w) devices += ";cuda:0,cuda:1";
  std::vector<std::string> args = {"--ps=2", "--workers=" + std::to_string(workers),
                                   "--worker_devices=" + devices};
  args.insert(args.end(), launch_flags.begin(), launch_flags.end());
  for (const std::string& a :
       {std::string("--"), std::string("--model=cnn"), std::string("--epochs=5"),
        std::string("--optimizer=adam"), std::string("--learning_rate=0.001"),
        std::string("--batch_size=32"), std::string("--log_every_steps=200"),
        "--data_dir=" + std::string(kData), "--model_dir=" + dir}) {
    args.push_back(a);
  }
  Process launch(Bin("psflow-launch"), args);
  if (while_running) {
    EXPECT_TRUE(launch.WaitForOutput("| step ", seconds(120))) << launch.Describe();
    while_running(launch);
  }
  EXPECT_EQ(launch.WaitOrKill(seconds(300)), 0) << launch.Describe();
  EXPECT_THAT(launch.output(), ::testing::HasSubstr("x 2 replicas (GPUs) each"))
      << launch.Describe();
  RunResult eval =
      RunEval(dir, {"--device=cuda:0", "--data_dir=" + std::string(kData)}, seconds(120));
  EXPECT_EQ(eval.exit_code, 0) << eval.description;
  return EvalAccuracyText(eval.out);
}

TEST(MultiGpuTest, MainRecipeOnWorkersOfTwoGpusReachesTheAccuracyBar) {
  REQUIRE_TWO_GPUS_AND_DATA();
  // One worker of 2 GPUs at 32 each (a global batch of 64), and two such
  // workers (128, the main job's global batch of 64 x 2 workers).
  for (int workers : {1, 2}) {
    const std::string dir = TempDir("recipe" + std::to_string(workers));
    const std::string acc = MainRecipe(workers, dir);
    ASSERT_NE(acc, "") << workers << " workers";
    std::printf("main recipe, %d worker(s) x 2 GPUs x batch 32: test accuracy %s\n", workers,
                acc.c_str());
    EXPECT_GE(std::stod(acc), 0.895) << workers << " workers";
    std::filesystem::remove_all(dir);
  }
}

// Two GPU workers without ps: they average their gradients on their GPUs
// (one NCCL group across the two processes, its id handed over psflow's
// ring) in the wire dtype `wire`, each applies the mean to its replica; the
// main recipe reaches the bar and both replicas end bit-identical.
void GpuWorkersWithoutPsReachTheBar(const std::string& wire) {
  const std::string dir = TempDir("allreduce_" + wire);
  Process launch(Bin("psflow-launch"),
                 {"--ps=0", "--chief=false", "--workers=2", "--worker_devices=cuda:0;cuda:1", "--",
                  "--model=cnn", "--epochs=5", "--optimizer=adam", "--learning_rate=0.001",
                  "--batch_size=64", "--wire_dtype=" + wire, "--log_every_steps=500",
                  "--data_dir=" + std::string(kData), "--model_dir=" + dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(300)), 0) << launch.Describe();
  const std::string out = launch.output();
  const std::string nccl = wire == "fp32" ? "(NCCL)" : "(NCCL, in " + wire + ")";
  for (const std::string worker : {"worker0", "worker1"}) {
    EXPECT_THAT(out, ::testing::HasSubstr(
                         worker + "] the 2 workers average their gradients on their GPUs " + nccl));
  }
  EXPECT_THAT(out, ::testing::HasSubstr("worker0] replica at step 2340: crc32c"));
  ExpectIdenticalReplicas(out, 2);
  RunResult eval =
      RunEval(dir, {"--device=cuda:0", "--data_dir=" + std::string(kData)}, seconds(120));
  ASSERT_EQ(eval.exit_code, 0) << eval.description;
  const std::string acc = EvalAccuracyText(eval.out);
  ASSERT_NE(acc, "");
  std::printf("main recipe, 2 GPU workers without ps, %s on the wire: test accuracy %s\n",
              wire.c_str(), acc.c_str());
  EXPECT_GE(std::stod(acc), 0.895);
  std::filesystem::remove_all(dir);
}

TEST(MultiGpuTest, GpuWorkersWithoutPsAverageOverNcclAndReachTheBar) {
  REQUIRE_TWO_GPUS_AND_DATA();
  GpuWorkersWithoutPsReachTheBar("fp32");
}

TEST(MultiGpuTest, GpuWorkersWithoutPsAverageInBf16AndReachTheBar) {
  REQUIRE_TWO_GPUS_AND_DATA();
  GpuWorkersWithoutPsReachTheBar("bf16");
}

// GPU workers without ps keep their replicas on their devices: worker 0's
// shard gets the replica at the multiples of 100 steps and at the steps the
// evaluator asks for in advance (multiples of 250: some not of 100), so
// checkpoints, the evaluator's lines and the saved model come as in ps mode.
// (An evaluation whose step the workers pass before the evaluator asks for
// it is skipped, as in ps mode: which ones come depends on the speeds.)
TEST(MultiGpuTest, GpuReplicasServeCheckpointsAndTheEvaluator) {
  REQUIRE_TWO_GPUS_AND_DATA();
  const std::string dir = TempDir("allreduce_eval");
  Process launch(
      Bin("psflow-launch"),
      {"--ps=0", "--chief=false", "--workers=2", "--evaluators=1", "--worker_devices=cuda:0;cuda:1",
       "--", "--model=cnn", "--train_steps=3000", "--optimizer=momentum", "--learning_rate=0.02",
       "--batch_size=64", "--log_every_steps=250", "--eval_every_steps=250",
       "--checkpoint_every_steps=200", "--data_dir=" + std::string(kData), "--model_dir=" + dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(300)), 0) << launch.Describe();
  const std::string out = launch.output();
  EXPECT_THAT(out, ::testing::ContainsRegex("eval: step (250|750|1250|1750|2250|2750)/3000 "));
  EXPECT_THAT(out, ::testing::HasSubstr("eval: step 3000/3000 "));
  EXPECT_THAT(out, ::testing::ContainsRegex("checkpoint of step [1-9][0-9]* written"));
  ExpectIdenticalReplicas(out, 2);
  std::filesystem::remove_all(dir);
}

// Both GPU workers stopped (SIGTERM): worker 0's trainer stops first and
// publishes its device replica, then the chief's duties checkpoint it;
// started again, the group resumes from that checkpoint.
TEST(MultiGpuTest, SigtermedGpuWorkersWithoutPsResumeFromTheirCheckpoint) {
  REQUIRE_TWO_GPUS_AND_DATA();
  const std::string dir = TempDir("allreduce_stop");
  const std::vector<int> ports = FreePorts(2);
  ASSERT_EQ(ports.size(), 2u);
  const std::string hosts = "--worker_hosts=127.0.0.1:" + std::to_string(ports[0]) +
                            ",127.0.0.1:" + std::to_string(ports[1]);
  auto start = [&](int w) {
    return std::make_unique<Process>(
        Bin("psflow-worker"),
        std::vector<std::string>{"--job_name=worker", "--task_id=" + std::to_string(w), hosts,
                                 "--device=cuda:" + std::to_string(w), "--model=cnn",
                                 "--train_steps=3000", "--batch_size=64", "--optimizer=adam",
                                 "--learning_rate=0.001", "--log_every_steps=50",
                                 "--checkpoint_every_steps=0", "--data_dir=" + std::string(kData),
                                 "--model_dir=" + dir});
  };
  // Stopped past a multiple of 100: the replica of the stop's step, not the
  // one published at 500, is the checkpoint's.
  ExpectStoppedWorkersResume(start, "worker0] step 550/3000 ", 550, 3000);
  std::filesystem::remove_all(dir);
}

// A GPU worker without ps killed mid-job: its peer must not wait on its GPU
// for the NCCL all-reduce forever; it ends with a retryable exit code once
// the chief finds the killed worker silent (--worker_timeout).
TEST(MultiGpuTest, GpuWorkerWithoutPsKilledLeavesNoPeerWaitingOnItsGpu) {
  REQUIRE_TWO_GPUS_AND_DATA();
  const std::string dir = TempDir("allreduce_kill");
  const std::vector<int> ports = FreePorts(2);
  ASSERT_EQ(ports.size(), 2u);
  const std::string hosts = "--worker_hosts=127.0.0.1:" + std::to_string(ports[0]) +
                            ",127.0.0.1:" + std::to_string(ports[1]);
  Process w0(Bin("psflow-worker"),
             {"--job_name=worker", "--task_id=0", hosts, "--device=cuda:0", "--model=cnn",
              "--epochs=50", "--batch_size=64", "--log_every_steps=200", "--worker_timeout=10",
              "--data_dir=" + std::string(kData), "--model_dir=" + dir});
  Process w1(Bin("psflow-worker"), {"--job_name=worker", "--task_id=1", hosts, "--device=cuda:1"});
  ASSERT_TRUE(w0.WaitForOutput("worker0] step 400/", seconds(120))) << w0.Describe();
  w1.Signal(SIGKILL);
  w1.WaitOrKill(seconds(10));
  const int code = w0.WaitOrKill(seconds(90));
  EXPECT_TRUE(code == 138 || code == 140) << w0.Describe();
  EXPECT_LT(w0.elapsed_seconds(), 200) << w0.Describe();
  std::filesystem::remove_all(dir);
}

TEST(MultiGpuTest, AKilledWorkerOfTwoGpusIsRestartedAndTheJobEndsAtTheBar) {
  REQUIRE_TWO_GPUS_AND_DATA();
  // As any worker: SIGKILLed mid-job, restarted (the launcher's on-failure
  // policy, as Kubernetes would), it registers again and trains on; the job
  // ends with every step and the accuracy of a job without the kill.
  const std::string dir = TempDir("kill");
  int killed = 0;
  const std::string acc =
      MainRecipe(2, dir,
                 [&](Process& launch) {
                   for (pid_t pid : FindProcesses("--job_name=worker --task_id=1")) {
                     ::kill(pid, SIGKILL);
                     ++killed;
                   }
                 },
                 {"--restart=on-failure"});
  EXPECT_EQ(killed, 1);
  ASSERT_NE(acc, "");
  std::printf("main recipe, 2 workers x 2 GPUs, worker 1 killed once: test accuracy %s\n",
              acc.c_str());
  EXPECT_GE(std::stod(acc), 0.895);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace psflow::itest
