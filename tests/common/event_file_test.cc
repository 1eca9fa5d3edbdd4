#include "common/event_file.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/summary.pb.h"

namespace psflow {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

uint32_t Le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(s[at + i])} << (8 * i);
  return v;
}

TEST(FrameRecordTest, LayoutAndChecksums) {
  const std::string framed = FrameRecord("hello");
  ASSERT_EQ(framed.size(), 8u + 4u + 5u + 4u);
  EXPECT_EQ(framed.substr(0, 8), std::string("\x05\0\0\0\0\0\0\0", 8));
  // The masked CRC-32C of those 8 bytes, as TensorBoard's own Python code
  // computes it (masked_crc32c(struct.pack('<Q', 5))).
  EXPECT_EQ(Le32(framed, 8), 0x3e04b2eau);
  EXPECT_EQ(Le32(framed, 8), MaskCrc32c(Crc32c(framed.substr(0, 8))));
  EXPECT_EQ(framed.substr(12, 5), "hello");
  EXPECT_EQ(Le32(framed, 17), MaskCrc32c(Crc32c("hello")));
}

TEST(ParseRecordsTest, ReadsBackWhatWasFramed) {
  const std::vector<std::string> records = {"first", "", std::string(1000, 'x'),
                                            std::string("\0\1\2", 3)};
  std::string file;
  for (const std::string& r : records) file += FrameRecord(r);
  absl::StatusOr<std::vector<std::string>> read = ParseRecords(file);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, records);
  ASSERT_TRUE(ParseRecords("").ok());
  EXPECT_TRUE(ParseRecords("")->empty());
}

TEST(ParseRecordsTest, DetectsEveryTruncation) {
  const std::string a = FrameRecord("some data"), b = FrameRecord("more");
  const std::string file = a + b;
  for (size_t cut = 0; cut < file.size(); ++cut) {
    absl::StatusOr<std::vector<std::string>> read = ParseRecords(file.substr(0, cut));
    if (cut == 0 || cut == a.size()) {
      ASSERT_TRUE(read.ok()) << cut << ": " << read.status();
      EXPECT_EQ(read->size(), cut == 0 ? 0u : 1u);
    } else {
      EXPECT_TRUE(absl::IsDataLoss(read.status())) << cut << ": " << read.status();
    }
  }
}

TEST(ParseRecordsTest, DetectsEveryFlippedByte) {
  const std::string file = FrameRecord("abc") + FrameRecord("defgh");
  for (size_t at = 0; at < file.size(); ++at) {
    std::string bad = file;
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    absl::StatusOr<std::vector<std::string>> read = ParseRecords(bad);
    EXPECT_TRUE(absl::IsDataLoss(read.status())) << at << ": " << read.status();
  }
  std::string bad_data = file;
  bad_data[13] = 'X';  // in "abc"
  EXPECT_THAT(std::string(ParseRecords(bad_data).status().message()),
              HasSubstr("the data of the record at byte 0 fails its checksum"));
}

TEST(EventFileNameTest, TimeHostPid) {
  EXPECT_EQ(
      EventFileName(absl::FromUnixSeconds(1700000000) + absl::Milliseconds(900), "host-a", 42),
      "events.out.tfevents.1700000000.host-a.42");
}

class EventFileWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/event_file_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "_",
                        ::getpid());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The events of the file at `path`, each record parsed.
  static std::vector<Event> ReadEvents(const std::string& path) {
    absl::StatusOr<std::string> contents = ReadFile(path);
    EXPECT_TRUE(contents.ok()) << contents.status();
    if (!contents.ok()) return {};
    absl::StatusOr<std::vector<std::string>> records = ParseRecords(*contents);
    EXPECT_TRUE(records.ok()) << records.status();
    std::vector<Event> events;
    if (!records.ok()) return events;
    for (const std::string& r : *records) {
      events.emplace_back();
      EXPECT_TRUE(events.back().ParseFromString(r));
    }
    return events;
  }

  std::string dir_;
};

TEST_F(EventFileWriterTest, WritesVersionScalarsAndStart) {
  const absl::Time t0 = absl::FromUnixMillis(1700000000250);
  absl::StatusOr<std::unique_ptr<EventFileWriter>> w = EventFileWriter::Open(dir_ + "/train", t0);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string path = (*w)->path();
  EXPECT_THAT(path, MatchesRegex(".*/train/events\\.out\\.tfevents\\.1700000000\\.[^/]+\\." +
                                 std::to_string(::getpid())));
  // The version record is on disk at once.
  ASSERT_EQ(ReadEvents(path).size(), 1u);

  (*w)->WriteSessionStart(101, t0 + absl::Seconds(1));
  (*w)->WriteScalars(200, t0 + absl::Seconds(2), {{"loss", 0.3125}, {"step_ms/pull", 1.1}});
  EXPECT_EQ(ReadEvents(path).size(), 1u) << "nothing reaches the file before Flush";
  ASSERT_TRUE((*w)->Flush().ok());

  std::vector<Event> events = ReadEvents(path);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_DOUBLE_EQ(events[0].wall_time(), 1700000000.25);
  EXPECT_EQ(events[1].step(), 101);
  EXPECT_EQ(events[1].session_log().status(), SessionLog::START);
  EXPECT_DOUBLE_EQ(events[1].wall_time(), 1700000001.25);
  EXPECT_EQ(events[2].step(), 200);
  EXPECT_DOUBLE_EQ(events[2].wall_time(), 1700000002.25);
  ASSERT_EQ(events[2].summary().value_size(), 2);
  EXPECT_EQ(events[2].summary().value(0).tag(), "loss");
  EXPECT_EQ(events[2].summary().value(0).simple_value(), 0.3125f);
  EXPECT_EQ(events[2].summary().value(1).tag(), "step_ms/pull");
  EXPECT_EQ(events[2].summary().value(1).simple_value(), 1.1f);

  // Flushing again writes nothing twice; the destructor flushes the rest.
  ASSERT_TRUE((*w)->Flush().ok());
  (*w)->WriteScalars(300, t0, {{"loss", 0.25}});
  w->reset();
  events = ReadEvents(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[3].step(), 300);
}

TEST_F(EventFileWriterTest, EveryOpenMakesANewFile) {
  const absl::Time t = absl::FromUnixSeconds(1700000000);
  std::vector<std::string> paths;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::unique_ptr<EventFileWriter>> w = EventFileWriter::Open(dir_, t);
    ASSERT_TRUE(w.ok()) << w.status();
    (*w)->WriteScalars(i, t, {{"loss", i}});
    ASSERT_TRUE((*w)->Flush().ok());
    paths.push_back((*w)->path());
  }
  // The same second: the name gets ".1", ".2"; the first file is untouched
  // and every name sorts after the ones before it.
  EXPECT_EQ(paths[1], paths[0] + ".1");
  EXPECT_EQ(paths[2], paths[0] + ".2");
  EXPECT_LT(paths[0], paths[1]);
  EXPECT_LT(paths[1], paths[2]);
  for (int i = 0; i < 3; ++i) {
    std::vector<Event> events = ReadEvents(paths[i]);
    ASSERT_EQ(events.size(), 2u) << paths[i];
    EXPECT_EQ(events[1].step(), i);
  }
  // A later second sorts after.
  absl::StatusOr<std::unique_ptr<EventFileWriter>> later =
      EventFileWriter::Open(dir_, t + absl::Seconds(1));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_GT((*later)->path(), paths[2]);
}

TEST_F(EventFileWriterTest, OpenFailsNamingThePath) {
  fs::create_directories(dir_);
  ASSERT_TRUE(WriteFileAtomically(dir_ + "/file", "x").ok());
  absl::StatusOr<std::unique_ptr<EventFileWriter>> w =
      EventFileWriter::Open(dir_ + "/file/train", absl::Now());
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(std::string(w.status().message()), HasSubstr(dir_ + "/file"));
}

}  // namespace
}  // namespace psflow
