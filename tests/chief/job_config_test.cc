
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "chief/coordinator.h"
#include "data/mnist.h"
#include "data/synthetic.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/job.pb.h"
#include "ps/optimizer.h"
#include "tests/data/idx_files.h"

namespace psflow::chief {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint32_t kCount = 100;

using ::psflow::data::idx_testing::IdxBytes;
using ::psflow::data::idx_testing::WriteGzip;
using ::psflow::data::idx_testing::WritePlain;

// Pixels of `count` images of size x size: (i * 37 + k * 13) % 256 skewed so
// the mean is not 127.5.
std::vector<uint8_t> Pixels(uint32_t count, uint32_t size) {
  std::vector<uint8_t> pixels(size_t{count} * size * size);
  for (size_t j = 0; j < pixels.size(); ++j) {
    const size_t i = j / (size * size), k = j % (size * size);
    const uint32_t v = static_cast<uint32_t>((i * 37 + k * 13) % 256);
    pixels[j] = static_cast<uint8_t>(v * v / 255);
  }
  return pixels;
}

void ExpectInvalid(const absl::StatusOr<JobConfig>& job, const std::string& substring) {
  ASSERT_FALSE(job.ok()) << "expected an error containing '" << substring << "'";
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << job.status();
  EXPECT_THAT(std::string(job.status().message()), HasSubstr(substring));
}

class JobConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        (fs::path(::testing::TempDir()) / absl::StrCat("job_config_test_", info->name())).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    options_.cluster.cluster.chief = {"chief-0:2222"};
    options_.cluster.cluster.worker = {"worker-0:2222", "worker-1:2222"};
    options_.cluster.cluster.ps = {"ps-0:2222", "ps-1:2222"};
    options_.cluster.role = Role::kChief;
    options_.job.model = "cnn";
    options_.job.data_dir = dir_;
    options_.coordinator.model_dir = (fs::path(dir_) / "model").string();
    options_.job.batch_size = 8;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the training images and labels, plain or gzipped (".gz" names).
  void WriteData(uint32_t count, uint32_t size, bool gzip) {
    pixels_ = Pixels(count, size);
    std::vector<uint8_t> labels(count);
    for (uint32_t i = 0; i < count; ++i) labels[i] = static_cast<uint8_t>(i % 10);
    const std::vector<uint8_t> images = IdxBytes(0x803, {count, size, size}, pixels_);
    const std::vector<uint8_t> label_bytes = IdxBytes(0x801, {count}, labels);
    const std::string images_path = (fs::path(dir_) / "train-images-idx3-ubyte").string();
    const std::string labels_path = (fs::path(dir_) / "train-labels-idx1-ubyte").string();
    if (gzip) {
      WriteGzip(images_path + ".gz", images);
      WriteGzip(labels_path + ".gz", label_bytes);
    } else {
      WritePlain(images_path, images);
      WritePlain(labels_path, label_bytes);
    }
  }

  std::string dir_;
  std::vector<uint8_t> pixels_;
  ChiefOptions options_;
};

TEST_F(JobConfigTest, DefaultsToOneEpoch) {
  WriteData(kCount, 28, /*gzip=*/false);
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  // Each of 2 workers sees ceil(100 / 2) = 50 examples per epoch: 6 full batches of 8.
  EXPECT_EQ(job->steps_per_epoch(), 6);
  EXPECT_EQ(job->train_steps(), 6);
  EXPECT_EQ(job->num_examples(), kCount);
  EXPECT_EQ(job->batch_size(), 8);
  EXPECT_EQ(job->num_workers(), 2);
  EXPECT_EQ(job->num_ps(), 2);
  EXPECT_EQ(job->data().data_dir(), dir_);
  EXPECT_EQ(job->seed(), 1u);
  EXPECT_EQ(job->model().name(), "cnn");
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::SGD);
  EXPECT_FLOAT_EQ(job->optimizer().learning_rate(), 0.01f);
}

TEST_F(JobConfigTest, ReadsGzippedDataAndOddCounts) {
  WriteData(101, 28, /*gzip=*/true);
  options_.job.batch_size = 17;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  // ceil(101 / 2) = 51 = 3 * 17.
  EXPECT_EQ(job->steps_per_epoch(), 3);
  EXPECT_EQ(job->num_examples(), 101);
}

TEST_F(JobConfigTest, StepsPerEpochIsFullBatchesOfAShard) {
  WriteData(kCount, 28, false);
  for (int batch : {1, 7, 8, 25, 49, 50}) {
    options_.job.batch_size = batch;
    absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << batch << ": " << job.status();
    EXPECT_EQ(job->steps_per_epoch(), 50 / batch) << batch;
  }
  options_.cluster.cluster.worker = {"worker-0:2222", "worker-1:2222", "worker-2:2222"};
  options_.job.batch_size = 10;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->steps_per_epoch(), 3);  // ceil(100 / 3) = 34
  EXPECT_EQ(job->num_workers(), 3);
}

TEST_F(JobConfigTest, ReplicasPerWorkerTakeABatchEach) {
  WriteData(kCount, 28, false);
  options_.job.replicas_per_worker = 2;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  // 50 examples per worker and epoch, 2 replicas x 8 per step: 3 steps.
  EXPECT_EQ(job->replicas_per_worker(), 2);
  EXPECT_EQ(job->batch_size(), 8);
  EXPECT_EQ(job->steps_per_epoch(), 3);
  options_.job.batch_size = 26;  // 2 x 26 > 50
  ExpectInvalid(BuildJobConfig(options_), "times 2 replicas exceeds");
  options_.job.batch_size = 8;
  options_.job.replicas_per_worker = 0;
  ExpectInvalid(BuildJobConfig(options_), "--replicas_per_worker must be in [1, 64]");
}

TEST_F(JobConfigTest, GlobalBatchSizeIsSharedByEveryReplica) {
  WriteData(kCount, 28, false);
  options_.job.global_batch_size = 16;  // 2 workers: 8 each, whatever --batch_size says
  options_.job.batch_size = 3;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->batch_size(), 8);
  EXPECT_EQ(job->steps_per_epoch(), 6);
  options_.job.replicas_per_worker = 2;  // 4 replicas: 4 each
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->batch_size(), 4);
  options_.job.global_batch_size = 18;
  ExpectInvalid(BuildJobConfig(options_), "--global_batch_size 18 is not a multiple of the 4");
  options_.job.global_batch_size = -1;
  ExpectInvalid(BuildJobConfig(options_), "--global_batch_size must not be negative");
}

TEST_F(JobConfigTest, WithoutPsTheWorkersAllReduceIntoOneReplicaPlacement) {
  WriteData(kCount, 28, false);
  options_.cluster.cluster.ps.clear();
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->exchange(), JobConfig::ALL_REDUCE);
  EXPECT_EQ(job->num_ps(), 1);
  EXPECT_EQ(job->placement().num_ps(), 1);
  for (const VariablePlacement& v : job->placement().variable()) {
    for (const VariableSlice& s : v.slice()) EXPECT_EQ(s.ps(), 0);
  }
  options_.job.mode = "async";
  ExpectInvalid(BuildJobConfig(options_), "--mode async needs parameter servers");
  options_.cluster.cluster.ps = {"ps-0:2222"};
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->exchange(), JobConfig::PARAMETER_SERVERS);
}

TEST_F(JobConfigTest, EpochsOrTrainSteps) {
  WriteData(kCount, 28, false);
  options_.job.epochs = 3;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->train_steps(), 3 * 6);

  options_.job.epochs = 0;
  options_.job.train_steps = 7;  // not a multiple of steps_per_epoch: used as is
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->train_steps(), 7);
  EXPECT_EQ(job->steps_per_epoch(), 6);

  options_.job.epochs = 2;
  ExpectInvalid(BuildJobConfig(options_), "not both");

  options_.job.epochs = -1;
  options_.job.train_steps = 0;
  ExpectInvalid(BuildJobConfig(options_), "must not be negative");
  options_.job.epochs = std::numeric_limits<int64_t>::max() / 2;
  ExpectInvalid(BuildJobConfig(options_), "too large");
}

TEST_F(JobConfigTest, StandardizesInputsWithThePixelStatistics) {
  WriteData(kCount, 28, false);
  double sum = 0;
  for (uint8_t p : pixels_) sum += p / 255.0;
  const double mean = sum / static_cast<double>(pixels_.size());
  double var = 0;
  for (uint8_t p : pixels_) var += (p / 255.0 - mean) * (p / 255.0 - mean);
  const double stddev = std::sqrt(var / static_cast<double>(pixels_.size()));
  ASSERT_GT(stddev, 0.05);
  ASSERT_GT(std::abs(mean - 0.5), 0.05);  // the data really is skewed

  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_NEAR(job->model().input().mean(), mean, 1e-6);
  EXPECT_NEAR(job->model().input().stddev(), stddev, 1e-6);
  EXPECT_EQ(job->model().input().height(), 28);
  EXPECT_EQ(job->model().input().width(), 28);
}

TEST_F(JobConfigTest, PlacesEveryVariableOnThePs) {
  WriteData(kCount, 28, false);
  for (int num_ps : {1, 2, 3}) {
    options_.cluster.cluster.ps.clear();
    for (int p = 0; p < num_ps; ++p)
      options_.cluster.cluster.ps.push_back(absl::StrCat("ps-", p, ":2222"));
    absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << num_ps << ": " << job.status();
    EXPECT_EQ(job->num_ps(), num_ps);
    EXPECT_EQ(job->placement().num_ps(), num_ps);
    // cnn: conv1, conv2, fc1, fc2 with kernel and bias each.
    EXPECT_EQ(job->placement().variable_size(), 8);
    std::vector<bool> used(num_ps, false);
    for (const VariablePlacement& v : job->placement().variable()) {
      ASSERT_GT(v.slice_size(), 0) << v.name();
      EXPECT_EQ(v.slice(0).row_begin(), 0) << v.name();
      EXPECT_EQ(v.slice(v.slice_size() - 1).row_end(), v.shape(0)) << v.name();
      for (const VariableSlice& s : v.slice()) {
        ASSERT_GE(s.ps(), 0);
        ASSERT_LT(s.ps(), num_ps);
        used[s.ps()] = true;
      }
    }
    for (int p = 0; p < num_ps; ++p)
      EXPECT_TRUE(used[p]) << "ps " << p << " of " << num_ps << " holds nothing";
  }
}

TEST_F(JobConfigTest, Optimizers) {
  WriteData(kCount, 28, false);
  options_.job.optimizer = "Momentum";
  options_.job.momentum = 0.5f;
  options_.job.learning_rate = 0.1f;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::MOMENTUM);
  EXPECT_FLOAT_EQ(job->optimizer().momentum(), 0.5f);
  EXPECT_FLOAT_EQ(job->optimizer().learning_rate(), 0.1f);

  options_.job.optimizer = "adam";
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::ADAM);

  // --momentum only matters to the momentum optimizer.
  options_.job.optimizer = "sgd";
  options_.job.momentum = 1.5f;
  EXPECT_TRUE(BuildJobConfig(options_).ok());
}

TEST_F(JobConfigTest, NewOptimizersAndTheirFlags) {
  WriteData(kCount, 28, false);
  options_.job.optimizer = "momentum";
  options_.job.nesterov = true;
  options_.job.weight_decay = 0.01f;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(job->optimizer().nesterov());
  EXPECT_FLOAT_EQ(job->optimizer().weight_decay(), 0.01f);
  options_.job.nesterov = false;

  options_.job.optimizer = "AdamW";
  options_.job.beta1 = 0.8f;
  options_.job.beta2 = 0.99f;
  options_.job.epsilon = 1e-6f;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::ADAMW);
  EXPECT_FLOAT_EQ(job->optimizer().beta1(), 0.8f);
  EXPECT_FLOAT_EQ(job->optimizer().beta2(), 0.99f);
  EXPECT_FLOAT_EQ(job->optimizer().epsilon(), 1e-6f);

  options_.job.optimizer = "adagrad";
  options_.job.epsilon = 0;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::ADAGRAD);
  EXPECT_EQ(job->optimizer().epsilon(), 0) << "0: the ps's default, 1e-10";

  options_.job.optimizer = "rmsprop";
  options_.job.rmsprop_alpha = 0.9f;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().kind(), OptimizerConfig::RMSPROP);
  EXPECT_FLOAT_EQ(job->optimizer().alpha(), 0.9f);
}

TEST_F(JobConfigTest, LearningRateSchedules) {
  WriteData(kCount, 28, false);
  options_.job.train_steps = 100;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().lr_decay(), OptimizerConfig::CONSTANT) << "the default";

  options_.job.lr_decay = "Step";
  options_.job.lr_warmup_steps = 5;
  options_.job.lr_decay_steps = 30;
  options_.job.lr_decay_rate = 0.5f;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().lr_decay(), OptimizerConfig::STEP);
  EXPECT_EQ(job->optimizer().lr_warmup_steps(), 5);
  EXPECT_EQ(job->optimizer().lr_decay_steps(), 30);
  EXPECT_FLOAT_EQ(job->optimizer().lr_decay_rate(), 0.5f);

  options_.job.lr_decay = "exponential";
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().lr_decay(), OptimizerConfig::EXPONENTIAL);

  // Cosine decays over the steps after the warmup unless told otherwise.
  options_.job.lr_decay = "cosine";
  options_.job.lr_decay_steps = 0;
  options_.job.lr_min = 0.001f;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().lr_decay(), OptimizerConfig::COSINE);
  EXPECT_EQ(job->optimizer().lr_decay_steps(), 95);
  EXPECT_FLOAT_EQ(job->optimizer().lr_min(), 0.001f);
  // The last step (t = 94 of 95) is just above lr_min, as with torch's
  // CosineAnnealingLR(T_max=95); lr_min is reached at t = 95.
  EXPECT_NEAR(ps::LearningRate(job->optimizer(), 99),
              0.001 + (0.01 - 0.001) * (1 + std::cos(M_PI * 94 / 95)) / 2, 1e-9);
  EXPECT_FLOAT_EQ(ps::LearningRate(job->optimizer(), 100), 0.001f);
  options_.job.lr_decay_steps = 20;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->optimizer().lr_decay_steps(), 20);
}

TEST_F(JobConfigTest, RejectsBadOptimizerFlags) {
  WriteData(kCount, 28, false);
  options_.job.train_steps = 100;
  ASSERT_TRUE(BuildJobConfig(options_).ok());
  auto with = [&](auto change) {
    ChiefOptions o = options_;
    change(o.job);
    return BuildJobConfig(o);
  };
  ExpectInvalid(with([](JobOptions& j) { j.optimizer = "lamb"; }),
                "--optimizer 'lamb' is not one of sgd, momentum, adam, adamw, adagrad, rmsprop");
  ExpectInvalid(with([](JobOptions& j) { j.nesterov = true; }),
                "--nesterov needs --optimizer=momentum");
  ExpectInvalid(with([](JobOptions& j) { j.weight_decay = -0.1f; }),
                "--weight_decay must be finite and not negative");
  ExpectInvalid(with([](JobOptions& j) { j.weight_decay = std::nanf(""); }), "--weight_decay");
  ExpectInvalid(with([](JobOptions& j) {
                  j.optimizer = "adamw";
                  j.beta2 = 1;
                }),
                "--beta1 and --beta2 must be in (0, 1)");
  ExpectInvalid(with([](JobOptions& j) { j.epsilon = -1e-8f; }), "--epsilon must not be negative");
  ExpectInvalid(with([](JobOptions& j) {
                  j.optimizer = "rmsprop";
                  j.rmsprop_alpha = 1;
                }),
                "--rmsprop_alpha must be in (0, 1)");
  ExpectInvalid(with([](JobOptions& j) { j.lr_decay = "linear"; }),
                "--lr_decay 'linear' is not one of constant, step, exponential, cosine");
  ExpectInvalid(with([](JobOptions& j) { j.lr_warmup_steps = -1; }),
                "--lr_warmup_steps and --lr_decay_steps must not be negative");
  ExpectInvalid(with([](JobOptions& j) { j.lr_decay = "step"; }),
                "--lr_decay=step needs --lr_decay_steps");
  ExpectInvalid(with([](JobOptions& j) {
                  j.lr_decay = "exponential";
                  j.lr_decay_steps = 10;
                  j.lr_decay_rate = 2;
                }),
                "--lr_decay_rate must be in (0, 1]");
  ExpectInvalid(with([](JobOptions& j) {
                  j.lr_decay = "cosine";
                  j.lr_min = 1;
                }),
                "--lr_min must be in [0, --learning_rate");
  ExpectInvalid(with([](JobOptions& j) {
                  j.lr_decay = "cosine";
                  j.lr_warmup_steps = 100;
                }),
                "--lr_warmup_steps 100 leaves none of the job's 100 steps to the cosine decay");
  // Flags of other optimizers or schedules are not checked.
  EXPECT_TRUE(with([](JobOptions& j) {
                j.beta1 = 7;
                j.rmsprop_alpha = -1;
                j.lr_decay_rate = 9;
                j.lr_min = 5;
              }).ok());
}

TEST_F(JobConfigTest, WireDtype) {
  WriteData(kCount, 28, false);
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->wire_dtype(), JobConfig::FP32) << "the default";
  for (const auto& [flag, dtype] :
       {std::pair{"bf16", JobConfig::BF16}, std::pair{"fp16", JobConfig::FP16},
        std::pair{"FP32", JobConfig::FP32}}) {
    options_.job.wire_dtype = flag;
    job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << flag << ": " << job.status();
    EXPECT_EQ(job->wire_dtype(), dtype) << flag;
  }
  for (const char* bad : {"float16", "", "int8"}) {
    options_.job.wire_dtype = bad;
    ExpectInvalid(BuildJobConfig(options_),
                  absl::StrCat("--wire_dtype '", bad, "' is not one of fp32, bf16, fp16"));
  }
}

TEST_F(JobConfigTest, BnMomentum) {
  WriteData(kCount, 28, false);
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_FLOAT_EQ(job->bn_momentum(), 0.1f) << "the default, PyTorch's";
  for (float m : {0.01f, 0.5f, 1.0f}) {
    options_.job.bn_momentum = m;
    job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << m << ": " << job.status();
    EXPECT_FLOAT_EQ(job->bn_momentum(), m);
  }
  for (float bad : {0.0f, -0.1f, 1.5f, std::nanf("")}) {
    options_.job.bn_momentum = bad;
    ExpectInvalid(BuildJobConfig(options_), "--bn_momentum must be in (0, 1]");
  }
}

TEST_F(JobConfigTest, AllReduceBucketSize) {
  WriteData(kCount, 28, false);
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->allreduce_bucket_bytes(), 1 << 20) << "1 MiB by default";
  for (const auto& [mb, bytes] :
       std::vector<std::pair<double, int64_t>>{{0.0625, 65536}, {2.5, 2621440}, {64, 67108864}}) {
    options_.job.allreduce_bucket_mb = mb;
    job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << mb << ": " << job.status();
    EXPECT_EQ(job->allreduce_bucket_bytes(), bytes) << mb;
  }
  // Below 64 KiB, or a ring message (half a bucket) over gRPC's 64 MiB.
  for (double bad : {0.0, -1.0, 0.01, 65.0, 1e9, std::nan("")}) {
    options_.job.allreduce_bucket_mb = bad;
    ExpectInvalid(BuildJobConfig(options_), "--allreduce_bucket_mb must be in [0.0625, 64]");
  }
}

// --slice_mb cuts the cnn's fc1/weights (1.6 MB, over the test's 2 ps) into
// slices of at most that size, as many on each ps.
TEST_F(JobConfigTest, SliceSize) {
  WriteData(kCount, 28, false);
  auto fc1_slices = [](const JobConfig& job) {
    for (const VariablePlacement& v : job.placement().variable()) {
      if (v.name() == "fc1/weights") return v.slice_size();
    }
    return -1;
  };
  for (const auto& [mb, slices] :
       std::vector<std::pair<double, int>>{{1, 2}, {0.25, 8}, {0.0625, 26}, {0, 2}, {1024, 2}}) {
    options_.job.slice_mb = mb;
    absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
    ASSERT_TRUE(job.ok()) << mb << ": " << job.status();
    EXPECT_EQ(fc1_slices(*job), slices) << mb;
  }
  for (double bad : {-1.0, 0.01, 1025.0, 1e12, std::nan("")}) {
    options_.job.slice_mb = bad;
    ExpectInvalid(BuildJobConfig(options_), "--slice_mb must be 0 or in [0.0625, 1024]");
  }
}

TEST_F(JobConfigTest, RejectsBadSettings) {
  WriteData(kCount, 28, false);
  ASSERT_TRUE(BuildJobConfig(options_).ok());
  auto with = [&](auto change) {
    ChiefOptions o = options_;
    change(o);
    return BuildJobConfig(o);
  };
  ExpectInvalid(with([](ChiefOptions& o) { o.coordinator.model_dir.clear(); }),
                "--model_dir is required");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.batch_size = 0; }),
                "--batch_size must be positive");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.batch_size = -3; }),
                "--batch_size must be positive");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.batch_size = 51; }),
                "--batch_size 51 exceeds the 50 examples each worker sees per epoch");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.optimizer = "adadelta"; }),
                "--optimizer 'adadelta' is not one of sgd, momentum, adam");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.learning_rate = 0; }),
                "--learning_rate must be positive");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.learning_rate = -0.1f; }),
                "--learning_rate must be positive");
  ExpectInvalid(
      with([](ChiefOptions& o) { o.job.learning_rate = std::numeric_limits<float>::infinity(); }),
      "--learning_rate must be positive");
  ExpectInvalid(
      with([](ChiefOptions& o) { o.job.learning_rate = std::numeric_limits<float>::quiet_NaN(); }),
      "--learning_rate must be positive");
  ExpectInvalid(with([](ChiefOptions& o) {
                  o.job.optimizer = "momentum";
                  o.job.momentum = 1.5f;
                }),
                "--momentum must be in (0, 1)");
  ExpectInvalid(with([](ChiefOptions& o) {
                  o.job.optimizer = "momentum";
                  o.job.momentum = 0;
                }),
                "--momentum must be in (0, 1)");
  ExpectInvalid(
      with([&](ChiefOptions& o) { o.job.data_dir = (fs::path(dir_) / "missing").string(); }),
      "--data_dir");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.model = "no-such-model"; }),
                "'no-such-model' is neither a built-in model");
  ExpectInvalid(with([](ChiefOptions& o) { o.coordinator.log_every_steps = 0; }),
                "--log_every_steps must be positive");
  ExpectInvalid(with([](ChiefOptions& o) { o.job.compute_threads = -1; }),
                "--compute_threads must not be negative");
  ExpectInvalid(with([](ChiefOptions& o) { o.cluster.cluster.worker.clear(); }), "no workers");
}

TEST_F(JobConfigTest, RejectsImagesOfTheWrongSize) {
  WriteData(kCount, 20, false);
  ExpectInvalid(BuildJobConfig(options_), "model cnn takes 1x28x28 inputs");
  ExpectInvalid(BuildJobConfig(options_), "are 1x20x20");
}

TEST_F(JobConfigTest, RejectsMismatchedImagesAndLabels) {
  WriteData(kCount, 28, false);
  WritePlain((fs::path(dir_) / "train-labels-idx1-ubyte").string(),
             IdxBytes(0x801, {3}, {1, 2, 3}));
  ExpectInvalid(BuildJobConfig(options_), "do not match");
}

// --data_format=synthetic: the examples are made, not read, so no data files are
// needed and any input shape works (the resnet's 3x32x32).
TEST_F(JobConfigTest, SyntheticDatasetForTheResnet) {
  options_.job.model = "resnet";
  options_.job.data.set_format("synthetic");
  options_.job.synthetic_examples = 1000;
  options_.job.data_dir = (fs::path(dir_) / "no-such-dir").string();
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->data().format(), "synthetic");
  EXPECT_EQ(job->num_examples(), 1000);
  // ceil(1000 / 2 workers) = 500 examples each: 62 full batches of 8.
  EXPECT_EQ(job->steps_per_epoch(), 62);
  EXPECT_EQ(job->train_steps(), 62);
  EXPECT_EQ(job->model().name(), "resnet");
  EXPECT_EQ(job->model().input().channels(), 3);
  EXPECT_EQ(job->model().input().height(), 32);
  EXPECT_EQ(job->model().input().width(), 32);
  EXPECT_EQ(job->placement().variable_size(), 102) << "every resnet variable is placed";
  // Batch norm's running statistics are placed like the rest, marked not
  // trainable; the job carries the default momentum for them.
  int statistics = 0;
  for (const VariablePlacement& v : job->placement().variable()) {
    const bool running = v.name().find("/running_") != std::string::npos;
    EXPECT_EQ(v.non_trainable(), running) << v.name();
    statistics += running;
  }
  EXPECT_EQ(statistics, 40);
  EXPECT_FLOAT_EQ(job->bn_momentum(), 0.1f);

  // The inputs are standardized with the statistics of the very examples the
  // workers will make.
  absl::StatusOr<data::Dataset> made =
      data::MakeSynthetic(data::SyntheticShape{3, 32, 32, 10}, 1000, data::Split::kTrain);
  ASSERT_TRUE(made.ok()) << made.status();
  double sum = 0, sum_sq = 0;
  for (float p : made->images) {
    sum += p;
    sum_sq += static_cast<double>(p) * p;
  }
  const double n = static_cast<double>(made->images.size());
  const double mean = sum / n;
  const double stddev = std::sqrt(sum_sq / n - mean * mean);
  EXPECT_NEAR(job->model().input().mean(), mean, 1e-6);
  EXPECT_NEAR(job->model().input().stddev(), stddev, 1e-6);
  // Half a uniform pattern and half uniform noise: mean 1/2, variance
  // 2 * (1/4) * (1/12) = 1/24.
  EXPECT_NEAR(job->model().input().mean(), 0.5, 0.01);
  EXPECT_NEAR(job->model().input().stddev(), std::sqrt(1.0 / 24), 0.01);

  // More examples, more steps.
  options_.job.synthetic_examples = 4000;
  job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->num_examples(), 4000);
  EXPECT_EQ(job->steps_per_epoch(), 250);
}

TEST_F(JobConfigTest, SyntheticDatasetTakesAnyClassCount) {
  // MNIST-format data has 10 classes; synthetic data has as many as the model.
  const std::string spec = (fs::path(dir_) / "five.pbtxt").string();
  std::ofstream(spec) << "input { channels: 1 height: 6 width: 6 } num_classes: 5 "
                         "layer { name: \"d\" dense { units: 5 } }";
  options_.job.model = spec;
  options_.job.data.set_format("synthetic");
  options_.job.synthetic_examples = 64;
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->model().num_classes(), 5);
  EXPECT_EQ(job->num_examples(), 64);
  EXPECT_EQ(job->steps_per_epoch(), 4);
  EXPECT_GT(job->model().input().stddev(), 0.1);

  WriteData(kCount, 6, false);
  options_.job.data.set_format("idx");
  ExpectInvalid(BuildJobConfig(options_), "with 5 classes, but the images in");
}

// --input_mean/--input_stddev: per-channel standardization in the spec
// instead of the measured mean and stddev; one value stands for every
// channel; a wrong count, a stddev that is not positive, or one flag alone
// is refused on one line.
TEST_F(JobConfigTest, InputMeanAndStddevPerChannel) {
  options_.job.model = "resnet";
  options_.job.data.set_format("synthetic");
  options_.job.synthetic_examples = 64;
  options_.job.input_mean = "0.485, 0.456,0.406";
  options_.job.input_stddev = "0.25";
  absl::StatusOr<JobConfig> job = BuildJobConfig(options_);
  ASSERT_TRUE(job.ok()) << job.status();
  const InputSpec& in = job->model().input();
  EXPECT_THAT(in.channel_mean(), ElementsAre(0.485f, 0.456f, 0.406f));
  EXPECT_THAT(in.channel_stddev(), ElementsAre(0.25f, 0.25f, 0.25f));
  EXPECT_EQ(in.stddev(), 0);
  EXPECT_THAT(DescribeJob(*job),
              HasSubstr("inputs standardized per channel with mean 0.485,0.456,0.406 stddev "
                        "0.25,0.25,0.25"));

  options_.job.input_stddev = "0.2,0.2";
  ExpectInvalid(BuildJobConfig(options_),
                "--input_stddev has 2 values; the model's input has 3 channels (give 1 or 3)");
  options_.job.input_stddev = "0.2,0,0.2";
  ExpectInvalid(BuildJobConfig(options_), "--input_stddev: '0' is not a positive number");
  options_.job.input_stddev = "";
  ExpectInvalid(BuildJobConfig(options_), "--input_mean and --input_stddev go together");
}

TEST_F(JobConfigTest, RejectsBadDatasets) {
  WriteData(kCount, 28, false);
  options_.job.data.set_format("imagenet");
  ExpectInvalid(
      BuildJobConfig(options_),
      "--data_format 'imagenet' is not one of idx, synthetic, tfrecord, image_folder, csv");
  // No format: recognized from what --data_dir holds.
  options_.job.data.set_format("");
  absl::StatusOr<JobConfig> recognized = BuildJobConfig(options_);
  ASSERT_TRUE(recognized.ok()) << recognized.status();
  EXPECT_EQ(recognized->data().format(), "idx");

  // The resnet takes 3x32x32 images; the Fashion-MNIST files hold 1x28x28.
  options_.job.data.set_format("idx");
  options_.job.model = "resnet";
  ExpectInvalid(BuildJobConfig(options_), "model resnet takes 3x32x32 inputs");
  ExpectInvalid(BuildJobConfig(options_), "are 1x28x28");

  options_.job.data.set_format("synthetic");
  options_.job.synthetic_examples = 0;
  ExpectInvalid(BuildJobConfig(options_), "--synthetic_examples");
  options_.job.synthetic_examples = -10;
  ExpectInvalid(BuildJobConfig(options_), "--synthetic_examples");
  options_.job.synthetic_examples = 10;  // 5 per worker, batches of 8
  ExpectInvalid(BuildJobConfig(options_),
                "--batch_size 8 exceeds the 5 examples each worker sees per epoch");
  options_.job.synthetic_examples = 16;
  EXPECT_TRUE(BuildJobConfig(options_).ok());
}

}  // namespace
}  // namespace psflow::chief
