#include "ps/shard.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/deferred_work.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"
#include "ps/slice_apply.h"
#include "ps/tensors.h"

namespace psflow::ps {
namespace {

// Whether a pushed gradient holds a NaN, an infinity or a value of `limit`
// or more in magnitude (found while it was decoded, or looked for now).
bool NonFinite(const Shard::SliceGradient& g, float limit) {
  if (g.finite_checked) return g.non_finite;
  if (!g.borrowed.empty()) {
    return AnyAtOrAboveIn(g.borrowed.dtype, static_cast<const char*>(g.borrowed.data), g.count(),
                          limit);
  }
  return !AllBelow(g.values.data(), static_cast<int64_t>(g.values.size()), limit);
}

// The bound of a job's pushed values: max_gradient_abs, or none (infinity).
float MagnitudeLimit(const JobConfig& job) {
  return job.max_gradient_abs() > 0 ? job.max_gradient_abs()
                                    : std::numeric_limits<float>::infinity();
}

// The values of a pushed gradient for the shard to keep (a skip's are
// empty): borrowed ones stay where they are with their hold.
Shard::Gradient Kept(Shard::SliceGradient& g) {
  Shard::Gradient kept;
  if (g.skip) return kept;
  kept.values = std::move(g.values);
  kept.borrowed = std::move(g.borrowed);
  return kept;
}

// A pushed gradient's values in memory of the shard's own (a copy of
// borrowed ones, whose hold is let go).
std::vector<float> Owned(Shard::SliceGradient& g) {
  if (g.skip) return {};
  if (g.borrowed.empty()) return std::move(g.values);
  std::vector<float> values(g.count());
  DecodeFloats(g.borrowed.dtype, static_cast<const char*>(g.borrowed.data), g.count(),
               values.data());
  g.borrowed = {};
  return values;
}

}  // namespace

namespace {

// `value` in the 16-bit `dtype`, into `*out` (made, or resized, as needed).
void EncodeHalves(DataType dtype, const std::vector<float>& value,
                  std::shared_ptr<std::vector<uint16_t>>* out) {
  if (*out == nullptr) *out = std::make_shared<std::vector<uint16_t>>();
  (*out)->resize(value.size());
  EncodeFloats(dtype, value.data(), static_cast<int64_t>(value.size()),
               reinterpret_cast<char*>((*out)->data()));
}

}  // namespace

void Shard::SetWireCopies(bool on) {
  absl::MutexLock lock(&mu_);
  wire_copies_ = on;
}

Shard::Shard(ThreadPool* apply_pool, int64_t apply_range, ThreadPool* appliers, StepTrace* trace,
             int64_t inline_apply_floats)
    : apply_pool_(apply_pool),
      apply_range_(std::max<int64_t>(apply_range, 1)),
      appliers_(appliers),
      inline_apply_floats_(inline_apply_floats),
      trace_(trace) {}

Shard::~Shard() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return applying_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

absl::Status Shard::Init(const InitHeader& header, std::vector<SliceValues> values) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(header.job().optimizer());
  if (!opt.ok()) return opt.status();
  absl::StatusOr<float> bn_momentum = BnMomentum(header.job());
  if (!bn_momentum.ok()) return bn_momentum.status();
  if (static_cast<int>(values.size()) != header.slice_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init has ", values.size(), " slices of values for ", header.slice_size(), " slices"));
  }
  if (header.live_workers_size() == 0)
    return absl::InvalidArgumentError("init names no live workers");
  for (int w : header.live_workers()) {
    if (w < 0 || (header.job().num_workers() > 0 && w >= header.job().num_workers())) {
      return absl::InvalidArgumentError(
          absl::StrCat("live worker ", w, " is not in the job of ", header.job().num_workers()));
    }
  }
  const std::vector<std::string> slot_names = (*opt)->SlotNames();
  std::vector<SliceState> states(values.size());
  for (int i = 0; i < header.slice_size(); ++i) {
    const int64_t n = NumElements(header.slice(i).shape());
    SliceValues& v = values[i];
    if (static_cast<int64_t>(v.value.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat("slice '", header.slice(i).name(), "' has ",
                                                     v.value.size(), " values, expected ", n));
    }
    v.slots.resize(slot_names.size());
    for (auto& slot : v.slots) {
      if (slot.empty()) slot.assign(n, 0.0f);
      if (static_cast<int64_t>(slot.size()) != n) {
        return absl::InvalidArgumentError(
            absl::StrCat("slot of '", header.slice(i).name(), "' has the wrong size"));
      }
    }
    states[i].version = header.version();
    // Not const: once no reader holds it, it is reused for a later value.
    states[i].published = std::make_shared<std::vector<float>>(std::move(v.value));
    states[i].slots = std::move(v.slots);
  }
  absl::MutexLock lock(&mu_);
  // Appliers write into the slots without the lock: let them finish.
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return applying_ == 0; };
  mu_.Await(absl::Condition(&idle));
  if (shutdown_) return absl::UnavailableError("ps is shutting down");
  initialized_ = true;
  job_id_ = header.job_id();
  slices_ =
      std::make_shared<const std::vector<SliceSpec>>(header.slice().begin(), header.slice().end());
  slice_ = std::move(states);
  applied_ = 0;
  empty_pushes_.clear();
  step_skipped_ = false;
  job_ = header.job();
  magnitude_limit_ = MagnitudeLimit(job_);
  halves_dtype_ = wire_copies_ && WireDtypeOf(job_) != DT_FLOAT ? WireDtypeOf(job_) : DT_FLOAT;
  if (halves_dtype_ != DT_FLOAT) {
    for (SliceState& s : slice_) {
      std::shared_ptr<std::vector<uint16_t>> halves;
      EncodeHalves(halves_dtype_, *s.published, &halves);
      s.published_halves = std::move(halves);
    }
  }
  optimizer_ = *std::move(opt);
  bn_momentum_ = *bn_momentum;
  live_workers_ =
      absl::flat_hash_set<int>(header.live_workers().begin(), header.live_workers().end());
  joining_.clear();
  pushed_steps_.clear();
  snapshots_.clear();
  ++generation_;
  counters_ = Counters{};
  version_ = header.version();
  async_ = AppliesEachGradient(job_);
  staleness_ = job_.mode() == JobConfig::SSP ? job_.staleness() : -1;
  pending_.clear();
  ready_.clear();
  round_owner_ = -1;
  round_lag_ = 0;
  clocks_.clear();
  accepted_.clear();
  last_lag_.clear();
  // A restored job's clocks start level: its version spread over the workers.
  const int64_t level = version_ / std::max(job_.num_workers(), 1);
  for (int w = 0; w < job_.num_workers(); ++w) clocks_[w] = accepted_[w] = level;
  for (int w : live_workers_) clocks_[w] = accepted_[w] = level;
  lag_count_ = lag_sum_ = lag_max_ = clock_gap_max_ = 0;
  WakeLocked();
  return absl::OkStatus();
}

absl::Status Shard::CheckJobLocked(uint64_t job_id) const {
  if (shutdown_) return absl::UnavailableError("ps is shutting down");
  if (!initialized_) return absl::FailedPreconditionError("ps holds no job yet");
  if (job_id != job_id_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is not the job this ps holds"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> Shard::Slices(uint64_t job_id) const {
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  return slices_;
}

std::shared_ptr<const Shard::Weights> Shard::WeightsLocked() const {
  auto weights = std::make_shared<Weights>();
  weights->version = version_;
  weights->slices = slices_;
  weights->values.reserve(slice_.size());
  for (const SliceState& s : slice_)
    weights->values.push_back(s.version == version_ ? s.published : s.previous);
  return weights;
}

absl::StatusOr<PushResponse::Outcome> Shard::Push(uint64_t job_id, int worker, int64_t step,
                                                  std::vector<std::vector<float>> grads) {
  {
    absl::MutexLock lock(&mu_);
    PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
    if (grads.size() != slice_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("push has ", grads.size(), " slices, the ps holds ", slice_.size()));
    }
  }
  std::vector<SliceGradient> all;
  all.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    SliceGradient& g = all.emplace_back();
    g.slice = static_cast<int>(i);
    g.values = std::move(grads[i]);
  }
  absl::StatusOr<PushResponse::Outcome> outcome = PushSlices(job_id, worker, step, std::move(all));
  if (outcome.ok()) FinishPush(*outcome);
  return outcome;
}

absl::StatusOr<Shard::PushStart> Shard::BeginPush(uint64_t job_id, absl::Span<const int32_t> asked,
                                                  bool skip, bool borrow) {
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (skip && job_.on_nonfinite() != JobConfig::SKIP_STEP) {
    // No worker of this job skips a step: the skip is forged (or of another
    // configuration), and taking it would pass this ps through a step that
    // the others apply.
    ++counters_.refused_pushes;
    return absl::InvalidArgumentError(absl::StrCat(
        "skip push refused: job ", job_id, " runs on_nonfinite=",
        JobConfig::NonFinitePolicy_Name(job_.on_nonfinite()), ", only SKIP_STEP jobs skip steps"));
  }
  PushStart start;
  start.slices = slices_;
  PSFLOW_ASSIGN_OR_RETURN(start.indices,
                          SliceIndices(asked, static_cast<int>(slices_->size()), "push"));
  start.dtype = WireDtypeOf(job_);
  start.magnitude_limit = MagnitudeLimit(job_);
  // An asynchronous shard would hold the push until its gradient's round:
  // it copies borrowed values as they come.
  start.borrow = borrow && !skip && !async_;
  if (!start.borrow && !skip) {
    start.buffers.reserve(start.indices.size());
    for (int i : start.indices) {
      start.buffers.push_back(GradientBufferLocked(i, NumElements((*slices_)[i].shape())));
    }
  }
  return start;
}

int64_t Shard::FinishPush(PushResponse::Outcome outcome) {
  absl::MutexLock lock(&mu_);
  if (outcome == PushResponse::STALE) ++counters_.stale;
  if (outcome == PushResponse::DUPLICATE) ++counters_.duplicate;
  return version_;
}

absl::StatusOr<PushResponse::Outcome> Shard::PushSlices(uint64_t job_id, int worker, int64_t step,
                                                        std::vector<SliceGradient> grads,
                                                        int64_t read_version) {
  // Outside the lock: it reads every value.
  const float limit = magnitude_limit_.load();
  int non_finite = -1;
  for (size_t k = 0; k < grads.size() && non_finite < 0; ++k) {
    if (!grads[k].skip && NonFinite(grads[k], limit)) non_finite = static_cast<int>(k);
  }
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  auto name_of = [&](int slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return slice >= 0 && static_cast<size_t>(slice) < slices_->size()
               ? absl::StrCat("'", (*slices_)[slice].name(), "'")
               : absl::StrCat("#", slice);
  };
  if (non_finite >= 0) {
    ++counters_.refused_pushes;
    return absl::InvalidArgumentError(absl::StrCat(
        "non-finite gradient for ", name_of(grads[non_finite].slice), " from worker ", worker,
        " at step ", step,
        job_.max_gradient_abs() > 0
            ? absl::StrCat(" (or one reaching max_gradient_abs ", job_.max_gradient_abs(), ")")
            : "",
        ": push refused"));
  }
  if (!live_workers_.contains(worker)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker, " is not a live member of the job"));
  }
  if (!async_) {
    if (step < version_) return PushResponse::STALE;
    if (step > version_) {
      return absl::FailedPreconditionError(
          absl::StrCat("push for step ", step, " but the ps is at version ", version_));
    }
  }
  // Every gradient is checked before any is kept.
  std::vector<bool> named(slice_.size(), false);
  for (const SliceGradient& g : grads) {
    if (g.slice < 0 || static_cast<size_t>(g.slice) >= slice_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("push names slice #", g.slice, "; the ps holds ", slice_.size(), " slices"));
    }
    if (named[g.slice]) {
      return absl::InvalidArgumentError(absl::StrCat("push names ", name_of(g.slice), " twice"));
    }
    named[g.slice] = true;
    const int64_t n = static_cast<int64_t>(slice_[g.slice].published->size());
    if (g.skip ? g.count() != 0 : g.count() != n) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of ", name_of(g.slice), " has ",
                                                     g.count(), " values, expected ", n));
    }
  }
  if (async_) return PushAsyncLocked(worker, step, read_version, std::move(grads));
  if (slice_.empty()) {
    if (!empty_pushes_.insert(worker).second) return PushResponse::DUPLICATE;
    pushed_steps_[worker] = version_;
    MaybeApplyAllLocked();
    return PushResponse::ACCEPTED;
  }
  std::vector<int> kept;
  for (SliceGradient& g : grads) {
    SliceState& s = slice_[g.slice];
    if (s.version > version_ || s.applying || s.pushes.contains(worker)) continue;
    s.pushes.emplace(worker, Kept(g));
    kept.push_back(g.slice);
  }
  if (kept.empty()) return PushResponse::DUPLICATE;
  NotePushLocked(worker);
  for (int i : kept) MaybeApplySliceLocked(i);
  return PushResponse::ACCEPTED;
}

void Shard::NotePushLocked(int worker) {
  // A slice applied (or being applied) in this step had the gradient of
  // every live worker.
  for (const SliceState& s : slice_) {
    if (s.version <= version_ && !s.applying && !s.pushes.contains(worker)) return;
  }
  pushed_steps_[worker] = version_;
}

absl::StatusOr<PushResponse::Outcome> Shard::PushAsyncLocked(int worker, int64_t clock,
                                                             int64_t read_version,
                                                             std::vector<SliceGradient> grads) {
  // The job is over here: nothing more is applied.
  if (version_ >= job_.train_steps()) return PushResponse::STALE;
  // A retry of a gradient already whole here (queued, being applied, or
  // applied) is answered as such, never taken again.
  const int64_t have = accepted_[worker];
  if (clock < have) return clock < clocks_[worker] ? PushResponse::STALE : PushResponse::DUPLICATE;
  if (clock > have) {
    return absl::FailedPreconditionError(absl::StrCat("push of worker ", worker, " for its step ",
                                                      clock, " but this ps has ", have,
                                                      " of its gradients"));
  }
  if (read_version < 0 || read_version > version_) {
    return absl::InvalidArgumentError(absl::StrCat("push computed from version ", read_version,
                                                   "; the ps is at version ", version_));
  }
  AsyncPush& p = pending_[worker];
  if (p.grads.empty() && !p.queued) {
    p.clock = clock;
    p.read_version = read_version;
    p.grads.resize(slice_.size());
  }
  if (p.queued) return PushResponse::DUPLICATE;
  bool kept = slice_.empty();
  for (SliceGradient& g : grads) {
    std::optional<std::vector<float>>& slot = p.grads[g.slice];
    if (slot.has_value()) continue;
    slot = Owned(g);
    ++p.received;
    kept = true;
  }
  if (!kept) return PushResponse::DUPLICATE;
  if (p.received == static_cast<int>(slice_.size())) {
    p.queued = true;
    ++accepted_[worker];
    ready_.push_back(worker);
    StartRoundLocked();
  }
  return PushResponse::ACCEPTED;
}

void Shard::StartRoundLocked() {
  while (round_owner_ < 0 && !ready_.empty()) {
    const int w = ready_.front();
    ready_.erase(ready_.begin());
    auto it = pending_.find(w);
    if (it == pending_.end() || !it->second.queued) continue;  // its worker was dropped
    AsyncPush p = std::move(it->second);
    pending_.erase(it);
    if (version_ >= job_.train_steps()) {
      // Complete, but after the last step: dropped.
      ++clocks_[w];
      ++counters_.stale;
      WakeLocked();
      continue;
    }
    round_owner_ = w;
    round_lag_ = version_ - p.read_version;
    if (slice_.empty()) {
      AdvanceLocked();
      WakeLocked();
      continue;
    }
    for (size_t i = 0; i < slice_.size(); ++i) {
      Gradient& g = slice_[i].pushes[w];
      g.values = std::move(*p.grads[i]);
    }
    // Applies the slices (here, or on the appliers); the last one's
    // FinishLocked starts the next queued gradient.
    MaybeApplyAllLocked();
    return;
  }
}

std::optional<int64_t> Shard::SlowestClockLocked(int except) const {
  std::optional<int64_t> slowest;
  for (int w : live_workers_) {
    if (w == except) continue;
    auto it = clocks_.find(w);
    const int64_t c = it == clocks_.end() ? 0 : it->second;
    if (!slowest.has_value() || c < *slowest) slowest = c;
  }
  return slowest;
}

bool Shard::StepCompleteLocked(const SliceState& s) const {
  if (async_) return round_owner_ >= 0 && s.pushes.contains(round_owner_);
  if (live_workers_.empty()) return false;
  for (int w : live_workers_) {
    if (!s.pushes.contains(w)) return false;
  }
  return true;
}

void Shard::MaybeApplySliceLocked(int i) {
  std::shared_ptr<SliceApply> job = ClaimLocked(i);
  if (job == nullptr) return;
  if (appliers_ != nullptr && job->n > inline_apply_floats_) {
    appliers_->Schedule([this, job] {
      // The wakes FinishLocked finds run here once the lock is let go.
      DeferredWork wakes;
      ComputeSliceApply(*job, apply_pool_, apply_range_, trace_);
      Publish(*job);
    });
    return;
  }
  mu_.Unlock();
  ComputeSliceApply(*job, apply_pool_, apply_range_, trace_);
  Publish(*job);
  mu_.Lock();
}

void Shard::Publish(SliceApply& job) {
  TraceSpan span(trace_, "publish", job.step);  // the wait for the lock too
  span.Arg("slice", job.slice);
  absl::MutexLock lock(&mu_);
  FinishLocked(job);
}

std::shared_ptr<SliceApply> Shard::ClaimLocked(int i) {
  // slice_ keeps its size while the slice is applying: Init waits for every applier.
  SliceState& s = slice_[i];
  if (s.applying || s.version > version_ || !StepCompleteLocked(s)) return nullptr;
  // The pushes (all from live workers), summed in worker-id order: each
  // element's sum is then the same however the work is split and whoever
  // applies it.
  auto job = std::make_shared<SliceApply>();
  job->slice = i;
  job->step = version_;
  job->pushes.reserve(s.pushes.size());
  for (auto& [worker, grad] : s.pushes) {
    job->skip |= grad.empty() && !s.published->empty();
    job->pushes.emplace_back(worker, std::move(grad));
  }
  s.pushes.clear();
  step_skipped_ |= job->skip;
  std::sort(job->pushes.begin(), job->pushes.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  s.applying = true;
  ++applying_;
  job->current = s.published;
  job->n = static_cast<int64_t>(job->current->size());
  for (auto& slot : s.slots) job->slots.push_back(slot.data());
  // The slots of the version before this one (no snapshot needs them any
  // more) take the slots after the apply.
  s.previous_slots.resize(s.slots.size());
  for (std::vector<float>& slot : s.previous_slots) {
    slot.resize(job->n);
    job->slots_out.push_back(slot.data());
  }
  job->optimizer = optimizer_.get();
  if ((*slices_)[i].non_trainable()) job->bn_momentum = bn_momentum_;
  job->out = std::move(s.spare);
  job->halves_dtype = halves_dtype_;
  if (halves_dtype_ != DT_FLOAT) job->halves_out = std::move(s.spare_halves);
  return job;
}

std::vector<float> Shard::GradientBufferLocked(int slice, int64_t n) {
  if (slice < 0 || slice >= static_cast<int>(slice_.size())) return {};
  std::vector<std::vector<float>>& spares = slice_[slice].spare_grads;
  if (spares.empty() || static_cast<int64_t>(spares.back().size()) != n) return {};
  std::vector<float> buffer = std::move(spares.back());
  spares.pop_back();
  return buffer;
}

void Shard::FinishLocked(SliceApply& job) {
  SliceState& s = slice_[job.slice];
  // Read: let go of it, so that the buffer is reused once no reader holds it.
  job.current = nullptr;
  for (auto& [worker, grad] : job.pushes) {
    if (grad.borrowed.empty() && static_cast<int64_t>(grad.values.size()) == job.n &&
        s.spare_grads.size() < live_workers_.size()) {
      s.spare_grads.push_back(std::move(grad.values));
    }
  }
  // Borrowed values are let go now (their pushes may be answered).
  job.pushes.clear();
  if (const int w = job.changed_by.load(); w >= 0) {
    ++counters_.changed_after_check;
    PSLOG(ERROR) << "worker " << w << " changed its gradient of '" << (*slices_)[job.slice].name()
                 << "' in shared memory after its push was checked (a NaN or an infinity at "
                    "step "
                 << job.step << "); those values counted as 0";
  }
  s.applying = false;
  --applying_;
  // The slots after the apply become the slice's; those it read are kept
  // as the slots at version_ until the shard advances.
  s.slots.swap(s.previous_slots);
  s.previous = std::move(s.published);
  s.published = std::move(job.out);
  s.previous_halves = std::move(s.published_halves);
  s.published_halves = std::move(job.halves_out);
  s.version = job.step + 1;
  // One asked for while slices were applied: with none applying any more,
  // every slice's value and slots at version_ are at hand (an applied
  // slice keeps them until the shard advances).
  TakeSnapshotLocked();
  if (++applied_ == static_cast<int>(slice_.size())) {
    AdvanceLocked();
    if (async_) StartRoundLocked();
    WakeLocked();
    return;
  }
  WakeLocked(job.slice);
}

void Shard::MaybeApplyAllLocked() {
  if (slice_.empty() && !async_) {
    if (live_workers_.empty()) return;
    for (int w : live_workers_) {
      if (!empty_pushes_.contains(w)) return;
    }
    AdvanceLocked();
    WakeLocked();
    return;
  }
  // The lock is let go while a slice is applied, but slice_ keeps its size.
  for (size_t i = 0; i < slice_.size(); ++i) MaybeApplySliceLocked(static_cast<int>(i));
}

void Shard::AdvanceLocked() {
  for (SliceState& s : slice_) {
    // The value at the old version is no reader's any more: its buffer
    // takes the next one (readers hand theirs back without the lock, but
    // none takes a new reference to it).
    if (s.previous != nullptr && s.previous.use_count() == 1) {
      // The readers that held it are done with it: order their reads
      // before the writes of its next use.
      std::atomic_thread_fence(std::memory_order_acquire);
      s.spare = std::const_pointer_cast<std::vector<float>>(std::move(s.previous));
    }
    s.previous = nullptr;
    if (s.previous_halves != nullptr && s.previous_halves.use_count() == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);
      s.spare_halves = std::const_pointer_cast<std::vector<uint16_t>>(std::move(s.previous_halves));
    }
    s.previous_halves = nullptr;
  }
  applied_ = 0;
  empty_pushes_.clear();
  if (round_owner_ >= 0) {
    ++clocks_[round_owner_];
    last_lag_[round_owner_] = round_lag_;
    ++lag_count_;
    lag_sum_ += round_lag_;
    lag_max_ = std::max(lag_max_, round_lag_);
    round_owner_ = -1;
  }
  if (step_skipped_) ++counters_.skipped;
  step_skipped_ = false;
  ++version_;
  ++counters_.applied;
  OnVersionLocked();
}

void Shard::OnVersionLocked() {
  for (auto it = joining_.begin(); it != joining_.end();) {
    if (it->second <= version_) {
      live_workers_.insert(it->first);
      joining_.erase(it++);
    } else {
      ++it;
    }
  }
  TakeSnapshotLocked();
}

void Shard::TakeSnapshotLocked() {
  if (applying_ > 0) return;  // its slots are being written
  auto snap = snapshots_.find(version_);
  if (snap == snapshots_.end() || snap->second.data != nullptr) return;
  auto data = std::make_shared<Snapshot>();
  data->weights = WeightsLocked();
  data->slot_names = optimizer_->SlotNames();
  data->slots.reserve(slice_.size());
  for (const SliceState& s : slice_) {
    // A slice applied ahead of the shard kept its slots of version_.
    data->slots.push_back(s.version > version_ ? s.previous_slots : s.slots);
  }
  snap->second.data = std::move(data);
}

absl::Status Shard::Mirror(uint64_t job_id, int64_t version, std::vector<SliceValues> values) {
  // The values readers get, made without the lock.
  std::vector<Value> published;
  published.reserve(values.size());
  for (SliceValues& v : values) {
    published.push_back(std::make_shared<std::vector<float>>(std::move(v.value)));
  }
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return applying_ == 0; };
  mu_.Await(absl::Condition(&idle));
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (values.size() != slice_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mirror has ", values.size(), " slices of values for ", slice_.size()));
  }
  const size_t slots = optimizer_->SlotNames().size();
  for (size_t i = 0; i < values.size(); ++i) {
    const size_t n = slice_[i].published->size();
    bool fits = published[i]->size() == n && values[i].slots.size() == slots;
    for (const std::vector<float>& slot : values[i].slots) fits = fits && slot.size() == n;
    if (!fits) {
      return absl::InvalidArgumentError(
          absl::StrCat("mirror of slice '", (*slices_)[i].name(), "' has the wrong size"));
    }
  }
  if (version < version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("mirror of version ", version, " behind the shard's ", version_));
  }
  if (applied_ > 0 || !empty_pushes_.empty() ||
      std::any_of(slice_.begin(), slice_.end(),
                  [](const SliceState& s) { return !s.pushes.empty(); })) {
    return absl::FailedPreconditionError("a mirrored shard takes no pushes");
  }
  for (size_t i = 0; i < values.size(); ++i) {
    SliceState& s = slice_[i];
    s.previous = nullptr;
    s.published = std::move(published[i]);
    // (A mirror is a replica's, which has no wire copies.)
    s.previous_halves = s.published_halves = nullptr;
    s.version = version;
    s.slots = std::move(values[i].slots);
  }
  counters_.applied += version - version_;
  version_ = version;
  OnVersionLocked();
  WakeLocked();
  return absl::OkStatus();
}

std::optional<int64_t> Shard::WantedSnapshot(int64_t from) const {
  absl::MutexLock lock(&mu_);
  std::optional<int64_t> wanted;
  for (const auto& [version, pending] : snapshots_) {
    if (version >= from && pending.data == nullptr && (!wanted || version < *wanted)) {
      wanted = version;
    }
  }
  return wanted;
}

absl::Status Shard::SetLiveWorkers(uint64_t job_id, const std::vector<int>& live,
                                   int64_t from_version) {
  if (live.empty()) return absl::InvalidArgumentError("a job needs at least one live worker");
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  for (int w : live) {
    if (w < 0 || (job_.num_workers() > 0 && w >= job_.num_workers())) {
      return absl::InvalidArgumentError(
          absl::StrCat("live worker ", w, " is not in the job of ", job_.num_workers()));
    }
  }
  const absl::flat_hash_set<int> wanted(live.begin(), live.end());
  for (auto it = live_workers_.begin(); it != live_workers_.end();) {
    if (!wanted.contains(*it)) {
      // A dropped worker's pushes do not count (but a gradient of its that
      // an asynchronous step is applying is applied whole).
      if (*it != round_owner_) {
        for (SliceState& s : slice_) s.pushes.erase(*it);
      }
      empty_pushes_.erase(*it);
      if (auto p = pending_.find(*it); p != pending_.end()) {
        if (p->second.queued) --accepted_[*it];  // its queued gradient is not applied
        pending_.erase(p);
      }
      live_workers_.erase(it++);
    } else {
      ++it;
    }
  }
  // Joins already scheduled keep their version; new ones get from_version.
  absl::erase_if(joining_, [&](const auto& entry) { return !wanted.contains(entry.first); });
  for (int w : wanted) {
    if (live_workers_.contains(w)) continue;
    if (async_) {
      // At once, and no slower than the slowest live worker.
      const std::optional<int64_t> slowest = SlowestClockLocked(w);
      int64_t& clock = clocks_[w];
      if (slowest.has_value()) clock = std::max(clock, *slowest);
      accepted_[w] = std::max(accepted_[w], clock);
      live_workers_.insert(w);
      continue;
    }
    joining_.try_emplace(w, from_version);
  }
  // Nobody left for the current step: the joining workers take it on now.
  if (live_workers_.empty()) {
    for (auto& [w, version] : joining_) version = std::min(version, version_);
  }
  OnVersionLocked();  // joins due already
  MaybeApplyAllLocked();
  WakeLocked();
  return absl::OkStatus();
}

void Shard::WakeLocked(int slice) {
  for (auto& [id, wake] : waiters_) wake(slice);
}

int64_t Shard::AddWaiter(std::function<void(int)> wake) {
  absl::MutexLock lock(&mu_);
  const int64_t id = next_waiter_++;
  waiters_.emplace(id, std::move(wake));
  return id;
}

void Shard::RemoveWaiter(int64_t id) {
  absl::MutexLock lock(&mu_);
  waiters_.erase(id);
}

absl::StatusOr<std::optional<Shard::PulledSlice>> Shard::TryPullSlice(uint64_t job_id, int slice,
                                                                      int64_t min_version) {
  absl::MutexLock lock(&mu_);
  return TryPullSliceLocked(job_id, slice, min_version);
}

absl::StatusOr<std::optional<std::pair<size_t, Shard::PulledSlice>>> Shard::TryPullFirstReady(
    uint64_t job_id, absl::Span<const int> slices, int64_t min_version) {
  absl::MutexLock lock(&mu_);
  for (size_t k = 0; k < slices.size(); ++k) {
    absl::StatusOr<std::optional<PulledSlice>> pulled =
        TryPullSliceLocked(job_id, slices[k], min_version);
    if (!pulled.ok()) return pulled.status();
    if (pulled->has_value()) return std::make_pair(k, **std::move(pulled));
  }
  return std::nullopt;
}

Shard::PulledSlice Shard::SliceAtLocked(const SliceState& s, int64_t min_version) const {
  PulledSlice pulled;
  if (s.version > version_ && version_ >= min_version) {
    pulled.version = version_;  // as the shard's other slices
    pulled.value = s.previous;
    pulled.halves = s.previous_halves;
  } else {
    pulled.version = s.version;
    pulled.value = s.published;
    pulled.halves = s.published_halves;
  }
  if (pulled.halves != nullptr) pulled.halves_dtype = halves_dtype_;
  return pulled;
}

absl::StatusOr<std::optional<Shard::PulledSlice>> Shard::TryPullSliceLocked(uint64_t job_id,
                                                                            int slice,
                                                                            int64_t min_version) {
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (slice < 0 || static_cast<size_t>(slice) >= slice_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull of slice #", slice, "; the ps holds ", slice_.size(), " slices"));
  }
  const SliceState& s = slice_[slice];
  if (s.version < min_version) return std::nullopt;
  return SliceAtLocked(s, min_version);
}

absl::StatusOr<std::optional<int64_t>> Shard::TryVersion(uint64_t job_id, int64_t min_version) {
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (version_ < min_version) return std::nullopt;
  return version_;
}

absl::StatusOr<std::optional<Shard::ClockGrant>> Shard::TryClockLocked(uint64_t job_id, int worker,
                                                                       int64_t clock) {
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (!async_) {
    return absl::FailedPreconditionError("a pull by clock, but the job is synchronous");
  }
  if (worker < 0 || worker >= job_.num_workers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull for worker ", worker, "; the job has ", job_.num_workers()));
  }
  auto it = clocks_.find(worker);
  const int64_t own = it == clocks_.end() ? 0 : it->second;
  if (version_ < job_.train_steps() && !live_workers_.contains(worker)) {
    // Dropped (its queued gradient too): it must register again, not wait.
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker, " is not a live member of the job"));
  }
  if (version_ < job_.train_steps()) {  // the last step applied: answered at once
    if (own < clock) return std::nullopt;
    if (const std::optional<int64_t> slowest = SlowestClockLocked(worker)) {
      if (staleness_ >= 0 && clock - *slowest > staleness_) return std::nullopt;
      clock_gap_max_ = std::max(clock_gap_max_, clock - *slowest);
    }
  }
  ClockGrant grant;
  grant.version = version_;
  grant.clock = own;
  auto lag = last_lag_.find(worker);
  grant.lag = lag == last_lag_.end() ? 0 : lag->second;
  return grant;
}

absl::StatusOr<std::optional<Shard::ClockGrant>> Shard::TryClock(uint64_t job_id, int worker,
                                                                 int64_t clock) {
  absl::MutexLock lock(&mu_);
  return TryClockLocked(job_id, worker, clock);
}

absl::StatusOr<Shard::SnapshotTicket> Shard::RequestSnapshotLocked(uint64_t job_id,
                                                                   int64_t version) {
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  auto taken = snapshots_.find(version);
  if (version_ > version && (taken == snapshots_.end() || taken->second.data == nullptr)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ps is at version ", version_, ", past ", version));
  }
  ++snapshots_[version].waiters;
  OnVersionLocked();  // takes it now if the shard is at that version
  return SnapshotTicket{job_id, version, generation_};
}

absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> Shard::PollSnapshotLocked(
    const SnapshotTicket& ticket) {
  if (shutdown_) return absl::UnavailableError("ps is shutting down");
  // An Init dropped the ticket's entry: its job (even the same id) was reloaded.
  if (ticket.generation != generation_) {
    return absl::AbortedError("the job was reloaded while waiting");
  }
  auto it = snapshots_.find(ticket.version);
  if (it != snapshots_.end() && it->second.data != nullptr) return it->second.data;
  if (version_ > ticket.version) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ps went past version ", ticket.version, " before it could be taken"));
  }
  return nullptr;  // not yet
}

void Shard::ReleaseSnapshotLocked(const SnapshotTicket& ticket) {
  if (ticket.generation != generation_) return;  // Init dropped every entry
  auto it = snapshots_.find(ticket.version);
  if (it != snapshots_.end() && --it->second.waiters <= 0) snapshots_.erase(it);
}

absl::StatusOr<Shard::SnapshotTicket> Shard::RequestSnapshot(uint64_t job_id, int64_t version) {
  absl::MutexLock lock(&mu_);
  return RequestSnapshotLocked(job_id, version);
}

absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> Shard::PollSnapshot(
    const SnapshotTicket& ticket) {
  absl::MutexLock lock(&mu_);
  return PollSnapshotLocked(ticket);
}

void Shard::ReleaseSnapshot(const SnapshotTicket& ticket) {
  absl::MutexLock lock(&mu_);
  ReleaseSnapshotLocked(ticket);
}

Shard::State Shard::state() const {
  absl::MutexLock lock(&mu_);
  State st;
  st.has_job = initialized_;
  st.job_id = job_id_;
  st.version = version_;
  st.job = job_;
  st.live_workers.assign(live_workers_.begin(), live_workers_.end());
  std::sort(st.live_workers.begin(), st.live_workers.end());
  for (const auto& [w, version] : joining_) st.joining_workers.push_back(w);
  std::sort(st.joining_workers.begin(), st.joining_workers.end());
  if (async_) {
    st.clocks.assign(std::max(job_.num_workers(), 0), 0);
    for (const auto& [w, clock] : clocks_) {
      if (w >= 0 && w < job_.num_workers()) st.clocks[w] = clock;
    }
    st.lag_count = lag_count_;
    st.lag_sum = lag_sum_;
    st.lag_max = lag_max_;
    st.clock_gap_max = clock_gap_max_;
  } else {
    st.pushed_steps.assign(std::max(job_.num_workers(), 0), -1);
    for (const auto& [w, step] : pushed_steps_) {
      if (w >= 0 && w < job_.num_workers()) st.pushed_steps[w] = step;
    }
  }
  return st;
}

absl::StatusOr<DataType> Shard::WireDtype(uint64_t job_id) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckJobLocked(job_id); !s.ok()) return s;
  return WireDtypeOf(job_);
}

void Shard::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  WakeLocked();
}

Shard::Stats Shard::stats() const {
  absl::MutexLock lock(&mu_);
  Stats st;
  static_cast<Counters&>(st) = counters_;
  st.version = version_;
  st.staleness_sum = lag_sum_;
  st.staleness_max = lag_max_;
  st.clock_lead_max = clock_gap_max_;
  return st;
}

}  // namespace psflow::ps
