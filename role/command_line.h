// Command-line parsing shared by every psflow executable, on absl flags
// (public API only: absl::ParseCommandLine for the parse, absl::GetAllFlags for
// the help). Call ParseCommandLine once, first thing in main; not thread-safe.
#ifndef PSFLOW_ROLE_COMMAND_LINE_H_
#define PSFLOW_ROLE_COMMAND_LINE_H_

#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace psflow {

// Parses argv. `usage` opens the help, which goes to stdout and exits 0:
//   --help, --helpshort, --helppackage
//                        the flags defined in files whose path ends with one of
//                        `help_files`
//   --help=S             every flag whose name, help text or file contains S
//   --helpfull           every flag, absl's own included
//   --helpon=F           the flags of files named F (F.cc, F.h, ...)
//   --helpmatch=S        the flags of files whose path contains S
// These are recognised on the command line itself (not inside a --flagfile).
// An unknown flag or a bad value exits 1 with one line per problem on stderr
// (absl's "ERROR: ..."). Returns the positional arguments, argv[0] first (and,
// after "--", everything that follows it).
std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::vector<std::string>& help_files = {"main.cc"});

// The help text: "<program>: <usage>", then each flag for which `include`
// holds, grouped under "Flags from <dir>/<file>:" (files and flags sorted by
// name), each as "--name (help); default: value;" wrapped at 80 columns.
std::string FlagsHelp(absl::string_view program, absl::string_view usage,
                      absl::FunctionRef<bool(const absl::CommandLineFlag&)> include);

// The command line that gives this program's flags the values they hold
// now: `program`, then --name=value for each flag whose value differs from
// its default, sorted by name. The flags that read other sources
// (--flagfile, --fromenv, --tryfromenv) and --undefok are left out: what
// they read is in the values already. For a process that executes itself
// again: its original arguments may name a flag file it cannot read the
// same way twice (a pipe, /dev/stdin, a file changed or removed since).
std::vector<std::string> CommandLineOfFlagsNow(absl::string_view program);

// For the mains of tools: writes `message` (or the status's message) as one
// line on stderr and returns exit code 1.
int FailWith(absl::string_view message);
int FailWith(const absl::Status& status);

}  // namespace psflow

#endif  // PSFLOW_ROLE_COMMAND_LINE_H_
