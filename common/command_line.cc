#include "common/command_line.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"

namespace psflow {

std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::vector<std::string>& help_files) {
  absl::FlagsUsageConfig config;
  auto ours = [help_files](absl::string_view path) {
    for (const std::string& f : help_files) {
      if (absl::EndsWith(path, f)) return true;
    }
    return false;
  };
  config.contains_help_flags = ours;
  config.contains_helpshort_flags = ours;
  // "Flags from chief/main.cc" rather than the build machine's absolute path.
  config.normalize_filename = [](absl::string_view path) {
    size_t last = path.rfind('/');
    size_t prev = last == absl::string_view::npos || last == 0 ? absl::string_view::npos : path.rfind('/', last - 1);
    return std::string(prev == absl::string_view::npos ? path : path.substr(prev + 1));
  };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  // absl's own handling of --help exits 1; asking for help is not an error.
  std::vector<char*> rest = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  const int code = absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage());
  if (code >= 0) std::exit(code == 1 ? 0 : code);
  return rest;
}

}  // namespace psflow
