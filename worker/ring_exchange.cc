#include "worker/ring_exchange.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"
#include "common/tensor_view.h"

namespace psflow::worker {

RingExchange::RingExchange(allreduce::Ring* ring, DataType wire,
                           std::unique_ptr<PsExchange> replica, model::Network* net,
                           const std::vector<float*>& grads, bool overlap, ExchangeHooks hooks)
    : ring_(ring),
      wire_(wire),
      replica_(std::move(replica)),
      hooks_(std::move(hooks)),
      overlap_(overlap) {
  pieces_ = {absl::MakeSpan(&loss_, 1)};
  const std::vector<VariableShape>& variables = net->variables();
  for (size_t v = 0; v < variables.size(); ++v) {
    pieces_.push_back(absl::MakeSpan(grads[v], NumElements(variables[v].shape)));
  }
  if (!overlap_) return;
  net->SetGradientsReady([this](absl::Span<const int> done) {
    for (int v : done) ready_.MarkReady(v + 1);
  });
  caller_ = std::make_unique<ThreadPool>(1);
}

void RingExchange::BeginStep(const StepPush& push, ExchangeRound* out) {
  replica_->BeginStep(push, out);
  if (!overlap_) return;
  // The ring all-reduce of the step's gradients starts now, on another
  // thread: each bucket goes as soon as the backward pass has completed its
  // gradients.
  began_ = true;
  ready_.Reset(static_cast<int>(pieces_.size()));
  reduced_ = std::make_unique<absl::Notification>();
  caller_->Schedule([this, step = push.step] {
    status_ = ring_->AllReduce(step, pieces_, wire_, &ready_);
    reduced_->Notify();
  });
}

void RingExchange::EndCompute(const absl::StatusOr<double>& loss) {
  replica_->EndCompute(loss);
  if (!began_) return;
  if (loss.ok()) {
    loss_ = static_cast<float>(*loss);
    ready_.MarkReady(0);
  } else {
    // The group cannot go on without this worker's gradients.
    ring_->Leave(loss.status());
    ready_.MarkAllReady();
  }
  reduced_->WaitForNotification();
}

void RingExchange::Abandon() {
  began_ = false;
  replica_->Abandon();
}

absl::Status RingExchange::Reduce(int64_t step, float* mean_loss) {
  const bool overlapped = began_;
  began_ = false;
  // The mean gradient of every worker, the same bits on each (and the mean
  // loss, so that all of them agree on whether the step was finite).
  // (Overlapped: the ring already replaced the loss by the group's mean.)
  if (!overlapped) loss_ = *mean_loss;
  const absl::Status s = overlapped ? status_ : ring_->AllReduce(step, pieces_, wire_);
  if (const int sig = hooks_.stop_signal(); sig != 0) return StoppedBySignal(sig);
  if (!s.ok()) {
    // The group is gone: every worker restarts (from the newest checkpoint).
    return absl::Status(IsRetryable(s) ? s.code() : absl::StatusCode::kInternal,
                        absl::StrCat("all-reduce of step ", step, ": ", s.message()));
  }
  *mean_loss = loss_;
  return absl::OkStatus();
}

}  // namespace psflow::worker
