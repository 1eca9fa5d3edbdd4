// psflow-launch's reading of --worker_devices (the processes it starts are
// tested by the integration tests).
#include "tools/launch/launcher.h"

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

}  // namespace
}  // namespace psflow::launch
