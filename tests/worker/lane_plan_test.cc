// PlanLanes: lanes of about equal bytes per ps, in the ps's or the backward
// order, and runs cut where gradients become final apart.
#include "worker/lane_plan.h"

#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

struct Slice {
  int ps;
  int64_t row_begin, row_end;
};

// A variable of `rows` x `cols` floats in `slices`.
void AddVariable(Placement* placement, int64_t rows, int64_t cols, std::vector<Slice> slices) {
  VariablePlacement* v = placement->add_variable();
  v->set_name("v" + std::to_string(placement->variable_size() - 1));
  v->add_shape(rows);
  v->add_shape(cols);
  for (const Slice& s : slices) {
    VariableSlice* slice = v->add_slice();
    slice->set_ps(s.ps);
    slice->set_row_begin(s.row_begin);
    slice->set_row_end(s.row_end);
  }
}

// One ps: v0 64 bytes, v1 16, v2 128; the backward pass completes v2 first.
Placement ThreeVariables() {
  Placement p;
  p.set_num_ps(1);
  AddVariable(&p, 4, 4, {{0, 0, 4}});
  AddVariable(&p, 1, 4, {{0, 0, 1}});
  AddVariable(&p, 8, 4, {{0, 0, 8}});
  return p;
}

LanePlanOptions OneLane() {
  LanePlanOptions o;
  o.lane_bytes = int64_t{1} << 30;
  o.min_run_bytes = 0;
  o.backward_pos = {2, 1, 0};
  return o;
}

TEST(LanePlanTest, OneLaneInThePsOrderWithARunPerVariable) {
  const LanePlan plan = PlanLanes(ThreeVariables(), OneLane());
  ASSERT_EQ(plan.lanes.size(), 1u);
  const LaneSpec& lane = plan.lanes[0];
  EXPECT_EQ(lane.ps, 0);
  EXPECT_THAT(lane.slices, ElementsAre(0, 1, 2));
  EXPECT_THAT(lane.variables, ElementsAre(0, 1, 2));
  EXPECT_THAT(lane.run_starts, ElementsAre(0u, 1u, 2u));
  EXPECT_THAT(lane.run_pieces, ElementsAre(Pair(2, 2), Pair(1, 1), Pair(0, 0)));
  EXPECT_EQ(lane.first_piece, 0);
  EXPECT_EQ(lane.last_piece, 2);
  EXPECT_THAT(plan.slices_of, ElementsAre(1, 1, 1));
}

TEST(LanePlanTest, BackwardOrderSortsTheSlicesByWhenTheyBecomeFinal) {
  LanePlanOptions o = OneLane();
  o.backward_order = true;
  const LanePlan plan = PlanLanes(ThreeVariables(), o);
  ASSERT_EQ(plan.lanes.size(), 1u);
  EXPECT_THAT(plan.lanes[0].slices, ElementsAre(2, 1, 0));
  EXPECT_THAT(plan.lanes[0].variables, ElementsAre(2, 1, 0));
  EXPECT_THAT(plan.lanes[0].run_pieces, ElementsAre(Pair(0, 0), Pair(1, 1), Pair(2, 2)));
}

TEST(LanePlanTest, SmallRunsGoOnToTheNextVariable) {
  LanePlanOptions o = OneLane();
  o.backward_order = true;
  o.min_run_bytes = 100;
  // v2 (128 bytes) fills a run; v1 (16) is too small alone and takes v0.
  const LanePlan plan = PlanLanes(ThreeVariables(), o);
  ASSERT_EQ(plan.lanes.size(), 1u);
  EXPECT_THAT(plan.lanes[0].run_starts, ElementsAre(0u, 1u));
  EXPECT_THAT(plan.lanes[0].run_pieces, ElementsAre(Pair(0, 0), Pair(1, 2)));
}

TEST(LanePlanTest, ABucketsVariablesFormRunsOfTheirOwn) {
  LanePlanOptions o = OneLane();
  o.backward_order = true;
  o.min_run_bytes = int64_t{1} << 20;
  o.bucket = {0, 0, -1};  // v0 and v1 become final together; v2 alone
  LanePlan plan = PlanLanes(ThreeVariables(), o);
  ASSERT_EQ(plan.lanes.size(), 1u);
  EXPECT_THAT(plan.lanes[0].run_starts, ElementsAre(0u, 1u));
  EXPECT_THAT(plan.lanes[0].run_pieces, ElementsAre(Pair(0, 0), Pair(1, 2)));
  o.bucket = {1, 0, -1};  // two buckets: never one run, however small
  plan = PlanLanes(ThreeVariables(), o);
  EXPECT_THAT(plan.lanes[0].run_starts, ElementsAre(0u, 1u, 2u));
}

// One ps with four variables of 4 KiB each.
Placement FourEqualVariables() {
  Placement p;
  p.set_num_ps(1);
  for (int i = 0; i < 4; ++i) AddVariable(&p, 64, 16, {{0, 0, 64}});
  return p;
}

TEST(LanePlanTest, LanesOfAboutEqualBytesUpToLanesPerPs) {
  LanePlanOptions o;
  o.backward_pos = {3, 2, 1, 0};
  o.lane_bytes = 4096;
  o.lanes_per_ps = 2;
  LanePlan plan = PlanLanes(FourEqualVariables(), o);
  ASSERT_EQ(plan.lanes.size(), 2u);
  EXPECT_THAT(plan.lanes[0].slices, ElementsAre(0, 1));
  EXPECT_THAT(plan.lanes[1].slices, ElementsAre(2, 3));
  EXPECT_EQ(plan.lanes[1].first_piece, 0);
  EXPECT_EQ(plan.lanes[1].last_piece, 1);
  o.lanes_per_ps = 8;  // no more than the bytes allow: one 4 KiB variable each
  plan = PlanLanes(FourEqualVariables(), o);
  ASSERT_EQ(plan.lanes.size(), 4u);
  for (int l = 0; l < 4; ++l) EXPECT_THAT(plan.lanes[l].slices, ElementsAre(l));
  o.lanes_per_ps = 0;  // at least one
  o.lane_bytes = 0;
  EXPECT_EQ(PlanLanes(FourEqualVariables(), o).lanes.size(), 1u);
}

TEST(LanePlanTest, EveryPsHasLanesOfItsOwnSlices) {
  Placement p;
  p.set_num_ps(3);
  AddVariable(&p, 4, 4, {{0, 0, 2}, {1, 2, 4}});  // split over ps 0 and 1
  AddVariable(&p, 4, 4, {{1, 0, 4}});
  LanePlanOptions o = OneLane();
  o.backward_pos = {1, 0};
  const LanePlan plan = PlanLanes(p, o);
  ASSERT_EQ(plan.lanes.size(), 3u);
  EXPECT_EQ(plan.lanes[0].ps, 0);
  EXPECT_THAT(plan.lanes[0].variables, ElementsAre(0));
  EXPECT_EQ(plan.lanes[1].ps, 1);
  EXPECT_THAT(plan.lanes[1].variables, ElementsAre(0, 1));
  EXPECT_THAT(plan.lanes[1].slices, ElementsAre(0, 1));
  EXPECT_EQ(plan.lanes[2].ps, 2);  // holds nothing: an empty lane
  EXPECT_THAT(plan.lanes[2].slices, IsEmpty());
  EXPECT_THAT(plan.slices_of, ElementsAre(2, 1));
}

}  // namespace
}  // namespace psflow::worker
