#include "allreduce/ring.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/float16.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace psflow::allreduce {
namespace {

// Pieces waiting in a mailbox at most, and their bytes (a peer is at most
// one step ahead: a step's pieces for this member).
constexpr size_t kMaxWaitingPieces = 4096;
constexpr int64_t kMaxWaitingBytes = int64_t{1} << 30;
// Buckets of a step at most (of 1 MiB: 1 TiB of gradients).
constexpr int kMaxBuckets = 1 << 20;

// The floats of [begin, end) of the pieces' concatenation, run by run.
template <typename Fn>
void ForEachRun(absl::Span<const absl::Span<float>> pieces, int64_t begin, int64_t end, Fn fn) {
  int64_t at = 0;  // where the current piece starts
  for (const absl::Span<float>& p : pieces) {
    const int64_t n = static_cast<int64_t>(p.size());
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + n);
    if (lo < hi) fn(p.data() + (lo - at), hi - lo, lo - begin);
    at += n;
    if (at >= end) break;
  }
}

bool IsWireDtype(DataType d) { return d == DT_FLOAT || d == DT_BFLOAT16 || d == DT_HALF; }

// A piece or an abort without the ring's key: its sender learnt the job id
// (which the chief's GetState tells anyone) but is no member.
absl::Status NotAMember() {
  return absl::PermissionDeniedError("not a member of this all-reduce ring (wrong ring key)");
}

}  // namespace

Ring::Ring(RingOptions options, Peers* peers) : options_(std::move(options)), peers_(peers) {
  pool_ = std::make_unique<ThreadPool>(std::max(options_.threads - 1, 1));
}

Ring::~Ring() = default;

void Ring::Open(uint64_t job_id, int64_t bucket_bytes, uint64_t ring_key) {
  absl::MutexLock lock(&mu_);
  job_id_ = job_id;
  ring_key_ = ring_key;
  bucket_bytes_ = std::max<int64_t>(bucket_bytes, 0);
}

absl::Status Ring::status() {
  absl::MutexLock lock(&mu_);
  return left_;
}

int64_t Ring::FloatsPerBucketLocked() const {
  const int64_t bytes = bucket_bytes_ > 0 ? bucket_bytes_ : options_.bucket_bytes;
  return std::max<int64_t>(bytes / static_cast<int64_t>(sizeof(float)), options_.size);
}

int64_t Ring::MaxPieceBytesLocked() const {
  return (FloatsPerBucketLocked() / options_.size + 2) * static_cast<int64_t>(sizeof(float));
}

void Ring::Leave(const absl::Status& why) {
  RingAbort abort;
  {
    absl::MutexLock lock(&mu_);
    if (!left_.ok()) return;
    left_ = why;
    abort.set_job_id(job_id_);
    abort.set_ring_key(ring_key_);
  }
  abort.set_from(options_.rank);
  abort.set_reason(std::string(why.message()));
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  for (int m = 0; m < options_.size; ++m) {
    if (m != options_.rank) peers_->Abort(m, abort, deadline);
  }
  peers_->CancelAll();  // sends still trying (a forming group's) end now
}

void Ring::Cancel() { Leave(absl::CancelledError("stopping")); }

absl::Status Ring::Deliver(RingPiece piece) {
  absl::MutexLock lock(&mu_);
  if (!left_.ok()) {
    return absl::AbortedError(
        absl::StrCat("worker ", options_.rank, " left the all-reduce group: ", left_.message()));
  }
  if (job_id_ == 0) return absl::UnavailableError("not in a job yet");
  if (piece.job_id() != job_id_) {
    return absl::FailedPreconditionError(
        absl::StrCat("a piece of job ", piece.job_id(), "; this worker is in job ", job_id_));
  }
  if (piece.ring_key() != ring_key_) return NotAMember();
  const int prev = (options_.rank + options_.size - 1) % options_.size;
  const int rounds = 2 * (options_.size - 1);
  if (piece.from() != prev || piece.round() < 0 || piece.round() >= rounds || piece.bucket() < 0 ||
      piece.bucket() >= kMaxBuckets || !IsWireDtype(piece.dtype()) ||
      static_cast<int64_t>(piece.data().size()) > MaxPieceBytesLocked()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a piece this worker never takes: from ", piece.from(), ", round ",
                     piece.round(), ", bucket ", piece.bucket(), ", dtype ", piece.dtype()));
  }
  if (step_ >= 0 && (piece.step() < step_ || piece.step() > step_ + 1)) {
    return absl::FailedPreconditionError(
        absl::StrCat("a piece of step ", piece.step(), "; this worker is at step ", step_));
  }
  const int64_t bytes = static_cast<int64_t>(piece.data().size());
  if (mailbox_.size() >= kMaxWaitingPieces || mailbox_bytes_ + bytes > kMaxWaitingBytes) {
    return absl::ResourceExhaustedError("too many pieces waiting");
  }
  const Key key(piece.step(), piece.bucket(), piece.round());
  if (!mailbox_.emplace(key, std::move(piece)).second) {
    return absl::FailedPreconditionError("this worker already has that piece");
  }
  mailbox_bytes_ += bytes;
  return absl::OkStatus();
}

absl::Status Ring::PeerAborted(const RingAbort& abort) {
  if (abort.from() < 0 || abort.from() >= options_.size || abort.from() == options_.rank) {
    return absl::InvalidArgumentError(absl::StrCat("no member ", abort.from()));
  }
  {
    absl::MutexLock lock(&mu_);
    if (job_id_ == 0 || abort.job_id() != job_id_) {
      return absl::FailedPreconditionError("another job");
    }
    if (abort.ring_key() != ring_key_) return NotAMember();
    if (!left_.ok()) return absl::OkStatus();
    left_ = absl::UnavailableError(
        absl::StrCat("worker ", abort.from(), " left the all-reduce group: ", abort.reason()));
  }
  peers_->CancelAll();  // sends in flight to a member that waits for it end now
  return absl::OkStatus();
}

absl::StatusOr<RingPiece> Ring::Take(const Key& key, absl::Time deadline, bool forming) {
  const int prev = (options_.rank + options_.size - 1) % options_.size;
  absl::MutexLock lock(&mu_);
  auto here = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !left_.ok() || mailbox_.count(key) > 0;
  };
  int unreachable = 0;  // consecutive looks that found the sender gone
  while (!mu_.AwaitWithDeadline(absl::Condition(&here),
                                std::min(deadline, absl::Now() + absl::Seconds(1)))) {
    if (absl::Now() >= deadline) break;
    // (Looking is cheap and calls nothing back: the connection's state.)
    unreachable = !forming && peers_->Unreachable(prev) ? unreachable + 1 : 0;
    if (unreachable >= 2) {
      return absl::UnavailableError(
          absl::StrCat("step ", std::get<0>(key), ": worker ", prev, " cannot be reached (gone?)"));
    }
  }
  if (!left_.ok()) return left_;
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) {
    return absl::DeadlineExceededError(
        absl::StrCat("step ", std::get<0>(key), ": no piece from worker ", prev, " in time"));
  }
  RingPiece piece = std::move(it->second);
  mailbox_.erase(it);
  mailbox_bytes_ -= static_cast<int64_t>(piece.data().size());
  return piece;
}

absl::Status Ring::WaitForPieces(int64_t step, int bucket, int64_t begin, int64_t end,
                                 absl::Span<const absl::Span<float>> pieces, bool forming,
                                 PieceReadiness* ready) {
  // The pieces this bucket spans: the first whose end is past `begin`,
  // through the one holding end - 1.
  int first = 0, last = 0;
  int64_t at = 0;
  for (int p = 0; p < static_cast<int>(pieces.size()); ++p) {
    const int64_t next_at = at + static_cast<int64_t>(pieces[p].size());
    if (next_at <= begin) first = p + 1;
    if (at < end) last = p;
    at = next_at;
  }
  const absl::Time give_up =
      absl::Now() + (forming ? options_.form_timeout : options_.round_timeout);
  if (ready->WaitReady(first, last, give_up, [this] { return !status().ok(); })) {
    return absl::OkStatus();
  }
  absl::Status left = status();
  return left.ok() ? absl::DeadlineExceededError(absl::StrCat("step ", step, ": bucket ", bucket,
                                                              "'s gradients never came"))
                   : left;
}

absl::Status Ring::ReduceBucket(int64_t step, int bucket, int64_t begin, int64_t end,
                                absl::Span<const absl::Span<float>> pieces, DataType dtype,
                                bool forming, PieceReadiness* ready) {
  const int n = options_.size, i = options_.rank;
  if (ready != nullptr) {
    absl::Status s = WaitForPieces(step, bucket, begin, end, pieces, forming, ready);
    if (!s.ok()) return s;
  }
  const int next = (i + 1) % n;
  const int64_t len = end - begin;
  auto seg_begin = [&](int s) { return begin + len * s / n; };
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  const int64_t width = WireBytes(dtype);
  const absl::Time form_deadline = absl::Now() + options_.form_timeout;
  auto deadline = [&] { return forming ? form_deadline : absl::Now() + options_.round_timeout; };
  std::vector<float> incoming;

  auto send = [&](int s, int round) -> absl::Status {
    RingPiece piece;
    piece.set_step(step);
    piece.set_bucket(bucket);
    piece.set_round(round);
    piece.set_from(i);
    piece.set_dtype(dtype);
    {
      absl::MutexLock lock(&mu_);
      piece.set_job_id(job_id_);
      piece.set_ring_key(ring_key_);
    }
    std::string* data = piece.mutable_data();
    data->resize(static_cast<size_t>((seg_begin(s + 1) - seg_begin(s)) * width));
    ForEachRun(pieces, seg_begin(s), seg_begin(s + 1), [&](float* p, int64_t count, int64_t at) {
      EncodeFloats(dtype, p, count, data->data() + at * width);
    });
    absl::Status sent = peers_->Send(next, piece, deadline(), forming);
    if (!sent.ok()) {
      return absl::Status(sent.code(), absl::StrCat("step ", step, ": sending to worker ", next,
                                                    ": ", sent.message()));
    }
    return absl::OkStatus();
  };
  // Takes round `round`'s piece (segment s) and adds it to, or puts it in
  // place of, this member's floats.
  auto receive = [&](int s, int round, bool add) -> absl::Status {
    absl::StatusOr<RingPiece> got = Take(Key(step, bucket, round), deadline(), forming);
    if (!got.ok()) return got.status();
    const int64_t count = seg_begin(s + 1) - seg_begin(s);
    if (got->dtype() != dtype || static_cast<int64_t>(got->data().size()) != count * width) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", step, ": worker ", got->from(), " sent ", got->data().size(), " bytes of dtype ",
          got->dtype(), " for a segment of ", count, " floats of dtype ", dtype));
    }
    incoming.resize(static_cast<size_t>(count));
    DecodeFloats(dtype, got->data().data(), count, incoming.data());
    ForEachRun(pieces, seg_begin(s), seg_begin(s + 1), [&](float* p, int64_t c, int64_t at) {
      const float* from = incoming.data() + at;
      if (add) {
        for (int64_t k = 0; k < c; ++k) p[k] += from[k];
      } else {
        std::copy(from, from + c, p);
      }
    });
    return absl::OkStatus();
  };

  for (int r = 0; r + 1 < n; ++r) {
    if (absl::Status s = send(mod(i - r), r); !s.ok()) return s;
    if (absl::Status s = receive(mod(i - r - 1), r, /*add=*/true); !s.ok()) return s;
  }
  // This member's segment holds the sum: the mean, as the wire carries it.
  const int own = mod(i + 1);
  const float scale = 1.0f / static_cast<float>(n);
  std::string rounded;
  ForEachRun(pieces, seg_begin(own), seg_begin(own + 1), [&](float* p, int64_t c, int64_t) {
    for (int64_t k = 0; k < c; ++k) p[k] *= scale;
    if (dtype != DT_FLOAT) {
      rounded.resize(static_cast<size_t>(c * width));
      EncodeFloats(dtype, p, c, rounded.data());
      DecodeFloats(dtype, rounded.data(), c, p);
    }
  });
  for (int r = 0; r + 1 < n; ++r) {
    if (absl::Status s = send(mod(i + 1 - r), n - 1 + r); !s.ok()) return s;
    if (absl::Status s = receive(mod(i - r), n - 1 + r, /*add=*/false); !s.ok()) return s;
  }
  return absl::OkStatus();
}

void PieceReadiness::Reset(int pieces) {
  absl::MutexLock lock(&mu_);
  ready_.assign(static_cast<size_t>(std::max(pieces, 0)), 0);
}

void PieceReadiness::MarkReady(int piece) {
  absl::MutexLock lock(&mu_);
  if (piece >= 0 && piece < static_cast<int>(ready_.size())) ready_[piece] = 1;
}

void PieceReadiness::MarkAllReady() {
  absl::MutexLock lock(&mu_);
  std::fill(ready_.begin(), ready_.end(), 1);
}

bool PieceReadiness::WaitReady(int first, int last, absl::Time deadline,
                               const std::function<bool()>& abandoned) {
  absl::MutexLock lock(&mu_);
  auto all_ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int p = std::max(first, 0); p <= last && p < static_cast<int>(ready_.size()); ++p) {
      if (!ready_[p]) return false;
    }
    return true;
  };
  while (!all_ready()) {
    const absl::Time now = absl::Now();
    if (now >= deadline || abandoned()) return false;
    mu_.AwaitWithDeadline(absl::Condition(&all_ready),
                          std::min(deadline, now + absl::Milliseconds(50)));
  }
  return true;
}

absl::Status Ring::AllReduce(int64_t step, absl::Span<const absl::Span<float>> pieces,
                             DataType dtype, PieceReadiness* ready) {
  if (!IsWireDtype(dtype)) return absl::InvalidArgumentError("not a wire dtype");
  bool forming = false;
  {
    absl::MutexLock lock(&mu_);
    if (!left_.ok()) return left_;
    if (job_id_ == 0) return absl::FailedPreconditionError("the ring is not open");
    forming = !formed_;
    step_ = step;
    // Pieces of older steps (a retry's leftovers) are of no use now.
    const auto old_end = mailbox_.lower_bound(Key(step, 0, 0));
    for (auto it = mailbox_.begin(); it != old_end; ++it) {
      mailbox_bytes_ -= static_cast<int64_t>(it->second.data().size());
    }
    mailbox_.erase(mailbox_.begin(), old_end);
  }
  if (options_.size == 1) return absl::OkStatus();
  int64_t total = 0;
  for (const absl::Span<float>& p : pieces) total += static_cast<int64_t>(p.size());
  // Buckets of about the job's bucket bytes, at least one float per member each.
  int64_t per_bucket = 0;
  {
    absl::MutexLock lock(&mu_);
    per_bucket = FloatsPerBucketLocked();
  }
  const int64_t bucket_count = std::max<int64_t>((total + per_bucket - 1) / per_bucket, 1);
  if (bucket_count > kMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat(bucket_count, " buckets in a step, more than ",
                                                   kMaxBuckets, ": make them larger"));
  }
  const int buckets = static_cast<int>(bucket_count);
  std::vector<absl::Status> results(buckets);
  std::atomic<bool> failed{false};
  pool_->ParallelFor(buckets, [&](int k) {
    // The last bucket first, on every member (those that wait for their
    // pieces get the last ones from the backward pass first; all members
    // must claim buckets in one order, or with more buckets than threads
    // they would each wait for a bucket the other has not started).
    const int b = buckets - 1 - k;
    if (failed.load()) {
      results[b] = absl::CancelledError("another bucket failed");
      return;
    }
    const int64_t begin = total * b / buckets, end = total * (b + 1) / buckets;
    results[b] = ReduceBucket(step, b, begin, end, pieces, dtype, forming, ready);
    if (!results[b].ok()) {
      failed.store(true);
      Leave(results[b]);  // ends the other buckets' waits
    }
  });
  for (const absl::Status& r : results) {
    // The first failure left the group; the others followed from it.
    if (!r.ok()) return status();
  }
  absl::MutexLock lock(&mu_);
  formed_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Ring::Broadcast(int64_t step, const std::string& bytes) {
  std::vector<float> values(bytes.size(), 0.0f);
  if (options_.rank == 0) {
    for (size_t i = 0; i < bytes.size(); ++i) values[i] = static_cast<unsigned char>(bytes[i]);
  }
  std::vector<absl::Span<float>> pieces = {absl::MakeSpan(values)};
  PSFLOW_RETURN_IF_ERROR(AllReduce(step, pieces, DT_FLOAT));
  std::string out(bytes.size(), '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(std::lrint(values[i] * static_cast<float>(options_.size)));
  }
  return out;
}

}  // namespace psflow::allreduce
