#include "common/exit_codes.h"

#include <csignal>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

TEST(ExitCodesTest, OkIsDone) { EXPECT_EQ(ExitCodeFor(absl::OkStatus()), kExitDone); }

TEST(ExitCodesTest, ErrorsThatHappenAgainArePermanent) {
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition,
        absl::StatusCode::kNotFound, absl::StatusCode::kOutOfRange,
        absl::StatusCode::kAlreadyExists, absl::StatusCode::kPermissionDenied,
        absl::StatusCode::kUnauthenticated, absl::StatusCode::kUnimplemented}) {
    EXPECT_EQ(ExitCodeFor(absl::Status(code, "x")), kExitPermanent)
        << absl::StatusCodeToString(code);
  }
}

TEST(ExitCodesTest, APeerThatStayedUnreachableIs138) {
  EXPECT_EQ(ExitCodeFor(absl::UnavailableError("x")), kExitUnreachable);
  EXPECT_EQ(ExitCodeFor(absl::DeadlineExceededError("x")), kExitUnreachable);
}

TEST(ExitCodesTest, EverythingElseIsWorthARetry) {
  for (absl::StatusCode code : {absl::StatusCode::kInternal, absl::StatusCode::kAborted,
                                absl::StatusCode::kDataLoss, absl::StatusCode::kCancelled,
                                absl::StatusCode::kUnknown, absl::StatusCode::kResourceExhausted}) {
    EXPECT_EQ(ExitCodeFor(absl::Status(code, "x")), kExitRetryable)
        << absl::StatusCodeToString(code);
  }
}

TEST(ExitCodesTest, AStopBySignalCarriesTheSignal) {
  const absl::Status s = StoppedBySignal(SIGTERM);
  EXPECT_TRUE(absl::IsCancelled(s));
  EXPECT_EQ(SignalOf(s), SIGTERM);
  EXPECT_EQ(ExitCodeFor(s), 143);
  EXPECT_EQ(ExitCodeFor(StoppedBySignal(SIGINT)), 130);
  // A plain cancellation carries none.
  EXPECT_EQ(SignalOf(absl::CancelledError("x")), std::nullopt);
  EXPECT_EQ(ExitCodeFor(absl::CancelledError("x")), kExitRetryable);
}

TEST(ExitCodesTest, OnlyUnavailableAndDeadlineExceededAreRetryable) {
  EXPECT_TRUE(IsRetryable(absl::UnavailableError("x")));
  EXPECT_TRUE(IsRetryable(absl::DeadlineExceededError("x")));
  EXPECT_FALSE(IsRetryable(absl::OkStatus()));
  EXPECT_FALSE(IsRetryable(absl::CancelledError("x")));
  EXPECT_FALSE(IsRetryable(absl::AbortedError("x")));
  EXPECT_FALSE(IsRetryable(absl::InvalidArgumentError("x")));
}

}  // namespace
}  // namespace psflow
