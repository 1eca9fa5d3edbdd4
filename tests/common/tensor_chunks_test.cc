#include "common/tensor_chunks.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

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

}  // namespace
}  // namespace psflow
