// main() of every psflow GoogleTest executable: GoogleTest's own, after
// holding gRPC's library until exit, so that a test that destroys its last
// server or channel does not stall at random in gRPC's shutdown
// (common/process_setup.h says why).
#include "common/process_setup.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  psflow::KeepGrpcUntilExit();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
