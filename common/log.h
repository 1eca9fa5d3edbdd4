// A small logging module: PSLOG(INFO) << "text"; writes one line to stderr,
// prefixed with the time, the severity and this process's tag (e.g.
// "worker1"). Lines from several threads never interleave. PSLOG(FATAL) aborts
// after writing (for broken internal invariants only, never for input).
#ifndef PSFLOW_COMMON_LOG_H_
#define PSFLOW_COMMON_LOG_H_

#include <sstream>
#include <string>

namespace psflow {

enum class Severity { kInfo, kWarning, kError, kFatal };

// Sets the tag printed on every line; call once in main before threads start.
void SetLogTag(const std::string& tag);

class LogMessage {
 public:
  LogMessage(Severity severity, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  Severity severity_;
  std::ostringstream stream_;
};

}  // namespace psflow

#define PSFLOW_SEVERITY_INFO ::psflow::Severity::kInfo
#define PSFLOW_SEVERITY_WARNING ::psflow::Severity::kWarning
#define PSFLOW_SEVERITY_ERROR ::psflow::Severity::kError
#define PSFLOW_SEVERITY_FATAL ::psflow::Severity::kFatal
#define PSLOG(severity) \
  ::psflow::LogMessage(PSFLOW_SEVERITY_##severity, __FILE__, __LINE__).stream()

#endif  // PSFLOW_COMMON_LOG_H_
