// Early return on error, leveldb-style: `if (!s.ok()) return s;` in one line.
#ifndef PSFLOW_COMMON_STATUS_MACROS_H_
#define PSFLOW_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"

#define PSFLOW_RETURN_IF_ERROR(expr)   \
  do {                                 \
    absl::Status _status = (expr);     \
    if (!_status.ok()) return _status; \
  } while (0)

#endif  // PSFLOW_COMMON_STATUS_MACROS_H_
