// A whole cluster with GPU workers: psflow-launch runs the main job's recipe
// (cnn on Fashion-MNIST, 2 ps, 2 workers, 5 epochs, Adam) with both workers on
// cuda:0 and an evaluator on the GPU too, and psflow-eval, also on the GPU,
// checks the accuracy of the saved model and that the evaluator's final
// figures are its own. Skips where "cuda:0" cannot be created (no GPU, or a build without
// the CUDA backend) or the data is missing. PSFLOW_BIN_DIR in the environment
// overrides where the binaries are (for test binaries carried to a GPU
// machine; see Bin() in process.h).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernels.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

constexpr char kData[] = "/usr/share/datasets/fashion-mnist";

TEST(GpuClusterTest, CnnOnGpuWorkersReachesTheAccuracyBar) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> gpu = kernels::CreateBackend("cuda:0");
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().message();
  gpu->reset();  // the test process does not compute; the workers do
  if (!std::filesystem::exists(std::string(kData) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "no Fashion-MNIST in " << kData;
  }
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           ("psflow_gpu_cluster_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  Process launch(
      Bin("psflow-launch"),
      {"--ps=2", "--workers=2", "--worker_devices=cuda:0", "--evaluators=1",
       "--evaluator_device=cuda:0", "--", "--model=cnn", "--epochs=5", "--optimizer=adam",
       "--learning_rate=0.001", "--batch_size=64", "--log_every_steps=500",
       "--data_dir=" + std::string(kData), "--model_dir=" + dir});
  ASSERT_EQ(launch.WaitOrKill(seconds(300)), 0) << launch.Describe();
  EXPECT_THAT(launch.output(), ::testing::HasSubstr("workers 2/2 ps 2/2")) << launch.Describe();

  RunResult eval =
      RunEval(dir, {"--device=cuda:0", "--data_dir=" + std::string(kData)}, seconds(120));
  ASSERT_EQ(eval.exit_code, 0) << eval.description;
  const std::string acc = EvalAccuracyText(eval.out);
  ASSERT_NE(acc, "") << eval.description;
  // The same recipe on CPU workers reaches 0.90; on an H100 it reached 0.905.
  EXPECT_GE(std::stod(acc), 0.89) << eval.description;
  // The evaluator on the GPU saw the final model as psflow-eval does.
  EXPECT_THAT(launch.output(), ::testing::HasSubstr("acc " + acc + " (evaluator)"))
      << launch.Describe();
  std::filesystem::remove_all(dir);
}

// One job of the tests below: one GPU worker with `worker_args`, 2 ps,
// the mlp on synthetic data, 300 steps of SGD, `wire` on the wire, its
// model in `model_dir`.
struct MlpJob {
  int exit_code = -1;
  std::string output, description;
  std::string model;  // the saved model's bytes (empty if none)
};
MlpJob TrainMlp(const std::string& model_dir, const std::string& wire,
                const std::string& worker_args) {
  Process launch(Bin("psflow-launch"),
                 {"--ps=2", "--workers=1", "--worker_devices=cuda:0",
                  "--worker_args=" + worker_args, "--", "--model=mlp", "--data_format=synthetic",
                  "--train_steps=300", "--batch_size=64", "--optimizer=sgd", "--learning_rate=0.05",
                  "--log_every_steps=100", "--wire_dtype=" + wire, "--model_dir=" + model_dir});
  MlpJob job;
  job.exit_code = launch.WaitOrKill(seconds(180));
  job.output = launch.output();
  job.description = launch.Describe();
  std::ifstream in(model_dir + "/saved_model/model.pb", std::ios::binary);
  job.model.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return job;
}

// For fp32 and bf16 on the wire, an mlp job (TrainMlp) with the worker flag
// `--<flag>=true` and one with `--<flag>=false`: both end, only the first
// says `says`, and their saved models are equal byte for byte. Skips the
// calling test where there is no CUDA device.
void ExpectAWorkerFlagTrainsTheSameWeights(const std::string& flag, const std::string& says) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> gpu = kernels::CreateBackend("cuda:0");
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().message();
  gpu->reset();
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           ("psflow_gpu_" + flag + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  for (const std::string wire : {"fp32", "bf16"}) {
    SCOPED_TRACE(wire);
    std::string model[2];
    for (const bool on : {true, false}) {
      const std::string value = on ? "true" : "false";
      const MlpJob job = TrainMlp(dir + "/" + wire + "_" + value, wire, "--" + flag + "=" + value);
      ASSERT_EQ(job.exit_code, 0) << job.description;
      EXPECT_EQ(job.output.find(says) != std::string::npos, on) << job.description;
      model[on ? 0 : 1] = job.model;
      ASSERT_FALSE(job.model.empty()) << job.description;
    }
    EXPECT_TRUE(model[0] == model[1]) << "the saved models differ";
  }
  std::filesystem::remove_all(dir);
}

// A GPU worker whose pulls go through shared memory copies the pulled
// weights to the GPU straight from there (16-bit ones widened on the GPU),
// and says so once; it trains exactly the weights it trains when they are
// decoded into its own page-locked buffers first
// (--upload_from_shared_memory=false): one worker, 2 ps, the mlp on
// synthetic data, fp32 and bf16 on the wire; the saved models are equal
// byte for byte.
TEST(GpuClusterTest, UploadsStraightFromSharedMemoryTrainTheSameWeights) {
  ExpectAWorkerFlagTrainsTheSameWeights("upload_from_shared_memory",
                                        "straight from the shared memory");
}

// A GPU worker whose pushes go through shared memory copies its gradients
// from the GPU into one region of it, which its pushes name (no copy on the
// host), and says so once; it trains exactly the weights it trains when it
// copies them into buffers of its own and each push copies them on
// (--gradients_to_shared_memory=false): one worker, 2 ps, the mlp on
// synthetic data, fp32 and bf16 (rounded on the GPU) on the wire; the saved
// models are equal byte for byte.
TEST(GpuClusterTest, GradientsCopiedIntoSharedMemoryTrainTheSameWeights) {
  ExpectAWorkerFlagTrainsTheSameWeights("gradients_to_shared_memory",
                                        "pushes send them from there");
}

// A GPU worker of a job whose ps share its host sends its tensors through
// shared memory (the default) and says so; with --shared_memory=false it
// makes no shared region for its gradients (and does not say it does),
// sends everything over the network, and trains exactly the same weights:
// one worker, 2 ps, the mlp on synthetic data, fp32 and bf16 on the wire;
// the saved models are equal byte for byte.
TEST(GpuClusterTest, GpuWorkersWithoutSharedMemoryTrainTheSameWeights) {
  ExpectAWorkerFlagTrainsTheSameWeights("shared_memory", "pushes send them from there");
}

// A GPU worker of a 16-bit job rounds its gradients on the GPU
// (--narrow_on_gpu, the default), says so once, and trains exactly the
// weights it trains when it rounds them on the host as it pushes them
// (--narrow_on_gpu=false): one worker, 2 ps, the mlp on synthetic data,
// bf16 and fp16 on the wire, through shared memory and (bf16) over the
// network; the saved models are equal byte for byte.
TEST(GpuClusterTest, GradientsRoundedOnTheGpuTrainTheSameWeights) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> gpu = kernels::CreateBackend("cuda:0");
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device: " << gpu.status().message();
  gpu->reset();
  const std::string dir = (std::filesystem::path(::testing::TempDir()) /
                           ("psflow_gpu_narrowed_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  auto train = [&](const std::string& wire, bool on_gpu, bool shared) {
    const MlpJob job = TrainMlp(
        dir + "/" + wire + (on_gpu ? "_gpu" : "_host") + (shared ? "_shared" : "_network"), wire,
        std::string("--narrow_on_gpu=") + (on_gpu ? "true" : "false") +
            " --shared_memory=" + (shared ? "true" : "false"));
    EXPECT_EQ(job.exit_code, 0) << job.description;
    EXPECT_EQ(job.output.find("on the GPU before they cross") != std::string::npos, on_gpu)
        << job.description;
    EXPECT_FALSE(job.model.empty()) << job.description;
    return job.model;
  };
  for (const std::string wire : {"bf16", "fp16"}) {
    SCOPED_TRACE(wire);
    const std::string on_host = train(wire, false, true);
    EXPECT_TRUE(train(wire, true, true) == on_host) << "the saved models differ";
    if (wire == "bf16") {
      EXPECT_TRUE(train(wire, true, false) == on_host) << "the saved models differ (network)";
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace psflow::itest
