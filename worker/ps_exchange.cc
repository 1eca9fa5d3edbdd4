#include "worker/ps_exchange.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/exit_codes.h"
#include "common/fan_out.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "transport/tensor_chunks.h"

namespace psflow::worker {

absl::Status FromPs(const absl::Status& s, bool stopping) {
  if (!absl::IsCancelled(s) || stopping) return s;
  // Not cancelled here: the ps cancelled the call (it is going away).
  return absl::UnavailableError(absl::StrCat(s.message(), " (by the ps)"));
}

// One lane's part of a round of RunLanes. Its fields are the lane's thread's
// alone, but for `answered` (read by the last lane to count its push, after
// pushes_left orders it) and the atomics.
struct PsExchange::LaneRound {
  LanePull pull;
  bool pushed = false;   // its push was answered (or there is none)
  bool checked = false;  // its part of the verdict is in
  bool counted = false;  // its push counts for on_pushed
  bool pulled = false;   // its pull (beside the push) is done
  absl::Time answered;   // when its push was answered
  // Its push ended on a step that is not finite, rather than by the ps.
  std::atomic<bool> stopped{false};
  // Stops a pull beside a push that failed.
  std::atomic<bool> give_up{false};
};

// A round of RunLanes: what every lane shares.
struct PsExchange::Round {
  explicit Round(int n) : lanes(n) {}
  int64_t push_step = -1, min_version = 0;
  bool skip = false;
  const OnPushed* on_pushed = nullptr;
  StepVerdict* verdict = nullptr;
  // Pushing during the backward pass, a lane's push reads its gradients in
  // runs (ps::Client::PushInRuns), each once the backward pass has made it
  // final and it is checked: only finite ones leave.
  bool in_runs = false;
  // Pushing during the backward pass, a lane whose weights are staged on
  // the host (a GPU's) pulls before the verdict: the copies to the device
  // queue behind the step (and a step that is not finite ends the job).
  bool pull_early = false;
  // The client checks each run as it reads it, below this (the wire
  // dtype's overflow: a gradient it turns into infinity is as diverged as
  // one that already is).
  float overflow = std::numeric_limits<float>::infinity();
  PushHeader header;
  std::vector<LaneRound> lanes;
  std::atomic<int> pushes_left{0};
  // Until every lane's push is answered (or RunLanes returns): a stop
  // waits for them (StopAfterPushes).
  std::atomic<int> lanes_pushed{0};
};

PsExchange::PsExchange(PsExchangeOptions options, ExchangeHooks hooks, ps::Client* client,
                       PsExchangeBuffers buffers)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      client_(client),
      buffers_(std::move(buffers)) {}

PsExchange::~PsExchange() {
  // No upload may still read a region as the regions go.
  for (Lane& lane : lanes_) static_cast<void>(ReleaseHold(lane));
}

absl::StatusOr<std::unique_ptr<PsExchange>> PsExchange::Create(PsExchangeOptions options,
                                                               ExchangeHooks hooks,
                                                               ps::Client* client,
                                                               const Placement& placement,
                                                               PsExchangeBuffers buffers) {
  std::unique_ptr<PsExchange> x(
      new PsExchange(std::move(options), std::move(hooks), client, std::move(buffers)));
  PSFLOW_RETURN_IF_ERROR(x->MakeLanes(placement));
  return x;
}

absl::Status PsExchange::MakeLanes(const Placement& placement) {
  model::Network* const net = buffers_.net;
  // Pushes during the backward pass: where they apply, and the order in
  // which the backward pass completes the variables.
  push_early_ = options_.push_during_backward && (buffers_.in_place || !buffers_.buckets.empty());
  backward_pos_.assign(net->variables().size(), 0);
  const std::vector<int> order = net->BackwardOrder();
  for (size_t k = 0; k < order.size(); ++k) backward_pos_[order[k]] = static_cast<int>(k);
  if (push_early_ && buffers_.in_place) {
    net->SetGradientsReady([this](absl::Span<const int> done) {
      for (int v : done) grads_ready_.MarkReady(backward_pos_[v]);
    });
  }
  if (push_early_ && exchange_caller_ == nullptr)
    exchange_caller_ = std::make_unique<ThreadPool>(1);
  // Each ps's slices, cut into lanes of consecutive slices with about the
  // same bytes each: consecutive in the ps's order, or, pushing during the
  // backward pass, in the order the backward pass completes them (so that
  // each lane waits for one stretch of it). Variables whose gradients
  // become final together: a host bucket's (a GPU's), else each alone (a
  // CPU's, marked as its layer's backward ends).
  LanePlanOptions plan_options = options_.plan;
  plan_options.backward_pos = backward_pos_;
  plan_options.backward_order = push_early_;
  plan_options.bucket.assign(backward_pos_.size(), -1);
  for (size_t b = 0; b < buffers_.buckets.size(); ++b) {
    for (int v : buffers_.buckets[b]) plan_options.bucket[v] = static_cast<int>(b);
  }
  LanePlan plan = PlanLanes(placement, plan_options);
  slices_of_ = std::move(plan.slices_of);
  num_ps_ = placement.num_ps();
  const DataType wire = options_.dtype;
  for (int p = 0; p < placement.num_ps(); ++p) {
    std::vector<TensorSink> sinks = SliceSinks(placement, p, buffers_.weights, "", wire);
    std::vector<TensorRef> refs = buffers_.narrowed.empty()
                                      ? SliceRefs(placement, p, buffers_.grads, "", wire)
                                      : EncodedSliceRefs(placement, p, buffers_.narrowed, wire);
    for (LaneSpec& spec : plan.lanes) {
      if (spec.ps != p) continue;
      Lane& lane = lanes_.emplace_back();
      for (int i : spec.slices) {
        lane.sinks.push_back(std::move(sinks[i]));
        lane.refs.push_back(std::move(refs[i]));
      }
      lane.spec = std::move(spec);
    }
  }
  return PrepareUploads();
}

absl::Status PsExchange::PrepareUploads() {
  to_come_ = std::make_unique<std::atomic<int>[]>(slices_of_.size());
  // The pulls' regions are pinned for the GPU, and its uploads read them.
  const kernels::Backend::HostPinning pinning =
      buffers_.in_place ? kernels::Backend::HostPinning{} : buffers_.backend->host_pinning();
  borrow_pulls_ = options_.upload_from_shared_memory && pinning.pin != nullptr &&
                  !buffers_.upload_after.empty();
  if (ps::SharedMemoryClient* shared = client_->shared_memory(); borrow_pulls_ && shared) {
    shared->SetRegionPinning(pinning.pin, pinning.unpin);
  }
  const std::vector<VariableShape>& variable_shapes = buffers_.net->variables();
  for (Lane& lane : lanes_) {
    for (size_t i = 0; i < lane.sinks.size(); ++i) {
      const std::vector<int64_t>& shape = variable_shapes[lane.spec.variables[i]].shape;
      const int64_t row = shape.empty() ? 1 : NumElements(shape) / std::max<int64_t>(shape[0], 1);
      lane.first_float.push_back(lane.sinks[i].row_begin * row);
    }
    if (!borrow_pulls_) continue;
    lane.borrowed.assign(lane.sinks.size(), nullptr);
    for (size_t i = 0; i < lane.sinks.size(); ++i) lane.sinks[i].borrow = &lane.borrowed[i];
    absl::StatusOr<std::unique_ptr<kernels::Event>> event = buffers_.backend->CreateEvent();
    if (!event.ok()) return Permanent(event.status());
    lane.uploaded = *std::move(event);
  }
  // A lane's pull may wait for its own push, and pushing during the backward
  // pass for the step's verdict, which every lane's check is part of: every
  // lane needs a thread.
  pool_ = std::make_unique<ThreadPool>(std::max<int>(lanes_.size() - 1, 1));
  // Where weights are staged on the host and gradients pushed during the
  // backward pass, each lane's pull runs beside its push.
  if (push_early_ && !buffers_.in_place) {
    pullers_ = std::make_unique<ThreadPool>(static_cast<int>(lanes_.size()));
  }
  return absl::OkStatus();
}

absl::Status PsExchange::FromPs(const absl::Status& s) const {
  if (!absl::IsCancelled(s)) return s;
  return worker::FromPs(s, hooks_.stopping());
}

absl::Status PsExchange::Pull(int64_t min_version, ExchangeRound* out) {
  return RunLanes(/*push_step=*/-1, min_version, /*skip=*/false, nullptr, out);
}

void PsExchange::BeginStep(const StepPush& push, ExchangeRound* out) {
  if (!push_early_) return;
  // The lanes start now, on another thread, each pushing its gradients once
  // the backward pass has completed them (StepCopyingGradients or the
  // network's notifications mark them in grads_ready_); they pull (into
  // the network's own buffers on a CPU) once the training thread has found
  // the loss finite too (the verdict; on_pushed runs after it).
  early_ = true;
  SetStepQueued(false);
  grads_ready_.Reset(static_cast<int>(backward_pos_.size()));
  verdict_.Reset(static_cast<int>(lanes_.size()) + 1);
  exchanged_ = std::make_unique<absl::Notification>();
  exchange_caller_->Schedule([this, push, out] {
    exchange_status_ =
        RunLanes(push.push_step, push.min_version, /*skip=*/false, push.on_pushed, out, &verdict_);
    exchanged_->Notify();
  });
}

absl::Status PsExchange::StepQueued() {
  SetStepQueued(true);
  return absl::OkStatus();
}

void PsExchange::GradientsOnHost(const std::vector<int>& variables) {
  for (int v : variables) grads_ready_.MarkReady(backward_pos_[v]);
}

void PsExchange::EndCompute(const absl::StatusOr<double>& loss) {
  SetStepQueued(true);  // (if the step did not: it failed or ran otherwise)
  if (!early_) return;
  // After a failed step too, so that no lane waits for gradients that
  // never come; the verdict fails first, so that none of them pushes what
  // it then finds in its buffers. (The training thread's one mark of the
  // verdict; every path out of the step from here waits for the lanes.)
  if (!loss.ok()) verdict_.Mark(false);
  grads_ready_.MarkAllReady();
}

void PsExchange::Abandon() {
  if (!early_) return;
  early_ = false;
  exchanged_->WaitForNotification();
}

absl::Status PsExchange::PushStep(const StepPush& push, StepVerdictKind* verdict,
                                  ExchangeRound* out) {
  if (early_) {
    early_ = false;
    verdict_.Mark(std::isfinite(push.loss));
    TraceSpan after_span(options_.trace, "exchange after the pass", push.step);
    exchanged_->WaitForNotification();
    after_span.End();
    // Lanes stopped by a signal or by the chief's FAIL leave the verdict
    // failed too, or without their parts: the caller ends on those.
    if (hooks_.stopping()) {
      *verdict = StepVerdictKind::kInterrupted;
      return exchange_status_;
    }
    if (!verdict_.Wait()) {
      *verdict = StepVerdictKind::kNotFiniteAfterPushes;
      return absl::OkStatus();
    }
    *verdict = StepVerdictKind::kFinite;
    return exchange_status_;
  }
  // Each lane's slices are checked on the pool, as the pushes will go.
  std::vector<char> finite_on(lanes_.size(), 1);
  FanOut(pool_.get(), static_cast<int>(lanes_.size()), RetryPolicy(), [&](int l) {
    finite_on[l] = LaneFinite(l);
    return absl::OkStatus();
  }).IgnoreError();  // the calls cannot fail
  const bool finite = std::isfinite(push.loss) && std::isfinite(push.mean_loss) &&
                      std::all_of(finite_on.begin(), finite_on.end(), [](char f) { return f; });
  const bool skip = !finite && options_.skip_nonfinite;
  if (!finite && !skip) {
    *verdict = StepVerdictKind::kNotFinite;
    return absl::OkStatus();
  }
  if (skip) {
    PSLOG(WARNING) << "step " << push.step << ": the loss (" << push.loss
                   << ") or the gradients are not finite (in the wire dtype); skipping the step";
  }
  *verdict = skip ? StepVerdictKind::kSkipped : StepVerdictKind::kFinite;
  return RunLanes(push.push_step, push.min_version, skip, push.on_pushed, out);
}

absl::Status PsExchange::RunLanes(int64_t push_step, int64_t min_version, bool skip,
                                  const OnPushed& on_pushed, ExchangeRound* out,
                                  StepVerdict* verdict) {
  const int n = static_cast<int>(lanes_.size());
  for (size_t v = 0; v < slices_of_.size(); ++v) to_come_[v].store(slices_of_[v]);
  Round round(n);
  round.push_step = push_step;
  round.min_version = min_version;
  round.skip = skip;
  round.on_pushed = &on_pushed;
  round.verdict = verdict;
  round.in_runs = verdict != nullptr && !skip;
  round.pull_early = verdict != nullptr && !buffers_.in_place;
  round.overflow = GradientLimit();
  round.header.set_job_id(job_id());
  round.header.set_worker(options_.push_worker);
  round.header.set_step(push_step);
  round.header.set_skip(skip);
  for (LaneRound& r : round.lanes) r.pushed = push_step < 0;
  round.pushes_left = push_step < 0 ? 0 : n;
  if (push_step >= 0) hooks_.open_pushes();
  absl::Cleanup close_pushes = [&] {
    if (push_step >= 0 && round.lanes_pushed.load() < n) hooks_.close_pushes();
  };
  RetryPolicy policy;
  policy.give_up = absl::Now() + options_.startup_timeout;
  // Told to stop once the pushes are answered: a push that failed (its ps
  // stopped) is not tried again.
  policy.stop = [this] { return hooks_.stopping() || hooks_.stop_pending(); };
  PSFLOW_RETURN_IF_ERROR(FanOut(pool_.get(), n, policy, [&](int l) { return RunLane(round, l); }));
  if (verdict != nullptr && !verdict->Wait()) return absl::OkStatus();  // nothing pulled
  return Collect(round, out);
}

absl::Status PsExchange::RunLane(Round& round, int l) {
  LaneRound& r = round.lanes[l];
  StepVerdict* const verdict = round.verdict;
  if (!r.pushed && verdict != nullptr && !round.in_runs && !r.checked) {
    absl::StatusOr<bool> push = CheckBeforePush(round, l);
    if (!push.ok()) return push.status();
    if (!*push) return absl::OkStatus();  // the caller ends the step
  }
  if (!r.pushed) {
    PSFLOW_RETURN_IF_ERROR(PushLane(round, l));
    if (r.stopped) return absl::OkStatus();  // not finite: the caller ends the step
  }
  if (!round.pull_early) {
    // No pull, nor the step's metrics, before the whole step is known finite.
    if (verdict != nullptr && !verdict->Wait()) return absl::OkStatus();
    if (!r.counted && round.push_step >= 0) CountPush(round, l);
    return PullLane(l, round.min_version, nullptr, &r.pull);
  }
  if (!r.pulled) PSFLOW_RETURN_IF_ERROR(PullLane(l, round.min_version, verdict, &r.pull));
  if (!verdict->Wait()) return absl::OkStatus();
  if (!r.counted) CountPush(round, l);
  return absl::OkStatus();
}

absl::StatusOr<bool> PsExchange::CheckBeforePush(Round& round, int l) {
  // Pushing during the backward pass: once the lane's gradients are final
  // (and on the host), check them; only finite ones leave. A verdict that
  // failed already (another lane, or a step that failed and released every
  // piece without writing it) sends nothing more.
  bool ready = false;
  const bool finite = WaitAndMark(round, l, &ready);
  if (!ready && hooks_.stopping()) return absl::CancelledError("stopping");
  return finite;
}

bool PsExchange::WaitAndMark(Round& round, int l, bool* ready) {
  const Lane& lane = lanes_[l];
  StepVerdict* const verdict = round.verdict;
  round.lanes[l].checked = true;
  *ready =
      grads_ready_.WaitReady(lane.spec.first_piece, lane.spec.last_piece, absl::InfiniteFuture(),
                             [&] { return hooks_.stopping() || verdict->Failed(); });
  const bool finite = *ready && !verdict->Failed() && LaneFinite(l);
  verdict->Mark(finite);
  return finite;
}

absl::Status PsExchange::PushLane(Round& round, int l) {
  LaneRound& r = round.lanes[l];
  // Where weights are staged on the host, the lane's pull runs beside its
  // push from the start: each slice comes as soon as the ps applied it.
  // `give_up` stops a pull whose push failed (it asks again at least every
  // 100 ms while the verdict is open).
  absl::Notification pull_done;
  absl::Status pull_status;
  const bool beside = round.pull_early && round.in_runs && pullers_ != nullptr && !r.pulled;
  if (beside) {
    r.give_up = false;
    pullers_->Schedule([&, l] {
      pull_status = PullLane(l, round.min_version, round.verdict, &r.pull, &r.give_up);
      pull_done.Notify();
    });
  }
  const absl::Status pushed = FromPs(SendPush(round, l).status());
  // The push ended before its last run (the ps answered first): the lane's
  // part of the verdict is still owed, or the step would wait for it.
  if (round.in_runs && !r.checked) MarkOwed(round, l);
  if (!pushed.ok() && beside) {
    r.give_up = true;
    pull_done.WaitForNotification();
    // A pull that ended first needed this push: it arrived after all (its
    // answer was lost), and the pull's copies to the device are done; the
    // retry's push is a duplicate and pulls nothing again.
    if (pull_status.ok() && r.pull.version >= 0) r.pulled = true;
  }
  if (r.stopped) {
    if (hooks_.stopping()) return absl::CancelledError("stopping");
    return absl::OkStatus();  // not finite: the caller ends the step
  }
  if (!pushed.ok()) {
    if (IsRetryable(pushed) && !hooks_.stop_pending()) {
      PSLOG(WARNING) << "retrying: " << pushed.message() << " ("
                     << absl::StatusCodeToString(pushed.code()) << ")";
    }
    return pushed;
  }
  r.answered = absl::Now();
  r.pushed = true;
  if (round.lanes_pushed.fetch_add(1) + 1 == static_cast<int>(round.lanes.size())) {
    hooks_.close_pushes();
  }
  if (beside) {
    pull_done.WaitForNotification();
    PSFLOW_RETURN_IF_ERROR(pull_status);
    r.pulled = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<PushResponse> PsExchange::SendPush(Round& round, int l) {
  const Lane& lane = lanes_[l];
  // A retried push that had arrived after all is answered DUPLICATE (or
  // STALE once applied): either way the ps has this worker's gradients.
  PushHeader header = round.header;
  for (int i : lane.spec.slices) header.add_slices(i);
  if (options_.async) header.set_read_version(ps_versions_[lane.spec.ps]);
  // A push in runs opens with the step: transfer_timeout for the step
  // itself too.
  const absl::Time deadline = absl::Now() + (round.in_runs ? 2 : 1) * options_.transfer_timeout;
  TraceSpan push_span(options_.trace, round.in_runs ? "push in runs" : "push", trace_step());
  push_span.Arg("lane", l);
  push_span.Arg("ps", lane.spec.ps);
  push_span.Arg("slices", lane.spec.slices.size());
  if (!round.in_runs) {
    return client_->Push(lane.spec.ps, header, round.skip ? std::vector<TensorRef>() : lane.refs,
                         deadline);
  }
  ps::Client::PushRuns runs{lane.spec.run_starts, [&](int g) { return WaitRun(round, l, g); },
                            [&](int g, bool ok) { return MarkRun(round, l, g, ok); },
                            round.overflow};
  return client_->PushInRuns(lane.spec.ps, header, lane.refs, runs, deadline);
}

absl::Status PsExchange::MarkRun(Round& round, int l, int g, bool finite) {
  // Marked at the lane's first run that is not finite, or with its last; a
  // verdict that failed already ends the push.
  LaneRound& r = round.lanes[l];
  if (!r.checked && (!finite || g + 1 == static_cast<int>(lanes_[l].spec.run_starts.size()))) {
    r.checked = true;
    round.verdict->Mark(finite);
  }
  if (finite) return absl::OkStatus();
  r.stopped = true;
  return absl::CancelledError("the step is not finite");
}

absl::Status PsExchange::WaitRun(Round& round, int l, int g) {
  const auto [first, last] = lanes_[l].spec.run_pieces[g];
  StepVerdict* const verdict = round.verdict;
  TraceSpan wait_span(options_.trace, "run waits for its gradients", trace_step());
  wait_span.Arg("lane", l);
  wait_span.Arg("run", g);
  const bool ready = grads_ready_.WaitReady(first, last, absl::InfiniteFuture(),
                                            [&] { return hooks_.stopping() || verdict->Failed(); });
  wait_span.End();
  if (ready && !verdict->Failed()) return absl::OkStatus();
  // Stopping, or the step failed already: the lane's part fails too.
  const absl::Status s = MarkRun(round, l, g, false);
  return ready ? s : absl::CancelledError("stopping");
}

void PsExchange::MarkOwed(Round& round, int l) {
  bool ready = false;
  WaitAndMark(round, l, &ready);
}

void PsExchange::CountPush(Round& round, int l) {
  round.lanes[l].counted = true;
  if (round.pushes_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && *round.on_pushed) {
    absl::Time last;
    for (const LaneRound& r : round.lanes) last = std::max(last, r.answered);
    (*round.on_pushed)(last, round.skip);
  }
}

absl::Status PsExchange::Collect(const Round& round, ExchangeRound* out) {
  int64_t newest = std::numeric_limits<int64_t>::min();
  out->version = std::numeric_limits<int64_t>::max();
  out->wait_us = std::numeric_limits<int64_t>::min();
  for (const LaneRound& r : round.lanes) {
    out->version = std::min(out->version, r.pull.version);
    out->wait_us = std::max(out->wait_us, r.pull.wait_us);
    newest = std::max(newest, r.pull.version);
  }
  if (options_.async) {
    // Each ps counts its own versions: the next push to it names the one
    // its slices were pulled at.
    ps_versions_.assign(num_ps_, std::numeric_limits<int64_t>::max());
    out->clock = std::numeric_limits<int64_t>::max();
    out->lag = 0;
    for (size_t l = 0; l < lanes_.size(); ++l) {
      int64_t& v = ps_versions_[lanes_[l].spec.ps];
      v = std::min(v, round.lanes[l].pull.version);
      out->clock = std::min(out->clock, round.lanes[l].pull.clock);
      out->lag = std::max(out->lag, round.lanes[l].pull.lag);
    }
    return absl::OkStatus();
  }
  // One step apart: a worker died between its pushes of the last step to
  // different ps (some applied it, the others still wait for its push). Do
  // the older step: the ps past it answer STALE, the others get their push.
  if (newest - out->version > 1) {
    return absl::AbortedError(
        absl::StrCat("ps disagree on the version: ", out->version, " and ", newest));
  }
  return absl::OkStatus();
}

absl::Status PsExchange::PullLane(int l, int64_t min_version, StepVerdict* open_verdict,
                                  LanePull* out, const std::atomic<bool>* give_up) {
  Lane& lane = lanes_[l];  // its pull's fields are this thread's alone
  const absl::Time start = absl::Now();
  absl::StatusOr<ps::Client::ClockedPull> r;
  // The lane's last pull's region, once its uploads are done, goes back for
  // this pull to use.
  PSFLOW_RETURN_IF_ERROR(ReleaseHold(lane));
  TraceSpan pull_span(options_.trace, "pull", trace_step());
  pull_span.Arg("lane", l);
  pull_span.Arg("ps", lane.spec.ps);
  pull_span.Arg("slices", lane.spec.slices.size());
  absl::Time last_ask;
  do {  // ask again while the other workers are still on the step
    if (hooks_.stop_signal() != 0) return absl::CancelledError("stopping");
    if (give_up != nullptr && give_up->load())
      return absl::CancelledError("the lane's push failed");
    // Before the step's verdict, ask often, so as to stop soon after one
    // that is not finite (the slices this worker withheld never come).
    absl::Duration max_wait = options_.pull_wait;
    if (open_verdict != nullptr) {
      if (open_verdict->Failed()) return absl::OkStatus();  // out->version stays -1
      if (!open_verdict->Decided()) max_wait = std::min(max_wait, absl::Milliseconds(100));
    }
    last_ask = absl::Now();
    r = AskLane(l, min_version, max_wait, last_ask + max_wait + options_.transfer_timeout, give_up);
  } while (r.ok() && !r->ready);
  if (!r.ok()) {
    const absl::Status failed = FromPs(r.status());
    if (IsRetryable(failed) && !hooks_.stop_pending())
      PSLOG(WARNING) << "retrying: " << failed.message() << " ("
                     << absl::StatusCodeToString(failed.code()) << ")";
    return failed;
  }
  out->version = r->version;
  out->clock = r->clock;
  out->lag = r->lag;
  // Time spent on "not yet" answers (and retries) is waiting too.
  out->wait_us = r->wait_us + absl::ToInt64Microseconds(last_ask - start);
  pull_span.End();
  if (buffers_.in_place) return absl::OkStatus();
  TraceSpan upload_span(options_.trace, "queue uploads", trace_step());
  upload_span.Arg("lane", l);
  if (!buffers_.upload_after.empty()) WaitStepQueued();
  if (borrow_pulls_) return UploadBorrowed(lane, std::move(r->hold));
  return UploadStaged(lane);
}

absl::StatusOr<ps::Client::ClockedPull> PsExchange::AskLane(int l, int64_t min_version,
                                                            absl::Duration max_wait,
                                                            absl::Time deadline,
                                                            const std::atomic<bool>* give_up) {
  const Lane& lane = lanes_[l];
  const int ps = lane.spec.ps;
  if (options_.async) {
    return client_->PullByClock(ps, job_id(), options_.worker_index, min_version, lane.spec.slices,
                                lane.sinks, deadline, max_wait);
  }
  absl::StatusOr<ps::Client::PullResult> p =
      give_up != nullptr ? client_->PullUnlessGivenUp(ps, job_id(), min_version, lane.spec.slices,
                                                      lane.sinks, deadline, max_wait, *give_up)
                         : client_->Pull(ps, job_id(), min_version, lane.spec.slices, lane.sinks,
                                         deadline, max_wait);
  if (!p.ok()) return p.status();
  ps::Client::ClockedPull pulled;
  pulled.ready = p->version >= min_version;
  pulled.version = p->version;
  pulled.wait_us = p->wait_us;
  pulled.hold = std::move(p->hold);
  return pulled;
}

absl::Status PsExchange::UploadBorrowed(Lane& lane, std::shared_ptr<const void> hold) {
  // Each slice from where the pull left it: the region (kept until the
  // copies are done), or its sink.
  lane.hold = std::move(hold);
  model::Network* const net = buffers_.net;
  absl::Status s;
  // The lane's slices go to the backend in one call for each kind of
  // values (each alone costs a copy, and a kernel for 16-bit values, under
  // the backend's lock).
  std::vector<model::Network::HostRange> floats, halves;
  DataType halves_dtype = DT_BFLOAT16;
  for (size_t i = 0; i < lane.sinks.size(); ++i) {
    const int v = lane.spec.variables[i];
    const int64_t first = lane.first_float[i], count = NumElements(lane.sinks[i].shape);
    const void* const borrowed = lane.borrowed[i];
    kernels::Event* const after = buffers_.upload_after[v];
    if (borrowed == nullptr) {  // in the variable's staging buffer, floats
      floats.push_back({v, first, count, buffers_.weights[v] + first, after});
      continue;
    }
    // In the pull's region (one block), in the wire dtype.
    const DataType dtype = lane.sinks[i].dtype;
    (dtype == DT_FLOAT ? floats : halves)
        .push_back({v, first, count, borrowed, after, lane.hold.get()});
    if (dtype != DT_FLOAT) halves_dtype = dtype;
  }
  if (!floats.empty()) s = net->SetWeightRangesAfter(floats, kernels::Backend::HostValues::kFloat);
  if (s.ok() && !halves.empty()) {
    s = net->SetWeightRangesAfter(halves, halves_dtype == DT_BFLOAT16
                                              ? kernels::Backend::HostValues::kBfloat16
                                              : kernels::Backend::HostValues::kHalf);
  }
  if (s.ok() && lane.hold != nullptr) {
    if (!told_borrow_.exchange(true)) {
      PSLOG(INFO) << "pulled weights go to the GPU straight from the shared memory the ps "
                     "wrote them into";
    }
    s = buffers_.backend->RecordUploadsDone(lane.uploaded.get());
  }
  if (s.ok()) return absl::OkStatus();
  // Copies queued before the failure may still read the region: wait for
  // all of them before it goes. INTERNAL whatever the device said.
  if (lane.hold != nullptr) static_cast<void>(buffers_.backend->Synchronize());
  lane.hold.reset();
  return absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
}

absl::Status PsExchange::UploadStaged(const Lane& lane) {
  // Each variable goes to the device once its last slice is in.
  model::Network* const net = buffers_.net;
  for (int v : lane.spec.variables) {
    if (to_come_[v].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
    float* const weights = buffers_.weights[v];
    absl::Status s = buffers_.upload_after.empty()
                         ? net->SetWeight(v, weights)
                         : net->SetWeightAfter(v, weights, buffers_.upload_after[v]);
    // INTERNAL whatever the device said: never retried (the countdown is spent).
    if (!s.ok())
      return absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status PsExchange::ReleaseHold(Lane& lane) {
  if (lane.hold == nullptr) return absl::OkStatus();
  absl::Status s = buffers_.backend->WaitEvent(lane.uploaded.get());
  if (!s.ok()) {
    static_cast<void>(buffers_.backend->Synchronize());
    s = absl::InternalError(absl::StrCat("copying weights to the device: ", s.message()));
  }
  lane.hold.reset();
  return s;
}

void PsExchange::SetStepQueued(bool queued) {
  absl::MutexLock lock(&queued_mu_);
  step_queued_ = queued;
}

void PsExchange::WaitStepQueued() {
  absl::MutexLock lock(&queued_mu_);
  queued_mu_.Await(absl::Condition(&step_queued_));
}

float PsExchange::GradientLimit() const {
  const float overflow = WireOverflow(options_.dtype);
  return options_.max_gradient_abs > 0 ? std::min(overflow, options_.max_gradient_abs) : overflow;
}

bool PsExchange::LaneFinite(int l) const {
  // A gradient the wire dtype turns into infinity (fp16 from 65520 on) is
  // as diverged as one that already is. (To a replica of an all-reduce job
  // the exchange is fp32: its ring rounds the mean through the wire dtype
  // already, so an fp16 overflow is an infinity by then.)
  const float overflow = GradientLimit();
  for (const TensorRef& r : lanes_[l].refs) {
    if (!WireValuesBelow(r, 0, NumElements(r.shape), overflow)) return false;
  }
  return true;
}

}  // namespace psflow::worker
