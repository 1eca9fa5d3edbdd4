// The coordinator's checkpoints and saved model (chief/coordinator.h): when
// to take one, taking it from the ps' snapshots (retried), the checkpoint a
// stopping ps waits for, and the saved model at the job's end.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "chief/coordinator.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "model/saved_model.h"
#include "model/spec.h"
#include "ps/optimizer.h"

namespace psflow::chief {

absl::Status Coordinator::TakeCheckpoint(Checkpoint* taken) {
  // A ps may pass the chosen step between looking and asking: look again.
  absl::Status s;
  for (int attempt = 0; attempt < options_.timeouts.checkpoint_attempts; ++attempt) {
    s = TakeCheckpointOnce(taken, attempt);
    if (!absl::IsFailedPrecondition(s) || absl::Now() >= checkpoint_cutoff_) return s;
  }
  return s;
}

int64_t Coordinator::CheckpointTarget(const std::vector<PsState>& states, int attempt) const {
  const int64_t newest = MaxVersion(states);
  if (AppliesEachGradient(job_)) {
    // The ps of an asynchronous job are never in step, and each moves by
    // every worker's gradient: one may pass the newest version before the
    // request reaches it. Ask for a version a few gradients ahead, which
    // every ps reaches soon, unless they agree and this is the first try
    // (nothing may be moving: a job whose workers are away).
    bool agree = true;
    for (const PsState& st : states) agree = agree && st.version() == newest;
    return !agree || attempt > 0 ? VersionAhead(job_, newest) : newest;
  }
  // A synchronous job whose steps take a few milliseconds passed the
  // newest step twice between the look and the request: ask for two
  // steps on, which every ps reaches soon, at once with the others.
  return attempt > 1 ? std::min<int64_t>(newest + 2, job_.train_steps()) : newest;
}

absl::Status Coordinator::TakeCheckpointOnce(Checkpoint* taken, int attempt) {
  const absl::Time begun = absl::Now();
  const uint64_t id = job_id();
  absl::StatusOr<std::vector<PsState>> states = States(id);
  if (!states.ok()) return absl::UnavailableError("a ps is not reachable");
  const int64_t target = CheckpointTarget(*states, attempt);
  // Every ps copies its slices the moment it reaches `target` (those there
  // already, at once): one consistent step across shards (in an
  // asynchronous job, one consistent version of each shard), taken while
  // training goes on.
  const std::vector<std::string> slots = ps::Optimizer::SlotNames(job_.optimizer().kind());
  Checkpoint ckpt = EmptyCheckpoint(job_, target, slots);
  // Variable i's value, then its slots, are ckpt.tensors[i * per_var + k].
  const size_t per_var = slots.size() + 1;
  std::vector<std::vector<float*>> buffers(per_var);
  std::vector<std::string> slot_of(per_var);
  for (size_t i = 0; i < ckpt.tensors.size(); ++i) {
    buffers[i % per_var].push_back(ckpt.tensors[i].values.data());
    slot_of[i % per_var] = ckpt.tensors[i].slot;
  }
  const absl::Time deadline =
      std::min(absl::Now() + options_.timeouts.snapshot_call, checkpoint_cutoff_);
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_, job_.num_ps(), RetryPolicy(), [&](int p) {
    return ps_->Snapshot(p, id, target, StateSinks(job_.placement(), p, buffers, slot_of),
                         deadline);
  }));
  for (const CheckpointTensorData& t : ckpt.tensors) {
    if (std::all_of(t.values.begin(), t.values.end(), [](float v) { return std::isfinite(v); }))
      continue;
    absl::Status diverged = absl::OutOfRangeError(absl::StrCat(
        "the weights of step ", target, " are not finite (", t.name, t.slot.empty() ? "" : "/",
        t.slot,
        "): the job diverged; the checkpoints before it are kept, no saved model is written"));
    Fail(diverged);
    return diverged;
  }
  const absl::Time start = absl::Now();
  PSFLOW_RETURN_IF_ERROR(WriteCheckpoint(options_.model_dir, ckpt, options_.keep_checkpoints));
  last_checkpoint_step_ = target;
  last_checkpoint_time_ = absl::Now();
  PSLOG(INFO) << "checkpoint of step " << target << " written to "
              << CheckpointsDir(options_.model_dir) << " ("
              << absl::ToInt64Milliseconds(absl::Now() - start) << " ms)";
  int64_t bytes = 0;
  for (const CheckpointTensorData& t : ckpt.tensors) bytes += t.values.size() * sizeof(float);
  metrics_.Checkpointed(target, absl::Now() - begun, bytes);
  if (taken != nullptr) *taken = std::move(ckpt);
  return absl::OkStatus();
}

bool Coordinator::CheckpointForStoppingPs(const std::vector<PsState>& states, int64_t version) {
  // A ps told to stop (a signal: its pod evicted, say) serves on until
  // this chief has checkpointed what it holds, and exits then: take that
  // checkpoint now (unless the last one is of this step), and say so.
  // Its reload from that checkpoint follows, as for any ps that goes.
  // A chief told to stop meanwhile (a whole cluster stopping at once) takes
  // the stop's checkpoint instead and tells every ps then: a ps told now
  // would exit before that checkpoint could reach it.
  std::vector<int> stopping;
  for (int p = 0; p < static_cast<int>(states.size()); ++p) {
    if (states[p].stopping() && !told_stopping_.contains(p)) stopping.push_back(p);
  }
  if (stopping.empty() || StopRequested()) return true;
  PSLOG(INFO) << "ps " << absl::StrJoin(stopping, ", ")
              << " told to stop: checkpointing before it goes";
  absl::Status s = version > last_checkpoint_step_ ? TakeCheckpoint() : absl::OkStatus();
  if (Failed()) return false;
  if (!s.ok()) {
    PSLOG(WARNING) << "checkpoint failed: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
  }
  if (StopRequested()) return true;
  const int told = TellCheckpointTaken(stopping);
  PSLOG(INFO) << "told " << told << " of " << stopping.size() << " stopping ps that "
              << (s.ok() ? absl::StrCat("the checkpoint of step ", last_checkpoint_step_,
                                        " holds what they had")
                         : std::string("no checkpoint is coming"))
              << " (they exit now)";
  told_stopping_.insert(stopping.begin(), stopping.end());
  return true;
}

void Coordinator::CheckpointIfDue(int64_t version) {
  const bool by_steps = options_.checkpoint_every_steps > 0 &&
                        version >= last_checkpoint_step_ + options_.checkpoint_every_steps;
  const bool by_time = options_.checkpoint_every > absl::ZeroDuration() &&
                       absl::Now() - last_checkpoint_time_ >= options_.checkpoint_every &&
                       version > last_checkpoint_step_;
  if (!by_steps && !by_time) return;
  absl::Status s = TakeCheckpoint();
  if (!s.ok() && !Failed())
    PSLOG(WARNING) << "checkpoint failed: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
}

absl::Status Coordinator::CheckpointAndStop() {
  // Stopped by a signal: keep what was trained, then leave ps and workers
  // running for the chief that comes next; briefly, as the ps may be
  // stopping too (a whole cluster told to stop).
  checkpoint_cutoff_ = absl::Now() + options_.timeouts.stop_checkpoint;
  absl::Status s = TakeCheckpoint();
  if (!s.ok() && !Failed())
    PSLOG(WARNING) << "no checkpoint before exiting: " << s.message() << " ("
                   << absl::StatusCodeToString(s.code()) << ")";
  if (!Failed()) {
    std::vector<int> all(job_.num_ps());
    std::iota(all.begin(), all.end(), 0);
    PSLOG(INFO) << "told " << TellCheckpointTaken(all) << " of " << job_.num_ps()
                << " ps that the stop checkpoint is done (a ps stopping too exits now)";
  }
  absl::MutexLock lock(&mu_);
  if (!failure_.ok()) return failure_;
  return group_broken_.ok() ? StoppedBySignal(stop_signal_) : group_broken_;
}

absl::Status Coordinator::SaveModel(Checkpoint* final_checkpoint) {
  std::vector<std::vector<float>> values;
  int64_t version = -1;
  if (final_checkpoint != nullptr) {
    // The values (slot "") come in the variables' order.
    for (CheckpointTensorData& t : final_checkpoint->tensors) {
      if (t.slot.empty()) values.push_back(std::move(t.values));
    }
    version = final_checkpoint->manifest.step();
  } else {
    for (const VariableShape& v : model::ModelVariables(job_.model()))
      values.emplace_back(NumElements(v.shape));
    std::vector<float*> buffers;
    for (std::vector<float>& v : values) buffers.push_back(v.data());
    const absl::Time deadline = absl::Now() + options_.timeouts.final_pull;
    const uint64_t id = job_id();
    std::vector<int64_t> versions(job_.num_ps(), 0);
    absl::Status s = FanOut(pool_, job_.num_ps(), RetryPolicy(), [&](int p) {
      absl::StatusOr<ps::Client::PullResult> r =
          ps_->Pull(p, id, job_.train_steps(), {}, SliceSinks(job_.placement(), p, buffers),
                    deadline, absl::ZeroDuration());
      if (r.ok()) versions[p] = r->version;
      return r.status();
    });
    if (!s.ok())
      return absl::InternalError(absl::StrCat("cannot read the final weights: ", s.message()));
    version = versions.empty() ? 0 : versions[0];
  }
  const std::string dir = SavedModelDir();
  absl::Status s = model::WriteSavedModel(dir, job_.model(), version, values);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("cannot write the saved model: ", s.message()));
  PSLOG(INFO) << "saved model (step " << version << ") written to " << dir;
  return absl::OkStatus();
}

int Coordinator::TellCheckpointTaken(const std::vector<int>& ps) {
  const uint64_t id = job_id();
  const absl::Time deadline =
      absl::Now() + std::min(options_.timeouts.control_call, options_.timeouts.stop_release);
  // Once each (no retries): a ps that is down or gone waits for no one.
  std::vector<char> told(ps.size(), 0);
  FanOut(pool_, static_cast<int>(ps.size()), RetryPolicy(), [&](int i) {
    told[i] = ps_->CheckpointTaken(ps[i], id, deadline).ok();
    return absl::OkStatus();
  }).IgnoreError();  // the calls report through `told`
  return static_cast<int>(std::count(told.begin(), told.end(), 1));
}

}  // namespace psflow::chief
