// A fresh directory for one unit test, under gtest's temp dir, removed with
// everything in it when the object goes (header-only, for the unit tests;
// the process-level tests have their fixture in tests/integration/process.h).
#ifndef PSFLOW_TESTS_COMMON_SCRATCH_DIR_H_
#define PSFLOW_TESTS_COMMON_SCRATCH_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace psflow {

class ScratchDir {
 public:
  // `prefix` starts the directory's name (psflow_<prefix>_XXXXXX); path() is
  // empty if it could not be made.
  explicit ScratchDir(const std::string& prefix) {
    std::string pattern =
        (std::filesystem::path(::testing::TempDir()) / ("psflow_" + prefix + "_XXXXXX")).string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace psflow

#endif  // PSFLOW_TESTS_COMMON_SCRATCH_DIR_H_
