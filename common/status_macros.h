// Early return on error, leveldb-style: `if (!s.ok()) return s;` in one line,
// and its StatusOr form, which also assigns the value.
#ifndef PSFLOW_COMMON_STATUS_MACROS_H_
#define PSFLOW_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"

#define PSFLOW_RETURN_IF_ERROR(expr)   \
  do {                                 \
    absl::Status _status = (expr);     \
    if (!_status.ok()) return _status; \
  } while (0)

#define PSFLOW_STATUS_CONCAT_INNER(a, b) a##b
#define PSFLOW_STATUS_CONCAT(a, b) PSFLOW_STATUS_CONCAT_INNER(a, b)

// PSFLOW_ASSIGN_OR_RETURN(T x, expr) or PSFLOW_ASSIGN_OR_RETURN(existing, expr):
// evaluates the StatusOr `expr`, returns its status on error, else moves its
// value into the left-hand side.
#define PSFLOW_ASSIGN_OR_RETURN(lhs, expr) \
  PSFLOW_ASSIGN_OR_RETURN_IMPL(PSFLOW_STATUS_CONCAT(_status_or_, __LINE__), lhs, expr)
#define PSFLOW_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = *std::move(tmp)

#endif  // PSFLOW_COMMON_STATUS_MACROS_H_
