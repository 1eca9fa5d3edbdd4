// The exchange of a job without ps (JobConfig.exchange ALL_REDUCE) on the
// host ring: each step's gradients and loss are averaged among the workers
// (allreduce::Ring), then pushed to this worker's own replica in this
// process and the next weights pulled from it, through lanes
// (worker/ps_exchange.h). On a CPU the ring starts during the backward pass,
// each variable's piece ready once its layer's backward is done.
//
// Thread-safety: as Exchange's. Ownership: the ring and the network are not
// owned and outlive the exchange; the replica's lanes are owned.
#ifndef PSFLOW_WORKER_RING_EXCHANGE_H_
#define PSFLOW_WORKER_RING_EXCHANGE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/types/span.h"
#include "allreduce/ring.h"
#include "common/thread_pool.h"
#include "model/network.h"
#include "proto/job.pb.h"
#include "worker/exchange.h"
#include "worker/ps_exchange.h"

namespace psflow::worker {

class RingExchange final : public Exchange {
 public:
  // `grads`: by variable, the host buffers the step's gradients are in
  // (the ring averages them there, and the lanes push them from there).
  // With `overlap` (the gradients are the network's own, on one device),
  // the ring starts before the step and takes each piece as `net` reports
  // it done.
  RingExchange(allreduce::Ring* ring, DataType wire, std::unique_ptr<PsExchange> replica,
               model::Network* net, const std::vector<float*>& grads, bool overlap,
               ExchangeHooks hooks);

  absl::Status Pull(int64_t min_version, ExchangeRound* out) override {
    return replica_->Pull(min_version, out);
  }
  void BeginStep(const StepPush& push, ExchangeRound* out) override;
  absl::Status StepQueued() override { return replica_->StepQueued(); }
  void GradientsOnHost(const std::vector<int>& variables) override {
    replica_->GradientsOnHost(variables);
  }
  void EndCompute(const absl::StatusOr<double>& loss) override;
  void Abandon() override;
  absl::Status Reduce(int64_t step, float* mean_loss) override;
  absl::Status PushStep(const StepPush& push, StepVerdictKind* verdict,
                        ExchangeRound* out) override {
    return replica_->PushStep(push, verdict, out);
  }

 private:
  allreduce::Ring* const ring_;
  const DataType wire_;
  const std::unique_ptr<PsExchange> replica_;
  const ExchangeHooks hooks_;
  // The spans each step's all-reduce averages: loss_, the step's loss (so
  // that every worker agrees whether the step was finite), then the
  // gradients by variable.
  float loss_ = 0;
  std::vector<absl::Span<float>> pieces_;
  // CPU workers: the all-reduce runs on caller_ while the backward pass
  // marks the pieces it completes in ready_; began_ while one runs.
  const bool overlap_;
  allreduce::PieceReadiness ready_;
  std::unique_ptr<ThreadPool> caller_;
  bool began_ = false;
  std::unique_ptr<absl::Notification> reduced_;
  absl::Status status_;
};

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_RING_EXCHANGE_H_
