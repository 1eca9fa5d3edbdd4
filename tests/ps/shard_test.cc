#include "ps/shard.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/deferred_work.h"
#include "common/float16.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/optimizer.h"

namespace psflow::ps {
namespace {

// Every slice's values of a published version, copied.
std::vector<std::vector<float>> ValuesOf(const Shard::Weights& weights) {
  std::vector<std::vector<float>> out;
  for (const Shard::Value& v : weights.values) out.push_back(*v);
  return out;
}

using ::testing::HasSubstr;

constexpr uint64_t kJob = 0xC0FFEE;

// Values and gradients are small multiples of powers of two, so every sum,
// mean and update below is exact in fp32 and can be compared with ==.
InitHeader Header(OptimizerConfig::Kind kind, float lr, std::vector<int> workers = {0, 1},
                  int64_t version = 0) {
  InitHeader h;
  h.set_job_id(kJob);
  h.set_ps_index(0);
  h.mutable_job()->mutable_optimizer()->set_kind(kind);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(lr);
  h.set_version(version);
  for (int w : workers) h.add_live_workers(w);
  SliceSpec* a = h.add_slice();
  a->set_name("a");
  a->add_shape(2);
  a->add_shape(3);
  a->set_row_end(2);
  SliceSpec* b = h.add_slice();
  b->set_name("b");
  b->add_shape(4);
  b->set_row_end(4);
  return h;
}

const std::vector<float> kA = {1, -2, 3.5, 0, 0.25, -8};
const std::vector<float> kB = {10, 20, 30, 40};

std::vector<Shard::SliceValues> Values() {
  std::vector<Shard::SliceValues> v(2);
  v[0].value = kA;
  v[1].value = kB;
  return v;
}

std::vector<std::vector<float>> Grads(float scale) {
  return {{1 * scale, 2 * scale, -3 * scale, 0.5f * scale, 4 * scale, -1 * scale},
          {-2 * scale, 0.25f * scale, 6 * scale, 1 * scale}};
}

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

// The shard does not wait: its callers wait on its waiter API (as the
// sessions' drivers do, ps/pull_session.h). These helpers are such callers,
// blocking, for the tests: `look` runs again at every change of the shard
// (and at least once a second, when `cancelled` is asked too) until it
// gives a value or an error. Already there: served, even past the
// deadline. A job replaced while waiting is ABORTED, as one reloaded with
// fewer slices or workers (the look's FAILED_PRECONDITION or
// INVALID_ARGUMENT after a wait).
template <typename T>
absl::StatusOr<T> WaitFor(Shard* shard, int64_t version, absl::Time deadline,
                          const std::function<bool()>& cancelled,
                          const std::function<absl::StatusOr<std::optional<T>>()>& look) {
  absl::Mutex mu;
  bool changed = false;
  const int64_t id = shard->AddWaiter([&](int) {
    absl::MutexLock lock(&mu);
    changed = true;
  });
  absl::Cleanup remove = [&] { shard->RemoveWaiter(id); };
  for (bool waited = false;; waited = true) {
    {
      absl::MutexLock lock(&mu);
      changed = false;  // armed: a change after the look ends the wait
    }
    absl::StatusOr<std::optional<T>> got = look();
    if (!got.ok()) {
      if (waited &&
          (absl::IsFailedPrecondition(got.status()) || absl::IsInvalidArgument(got.status()))) {
        return absl::AbortedError(
            absl::StrCat("the job was replaced while waiting: ", got.status().message()));
      }
      return got.status();
    }
    if (got->has_value()) return **std::move(got);
    if (cancelled && cancelled()) return absl::CancelledError("wait cancelled");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("version ", version, " not reached; ps is at ", shard->stats().version));
    }
    absl::MutexLock lock(&mu);
    mu.AwaitWithDeadline(absl::Condition(&changed), std::min(deadline, now + absl::Seconds(1)));
  }
}

// Every slice at the shard's version once it reaches min_version, and the
// time waited.
struct Pulled {
  std::shared_ptr<const Shard::Weights> weights;
  absl::Duration waited;
};
absl::StatusOr<Pulled> Pull(Shard* shard, uint64_t job, int64_t min_version, absl::Time deadline,
                            const std::function<bool()>& cancelled) {
  const absl::Time start = absl::Now();
  using Found = std::shared_ptr<const Shard::Weights>;
  // The slices one by one: all at the shard's version, or looked at again.
  auto look = [&]() -> absl::StatusOr<std::optional<Found>> {
    while (true) {
      absl::StatusOr<std::optional<int64_t>> v = shard->TryVersion(job, min_version);
      if (!v.ok()) return v.status();
      if (!v->has_value()) return std::nullopt;
      auto weights = std::make_shared<Shard::Weights>();
      weights->version = **v;
      absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> slices = shard->Slices(job);
      if (!slices.ok()) return slices.status();
      weights->slices = *slices;
      bool one_version = true;
      for (int i = 0; i < static_cast<int>((*slices)->size()) && one_version; ++i) {
        absl::StatusOr<std::optional<Shard::PulledSlice>> s = shard->TryPullSlice(job, i, **v);
        if (!s.ok()) return s.status();
        one_version = s->has_value() && (*s)->version == **v;
        if (one_version) weights->values.push_back((*s)->value);
      }
      if (one_version) return Found(std::move(weights));
    }
  };
  absl::StatusOr<Found> weights = WaitFor<Found>(shard, min_version, deadline, cancelled, look);
  if (!weights.ok()) return weights.status();
  return Pulled{*std::move(weights), absl::Now() - start};
}

// Slice `slice` once it reaches min_version (Shard::TryPullSlice).
absl::StatusOr<Shard::PulledSlice> PullSlice(Shard* shard, uint64_t job, int slice,
                                             int64_t min_version, absl::Time deadline,
                                             const std::function<bool()>& cancelled) {
  return WaitFor<Shard::PulledSlice>(shard, min_version, deadline, cancelled,
                                     [&] { return shard->TryPullSlice(job, slice, min_version); });
}

// An asynchronous job's pull condition, waited for (Shard::TryClock).
absl::StatusOr<Shard::ClockGrant> WaitClock(Shard* shard, uint64_t job, int worker, int64_t clock,
                                            absl::Time deadline,
                                            const std::function<bool()>& cancelled) {
  return WaitFor<Shard::ClockGrant>(shard, clock, deadline, cancelled,
                                    [&] { return shard->TryClock(job, worker, clock); });
}

// The snapshot of `version` once taken (Shard::RequestSnapshot, then
// PollSnapshot until it gives one).
absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> SnapshotAt(
    Shard* shard, uint64_t job, int64_t version, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  using Found = std::shared_ptr<const Shard::Snapshot>;
  absl::StatusOr<Shard::SnapshotTicket> ticket = shard->RequestSnapshot(job, version);
  if (!ticket.ok()) return ticket.status();
  absl::Cleanup release = [&] { shard->ReleaseSnapshot(*ticket); };
  return WaitFor<Found>(shard, version, deadline, cancelled,
                        [&]() -> absl::StatusOr<std::optional<Found>> {
                          absl::StatusOr<Found> taken = shard->PollSnapshot(*ticket);
                          if (!taken.ok()) return taken.status();
                          if (*taken == nullptr) return std::nullopt;
                          return *std::move(taken);
                        });
}

class ShardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  }

  // The values at the shard's current version.
  std::vector<std::vector<float>> Current() {
    absl::StatusOr<Pulled> snap = Pull(&shard_, kJob, 0, Soon(), nullptr);
    EXPECT_TRUE(snap.ok()) << snap.status();
    return snap.ok() ? ValuesOf(*snap->weights) : std::vector<std::vector<float>>{};
  }

  PushResponse::Outcome MustPush(int worker, int64_t step, std::vector<std::vector<float>> grads) {
    absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, worker, step, std::move(grads));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : PushResponse::Outcome{};
  }

  Shard shard_;
};

// w - lr * mean(g0, g1), computed the way the shard must.
std::vector<std::vector<float>> SgdAfter(const std::vector<std::vector<float>>& w, float lr,
                                         const std::vector<std::vector<float>>& g0,
                                         const std::vector<std::vector<float>>& g1) {
  std::vector<std::vector<float>> out = w;
  for (size_t i = 0; i < w.size(); ++i) {
    for (size_t j = 0; j < w[i].size(); ++j) out[i][j] = w[i][j] - lr * ((g0[i][j] + g1[i][j]) / 2);
  }
  return out;
}

TEST_F(ShardTest, SlicesAndInitialPull) {
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> slices = shard_.Slices(kJob);
  ASSERT_TRUE(slices.ok()) << slices.status();
  ASSERT_EQ((*slices)->size(), 2u);
  EXPECT_EQ((**slices)[0].name(), "a");
  EXPECT_EQ((**slices)[1].name(), "b");

  absl::StatusOr<Pulled> snap = Pull(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->weights->version, 0);
  ASSERT_EQ(snap->weights->slices->size(), 2u);
  EXPECT_EQ(ValuesOf(*snap->weights), (std::vector<std::vector<float>>{kA, kB}));
}

// A push's first and last calls (each one lock of the shard; PushSlices
// between them once per part): BeginPush checks the job and the slices
// named and gives what the push needs; FinishPush counts the outcome and
// gives the version for the answer.
TEST_F(ShardTest, BeginPushAndFinishPush) {
  absl::StatusOr<Shard::PushStart> start = shard_.BeginPush(kJob, {1}, false, false);
  ASSERT_TRUE(start.ok()) << start.status();
  EXPECT_EQ(start->slices.get(), shard_.Slices(kJob)->get()) << "shared, not copied";
  EXPECT_EQ(start->indices, std::vector<int>{1});
  EXPECT_EQ(start->dtype, DT_FLOAT);
  EXPECT_FALSE(start->borrow) << "not asked for";
  EXPECT_EQ(start->buffers.size(), 1u);
  EXPECT_EQ(shard_.BeginPush(kJob, {}, false, false)->indices, (std::vector<int>{0, 1}));
  EXPECT_EQ(shard_.BeginPush(kJob + 1, {}, false, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(shard_.BeginPush(kJob, {2}, false, false).status().message(),
              HasSubstr("push names slice #2; the ps holds 2 slices"));
  EXPECT_THAT(shard_.BeginPush(kJob, {1, 1}, false, false).status().message(),
              HasSubstr("push names slice #1 twice"));

  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(1));
  EXPECT_EQ(shard_.FinishPush(PushResponse::STALE), 1);
  EXPECT_EQ(shard_.FinishPush(PushResponse::DUPLICATE), 1);
  EXPECT_EQ(shard_.FinishPush(PushResponse::ACCEPTED), 1);
  const Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.stale, 1);
  EXPECT_EQ(stats.duplicate, 1);
}

TEST_F(ShardTest, AveragesTwoWorkersWithSgd) {
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 0) << "one of two workers pushed: not applied yet";
  EXPECT_EQ(shard_.stats().applied, 0);
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{kA, kB}));

  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.version, 1);
  EXPECT_EQ(stats.applied, 1);
  const auto expected = SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3));
  EXPECT_EQ(Current(), expected);
  // Spot check by hand: a[0] = 1 - 0.5 * (1 - 3) / 2 = 1.5.
  EXPECT_EQ(Current()[0][0], 1.5f);

  // The sums start again from zero for the next step.
  EXPECT_EQ(MustPush(1, 1, Grads(2)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(0, 1, Grads(2)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 2);
  EXPECT_EQ(Current(), SgdAfter(expected, 0.5f, Grads(2), Grads(2)));
}

// A waiter hears which slice was applied, so that a pull waiting for
// another slice may sleep on; the apply that completes the version (and so
// changes what a pull of the version alone waits for) wakes everyone (-1).
TEST_F(ShardTest, WaitersHearTheSliceApplied) {
  std::vector<int> heard;  // under the shard's lock
  const int64_t id = shard_.AddWaiter([&](int slice) { heard.push_back(slice); });
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_TRUE(heard.empty()) << "nothing applied yet";
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(heard, (std::vector<int>{0, -1}));
  shard_.RemoveWaiter(id);
}

// The gradients an apply is done with are handed out again for later
// pushes (BeginPush), one per live worker and slice; pushes into them give
// the same weights as pushes of fresh memory.
TEST_F(ShardTest, GradientBuffersOfAnAppliedStepAreReused) {
  // The buffers BeginPush hands a push of `asked` (all slices: none named).
  auto buffers = [&](std::vector<int32_t> asked) {
    absl::StatusOr<Shard::PushStart> start = shard_.BeginPush(kJob, asked, false, false);
    EXPECT_TRUE(start.ok()) << start.status();
    return start.ok() ? std::move(start->buffers) : std::vector<std::vector<float>>{};
  };
  ASSERT_EQ(buffers({0}).size(), 1u);
  EXPECT_TRUE(buffers({0})[0].empty()) << "nothing applied yet";
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(-3));
  const auto expected = SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3));
  std::vector<std::vector<float>> both = buffers({});
  ASSERT_EQ(both.size(), 2u);
  std::vector<float> first = std::move(both[0]);
  EXPECT_EQ(first.size(), kA.size());
  EXPECT_EQ(both[1].size(), kB.size()) << "slice b's, of b's size";
  std::vector<float> second = std::move(buffers({0})[0]);
  EXPECT_EQ(second.size(), kA.size());
  EXPECT_TRUE(buffers({0})[0].empty()) << "one per live worker";
  EXPECT_EQ(buffers({1})[0].size(), kB.size());
  EXPECT_TRUE(buffers({1})[0].empty());
  // A push whose gradients stay borrowed gets none (nor does a skip push:
  // ShardSkipTest).
  EXPECT_TRUE(shard_.BeginPush(kJob, {}, false, /*borrow=*/true)->buffers.empty());
  // Stale contents written over: the next step is exact.
  std::vector<std::vector<float>> g0 = Grads(2), g1 = Grads(2);
  std::copy(g0[0].begin(), g0[0].end(), first.begin());
  std::copy(g1[0].begin(), g1[0].end(), second.begin());
  g0[0] = std::move(first);
  g1[0] = std::move(second);
  MustPush(0, 1, std::move(g0));
  MustPush(1, 1, std::move(g1));
  EXPECT_EQ(Current(), SgdAfter(expected, 0.5f, Grads(2), Grads(2)));
}

// The shard keeps no copy of its weights beside the values it publishes:
// each apply reads one version's and writes the next into the buffer of the
// version before that, once no reader holds it, so a slice's weights take
// two buffers however many steps run; a buffer a reader holds stays as it
// was and a new one is made instead.
TEST_F(ShardTest, EachApplyWritesIntoTheBufferOfTwoVersionsBefore) {
  // Weak references keep each value's memory from being allocated again, so
  // that equal addresses mean the same buffer, reused.
  std::vector<std::weak_ptr<const std::vector<float>>> seen;
  auto buffer_of = [&](int slice, int64_t version) -> const void* {
    absl::StatusOr<Shard::PulledSlice> p =
        PullSlice(&shard_, kJob, slice, version, Soon(), nullptr);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    seen.push_back(p->value);
    return p->value.get();
  };
  std::vector<std::vector<float>> w = {kA, kB};
  std::vector<std::vector<const void*>> buffers(2);  // [slice][version]
  for (int64_t version = 0; version < 5; ++version) {
    if (version > 0) {
      MustPush(0, version - 1, Grads(static_cast<float>(version)));
      MustPush(1, version - 1, Grads(-0.5f));
      w = SgdAfter(w, 0.5f, Grads(static_cast<float>(version)), Grads(-0.5f));
    }
    ASSERT_EQ(Current(), w) << "version " << version;
    for (int slice : {0, 1}) buffers[slice].push_back(buffer_of(slice, version));
  }
  for (int slice : {0, 1}) {
    SCOPED_TRACE(slice);
    EXPECT_NE(buffers[slice][1], buffers[slice][0]);
    for (int64_t version = 2; version < 5; ++version) {
      EXPECT_EQ(buffers[slice][version], buffers[slice][version - 2]) << "version " << version;
    }
  }
  // A reader holds version 5 through three more steps.
  MustPush(0, 4, Grads(1));
  MustPush(1, 4, Grads(1));
  w = SgdAfter(w, 0.5f, Grads(1), Grads(1));
  absl::StatusOr<Pulled> held = Pull(&shard_, kJob, 5, Soon(), nullptr);
  ASSERT_TRUE(held.ok()) << held.status();
  const void* held_a = held->weights->values[0].get();
  EXPECT_EQ(held_a, buffers[0][3]);
  for (int64_t step = 5; step < 8; ++step) {
    MustPush(0, step, Grads(2));
    MustPush(1, step, Grads(-1));
    EXPECT_NE(buffer_of(0, step + 1), held_a) << "version " << step + 1;
  }
  EXPECT_EQ(ValuesOf(*held->weights), w) << "a held version changed";
  for (int64_t step = 5; step < 8; ++step) w = SgdAfter(w, 0.5f, Grads(2), Grads(-1));
  EXPECT_EQ(Current(), w);
}

// Skips are a SKIP_STEP job's alone: in a FAIL job (the default) a skip
// push is refused at BeginPush, counted with the refused pushes; in a
// SKIP_STEP job it begins, with no buffers and nothing borrowed.
TEST(ShardSkipTest, ASkipPushBeginsOnlyInAJobThatSkipsSteps) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  absl::StatusOr<Shard::PushStart> refused = shard.BeginPush(kJob, {}, /*skip=*/true, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("runs on_nonfinite=FAIL"));
  EXPECT_EQ(shard.stats().refused_pushes, 1);
  EXPECT_TRUE(shard.BeginPush(kJob, {}, /*skip=*/false, false).ok());

  InitHeader skipping = Header(OptimizerConfig::SGD, 0.5f);
  skipping.mutable_job()->set_on_nonfinite(JobConfig::SKIP_STEP);
  ASSERT_TRUE(shard.Init(skipping, Values()).ok());
  for (bool borrow : {false, true}) {
    absl::StatusOr<Shard::PushStart> start = shard.BeginPush(kJob, {}, /*skip=*/true, borrow);
    ASSERT_TRUE(start.ok()) << start.status();
    EXPECT_TRUE(start->buffers.empty());
    EXPECT_FALSE(start->borrow);
  }
  EXPECT_EQ(shard.stats().refused_pushes, 0);
}

// --max_gradient_abs: a finite gradient holding a value of the bound or more
// in magnitude is refused and counted as a NaN is, through either check (the
// decoding sinks' and the shard's own); values below it apply.
TEST(ShardBoundTest, AGradientReachingMaxGradientAbsIsRefusedAndCounted) {
  Shard shard;
  InitHeader h = Header(OptimizerConfig::SGD, 0.5f);
  h.mutable_job()->set_max_gradient_abs(100);
  ASSERT_TRUE(shard.Init(h, Values()).ok());
  absl::StatusOr<Shard::PushStart> start = shard.BeginPush(kJob, {}, false, false);
  ASSERT_TRUE(start.ok()) << start.status();
  EXPECT_EQ(start->magnitude_limit, 100);  // what the sinks check while decoding
  for (float bad : {100.0f, -1e30f}) {
    std::vector<std::vector<float>> g = Grads(1);
    g[1][2] = bad;
    absl::StatusOr<PushResponse::Outcome> r = shard.Push(kJob, 0, 0, g);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("'b' from worker 0 at step 0 (or one reaching max_gradient_abs 100)"));
  }
  EXPECT_EQ(shard.stats().refused_pushes, 2);
  // Below the bound: applied.
  EXPECT_EQ(shard.Push(kJob, 0, 0, Grads(16)).value(), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.Push(kJob, 1, 0, Grads(-16)).value(), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
}

// A worker whose step was not finite pushes skips (--on_nonfinite=skip_step):
// the step passes with no update, optimizer state included, and the next
// step applies as usual.
TEST(ShardSkipTest, ASkippedStepKeepsValuesAndSlotsAndTheNextStepApplies) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::MOMENTUM, 0.5f), Values()).ok());
  auto push = [&](int worker, int64_t step, std::vector<Shard::SliceGradient> grads) {
    absl::StatusOr<PushResponse::Outcome> r =
        shard.PushSlices(kJob, worker, step, std::move(grads));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : PushResponse::Outcome{};
  };
  auto grads = [](float scale) {
    std::vector<std::vector<float>> g = Grads(scale);
    return std::vector<Shard::SliceGradient>{{0, g[0]}, {1, g[1]}};
  };
  const std::vector<Shard::SliceGradient> skip = {{0, {}, true}, {1, {}, true}};
  // Step 0: worker 0 has gradients, worker 1 skips.
  EXPECT_EQ(push(0, 0, grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(push(1, 0, skip), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
  EXPECT_EQ(shard.stats().skipped, 1);
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap =
      SnapshotAt(&shard, kJob, 1, Soon(), nullptr);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(ValuesOf(*(*snap)->weights), (std::vector<std::vector<float>>{kA, kB}));
  for (const auto& slice : (*snap)->slots) {
    for (const auto& slot : slice) {
      for (float v : slot) EXPECT_EQ(v, 0.0f) << "the momentum moved in a skipped step";
    }
  }
  // Step 1: both push; momentum starts from zero as if step 0 never was.
  EXPECT_EQ(push(0, 1, grads(2)), PushResponse::ACCEPTED);
  EXPECT_EQ(push(1, 1, grads(2)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 2);
  EXPECT_EQ(shard.stats().skipped, 1);
  absl::StatusOr<Pulled> pulled = Pull(&shard, kJob, 2, Soon(), nullptr);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  // Momentum's first step from zero velocity is plain SGD.
  EXPECT_EQ(ValuesOf(*pulled->weights), SgdAfter({kA, kB}, 0.5f, Grads(2), Grads(2)));
  // A skip with data, or a gradient without, is refused.
  EXPECT_TRUE(absl::IsInvalidArgument(
      shard.PushSlices(kJob, 0, 2, {{0, {1, 2, 3, 4, 5, 6}, true}}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(shard.PushSlices(kJob, 0, 2, {{0, {}, false}}).status()));
}

// A replica kept on a GPU publishes its state into its shard: the shard
// jumps to that version with those values and slots; a snapshot asked for
// that version in advance is taken, one of a version jumped over fails as
// a passed one does, and WantedSnapshot names what waits.
TEST(ShardMirrorTest, MirroredStateIsServedAtItsVersion) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::MOMENTUM, 0.5f, {0}), Values()).ok());
  EXPECT_EQ(shard.WantedSnapshot(0), std::nullopt);
  absl::StatusOr<Shard::SnapshotTicket> between = shard.RequestSnapshot(kJob, 3);
  absl::StatusOr<Shard::SnapshotTicket> at = shard.RequestSnapshot(kJob, 7);
  ASSERT_TRUE(between.ok() && at.ok());
  EXPECT_EQ(shard.WantedSnapshot(0), 3);
  EXPECT_EQ(shard.WantedSnapshot(4), 7);
  EXPECT_EQ(shard.WantedSnapshot(8), std::nullopt);

  std::vector<Shard::SliceValues> mirrored(2);
  mirrored[0].value = {6, 5, 4, 3, 2, 1};
  mirrored[0].slots = {{0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f}};
  mirrored[1].value = {-1, -2, -3, -4};
  mirrored[1].slots = {{1, 2, 3, 4}};
  ASSERT_TRUE(shard.Mirror(kJob, 7, mirrored).ok());
  EXPECT_EQ(shard.stats().version, 7);
  absl::StatusOr<Pulled> pulled = Pull(&shard, kJob, 7, Soon(), nullptr);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->weights->version, 7);
  EXPECT_EQ(ValuesOf(*pulled->weights),
            (std::vector<std::vector<float>>{mirrored[0].value, mirrored[1].value}));
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap = shard.PollSnapshot(*at);
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_NE(*snap, nullptr);
  EXPECT_EQ((*snap)->weights->version, 7);
  EXPECT_EQ((*snap)->slots[0][0], mirrored[0].slots[0]);
  EXPECT_EQ((*snap)->slots[1][0], mirrored[1].slots[0]);
  EXPECT_TRUE(absl::IsFailedPrecondition(shard.PollSnapshot(*between).status()));
  shard.ReleaseSnapshot(*between);
  shard.ReleaseSnapshot(*at);
  EXPECT_EQ(shard.WantedSnapshot(0), std::nullopt);

  // Behind the shard, another job, or the wrong sizes: refused, nothing changes.
  EXPECT_TRUE(absl::IsFailedPrecondition(shard.Mirror(kJob, 6, mirrored)));
  EXPECT_TRUE(absl::IsFailedPrecondition(shard.Mirror(kJob + 1, 8, mirrored)));
  std::vector<Shard::SliceValues> short_slot = mirrored;
  short_slot[1].slots[0].pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(shard.Mirror(kJob, 8, short_slot)));
  std::vector<Shard::SliceValues> no_slots = mirrored;
  no_slots[0].slots.clear();
  EXPECT_TRUE(absl::IsInvalidArgument(shard.Mirror(kJob, 8, no_slots)));
  EXPECT_TRUE(absl::IsInvalidArgument(shard.Mirror(kJob, 8, {mirrored[0]})));
  EXPECT_EQ(shard.stats().version, 7);

  // A shard with a push pending is not a mirror's.
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::MOMENTUM, 0.5f, {0, 1}), Values()).ok());
  ASSERT_TRUE(shard.Push(kJob, 0, 0, Grads(1)).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(shard.Mirror(kJob, 1, mirrored)));
}

// The chief holds workers' reports against the steps each ps received
// whole from them (PsState.pushed_steps): a push of some slices of a step
// does not count until the last one comes; an applied step stays counted;
// a new job starts over.
TEST(ShardPushedStepsTest, CountsStepsEveryOneOfWhoseSlicesCame) {
  Shard shard;
  InitHeader h = Header(OptimizerConfig::SGD, 0.5f);
  h.mutable_job()->set_num_workers(2);
  ASSERT_TRUE(shard.Init(h, Values()).ok());
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{-1, -1}));
  const std::vector<std::vector<float>> g = Grads(1);
  ASSERT_TRUE(shard.PushSlices(kJob, 0, 0, {{0, g[0]}}).ok());
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{-1, -1})) << "one slice of two";
  ASSERT_TRUE(shard.PushSlices(kJob, 1, 0, {{0, g[0]}}).ok());  // slice 0 applies
  ASSERT_TRUE(shard.PushSlices(kJob, 0, 0, {{1, g[1]}}).ok());
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{0, -1}));
  ASSERT_TRUE(shard.PushSlices(kJob, 1, 0, {{1, g[1]}}).ok());
  EXPECT_EQ(shard.state().version, 1);
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(shard.Push(kJob, 1, 1, Grads(1)).value(), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{0, 1}));
  ASSERT_TRUE(shard.Init(h, Values()).ok());
  EXPECT_EQ(shard.state().pushed_steps, (std::vector<int64_t>{-1, -1}));
}

TEST_F(ShardTest, StalePushIsDroppedAndCounted) {
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(1));
  const auto before = Current();
  EXPECT_EQ(MustPush(0, 0, Grads(100)), PushResponse::STALE);
  EXPECT_EQ(shard_.stats().stale, 1);
  EXPECT_EQ(shard_.stats().version, 1);
  // A stale push must not count toward step 1: worker 1 alone does not apply.
  EXPECT_EQ(MustPush(1, 1, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), before);
}

TEST_F(ShardTest, DuplicatePushIsIgnoredAndCounted) {
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(0, 0, Grads(64)), PushResponse::DUPLICATE);
  EXPECT_EQ(shard_.stats().duplicate, 1);
  EXPECT_EQ(shard_.stats().version, 0) << "a duplicate does not stand in for worker 1";
  EXPECT_EQ(MustPush(1, 0, Grads(-1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  // The duplicate's gradients were not added: the mean of g and -g is zero.
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{kA, kB}));
}

TEST_F(ShardTest, FuturePushFails) {
  absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 0, 1, Grads(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(shard_.stats().stale, 0);
}

TEST_F(ShardTest, WorkerNotLiveFails) {
  absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 2, 0, Grads(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("worker 2"));
  r = shard_.Push(kJob, -1, 0, Grads(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  // And it did not count as anyone's push.
  MustPush(0, 0, Grads(1));
  EXPECT_EQ(shard_.stats().version, 0);
}

TEST_F(ShardTest, WrongJobFails) {
  EXPECT_EQ(shard_.Slices(kJob + 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Pull(&shard_, kJob + 1, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shard_.Push(kJob + 1, 0, 0, Grads(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShardNoJobTest, EverythingFailsBeforeInit) {
  Shard shard;
  EXPECT_EQ(shard.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Pull(&shard, kJob, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shard.Push(kJob, 0, 0, Grads(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShardTest, WrongGradientSizeFails) {
  std::vector<std::vector<float>> g = Grads(1);
  g[1].push_back(1);
  absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 0, 0, g);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("'b'"));
  g = Grads(1);
  g.pop_back();
  EXPECT_EQ(shard_.Push(kJob, 0, 0, g).status().code(), absl::StatusCode::kInvalidArgument);
  // The rejected pushes did not mark worker 0 as done: its retry is accepted.
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(1, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(Current(), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1)));
}

TEST(ShardInitTest, RejectsBadInit) {
  Shard shard;
  std::vector<Shard::SliceValues> one = Values();
  one.pop_back();
  EXPECT_EQ(shard.Init(Header(OptimizerConfig::SGD, 0.5f), one).code(),
            absl::StatusCode::kInvalidArgument);

  std::vector<Shard::SliceValues> short_values = Values();
  short_values[0].value.pop_back();
  absl::Status s = shard.Init(Header(OptimizerConfig::SGD, 0.5f), short_values);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'a'"));

  std::vector<Shard::SliceValues> bad_slot = Values();
  bad_slot[1].slots = {{1, 2}};
  EXPECT_EQ(shard.Init(Header(OptimizerConfig::MOMENTUM, 0.5f), bad_slot).code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_EQ(shard.Init(Header(OptimizerConfig::SGD, 0.5f, {}), Values()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard.Init(Header(OptimizerConfig::SGD, 0.0f), Values()).code(),
            absl::StatusCode::kInvalidArgument);
  // None of these loaded a job.
  EXPECT_EQ(shard.Slices(kJob).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Batch norm's running statistics: a non-trainable slice takes no optimizer
// step (no weight decay, no slots) but the moving average of the statistics
// the live workers push for it, r = (1 - m) * r + m * mean(s_0, s_1), m
// being JobConfig.bn_momentum (0.1 by default); its trainable neighbour is
// stepped by the optimizer as ever.
TEST(ShardMovingAverageTest, NonTrainableSliceAveragesTheWorkersStatistics) {
  for (const float momentum : {0.0f, 0.1f, 0.5f}) {  // 0: unset, the default 0.1
    SCOPED_TRACE(momentum);
    const float m = momentum == 0 ? 0.1f : momentum;
    InitHeader h = Header(OptimizerConfig::ADAM, 0.5f);
    h.mutable_job()->mutable_optimizer()->set_weight_decay(0.25f);
    h.mutable_job()->set_bn_momentum(momentum);
    h.mutable_slice(1)->set_non_trainable(true);
    Shard shard;
    ASSERT_TRUE(shard.Init(h, Values()).ok());
    // Two steps of two workers' statistics for "b" (and gradients for "a").
    const std::vector<std::vector<std::vector<float>>> stats = {{{1.5f, 2, -4, 8}, {2.5f, 6, 4, 0}},
                                                                {{0, 3, 1, -1}, {2, 5, 7, 1}}};
    std::vector<float> want = kB;
    for (int step = 0; step < 2; ++step) {
      for (int w = 0; w < 2; ++w) {
        absl::StatusOr<PushResponse::Outcome> r =
            shard.Push(kJob, w, step, {Grads(1.0f + w)[0], stats[step][w]});
        ASSERT_TRUE(r.ok()) << r.status();
      }
      for (size_t i = 0; i < want.size(); ++i) {
        const float mean = (stats[step][0][i] + stats[step][1][i]) / 2;
        want[i] = (1 - m) * want[i] + m * mean;
      }
    }
    ASSERT_EQ(shard.stats().version, 2);
    absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap =
        SnapshotAt(&shard, kJob, 2, Soon(), nullptr);
    ASSERT_TRUE(snap.ok()) << snap.status();
    const std::vector<float>& b = *(*snap)->weights->values[1];
    ASSERT_EQ(b.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(b[i], want[i]) << "b[" << i << "]";
    if (m == 0.1f) {
      // By hand, in double: b[0] = 0.9 (0.9 * 10 + 0.1 * 2) + 0.1 * 1 = 8.38.
      EXPECT_NEAR(b[0], 8.38, 1e-5);
      EXPECT_NEAR(b[3], 0.9 * (0.9 * 40 + 0.1 * 4) + 0.1 * 0, 1e-5);
    }
    // Adam's slots of "b" stay at zero; "a" was stepped by Adam.
    ASSERT_EQ((*snap)->slot_names, (std::vector<std::string>{"m", "v"}));
    for (const std::vector<float>& slot : (*snap)->slots[1]) {
      EXPECT_EQ(slot, std::vector<float>(4, 0.0f));
    }
    EXPECT_NE(*(*snap)->weights->values[0], kA);
    EXPECT_NE((*snap)->slots[0][0], std::vector<float>(6, 0.0f));
  }
}

TEST(ShardMovingAverageTest, RejectsAMomentumOutsideZeroToOne) {
  for (const float bad : {-0.1f, 1.5f, std::nanf("")}) {
    InitHeader h = Header(OptimizerConfig::SGD, 0.5f);
    h.mutable_job()->set_bn_momentum(bad);
    Shard shard;
    absl::Status s = shard.Init(h, Values());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), HasSubstr("bn_momentum")) << bad;
  }
  InitHeader one = Header(OptimizerConfig::SGD, 0.5f);
  one.mutable_job()->set_bn_momentum(1);
  Shard shard;
  EXPECT_TRUE(shard.Init(one, Values()).ok()) << "1: the running statistic is the latest";
}

TEST(ShardInitTest, StartsAtTheHeaderVersion) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f, {3}, 7), Values()).ok());
  EXPECT_EQ(shard.stats().version, 7);
  EXPECT_EQ(shard.Push(kJob, 3, 6, Grads(1)).value(), PushResponse::STALE);
  EXPECT_EQ(shard.Push(kJob, 3, 7, Grads(1)).value(), PushResponse::ACCEPTED);
  // One live worker: applied at once.
  EXPECT_EQ(shard.stats().version, 8);
  absl::StatusOr<Pulled> snap = Pull(&shard, kJob, 8, Soon(), nullptr);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(ValuesOf(*snap->weights), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1)));
}

// Runs a waiting call of the shard (Pull or SnapshotAt) on another thread;
// `done` is notified when it returns.
template <typename T, absl::StatusOr<T> (*kCall)(Shard*, uint64_t, int64_t, absl::Time,
                                                 const std::function<bool()>&)>
class Async {
 public:
  Async(Shard* shard, uint64_t job, int64_t version, absl::Time deadline,
        std::function<bool()> cancelled = nullptr)
      : thread_([=, this] {
          result_ = kCall(shard, job, version, deadline, cancelled);
          done_.Notify();
        }) {}
  ~Async() { thread_.join(); }

  bool Done(absl::Duration wait) { return done_.WaitForNotificationWithTimeout(wait); }
  const absl::StatusOr<T>& result() {
    done_.WaitForNotification();
    return result_;
  }

 private:
  absl::Notification done_;
  absl::StatusOr<T> result_;
  std::thread thread_;  // last: starts after the members it uses exist
};
using AsyncPull = Async<Pulled, &Pull>;
using AsyncSnapshot = Async<std::shared_ptr<const Shard::Snapshot>, &SnapshotAt>;

TEST_F(ShardTest, PullBlocksUntilTheStepIsApplied) {
  AsyncPull pull(&shard_, kJob, 1, Soon());
  EXPECT_FALSE(pull.Done(absl::Milliseconds(50))) << "version 1 does not exist yet";
  MustPush(1, 0, Grads(1));
  EXPECT_FALSE(pull.Done(absl::Milliseconds(50))) << "worker 0 has not pushed yet";
  MustPush(0, 0, Grads(0.5f));
  ASSERT_TRUE(pull.Done(absl::Seconds(5)));
  ASSERT_TRUE(pull.result().ok()) << pull.result().status();
  EXPECT_EQ(pull.result()->weights->version, 1);
  EXPECT_EQ(ValuesOf(*pull.result()->weights), SgdAfter({kA, kB}, 0.5f, Grads(0.5f), Grads(1)));
  // It waited for the 100 ms of pushes above (less the time its thread took to start).
  EXPECT_GE(pull.result()->waited, absl::Milliseconds(40));
}

TEST_F(ShardTest, PullDeadline) {
  const absl::Time start = absl::Now();
  absl::StatusOr<Pulled> r = Pull(&shard_, kJob, 1, start + absl::Milliseconds(50), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // A version already reached is served even past the deadline.
  EXPECT_TRUE(Pull(&shard_, kJob, 0, absl::InfinitePast(), nullptr).ok());
}

TEST_F(ShardTest, PullCancelled) {
  int asked = 0;
  absl::StatusOr<Pulled> r = Pull(&shard_, kJob, 1, Soon(), [&] {
    ++asked;
    return true;
  });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled) << r.status();
  EXPECT_GE(asked, 1);
}

TEST_F(ShardTest, PullNoticesLateCancellation) {
  std::atomic<bool> cancel = false;
  AsyncPull pull(&shard_, kJob, 1, Soon(), [&] { return cancel.load(); });
  EXPECT_FALSE(pull.Done(absl::Milliseconds(50)));
  cancel = true;
  // Cancellation is polled at least once a second.
  ASSERT_TRUE(pull.Done(absl::Milliseconds(1500)));
  EXPECT_EQ(pull.result().status().code(), absl::StatusCode::kCancelled) << pull.result().status();
}

TEST_F(ShardTest, ShutdownWakesWaitingPull) {
  AsyncPull pull(&shard_, kJob, 1, Soon());
  EXPECT_FALSE(pull.Done(absl::Milliseconds(50)));
  shard_.Shutdown();
  ASSERT_TRUE(pull.Done(absl::Seconds(2))) << "Shutdown must wake the pull, not its 1 s poll";
  EXPECT_EQ(pull.result().status().code(), absl::StatusCode::kUnavailable)
      << pull.result().status();
  // Later calls fail the same way.
  EXPECT_EQ(Pull(&shard_, kJob, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(shard_.Push(kJob, 0, 0, Grads(1)).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(shard_.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(ShardTest, NewJobAbortsWaitingPull) {
  AsyncPull pull(&shard_, kJob, 1, Soon());
  EXPECT_FALSE(pull.Done(absl::Milliseconds(50)));
  InitHeader other = Header(OptimizerConfig::SGD, 0.5f);
  other.set_job_id(kJob + 1);
  ASSERT_TRUE(shard_.Init(other, Values()).ok());
  ASSERT_TRUE(pull.Done(absl::Seconds(2)));
  EXPECT_EQ(pull.result().status().code(), absl::StatusCode::kAborted) << pull.result().status();
  EXPECT_EQ(shard_.Push(kJob, 0, 0, Grads(1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(shard_.Slices(kJob + 1).ok());
}

TEST_F(ShardTest, ManyConcurrentPushesApplyEachStepOnce) {
  // Two workers push 50 steps each from their own threads, each waiting for
  // the previous version: every step must be applied exactly once.
  constexpr int kSteps = 50;
  auto worker = [&](int w) {
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(Pull(&shard_, kJob, step, Soon(), nullptr).ok());
      absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, w, step, Grads(w == 0 ? 1 : -1));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(*r, PushResponse::ACCEPTED);
    }
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.version, kSteps);
  EXPECT_EQ(stats.applied, kSteps);
  EXPECT_EQ(stats.stale + stats.duplicate, 0);
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{kA, kB})) << "g and -g average to zero";
}

// ---- One copy per version ----

TEST_F(ShardTest, PullsOfOneVersionShareOneCopy) {
  absl::StatusOr<Pulled> p1 = Pull(&shard_, kJob, 0, Soon(), nullptr);
  absl::StatusOr<Pulled> p2 = Pull(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(p1.ok()) << p1.status();
  ASSERT_TRUE(p2.ok()) << p2.status();
  ASSERT_NE(p1->weights, nullptr);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(p1->weights->values[i].get(), p2->weights->values[i].get())
        << "the second pull made its own copy";
  }
  // A pull of one slice, and a snapshot of that version, read the same copy.
  absl::StatusOr<Shard::PulledSlice> one = PullSlice(&shard_, kJob, 1, 0, Soon(), nullptr);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->value.get(), p1->weights->values[1].get());
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap =
      SnapshotAt(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ((*snap)->weights->values[0].get(), p1->weights->values[0].get());
  // So do pulls from many threads at once.
  std::vector<const std::vector<float>*> seen(8, nullptr);
  std::vector<std::thread> pullers;
  for (size_t t = 0; t < seen.size(); ++t) {
    pullers.emplace_back([&, t] {
      absl::StatusOr<Pulled> p = Pull(&shard_, kJob, 0, Soon(), nullptr);
      if (p.ok()) seen[t] = p->weights->values[0].get();
    });
  }
  for (std::thread& t : pullers) t.join();
  for (const std::vector<float>* w : seen) EXPECT_EQ(w, p1->weights->values[0].get());
  // The slice specs are shared with the shard, not copied per version.
  absl::StatusOr<std::shared_ptr<const std::vector<SliceSpec>>> slices = shard_.Slices(kJob);
  ASSERT_TRUE(slices.ok()) << slices.status();
  EXPECT_EQ(slices->get(), p1->weights->slices.get());

  // The next version is a new copy, shared again.
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(1));
  absl::StatusOr<Pulled> q1 = Pull(&shard_, kJob, 1, Soon(), nullptr);
  absl::StatusOr<Pulled> q2 = Pull(&shard_, kJob, 0, Soon(), nullptr);  // served at version 1
  ASSERT_TRUE(q1.ok()) << q1.status();
  ASSERT_TRUE(q2.ok()) << q2.status();
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(q1->weights->values[i].get(), p1->weights->values[i].get());
    EXPECT_EQ(q1->weights->values[i].get(), q2->weights->values[i].get());
  }
  EXPECT_EQ(q2->weights->version, 1);
}

TEST_F(ShardTest, APulledVersionIsNotChangedByLaterApplies) {
  absl::StatusOr<Pulled> p0 = Pull(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(p0.ok()) << p0.status();
  const std::vector<std::vector<float>> want0 = {kA, kB};
  ASSERT_EQ(ValuesOf(*p0->weights), want0);
  for (int64_t step : {0, 1}) {
    MustPush(0, step, Grads(1));
    MustPush(1, step, Grads(3));
  }
  ASSERT_EQ(shard_.stats().version, 2);
  EXPECT_EQ(p0->weights->version, 0);
  EXPECT_EQ(ValuesOf(*p0->weights), want0) << "an apply wrote into a published version";
  const auto want2 = SgdAfter(SgdAfter(want0, 0.5f, Grads(1), Grads(3)), 0.5f, Grads(1), Grads(3));
  EXPECT_EQ(Current(), want2);
  // A pull kept across a re-Init of the same job keeps its values too.
  std::vector<Shard::SliceValues> zeros = Values();
  for (auto& v : zeros) std::fill(v.value.begin(), v.value.end(), 0.0f);
  ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f), std::move(zeros)).ok());
  EXPECT_EQ(ValuesOf(*p0->weights), want0);
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{std::vector<float>(6, 0.0f),
                                                        std::vector<float>(4, 0.0f)}));
}

// ---- Non-finite gradients ----

TEST_F(ShardTest, NonFiniteGradientIsRefusedAndCounted) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    size_t slice, index;
    float bad;
    std::string name;
  };
  int64_t refused = 0;
  for (const Case& c : {Case{0, 0, nan, "'a'"}, Case{1, 3, inf, "'b'"}, Case{0, 5, -inf, "'a'"},
                        Case{1, 1, -nan, "'b'"}}) {
    SCOPED_TRACE(c.bad);
    std::vector<std::vector<float>> g = Grads(1);
    g[c.slice][c.index] = c.bad;
    absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 0, 0, g);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("non-finite gradient"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.name));
    EXPECT_EQ(shard_.stats().refused_pushes, ++refused);
  }
  // Nothing of them was kept: worker 0's good push is not a duplicate, and
  // the step is the mean of the two good pushes alone.
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3)));
  Shard::Stats stats = shard_.stats();
  EXPECT_EQ(stats.refused_pushes, 4);
  EXPECT_EQ(stats.duplicate + stats.stale, 0);
}

TEST_F(ShardTest, NonFiniteGradientOfTheLastWorkerDoesNotApply) {
  // The push that would complete the step is refused: no apply of NaN.
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  std::vector<std::vector<float>> g = Grads(1);
  g[1][2] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(shard_.Push(kJob, 1, 0, g).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(shard_.stats().applied, 0);
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{kA, kB}));
  // Refused whatever the step: a stale push with a NaN is refused, not dropped.
  EXPECT_EQ(MustPush(1, 0, Grads(1)), PushResponse::ACCEPTED);
  g[1][2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(shard_.Push(kJob, 1, 0, g).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.stats().stale, 0);
  EXPECT_EQ(shard_.stats().refused_pushes, 2);
  // Values next to the largest finite floats are accepted.
  g = Grads(1);
  g[0][0] = std::numeric_limits<float>::max();
  g[0][1] = -std::numeric_limits<float>::max();
  g[1][0] = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(MustPush(0, 1, g), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().refused_pushes, 2);
}

// ---- Live workers, snapshots, state ----

// w - lr * mean(grads), computed the way the shard must.
std::vector<std::vector<float>> SgdMean(const std::vector<std::vector<float>>& w, float lr,
                                        const std::vector<std::vector<std::vector<float>>>& grads) {
  std::vector<std::vector<float>> out = w;
  for (size_t i = 0; i < w.size(); ++i) {
    for (size_t j = 0; j < w[i].size(); ++j) {
      float sum = 0;
      for (const auto& g : grads) sum += g[i][j];
      out[i][j] = w[i][j] - lr * (sum / static_cast<float>(grads.size()));
    }
  }
  return out;
}

TEST_F(ShardTest, DroppingAWorkerThatHasNotPushedAppliesAtOnce) {
  EXPECT_EQ(MustPush(0, 0, Grads(2)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 0);
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0}, 1).ok());
  // Worker 0 already pushed: the step is applied by SetLiveWorkers itself,
  // with the mean over worker 0 alone (not halved).
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(shard_.stats().applied, 1);
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(2)}));
  EXPECT_EQ(shard_.state().live_workers, std::vector<int>{0});
  // From now on worker 0 alone completes each step.
  EXPECT_EQ(MustPush(0, 1, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 2);
  EXPECT_EQ(Current(), SgdMean(SgdMean({kA, kB}, 0.5f, {Grads(2)}), 0.5f, {Grads(1)}));
}

TEST_F(ShardTest, DroppingAWorkerThatHasNotPushedAppliesOnceTheOthersPush) {
  ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f, {0, 1, 2}), Values()).ok());
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1}, 0).ok());
  EXPECT_EQ(shard_.stats().version, 0) << "worker 1 has not pushed yet";
  EXPECT_EQ(shard_.state().live_workers, (std::vector<int>{0, 1}));
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  // The mean over the two remaining workers: divided by 2, not 3.
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(1), Grads(-3)}));
}

TEST_F(ShardTest, DroppingAWorkerThatPushedDiscardsItsGradient) {
  ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f, {0, 1, 2}), Values()).ok());
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(2, 0, Grads(64)), PushResponse::ACCEPTED);
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1}, 0).ok());
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(1), Grads(-3)}))
      << "worker 2's push must not count";

  // The dropped worker's later pushes fail, for the current step and the old one.
  absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 2, 1, Grads(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  r = shard_.Push(kJob, 2, 0, Grads(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(shard_.stats().stale, 0);
}

TEST_F(ShardTest, DroppingTheOnlyWorkerStillMissingAppliesWithTheOthers) {
  // Worker 1 pushed, worker 0 did not; dropping worker 1 (who pushed) with
  // worker 0 still missing leaves the step waiting for worker 0 alone.
  EXPECT_EQ(MustPush(1, 0, Grads(64)), PushResponse::ACCEPTED);
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0}, 0).ok());
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(1)}));
}

TEST_F(ShardTest, AddedWorkerCountsFromTheNextVersion) {
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1, 2}, 1).ok());
  // Step 0 still applies with workers 0 and 1 only.
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  const auto after0 = SgdMean({kA, kB}, 0.5f, {Grads(1), Grads(-3)});
  EXPECT_EQ(Current(), after0);
  EXPECT_EQ(shard_.state().live_workers, (std::vector<int>{0, 1, 2}));

  // Step 1 waits for worker 2 too.
  EXPECT_EQ(MustPush(0, 1, Grads(3)), PushResponse::ACCEPTED);
  EXPECT_EQ(MustPush(1, 1, Grads(3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1) << "worker 2 counts from version 1 on";
  EXPECT_EQ(Current(), after0);
  EXPECT_EQ(MustPush(2, 1, Grads(6)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 2);
  // Mean over three: (3 + 3 + 6) / 3 = 4.
  EXPECT_EQ(Current(), SgdMean(after0, 0.5f, {Grads(3), Grads(3), Grads(6)}));
  EXPECT_EQ(Current(), SgdMean(after0, 0.5f, {Grads(4)}));
}

TEST_F(ShardTest, AddedWorkerFromAVersionReachedCountsAtOnce) {
  for (int64_t from : {int64_t{0}, int64_t{-5}}) {
    SCOPED_TRACE(from);
    ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f, {0, 1}), Values()).ok());
    ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1, 2}, from).ok());
    EXPECT_EQ(shard_.state().live_workers, (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(MustPush(0, 0, Grads(3)), PushResponse::ACCEPTED);
    EXPECT_EQ(MustPush(1, 0, Grads(3)), PushResponse::ACCEPTED);
    EXPECT_EQ(shard_.stats().version, 0) << "worker 2 already counts for step 0";
    EXPECT_EQ(MustPush(2, 0, Grads(6)), PushResponse::ACCEPTED);
    EXPECT_EQ(shard_.stats().version, 1);
    EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(4)}));
  }
  // Also past the start: at version 7, from_version 3 is already reached.
  ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f, {0}, 7), Values()).ok());
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1}, 3).ok());
  EXPECT_EQ(MustPush(0, 7, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 7);
  EXPECT_EQ(MustPush(1, 7, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 8);
}

TEST_F(ShardTest, AJoiningWorkerKeepsItsVersionWhenAnotherIsDropped) {
  // The chief's sequence: worker 2 (re)joins from version 1 (RegisterWorker:
  // from max_version + 1), then worker 1 times out and the chief sends the
  // remaining set with from_version 0 (CheckWorkers). Worker 2 was told to
  // start at step 1 and never pushes for step 0, so step 0 must not wait for it.
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 1, 2}, 1).ok());
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0, 2}, 0).ok());
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1) << "step 0 waits for worker 2, who starts at step 1";
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(1)}));
}

TEST_F(ShardTest, SetLiveWorkersRejectsEmptySetAndOtherJob) {
  EXPECT_EQ(MustPush(0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.SetLiveWorkers(kJob, {}, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.SetLiveWorkers(kJob + 1, {0}, 0).code(), absl::StatusCode::kFailedPrecondition);
  // Neither changed anything: worker 0's push still stands, worker 1 still counts.
  EXPECT_EQ(shard_.state().live_workers, (std::vector<int>{0, 1}));
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(MustPush(1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(Current(), SgdMean({kA, kB}, 0.5f, {Grads(1), Grads(-3)}));

  Shard empty;
  EXPECT_EQ(empty.SetLiveWorkers(kJob, {0}, 0).code(), absl::StatusCode::kFailedPrecondition);
}

// Momentum 0.5, lr 0.5: buf = 0.5 buf + g; w -= 0.5 buf (exact in fp32 here).
InitHeader MomentumHeader(std::vector<int> workers) {
  InitHeader h = Header(OptimizerConfig::MOMENTUM, 0.5f, std::move(workers));
  h.mutable_job()->mutable_optimizer()->set_momentum(0.5f);
  return h;
}

struct MomentumState {
  std::vector<std::vector<float>> w, buf;
};
MomentumState MomentumStep(MomentumState s, const std::vector<std::vector<float>>& g) {
  for (size_t i = 0; i < s.w.size(); ++i) {
    for (size_t j = 0; j < s.w[i].size(); ++j) {
      s.buf[i][j] = 0.5f * s.buf[i][j] + g[i][j];
      s.w[i][j] -= 0.5f * s.buf[i][j];
    }
  }
  return s;
}
MomentumState MomentumStart() {
  return {{kA, kB}, {std::vector<float>(6, 0.0f), std::vector<float>(4, 0.0f)}};
}

void ExpectSnapshotIs(const Shard::Snapshot& snap, int64_t version, const MomentumState& want) {
  ASSERT_NE(snap.weights, nullptr);
  EXPECT_EQ(snap.weights->version, version);
  EXPECT_EQ(snap.slot_names, std::vector<std::string>{"momentum"});
  ASSERT_EQ(snap.weights->slices->size(), 2u);
  EXPECT_EQ((*snap.weights->slices)[0].name(), "a");
  EXPECT_EQ((*snap.weights->slices)[1].name(), "b");
  ASSERT_EQ(snap.weights->values.size(), 2u);
  ASSERT_EQ(snap.slots.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(*snap.weights->values[i], want.w[i]) << "slice " << i;
    ASSERT_EQ(snap.slots[i].size(), 1u);
    EXPECT_EQ(snap.slots[i][0], want.buf[i]) << "slice " << i;
  }
}

TEST_F(ShardTest, SnapshotOfTheCurrentVersionHasValuesAndSlots) {
  ASSERT_TRUE(shard_.Init(MomentumHeader({0, 1}), Values()).ok());
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s0 =
      SnapshotAt(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(s0.ok()) << s0.status();
  ExpectSnapshotIs(**s0, 0, MomentumStart());

  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(-3));
  MomentumState want = MomentumStep(MomentumStart(), Grads(-1));  // mean of 1 and -3
  MustPush(0, 1, Grads(2));
  MustPush(1, 1, Grads(4));
  want = MomentumStep(want, Grads(3));
  ASSERT_EQ(shard_.stats().version, 2);
  // Hand check of one element: a[0]: buf = -1, w = 1.5; buf = -0.5 + 3 = 2.5, w = 1.5 - 1.25.
  EXPECT_EQ(want.buf[0][0], 2.5f);
  EXPECT_EQ(want.w[0][0], 0.25f);

  // A deadline already past does not matter: the version is there.
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s2 =
      SnapshotAt(&shard_, kJob, 2, absl::InfinitePast(), nullptr);
  ASSERT_TRUE(s2.ok()) << s2.status();
  ExpectSnapshotIs(**s2, 2, want);
  ASSERT_EQ((*s2)->weights->values.size(), 2u);
  const auto pulled = Current();
  EXPECT_EQ(*(*s2)->weights->values[0], pulled[0]);
  EXPECT_EQ(*(*s2)->weights->values[1], pulled[1]);
}

TEST_F(ShardTest, SnapshotKeepsInitialSlots) {
  std::vector<Shard::SliceValues> v = Values();
  v[0].slots = {{1, 2, 3, 4, 5, 6}};
  v[1].slots = {{-1, -2, -3, -4}};
  ASSERT_TRUE(shard_.Init(MomentumHeader({0}), v).ok());
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s =
      SnapshotAt(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  ExpectSnapshotIs(**s, 0, MomentumState{{kA, kB}, {v[0].slots[0], v[1].slots[0]}});
}

TEST_F(ShardTest, SnapshotOfAFutureVersionWaitsAndIsExactlyThatVersion) {
  ASSERT_TRUE(shard_.Init(MomentumHeader({0}), Values()).ok());
  MustPush(0, 0, Grads(1));
  MomentumState want1 = MomentumStep(MomentumStart(), Grads(1));
  AsyncSnapshot snap(&shard_, kJob, 2, Soon());
  EXPECT_FALSE(snap.Done(absl::Milliseconds(50))) << "version 2 does not exist yet";
  // Steps 1 and 2 back to back: the snapshot must hold version 2, even if
  // its thread only wakes after version 3.
  MustPush(0, 1, Grads(2));
  MomentumState want2 = MomentumStep(want1, Grads(2));
  MustPush(0, 2, Grads(-4));
  MomentumState want3 = MomentumStep(want2, Grads(-4));
  ASSERT_TRUE(snap.Done(absl::Seconds(5)));
  ASSERT_TRUE(snap.result().ok()) << snap.result().status();
  ExpectSnapshotIs(**snap.result(), 2, want2);
  // Another step after it returned does not change it.
  MustPush(0, 3, Grads(8));
  ExpectSnapshotIs(**snap.result(), 2, want2);
  // The shard itself moved on.
  EXPECT_EQ(Current(), MomentumStep(want3, Grads(8)).w);
}

TEST_F(ShardTest, SnapshotOfAPastVersionFails) {
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(1));
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s =
      SnapshotAt(&shard_, kJob, 0, Soon(), nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_EQ(SnapshotAt(&shard_, kJob + 1, 1, Soon(), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Shard empty;
  EXPECT_EQ(SnapshotAt(&empty, kJob, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShardTest, SnapshotDeadline) {
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s =
      SnapshotAt(&shard_, kJob, 1, start + absl::Milliseconds(50), nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // Once reached, the same version can be asked for again and is served.
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(1));
  s = SnapshotAt(&shard_, kJob, 1, Soon(), nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ((*s)->weights->version, 1);
  EXPECT_EQ(*(*s)->weights->values[0], Current()[0]);
}

TEST_F(ShardTest, ShutdownWakesWaitingSnapshot) {
  AsyncSnapshot snap(&shard_, kJob, 1, Soon());
  EXPECT_FALSE(snap.Done(absl::Milliseconds(50)));
  shard_.Shutdown();
  ASSERT_TRUE(snap.Done(absl::Milliseconds(900)))
      << "Shutdown must wake the snapshot, not its 1 s poll";
  EXPECT_EQ(snap.result().status().code(), absl::StatusCode::kUnavailable)
      << snap.result().status();
  EXPECT_EQ(SnapshotAt(&shard_, kJob, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(ShardTest, TwoSnapshotsOfTheSameVersionBothGetIt) {
  // E.g. a chief that retries a Snapshot RPC while the first is still waiting.
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  AsyncSnapshot a(&shard_, kJob, 1, deadline);
  AsyncSnapshot b(&shard_, kJob, 1, deadline);
  EXPECT_FALSE(a.Done(absl::Milliseconds(50)));
  MustPush(0, 0, Grads(1));
  MustPush(1, 0, Grads(-3));
  const auto want = SgdMean({kA, kB}, 0.5f, {Grads(1), Grads(-3)});
  for (AsyncSnapshot* s : {&a, &b}) {
    ASSERT_TRUE(s->result().ok()) << s->result().status();
    EXPECT_EQ((*s->result())->weights->version, 1);
    EXPECT_EQ(*(*s->result())->weights->values[0], want[0]);
  }
}

TEST_F(ShardTest, CancelledSnapshotDoesNotKeepACopy) {
  // A cancelled snapshot must not leave its request behind: otherwise the
  // shard copies every value and slot when it reaches that version and keeps
  // the copy for good, and a later request for that (by then past) version
  // is served instead of refused.
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> s =
      SnapshotAt(&shard_, kJob, 1, Soon(), [] { return true; });
  EXPECT_EQ(s.status().code(), absl::StatusCode::kCancelled) << s.status();
  for (int64_t step : {0, 1}) {
    MustPush(0, step, Grads(1));
    MustPush(1, step, Grads(1));
  }
  ASSERT_EQ(shard_.stats().version, 2);
  s = SnapshotAt(&shard_, kJob, 1, Soon(), nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
}

TEST_F(ShardTest, ReplacingEveryLiveWorkerDoesNotStallTheStep) {
  // Workers 0 and 1 are gone; worker 2 replaces them from the next version.
  // Nobody is left to complete step 0 and worker 2 may not push for it, so
  // the shard would never reach version 1: SetLiveWorkers accepts the set and
  // lets worker 2 count for step 0.
  absl::Status s = shard_.SetLiveWorkers(kJob, {2}, 1);
  ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<PushResponse::Outcome> r = shard_.Push(kJob, 2, 0, Grads(1));
  ASSERT_TRUE(r.ok()) << r.status() << " (live workers: " << shard_.state().live_workers.size()
                      << "): nobody can complete step 0";
  EXPECT_EQ(shard_.stats().version, 1);
}

TEST(ShardStateTest, StateBeforeAndAfterInit) {
  Shard shard;
  Shard::State st = shard.state();
  EXPECT_FALSE(st.has_job);
  EXPECT_EQ(st.version, 0);
  EXPECT_TRUE(st.live_workers.empty());

  InitHeader h = Header(OptimizerConfig::ADAM, 0.125f, {5, 0, 3}, 4);
  h.mutable_job()->mutable_optimizer()->set_beta1(0.5f);
  h.mutable_job()->set_batch_size(32);
  ASSERT_TRUE(shard.Init(h, Values()).ok());
  st = shard.state();
  EXPECT_TRUE(st.has_job);
  EXPECT_EQ(st.job_id, kJob);
  EXPECT_EQ(st.version, 4);
  EXPECT_EQ(st.live_workers, (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(st.job.SerializeAsString(), h.job().SerializeAsString());
  EXPECT_EQ(st.job.optimizer().kind(), OptimizerConfig::ADAM);
  EXPECT_EQ(st.job.optimizer().beta1(), 0.5f);

  for (int w : {0, 3, 5}) ASSERT_TRUE(shard.Push(kJob, w, 4, Grads(1)).ok());
  EXPECT_EQ(shard.state().version, 5);
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {9, 3}, 5).ok());
  EXPECT_EQ(shard.state().live_workers, (std::vector<int>{3, 9}));
}

// ---- Optimizer ----

std::unique_ptr<Optimizer> MakeOptimizer(const OptimizerConfig& config) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(config);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? *std::move(opt) : nullptr;
}

std::unique_ptr<Optimizer> MakeOptimizer(OptimizerConfig::Kind kind, float learning_rate) {
  OptimizerConfig c;
  c.set_kind(kind);
  c.set_learning_rate(learning_rate);
  return MakeOptimizer(c);
}

TEST(OptimizerTest, Sgd) {
  std::unique_ptr<Optimizer> opt = MakeOptimizer(OptimizerConfig::SGD, 0.25f);
  ASSERT_NE(opt, nullptr);
  EXPECT_TRUE(opt->SlotNames().empty());
  std::vector<float> w = {1, 2}, g = {4, -8};
  opt->Apply(0, w.data(), g.data(), 2, {});
  EXPECT_EQ(w, (std::vector<float>{0, 4}));
}

TEST(OptimizerTest, MomentumMatchesTorch) {
  // torch.optim.SGD(momentum=0.9, lr=0.1): buf = 0.9 buf + g; w -= lr buf.
  OptimizerConfig c;
  c.set_kind(OptimizerConfig::MOMENTUM);
  c.set_learning_rate(0.1f);
  c.set_momentum(0.9f);
  std::unique_ptr<Optimizer> opt = MakeOptimizer(c);
  ASSERT_NE(opt, nullptr);
  ASSERT_EQ(opt->SlotNames(), (std::vector<std::string>{"momentum"}));
  float w = 1.0f, buf = 0.0f;
  const float grads[] = {1.0f, 0.5f, -1.0f};
  const double want_w[] = {0.9, 0.76, 0.734};
  const double want_buf[] = {1.0, 1.4, 0.26};
  for (int step = 0; step < 3; ++step) {
    opt->Apply(step, &w, &grads[step], 1, {&buf});
    EXPECT_NEAR(w, want_w[step], 1e-6) << "step " << step;
    EXPECT_NEAR(buf, want_buf[step], 1e-6) << "step " << step;
  }
}

TEST(OptimizerTest, MomentumDefaultsTo09) {
  std::unique_ptr<Optimizer> opt = MakeOptimizer(OptimizerConfig::MOMENTUM, 0.1f);
  ASSERT_NE(opt, nullptr);
  float w = 1.0f, buf = 1.0f, g = 0.0f;
  opt->Apply(0, &w, &g, 1, {&buf});
  EXPECT_NEAR(buf, 0.9, 1e-7);
}

TEST(OptimizerTest, AdamMatchesTorch) {
  // torch.optim.Adam(lr=0.1) (betas 0.9, 0.999, eps 1e-8 by default), one
  // weight starting at 1 with gradients 1, 0.5, -1; values from the torch
  // formulas in double precision:
  //   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
  //   w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
  std::unique_ptr<Optimizer> opt = MakeOptimizer(OptimizerConfig::ADAM, 0.1f);
  ASSERT_NE(opt, nullptr);
  ASSERT_EQ(opt->SlotNames(), (std::vector<std::string>{"m", "v"}));
  float w = 1.0f, m = 0.0f, v = 0.0f;
  const float grads[] = {1.0f, 0.5f, -1.0f};
  const double want_w[] = {0.900000001, 0.8067820382981611, 0.7957037312938717};
  const double want_m[] = {0.1, 0.14, 0.026};
  const double want_v[] = {0.001, 0.001249, 0.002247751};
  for (int step = 0; step < 3; ++step) {
    opt->Apply(step, &w, &grads[step], 1, {&m, &v});
    EXPECT_NEAR(w, want_w[step], 2e-6) << "step " << step;
    EXPECT_NEAR(m, want_m[step], 1e-6) << "step " << step;
    // 1 - 0.999f is 1.3e-5 off 0.001 in relative terms (as in torch's fp32).
    EXPECT_NEAR(v, want_v[step], want_v[step] * 2e-5) << "step " << step;
  }
}

TEST(OptimizerTest, AdamOnShardUsesTheVersionAsStep) {
  // Through the shard, the bias correction of the first applied step is t=1:
  // the first update is lr * sign(g) whatever g's size.
  Shard shard;
  InitHeader h = Header(OptimizerConfig::ADAM, 0.125f, {0});
  ASSERT_TRUE(shard.Init(h, Values()).ok());
  ASSERT_TRUE(shard.Push(kJob, 0, 0, Grads(3)).ok());
  absl::StatusOr<Pulled> snap = Pull(&shard, kJob, 1, Soon(), nullptr);
  ASSERT_TRUE(snap.ok()) << snap.status();
  const auto g = Grads(3);
  const std::vector<std::vector<float>> w0 = {kA, kB};
  for (size_t i = 0; i < w0.size(); ++i) {
    for (size_t j = 0; j < w0[i].size(); ++j) {
      const double sign = g[i][j] > 0 ? 1 : -1;
      EXPECT_NEAR((*snap->weights->values[i])[j], w0[i][j] - 0.125 * sign, 1e-5) << i << "," << j;
    }
  }
}

TEST(OptimizerTest, RejectsInvalidConfigs) {
  auto rejected = [](OptimizerConfig::Kind kind, float lr, float momentum = 0, float b1 = 0,
                     float b2 = 0, float eps = 0) {
    OptimizerConfig c;
    c.set_kind(kind);
    c.set_learning_rate(lr);
    c.set_momentum(momentum);
    c.set_beta1(b1);
    c.set_beta2(b2);
    c.set_epsilon(eps);
    absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(c);
    return !opt.ok() && opt.status().code() == absl::StatusCode::kInvalidArgument;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(rejected(OptimizerConfig::SGD, 0));
  EXPECT_TRUE(rejected(OptimizerConfig::SGD, -0.1f));
  EXPECT_TRUE(rejected(OptimizerConfig::SGD, nan));
  EXPECT_TRUE(rejected(OptimizerConfig::SGD, inf));
  EXPECT_TRUE(rejected(OptimizerConfig::MOMENTUM, 0.1f, 1.0f));
  EXPECT_TRUE(rejected(OptimizerConfig::MOMENTUM, 0.1f, -0.5f));
  EXPECT_TRUE(rejected(OptimizerConfig::MOMENTUM, 0.1f, nan));
  EXPECT_TRUE(rejected(OptimizerConfig::ADAM, 0.1f, 0, 1.0f));
  EXPECT_TRUE(rejected(OptimizerConfig::ADAM, 0.1f, 0, -0.1f));
  EXPECT_TRUE(rejected(OptimizerConfig::ADAM, 0.1f, 0, 0, 1.5f));
  EXPECT_TRUE(rejected(OptimizerConfig::ADAM, 0.1f, 0, 0, 0, -1e-8f));
  EXPECT_TRUE(rejected(OptimizerConfig::ADAM, 0.1f, 0, nan));
  EXPECT_TRUE(rejected(static_cast<OptimizerConfig::Kind>(7), 0.1f));
  // And the valid ones are accepted.
  EXPECT_FALSE(rejected(OptimizerConfig::SGD, 0.1f));
  EXPECT_FALSE(rejected(OptimizerConfig::MOMENTUM, 0.1f, 0.5f));
  EXPECT_FALSE(rejected(OptimizerConfig::ADAM, 0.1f, 0, 0.8f, 0.99f, 1e-7f));
}

// ---------------------------------------------------------------------------
// Parallel apply: the same pushes give bit-identical values and slots with one
// thread and with several, whatever the ranges.

// Slices of 1, 7, 64, 1000 and 4099 elements (the larger ones split into many
// ranges of 7, the last range short), three workers.
InitHeader ParallelHeader(OptimizerConfig::Kind kind) {
  InitHeader h;
  h.set_job_id(kJob);
  h.mutable_job()->mutable_optimizer()->set_kind(kind);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(0.03f);
  for (int w : {0, 1, 2}) h.add_live_workers(w);
  int index = 0;
  for (int64_t n : {1, 7, 64, 1000, 4099}) {
    SliceSpec* s = h.add_slice();
    s->set_name(absl::StrCat("s", index++));
    s->add_shape(n);
    s->set_row_end(n);
  }
  return h;
}

// Values with every bit of the mantissa in play (so a sum or product taken in
// another order or with another rounding would show), and random slots.
std::vector<std::vector<float>> RandomPerSlice(const InitHeader& h, std::mt19937& rng,
                                               float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<std::vector<float>> out;
  for (const SliceSpec& s : h.slice()) {
    out.emplace_back(s.shape(0));
    for (float& x : out.back()) x = dist(rng);
  }
  return out;
}

void ExpectBitIdentical(const std::vector<float>& a, const std::vector<float>& b,
                        const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << what << " element " << i << ": " << a[i] << " vs " << b[i];
  }
}

class ShardParallelApplyTest : public ::testing::TestWithParam<OptimizerConfig::Kind> {};

TEST_P(ShardParallelApplyTest, SameValuesAndSlotsAsTheSequentialApply) {
  const InitHeader header = ParallelHeader(GetParam());
  std::mt19937 rng(7);
  std::vector<Shard::SliceValues> init;
  for (auto& v : RandomPerSlice(header, rng, 1.0f)) init.push_back({std::move(v), {}});
  const std::vector<std::string> slot_names = Optimizer::SlotNames(GetParam());
  for (Shard::SliceValues& v : init) {  // slots that do not start at zero
    for (size_t k = 0; k < slot_names.size(); ++k) {
      v.slots.emplace_back(v.value.size());
      for (float& x : v.slots.back()) x = std::abs(std::normal_distribution<float>(0, 0.1f)(rng));
    }
  }

  ThreadPool pool(3);
  Shard sequential;                // one thread, one range per slice
  Shard split_ranges(nullptr, 7);  // one thread, ranges of 7
  Shard parallel(&pool, 7);        // four threads, ranges of 7
  Shard parallel_big(&pool);       // four threads, one range per slice
  Shard* shards[] = {&sequential, &split_ranges, &parallel, &parallel_big};
  for (Shard* shard : shards) ASSERT_TRUE(shard->Init(header, init).ok());

  constexpr int kSteps = 5;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::vector<std::vector<float>>> grads;
    for (int w = 0; w < 3; ++w) grads.push_back(RandomPerSlice(header, rng, 0.5f));
    for (Shard* shard : shards) {
      // The parallel shards see the pushes in another order: the sum must not depend on it.
      const bool reversed = shard == &parallel || shard == &parallel_big;
      for (int i = 0; i < 3; ++i) {
        const int w = reversed ? 2 - i : i;
        absl::StatusOr<PushResponse::Outcome> r = shard->Push(kJob, w, step, grads[w]);
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(*r, PushResponse::ACCEPTED);
      }
    }
  }

  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> want =
      SnapshotAt(&sequential, kJob, kSteps, Soon(), nullptr);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ((*want)->slots.size(), init.size());
  for (Shard* shard : shards) {
    SCOPED_TRACE(shard == &sequential     ? "sequential"
                 : shard == &split_ranges ? "split ranges"
                 : shard == &parallel     ? "parallel, split ranges"
                                          : "parallel");
    EXPECT_EQ(shard->stats().version, kSteps);
    absl::StatusOr<Pulled> pulled = Pull(shard, kJob, kSteps, Soon(), nullptr);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> got =
        SnapshotAt(shard, kJob, kSteps, Soon(), nullptr);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < init.size(); ++i) {
      EXPECT_EQ((*got)->weights->values[i], pulled->weights->values[i])
          << "a pull and a snapshot share one copy";
      // The values moved: the steps were applied, not skipped.
      EXPECT_NE(*pulled->weights->values[i], init[i].value);
      ExpectBitIdentical(*pulled->weights->values[i], *(*want)->weights->values[i],
                         absl::StrCat("value of slice ", i));
      ASSERT_EQ((*got)->slots[i].size(), slot_names.size());
      for (size_t k = 0; k < slot_names.size(); ++k) {
        ExpectBitIdentical((*got)->slots[i][k], (*want)->slots[i][k],
                           absl::StrCat(slot_names[k], " of slice ", i));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ShardParallelApplyTest,
                         ::testing::Values(OptimizerConfig::SGD, OptimizerConfig::MOMENTUM,
                                           OptimizerConfig::ADAM, OptimizerConfig::ADAMW,
                                           OptimizerConfig::ADAGRAD, OptimizerConfig::RMSPROP),
                         [](const ::testing::TestParamInfo<OptimizerConfig::Kind>& info) {
                           return OptimizerConfig::Kind_Name(info.param);
                         });

// Pulls waiting for the next version, on other threads, see all of a parallel
// apply, and a version pulled before it is left alone.
TEST(ShardParallelApplyContractTest, WaitingPullsSeeTheWholeApply) {
  const InitHeader header = ParallelHeader(OptimizerConfig::MOMENTUM);
  std::vector<Shard::SliceValues> init;
  for (const SliceSpec& s : header.slice()) init.push_back({std::vector<float>(s.shape(0), 1), {}});
  ThreadPool pool(2);
  Shard shard(&pool, 5);
  ASSERT_TRUE(shard.Init(header, init).ok());
  absl::StatusOr<Pulled> before = Pull(&shard, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(before.ok());

  std::vector<std::thread> pullers;
  std::vector<absl::StatusOr<Pulled>> pulled(4, absl::UnknownError("not run"));
  for (int t = 0; t < 4; ++t)
    pullers.emplace_back([&, t] { pulled[t] = Pull(&shard, kJob, 1, Soon(), nullptr); });
  for (int w = 0; w < 3; ++w) {
    std::vector<std::vector<float>> g;
    for (const SliceSpec& s : header.slice()) g.emplace_back(s.shape(0), 2.0f * (w + 1));
    ASSERT_TRUE(shard.Push(kJob, w, 0, std::move(g)).ok());
  }
  for (std::thread& t : pullers) t.join();
  // mean 4, momentum buffer 4, w = 1 - 0.03 * 4.
  const float want = 1.0f - 0.03f * 4.0f;
  for (const auto& p : pulled) {
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->weights->version, 1);
    for (const auto& v : p->weights->values) EXPECT_THAT(*v, ::testing::Each(::testing::Eq(want)));
  }
  for (const auto& v : before->weights->values)
    EXPECT_THAT(*v, ::testing::Each(::testing::Eq(1.0f)));
}

// ---------------------------------------------------------------- slice by slice

// Gradient `i` of Grads(scale), as a push of that slice alone.
std::vector<Shard::SliceGradient> SliceGrad(int i, float scale) { return {{i, Grads(scale)[i]}}; }

TEST_F(ShardTest, AppliesEachSliceOnceEveryWorkerPushedIt) {
  const std::vector<std::vector<float>> after = SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(2));
  ASSERT_TRUE(shard_.PushSlices(kJob, 0, 0, SliceGrad(1, 1)).ok());
  ASSERT_TRUE(shard_.PushSlices(kJob, 1, 0, SliceGrad(1, 2)).ok());
  // Slice b is applied; slice a waits for its pushes, and so does the shard's version.
  absl::StatusOr<Shard::PulledSlice> b = PullSlice(&shard_, kJob, 1, 1, Soon(), nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->version, 1);
  EXPECT_EQ(*b->value, after[1]);
  EXPECT_EQ(shard_.stats().version, 0);
  EXPECT_EQ(
      PullSlice(&shard_, kJob, 0, 1, absl::Now() + absl::Milliseconds(20), nullptr).status().code(),
      absl::StatusCode::kDeadlineExceeded);
  // A reader of the whole shard still sees version 0, b included.
  EXPECT_EQ(Current(), (std::vector<std::vector<float>>{kA, kB}));
  ASSERT_TRUE(shard_.PushSlices(kJob, 1, 0, SliceGrad(0, 2)).ok());
  ASSERT_TRUE(shard_.PushSlices(kJob, 0, 0, SliceGrad(0, 1)).ok());
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(shard_.stats().applied, 1);
  EXPECT_EQ(Current(), after) << "the same as whole pushes";
}

TEST_F(ShardTest, APullOfASliceWakesWhenThatSliceIsApplied) {
  absl::StatusOr<Shard::PulledSlice> got;
  absl::Time returned;
  std::thread puller([&] {
    got = PullSlice(&shard_, kJob, 0, 1, Soon(), nullptr);
    returned = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(50));  // the pull is waiting by now
  ASSERT_TRUE(shard_.PushSlices(kJob, 0, 0, SliceGrad(0, 1)).ok());
  ASSERT_TRUE(shard_.PushSlices(kJob, 1, 0, SliceGrad(0, 1)).ok());
  const absl::Time applied = absl::Now();
  puller.join();
  ASSERT_TRUE(got.ok()) << got.status();
  // Woken by the apply, not by the once-a-second look at cancellation.
  EXPECT_LT(returned - applied, absl::Milliseconds(500));
  EXPECT_EQ(got->version, 1);
  EXPECT_EQ(*got->value, SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1))[0]);
  EXPECT_EQ(shard_.stats().version, 0) << "slice b is not pushed yet";
}

TEST_F(ShardTest, RepeatedSlicesAreDuplicatesAndBadOnesRefusedWhole) {
  ASSERT_EQ(*shard_.PushSlices(kJob, 0, 0, SliceGrad(0, 1)), PushResponse::ACCEPTED);
  EXPECT_EQ(*shard_.PushSlices(kJob, 0, 0, SliceGrad(0, 64)), PushResponse::DUPLICATE);
  // Partly new: accepted; the slice already pushed keeps its first gradient.
  EXPECT_EQ(*shard_.PushSlices(kJob, 0, 0, {{0, Grads(64)[0]}, {1, Grads(1)[1]}}),
            PushResponse::ACCEPTED);
  // Named twice, out of range, wrong size: refused before anything is kept.
  EXPECT_EQ(shard_.PushSlices(kJob, 1, 0, {{0, Grads(1)[0]}, {0, Grads(1)[0]}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.PushSlices(kJob, 1, 0, {{0, Grads(1)[0]}, {2, Grads(1)[1]}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.PushSlices(kJob, 1, 0, {{0, Grads(1)[0]}, {1, Grads(1)[0]}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shard_.stats().version, 0) << "nothing of worker 1 was kept";
  EXPECT_EQ(PullSlice(&shard_, kJob, 2, 0, Soon(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(*shard_.PushSlices(kJob, 1, 0, {{1, Grads(1)[1]}, {0, Grads(1)[0]}}),
            PushResponse::ACCEPTED);
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1)));
}

TEST_F(ShardTest, ADroppedWorkerTakesItsSlicesAway) {
  ASSERT_TRUE(shard_.PushSlices(kJob, 1, 0, SliceGrad(0, 8)).ok());
  ASSERT_TRUE(shard_.PushSlices(kJob, 0, 0, SliceGrad(1, 1)).ok());
  // Dropping worker 1 completes slice b (worker 0 alone) but forgets 1's a.
  ASSERT_TRUE(shard_.SetLiveWorkers(kJob, {0}, 0).ok());
  absl::StatusOr<Shard::PulledSlice> b = PullSlice(&shard_, kJob, 1, 1, Soon(), nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(shard_.PushSlices(kJob, 0, 0, SliceGrad(0, 1)).ok());
  EXPECT_EQ(shard_.stats().version, 1);
  EXPECT_EQ(Current(), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1)))
      << "each slice is worker 0's gradient alone";
}

// A step that stays half applied (its workers stopped mid-push) still has
// an exact snapshot and a consistent pull of the version before it.
TEST(ShardHalfAppliedTest, SnapshotsAndPullsOfTheVersionBeforeAreExact) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::MOMENTUM, 0.5f), Values()).ok());
  // Step 0 in full, so that the momentum slots are not zero.
  ASSERT_TRUE(shard.Push(kJob, 0, 0, Grads(1)).ok());
  ASSERT_TRUE(shard.Push(kJob, 1, 0, Grads(1)).ok());
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> at1 =
      SnapshotAt(&shard, kJob, 1, Soon(), nullptr);
  ASSERT_TRUE(at1.ok()) << at1.status();
  // Step 1 applied to slice b only.
  ASSERT_TRUE(shard.PushSlices(kJob, 0, 1, SliceGrad(1, 2)).ok());
  ASSERT_TRUE(shard.PushSlices(kJob, 1, 1, SliceGrad(1, 2)).ok());
  absl::StatusOr<Shard::PulledSlice> b2 = PullSlice(&shard, kJob, 1, 2, Soon(), nullptr);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(b2->version, 2);
  EXPECT_NE(*b2->value, *(*at1)->weights->values[1]) << "slice b moved on";
  // Version 1 again, taken now: the same values and slots as when it was reached.
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> again =
      SnapshotAt(&shard, kJob, 1, Soon(), nullptr);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ValuesOf(*(*again)->weights), ValuesOf(*(*at1)->weights));
  EXPECT_EQ((*again)->slots, (*at1)->slots);
  // A pull asking for version 1 gets every slice at 1, b included.
  absl::StatusOr<Shard::PulledSlice> b1 = PullSlice(&shard, kJob, 1, 1, Soon(), nullptr);
  ASSERT_TRUE(b1.ok()) << b1.status();
  EXPECT_EQ(b1->version, 1);
  EXPECT_EQ(*b1->value, *(*at1)->weights->values[1]);
  // One asked for ahead is taken the moment the shard gets there.
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> at2;
  std::thread taker([&] { at2 = SnapshotAt(&shard, kJob, 2, Soon(), nullptr); });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(shard.PushSlices(kJob, 0, 1, SliceGrad(0, 2)).ok());
  ASSERT_TRUE(shard.PushSlices(kJob, 1, 1, SliceGrad(0, 2)).ok());
  taker.join();
  ASSERT_TRUE(at2.ok()) << at2.status();
  absl::StatusOr<Pulled> now = Pull(&shard, kJob, 2, Soon(), nullptr);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(ValuesOf(*(*at2)->weights), ValuesOf(*now->weights));
  EXPECT_EQ(SnapshotAt(&shard, kJob, 1, Soon(), nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "past it";
}

// An Init of the same job while a snapshot waits abandons it (it never
// waits out its deadline) and leaves later snapshots alone.
TEST_F(ShardTest, ASnapshotWaitingAcrossAReloadIsAborted) {
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> waiting;
  std::thread taker([&] { waiting = SnapshotAt(&shard_, kJob, 2, Soon(), nullptr); });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(shard_.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  taker.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kAborted) << waiting.status();
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> now =
      SnapshotAt(&shard_, kJob, 0, Soon(), nullptr);
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(ValuesOf(*(*now)->weights), (std::vector<std::vector<float>>{kA, kB}));
}

// Many workers push their slices in random orders and splits from their own
// threads, with an apply pool, for several steps: every version equals the
// sequential apply of whole pushes, bit for bit.
class ShardConcurrencyTest : public ::testing::TestWithParam<bool> {};

// With the parameter, slices are applied on an applier pool, after the
// pushes return.
TEST_P(ShardConcurrencyTest, SliceBySlicePushesMatchWholePushes) {
  constexpr int kWorkers = 4, kSteps = 20, kSlices = 12;
  InitHeader header;
  header.set_job_id(kJob);
  header.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::ADAM);
  header.mutable_job()->mutable_optimizer()->set_learning_rate(0.01f);
  for (int w = 0; w < kWorkers; ++w) header.add_live_workers(w);
  std::vector<Shard::SliceValues> init(kSlices);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1, 1);
  for (int i = 0; i < kSlices; ++i) {
    SliceSpec* s = header.add_slice();
    s->set_name(absl::StrCat("v", i));
    const int n = 1000 + 5000 * i;
    s->add_shape(n);
    s->set_row_end(n);
    for (int k = 0; k < n; ++k) init[i].value.push_back(uniform(rng));
  }
  // grads[step][worker][slice]
  std::vector<std::vector<std::vector<std::vector<float>>>> grads(kSteps);
  for (auto& step : grads) {
    step.resize(kWorkers);
    for (auto& worker : step) {
      for (int i = 0; i < kSlices; ++i) {
        worker.emplace_back(init[i].value.size());
        for (float& g : worker.back()) g = uniform(rng);
      }
    }
  }
  Shard whole;
  ASSERT_TRUE(whole.Init(header, init).ok());
  ThreadPool pool(3), appliers(2);
  Shard sliced(&pool, /*apply_range=*/4096, GetParam() ? &appliers : nullptr);
  ASSERT_TRUE(sliced.Init(header, init).ok());
  for (int step = 0; step < kSteps; ++step) {
    for (int w = 0; w < kWorkers; ++w) ASSERT_TRUE(whole.Push(kJob, w, step, grads[step][w]).ok());
    std::vector<std::thread> workers;
    for (int w = 0; w < kWorkers; ++w) {
      workers.emplace_back([&, w] {
        std::mt19937 order_rng(step * 100 + w);
        std::vector<int> order(kSlices);
        for (int i = 0; i < kSlices; ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), order_rng);
        for (size_t k = 0; k < order.size();) {  // pushes of 1 to 3 slices
          std::vector<Shard::SliceGradient> part;
          for (size_t end = std::min(order.size(), k + 1 + order_rng() % 3); k < end; ++k)
            part.push_back({order[k], grads[step][w][order[k]]});
          EXPECT_TRUE(sliced.PushSlices(kJob, w, step, std::move(part)).ok());
        }
      });
    }
    for (std::thread& t : workers) t.join();
    absl::StatusOr<Pulled> a = Pull(&whole, kJob, step + 1, Soon(), nullptr);
    absl::StatusOr<Pulled> b = Pull(&sliced, kJob, step + 1, Soon(), nullptr);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(b->weights->version, step + 1);
    ASSERT_EQ(ValuesOf(*a->weights), ValuesOf(*b->weights)) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Appliers, ShardConcurrencyTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "OnAnApplierPool" : "OnThePushingThreads";
                         });

// An asynchronous (or SSP) job of two workers and `train_steps` steps over
// the two slices of Header(), SGD with lr 0.5.
InitHeader AsyncHeader(JobConfig::Mode mode, int staleness = 0, int64_t train_steps = 100) {
  InitHeader h = Header(OptimizerConfig::SGD, 0.5f);
  h.mutable_job()->set_mode(mode);
  h.mutable_job()->set_staleness(staleness);
  h.mutable_job()->set_train_steps(train_steps);
  h.mutable_job()->set_num_workers(2);
  return h;
}

// w - lr * g.
std::vector<std::vector<float>> SgdStep(const std::vector<std::vector<float>>& w, float lr,
                                        const std::vector<std::vector<float>>& g) {
  std::vector<std::vector<float>> out = w;
  for (size_t i = 0; i < w.size(); ++i) {
    for (size_t j = 0; j < w[i].size(); ++j) out[i][j] = w[i][j] - lr * g[i][j];
  }
  return out;
}

// One worker's whole gradient as PushSlices takes it.
std::vector<Shard::SliceGradient> SliceGrads(const std::vector<std::vector<float>>& g) {
  std::vector<Shard::SliceGradient> out;
  for (size_t i = 0; i < g.size(); ++i) out.push_back({static_cast<int>(i), g[i]});
  return out;
}

absl::StatusOr<PushResponse::Outcome> PushAsync(Shard& shard, int worker, int64_t clock,
                                                int64_t read_version,
                                                const std::vector<std::vector<float>>& g) {
  return shard.PushSlices(kJob, worker, clock, SliceGrads(g), read_version);
}

std::vector<std::vector<float>> ValuesNow(Shard& shard) {
  absl::StatusOr<Pulled> p = Pull(&shard, kJob, 0, Soon(), nullptr);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? ValuesOf(*p->weights) : std::vector<std::vector<float>>{};
}

// Gradients borrowed from memory the pusher keeps (SliceGradient::borrowed,
// as the ps's service does with a worker's shared region): each is `g`'s
// values in `memory` (which must outlive the push), held by a token whose
// release is counted in `*released`.
std::vector<Shard::SliceGradient> Borrowed(const std::vector<std::vector<float>>& g,
                                           std::vector<std::vector<float>>* memory,
                                           std::shared_ptr<int>* released) {
  *memory = g;
  *released = std::make_shared<int>(0);
  std::vector<Shard::SliceGradient> out;
  for (size_t i = 0; i < g.size(); ++i) {
    Shard::SliceGradient& s = out.emplace_back();
    s.slice = static_cast<int>(i);
    s.borrowed.data = (*memory)[i].data();
    s.borrowed.count = static_cast<int64_t>((*memory)[i].size());
    s.borrowed.hold = std::shared_ptr<const void>(nullptr, [r = *released](const void*) { ++*r; });
  }
  return out;
}

// A synchronous shard applies borrowed gradients where they lie, with the
// same result as its own copies, and lets go of them (their holds) only
// once they are applied.
TEST(BorrowedGradientsTest, AreAppliedWhereTheyLieAndLetGoOnceApplied) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  EXPECT_TRUE(shard.BeginPush(kJob, {}, false, /*borrow=*/true)->borrow);
  std::vector<std::vector<float>> memory;
  std::shared_ptr<int> released;
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, Borrowed(Grads(1), &memory, &released)),
            PushResponse::ACCEPTED);
  EXPECT_EQ(*released, 0) << "kept until applied";
  ASSERT_EQ(*shard.PushSlices(kJob, 1, 0, SliceGrads(Grads(-3))), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
  EXPECT_EQ(*released, 2) << "one hold per slice, each let go at its apply";
  EXPECT_EQ(ValuesNow(shard), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3)));
  EXPECT_EQ(shard.stats().changed_after_check, 0);

  // Refused (a duplicate, a worker not in the job): let go at once.
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 1, Borrowed(Grads(2), &memory, &released)),
            PushResponse::ACCEPTED);
  std::vector<std::vector<float>> again;
  std::shared_ptr<int> released_again;
  EXPECT_EQ(*shard.PushSlices(kJob, 0, 1, Borrowed(Grads(2), &again, &released_again)),
            PushResponse::DUPLICATE);
  EXPECT_EQ(*released_again, 2);
  EXPECT_FALSE(shard.PushSlices(kJob, 7, 1, Borrowed(Grads(2), &again, &released_again)).ok());
  EXPECT_EQ(*released_again, 2);
  // A worker dropped mid-step: its kept gradients are let go with it.
  EXPECT_EQ(*released, 0);
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {1}, 1).ok());
  EXPECT_EQ(*released, 2);
}

// Borrowed values changed to a NaN (or an infinity) after the push was
// checked, as a worker writing into its region after sending it would:
// the apply reads them again, counts them as 0, and says so; the weights
// stay finite.
TEST(BorrowedGradientsTest, ValuesChangedAfterTheCheckNeverReachTheWeights) {
  Shard shard;
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  std::vector<std::vector<float>> memory;
  std::shared_ptr<int> released;
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, Borrowed(Grads(1), &memory, &released)),
            PushResponse::ACCEPTED);
  memory[0][2] = std::numeric_limits<float>::quiet_NaN();
  memory[1][1] = std::numeric_limits<float>::infinity();
  ASSERT_EQ(*shard.PushSlices(kJob, 1, 0, SliceGrads(Grads(1))), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
  EXPECT_EQ(shard.stats().changed_after_check, 2) << "one per slice";
  std::vector<std::vector<float>> expected = SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(1));
  expected[0][2] = kA[2];  // a mean of 0: no update
  expected[1][1] = kB[1];
  EXPECT_EQ(ValuesNow(shard), expected);
  // A borrowed gradient that is not finite when pushed is refused as ever.
  std::shared_ptr<int> released_bad;
  std::vector<std::vector<float>> bad_memory;
  std::vector<Shard::SliceGradient> bad = Borrowed(Grads(1), &bad_memory, &released_bad);
  bad_memory[1][3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(shard.PushSlices(kJob, 0, 1, std::move(bad)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*released_bad, 2);
}

// An asynchronous shard would keep a gradient until its round: it copies
// borrowed values at once and lets them go.
TEST(BorrowedGradientsTest, AnAsynchronousShardCopiesThem) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  EXPECT_FALSE(shard.BeginPush(kJob, {}, false, /*borrow=*/true)->borrow);
  ASSERT_EQ(*PushAsync(shard, 1, 0, 0, Grads(4)), PushResponse::ACCEPTED);
  std::vector<std::vector<float>> memory;
  std::shared_ptr<int> released;
  std::vector<Shard::SliceGradient> first = Borrowed(Grads(1), &memory, &released);
  first.pop_back();
  // Worker 0's slice a waits for its slice b, copied.
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, std::move(first), 0), PushResponse::ACCEPTED);
  EXPECT_EQ(*released, 2);
  memory[0].assign(memory[0].size(), 1000.0f);
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, {SliceGrads(Grads(1))[1]}, 0), PushResponse::ACCEPTED);
  EXPECT_EQ(ValuesNow(shard), SgdStep(SgdStep({kA, kB}, 0.5f, Grads(4)), 0.5f, Grads(1)));
}

// `g` through `dtype`: each value as the wire gives it back.
std::vector<std::vector<float>> Through(DataType dtype, const std::vector<std::vector<float>>& g) {
  std::vector<std::vector<float>> out;
  for (const std::vector<float>& v : g) {
    std::vector<uint16_t> wire(v.size());
    std::vector<float>& back = out.emplace_back(v.size());
    EncodeFloats(dtype, v.data(), static_cast<int64_t>(v.size()),
                 reinterpret_cast<char*>(wire.data()));
    DecodeFloats(dtype, reinterpret_cast<const char*>(wire.data()), static_cast<int64_t>(v.size()),
                 back.data());
  }
  return out;
}

// Borrowed 16-bit gradients (a bf16 or fp16 job's pushes in a shared
// region): `g` encoded in `dtype` into `memory`, as Borrowed does for fp32.
std::vector<Shard::SliceGradient> Borrowed16(DataType dtype,
                                             const std::vector<std::vector<float>>& g,
                                             std::vector<std::vector<uint16_t>>* memory,
                                             std::shared_ptr<int>* released) {
  memory->clear();
  *released = std::make_shared<int>(0);
  std::vector<Shard::SliceGradient> out;
  for (size_t i = 0; i < g.size(); ++i) {
    std::vector<uint16_t>& m = memory->emplace_back(g[i].size());
    EncodeFloats(dtype, g[i].data(), static_cast<int64_t>(g[i].size()),
                 reinterpret_cast<char*>(m.data()));
    Shard::SliceGradient& s = out.emplace_back();
    s.slice = static_cast<int>(i);
    s.borrowed.data = m.data();
    s.borrowed.count = static_cast<int64_t>(m.size());
    s.borrowed.dtype = dtype;
    s.borrowed.hold = std::shared_ptr<const void>(nullptr, [r = *released](const void*) { ++*r; });
  }
  return out;
}

// 16-bit gradients borrowed where they lie are widened as the apply reads
// them: the same weights as their decoded values, with fp32 and with other
// 16-bit pushes beside them; a value changed to an infinity after the check
// counts as 0; an asynchronous shard widens them into a copy at once.
TEST(BorrowedGradientsTest, SixteenBitOnesAreWidenedAsTheyAreApplied) {
  for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
    SCOPED_TRACE(DataType_Name(dtype));
    // Values the format rounds: the widening must give what decoding gives.
    const std::vector<std::vector<float>> g0 = {{1.001f, 2, -3.3f, 0.5f, 4.07f, -1},
                                                {-2, 0.2501f, 6.1f, 1}};
    Shard shard;
    ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
    std::vector<std::vector<uint16_t>> memory0, memory1;
    std::shared_ptr<int> released0, released1;
    ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, Borrowed16(dtype, g0, &memory0, &released0)),
              PushResponse::ACCEPTED);
    ASSERT_EQ(*shard.PushSlices(kJob, 1, 0, SliceGrads(Grads(-3))), PushResponse::ACCEPTED);
    EXPECT_EQ(*released0, 2);
    EXPECT_EQ(ValuesNow(shard), SgdAfter({kA, kB}, 0.5f, Through(dtype, g0), Grads(-3)));
    // Both workers borrowed; one value made infinite after the check.
    ASSERT_EQ(*shard.PushSlices(kJob, 0, 1, Borrowed16(dtype, g0, &memory0, &released0)),
              PushResponse::ACCEPTED);
    memory0[1][2] = dtype == DT_BFLOAT16 ? 0x7f80 : 0x7c00;
    ASSERT_EQ(*shard.PushSlices(kJob, 1, 1, Borrowed16(dtype, Grads(2), &memory1, &released1)),
              PushResponse::ACCEPTED);
    EXPECT_EQ(*released0 + *released1, 4);
    EXPECT_EQ(shard.stats().changed_after_check, 1);
    std::vector<std::vector<float>> expected =
        SgdAfter(SgdAfter({kA, kB}, 0.5f, Through(dtype, g0), Grads(-3)), 0.5f, Through(dtype, g0),
                 Through(dtype, Grads(2)));
    const std::vector<std::vector<float>> before = ValuesNow(shard);
    expected[1][2] = SgdAfter({kA, kB}, 0.5f, Through(dtype, g0), Grads(-3))[1][2];
    EXPECT_EQ(before, expected);
    // A 16-bit gradient that is not finite when pushed is refused.
    std::vector<Shard::SliceGradient> bad = Borrowed16(dtype, g0, &memory0, &released0);
    memory0[0][5] = dtype == DT_BFLOAT16 ? 0x7fc0 : 0x7e00;  // a NaN
    EXPECT_EQ(shard.PushSlices(kJob, 0, 2, std::move(bad)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(*released0, 2);

    Shard async;
    ASSERT_TRUE(async.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
    std::vector<Shard::SliceGradient> first = Borrowed16(dtype, g0, &memory0, &released0);
    first.pop_back();
    ASSERT_EQ(*async.PushSlices(kJob, 0, 0, std::move(first), 0), PushResponse::ACCEPTED);
    EXPECT_EQ(*released0, 2) << "copied and let go at once";
    memory0[0].assign(memory0[0].size(), 0);
    ASSERT_EQ(*async.PushSlices(kJob, 0, 0, {SliceGrads(Through(dtype, g0))[1]}, 0),
              PushResponse::ACCEPTED);
    EXPECT_EQ(ValuesNow(async), SgdStep({kA, kB}, 0.5f, Through(dtype, g0)));
  }
}

TEST(AsyncShardTest, AppliesEachWorkersGradientAloneAndCountsStaleness) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  // Worker 0's gradient is a step of its own: no waiting for worker 1.
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
  const auto after0 = SgdStep({kA, kB}, 0.5f, Grads(1));
  EXPECT_EQ(ValuesNow(shard), after0);
  // Worker 1 computed from version 0; applied at version 1: staleness 1.
  ASSERT_EQ(*PushAsync(shard, 1, 0, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 2);
  const auto after1 = SgdStep(after0, 0.5f, Grads(-3));
  EXPECT_EQ(ValuesNow(shard), after1);
  // Worker 0 pulls for its next step at once, and pushes again.
  absl::StatusOr<std::optional<Shard::ClockGrant>> grant = shard.TryClock(kJob, 0, 1);
  ASSERT_TRUE(grant.ok() && grant->has_value()) << grant.status();
  EXPECT_EQ((*grant)->version, 2);
  EXPECT_EQ((*grant)->clock, 1);
  EXPECT_EQ((*grant)->lag, 0);
  ASSERT_EQ(*PushAsync(shard, 0, 1, 2, Grads(2)), PushResponse::ACCEPTED);
  grant = shard.TryClock(kJob, 1, 1);
  ASSERT_TRUE(grant.ok() && grant->has_value());
  EXPECT_EQ((*grant)->lag, 1) << "worker 1's gradient was one version stale";
  // A pull for a clock this worker has not pushed yet waits (nullopt).
  grant = shard.TryClock(kJob, 1, 2);
  ASSERT_TRUE(grant.ok());
  EXPECT_FALSE(grant->has_value());
  Shard::State st = shard.state();
  EXPECT_EQ(st.clocks, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(st.lag_count, 3);
  EXPECT_EQ(st.lag_sum, 1);
  EXPECT_EQ(st.lag_max, 1);
  EXPECT_EQ(shard.stats().applied, 3);
}

TEST(AsyncShardTest, AWorkersGradientWaitsForAllItsSlicesAndIsCheckedByClock) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  std::vector<Shard::SliceGradient> first = {{0, Grads(1)[0]}};
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, first, 0), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 0) << "half of the gradient: nothing applied";
  EXPECT_EQ(*shard.PushSlices(kJob, 0, 0, first, 0), PushResponse::DUPLICATE);
  // The next step's push before this one is complete is out of order.
  absl::StatusOr<PushResponse::Outcome> ahead = PushAsync(shard, 0, 1, 0, Grads(1));
  EXPECT_TRUE(absl::IsFailedPrecondition(ahead.status())) << ahead.status();
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 0, {{1, Grads(1)[1]}}, 0), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 1);
  EXPECT_EQ(ValuesNow(shard), SgdStep({kA, kB}, 0.5f, Grads(1)));
  // A retry of the applied step is stale; a version from the future is refused.
  EXPECT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::STALE);
  EXPECT_TRUE(absl::IsInvalidArgument(PushAsync(shard, 0, 1, 7, Grads(1)).status()));
  // A forged pull for a worker outside the job.
  EXPECT_TRUE(absl::IsInvalidArgument(shard.TryClock(kJob, 5, 0).status()));
}

TEST(AsyncShardTest, SspHoldsAWorkerWithinTheBoundOfTheSlowest) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::SSP, /*staleness=*/1), Values()).ok());
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  // Clock 1 is one ahead of worker 1 (at 0): allowed.
  absl::StatusOr<std::optional<Shard::ClockGrant>> grant = shard.TryClock(kJob, 0, 1);
  ASSERT_TRUE(grant.ok() && grant->has_value());
  ASSERT_EQ(*PushAsync(shard, 0, 1, 1, Grads(1)), PushResponse::ACCEPTED);
  // Clock 2 would be two ahead: it waits for worker 1.
  grant = shard.TryClock(kJob, 0, 2);
  ASSERT_TRUE(grant.ok());
  EXPECT_FALSE(grant->has_value());
  absl::StatusOr<Shard::ClockGrant> waited =
      WaitClock(&shard, kJob, 0, 2, absl::Now() + absl::Milliseconds(200), nullptr);
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited.status())) << waited.status();
  ASSERT_EQ(*PushAsync(shard, 1, 0, 0, Grads(-1)), PushResponse::ACCEPTED);
  grant = shard.TryClock(kJob, 0, 2);
  ASSERT_TRUE(grant.ok() && grant->has_value());
  EXPECT_EQ(shard.state().clock_gap_max, 1);
  // A worker dropped from the job holds nobody back.
  ASSERT_EQ(*PushAsync(shard, 0, 2, 3, Grads(1)), PushResponse::ACCEPTED);
  grant = shard.TryClock(kJob, 0, 3);
  ASSERT_TRUE(grant.ok());
  EXPECT_FALSE(grant->has_value());
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {0}, 0).ok());
  grant = shard.TryClock(kJob, 0, 3);
  ASSERT_TRUE(grant.ok() && grant->has_value());
  // It comes back at once, at the clock of the slowest live worker.
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {0, 1}, 100).ok());
  EXPECT_EQ(shard.state().clocks, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(shard.state().live_workers, (std::vector<int>{0, 1}));
}

TEST(AsyncShardTest, SnapshotIsOneGradientVersion) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  absl::StatusOr<Shard::SnapshotTicket> ticket = shard.RequestSnapshot(kJob, 1);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  ASSERT_TRUE(PushAsync(shard, 0, 0, 0, Grads(1)).ok());
  ASSERT_TRUE(PushAsync(shard, 1, 0, 0, Grads(-3)).ok());
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap = shard.PollSnapshot(*ticket);
  ASSERT_TRUE(snap.ok() && *snap != nullptr) << snap.status();
  EXPECT_EQ((*snap)->weights->version, 1);
  EXPECT_EQ(ValuesOf(*(*snap)->weights), SgdStep({kA, kB}, 0.5f, Grads(1)));
  shard.ReleaseSnapshot(*ticket);
}

TEST(AsyncShardTest, StopsAtTheLastStep) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC, 0, /*train_steps=*/2), Values()).ok());
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  ASSERT_EQ(*PushAsync(shard, 1, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(*PushAsync(shard, 0, 1, 2, Grads(1)), PushResponse::STALE);
  EXPECT_EQ(shard.stats().version, 2);
  // Every pull is answered at once: there is nothing more to wait for.
  absl::StatusOr<std::optional<Shard::ClockGrant>> grant = shard.TryClock(kJob, 0, 5);
  ASSERT_TRUE(grant.ok() && grant->has_value());
  EXPECT_EQ((*grant)->version, 2);
}

TEST(AsyncShardTest, SspWithStalenessZeroIsSync) {
  Shard shard;
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::SSP, /*staleness=*/0), Values()).ok());
  ASSERT_EQ(*shard.Push(kJob, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  EXPECT_EQ(shard.stats().version, 0) << "waits for worker 1, as sync does";
  ASSERT_EQ(*shard.Push(kJob, 1, 0, Grads(-3)), PushResponse::ACCEPTED);
  EXPECT_EQ(ValuesNow(shard), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3)));
  EXPECT_TRUE(absl::IsFailedPrecondition(shard.TryClock(kJob, 0, 0).status()));
}

// An applier pool whose one thread is held until `go`: a gradient the shard
// hands it stays taken off the queue and not yet applied.
struct HeldAppliers {
  ThreadPool pool{1};
  absl::Notification go;
  HeldAppliers() {
    pool.Schedule([this] { go.WaitForNotification(); });
  }
  ~HeldAppliers() {
    if (!go.HasBeenNotified()) go.Notify();
  }
};

// Waits until the shard reaches `version` (the appliers run on their own thread).
void AwaitVersion(Shard& shard, int64_t version) {
  absl::StatusOr<Pulled> p = Pull(&shard, kJob, version, Soon(), nullptr);
  ASSERT_TRUE(p.ok()) << p.status();
}

TEST(AsyncShardTest, ARetryOfAGradientBeingAppliedIsNotTakenAgain) {
  HeldAppliers held;
  Shard shard(nullptr, Shard::kDefaultApplyRange, &held.pool, nullptr, /*inline_apply_floats=*/0);
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  // The answer was lost; the worker sends the push again while it is applied.
  EXPECT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::DUPLICATE);
  // A lane of it alone, too.
  EXPECT_EQ(*shard.PushSlices(kJob, 0, 0, {{0, Grads(1)[0]}}, 0), PushResponse::DUPLICATE);
  held.go.Notify();
  AwaitVersion(shard, 1);
  EXPECT_EQ(shard.stats().version, 1) << "one gradient, applied once";
  EXPECT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::STALE);
  // The next gradient is whole and only itself.
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 1, {{0, Grads(100)[0]}}, 1), PushResponse::ACCEPTED);
  ASSERT_EQ(*shard.PushSlices(kJob, 0, 1, {{1, Grads(100)[1]}}, 1), PushResponse::ACCEPTED);
  AwaitVersion(shard, 2);
  EXPECT_EQ(ValuesNow(shard), SgdStep(SgdStep({kA, kB}, 0.5f, Grads(1)), 0.5f, Grads(100)));
}

TEST(AsyncShardTest, ADroppedWorkersPullFailsInsteadOfWaiting) {
  HeldAppliers held;
  Shard shard(nullptr, Shard::kDefaultApplyRange, &held.pool, nullptr, /*inline_apply_floats=*/0);
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  ASSERT_EQ(*PushAsync(shard, 1, 0, 0, Grads(1)), PushResponse::ACCEPTED);  // being applied
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);  // queued
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {1}, 0).ok());  // worker 0 dropped with it
  held.go.Notify();
  AwaitVersion(shard, 1);
  absl::StatusOr<std::optional<Shard::ClockGrant>> grant = shard.TryClock(kJob, 0, 1);
  EXPECT_TRUE(absl::IsFailedPrecondition(grant.status())) << grant.status();
  EXPECT_EQ(shard.stats().version, 1) << "the dropped worker's queued gradient is not applied";
  // Back in the job, at the slowest live worker's clock (1): its pull says
  // so, and it pushes from there.
  ASSERT_TRUE(shard.SetLiveWorkers(kJob, {0, 1}, 0).ok());
  grant = shard.TryClock(kJob, 0, 0);
  ASSERT_TRUE(grant.ok() && grant->has_value()) << grant.status();
  EXPECT_EQ((*grant)->clock, 1);
  EXPECT_EQ(*PushAsync(shard, 0, 0, 1, Grads(1)), PushResponse::STALE);
  EXPECT_EQ(*PushAsync(shard, 0, 1, 1, Grads(1)), PushResponse::ACCEPTED);
  AwaitVersion(shard, 2);
}

TEST(AsyncShardTest, ASnapshotOfTheVersionBeingLeftIsTaken) {
  HeldAppliers held;
  Shard shard(nullptr, Shard::kDefaultApplyRange, &held.pool, nullptr, /*inline_apply_floats=*/0);
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  ASSERT_EQ(*PushAsync(shard, 0, 0, 0, Grads(1)), PushResponse::ACCEPTED);  // being applied
  absl::StatusOr<Shard::SnapshotTicket> ticket = shard.RequestSnapshot(kJob, 0);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  held.go.Notify();
  AwaitVersion(shard, 1);
  absl::StatusOr<std::shared_ptr<const Shard::Snapshot>> snap = shard.PollSnapshot(*ticket);
  ASSERT_TRUE(snap.ok() && *snap != nullptr) << snap.status();
  EXPECT_EQ((*snap)->weights->version, 0);
  EXPECT_EQ(ValuesOf(*(*snap)->weights), (std::vector<std::vector<float>>{kA, kB}));
  shard.ReleaseSnapshot(*ticket);
}

// With an applier pool, a slice of at most inline_apply_floats elements is
// applied on the thread of the push that completes it; a larger one waits
// for an applier.
TEST(ShardAppliersTest, SmallSlicesAreAppliedOnThePushersThread) {
  HeldAppliers held;
  // Slice "a" has 6 elements, "b" 4.
  Shard shard(nullptr, Shard::kDefaultApplyRange, &held.pool, nullptr, /*inline_apply_floats=*/4);
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  ASSERT_EQ(*shard.Push(kJob, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  ASSERT_EQ(*shard.Push(kJob, 1, 0, Grads(-3)), PushResponse::ACCEPTED);
  // The applier is held: "b" is applied all the same, "a" is not yet.
  absl::StatusOr<std::optional<Shard::PulledSlice>> b = shard.TryPullSlice(kJob, 1, 1);
  ASSERT_TRUE(b.ok() && b->has_value()) << "the small slice was applied by the push";
  EXPECT_EQ((*b)->version, 1);
  absl::StatusOr<std::optional<Shard::PulledSlice>> a = shard.TryPullSlice(kJob, 0, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->has_value()) << "the larger slice waits for the held applier";
  held.go.Notify();
  AwaitVersion(shard, 1);
  EXPECT_EQ(ValuesNow(shard), SgdAfter({kA, kB}, 0.5f, Grads(1), Grads(-3)));
}

// A waiter's wake may defer its work (common/deferred_work.h): the applier
// that applied the slice runs it once it has let go of the shard's lock, so
// the work may call the shard (under the lock it would deadlock).
TEST(ShardAppliersTest, WorkAWaiterDefersRunsOnTheApplierAfterTheLock) {
  ThreadPool appliers(1);
  Shard shard(nullptr, Shard::kDefaultApplyRange, &appliers, nullptr, /*inline_apply_floats=*/0);
  ASSERT_TRUE(shard.Init(Header(OptimizerConfig::SGD, 0.5f), Values()).ok());
  absl::Notification ran;
  std::atomic<bool> deferred{false};
  std::thread::id ran_on;
  absl::StatusOr<std::optional<Shard::PulledSlice>> pulled = absl::UnknownError("not run");
  const int64_t waiter = shard.AddWaiter([&](int slice) {
    if (slice != 0 || deferred) return;
    std::function<void()> work = [&] {
      pulled = shard.TryPullSlice(kJob, 0, 1);
      ran_on = std::this_thread::get_id();
      ran.Notify();
    };
    deferred = DeferredWork::Defer(work);
  });
  ASSERT_EQ(*shard.Push(kJob, 0, 0, Grads(1)), PushResponse::ACCEPTED);
  ASSERT_EQ(*shard.Push(kJob, 1, 0, Grads(-3)), PushResponse::ACCEPTED);
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  shard.RemoveWaiter(waiter);
  EXPECT_TRUE(deferred);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  ASSERT_TRUE(pulled.ok() && pulled->has_value()) << pulled.status();
  EXPECT_EQ((*pulled)->version, 1);
}

TEST(AsyncShardTest, WorkerIdsOutsideTheJobAreRefused) {
  Shard shard;
  InitHeader h = AsyncHeader(JobConfig::ASYNC);
  h.add_live_workers(7);
  EXPECT_TRUE(absl::IsInvalidArgument(shard.Init(h, Values())));
  ASSERT_TRUE(shard.Init(AsyncHeader(JobConfig::ASYNC), Values()).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(shard.SetLiveWorkers(kJob, {0, 2147483647}, 0)));
  EXPECT_TRUE(absl::IsInvalidArgument(shard.SetLiveWorkers(kJob, {-1}, 0)));
  EXPECT_EQ(shard.state().clocks.size(), 2u);
}

// `values` encoded as `dtype` (16-bit), as the wire carries them.
std::vector<uint16_t> Halves(DataType dtype, const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  EncodeFloats(dtype, values.data(), static_cast<int64_t>(values.size()),
               reinterpret_cast<char*>(out.data()));
  return out;
}

// With wire copies, a 16-bit job's published values come in its wire dtype
// too: from Init, then written by each apply (with a pool of ranges and
// without), equal to the value encoded; a reader keeps its copy while later
// versions reuse the buffers of older ones. Without them, or in an fp32
// job, there is none.
TEST(ShardWireCopiesTest, SixteenBitJobsPublishEachValueInTheWireDtypeToo) {
  ThreadPool pool(2);
  for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
    for (ThreadPool* apply_pool : {static_cast<ThreadPool*>(nullptr), &pool}) {
      SCOPED_TRACE(DataType_Name(dtype));
      Shard shard(apply_pool, /*apply_range=*/2);
      shard.SetWireCopies(true);
      InitHeader h = Header(OptimizerConfig::SGD, 0.3f);
      h.mutable_job()->set_wire_dtype(dtype == DT_BFLOAT16 ? JobConfig::BF16 : JobConfig::FP16);
      ASSERT_TRUE(shard.Init(h, Values()).ok());
      std::vector<Shard::PulledSlice> held;
      for (int64_t version = 0; version < 4; ++version) {
        if (version > 0) {
          for (int w : {0, 1}) {
            ASSERT_TRUE(shard.Push(kJob, w, version - 1, Grads(0.37f * (w + version))).ok());
          }
        }
        for (int slice : {0, 1}) {
          absl::StatusOr<Shard::PulledSlice> p =
              PullSlice(&shard, kJob, slice, version, Soon(), nullptr);
          ASSERT_TRUE(p.ok()) << p.status();
          ASSERT_EQ(p->version, version);
          ASSERT_NE(p->halves, nullptr) << "slice " << slice << " version " << version;
          EXPECT_EQ(p->halves_dtype, dtype);
          EXPECT_EQ(*p->halves, Halves(dtype, *p->value)) << "slice " << slice << " v" << version;
          held.push_back(*std::move(p));
        }
      }
      // What readers kept is what they were given.
      for (const Shard::PulledSlice& p : held) EXPECT_EQ(*p.halves, Halves(dtype, *p.value));
      held.clear();
      // Once let go, the buffers are reused: still equal afterwards.
      for (int64_t version = 4; version < 7; ++version) {
        for (int w : {0, 1}) ASSERT_TRUE(shard.Push(kJob, w, version - 1, Grads(0.5f)).ok());
        absl::StatusOr<Shard::PulledSlice> p = PullSlice(&shard, kJob, 0, version, Soon(), nullptr);
        ASSERT_TRUE(p.ok()) << p.status();
        EXPECT_EQ(*p->halves, Halves(dtype, *p->value)) << "version " << version;
      }
    }
  }
  for (const bool copies : {false, true}) {
    Shard shard;
    shard.SetWireCopies(copies);
    InitHeader h = Header(OptimizerConfig::SGD, 0.5f);
    if (!copies) h.mutable_job()->set_wire_dtype(JobConfig::BF16);
    ASSERT_TRUE(shard.Init(h, Values()).ok());
    for (int w : {0, 1}) ASSERT_TRUE(shard.Push(kJob, w, 0, Grads(1)).ok());
    absl::StatusOr<Shard::PulledSlice> p = PullSlice(&shard, kJob, 0, 1, Soon(), nullptr);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->halves, nullptr) << (copies ? "an fp32 job" : "a bf16 job without copies");
  }
}

}  // namespace
}  // namespace psflow::ps
