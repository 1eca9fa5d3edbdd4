// psflow-launch's reading of --worker_devices and its job token (the
// processes it starts are tested by the integration tests).
#include "tools/launch/launcher.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ParseWorkerDevicesTest, OneDevicePerWorkerAsBefore) {
  std::vector<std::string> devices;
  int replicas = -1;
  EXPECT_EQ(ParseWorkerDevices("", 2, &devices, &replicas), "");
  EXPECT_TRUE(devices.empty());
  EXPECT_EQ(replicas, 1);
  EXPECT_EQ(ParseWorkerDevices("cuda:0", 3, &devices, &replicas), "");
  EXPECT_THAT(devices, ElementsAre("cuda:0", "cuda:0", "cuda:0"));
  EXPECT_EQ(replicas, 1);
  EXPECT_EQ(ParseWorkerDevices("cuda:0,cuda:1", 2, &devices, &replicas), "");
  EXPECT_THAT(devices, ElementsAre("cuda:0", "cuda:1"));
  EXPECT_EQ(replicas, 1);
}

TEST(ParseWorkerDevicesTest, SeveralGpusPerWorker) {
  std::vector<std::string> devices;
  int replicas = -1;
  // A single worker takes the whole list.
  EXPECT_EQ(ParseWorkerDevices("cuda:0,cuda:1", 1, &devices, &replicas), "");
  EXPECT_THAT(devices, ElementsAre("cuda:0,cuda:1"));
  EXPECT_EQ(replicas, 2);
  EXPECT_EQ(ParseWorkerDevices("cuda:0,cuda:1;cuda:2,cuda:3", 2, &devices, &replicas), "");
  EXPECT_THAT(devices, ElementsAre("cuda:0,cuda:1", "cuda:2,cuda:3"));
  EXPECT_EQ(replicas, 2);
  // One list for every worker (the workers share the GPUs).
  EXPECT_EQ(ParseWorkerDevices("cuda:0,cuda:1;", 1, &devices, &replicas),
            "--worker_devices has 2 device lists for 1 workers");
  EXPECT_EQ(ParseWorkerDevices("cuda:0,cuda:1;", 2, &devices, &replicas),
            "--worker_devices has an empty device list");
  // cuda:all: the count is the worker machine's.
  EXPECT_EQ(ParseWorkerDevices("cuda:all", 2, &devices, &replicas), "");
  EXPECT_THAT(devices, ElementsAre("cuda:all", "cuda:all"));
  EXPECT_EQ(replicas, 0);
}

TEST(ParseWorkerDevicesTest, RefusesListsThatDoNotFit) {
  std::vector<std::string> devices;
  int replicas = -1;
  EXPECT_THAT(ParseWorkerDevices("cuda:0,cuda:1,cuda:2", 2, &devices, &replicas),
              HasSubstr("separate the workers' device lists with ';'"));
  EXPECT_THAT(ParseWorkerDevices("cuda:0,cuda:1;cuda:2", 2, &devices, &replicas),
              HasSubstr("every worker needs as many devices"));
  EXPECT_THAT(ParseWorkerDevices("cuda:0;cuda:1;cuda:2", 2, &devices, &replicas),
              HasSubstr("3 device lists for 2 workers"));
}

// 256 random bits as hex, a different token each time.
TEST(JobTokenTest, NewTokensAre256RandomBitsInHex) {
  const std::string a = NewJobToken(), b = NewJobToken();
  EXPECT_THAT(a, ::testing::MatchesRegex("[0-9a-f]{64}"));
  EXPECT_THAT(b, ::testing::MatchesRegex("[0-9a-f]{64}"));
  EXPECT_NE(a, b);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The file is its owner's only (0600) whatever the umask, and replaces a
// file or a link at its path without writing through the link.
TEST(JobTokenTest, TokenFileIsTheOwnersOnlyAndReplacesLinks) {
  const std::string dir = ::testing::TempDir() + "/launcher_test_token_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(std::filesystem::create_directories(dir));
  const std::string path = dir + "/token";
  const mode_t old_umask = ::umask(0);
  EXPECT_EQ(WriteTokenFile(path, "abc123"), "");
  ::umask(old_umask);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(ReadFile(path), "abc123\n");

  EXPECT_EQ(WriteTokenFile(path, "def456"), "");
  EXPECT_EQ(ReadFile(path), "def456\n");

  const std::string victim = dir + "/victim";
  std::ofstream(victim) << "untouched";
  const std::string link = dir + "/link";
  std::filesystem::create_symlink(victim, link);
  EXPECT_EQ(WriteTokenFile(link, "ghi789"), "");
  EXPECT_EQ(ReadFile(victim), "untouched");
  EXPECT_FALSE(std::filesystem::is_symlink(link));
  EXPECT_EQ(ReadFile(link), "ghi789\n");
  // Nothing else is left in the directory (no temporary file).
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            3);

  const std::string error = WriteTokenFile(dir + "/no/such/dir/token", "x");
  EXPECT_THAT(error, HasSubstr("cannot create " + dir + "/no/such/dir/token."));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace psflow::launch
