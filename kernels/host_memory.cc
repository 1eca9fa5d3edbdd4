#include "kernels/host_memory.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace psflow::kernels {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return text.str();
}

// The "<name>: <n> kB" line of /proc/meminfo, in bytes.
std::optional<int64_t> MeminfoBytes(absl::string_view meminfo, absl::string_view name) {
  for (absl::string_view line : absl::StrSplit(meminfo, '\n')) {
    if (!absl::ConsumePrefix(&line, name) || !absl::ConsumePrefix(&line, ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    if (!absl::ConsumeSuffix(&line, "kB")) return std::nullopt;
    int64_t kib = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib) || kib < 0) return std::nullopt;
    return kib * 1024;
  }
  return std::nullopt;
}

// A file holding one number of bytes (or "max": nullopt, as unreadable).
std::optional<int64_t> ReadBytes(const std::string& path) {
  std::optional<std::string> text = ReadFile(path);
  if (!text) return std::nullopt;
  int64_t bytes = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &bytes) || bytes < 0)
    return std::nullopt;
  return bytes;
}

}  // namespace

absl::StatusOr<int64_t> AvailableHostMemory(const std::string& root) {
  const std::string meminfo_path = root + "/proc/meminfo";
  std::optional<std::string> meminfo = ReadFile(meminfo_path);
  if (!meminfo) return absl::UnavailableError(absl::StrCat("cannot read ", meminfo_path));
  std::optional<int64_t> available = MeminfoBytes(*meminfo, "MemAvailable");
  if (!available) {
    return absl::UnavailableError(absl::StrCat(meminfo_path, " has no MemAvailable line"));
  }
  const int64_t total =
      MeminfoBytes(*meminfo, "MemTotal").value_or(std::numeric_limits<int64_t>::max());

  // (limit file, usage file) of every cgroup that may limit this process.
  std::vector<std::pair<std::string, std::string>> cgroups;
  const std::string v2 = root + "/sys/fs/cgroup", v1 = root + "/sys/fs/cgroup/memory";
  if (std::optional<std::string> own = ReadFile(root + "/proc/self/cgroup")) {
    // "0::/path" (v2) and "N:memory:/path" or "N:a,memory:/path" (v1).
    for (absl::string_view line : absl::StrSplit(*own, '\n', absl::SkipEmpty())) {
      std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
      if (f.size() != 3 || f[2] == "/" || f[2].empty()) continue;
      const std::string path(f[2]);
      if (f[0] == "0" && f[1].empty()) {
        cgroups.emplace_back(v2 + path + "/memory.max", v2 + path + "/memory.current");
      }
      for (absl::string_view c : absl::StrSplit(f[1], ',')) {
        if (c == "memory") {
          cgroups.emplace_back(v1 + path + "/memory.limit_in_bytes",
                               v1 + path + "/memory.usage_in_bytes");
        }
      }
    }
  }
  cgroups.emplace_back(v2 + "/memory.max", v2 + "/memory.current");
  cgroups.emplace_back(v1 + "/memory.limit_in_bytes", v1 + "/memory.usage_in_bytes");

  int64_t result = *available;
  for (const auto& [limit_path, usage_path] : cgroups) {
    const std::optional<int64_t> limit = ReadBytes(limit_path);
    if (!limit || *limit >= total) continue;  // "max", unreadable, or above the machine
    const std::optional<int64_t> usage = ReadBytes(usage_path);
    if (!usage) continue;
    result = std::min(result, std::max<int64_t>(0, *limit - *usage));
  }
  return result;
}

}  // namespace psflow::kernels
