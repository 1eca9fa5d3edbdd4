#include "common/placement.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/tensor_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow {
namespace {

using ::testing::HasSubstr;

// The built-in cnn model's variables (model/spec.cc).
std::vector<VariableShape> CnnVariables() {
  return {{"conv1/weights", {20, 1, 5, 5}},  {"conv1/bias", {20}},
          {"conv2/weights", {50, 20, 5, 5}}, {"conv2/bias", {50}},
          {"fc1/weights", {500, 800}},       {"fc1/bias", {500}},
          {"fc2/weights", {10, 500}},        {"fc2/bias", {10}}};
}

int64_t Bytes(const VariableShape& v) { return NumElements(v.shape) * 4; }

int64_t TotalBytes(const std::vector<VariableShape>& vars) {
  int64_t total = 0;
  for (const VariableShape& v : vars) total += Bytes(v);
  return total;
}

// Checks the invariants every placement must hold: one entry per variable in
// model order, slices disjoint, ordered by row and covering every row, each on
// a valid ps; and that SlicesOnPs/BytesPerPs agree with the slices.
void ExpectWellFormed(const Placement& p, const std::vector<VariableShape>& vars, int num_ps) {
  ASSERT_EQ(p.num_ps(), num_ps);
  ASSERT_EQ(p.variable_size(), static_cast<int>(vars.size()));
  for (size_t i = 0; i < vars.size(); ++i) {
    const VariablePlacement& v = p.variable(static_cast<int>(i));
    SCOPED_TRACE(v.name());
    EXPECT_EQ(v.name(), vars[i].name);
    EXPECT_EQ(std::vector<int64_t>(v.shape().begin(), v.shape().end()), vars[i].shape);
    ASSERT_GE(v.slice_size(), 1);
    int64_t next_row = 0;
    for (int k = 0; k < v.slice_size(); ++k) {
      const VariableSlice& s = v.slice(k);
      EXPECT_EQ(s.row_begin(), next_row) << "slices must be contiguous and ordered";
      EXPECT_LT(s.row_begin(), s.row_end()) << "no empty slices";
      EXPECT_GE(s.ps(), 0);
      EXPECT_LT(s.ps(), num_ps);
      // A split variable's slices are dealt to the ps in turn.
      if (v.slice_size() > 1) {
        EXPECT_EQ(s.ps(), k % num_ps) << "slice " << k;
      }
      next_row = s.row_end();
    }
    EXPECT_EQ(next_row, vars[i].shape[0]) << "slices must cover every row";
    if (v.slice_size() > 1) {
      EXPECT_GE(v.slice_size(), std::min<int64_t>(num_ps, vars[i].shape[0]))
          << "a split variable has a slice on every ps (rows allowing)";
    }
  }

  // Reassemble every variable from SlicesOnPs: each float covered exactly once.
  std::vector<std::vector<int>> covered(vars.size());
  for (size_t i = 0; i < vars.size(); ++i) covered[i].assign(NumElements(vars[i].shape), 0);
  std::vector<int64_t> bytes = BytesPerPs(p);
  ASSERT_EQ(bytes.size(), static_cast<size_t>(num_ps));
  int64_t total = 0;
  for (int ps = 0; ps < num_ps; ++ps) {
    int64_t on_ps = 0;
    for (const SliceRef& s : SlicesOnPs(p, ps)) {
      ASSERT_GE(s.variable_index, 0);
      ASSERT_LT(s.variable_index, static_cast<int>(vars.size()));
      const VariableShape& v = vars[s.variable_index];
      EXPECT_EQ(s.name, v.name);
      EXPECT_EQ(s.variable_shape, v.shape);
      ASSERT_EQ(s.slice_shape.size(), v.shape.size());
      EXPECT_EQ(s.slice_shape[0], s.row_end - s.row_begin);
      for (size_t d = 1; d < v.shape.size(); ++d) EXPECT_EQ(s.slice_shape[d], v.shape[d]);
      const int64_t row_floats = NumElements(v.shape) / v.shape[0];
      EXPECT_EQ(s.float_offset, s.row_begin * row_floats);
      const int64_t n = NumElements(s.slice_shape);
      for (int64_t k = 0; k < n; ++k) ++covered[s.variable_index][s.float_offset + k];
      on_ps += n * 4;
    }
    EXPECT_EQ(bytes[ps], on_ps) << "ps " << ps;
    total += bytes[ps];
  }
  EXPECT_EQ(total, TotalBytes(vars));
  for (size_t i = 0; i < vars.size(); ++i) {
    EXPECT_TRUE(std::all_of(covered[i].begin(), covered[i].end(), [](int c) { return c == 1; }))
        << vars[i].name << " is not covered exactly once";
  }
}

// Greedy placement onto the least-loaded ps never widens the gap between the
// fullest and emptiest ps beyond max(gap left by the split variables, largest
// whole variable). Splitting gives the first ps at most one extra row per
// split variable.
int64_t BalanceBound(const std::vector<VariableShape>& vars, int num_ps, int64_t split_bytes) {
  int64_t largest_whole = 0, split_rows = 0;
  for (const VariableShape& v : vars) {
    const bool split = num_ps > 1 && Bytes(v) > split_bytes && v.shape[0] > 1;
    if (split) {
      split_rows += Bytes(v) / v.shape[0];
    } else {
      largest_whole = std::max(largest_whole, Bytes(v));
    }
  }
  return std::max(largest_whole, split_rows);
}

class CnnPlacementTest : public ::testing::TestWithParam<int> {};

TEST_P(CnnPlacementTest, DefaultSplitIsWellFormedAndBalanced) {
  const int num_ps = GetParam();
  const std::vector<VariableShape> vars = CnnVariables();
  absl::StatusOr<Placement> p = PlaceVariables(vars, num_ps);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, num_ps);

  for (size_t i = 0; i < vars.size(); ++i) {
    const VariablePlacement& v = p->variable(static_cast<int>(i));
    SCOPED_TRACE(v.name());
    if (Bytes(vars[i]) > kDefaultSplitBytes) {
      // Only fc1/weights (1.6 MB) is above 256 KiB: one slice per ps, or
      // two on one ps (a slice is at most 1 MiB).
      EXPECT_EQ(v.name(), "fc1/weights");
      const int parts = num_ps == 1 ? 2 : num_ps;
      EXPECT_EQ(v.slice_size(), parts);
      for (const VariableSlice& s : v.slice()) {
        // Rows differ by at most one between slices.
        const int64_t rows = s.row_end() - s.row_begin();
        EXPECT_GE(rows, 500 / parts);
        EXPECT_LE(rows, 500 / parts + 1);
        EXPECT_LE(rows * 800 * 4, kDefaultSliceBytes);
      }
    } else {
      EXPECT_EQ(v.slice_size(), 1);
    }
  }

  const std::vector<int64_t> bytes = BytesPerPs(*p);
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  EXPECT_LE(*hi - *lo, BalanceBound(vars, num_ps, kDefaultSplitBytes));
  if (num_ps > 1) {
    // For the cnn that bound is conv2/weights (100000 bytes): every ps holds
    // within 100 kB of the others, i.e. close to total / num_ps.
    EXPECT_LE(*hi - *lo, 100000);
    EXPECT_GT(*lo, 0);
  }
}

TEST_P(CnnPlacementTest, SmallSplitThresholdSplitsEveryLargeVariable) {
  const int num_ps = GetParam();
  const std::vector<VariableShape> vars = CnnVariables();
  const int64_t split_bytes = 10000;  // conv2/weights, fc1/weights and fc2/weights are above
  absl::StatusOr<Placement> p = PlaceVariables(vars, num_ps, split_bytes, /*slice_bytes=*/0);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, num_ps);
  int split = 0;
  for (size_t i = 0; i < vars.size(); ++i) {
    const VariablePlacement& v = p->variable(static_cast<int>(i));
    if (Bytes(vars[i]) > split_bytes && num_ps > 1) {
      ++split;
      EXPECT_EQ(v.slice_size(), num_ps) << v.name();
    } else {
      EXPECT_EQ(v.slice_size(), 1) << v.name();
    }
  }
  EXPECT_EQ(split, num_ps > 1 ? 3 : 0);
  const std::vector<int64_t> bytes = BytesPerPs(*p);
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  EXPECT_LE(*hi - *lo, BalanceBound(vars, num_ps, split_bytes));
}

TEST_P(CnnPlacementTest, Deterministic) {
  const int num_ps = GetParam();
  absl::StatusOr<Placement> a = PlaceVariables(CnnVariables(), num_ps);
  absl::StatusOr<Placement> b = PlaceVariables(CnnVariables(), num_ps);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
}

INSTANTIATE_TEST_SUITE_P(Ps, CnnPlacementTest, ::testing::Values(1, 2, 3));

TEST(PlacementTest, OnePsHoldsEverythingWholeWithoutASliceLimit) {
  absl::StatusOr<Placement> p =
      PlaceVariables(CnnVariables(), 1, /*split_bytes=*/4, /*slice_bytes=*/0);
  ASSERT_TRUE(p.ok()) << p.status();
  for (const VariablePlacement& v : p->variable()) {
    ASSERT_EQ(v.slice_size(), 1) << v.name();
    EXPECT_EQ(v.slice(0).ps(), 0);
  }
  EXPECT_EQ(SlicesOnPs(*p, 0).size(), CnnVariables().size());
  EXPECT_EQ(BytesPerPs(*p)[0], TotalBytes(CnnVariables()));
}

TEST(PlacementTest, TwoPsExactAssignment) {
  // fc1/weights splits 250/250 rows (800000 bytes each); the rest go largest
  // first onto the least-loaded ps, ties to the lowest index: conv2/weights to
  // ps 0, everything else to ps 1.
  absl::StatusOr<Placement> p = PlaceVariables(CnnVariables(), 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(BytesPerPs(*p), (std::vector<int64_t>{900000, 824320}));
  EXPECT_EQ(p->variable(2).slice(0).ps(), 0);  // conv2/weights
  for (int i : {0, 1, 3, 5, 6, 7})
    EXPECT_EQ(p->variable(i).slice(0).ps(), 1) << p->variable(i).name();
  const VariablePlacement& fc1 = p->variable(4);
  ASSERT_EQ(fc1.slice_size(), 2);
  EXPECT_EQ(fc1.slice(0).row_end(), 250);
}

TEST(PlacementTest, LargeVariablesAreDealtInSlicesOfAtMostSliceBytes) {
  // 4 MiB over 2 ps in slices of at most 1 MiB: four of 128 rows, dealt to
  // ps 0, 1, 0, 1; the small one goes whole to the least loaded (ps 0 on a
  // tie).
  std::vector<VariableShape> vars = {{"big", {512, 2048}}, {"small", {10}}};
  absl::StatusOr<Placement> p = PlaceVariables(vars, 2, kDefaultSplitBytes, 1 << 20);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, 2);
  const VariablePlacement& big = p->variable(0);
  ASSERT_EQ(big.slice_size(), 4);
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(big.slice(k).row_begin(), 128 * k);
    EXPECT_EQ(big.slice(k).ps(), k % 2);
  }
  // Ps 0 holds two slices of "big", told apart by their first row.
  const std::vector<SliceRef> on0 = SlicesOnPs(*p, 0);
  ASSERT_EQ(on0.size(), 3u);
  EXPECT_EQ(on0[0].row_begin, 0);
  EXPECT_EQ(on0[1].row_begin, 256);
  EXPECT_EQ(on0[1].float_offset, 256 * 2048);
  EXPECT_EQ(BytesPerPs(*p), (std::vector<int64_t>{(2 << 20) + 40, 2 << 20}));
  std::vector<float> whole(512 * 2048), small(10);
  const std::vector<TensorSink> sinks = SliceSinks(*p, 0, {whole.data(), small.data()});
  ASSERT_EQ(sinks.size(), 3u);
  EXPECT_EQ(sinks[1].row_begin, 256);
  EXPECT_EQ(sinks[1].data, whole.data() + 256 * 2048);
  EXPECT_EQ(SliceRefs(*p, 0, {whole.data(), small.data()})[1].row_begin, 256);
  // The same slices from 16-bit values that lie in the wire dtype already:
  // each ref points at its first element there, and at no float.
  std::vector<uint16_t> whole16(512 * 2048), small16(10);
  const std::vector<TensorRef> encoded =
      EncodedSliceRefs(*p, 0, {whole16.data(), small16.data()}, DT_BFLOAT16);
  const std::vector<TensorRef> refs =
      SliceRefs(*p, 0, {whole.data(), small.data()}, "", DT_BFLOAT16);
  ASSERT_EQ(encoded.size(), refs.size());
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_EQ(encoded[i].name, refs[i].name);
    EXPECT_EQ(encoded[i].shape, refs[i].shape);
    EXPECT_EQ(encoded[i].row_begin, refs[i].row_begin);
    EXPECT_EQ(encoded[i].dtype, DT_BFLOAT16);
    EXPECT_EQ(encoded[i].slot, "");
    EXPECT_EQ(encoded[i].data, nullptr);
  }
  EXPECT_EQ(encoded[0].encoded, whole16.data());
  EXPECT_EQ(encoded[1].encoded, whole16.data() + 256 * 2048);
  EXPECT_EQ(encoded[2].encoded, small16.data());

  // Three ps: two slices each (six of 85 or 86 rows, each below 1 MiB).
  p = PlaceVariables(vars, 3, kDefaultSplitBytes, 1 << 20);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, 3);
  EXPECT_EQ(p->variable(0).slice_size(), 6);
  // One ps: four slices, all on it.
  p = PlaceVariables(vars, 1, kDefaultSplitBytes, 1 << 20);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, 1);
  EXPECT_EQ(p->variable(0).slice_size(), 4);
  EXPECT_EQ(SlicesOnPs(*p, 0).size(), 5u);
  // No limit: one slice per ps.
  p = PlaceVariables(vars, 2, kDefaultSplitBytes, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->variable(0).slice_size(), 2);
  // Never more slices than rows: 3 rows of 4 MiB each over 2 ps.
  std::vector<VariableShape> tall = {{"tall", {3, 1 << 20}}};
  p = PlaceVariables(tall, 2, kDefaultSplitBytes, 1 << 20);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, tall, 2);
  EXPECT_EQ(p->variable(0).slice_size(), 3);
}

TEST(PlacementTest, FewerRowsThanPs) {
  // 2 rows of 1 MB each over 3 ps: two slices of one row; a large 1-row
  // variable cannot be split and stays whole.
  std::vector<VariableShape> vars = {{"wide", {2, 256 << 10}}, {"row", {1, 256 << 10}}};
  absl::StatusOr<Placement> p = PlaceVariables(vars, 3);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, 3);
  ASSERT_EQ(p->variable(0).slice_size(), 2);
  EXPECT_EQ(p->variable(0).slice(0).row_end() - p->variable(0).slice(0).row_begin(), 1);
  EXPECT_EQ(p->variable(1).slice_size(), 1);
  // The whole one goes to the ps the split left empty.
  EXPECT_EQ(p->variable(1).slice(0).ps(), 2);
}

TEST(PlacementTest, MorePsThanVariables) {
  std::vector<VariableShape> vars = {{"a", {3}}, {"b", {2}}};
  absl::StatusOr<Placement> p = PlaceVariables(vars, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, vars, 4);
  EXPECT_EQ(BytesPerPs(*p), (std::vector<int64_t>{12, 8, 0, 0}));
  EXPECT_TRUE(SlicesOnPs(*p, 3).empty());
}

TEST(PlacementTest, Errors) {
  absl::StatusOr<Placement> p = PlaceVariables(CnnVariables(), 0);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  p = PlaceVariables(CnnVariables(), -1);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);

  std::vector<VariableShape> dup = CnnVariables();
  dup.push_back({"fc1/bias", {7}});
  p = PlaceVariables(dup, 2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("fc1/bias"));

  p = PlaceVariables({{"scalar", {}}}, 2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("scalar"));

  p = PlaceVariables({{"zero", {4, 0}}}, 2);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace psflow
