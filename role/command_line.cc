#include "role/command_line.h"

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace psflow {
namespace {

// absl::ParseCommandLine answers --help itself, but exits 1 (abseil 20220623),
// and has no public hook to change that: asking for help is not an error, so
// the help flags are looked for here first and answered with FlagsHelp.
struct HelpRequest {
  enum Kind { kOwn, kSubstring, kFull, kOn, kMatch } kind;
  std::string arg;  // the S or F of --help=S, --helpon=F, --helpmatch=S
};

// The first help flag on the command line (before "--"), if any. Follows
// absl's syntax: -name or --name, =value or (non-bool flags) the next argument.
std::optional<HelpRequest> FindHelpRequest(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // positional (or "-")
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    const bool has_value = eq != absl::string_view::npos;
    const absl::string_view name = arg.substr(0, eq);
    const absl::string_view value = has_value ? arg.substr(eq + 1) : absl::string_view();

    if (name == "help") {
      if (has_value && !value.empty()) {
        return HelpRequest{HelpRequest::kSubstring, std::string(value)};
      }
      return HelpRequest{HelpRequest::kOwn, ""};
    }
    // Like absl, any value of these bool flags (even "false") asks for help.
    if (name == "helpshort" || name == "helppackage") return HelpRequest{HelpRequest::kOwn, ""};
    if (name == "helpfull") return HelpRequest{HelpRequest::kFull, ""};
    if (name == "helpon" || name == "helpmatch") {
      // Without "=", absl takes the next argument as the value; without
      // either, absl::ParseCommandLine reports the missing value.
      if (!has_value && i + 1 >= argc) return std::nullopt;
      std::string v(has_value ? value : absl::string_view(argv[i + 1]));
      return HelpRequest{name == "helpon" ? HelpRequest::kOn : HelpRequest::kMatch, std::move(v)};
    }
    // "--name value": the next argument is the value, not a flag.
    if (!has_value) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag != nullptr && !flag->IsOfType<bool>()) ++i;
    }
  }
  return std::nullopt;
}

// "chief/main.cc" for "/src/psflow/chief/main.cc": the last two components,
// so the help names files the same way on every build machine.
std::string FileLabel(absl::string_view path) {
  const size_t last = path.rfind('/');
  if (last == absl::string_view::npos || last == 0) return std::string(path);
  const size_t prev = path.rfind('/', last - 1);
  return std::string(prev == absl::string_view::npos ? path : path.substr(prev + 1));
}

// "main" for ".../chief/main.cc".
absl::string_view FileStem(absl::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash != absl::string_view::npos) path.remove_prefix(slash + 1);
  return path.substr(0, path.find('.'));
}

// Appends `text` and then `tail` as lines of at most 80 columns, breaking at
// spaces of `text` only (`tail` and longer words overflow); the first line is
// indented by 4 spaces, the rest by 6; a '\n' in `text` starts a line.
void AppendWrapped(std::string* out, absl::string_view text, absl::string_view tail) {
  constexpr size_t kWidth = 80;
  constexpr size_t kFirstIndent = 4;
  constexpr size_t kNextIndent = 6;
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  size_t column = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out->push_back('\n');
    column = i == 0 ? kFirstIndent : kNextIndent;
    out->append(column, ' ');
    bool line_empty = true;
    std::vector<absl::string_view> words = absl::StrSplit(lines[i], ' ', absl::SkipEmpty());
    if (i + 1 == lines.size()) words.push_back(tail);
    for (absl::string_view word : words) {
      if (!line_empty && column + 1 + word.size() > kWidth) {
        out->append("\n").append(kNextIndent, ' ');
        column = kNextIndent;
        line_empty = true;
      }
      if (!line_empty) {
        out->push_back(' ');
        ++column;
      }
      out->append(word.data(), word.size());
      column += word.size();
      line_empty = false;
    }
  }
  out->push_back('\n');
}

}  // namespace

std::string FlagsHelp(absl::string_view program, absl::string_view usage,
                      absl::FunctionRef<bool(const absl::CommandLineFlag&)> include) {
  // file label -> flag name -> flag, both sorted.
  std::map<std::string, std::map<absl::string_view, const absl::CommandLineFlag*>> by_file;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (include(*flag)) by_file[FileLabel(flag->Filename())][name] = flag;
  }
  std::string out = absl::StrCat(program, ": ", usage, "\n");
  for (const auto& [file, flags] : by_file) {
    absl::StrAppend(&out, "\n  Flags from ", file, ":\n");
    for (const auto& [name, flag] : flags) {
      std::string default_value = flag->DefaultValue();
      if (flag->IsOfType<std::string>()) default_value = absl::StrCat("\"", default_value, "\"");
      AppendWrapped(&out, absl::StrCat("--", name, " (", flag->Help(), ");"),
                    absl::StrCat("default: ", default_value, ";"));
    }
  }
  if (by_file.empty()) out.append("\n  No flags match.\n");
  out.append(
      "\nTry --helpfull for every flag, or --help=S for the flags whose name, help or\n"
      "file contains S.\n");
  return out;
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::vector<std::string>& help_files) {
  // For the usage flags absl still answers itself (--version).
  absl::SetProgramUsageMessage(usage);
  if (std::optional<HelpRequest> help = FindHelpRequest(argc, argv)) {
    const std::string& s = help->arg;
    std::function<bool(const absl::CommandLineFlag&)> include;
    switch (help->kind) {
      case HelpRequest::kOwn:
        include = [&help_files](const absl::CommandLineFlag& flag) {
          const std::string path = flag.Filename();
          for (const std::string& f : help_files) {
            if (absl::EndsWith(path, f)) return true;
          }
          return false;
        };
        break;
      case HelpRequest::kSubstring:
        include = [&s](const absl::CommandLineFlag& flag) {
          return absl::StrContains(flag.Name(), s) || absl::StrContains(flag.Help(), s) ||
                 absl::StrContains(flag.Filename(), s);
        };
        break;
      case HelpRequest::kFull:
        include = [](const absl::CommandLineFlag&) { return true; };
        break;
      case HelpRequest::kOn:
        include = [&s](const absl::CommandLineFlag& flag) {
          return FileStem(flag.Filename()) == s;
        };
        break;
      case HelpRequest::kMatch:
        include = [&s](const absl::CommandLineFlag& flag) {
          return absl::StrContains(flag.Filename(), s);
        };
        break;
    }
    absl::string_view program = argc > 0 ? argv[0] : "";
    if (size_t slash = program.rfind('/'); slash != absl::string_view::npos) {
      program.remove_prefix(slash + 1);
    }
    const std::string text = FlagsHelp(program, usage, include);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    std::exit(0);
  }
  // Unknown flags and bad values: absl prints "ERROR: ..." per problem and exits 1.
  return absl::ParseCommandLine(argc, argv);
}

std::vector<std::string> CommandLineOfFlagsNow(absl::string_view program) {
  std::vector<std::string> args = {std::string(program)};
  std::map<absl::string_view, const absl::CommandLineFlag*> sorted;
  for (const auto& [name, flag] : absl::GetAllFlags()) sorted.emplace(name, flag);
  for (const auto& [name, flag] : sorted) {
    if (flag->IsRetired() || name == "flagfile" || name == "fromenv" || name == "tryfromenv" ||
        name == "undefok") {
      continue;
    }
    const std::string value = flag->CurrentValue();
    if (value != flag->DefaultValue()) args.push_back(absl::StrCat("--", name, "=", value));
  }
  return args;
}

int FailWith(absl::string_view message) {
  std::fprintf(stderr, "%.*s\n", static_cast<int>(message.size()), message.data());
  return 1;
}

int FailWith(const absl::Status& status) { return FailWith(status.message()); }

}  // namespace psflow
