#include "ps/shard.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_chunks.h"

namespace psflow::ps {
namespace {

// The index of the first gradient holding a NaN or an infinity, or -1.
int FirstNonFinite(const std::vector<std::vector<float>>& grads) {
  // A NaN or an infinity has every exponent bit set. One integer reduction
  // per slice, with no branch per value.
  constexpr uint32_t kExponent = 0x7f800000;
  for (size_t i = 0; i < grads.size(); ++i) {
    uint32_t max_exponent = 0;
    for (float g : grads[i])
      max_exponent = std::max(max_exponent, std::bit_cast<uint32_t>(g) & kExponent);
    if (max_exponent == kExponent) return static_cast<int>(i);
  }
  return -1;
}

// What an apply works on in one slice, as raw pointers into the shard's
// members: the pool's threads use these while the applying thread holds the
// shard's lock, and never touch the members (or the lock) themselves.
struct SliceApply {
  float* value = nullptr;
  float* sum = nullptr;              // scratch for the mean
  std::vector<float*> slots;         // Optimizer::SlotNames() order
  std::vector<const float*> pushes;  // one per live worker, in worker-id order
};

// Elements [begin, end) of one slice.
struct ApplyRange {
  int slice = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

}  // namespace

Shard::Shard(ThreadPool* apply_pool, int64_t apply_range)
    : apply_pool_(apply_pool), apply_range_(std::max<int64_t>(apply_range, 1)) {}

absl::Status Shard::Init(const InitHeader& header, std::vector<SliceValues> values) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(header.job().optimizer());
  if (!opt.ok()) return opt.status();
  if (static_cast<int>(values.size()) != header.slice_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "init has ", values.size(), " slices of values for ", header.slice_size(), " slices"));
  }
  if (header.live_workers_size() == 0)
    return absl::InvalidArgumentError("init names no live workers");
  const std::vector<std::string> slot_names = (*opt)->SlotNames();
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
  }
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("ps is shutting down");
  initialized_ = true;
  job_id_ = header.job_id();
  slices_ =
      std::make_shared<const std::vector<SliceSpec>>(header.slice().begin(), header.slice().end());
  values_ = std::move(values);
  weights_ = nullptr;
  job_ = header.job();
  optimizer_ = *std::move(opt);
  live_workers_ =
      absl::flat_hash_set<int>(header.live_workers().begin(), header.live_workers().end());
  joining_.clear();
  sum_.clear();
  for (const SliceSpec& s : *slices_) sum_.emplace_back(NumElements(s.shape()), 0.0f);
  pending_.clear();
  snapshots_.clear();
  counters_ = Counters{};
  version_ = header.version();
  version_changed_.SignalAll();
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

absl::Status Shard::WaitLocked(uint64_t job_id, int64_t version, absl::Time deadline,
                               const std::function<bool()>& cancelled, absl::string_view what,
                               absl::FunctionRef<bool()> reached) {
  while (!reached()) {
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(what, " cancelled"));
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("version ", version, " not reached; ps is at ", version_));
    }
    // Bounded wait so that a cancelled call is noticed; progress itself is signalled.
    version_changed_.WaitWithDeadline(&mu_, std::min(deadline, now + absl::Seconds(1)));
    if (shutdown_) return absl::UnavailableError("ps is shutting down");
    if (job_id != job_id_) return absl::AbortedError("the job was replaced while waiting");
  }
  return absl::OkStatus();
}

std::shared_ptr<const Shard::Weights> Shard::WeightsLocked() {
  if (weights_ == nullptr) {
    auto weights = std::make_shared<Weights>();
    weights->version = version_;
    weights->slices = slices_;
    weights->values.reserve(values_.size());
    for (const SliceValues& v : values_) weights->values.push_back(v.value);
    weights_ = std::move(weights);
  }
  return weights_;
}

absl::StatusOr<Shard::Pulled> Shard::Pull(uint64_t job_id, int64_t min_version, absl::Time deadline,
                                          const std::function<bool()>& cancelled) {
  const absl::Time start = absl::Now();
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  PSFLOW_RETURN_IF_ERROR(
      WaitLocked(job_id, min_version, deadline, cancelled, "pull",
                 [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return version_ >= min_version; }));
  Pulled pulled;
  pulled.weights = WeightsLocked();
  pulled.waited = absl::Now() - start;
  return pulled;
}

absl::StatusOr<PushResponse::Outcome> Shard::Push(uint64_t job_id, int worker, int64_t step,
                                                  std::vector<std::vector<float>> grads) {
  const int non_finite = FirstNonFinite(grads);  // outside the lock: it reads every value
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  if (non_finite >= 0) {
    ++counters_.refused_pushes;
    const std::string name = static_cast<size_t>(non_finite) < slices_->size()
                                 ? absl::StrCat("'", (*slices_)[non_finite].name(), "'")
                                 : absl::StrCat("#", non_finite);
    return absl::InvalidArgumentError(absl::StrCat("non-finite gradient for ", name,
                                                   " from worker ", worker, " at step ", step,
                                                   ": push refused"));
  }
  if (!live_workers_.contains(worker)) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker, " is not a live member of the job"));
  }
  if (step < version_) {
    ++counters_.stale;
    return PushResponse::STALE;
  }
  if (step > version_) {
    return absl::FailedPreconditionError(
        absl::StrCat("push for step ", step, " but the ps is at version ", version_));
  }
  if (pending_.contains(worker)) {
    ++counters_.duplicate;
    return PushResponse::DUPLICATE;
  }
  if (grads.size() != sum_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("push has ", grads.size(), " slices, the ps holds ", sum_.size()));
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].size() != sum_[i].size()) {
      return absl::InvalidArgumentError(absl::StrCat("gradient of '", (*slices_)[i].name(),
                                                     "' has ", grads[i].size(),
                                                     " values, expected ", sum_[i].size()));
    }
  }
  pending_[worker] = std::move(grads);
  MaybeApplyLocked();
  return PushResponse::ACCEPTED;
}

void Shard::MaybeApplyLocked() {
  if (live_workers_.empty()) return;
  for (int w : live_workers_) {
    if (!pending_.contains(w)) return;
  }
  ApplyLocked();
}

void Shard::ApplyLocked() {
  // The live workers' pushes (pending_ holds no others), summed in worker-id
  // order: each element's sum is then the same however the work is split.
  std::vector<std::pair<int, const std::vector<std::vector<float>>*>> pushes;
  pushes.reserve(pending_.size());
  for (const auto& [worker, grads] : pending_) pushes.emplace_back(worker, &grads);
  std::sort(pushes.begin(), pushes.end());

  std::vector<SliceApply> slices(values_.size());
  std::vector<ApplyRange> ranges;
  for (size_t i = 0; i < values_.size(); ++i) {
    SliceApply& s = slices[i];
    s.value = values_[i].value.data();
    s.sum = sum_[i].data();
    for (auto& slot : values_[i].slots) s.slots.push_back(slot.data());
    for (const auto& [worker, grads] : pushes) s.pushes.push_back((*grads)[i].data());
    const int64_t n = static_cast<int64_t>(sum_[i].size());
    for (int64_t begin = 0; begin < n; begin += apply_range_)
      ranges.push_back({static_cast<int>(i), begin, std::min(n, begin + apply_range_)});
  }

  // Averaging then the optimizer, one range at a time (its sum stays in cache).
  const float scale = 1.0f / static_cast<float>(pushes.size());
  const Optimizer& optimizer = *optimizer_;
  const int64_t step = version_;
  auto apply = [&slices, &ranges, &optimizer, scale, step](int i) {
    const ApplyRange& r = ranges[i];
    const SliceApply& s = slices[r.slice];
    const int64_t n = r.end - r.begin;
    float* sum = s.sum + r.begin;
    std::fill(sum, sum + n, 0.0f);
    for (const float* g : s.pushes) AddInto(sum, g + r.begin, n);
    ScaleInPlace(sum, scale, n);
    std::vector<float*> slots;
    for (float* slot : s.slots) slots.push_back(slot + r.begin);
    optimizer.Apply(step, s.value + r.begin, sum, n, slots);
  };
  const int num_ranges = static_cast<int>(ranges.size());
  if (apply_pool_ == nullptr) {
    for (int i = 0; i < num_ranges; ++i) apply(i);
  } else {
    // This thread and the pool's take ranges until none is left; ParallelFor
    // returns once all have finished, which orders their writes before
    // anything this thread does next under the lock.
    apply_pool_->ParallelFor(num_ranges, apply);
  }
  pending_.clear();
  weights_ = nullptr;  // readers keep their copy of the old version
  ++version_;
  ++counters_.applied;
  OnVersionLocked();
  version_changed_.SignalAll();
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
  auto snap = snapshots_.find(version_);
  if (snap != snapshots_.end() && snap->second.data == nullptr) {
    auto data = std::make_shared<Snapshot>();
    data->weights = WeightsLocked();
    data->slot_names = optimizer_->SlotNames();
    data->slots.reserve(values_.size());
    for (const SliceValues& v : values_) data->slots.push_back(v.slots);
    snap->second.data = std::move(data);
  }
}

absl::Status Shard::SetLiveWorkers(uint64_t job_id, const std::vector<int>& live,
                                   int64_t from_version) {
  if (live.empty()) return absl::InvalidArgumentError("a job needs at least one live worker");
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  const absl::flat_hash_set<int> wanted(live.begin(), live.end());
  for (auto it = live_workers_.begin(); it != live_workers_.end();) {
    if (!wanted.contains(*it)) {
      pending_.erase(*it);  // a dropped worker's push does not count
      live_workers_.erase(it++);
    } else {
      ++it;
    }
  }
  // Joins already scheduled keep their version; new ones get from_version.
  absl::erase_if(joining_, [&](const auto& entry) { return !wanted.contains(entry.first); });
  for (int w : wanted) {
    if (!live_workers_.contains(w)) joining_.try_emplace(w, from_version);
  }
  // Nobody left for the current step: the joining workers take it on now.
  if (live_workers_.empty()) {
    for (auto& [w, version] : joining_) version = std::min(version, version_);
  }
  OnVersionLocked();  // joins due already
  MaybeApplyLocked();
  version_changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> Shard::SnapshotAt(
    uint64_t job_id, int64_t version, absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock lock(&mu_);
  PSFLOW_RETURN_IF_ERROR(CheckJobLocked(job_id));
  auto taken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = snapshots_.find(version);
    return it != snapshots_.end() && it->second.data != nullptr;
  };
  if (version_ > version && !taken()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ps is at version ", version_, ", past ", version));
  }
  ++snapshots_[version].waiters;
  OnVersionLocked();  // takes it now if the shard is at that version
  absl::Status s = WaitLocked(job_id, version, deadline, cancelled, "snapshot", taken);
  std::shared_ptr<const Snapshot> data;
  // Every way out drops this caller's claim on the snapshot.
  auto it = snapshots_.find(version);
  if (it != snapshots_.end()) {
    if (s.ok()) data = it->second.data;
    if (--it->second.waiters <= 0) snapshots_.erase(it);
  }
  if (!s.ok()) return s;
  return data;
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
  version_changed_.SignalAll();
}

Shard::Stats Shard::stats() const {
  absl::MutexLock lock(&mu_);
  Stats st;
  static_cast<Counters&>(st) = counters_;
  st.version = version_;
  return st;
}

}  // namespace psflow::ps
