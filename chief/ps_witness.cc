#include "chief/ps_witness.h"

#include <algorithm>

#include "common/log.h"

namespace psflow::chief {

void PsWitness::Observe(const std::vector<PsState>& states) {
  View view;
  view.job_id = states.empty() ? 0 : states[0].job_id();
  for (const PsState& st : states) {
    if (st.job_id() != view.job_id) return;  // no one view
    view.max_version = std::max(view.max_version, st.version());
    if (view.pushed.empty()) view.pushed.assign(st.pushed_steps().begin(), st.pushed_steps().end());
    for (size_t w = 0; w < view.pushed.size(); ++w) {
      view.pushed[w] = static_cast<int>(w) < st.pushed_steps_size()
                           ? std::min(view.pushed[w], st.pushed_steps(static_cast<int>(w)))
                           : -1;
    }
  }
  absl::MutexLock lock(&mu_);
  if (view.job_id == view_.job_id) {
    view.max_version = std::max(view.max_version, view_.max_version);
    for (size_t w = 0; w < std::min(view.pushed.size(), view_.pushed.size()); ++w) {
      view.pushed[w] = std::max(view.pushed[w], view_.pushed[w]);
    }
  }
  view_ = std::move(view);
}

bool PsWitness::Reached(uint64_t job_id, int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  return view_.job_id == job_id && step <= view_.max_version;
}

bool PsWitness::HasStep(uint64_t job_id, int w, int64_t step) const {
  absl::ReaderMutexLock lock(&mu_);
  return HasStepLocked(job_id, w, step);
}

bool PsWitness::HasStepLocked(uint64_t job_id, int w, int64_t step) const {
  if (view_.job_id != job_id) return false;
  if (asynchronous_) return step <= view_.max_version;
  return w >= 0 && static_cast<size_t>(w) < view_.pushed.size() && view_.pushed[w] >= step;
}

PsWitness::ClaimVerdict PsWitness::Claim(uint64_t job_id, int w, int64_t step, absl::Time now) {
  absl::MutexLock lock(&mu_);
  const bool known = std::any_of(waiting_.begin(), waiting_.end(), [&](const Waiting& c) {
    return c.job_id == job_id && c.worker == w && c.step == step;
  });
  if (known) return ClaimVerdict::kKnown;
  // A step no ps is at yet, or one every ps has this worker's gradients
  // of, is refuted at once: the claims that wait are a worker's current
  // step (or two), whatever is sent.
  if (view_.job_id != job_id || step > view_.max_version || HasStepLocked(job_id, w, step)) {
    LogRefutedLocked(w, step, "the ps have its gradients of that step, or are not there yet");
    return ClaimVerdict::kRefuted;
  }
  waiting_.push_back({job_id, w, step, now});
  PSLOG(WARNING) << "worker " << w << " reports step " << step
                 << " not finite; the job fails once the ps confirm that its gradients of that "
                    "step never came";
  return ClaimVerdict::kWaiting;
}

std::vector<PsWitness::Confirmed> PsWitness::Resolve(uint64_t job_id,
                                                     const std::vector<PsState>& states,
                                                     absl::Time now, absl::Duration wait) {
  std::vector<Confirmed> confirmed;
  absl::MutexLock lock(&mu_);
  auto settled = [&](const Waiting& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (c.job_id != job_id) return true;  // the job was reloaded since
    bool beyond = false, withheld = false;
    for (const PsState& st : states) {
      beyond |= st.version() < c.step;
      withheld |= c.worker >= st.pushed_steps_size() || st.pushed_steps(c.worker) < c.step;
    }
    if (!beyond && withheld) {
      if (now - c.since < wait) return false;
      confirmed.push_back({c.worker, c.step});
      return true;
    }
    LogRefutedLocked(
        c.worker, c.step,
        beyond ? "the ps are not at that step" : "every ps received its gradients of that step");
    return true;
  };
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), settled), waiting_.end());
  return confirmed;
}

void PsWitness::LogRefutedLocked(int w, int64_t step, const char* why) {
  ++refuted_;
  PSLOG(WARNING) << "ignored a report from worker " << w << " that step " << step
                 << " is not finite: " << why << " (" << refuted_ << " ignored)";
}

void PsWitness::RefuseMetrics(int w, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (++refused_metrics_ <= 10 || refused_metrics_ % 1000 == 0) {
    PSLOG(WARNING) << "refused worker " << w << "'s metrics of step " << step
                   << ": the ps do not have its gradients of that step (" << refused_metrics_
                   << " refused)";
  }
}

}  // namespace psflow::chief
