#include "common/log.h"

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace psflow {
namespace {

absl::Mutex log_mu;
std::string& Tag() {
  static std::string* tag = new std::string("psflow");
  return *tag;
}

char SeverityLetter(Severity s) {
  switch (s) {
    case Severity::kInfo:
      return 'I';
    case Severity::kWarning:
      return 'W';
    case Severity::kError:
      return 'E';
    case Severity::kFatal:
      return 'F';
  }
  return '?';
}

}  // namespace

void SetLogTag(const std::string& tag) { Tag() = tag; }

LogMessage::LogMessage(Severity severity, const char* file, int line) : severity_(severity) {
  if (severity_ == Severity::kFatal) stream_ << file << ":" << line << ": ";
}

LogMessage::~LogMessage() {
  std::string when = absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::Now(), absl::UTCTimeZone());
  std::string line =
      when + " " + SeverityLetter(severity_) + " " + Tag() + "] " + stream_.str() + "\n";
  {
    absl::MutexLock lock(&log_mu);
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
  if (severity_ == Severity::kFatal) std::abort();
}

}  // namespace psflow
