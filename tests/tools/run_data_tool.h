// Runs the psflow-data binary (of this build) the way a user does, for the
// tests of its command line: the exit status and what it printed.
#ifndef PSFLOW_TESTS_TOOLS_RUN_DATA_TOOL_H_
#define PSFLOW_TESTS_TOOLS_RUN_DATA_TOOL_H_

#include <sys/wait.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"

namespace psflow::data_tool {

struct Ran {
  int status = -1;
  std::string out, err;
};

// `psflow-data <args>` through the shell, its output kept in `dir`.
inline Ran RunBinary(const std::string& dir, const std::string& args) {
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const std::string command =
      absl::StrCat(PSFLOW_BIN_DIR, "/psflow-data ", args, " >", out, " 2>", err);
  Ran ran;
  const int status = std::system(command.c_str());
  ran.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  ran.out = ReadFile(out).value_or("");
  ran.err = ReadFile(err).value_or("");
  return ran;
}

}  // namespace psflow::data_tool

#endif  // PSFLOW_TESTS_TOOLS_RUN_DATA_TOOL_H_
