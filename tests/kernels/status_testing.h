// Status assertions shared by the kernel tests.
#ifndef PSFLOW_TESTS_KERNELS_STATUS_TESTING_H_
#define PSFLOW_TESTS_KERNELS_STATUS_TESTING_H_

#include "absl/status/status.h"
#include "gtest/gtest.h"

// Asserts that a Status is OK; prints the expression and the status when it
// is not.
#define PSFLOW_ASSERT_OK(expr)                             \
  do {                                                     \
    const absl::Status _status = (expr);                   \
    ASSERT_TRUE(_status.ok()) << #expr << ": " << _status; \
  } while (0)

#endif  // PSFLOW_TESTS_KERNELS_STATUS_TESTING_H_
