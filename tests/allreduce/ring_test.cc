#include "allreduce/ring.h"

#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "allreduce/grpc_peers.h"
#include "allreduce/service.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport/grpc_util.h"

namespace psflow::allreduce {
namespace {

using ::testing::HasSubstr;

// Members in one process: a send is the receiver's Deliver.
class MemoryPeers final : public Peers {
 public:
  explicit MemoryPeers(std::vector<Ring*>* rings) : rings_(rings) {}
  absl::Status Send(int to, const RingPiece& piece, absl::Time deadline, bool forming) override {
    while (true) {
      if (cancelled_) return absl::CancelledError("cancelled");
      if (down_.count(to)) return absl::UnavailableError(absl::StrCat("worker ", to, " is down"));
      absl::Status s = (*rings_)[to]->Deliver(piece);
      if (!forming || !absl::IsUnavailable(s) || absl::Now() > deadline) return s;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
  void Abort(int to, const RingAbort& abort, absl::Time) override {
    if (!down_.count(to)) (*rings_)[to]->PeerAborted(abort).IgnoreError();
  }
  void CancelAll() override { cancelled_ = true; }
  bool Unreachable(int member) override { return unreachable_.load() == member; }
  void SetDown(int member) { down_.insert(member); }
  // From now on `member` counts as gone when asked (sends still reach it).
  void SetUnreachable(int member) { unreachable_ = member; }

 private:
  std::vector<Ring*>* rings_;
  std::atomic<bool> cancelled_{false};
  std::set<int> down_;
  std::atomic<int> unreachable_{-1};
};

struct Group {
  std::vector<Ring*> rings;
  std::vector<std::unique_ptr<MemoryPeers>> peers;
  std::vector<std::unique_ptr<Ring>> owned;
  Group(int n, RingOptions base) {
    for (int r = 0; r < n; ++r) {
      peers.push_back(std::make_unique<MemoryPeers>(&rings));
      RingOptions o = base;
      o.rank = r;
      o.size = n;
      owned.push_back(std::make_unique<Ring>(o, peers.back().get()));
      rings.push_back(owned.back().get());
    }
  }
  // Every member takes part in job `job_id`, with ring key `key`.
  void Open(uint64_t job_id, uint64_t key = 0) {
    for (Ring* r : rings) r->Open(job_id, 0, key);
  }
};

// Options of a ring whose rounds and forming both give up after `timeout`.
RingOptions Timeouts(absl::Duration timeout) {
  RingOptions o;
  o.round_timeout = timeout;
  o.form_timeout = timeout;
  return o;
}

// Each member's buffers: pieces of odd lengths (a variable each).
std::vector<std::vector<float>> MemberValues(int member, const std::vector<int64_t>& lengths) {
  std::mt19937 rng(1234 + member);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::vector<float>> out;
  for (int64_t n : lengths) {
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<absl::Span<float>> Spans(std::vector<std::vector<float>>& values) {
  std::vector<absl::Span<float>> s;
  for (auto& v : values) s.push_back(absl::MakeSpan(v));
  return s;
}

// A float piece of job `job_id` from member `from` for round 0 of step 0,
// of `bytes` bytes of zeros.
RingPiece Piece(uint64_t job_id, int from, size_t bytes) {
  RingPiece piece;
  piece.set_job_id(job_id);
  piece.set_from(from);
  piece.set_step(0);
  piece.set_round(0);
  piece.set_dtype(DT_FLOAT);
  piece.set_data(std::string(bytes, '\0'));
  return piece;
}

// Starts an all-reduce of `values[r]` by each member r < `members`, on a
// thread of its own; member r's status goes to (*results)[r].
std::vector<std::thread> StartMembers(Group& g,
                                      std::vector<std::vector<std::vector<float>>>& values,
                                      int members, int64_t step, DataType dtype,
                                      std::vector<absl::Status>* results) {
  results->resize(members);
  std::vector<std::thread> threads;
  for (int r = 0; r < members; ++r) {
    threads.emplace_back([&g, &values, results, r, step, dtype] {
      std::vector<absl::Span<float>> spans = Spans(values[r]);
      (*results)[r] = g.rings[r]->AllReduce(step, spans, dtype);
    });
  }
  return threads;
}

// Runs one all-reduce of every member at once; the members' statuses.
std::vector<absl::Status> RunAll(Group& g, std::vector<std::vector<std::vector<float>>>& values,
                                 int64_t step, DataType dtype) {
  std::vector<absl::Status> results;
  const int n = static_cast<int>(g.rings.size());
  for (std::thread& t : StartMembers(g, values, n, step, dtype, &results)) t.join();
  return results;
}

void ExpectMeanEverywhere(int n, const std::vector<int64_t>& lengths, DataType dtype,
                          int64_t bucket_bytes) {
  RingOptions o;
  o.bucket_bytes = bucket_bytes;
  Group g(n, o);
  g.Open(42);
  std::vector<std::vector<std::vector<float>>> values;
  for (int r = 0; r < n; ++r) values.push_back(MemberValues(r, lengths));
  const auto original = values;
  for (absl::Status& s : RunAll(g, values, /*step=*/7, dtype)) ASSERT_TRUE(s.ok()) << s;
  // A 16-bit dtype rounds each received addend and the mean: 2^-8 of bf16
  // per rounding, at most n + 1 of them.
  const double tolerance = dtype == DT_FLOAT ? 1e-5 : (dtype == DT_BFLOAT16 ? 0.05 : 0.01);
  for (size_t p = 0; p < lengths.size(); ++p) {
    for (int64_t k = 0; k < lengths[p]; ++k) {
      double mean = 0;
      for (int r = 0; r < n; ++r) mean += original[r][p][k];
      mean /= n;
      ASSERT_NEAR(values[0][p][k], mean, tolerance * (1 + std::abs(mean)))
          << "n=" << n << " piece " << p << " element " << k;
      for (int r = 1; r < n; ++r) {
        // Bit-identical on every member.
        ASSERT_EQ(std::memcmp(&values[r][p][k], &values[0][p][k], sizeof(float)), 0)
            << "member " << r << " piece " << p << " element " << k;
      }
    }
  }
}

TEST(RingTest, EveryMemberGetsTheSameMean) {
  const std::vector<int64_t> lengths = {1, 37, 1000, 3, 4099};
  for (int n : {1, 2, 3, 4}) {
    // One bucket, and buckets of 1 KiB cutting through the pieces.
    ExpectMeanEverywhere(n, lengths, DT_FLOAT, int64_t{4} << 20);
    ExpectMeanEverywhere(n, lengths, DT_FLOAT, 1024);
  }
}

TEST(RingTest, SixteenBitWireStaysIdenticalEverywhere) {
  const std::vector<int64_t> lengths = {5, 513, 2048};
  for (int n : {2, 3}) {
    ExpectMeanEverywhere(n, lengths, DT_BFLOAT16, 2048);
    ExpectMeanEverywhere(n, lengths, DT_HALF, 2048);
  }
}

TEST(RingTest, MoreMembersThanFloats) { ExpectMeanEverywhere(4, {2}, DT_FLOAT, 4); }

TEST(RingTest, ANonFiniteValueReachesEveryMember) {
  Group g(3, RingOptions());
  g.Open(1);
  std::vector<std::vector<std::vector<float>>> values;
  for (int r = 0; r < 3; ++r) values.push_back(MemberValues(r, {100}));
  values[1][0][50] = std::nanf("");
  for (absl::Status& s : RunAll(g, values, 0, DT_FLOAT)) ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(std::isnan(values[r][0][50])) << r;
}

// Started before its pieces hold their values (as a CPU worker starts it
// before the backward pass), each member's pieces written and marked ready
// one by one, the last first, on another thread: the same bits as the
// all-reduce of finished pieces, and no bucket goes before its pieces.
TEST(RingTest, AnAllReduceStartedBeforeItsPiecesAreReadyGivesTheSameBits) {
  const std::vector<int64_t> lengths = {1, 700, 37, 1500, 3};
  constexpr int kMembers = 3;
  RingOptions o;
  o.bucket_bytes = 1024;  // buckets cutting through the pieces
  std::vector<std::vector<std::vector<float>>> want;
  for (int r = 0; r < kMembers; ++r) want.push_back(MemberValues(r, lengths));
  {
    Group g(kMembers, o);
    g.Open(3);
    for (absl::Status& s : RunAll(g, want, 5, DT_FLOAT)) ASSERT_TRUE(s.ok()) << s;
  }
  Group g(kMembers, o);
  g.Open(3);
  std::vector<std::vector<std::vector<float>>> values(kMembers);
  std::vector<PieceReadiness> ready(kMembers);
  std::vector<absl::Status> results(kMembers);
  std::vector<std::thread> threads;
  for (int r = 0; r < kMembers; ++r) {
    for (int64_t n : lengths) values[r].emplace_back(n, std::nanf(""));  // not computed yet
    ready[r].Reset(static_cast<int>(lengths.size()));
    threads.emplace_back([&, r] {
      std::vector<absl::Span<float>> spans = Spans(values[r]);
      results[r] = g.rings[r]->AllReduce(5, spans, DT_FLOAT, &ready[r]);
    });
  }
  const std::vector<std::vector<std::vector<float>>> inputs = [&] {
    std::vector<std::vector<std::vector<float>>> in;
    for (int r = 0; r < kMembers; ++r) in.push_back(MemberValues(r, lengths));
    return in;
  }();
  for (int p = static_cast<int>(lengths.size()) - 1; p >= 0; --p) {
    absl::SleepFor(absl::Milliseconds(20));
    for (int r = 0; r < kMembers; ++r) {
      values[r][p] = inputs[r][p];
      ready[r].MarkReady(p);
    }
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kMembers; ++r) {
    ASSERT_TRUE(results[r].ok()) << results[r];
    for (size_t p = 0; p < lengths.size(); ++p) {
      ASSERT_EQ(std::memcmp(values[r][p].data(), want[r][p].data(), lengths[p] * sizeof(float)), 0)
          << "member " << r << " piece " << p;
    }
  }
}

// A member whose pieces never become ready fails the step at the round
// timeout, and the others with it.
TEST(RingTest, PiecesThatNeverBecomeReadyEndTheStep) {
  Group g(2, Timeouts(absl::Milliseconds(300)));
  g.Open(3);
  std::vector<float> a(10, 1.0f), b(10, 2.0f);
  PieceReadiness never;
  never.Reset(1);
  std::vector<absl::Status> results(2);
  std::thread t0([&] {
    std::vector<absl::Span<float>> spans = {absl::MakeSpan(a)};
    results[0] = g.rings[0]->AllReduce(0, spans, DT_FLOAT, &never);
  });
  std::thread t1([&] {
    std::vector<absl::Span<float>> spans = {absl::MakeSpan(b)};
    results[1] = g.rings[1]->AllReduce(0, spans, DT_FLOAT);
  });
  t0.join();
  t1.join();
  // Its own wait's deadline, or the other member's abort: whichever comes first.
  EXPECT_TRUE(absl::IsDeadlineExceeded(results[0]) || absl::IsUnavailable(results[0]))
      << results[0];
  EXPECT_FALSE(results[1].ok());
}

TEST(RingTest, ConsecutiveStepsReuseTheRing) {
  Group g(2, RingOptions());
  g.Open(1);
  for (int64_t step = 0; step < 20; ++step) {
    std::vector<std::vector<std::vector<float>>> values = {{{1.0f, 2.0f}}, {{3.0f, 4.0f}}};
    for (absl::Status& s : RunAll(g, values, step, DT_FLOAT)) ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(values[1][0], (std::vector<float>{2.0f, 3.0f}));
  }
}

TEST(RingTest, BroadcastHandsMember0sBytesToEveryone) {
  for (int n : {1, 2, 3, 5}) {
    Group g(n, RingOptions());
    g.Open(1);
    std::string id(128, '\0');
    for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 37 + 11);
    std::vector<absl::StatusOr<std::string>> got(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        got[r] = g.rings[r]->Broadcast(-1, r == 0 ? id : std::string(id.size(), 'x'));
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
      ASSERT_TRUE(got[r].ok()) << got[r].status();
      EXPECT_EQ(*got[r], id) << "member " << r << " of " << n;
    }
  }
}

TEST(RingTest, AMemberThatIsDownFailsTheOthersAndTheyLeave) {
  RingOptions o;
  o.round_timeout = absl::Seconds(20);
  Group g(3, o);
  g.Open(1);
  // Form the group first: afterwards a member that does not answer fails at once.
  std::vector<std::vector<std::vector<float>>> values;
  for (int r = 0; r < 3; ++r) values.push_back(MemberValues(r, {64}));
  for (absl::Status& s : RunAll(g, values, 0, DT_FLOAT)) ASSERT_TRUE(s.ok()) << s;
  // Member 2 dies: 1 cannot send to it; 0 waits for it and is told.
  for (auto& p : g.peers) p->SetDown(2);
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results(2);
  std::vector<std::thread> threads = StartMembers(g, values, 2, 1, DT_FLOAT, &results);
  for (std::thread& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the round timeout
  EXPECT_TRUE(absl::IsUnavailable(results[1])) << results[1];
  EXPECT_THAT(results[1].message(), HasSubstr("worker 2"));
  // Told by member 1 (or refused by it, having left): either way, it says so.
  EXPECT_TRUE(absl::IsUnavailable(results[0]) || absl::IsAborted(results[0])) << results[0];
  EXPECT_THAT(results[0].message(), HasSubstr("worker 1 left the all-reduce group"));
  // Left for good.
  std::vector<absl::Span<float>> spans = Spans(values[0]);
  EXPECT_FALSE(g.rings[0]->AllReduce(2, spans, DT_FLOAT).ok());
}

// A member that took this one's piece and then died: the wait for its own
// piece ends within seconds (its address no longer connects), not at the
// round timeout.
TEST(RingTest, ASenderThatIsGoneEndsTheWaitForItsPiece) {
  RingOptions o;
  o.round_timeout = absl::Seconds(60);
  Group g(2, o);
  g.Open(5);
  std::vector<std::vector<std::vector<float>>> values = {{{1.0f, 2.0f}}, {{3.0f, 4.0f}}};
  for (absl::Status& s : RunAll(g, values, 0, DT_FLOAT)) ASSERT_TRUE(s.ok()) << s;  // formed
  g.peers[0]->SetUnreachable(1);
  std::vector<float> mine = {1.0f, 2.0f};
  std::vector<absl::Span<float>> spans = {absl::MakeSpan(mine)};
  const absl::Time start = absl::Now();
  const absl::Status s = g.rings[0]->AllReduce(1, spans, DT_FLOAT);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("worker 1 cannot be reached"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(RingTest, APieceThatNeverComesEndsTheRoundAtItsTimeout) {
  Group g(2, Timeouts(absl::Milliseconds(200)));
  g.Open(1);
  std::vector<std::vector<float>> values = {{1.0f, 2.0f, 3.0f}};
  std::vector<absl::Span<float>> spans = Spans(values);
  // Member 1 never takes part.
  absl::Status s = g.rings[0]->AllReduce(0, spans, DT_FLOAT);
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("no piece from worker 1"));
}

TEST(RingTest, DeliverRefusesWhatItNeverTakes) {
  Group g(3, RingOptions());
  RingPiece piece = Piece(5, 2, 8);  // from member 0's predecessor
  // Not in a job yet: the sender asks again later.
  EXPECT_TRUE(absl::IsUnavailable(g.rings[0]->Deliver(piece)));
  g.rings[0]->Open(5);
  RingPiece other_job = piece;
  other_job.set_job_id(6);
  EXPECT_TRUE(absl::IsFailedPrecondition(g.rings[0]->Deliver(other_job)));
  RingPiece not_prev = piece;
  not_prev.set_from(1);
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->Deliver(not_prev)));
  RingPiece bad_round = piece;
  bad_round.set_round(4);  // rounds 0..3 with 3 members
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->Deliver(bad_round)));
  RingPiece bad_dtype = piece;
  bad_dtype.set_dtype(DT_INVALID);
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->Deliver(bad_dtype)));
  EXPECT_TRUE(g.rings[0]->Deliver(piece).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(g.rings[0]->Deliver(piece)));  // twice
  RingAbort forged;
  forged.set_job_id(5);
  forged.set_from(9);
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->PeerAborted(forged)));
}

// Pieces and aborts carry the ring's key: the members' own pass (the
// all-reduce works), a stranger's, who knows the job id but not the key, are
// refused and the ring stays.
TEST(RingTest, PiecesAndAbortsWithoutTheRingsKeyAreRefused) {
  Group g(2, RingOptions());
  constexpr uint64_t kKey = 0x5ec7e7;
  g.Open(5, kKey);
  RingPiece piece = Piece(5, 1, 8);
  absl::Status s = g.rings[0]->Deliver(piece);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  RingAbort forged;
  forged.set_job_id(5);
  forged.set_from(1);
  s = g.rings[0]->PeerAborted(forged);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_TRUE(g.rings[0]->status().ok());
  std::vector<std::vector<std::vector<float>>> values;
  for (int r = 0; r < 2; ++r) values.push_back(MemberValues(r, {100}));
  for (absl::Status& r : RunAll(g, values, 0, DT_FLOAT)) ASSERT_TRUE(r.ok()) << r;
  forged.set_ring_key(kKey);  // a member's abort
  EXPECT_TRUE(g.rings[0]->PeerAborted(forged).ok());
  EXPECT_TRUE(absl::IsUnavailable(g.rings[0]->status()));
}

TEST(RingTest, APieceOfTheWrongSizeFailsTheStep) {
  RingOptions o;
  o.round_timeout = absl::Seconds(5);
  Group g(2, o);
  g.Open(1);
  // Member 1's piece for member 0, of 3 floats where member 0 expects 2
  // (member 1 itself takes no part: its piece is this one).
  ASSERT_TRUE(g.rings[0]->Deliver(Piece(1, 1, 12)).ok());
  std::vector<std::vector<float>> values = {{1.0f, 2.0f, 3.0f, 4.0f}};
  std::vector<absl::Span<float>> spans = Spans(values);
  absl::Status s = g.rings[0]->AllReduce(0, spans, DT_FLOAT);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("sent 12 bytes"));
}

TEST(RingTest, PiecesBeyondTheBoundsAreRefused) {
  RingOptions o;
  o.bucket_bytes = 1024;  // segments of 128 floats with 2 members
  Group g(2, o);
  g.rings[0]->Open(1);
  RingPiece piece = Piece(1, 1, 4 * 1000);  // far more than a segment
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->Deliver(piece)));
  piece.set_data(std::string(8, '\0'));
  piece.set_bucket(1 << 20);
  EXPECT_TRUE(absl::IsInvalidArgument(g.rings[0]->Deliver(piece)));
  // A mailbox holds a bounded number of pieces.
  absl::Status last;
  for (int b = 0; b < 5000 && last.ok(); ++b) {
    piece.set_bucket(b);
    last = g.rings[0]->Deliver(piece);
  }
  EXPECT_TRUE(absl::IsResourceExhausted(last)) << last;
}

// A stop during the group's forming ends the wait at once, and the other
// members, told, stop waiting too.
TEST(RingTest, CancelEndsTheFormingWaitAndTellsTheOthers) {
  RingOptions o;
  o.form_timeout = absl::Seconds(30);
  Group g(3, o);
  g.Open(1);
  std::vector<std::vector<std::vector<float>>> values(2, {{1.0f, 2.0f, 3.0f}});
  std::vector<absl::Status> results(2);
  // Members 0 and 1 wait for member 2, which never takes part.
  std::vector<std::thread> threads = StartMembers(g, values, 2, 0, DT_FLOAT, &results);
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  g.rings[2]->Cancel();
  for (std::thread& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(results[0].ok());
  EXPECT_FALSE(results[1].ok());
  EXPECT_THAT(std::string(results[0].message()) + std::string(results[1].message()),
              HasSubstr("worker 2"));
  EXPECT_TRUE(absl::IsCancelled(g.rings[2]->status()));
}

// Three members over real gRPC on loopback.
TEST(RingTest, OverGrpc) {
  constexpr int kMembers = 3;
  const std::vector<int> ports = FreePorts("127.0.0.1", kMembers);
  ASSERT_EQ(ports.size(), static_cast<size_t>(kMembers));
  std::vector<std::string> addresses;
  for (int p : ports) addresses.push_back(absl::StrCat("127.0.0.1:", p));
  SecurityOptions security;
  std::vector<std::unique_ptr<GrpcPeers>> peers;
  std::vector<std::unique_ptr<Ring>> rings;
  std::vector<std::unique_ptr<AllReduceService>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;
  for (int r = 0; r < kMembers; ++r) {
    peers.push_back(std::make_unique<GrpcPeers>(addresses, security));
    RingOptions o;
    o.rank = r;
    o.size = kMembers;
    o.bucket_bytes = 64 << 10;
    rings.push_back(std::make_unique<Ring>(o, peers.back().get()));
    rings.back()->Open(77);
  }
  // Member 2 comes up late: the forming group waits for it.
  for (int r = 0; r < kMembers; ++r)
    services.push_back(std::make_unique<AllReduceService>(rings[r].get()));
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<std::unique_ptr<grpc::Server>> s =
        StartServer(addresses[r], services[r].get(), security, AllReduceCallers());
    ASSERT_TRUE(s.ok()) << s.status();
    servers.push_back(*std::move(s));
  }
  const std::vector<int64_t> lengths = {100000, 7, 250000};
  std::vector<std::vector<std::vector<float>>> values;
  for (int r = 0; r < kMembers; ++r) values.push_back(MemberValues(r, lengths));
  const auto original = values;
  std::vector<absl::Status> results(kMembers);
  std::vector<std::thread> threads;
  for (int r = 0; r < kMembers; ++r) {
    threads.emplace_back([&, r] {
      std::vector<absl::Span<float>> spans = Spans(values[r]);
      results[r] = rings[r]->AllReduce(0, spans, DT_BFLOAT16);
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  absl::StatusOr<std::unique_ptr<grpc::Server>> late =
      StartServer(addresses[2], services[2].get(), security, AllReduceCallers());
  ASSERT_TRUE(late.ok()) << late.status();
  servers.push_back(*std::move(late));
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) ASSERT_TRUE(s.ok()) << s;
  for (size_t p = 0; p < lengths.size(); ++p) {
    ASSERT_EQ(std::memcmp(values[1][p].data(), values[0][p].data(), lengths[p] * sizeof(float)), 0);
    ASSERT_EQ(std::memcmp(values[2][p].data(), values[0][p].data(), lengths[p] * sizeof(float)), 0);
    const float mean = (original[0][p][3] + original[1][p][3] + original[2][p][3]) / 3;
    EXPECT_NEAR(values[0][p][3], mean, 0.05 * (1 + std::abs(mean)));
  }
  for (auto& s : servers) s->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

}  // namespace
}  // namespace psflow::allreduce
