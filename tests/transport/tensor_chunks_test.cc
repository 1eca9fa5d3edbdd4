#include "transport/tensor_chunks.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<float> Iota(int64_t n, float scale) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * scale - 3.0f;
  return v;
}

TensorChunk Chunk(const std::string& name, const std::string& slot, std::vector<int64_t> shape,
                  int64_t offset, const std::vector<float>& data) {
  TensorChunk c;
  c.set_name(name);
  c.set_slot(slot);
  c.set_dtype(DT_FLOAT);
  for (int64_t d : shape) c.add_shape(d);
  c.set_offset(offset);
  c.set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float));
  return c;
}

TEST(TensorChunksTest, NumElementsAndShapeString) {
  EXPECT_EQ(NumElements(std::vector<int64_t>{2, 3, 4}), 24);
  EXPECT_EQ(NumElements(std::vector<int64_t>{5, 0}), 0);
  EXPECT_EQ(ShapeString(std::vector<int64_t>{2, 3}), "[2,3]");
  EXPECT_EQ(ShapeString(std::vector<int64_t>{}), "[]");
}

class RoundTripTest : public ::testing::TestWithParam<size_t> {};

TEST_P(RoundTripTest, SplitThenAssemble) {
  const size_t max_bytes = GetParam();
  // Bigger than gRPC's 4 MB default message, a tiny one, an empty one and a
  // slot of the same variable.
  const std::vector<int64_t> big_shape = {1100, 1000};
  const std::vector<float> big = Iota(1100 * 1000, 0.5f);
  const std::vector<float> small = Iota(3, 1.0f);
  const std::vector<float> empty;
  const std::vector<float> slot = Iota(3, -2.0f);
  std::vector<TensorRef> refs = {{"small", "", {3}, small.data()},
                                 {"big", "", big_shape, big.data()},
                                 {"empty", "", {2, 0}, empty.data()},
                                 {"small", "m", {3}, slot.data()}};

  std::vector<float> big_out(big.size(), -1), small_out(3, -1), slot_out(3, -1);
  std::vector<float> empty_out;
  ChunkAssembler assembler({{"small", "", {3}, small_out.data()},
                            {"big", "", big_shape, big_out.data()},
                            {"empty", "", {2, 0}, empty_out.data()},
                            {"small", "m", {3}, slot_out.data()}});
  EXPECT_FALSE(assembler.Complete("big", ""));

  ChunkSplitter splitter(refs, max_bytes);
  int groups = 0, empty_chunks = 0;
  google::protobuf::RepeatedPtrField<TensorChunk> group;
  while (splitter.Next(&group)) {
    ++groups;
    ASSERT_FALSE(group.empty()) << "Next() returned true with no chunk";
    size_t group_bytes = 0;
    for (const TensorChunk& c : group) {
      EXPECT_EQ(c.dtype(), DT_FLOAT);
      EXPECT_EQ(c.data().size() % 4, 0u) << "chunks are cut on whole floats";
      group_bytes += c.data().size();
      if (c.data().empty()) {
        ++empty_chunks;
        EXPECT_EQ(c.name(), "empty");
      }
      absl::Status added = assembler.Add(c);
      ASSERT_TRUE(added.ok()) << added;
    }
    EXPECT_LE(group_bytes, max_bytes);
    group.Clear();
    ASSERT_LT(groups, 10'000'000) << "splitter does not terminate";
  }
  EXPECT_FALSE(splitter.Next(&group)) << "stays exhausted";
  EXPECT_TRUE(group.empty());
  EXPECT_EQ(empty_chunks, 1);
  // Every group is full except the last: the data needs at least this many.
  const size_t total = (big.size() + small.size() + slot.size()) * 4;
  const size_t per_group = max_bytes / 4 * 4;
  EXPECT_GE(static_cast<size_t>(groups), (total + per_group - 1) / per_group);

  absl::Status finished = assembler.Finish();
  ASSERT_TRUE(finished.ok()) << finished;
  EXPECT_EQ(big_out, big);
  EXPECT_EQ(small_out, small);
  EXPECT_EQ(slot_out, slot);
  EXPECT_TRUE(assembler.Complete("big", ""));
  EXPECT_TRUE(assembler.Complete("empty", ""));
  EXPECT_TRUE(assembler.Complete("small", "m"));
  EXPECT_FALSE(assembler.Complete("nope", ""));
}

// 1000 and 1 MB are multiples of 4; 1002 leaves 2 bytes of each group unused.
INSTANTIATE_TEST_SUITE_P(MaxBytes, RoundTripTest, ::testing::Values(1000, 1002, 1 << 20));

TEST(TensorChunksTest, TinyMaxBytesStillProgresses) {
  // Fewer than 4 bytes per group is raised to one float per chunk.
  const std::vector<float> v = Iota(5, 1.0f);
  ChunkSplitter splitter({{"v", "", {5}, v.data()}}, 1);
  std::vector<float> out(5);
  ChunkAssembler assembler({{"v", "", {5}, out.data()}});
  google::protobuf::RepeatedPtrField<TensorChunk> group;
  int groups = 0;
  while (splitter.Next(&group) && groups < 100) {
    ++groups;
    for (const TensorChunk& c : group) ASSERT_TRUE(assembler.Add(c).ok());
    group.Clear();
  }
  EXPECT_EQ(groups, 5);
  EXPECT_TRUE(assembler.Finish().ok());
  EXPECT_EQ(out, v);
}

TEST(TensorChunksTest, NoTensorsNoChunks) {
  ChunkSplitter splitter({}, 100);
  google::protobuf::RepeatedPtrField<TensorChunk> group;
  EXPECT_FALSE(splitter.Next(&group));
  EXPECT_TRUE(ChunkAssembler({}).Finish().ok());
}

class AssemblerErrorTest : public ::testing::Test {
 protected:
  AssemblerErrorTest()
      : w_out_(6, 0.0f),
        m_out_(6, 0.0f),
        assembler_({{"w", "", {2, 3}, w_out_.data()}, {"w", "m", {2, 3}, m_out_.data()}}) {}

  void ExpectRejected(const TensorChunk& c, const std::string& substring) {
    absl::Status s = assembler_.Add(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(substring));
  }

  const std::vector<float> half_ = {1, 2, 3};
  std::vector<float> w_out_, m_out_;
  ChunkAssembler assembler_;
};

TEST_F(AssemblerErrorTest, UnknownName) {
  ExpectRejected(Chunk("x", "", {2, 3}, 0, half_), "unknown tensor 'x'");
}

TEST_F(AssemblerErrorTest, WrongSlot) {
  ExpectRejected(Chunk("w", "v", {2, 3}, 0, half_), "slot 'v'");
}

TEST_F(AssemblerErrorTest, WrongDtype) {
  TensorChunk c = Chunk("w", "", {2, 3}, 0, half_);
  c.set_dtype(DT_INVALID);
  ExpectRejected(c, "dtype");
}

TEST_F(AssemblerErrorTest, WrongShape) {
  ExpectRejected(Chunk("w", "", {3, 2}, 0, half_), "[3,2]");
  ExpectRejected(Chunk("w", "", {2, 3, 1}, 0, half_), "shape");
  ExpectRejected(Chunk("w", "", {6}, 0, half_), "shape");
}

TEST_F(AssemblerErrorTest, OutOfOrderOffset) {
  // A gap: the second half before the first.
  ExpectRejected(Chunk("w", "", {2, 3}, 12, half_), "expected byte 0");
  ASSERT_TRUE(assembler_.Add(Chunk("w", "", {2, 3}, 0, half_)).ok());
  // A repeat of the first half.
  ExpectRejected(Chunk("w", "", {2, 3}, 0, half_), "expected byte 12");
  EXPECT_FALSE(assembler_.Complete("w", ""));
}

TEST_F(AssemblerErrorTest, Overflow) {
  ExpectRejected(Chunk("w", "", {2, 3}, 0, std::vector<float>(7, 1.0f)), "does not fit");
  ASSERT_TRUE(assembler_.Add(Chunk("w", "", {2, 3}, 0, std::vector<float>(5, 1.0f))).ok());
  ExpectRejected(Chunk("w", "", {2, 3}, 20, half_), "does not fit");
  // Nothing was written past the end of the sink.
  EXPECT_EQ(w_out_[5], 0.0f);
}

TEST_F(AssemblerErrorTest, PartialFloat) {
  TensorChunk c = Chunk("w", "", {2, 3}, 0, half_);
  c.mutable_data()->resize(10);
  ExpectRejected(c, "bytes");
}

TEST_F(AssemblerErrorTest, IncompleteFailsFinish) {
  ASSERT_TRUE(assembler_.Add(Chunk("w", "", {2, 3}, 0, half_)).ok());
  ASSERT_TRUE(assembler_.Add(Chunk("w", "m", {2, 3}, 0, {1, 2, 3, 4, 5, 6})).ok());
  absl::Status s = assembler_.Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'w'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("12 of 24"));
  ASSERT_TRUE(assembler_.Add(Chunk("w", "", {2, 3}, 12, {4, 5, 6})).ok());
  EXPECT_TRUE(assembler_.Finish().ok());
  EXPECT_EQ(w_out_, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(m_out_, (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST(TensorChunksTest, OptionalSinks) {
  std::vector<float> w(2, 0.0f), m(2, 7.0f);
  {
    ChunkAssembler assembler({{"w", "", {2}, w.data(), true}, {"w", "m", {2}, m.data(), false}});
    ASSERT_TRUE(assembler.Add(Chunk("w", "", {2}, 0, {1, 2})).ok());
    // The optional slot never arrived: fine, and untouched.
    EXPECT_TRUE(assembler.Finish().ok());
    EXPECT_FALSE(assembler.Complete("w", "m"));
    EXPECT_EQ(m, (std::vector<float>{7, 7}));
  }
  {
    ChunkAssembler assembler({{"w", "", {2}, w.data(), true}, {"w", "m", {2}, m.data(), false}});
    ASSERT_TRUE(assembler.Add(Chunk("w", "m", {2}, 0, {3, 4})).ok());
    EXPECT_TRUE(assembler.Complete("w", "m"));
    // A required sink still missing fails even when the optional one arrived.
    EXPECT_FALSE(assembler.Finish().ok());
    EXPECT_EQ(m, (std::vector<float>{3, 4}));
  }
  {
    // An optional sink is still checked when chunks for it do arrive.
    ChunkAssembler assembler({{"w", "m", {2}, m.data(), false}});
    EXPECT_FALSE(assembler.Add(Chunk("w", "m", {3}, 0, {1, 2})).ok());
    EXPECT_FALSE(assembler.Add(Chunk("w", "m", {2}, 0, {1, 2, 3})).ok());
  }
}

TEST(TensorChunksTest, RemainingBytesCountWhatTheSinksStillWaitFor) {
  std::vector<float> w(4, 0.0f), b(2, 0.0f);
  ChunkAssembler assembler({{"w", "", {4}, w.data(), true}, {"b", "", {2}, b.data(), true}});
  EXPECT_EQ(assembler.remaining_bytes(), 6 * 4);
  ASSERT_TRUE(assembler.Add(Chunk("w", "", {4}, 0, {1, 2})).ok());
  EXPECT_EQ(assembler.remaining_bytes(), 4 * 4);
  // A refused chunk (at the wrong offset) counts for nothing.
  EXPECT_FALSE(assembler.Add(Chunk("b", "", {2}, 4, {1})).ok());
  EXPECT_EQ(assembler.remaining_bytes(), 4 * 4);
  ASSERT_TRUE(assembler.Add(Chunk("w", "", {4}, 8, {3, 4})).ok());
  ASSERT_TRUE(assembler.Add(Chunk("b", "", {2}, 0, {5, 6})).ok());
  EXPECT_EQ(assembler.remaining_bytes(), 0);
}

// Chunks in memory that stays the caller's (a shared region): a sink that
// borrows is left pointing at its values where they lie while its
// chunks follow one another there; one whose chunks do not follow, a
// network chunk among them, or a sink without `borrow` gets its values
// copied, the part left in place before included.
TEST(TensorChunksTest, InPlaceChunksAreBorrowedWhileTheyFollowOneAnother) {
  std::vector<float> region = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const char* base = reinterpret_cast<const char*>(region.data());
  auto header = [](const std::string& name, int64_t floats, int64_t offset) {
    return Chunk(name, "", {floats}, offset, {});
  };
  std::vector<float> a(4, 0.0f), b(3, 0.0f), c(2, 0.0f), d(3, 0.0f);
  const void *borrow_a = &a[0], *borrow_b = &b[0], *borrow_d = &d[0];
  bool nan_in_a = false;
  TensorSink sink_a{"a", "", {4}, a.data()};
  sink_a.borrow = &borrow_a;
  sink_a.non_finite = &nan_in_a;
  TensorSink sink_b{"b", "", {3}, b.data()};
  sink_b.borrow = &borrow_b;
  TensorSink sink_d{"d", "", {3}, d.data()};
  sink_d.borrow = &borrow_d;
  ChunkAssembler assembler({sink_a, sink_b, {"c", "", {2}, c.data()}, sink_d});
  // The constructor clears every borrow.
  EXPECT_EQ(borrow_a, nullptr);
  EXPECT_EQ(borrow_b, nullptr);
  EXPECT_EQ(borrow_d, nullptr);
  int completed = -1;
  // a: two chunks one after the other: borrowed, nothing copied.
  ASSERT_TRUE(assembler.AddInPlace(header("a", 4, 0), 8, base, &completed).ok());
  EXPECT_EQ(completed, -1);
  EXPECT_EQ(borrow_a, nullptr) << "set only once the sink is complete";
  ASSERT_TRUE(assembler.AddInPlace(header("a", 4, 8), 8, base + 8, &completed).ok());
  EXPECT_EQ(completed, 0);
  EXPECT_EQ(borrow_a, region.data());
  EXPECT_THAT(a, ElementsAre(0, 0, 0, 0));
  EXPECT_FALSE(nan_in_a);
  // b: its second chunk lies elsewhere: copied, the first one too.
  ASSERT_TRUE(assembler.AddInPlace(header("b", 3, 0), 4, base + 16, &completed).ok());
  ASSERT_TRUE(assembler.AddInPlace(header("b", 3, 4), 8, base + 36, &completed).ok());
  EXPECT_EQ(completed, 1);
  EXPECT_EQ(borrow_b, nullptr);
  EXPECT_THAT(b, ElementsAre(5, 10, 11));
  // c does not borrow: copied.
  ASSERT_TRUE(assembler.AddInPlace(header("c", 2, 0), 8, base + 24, &completed).ok());
  EXPECT_THAT(c, ElementsAre(7, 8));
  // d: in place, then a chunk from the network: all copied.
  ASSERT_TRUE(assembler.AddInPlace(header("d", 3, 0), 8, base, &completed).ok());
  ASSERT_TRUE(assembler.Add(Chunk("d", "", {3}, 8, {42}), &completed).ok());
  EXPECT_EQ(borrow_d, nullptr);
  EXPECT_THAT(d, ElementsAre(1, 2, 42));
  EXPECT_TRUE(assembler.Finish().ok());
  EXPECT_EQ(assembler.borrowed(), 1);
  // A chunk that does not fit is refused in place as anywhere.
  std::vector<float> e(2, 0.0f);
  const void* borrow_e = nullptr;
  TensorSink sink_e{"e", "", {2}, e.data()};
  sink_e.borrow = &borrow_e;
  ChunkAssembler small({sink_e});
  EXPECT_FALSE(small.AddInPlace(header("e", 2, 0), 12, base, &completed).ok());
  EXPECT_EQ(borrow_e, nullptr);
}

// Values left in place are checked for NaN like copied ones, in the dtype
// they lie in: 16-bit chunks are left in place as 16-bit values, checked
// there too.
TEST(TensorChunksTest, InPlaceChunksAreCheckedWhereTheyLieInEveryDtype) {
  std::vector<float> region = {1, std::nanf(""), 3, 4};
  bool nan_seen = false;
  std::vector<float> a(4, 0.0f);
  const void* borrow = nullptr;
  TensorSink sink{"a", "", {4}, a.data()};
  sink.borrow = &borrow;
  sink.non_finite = &nan_seen;
  ChunkAssembler assembler({sink});
  int completed = -1;
  ASSERT_TRUE(assembler
                  .AddInPlace(Chunk("a", "", {4}, 0, {}), 16,
                              reinterpret_cast<const char*>(region.data()), &completed)
                  .ok());
  EXPECT_TRUE(nan_seen);
  EXPECT_EQ(borrow, region.data());

  std::vector<uint16_t> halves(3);
  const std::vector<float> values = {1.5f, -2.0f, 0.25f};
  EncodeFloats(DT_BFLOAT16, values.data(), 3, reinterpret_cast<char*>(halves.data()));
  TensorChunk c = Chunk("h", "", {3}, 0, {});
  c.set_dtype(DT_BFLOAT16);
  // A sink of 3 values of `dtype` (zeros in `h`), checked for NaN into
  // *nan_h unless that is null, given `wire` in place as two chunks one
  // after the other (2 and 1 values); where it borrowed (or null).
  auto borrow_in_two = [&](DataType dtype, const std::vector<uint16_t>& wire, std::vector<float>* h,
                           bool* nan_h) -> const void* {
    h->assign(3, 0.0f);
    const void* borrow_h = nullptr;
    TensorSink sink_h{"h", "", {3}, h->data(), true, dtype};
    sink_h.borrow = &borrow_h;
    sink_h.non_finite = nan_h;
    ChunkAssembler sixteen({sink_h});
    TensorChunk d = Chunk("h", "", {3}, 0, {});
    d.set_dtype(dtype);
    EXPECT_TRUE(
        sixteen.AddInPlace(d, 4, reinterpret_cast<const char*>(wire.data()), &completed).ok());
    d.set_offset(4);
    EXPECT_TRUE(
        sixteen.AddInPlace(d, 2, reinterpret_cast<const char*>(wire.data() + 2), &completed).ok());
    return borrow_h;
  };
  for (const bool checked : {false, true}) {
    std::vector<float> h;
    bool nan_h = false;
    EXPECT_EQ(borrow_in_two(DT_BFLOAT16, halves, &h, checked ? &nan_h : nullptr), halves.data());
    EXPECT_THAT(h, ElementsAre(0, 0, 0));
    EXPECT_FALSE(nan_h);
  }
  // A 16-bit NaN or infinity left in place is seen, in either format, in
  // either chunk.
  for (const DataType dtype : {DT_BFLOAT16, DT_HALF}) {
    for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
      for (int at = 0; at < 3; ++at) {
        std::vector<float> with_bad = values;
        with_bad[at] = bad;
        std::vector<uint16_t> wire(3);
        EncodeFloats(dtype, with_bad.data(), 3, reinterpret_cast<char*>(wire.data()));
        std::vector<float> h;
        bool nan_h = false;
        EXPECT_EQ(borrow_in_two(dtype, wire, &h, &nan_h), wire.data());
        EXPECT_TRUE(nan_h) << DataType_Name(dtype) << " " << bad << " at " << at;
      }
    }
  }
  // One left in place, then one that does not follow: the first is decoded too.
  std::vector<uint16_t> elsewhere = {halves[2]};
  std::vector<float> h(3, 0.0f);
  const void* borrow_h = nullptr;
  TensorSink sink_h{"h", "", {3}, h.data(), true, DT_BFLOAT16};
  sink_h.borrow = &borrow_h;
  ChunkAssembler split({sink_h});
  c.set_offset(0);
  ASSERT_TRUE(
      split.AddInPlace(c, 4, reinterpret_cast<const char*>(halves.data()), &completed).ok());
  c.set_offset(4);
  ASSERT_TRUE(
      split.AddInPlace(c, 2, reinterpret_cast<const char*>(elsewhere.data()), &completed).ok());
  EXPECT_EQ(borrow_h, nullptr);
  EXPECT_THAT(h, ElementsAre(1.5f, -2.0f, 0.25f));
}

// The value `v` becomes after a trip through `dtype`.
float OnWire(DataType dtype, float v) {
  if (dtype == DT_BFLOAT16) return Bfloat16ToFloat(FloatToBfloat16(v));
  if (dtype == DT_HALF) return HalfToFloat(FloatToHalf(v));
  return v;
}

// A 16-bit chunk of `values` encoded as `dtype`.
TensorChunk Chunk16(DataType dtype, const std::string& name, std::vector<int64_t> shape,
                    int64_t offset, const std::vector<float>& values) {
  TensorChunk c = Chunk(name, "", std::move(shape), offset, {});
  c.set_dtype(dtype);
  c.mutable_data()->resize(values.size() * 2);
  EncodeFloats(dtype, values.data(), static_cast<int64_t>(values.size()), c.mutable_data()->data());
  return c;
}

struct SixteenBitCase {
  DataType dtype;
  size_t max_bytes;
};

class SixteenBitRoundTripTest : public ::testing::TestWithParam<SixteenBitCase> {};

TEST_P(SixteenBitRoundTripTest, SplitEncodesAssembleDecodes) {
  const DataType dtype = GetParam().dtype;
  const size_t max_bytes = GetParam().max_bytes;
  // Values that 16 bits cannot hold exactly; an odd element count; a tensor
  // of one element; an empty one.
  const std::vector<int64_t> big_shape = {301, 7};
  const std::vector<float> big = Iota(301 * 7, 0.3337f);
  const std::vector<float> one = {1.0f / 3};
  const std::vector<float> empty;
  ChunkSplitter splitter({{"big", "", big_shape, big.data(), dtype},
                          {"one", "", {1}, one.data(), dtype},
                          {"empty", "", {0}, empty.data(), dtype}},
                         max_bytes);
  std::vector<float> big_out(big.size(), -1), one_out(1, -1), empty_out;
  ChunkAssembler assembler({{"big", "", big_shape, big_out.data(), true, dtype},
                            {"one", "", {1}, one_out.data(), true, dtype},
                            {"empty", "", {0}, empty_out.data(), true, dtype}});
  google::protobuf::RepeatedPtrField<TensorChunk> group;
  int64_t big_bytes = 0, big_chunks = 0, groups = 0;
  while (splitter.Next(&group)) {
    ++groups;
    size_t group_bytes = 0;
    for (const TensorChunk& c : group) {
      EXPECT_EQ(c.dtype(), dtype);
      EXPECT_EQ(c.data().size() % 2, 0u) << "chunks are cut on whole 16-bit elements";
      group_bytes += c.data().size();
      if (c.name() == "big") {
        // Offsets count bytes of the 16-bit encoding.
        EXPECT_EQ(c.offset(), big_bytes);
        big_bytes += static_cast<int64_t>(c.data().size());
        ++big_chunks;
        // Each chunk holds the encoding of its own elements.
        uint16_t first;
        std::memcpy(&first, c.data().data(), 2);
        const float v = big[c.offset() / 2];
        EXPECT_EQ(first, dtype == DT_HALF ? FloatToHalf(v) : FloatToBfloat16(v));
      }
      absl::Status added = assembler.Add(c);
      ASSERT_TRUE(added.ok()) << added;
    }
    EXPECT_LE(group_bytes, max_bytes);
    group.Clear();
    ASSERT_LT(groups, 1'000'000);
  }
  EXPECT_EQ(big_bytes, 301 * 7 * 2) << "half the bytes of fp32";
  EXPECT_GE(big_chunks, static_cast<int64_t>(301 * 7 * 2 / max_bytes));
  absl::Status finished = assembler.Finish();
  ASSERT_TRUE(finished.ok()) << finished;
  for (size_t i = 0; i < big.size(); ++i) ASSERT_EQ(big_out[i], OnWire(dtype, big[i])) << i;
  EXPECT_NE(big_out, big) << "the values went through 16 bits";
  EXPECT_EQ(one_out[0], OnWire(dtype, one[0]));
}

// Odd budgets cut tensors at element boundaries that are not multiples of 4
// bytes (5 and 6: two and three elements per group).
INSTANTIATE_TEST_SUITE_P(Budgets, SixteenBitRoundTripTest,
                         ::testing::Values(SixteenBitCase{DT_BFLOAT16, 5},
                                           SixteenBitCase{DT_BFLOAT16, 1001},
                                           SixteenBitCase{DT_HALF, 6}, SixteenBitCase{DT_HALF, 999},
                                           SixteenBitCase{DT_HALF, 1 << 20}),
                         [](const ::testing::TestParamInfo<SixteenBitCase>& info) {
                           return DataType_Name(info.param.dtype) + "_" +
                                  std::to_string(info.param.max_bytes);
                         });

TEST(SixteenBitTest, ChunksAtOddElementBoundaries) {
  // A 16-bit tensor of 5 elements in chunks of 3 and 2: the second starts at
  // byte 6 (element 3), which no fp32 chunking would produce.
  const std::vector<float> v = {1.0f, -2.5f, 65504.0f, 0.1f, 70000.0f};
  std::vector<float> out(5, 0.0f);
  ChunkAssembler assembler({{"v", "", {5}, out.data(), true, DT_HALF}});
  ASSERT_TRUE(assembler.Add(Chunk16(DT_HALF, "v", {5}, 0, {v[0], v[1], v[2]})).ok());
  EXPECT_FALSE(assembler.Finish().ok());
  absl::Status s = assembler.Add(Chunk16(DT_HALF, "v", {5}, 4, {v[3], v[4]}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("expected byte 6"));
  ASSERT_TRUE(assembler.Add(Chunk16(DT_HALF, "v", {5}, 6, {v[3], v[4]})).ok());
  ASSERT_TRUE(assembler.Finish().ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.5f);
  EXPECT_EQ(out[2], 65504.0f);
  EXPECT_EQ(out[3], HalfToFloat(FloatToHalf(0.1f)));
  EXPECT_NE(out[3], 0.1f);
  EXPECT_TRUE(std::isinf(out[4])) << "beyond fp16's range";
}

TEST(SixteenBitTest, WrongDtypeRefused) {
  std::vector<float> out(4, 0.0f);
  const std::vector<float> v = {1, 2, 3, 4};
  {
    // An fp32 chunk where bf16 is expected, and fp16 where bf16 is.
    ChunkAssembler assembler({{"w", "", {4}, out.data(), true, DT_BFLOAT16}});
    absl::Status s = assembler.Add(Chunk("w", "", {4}, 0, {1, 2}));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("DT_FLOAT, expected DT_BFLOAT16"));
    s = assembler.Add(Chunk16(DT_HALF, "w", {4}, 0, v));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("DT_HALF, expected DT_BFLOAT16"));
    EXPECT_EQ(out, std::vector<float>(4, 0.0f)) << "nothing written";
  }
  {
    // A 16-bit chunk where fp32 is expected (a ps fed 16-bit Init data).
    ChunkAssembler assembler({{"w", "", {4}, out.data()}});
    absl::Status s = assembler.Add(Chunk16(DT_BFLOAT16, "w", {4}, 0, v));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("DT_BFLOAT16, expected DT_FLOAT"));
  }
  {
    // A partial element, and more elements than the tensor holds.
    ChunkAssembler assembler({{"w", "", {4}, out.data(), true, DT_HALF}});
    TensorChunk c = Chunk16(DT_HALF, "w", {4}, 0, {1, 2});
    c.mutable_data()->resize(3);
    EXPECT_EQ(assembler.Add(c).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(assembler.Add(Chunk16(DT_HALF, "w", {4}, 0, {1, 2, 3, 4, 5})).code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(assembler.Add(Chunk16(DT_HALF, "w", {4}, 0, v)).ok());
    EXPECT_TRUE(assembler.Finish().ok());
    EXPECT_EQ(out, v);
  }
}

TEST(SixteenBitTest, SinksDtype) {
  float x = 0;
  EXPECT_EQ(*SinksDtype({}), DT_FLOAT);
  EXPECT_EQ(*SinksDtype({{"a", "", {1}, &x, true, DT_HALF}, {"b", "", {1}, &x, true, DT_HALF}}),
            DT_HALF);
  EXPECT_EQ(SinksDtype({{"a", "", {1}, &x, true, DT_HALF}, {"b", "", {1}, &x}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SinksDtype({{"a", "", {1}, &x, true, DT_INVALID}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow
