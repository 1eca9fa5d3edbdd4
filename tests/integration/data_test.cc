// Process-level tests of the data formats on real Fashion-MNIST examples,
// written by the tests into TFRecord shards (PNG in tf.Example), a CSV file
// and an image folder: short jobs train from each and psflow-eval reads them;
// the test split as TFRecords gives exactly the figures of the IDX files; a
// corrupt record fails the job on one line naming the file and offset unless
// --skip_bad_records; a worker whose TFRecords are 4x the memory it may
// use (a memory cgroup) trains through them; and a recommendation model with
// embedding tables trains on planted click logs in Criteo's layout.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "data/image/image.h"
#include "data/mnist.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/process.h"

namespace psflow::itest {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kData[] = "/usr/share/datasets/fashion-mnist";

class DataTest : public TempDirTest {
 protected:
  void SetUp() override {
    TempDirTest::SetUp();
    if (!fs::exists(fs::path(kData) / "t10k-images-idx3-ubyte.gz") &&
        !fs::exists(fs::path(kData) / "t10k-images-idx3-ubyte")) {
      GTEST_SKIP() << "no Fashion-MNIST in " << kData << " (apt-get install dataset-fashion-mnist)";
    }
    for (auto [split, prefix] : {std::pair{0, "train"}, std::pair{1, "t10k"}}) {
      auto images = data::ReadIdxFileInDir(kData, std::string(prefix) + "-images-idx3-ubyte");
      auto labels = data::ReadIdxFileInDir(kData, std::string(prefix) + "-labels-idx1-ubyte");
      ASSERT_TRUE(images.ok() && labels.ok());
      images_[split] = std::move(images->data);
      labels_[split] = std::move(labels->data);
    }
  }

  // Example i of split (0 train, 1 test) as a PNG.
  std::string Png(int split, int64_t i) const {
    data::Image image;
    image.height = image.width = 28;
    image.channels = 1;
    image.pixels.assign(images_[split].begin() + i * 784, images_[split].begin() + (i + 1) * 784);
    return data::EncodePng(image).value();
  }

  // Examples [begin, end) of `split` into `shards` TFRecord files
  // dir_/<name>-0000s-of-0000n, the first one gzipped when `gzip_first`.
  void WriteShards(int split, int64_t begin, int64_t end, int shards, const std::string& name,
                   bool gzip_first = false, int64_t padding = 0) const {
    const std::string pad(static_cast<size_t>(padding), 'p');
    for (int s = 0; s < shards; ++s) {
      const std::string path = absl::StrCat(dir_, "/", name, "-0000", s, "-of-0000", shards);
      auto writer =
          data::RecordWriter::Open(path, s == 0 && gzip_first ? data::RecordCompression::kGzip
                                                              : data::RecordCompression::kNone);
      ASSERT_TRUE(writer.ok()) << writer.status();
      const int64_t lo = begin + (end - begin) * s / shards,
                    hi = begin + (end - begin) * (s + 1) / shards;
      for (int64_t i = lo; i < hi; ++i) {
        data::Example e;
        data::AddBytes(&e, "image/encoded", Png(split, i));
        data::AddInt64(&e, "image/class/label", labels_[split][i]);
        if (padding > 0) data::AddBytes(&e, "image/padding", pad);
        ASSERT_TRUE((*writer)->Write(e.SerializeAsString()).ok());
      }
      ASSERT_TRUE((*writer)->Close().ok());
    }
  }

  // Launches a cluster of 1 ps and 2 workers (and `evaluators`) on the mlp
  // with `flags`.
  RunResult Train(const std::vector<std::string>& flags, int evaluators = 0) const {
    std::vector<std::string> args = {"--ps=1",
                                     "--workers=2",
                                     "--evaluators=" + std::to_string(evaluators),
                                     "--",
                                     "--model=mlp",
                                     "--optimizer=adam",
                                     "--learning_rate=0.002",
                                     "--batch_size=32",
                                     "--log_every_steps=50",
                                     "--model_dir=" + dir_ + "/model"};
    args.insert(args.end(), flags.begin(), flags.end());
    return RunProcess(Bin("psflow-launch"), args, {}, seconds(120));
  }

  static double Accuracy(const RunResult& eval) {
    std::smatch m;
    if (!std::regex_search(eval.out, m, std::regex(R"(accuracy: ([0-9.]+))"))) return -1;
    return std::stod(m[1].str());
  }

  std::vector<uint8_t> images_[2], labels_[2];
};

TEST_F(DataTest, TfRecordJobTrainsAndItsTestSplitGivesTheFiguresOfTheIdxFiles) {
  WriteShards(0, 0, 6000, 3, "train", /*gzip_first=*/true);
  WriteShards(1, 0, 10000, 2, "test");
  // With an evaluator, which reads the test split from the chief's --eval_files.
  RunResult train = Train({"--train_files=" + dir_ + "/train-*", "--eval_files=" + dir_ + "/test-*",
                           "--epochs=2", "--shuffle_buffer=500"},
                          /*evaluators=*/1);
  ASSERT_EQ(train.exit_code, 0) << train.description;
  // Recognized from the files, counted, listed in the chief's job line.
  EXPECT_THAT(train.output, HasSubstr("data: tfrecord, 3 files (" + dir_ + "/train-00000-of-00003"))
      << train.description;
  EXPECT_THAT(train.output, HasSubstr("6000 records, evaluation " + dir_ + "/test-*"));
  // 6000 / 2 workers / 32 = 93 steps an epoch.
  EXPECT_THAT(train.output, HasSubstr("186 steps = 2.00 epochs of 93 steps"));

  RunResult from_tfrecord =
      RunEval(dir_ + "/model", {"--data_format=tfrecord", "--eval_files=" + dir_ + "/test-*"});
  RunResult from_idx = RunEval(dir_ + "/model", {"--data_dir=" + std::string(kData)});
  ASSERT_EQ(from_tfrecord.exit_code, 0) << from_tfrecord.description;
  ASSERT_EQ(from_idx.exit_code, 0) << from_idx.description;
  EXPECT_EQ(from_tfrecord.out, from_idx.out) << "the same 10000 images, the same figures";
  // The evaluator's figures of the final model are psflow-eval's.
  std::smatch done;
  ASSERT_TRUE(std::regex_search(
      train.output, done,
      std::regex(R"(chief\] done: .* test loss ([0-9.]+) acc ([0-9.]+) \(evaluator\))")))
      << train.description;
  EXPECT_THAT(from_idx.out, HasSubstr("accuracy: " + done[2].str() + "\nloss: " + done[1].str()));
  // 2 epochs of 6000 examples: well above chance (0.1).
  EXPECT_GE(Accuracy(from_tfrecord), 0.70) << from_tfrecord.description;
}

TEST_F(DataTest, CsvJobTrainsOnItsNumericColumns) {
  for (int split = 0; split < 2; ++split) {
    std::ofstream csv(dir_ + (split == 0 ? "/train.csv" : "/test.csv"));
    csv << "label";
    for (int p = 0; p < 784; ++p) csv << ",p" << p;
    csv << ",note\n";
    for (int64_t i = 0; i < (split == 0 ? 3000 : 1000); ++i) {
      csv << static_cast<int>(labels_[split][i]);
      for (int p = 0; p < 784; ++p) csv << "," << images_[split][i * 784 + p] / 255.0;
      csv << ",\"a note, quoted\"\n";
    }
  }
  // From --data_dir's train.csv and test.csv.
  RunResult train =
      Train({"--data_dir=" + dir_, "--csv_columns=label:label,note:text,*:numeric", "--epochs=2"});
  ASSERT_EQ(train.exit_code, 0) << train.description;
  EXPECT_THAT(train.output, HasSubstr("data: csv, 1 file (" + dir_ + "/train.csv), 3000 records"));
  RunResult eval =
      RunEval(dir_ + "/model", {"--data_format=csv", "--eval_files=" + dir_ + "/test.csv",
                                "--csv_columns=label:label,note:text,*:numeric"});
  ASSERT_EQ(eval.exit_code, 0) << eval.description;
  EXPECT_THAT(eval.out, HasSubstr("examples: 1000"));
  EXPECT_GE(Accuracy(eval), 0.65) << eval.description;

  // A model whose input is not the numeric columns: one line, exit 1.
  RunResult wrong = Train({"--data_dir=" + dir_, "--csv_columns=label:label,*:ignore"});
  EXPECT_EQ(wrong.exit_code, 1) << wrong.description;
  EXPECT_THAT(wrong.output, HasSubstr("train.csv has 0 numeric columns, but the model takes 784"));
}

// A recommendation model on click logs in Criteo's layout with a planted
// model (psflow-data synth-criteo): its embedding tables (dense variables on
// the ps) read the categorical columns' ids, and it ranks the test split far
// better than an MLP of the numeric columns alone; the evaluator and
// psflow-eval give the AUC. A model reading a column the data lacks is
// refused on one line.
TEST_F(DataTest, CriteoJobWithEmbeddingsRanksBetterThanItsNumericColumnsAlone) {
  RunResult made = RunProcess(Bin("psflow-data"),
                              {"synth-criteo", "--output=" + dir_, "--train_examples=40000",
                               "--test_examples=4000", "--vocab_scale=0.01", "--seed=3"},
                              {}, seconds(60));
  ASSERT_EQ(made.exit_code, 0) << made.description;
  std::string dlrm = "name: \"dlrm_small\" input { channels: 1 height: 1 width: 13 ";
  std::string layers =
      "layer { name: \"bottom\" dense { units: 8 } } layer { name: \"brelu\" relu {} } ";
  std::string others;
  for (int c = 1; c <= 26; ++c) {
    absl::StrAppend(&dlrm, "id_feature { name: \"C", c, "\" } ");
    absl::StrAppend(&layers, "layer { name: \"e", c, "\" embedding { feature: \"C", c,
                    "\" rows: 2000 dim: 8 } } ");
    absl::StrAppend(&others, "others: \"e", c, "\" ");
  }
  absl::StrAppend(&dlrm, "} num_classes: 2 ", layers, "layer { name: \"inter\" input: \"brelu\" ",
                  "interaction { ", others, "} } layer { name: \"top\" dense { units: 32 } } ",
                  "layer { name: \"trelu\" relu {} } layer { name: \"out\" dense { units: 2 } }");
  std::ofstream(dir_ + "/dlrm.pbtxt") << dlrm;
  std::ofstream(dir_ + "/mlp.pbtxt")
      << "name: \"numeric\" input { channels: 1 height: 1 width: 13 } num_classes: 2 "
         "layer { name: \"h\" dense { units: 32 } } layer { name: \"r\" relu {} } "
         "layer { name: \"out\" dense { units: 2 } }";
  const std::vector<std::string> criteo = {"--data_format=csv", "--csv_preset=criteo"};
  auto train = [&](const std::string& model, int evaluators) {
    std::vector<std::string> args = {"--ps=2",
                                     "--workers=2",
                                     "--evaluators=" + std::to_string(evaluators),
                                     "--",
                                     "--model=" + dir_ + "/" + model + ".pbtxt",
                                     "--data_dir=" + dir_,
                                     "--train_steps=300",
                                     "--batch_size=128",
                                     "--optimizer=adam",
                                     "--learning_rate=0.003",
                                     "--model_dir=" + dir_ + "/" + model};
    args.insert(args.end(), criteo.begin(), criteo.end());
    return RunProcess(Bin("psflow-launch"), args, {}, seconds(120));
  };
  auto auc = [&](const std::string& model) {
    std::vector<std::string> flags = criteo;
    flags.push_back("--data_dir=" + dir_);
    RunResult eval = RunEval(dir_ + "/" + model, flags);
    std::smatch m;
    EXPECT_TRUE(std::regex_search(eval.out, m, std::regex(R"(auc: ([0-9.]+))")))
        << eval.description;
    return m.empty() ? -1.0 : std::stod(m[1].str());
  };
  RunResult embedded = train("dlrm", 1);
  ASSERT_EQ(embedded.exit_code, 0) << embedded.description;
  EXPECT_THAT(embedded.output, HasSubstr("auc 0."));  // the evaluator's figures
  RunResult numeric = train("mlp", 0);
  ASSERT_EQ(numeric.exit_code, 0) << numeric.description;
  const double with_ids = auc("dlrm"), without = auc("mlp");
  EXPECT_GE(with_ids, 0.68);
  EXPECT_GE(with_ids, without + 0.1);

  std::ofstream(dir_ + "/c27.pbtxt") << absl::StrReplaceAll(dlrm, {{"\"C1\"", "\"C27\""}});
  RunResult lacking = train("c27", 0);
  EXPECT_EQ(lacking.exit_code, 1) << lacking.description;
  EXPECT_THAT(lacking.output,
              HasSubstr("model dlrm_small reads id feature 'C27' (1 id per example), which the "
                        "csv data lack (they have C1, C2"));
}

TEST_F(DataTest, ImageFolderJobTrains) {
  for (int64_t i = 0; i < 1200; ++i) {
    const fs::path d =
        fs::path(dir_) / "images" / "train" / ("class" + std::to_string(labels_[0][i]));
    fs::create_directories(d);
    std::ofstream(d / (std::to_string(i) + ".png"), std::ios::binary) << Png(0, i);
  }
  RunResult train = Train({"--data_dir=" + dir_ + "/images", "--epochs=1"});
  ASSERT_EQ(train.exit_code, 0) << train.description;
  EXPECT_THAT(train.output, HasSubstr("data: image_folder " + dir_ +
                                      "/images/train, 1200 images in 10 classes, no evaluation"))
      << train.description;
}

// Flips a byte of the data of record `index` of a TFRecord file.
void CorruptRecord(const std::string& path, int64_t index) {
  auto reader = data::RecordReader::Open(path);
  ASSERT_TRUE(reader.ok());
  for (int64_t i = 0; i < index; ++i) ASSERT_TRUE((*reader)->Skip().value());
  const int64_t offset = (*reader)->offset();
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(offset + 12 + 40);  // 40 bytes into the record's data
  char c = 0;
  f.seekg(offset + 12 + 40);
  f.get(c);
  f.seekp(offset + 12 + 40);
  f.put(static_cast<char>(c ^ 0x5a));
}

TEST_F(DataTest, ACorruptRecordFailsTheJobUnlessSkipped) {
  WriteShards(0, 0, 2400, 2, "train");
  // Past the 1000 the chief reads for its statistics: a worker meets it.
  CorruptRecord(dir_ + "/train-00001-of-00002", 700);
  RunResult failed = Train({"--train_files=" + dir_ + "/train-*", "--epochs=1"});
  EXPECT_EQ(failed.exit_code, 1) << failed.description;
  EXPECT_THAT(failed.output, HasSubstr(dir_ + "/train-00001-of-00002: corrupt record at offset "))
      << failed.description;
  EXPECT_THAT(failed.output, HasSubstr("its data fails the CRC"));

  fs::remove_all(dir_ + "/model");
  RunResult skipped =
      Train({"--train_files=" + dir_ + "/train-*", "--epochs=1", "--skip_bad_records"});
  EXPECT_EQ(skipped.exit_code, 0) << skipped.description;
}

// The memory cgroup (v2 or v1) this test may create, or "" (then skipped).
std::string MakeMemoryCgroup(const std::string& name, int64_t limit_bytes) {
  for (const auto& [root, limit_file] :
       {std::pair<std::string, std::string>{"/sys/fs/cgroup/memory", "memory.limit_in_bytes"},
        std::pair<std::string, std::string>{"/sys/fs/cgroup", "memory.max"}}) {
    const fs::path dir = fs::path(root) / name;
    std::error_code ec;
    if (!fs::exists(fs::path(root) / "cgroup.procs", ec)) continue;
    fs::create_directory(dir, ec);
    if (ec || !fs::exists(dir / limit_file)) continue;
    std::ofstream(dir / limit_file) << limit_bytes;
    // Without swap accounting, a v1 group could still swap: cap that too.
    if (fs::exists(dir / "memory.memsw.limit_in_bytes")) {
      std::ofstream(dir / "memory.memsw.limit_in_bytes") << limit_bytes;
    }
    if (fs::exists(dir / "memory.swap.max")) std::ofstream(dir / "memory.swap.max") << 0;
    return dir.string();
  }
  return "";
}

TEST_F(DataTest, AWorkerTrainsThroughTfRecordsFourTimesItsMemory) {
  const int64_t limit = int64_t{160} << 20;
  const std::string cgroup = MakeMemoryCgroup(absl::StrCat("psflow-data-test-", getpid()), limit);
  if (cgroup.empty()) GTEST_SKIP() << "no memory cgroup can be made here (needs root and cgroupfs)";
  // 700 MB of records: each example carries 100 KiB that is read, not decoded.
  WriteShards(0, 0, 7000, 7, "big", false, 100 << 10);
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    if (e.path().filename().string().rfind("big-", 0) == 0) bytes += e.file_size();
  }
  ASSERT_GE(bytes, 4 * limit);
  // A chief, a ps and one worker, the worker in the group.
  const std::vector<int> ports = FreePorts(3);
  const std::string config =
      absl::StrCat("{\"chief\": [\"127.0.0.1:", ports[0], "\"], \"ps\": [\"127.0.0.1:", ports[1],
                   "\"], \"worker\": [\"127.0.0.1:", ports[2], "\"]}");
  auto env = [&](const std::string& pod) {
    return std::map<std::string, std::string>{{"CLUSTER_CONFIG", config},
                                              {"POD_NAME", "psflow-" + pod}};
  };
  Process ps(Bin("psflow-ps"), {}, env("ps-0"));
  Process worker("/bin/sh",
                 {"-c", "echo $$ > " + cgroup + "/cgroup.procs && exec " + Bin("psflow-worker")},
                 env("worker-0"));
  Process chief(Bin("psflow-chief"),
                {"--model=mlp", "--batch_size=32", "--epochs=1", "--shuffle_buffer=64",
                 "--prefetch_batches=2", "--log_every_steps=50", "--compute_threads=1",
                 "--train_files=" + dir_ + "/big-*", "--model_dir=" + dir_ + "/model"},
                env("chief-0"));
  const int chief_exit = chief.WaitOrKill(seconds(180));
  const int worker_exit = worker.WaitOrKill(seconds(30));
  ps.WaitOrKill(seconds(30));
  std::error_code ec;
  fs::remove(cgroup, ec);
  ASSERT_EQ(worker_exit, 0) << worker.Describe();
  ASSERT_EQ(chief_exit, 0) << chief.Describe();
  EXPECT_THAT(chief.output(), HasSubstr("7000 records"));
  EXPECT_THAT(chief.output(), HasSubstr("done: 218 steps"));
}

}  // namespace
}  // namespace psflow::itest
