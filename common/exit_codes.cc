#include "common/exit_codes.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace psflow {
namespace {
constexpr char kSignalPayload[] = "psflow.dev/signal";
constexpr char kRegisterAgainPayload[] = "psflow.dev/register-again";
}  // namespace

absl::Status Permanent(const absl::Status& status, absl::string_view context) {
  const absl::StatusCode code = absl::IsInvalidArgument(status)
                                    ? absl::StatusCode::kInvalidArgument
                                    : absl::StatusCode::kFailedPrecondition;
  return absl::Status(code, absl::StrCat(context, status.message()));
}

absl::Status RegisterAgain(absl::string_view why) {
  absl::Status s = absl::AbortedError(why);
  s.SetPayload(kRegisterAgainPayload, absl::Cord());
  return s;
}

bool IsRegisterAgain(const absl::Status& status) {
  return status.GetPayload(kRegisterAgainPayload).has_value();
}

absl::Status StoppedBySignal(int signal) {
  absl::Status s = absl::CancelledError(absl::StrCat("stopped by signal ", signal));
  s.SetPayload(kSignalPayload, absl::Cord(absl::StrCat(signal)));
  return s;
}

std::optional<int> SignalOf(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kSignalPayload);
  int signal = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &signal))
    return std::nullopt;
  return signal;
}

int ExitCodeFor(const absl::Status& status) {
  if (status.ok()) return kExitDone;
  if (std::optional<int> signal = SignalOf(status)) return ExitCodeForSignal(*signal);
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kUnimplemented:
      return kExitPermanent;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnreachable;
    default:
      return kExitRetryable;
  }
}

bool IsRetryable(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

}  // namespace psflow
