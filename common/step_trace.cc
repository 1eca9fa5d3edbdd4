#include "common/step_trace.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace psflow {
namespace {

int32_t ThreadId() {
  thread_local const int32_t tid = static_cast<int32_t>(syscall(SYS_gettid));
  return tid;
}

}  // namespace

absl::Status StepTrace::ParseSteps(absl::string_view text, int64_t* first, int64_t* last) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  const bool parsed = (parts.size() == 1 || parts.size() == 2) &&
                      absl::SimpleAtoi(parts[0], first) && absl::SimpleAtoi(parts.back(), last) &&
                      *first >= 0 && *first <= *last;
  if (!parsed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "steps to trace must be FIRST:LAST (0 <= FIRST <= LAST) or one step, not '", text, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StepTrace>> StepTrace::Create(const std::string& dir,
                                                             const std::string& file_name,
                                                             std::string process, int64_t first,
                                                             int64_t last, int64_t max_spans) {
  if (first < 0 || first > last) {
    return absl::InvalidArgumentError(
        absl::StrCat("steps to trace ", first, " to ", last, ": not a range"));
  }
  if (absl::Status s = MakeDirectories(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("trace directory: ", s.message()));
  }
  std::unique_ptr<StepTrace> trace(
      new StepTrace(absl::StrCat(dir, "/", file_name), std::move(process), first, last, max_spans));
  // An empty timeline now: a directory that cannot take the file fails at
  // once, not after the job.
  if (absl::Status s = trace->Write(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("trace file: ", s.message()));
  }
  return trace;
}

absl::StatusOr<std::unique_ptr<StepTrace>> StepTrace::FromFlags(const std::string& dir,
                                                                absl::string_view steps,
                                                                absl::string_view role, int index) {
  if (dir.empty()) return nullptr;
  int64_t first = 0, last = 0;
  PSFLOW_RETURN_IF_ERROR(ParseSteps(steps, &first, &last));
  return Create(dir, absl::StrCat(role, index, ".json"), absl::StrCat(role, " ", index), first,
                last);
}

StepTrace::StepTrace(std::string path, std::string process, int64_t first, int64_t last,
                     int64_t max_spans)
    : path_(std::move(path)),
      process_(std::move(process)),
      category_(process_.substr(0, process_.find(' '))),
      first_(first),
      last_(last),
      max_spans_(max_spans),
      pid_(static_cast<int32_t>(getpid())) {
  file_.set_display_time_unit("ms");
  TraceEvent* name = file_.add_trace_events();
  name->set_name("process_name");
  name->set_ph("M");
  name->set_pid(pid_);
  (*name->mutable_args())["name"] = process_;
}

StepTrace::~StepTrace() {
  bool written;
  {
    absl::MutexLock lock(&mu_);
    written = written_;
  }
  if (written) return;
  if (absl::Status s = Write(); !s.ok()) {
    PSLOG(WARNING) << "writing the step trace: " << s.message();
  }
}

int64_t StepTrace::NowMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void StepTrace::Record(absl::string_view name, int64_t step, int64_t start_us, int64_t end_us,
                       std::vector<std::pair<std::string, std::string>> args) {
  if (!Wants(step)) return;
  absl::MutexLock lock(&mu_);
  if (file_.trace_events_size() > max_spans_) {  // (the first is the process's name)
    ++dropped_;
    return;
  }
  TraceEvent* e = file_.add_trace_events();
  e->set_name(std::string(name));
  e->set_cat(category_);
  e->set_ph("X");
  e->set_ts(static_cast<double>(start_us));
  e->set_dur(static_cast<double>(std::max<int64_t>(end_us - start_us, 0)));
  e->set_pid(pid_);
  e->set_tid(ThreadId());
  auto& out = *e->mutable_args();
  out["step"] = absl::StrCat(step);
  for (auto& [key, value] : args) out[key] = std::move(value);
}

void StepTrace::Reached(int64_t step) {
  if (step <= last_ + 1) return;
  {
    absl::MutexLock lock(&mu_);
    if (written_) return;
    written_ = true;
  }
  if (absl::Status s = Write(); !s.ok()) {
    PSLOG(WARNING) << "writing the step trace: " << s.message();
  } else {
    PSLOG(INFO) << "wrote the trace of steps " << first_ << " to " << last_ << " to " << path_;
  }
}

absl::Status StepTrace::Write() {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;  // a span of 0 us keeps its "dur"
  {
    absl::MutexLock lock(&mu_);
    if (!google::protobuf::util::MessageToJsonString(file_, &json, options).ok()) {
      return absl::InternalError("the trace does not convert to JSON");
    }
  }
  return WriteFileAtomically(path_, json);
}

int64_t StepTrace::spans() const {
  absl::MutexLock lock(&mu_);
  return file_.trace_events_size() - 1;  // less the process's name
}

int64_t StepTrace::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

}  // namespace psflow
