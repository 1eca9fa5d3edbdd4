// The client side of the parameter-server service, shared by workers and the
// chief: one channel per ps, tensors streamed as chunks in both directions.
// Calls wait for a ps that is not up yet (gRPC wait-for-ready) until their
// deadline. Thread-safe: calls to different ps (or the same) may run
// concurrently.
#ifndef PSFLOW_PS_CLIENT_H_
#define PSFLOW_PS_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/tensor_chunks.h"
#include "proto/ps.grpc.pb.h"

namespace psflow {

class PsClient {
 public:
  explicit PsClient(const std::vector<std::string>& addresses);
  int num_ps() const { return static_cast<int>(stubs_.size()); }

  // Loads a job onto ps `ps`: the header, then `tensors` (values, and slots
  // named by TensorRef::slot).
  absl::Status Init(int ps, const InitHeader& header, std::vector<TensorRef> tensors,
                    absl::Time deadline);

  struct PullResult {
    int64_t version = 0;  // below min_version: max_wait passed first, sinks untouched
    int64_t wait_us = 0;  // time the ps waited for min_version
  };
  // Pulls every slice of ps `ps` into `sinks` once it reaches min_version,
  // waiting at most `max_wait` for that (zero: until the deadline). An answer
  // that leaves a sink incomplete is DATA_LOSS.
  absl::StatusOr<PullResult> Pull(int ps, uint64_t job_id, int64_t min_version,
                                  std::vector<TensorSink> sinks, absl::Time deadline,
                                  absl::Duration max_wait = absl::ZeroDuration());

  absl::StatusOr<PushResponse> Push(int ps, const PushHeader& header, std::vector<TensorRef> grads,
                                    absl::Time deadline);

  absl::Status Shutdown(int ps, uint64_t job_id, absl::Time deadline);

  absl::StatusOr<PsState> GetState(int ps, absl::Time deadline);
  absl::Status SetLiveWorkers(int ps, uint64_t job_id, const std::vector<int>& live, int64_t from_version,
                              absl::Time deadline);
  // Values and slots of ps `ps` as of exactly `version`, into `sinks` (one
  // per slice and slot: value sinks have slot ""). DATA_LOSS if incomplete.
  absl::Status Snapshot(int ps, uint64_t job_id, int64_t version, std::vector<TensorSink> sinks,
                        absl::Time deadline);

  // Whether the connection to ps `ps` is up (or idle), not failing.
  bool Reachable(int ps) const;

  // Cancels every call in flight and makes later calls fail with CANCELLED
  // at once (for a process that is stopping).
  void CancelAll();

 private:
  class CallScope;

  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs_;
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<grpc::ClientContext*> active_ ABSL_GUARDED_BY(mu_);
};

}  // namespace psflow

#endif  // PSFLOW_PS_CLIENT_H_
