// What the CPU backend's source files share (kernels/cpu/cpu_backend.h is
// the backend's contract): the engine and stream every op runs on, and the
// helpers of op creation and argument checks. Not part of the interface.
#ifndef PSFLOW_KERNELS_CPU_CPU_INTERNAL_H_
#define PSFLOW_KERNELS_CPU_CPU_INTERNAL_H_

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace psflow::kernels::cpu_internal {

// Shared by a backend and all its ops (ops hold a shared_ptr, so they keep it
// alive after the backend is gone).
struct DnnlContext {
  explicit DnnlContext(dnnl::engine e) : engine(std::move(e)), stream(engine) {}

  // Runs fn(stream) and waits for it. The mutex serializes ops of this
  // backend that are called from different threads: a dnnl::stream is not
  // meant to be driven concurrently, and two OpenMP-parallel primitives at
  // once would only oversubscribe the cores anyway.
  template <typename Fn>
  absl::Status Run(absl::string_view what, Fn&& fn) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    try {
      fn(stream);
      stream.wait();
      return absl::OkStatus();
    } catch (const dnnl::error& e) {
      return absl::InternalError(absl::StrCat(what, ": oneDNN execution failed: ", e.what()));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(what, ": ", e.what()));
    }
  }

  // Runs host loops (OpenMP-parallel ones included) under the same mutex, so
  // that they never compete with a primitive, or each other, for the cores.
  template <typename Fn>
  absl::Status RunLoops(Fn&& fn) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    fn();
    return absl::OkStatus();
  }

  const dnnl::engine engine;
  absl::Mutex mu;
  dnnl::stream stream ABSL_GUARDED_BY(mu);
};

// Host loops over fewer floats than this run on one thread: below it, starting
// the OpenMP team costs more than the loop.
inline constexpr int64_t kMinParallel = int64_t{1} << 15;

inline absl::Status CheckNonNull(
    absl::string_view op, std::initializer_list<std::pair<absl::string_view, const void*>> args) {
  for (const auto& [name, ptr] : args) {
    if (ptr == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  }
  return absl::OkStatus();
}

// Builds an op, turning oneDNN's refusal of a shape into INVALID_ARGUMENT.
template <typename Op, typename Make>
absl::StatusOr<std::unique_ptr<Op>> Build(absl::string_view what, Make&& make) {
  try {
    return std::unique_ptr<Op>(make());
  } catch (const dnnl::error& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not supported by oneDNN: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

}  // namespace psflow::kernels::cpu_internal

#endif  // PSFLOW_KERNELS_CPU_CPU_INTERNAL_H_
