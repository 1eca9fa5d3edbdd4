// ParseCommandLine's help and errors, and the FlagsHelp text, on flags this
// file defines.
#include "role/command_line.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, cl_test_name, "x", "A string flag.");
ABSL_FLAG(int, cl_test_count, 3,
          "An int flag whose help text is long enough that the help has to wrap it over more "
          "than one line of at most eighty columns.");
ABSL_FLAG(bool, cl_test_switch, false, "A bool flag.");

namespace psflow {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

bool InThisFile(const absl::CommandLineFlag& flag) {
  return absl::EndsWith(flag.Filename(), "command_line_test.cc");
}

TEST(FlagsHelpTest, ListsTheIncludedFlagsUnderTheirFile) {
  const std::string help = FlagsHelp("prog", "does things.", InThisFile);
  EXPECT_THAT(help, ::testing::StartsWith(
                        "prog: does things.\n\n  Flags from role/command_line_test.cc:\n"));
  EXPECT_THAT(help, HasSubstr("    --cl_test_name (A string flag.); default: \"x\";\n"));
  EXPECT_THAT(help, HasSubstr("    --cl_test_switch (A bool flag.); default: false;\n"));
  // Sorted by name: count before name before switch.
  EXPECT_LT(help.find("--cl_test_count ("), help.find("--cl_test_name ("));
  EXPECT_LT(help.find("--cl_test_name ("), help.find("--cl_test_switch ("));
  // Only the included flags (absl's own --flagfile is defined elsewhere).
  EXPECT_THAT(help, Not(HasSubstr("--flagfile")));
}

TEST(FlagsHelpTest, WrapsAtEightyColumns) {
  const std::string help = FlagsHelp("prog", "u", InThisFile);
  const size_t start = help.find("    --cl_test_count (");
  ASSERT_NE(start, std::string::npos);
  const size_t end = help.find("--cl_test_name", start);
  const std::vector<std::string> lines =
      absl::StrSplit(help.substr(start, end - start), '\n', absl::SkipEmpty());
  ASSERT_GE(lines.size(), 3u) << help;  // the last one is the next flag's indent
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    EXPECT_LE(lines[i].size(), 80u) << lines[i];
    if (i > 0) {
      EXPECT_THAT(lines[i], ::testing::StartsWith("      ")) << lines[i];
    }
  }
  EXPECT_THAT(help, HasSubstr("default: 3;"));
}

TEST(FlagsHelpTest, SaysWhenNothingMatches) {
  EXPECT_THAT(FlagsHelp("prog", "u", [](const absl::CommandLineFlag&) { return false; }),
              HasSubstr("No flags match."));
}

// ParseCommandLine exits, so it runs in a death-test child.
void Parse(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ParseCommandLine(static_cast<int>(argv.size()), argv.data(), "usage", {"command_line_test.cc"});
  std::exit(42);  // parsed without exiting
}

TEST(ParseCommandLineDeathTest, HelpExitsZero) {
  EXPECT_EXIT(Parse({"prog", "--help"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(Parse({"prog", "--helpfull"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(Parse({"prog", "-help=cl_test"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(Parse({"prog", "--helpshort"}), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(Parse({"prog", "--helpon", "command_line_test"}), ::testing::ExitedWithCode(0), "");
}

TEST(ParseCommandLineDeathTest, HelpAsAValueOrAfterDashDashIsNoRequest) {
  EXPECT_EXIT(Parse({"prog", "--cl_test_name", "--help"}), ::testing::ExitedWithCode(42), "");
  EXPECT_EXIT(Parse({"prog", "positional", "--cl_test_switch"}), ::testing::ExitedWithCode(42), "");
  EXPECT_EXIT(Parse({"prog", "--", "--help"}), ::testing::ExitedWithCode(42), "");
}

TEST(ParseCommandLineDeathTest, UnknownFlagOrBadValueExitsOne) {
  EXPECT_EXIT(Parse({"prog", "--bogus"}), ::testing::ExitedWithCode(1),
              "Unknown command line flag 'bogus'");
  EXPECT_EXIT(Parse({"prog", "--cl_test_count=abc"}), ::testing::ExitedWithCode(1),
              "Illegal value 'abc' specified for flag 'cl_test_count'");
}

// Parses a flag file, removes it, and checks the command line of the
// flags' values now: each flag away from its default, by name, as it is
// (spaces and commas included); one set to its default, and absl's flags
// that read files or the environment, left out. Exits 0 when it holds.
void ParseAFlagFileThenRemoveIt(const std::string& path) {
  {
    std::ofstream out(path);
    out << "--cl_test_switch\n--cl_test_name=a b,c\n--cl_test_count=3\n";
  }
  std::vector<std::string> args = {"prog", "--flagfile=" + path, "--undefok=nothing"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ParseCommandLine(static_cast<int>(argv.size()), argv.data(), "usage", {"command_line_test.cc"});
  std::remove(path.c_str());
  const std::vector<std::string> now = CommandLineOfFlagsNow("/bin/prog");
  const std::vector<std::string> want = {"/bin/prog", "--cl_test_name=a b,c",
                                         "--cl_test_switch=true"};
  if (now != want) {
    std::fprintf(stderr, "got: %s\n", absl::StrJoin(now, " | ").c_str());
    std::exit(1);
  }
  std::exit(0);
}

TEST(ParseCommandLineDeathTest, CommandLineOfFlagsNowNeedsNoFlagFile) {
  const std::string path = ::testing::TempDir() + "/psflow_command_line_flags";
  EXPECT_EXIT(ParseAFlagFileThenRemoveIt(path), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace psflow
