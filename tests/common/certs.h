// Test certificates: scripts/make-certs.sh run into a directory, read back
// as SecurityOptions per role, and a fixture with two such directories. Needs
// openssl and PSFLOW_SOURCE_DIR (the repository root, defined by
// tests/common/CMakeLists.txt).
#ifndef PSFLOW_TESTS_COMMON_CERTS_H_
#define PSFLOW_TESTS_COMMON_CERTS_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "transport/security.h"

namespace psflow::testing_certs {

// Runs make-certs.sh into `dir`; false if it failed.
inline bool MakeCerts(const std::string& dir) {
  const std::string command =
      absl::StrCat("bash '", PSFLOW_SOURCE_DIR, "/scripts/make-certs.sh' '", dir, "' > /dev/null");
  return std::system(command.c_str()) == 0;
}

// The options of `role` ("ps", ...) from a make-certs.sh directory, with its
// token when `token` is set.
inline SecurityOptions Options(const std::string& dir, const std::string& role, bool token = true) {
  SecurityFiles files;
  files.tls_cert = absl::StrCat(dir, "/", role, ".crt");
  files.tls_key = absl::StrCat(dir, "/", role, ".key");
  files.tls_ca = absl::StrCat(dir, "/ca.crt");
  if (token) files.auth_token_file = absl::StrCat(dir, "/token");
  absl::StatusOr<SecurityOptions> o = LoadSecurityOptions(files);
  return o.ok() ? *o : SecurityOptions{};
}

// A fixture with two sets of make-certs.sh files (two CAs), Job() and
// Other(), made once for the suite in a directory of its own, dir_.
class TwoCasTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(absl::StrCat(
        ::testing::TempDir(), "/psflow_",
        ::testing::UnitTest::GetInstance()->current_test_suite()->name(), "_", ::getpid()));
    std::filesystem::remove_all(*dir_);
    ASSERT_TRUE(MakeCerts(Job()));
    ASSERT_TRUE(MakeCerts(Other()));
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
    dir_ = nullptr;
  }
  static std::string Job() { return *dir_ + "/job"; }
  static std::string Other() { return *dir_ + "/other"; }

  inline static std::string* dir_ = nullptr;
};

}  // namespace psflow::testing_certs

#endif  // PSFLOW_TESTS_COMMON_CERTS_H_
