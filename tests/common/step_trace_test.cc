#include "common/step_trace.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include <google/protobuf/util/json_util.h>

#include "common/file_util.h"
#include "gtest/gtest.h"
#include "tests/common/scratch_dir.h"

namespace psflow {
namespace {

namespace fs = std::filesystem;

// The file at `path`, parsed back (as a viewer would read it).
TraceFile ReadTrace(const std::string& path) {
  absl::StatusOr<std::string> json = ReadFile(path);
  EXPECT_TRUE(json.ok()) << json.status();
  TraceFile file;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json.value_or(""), &file).ok());
  return file;
}

// The spans ("X" events) of `file`.
std::vector<TraceEvent> Spans(const TraceFile& file) {
  std::vector<TraceEvent> spans;
  for (const TraceEvent& e : file.trace_events()) {
    if (e.ph() == "X") spans.push_back(e);
  }
  return spans;
}

TEST(StepTraceTest, ParsesRangesAndOneStep) {
  int64_t first = -1, last = -1;
  ASSERT_TRUE(StepTrace::ParseSteps("100:102", &first, &last).ok());
  EXPECT_EQ(first, 100);
  EXPECT_EQ(last, 102);
  ASSERT_TRUE(StepTrace::ParseSteps("7", &first, &last).ok());
  EXPECT_EQ(first, 7);
  EXPECT_EQ(last, 7);
  for (const char* bad : {"", ":", "5:", ":5", "5:4", "-1:3", "a:b", "1:2:3", "1.5"}) {
    absl::Status s = StepTrace::ParseSteps(bad, &first, &last);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find("FIRST:LAST"), std::string::npos) << s.message();
  }
}

TEST(StepTraceTest, KeepsTheRangesSpansWithTheirThreadsAndWritesValidJson) {
  ScratchDir dir("step_trace");
  absl::StatusOr<std::unique_ptr<StepTrace>> trace =
      StepTrace::FromFlags(dir.path() + "/sub", "5:6", "worker", 3);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ASSERT_NE(*trace, nullptr);
  StepTrace& t = **trace;
  EXPECT_EQ(t.path(), dir.path() + "/sub/worker3.json");
  EXPECT_TRUE(fs::exists(t.path()));  // an empty timeline at once
  EXPECT_FALSE(t.Wants(4));
  EXPECT_TRUE(t.Wants(5));
  EXPECT_TRUE(t.Wants(6));
  EXPECT_FALSE(t.Wants(7));
  t.Record("before", 4, 10, 20);
  t.Record("push", 5, 100, 250, {{"lane", "2"}});
  int other_tid = 0;
  std::thread other([&] {
    other_tid = static_cast<int>(gettid());
    TraceSpan span(&t, "apply", 6);
    span.Arg("slice", "9");
  });
  other.join();
  {
    TraceSpan outside(&t, "after", 7);
    EXPECT_FALSE(outside.active());
  }
  TraceSpan null_trace(nullptr, "nothing", 5);
  EXPECT_FALSE(null_trace.active());
  EXPECT_EQ(t.spans(), 2);
  ASSERT_TRUE(t.Write().ok());

  const TraceFile file = ReadTrace(t.path());
  EXPECT_EQ(file.display_time_unit(), "ms");
  ASSERT_GE(file.trace_events_size(), 1);
  EXPECT_EQ(file.trace_events(0).ph(), "M");
  EXPECT_EQ(file.trace_events(0).name(), "process_name");
  EXPECT_EQ(file.trace_events(0).args().at("name"), "worker 3");
  const std::vector<TraceEvent> spans = Spans(file);
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].name(), "push");
  EXPECT_EQ(spans[0].cat(), "worker");
  EXPECT_EQ(spans[0].ts(), 100);
  EXPECT_EQ(spans[0].dur(), 150);
  EXPECT_EQ(spans[0].pid(), getpid());
  EXPECT_EQ(spans[0].tid(), gettid());
  EXPECT_EQ(spans[0].args().at("step"), "5");
  EXPECT_EQ(spans[0].args().at("lane"), "2");
  EXPECT_EQ(spans[1].name(), "apply");
  EXPECT_EQ(spans[1].tid(), other_tid);
  EXPECT_NE(spans[1].tid(), spans[0].tid());
  EXPECT_EQ(spans[1].args().at("step"), "6");
  EXPECT_EQ(spans[1].args().at("slice"), "9");
  EXPECT_GE(spans[1].dur(), 0);
  // The raw text has numbers where viewers want numbers.
  absl::StatusOr<std::string> json = ReadFile(t.path());
  ASSERT_TRUE(json.ok());
  EXPECT_NE(json->find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(json->find("\"ts\":100"), std::string::npos) << *json;
}

TEST(StepTraceTest, WritesOnceTheRangeIsOverAndAtTheEnd) {
  ScratchDir dir("step_trace");
  const std::string path = dir.path() + "/ps1.json";
  {
    absl::StatusOr<std::unique_ptr<StepTrace>> trace =
        StepTrace::FromFlags(dir.path(), "3", "ps", 1);
    ASSERT_TRUE(trace.ok()) << trace.status();
    StepTrace& t = **trace;
    t.Record("apply", 3, 1, 2);
    t.Reached(4);  // step 3's pulls may still come
    EXPECT_TRUE(Spans(ReadTrace(path)).empty());
    t.Reached(5);
    EXPECT_EQ(Spans(ReadTrace(path)).size(), 1u);
    // Later spans (of the range, written after all) reach the file at the end.
    t.Record("pull slice", 3, 5, 6);
    EXPECT_EQ(Spans(ReadTrace(path)).size(), 1u);
    ASSERT_TRUE(t.Write().ok());
    EXPECT_EQ(Spans(ReadTrace(path)).size(), 2u);
    t.Record("pull slice", 3, 7, 8);
  }
  // The destructor does not write again once Reached has.
  EXPECT_EQ(Spans(ReadTrace(path)).size(), 2u);
  {
    absl::StatusOr<std::unique_ptr<StepTrace>> trace =
        StepTrace::FromFlags(dir.path(), "3", "ps", 1);
    ASSERT_TRUE(trace.ok());
    (*trace)->Record("apply", 3, 1, 2);
  }
  // A process that stops before the range is over keeps what it traced.
  EXPECT_EQ(Spans(ReadTrace(path)).size(), 1u);
}

TEST(StepTraceTest, NoDirectoryMeansNoTraceAndBadOnesFailAtOnce) {
  absl::StatusOr<std::unique_ptr<StepTrace>> none = StepTrace::FromFlags("", "garbage", "ps", 0);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  ScratchDir dir("step_trace");
  EXPECT_TRUE(absl::IsInvalidArgument(StepTrace::FromFlags(dir.path(), "9:1", "ps", 0).status()));
  // A file where the directory should be.
  const std::string file = dir.path() + "/file";
  ASSERT_TRUE(WriteFileAtomically(file, "x").ok());
  absl::StatusOr<std::unique_ptr<StepTrace>> blocked =
      StepTrace::FromFlags(file + "/sub", "1:2", "worker", 0);
  EXPECT_FALSE(blocked.ok());
  EXPECT_NE(blocked.status().message().find("trace"), std::string::npos)
      << blocked.status().message();
  if (geteuid() != 0) {  // root writes anywhere
    const std::string locked = dir.path() + "/locked";
    ASSERT_EQ(mkdir(locked.c_str(), 0500), 0);
    EXPECT_FALSE(StepTrace::FromFlags(locked, "1:2", "worker", 0).ok());
  }
}

TEST(StepTraceTest, DropsSpansOverTheBound) {
  ScratchDir dir("step_trace");
  absl::StatusOr<std::unique_ptr<StepTrace>> trace =
      StepTrace::Create(dir.path(), "t.json", "ps 0", 0, 0, /*max_spans=*/100);
  ASSERT_TRUE(trace.ok());
  for (int64_t i = 0; i < 110; ++i) (*trace)->Record("x", 0, i, i + 1);
  EXPECT_EQ((*trace)->spans(), 100);
  EXPECT_EQ((*trace)->dropped(), 10);
  ASSERT_TRUE((*trace)->Write().ok());
  EXPECT_EQ(Spans(ReadTrace(dir.path() + "/t.json")).size(), 100u);
}

}  // namespace
}  // namespace psflow
