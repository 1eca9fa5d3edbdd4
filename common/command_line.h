// Command-line parsing shared by every psflow executable, on absl flags.
#ifndef PSFLOW_COMMON_COMMAND_LINE_H_
#define PSFLOW_COMMON_COMMAND_LINE_H_

#include <string>
#include <vector>

namespace psflow {

// Parses argv. `usage` opens --help, which lists the flags defined in files
// whose path ends with one of `help_files` and exits 0. An unknown flag or a
// bad value exits 1 naming it. Returns the positional arguments, argv[0]
// first (and, after "--", everything that follows it).
std::vector<char*> ParseCommandLine(int argc, char** argv, const std::string& usage,
                                    const std::vector<std::string>& help_files = {"main.cc"});

}  // namespace psflow

#endif  // PSFLOW_COMMON_COMMAND_LINE_H_
