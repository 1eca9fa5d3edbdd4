#include "chief/summaries.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/event_file.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/summary.pb.h"

namespace psflow::chief {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

class SummariesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/summaries_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_",
                        ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The event files of `sub`, in name order (TensorBoard's reading order).
  std::vector<std::string> Files(const std::string& sub) const {
    std::vector<std::string> files;
    if (!fs::exists(dir_ + "/" + sub)) return files;
    for (const auto& e : fs::directory_iterator(dir_ + "/" + sub)) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    return files;
  }

  static std::vector<Event> Read(const std::string& path) {
    std::vector<Event> events;
    absl::StatusOr<std::string> contents = ReadFile(path);
    EXPECT_TRUE(contents.ok()) << contents.status();
    if (!contents.ok()) return events;
    absl::StatusOr<std::vector<std::string>> records = ParseRecords(*contents);
    EXPECT_TRUE(records.ok()) << records.status();
    if (!records.ok()) return events;
    for (const std::string& r : *records) {
      events.emplace_back();
      EXPECT_TRUE(events.back().ParseFromString(r));
    }
    return events;
  }

  // "version", "start <step>" or "<step>: tag=value ..." per event.
  static std::vector<std::string> Describe(const std::vector<Event>& events) {
    std::vector<std::string> out;
    for (const Event& e : events) {
      if (e.has_file_version()) {
        out.push_back("version " + e.file_version());
      } else if (e.has_session_log()) {
        out.push_back(absl::StrCat("start ", e.step()));
        EXPECT_EQ(e.session_log().status(), SessionLog::START);
      } else {
        std::string s = absl::StrCat(e.step(), ":");
        for (const Summary::Value& v : e.summary().value())
          absl::StrAppend(&s, " ", v.tag(), "=", v.simple_value());
        out.push_back(s);
      }
    }
    return out;
  }

  static ProgressLine Line(int64_t step) {
    ProgressLine l;
    l.step = step;
    l.train_steps = 1000;
    l.loss = 0.25 + 0.001 * static_cast<double>(step);
    l.accuracy = 0.5;
    l.learning_rate = 0.125;
    l.examples_per_sec = 9850;
    l.pull_ms = 2.5;
    l.compute_ms = 15;
    l.push_ms = 1.75;
    l.wait_ms = 2.25;
    l.step_ms = 21.5;
    l.live_workers = 2;
    l.num_workers = 3;
    l.live_ps = 1;
    l.num_ps = 2;
    l.time = absl::FromUnixSeconds(1700000000) + absl::Seconds(step);
    return l;
  }

  std::string dir_;
};

TEST_F(SummariesTest, TrainGetsAStartAndEveryLinesScalars) {
  std::vector<absl::Status> errors;
  {
    Summaries s(dir_, [&](const absl::Status& e) { errors.push_back(e); });
    s.OnRestart(0);
    s.OnLine(Line(100));
    // Flushed at every line: the file holds it while the writer is open.
    std::vector<std::string> files = Files("train");
    ASSERT_EQ(files.size(), 1u);
    EXPECT_THAT(fs::path(files[0]).filename().string(),
                ::testing::StartsWith("events.out.tfevents."));
    std::vector<Event> events = Read(files[0]);
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(Describe(events)[0], "version brain.Event:2");
    EXPECT_EQ(Describe(events)[1], "start 1");
    const Event& line = events[2];
    EXPECT_EQ(line.step(), 100);
    EXPECT_DOUBLE_EQ(line.wall_time(), 1700000100.0);
    std::vector<std::pair<std::string, float>> values;
    for (const Summary::Value& v : line.summary().value())
      values.emplace_back(v.tag(), v.simple_value());
    EXPECT_THAT(values,
                ElementsAre(Pair("loss", 0.35f), Pair("accuracy", 0.5f),
                            Pair("examples_per_sec", 9850.0f), Pair("learning_rate", 0.125f),
                            Pair("step_ms/pull", 2.5f), Pair("step_ms/compute", 15.0f),
                            Pair("step_ms/push", 1.75f), Pair("step_ms/wait", 2.25f),
                            Pair("live_workers", 2.0f), Pair("live_ps", 1.0f)));
    // Without a known rate, no learning_rate.
    ProgressLine no_rate = Line(200);
    no_rate.learning_rate.reset();
    s.OnLine(no_rate);
    events = Read(files[0]);
    ASSERT_EQ(events.size(), 4u);
    for (const Summary::Value& v : events[3].summary().value()) EXPECT_NE(v.tag(), "learning_rate");
    EXPECT_EQ(events[3].summary().value_size(), 9);
  }
  EXPECT_TRUE(errors.empty());
  EXPECT_TRUE(Files("eval").empty()) << "eval/ is made at the first evaluation only";
}

// A restart in the middle (a ps reloaded from the checkpoint of step 100)
// writes a START at 101 into the same file; a new Summaries (a restarted
// chief) writes a new file and leaves the old one as it was.
TEST_F(SummariesTest, RestartsWriteStartsAndNewProcessesNewFiles) {
  {
    Summaries s(dir_);
    s.OnRestart(0);
    s.OnLine(Line(100));
    s.OnLine(Line(200));
    s.OnRestart(100);
    s.OnLine(Line(200));
  }
  std::vector<std::string> files = Files("train");
  ASSERT_EQ(files.size(), 1u);
  const std::string old_path = files[0];
  const std::vector<std::string> old_events = Describe(Read(old_path));
  ASSERT_EQ(old_events.size(), 6u);
  EXPECT_EQ(old_events[1], "start 1");
  EXPECT_THAT(old_events[2], ::testing::StartsWith("100: loss="));
  EXPECT_EQ(old_events[4], "start 101");
  EXPECT_THAT(old_events[5], ::testing::StartsWith("200: loss="));
  const std::string old_bytes = *ReadFile(old_path);

  {
    Summaries s(dir_);
    s.OnRestart(200);
    s.OnLine(Line(300));
  }
  files = Files("train");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], old_path) << "the new file sorts after the old one";
  EXPECT_EQ(*ReadFile(old_path), old_bytes);
  const std::vector<std::string> events = Describe(Read(files[1]));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0], "version brain.Event:2");
  EXPECT_EQ(events[1], "start 201");
  EXPECT_THAT(events[2], ::testing::StartsWith("300: loss="));
}

TEST_F(SummariesTest, EvalOpensLazilyAndGetsTheRestartsStart) {
  Summaries s(dir_);
  s.OnRestart(500);
  EXPECT_TRUE(Files("eval").empty());
  s.Eval(600, 0.375, 0.875);
  std::vector<std::string> files = Files("eval");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_THAT(Describe(Read(files[0])),
              ElementsAre("version brain.Event:2", "start 501", "600: loss=0.375 accuracy=0.875"));
  // Open now: a restart reaches it at once.
  s.OnRestart(550);
  s.Eval(700, 0.25, 0.9375);
  EXPECT_THAT(Describe(Read(files[0])),
              ElementsAre("version brain.Event:2", "start 501", "600: loss=0.375 accuracy=0.875",
                          "start 551", "700: loss=0.25 accuracy=0.9375"));
  EXPECT_EQ(Files("eval").size(), 1u);
  EXPECT_EQ(Files("train").size(), 1u);
}

TEST_F(SummariesTest, EvalWithoutARestartWritesNoStart) {
  Summaries s(dir_);
  s.Eval(10, 1.5, 0.25);
  std::vector<std::string> files = Files("eval");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_THAT(Describe(Read(files[0])),
              ElementsAre("version brain.Event:2", "10: loss=1.5 accuracy=0.25"));
  EXPECT_TRUE(Files("train").empty());
}

// Errors reach the error callback, never the caller; once the directory can
// be written, the curves go on (the START that could not be written first).
TEST_F(SummariesTest, ErrorsAreReportedAndWritingResumes) {
  const std::string model_dir = dir_ + "/model";
  ASSERT_TRUE(WriteFileAtomically(model_dir, "not a directory").ok());
  std::vector<absl::Status> errors;
  Summaries s(model_dir, [&](const absl::Status& e) { errors.push_back(e); });
  s.OnRestart(0);
  s.OnLine(Line(100));
  s.Eval(100, 1, 0.5);
  ASSERT_EQ(errors.size(), 3u);
  for (const absl::Status& e : errors) EXPECT_THAT(std::string(e.message()), HasSubstr(model_dir));

  fs::remove(model_dir);
  fs::create_directories(model_dir);
  s.OnLine(Line(200));
  EXPECT_EQ(errors.size(), 3u);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(model_dir + "/train")) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const std::vector<std::string> events = Describe(Read(files[0]));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1], "start 1");
  EXPECT_THAT(events[2], ::testing::StartsWith("200: loss="));
}

// The chief's default: the first error is logged, the next ones within a
// minute are not.
TEST_F(SummariesTest, DefaultLogsTheFirstErrorOnly) {
  const std::string model_dir = dir_ + "/model";
  ASSERT_TRUE(WriteFileAtomically(model_dir, "not a directory").ok());
  ::testing::internal::CaptureStderr();
  {
    Summaries s(model_dir);
    s.OnRestart(0);
    for (int step = 100; step <= 500; step += 100) s.OnLine(Line(step));
    s.Eval(100, 1, 0.5);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  size_t count = 0;
  for (size_t at = log.find("cannot write TensorBoard event files"); at != std::string::npos;
       at = log.find("cannot write TensorBoard event files", at + 1))
    ++count;
  EXPECT_EQ(count, 1u) << log;
  EXPECT_THAT(log, HasSubstr("training goes on")) << log;
}

}  // namespace
}  // namespace psflow::chief
