#include "worker/lane_plan.h"

#include <algorithm>
#include <numeric>

#include "common/placement.h"

namespace psflow::worker {
namespace {

// Cuts ps `p`'s slices (in `order`) into lanes appended to `plan`.
// `ready_group`: by variable, equal values become final together; negative
// ones are buckets.
void PlanPs(int p, const std::vector<SliceRef>& slices, const std::vector<int>& order,
            const std::vector<int>& ready_group, const LanePlanOptions& options, LanePlan* plan) {
  const std::vector<int>& pos = options.backward_pos;
  std::vector<LaneSpec>& lanes = plan->lanes;
  int64_t bytes = 0;
  for (const SliceRef& r : slices) bytes += NumElements(r.slice_shape) * sizeof(float);
  const int64_t count = std::clamp<int64_t>(bytes / std::max<int64_t>(options.lane_bytes, 1), 1,
                                            std::max(options.lanes_per_ps, 1));
  const size_t first = lanes.size();
  lanes.emplace_back().ps = p;
  int64_t so_far = 0;
  int64_t run_bytes = 0;  // in the lane's last run
  for (const int i : order) {
    // A new lane once this one holds its share (and slices remain for it).
    const int64_t filled = static_cast<int64_t>(lanes.size() - first);
    if (so_far * count >= bytes * filled && !lanes.back().slices.empty())
      lanes.emplace_back().ps = p;
    LaneSpec& lane = lanes.back();
    const int v = slices[i].variable_index;
    // A new run where the slice becomes final apart from the one before,
    // unless the run so far is a CPU's and smaller than min_run_bytes.
    const int64_t slice_bytes = NumElements(slices[i].slice_shape) * sizeof(float);
    const int before = lane.variables.empty() ? -1 : lane.variables.back();
    if (lane.slices.empty() ||
        (ready_group[v] != ready_group[before] &&
         (ready_group[v] < 0 || ready_group[before] < 0 || run_bytes >= options.min_run_bytes))) {
      lane.run_starts.push_back(lane.slices.size());
      lane.run_pieces.emplace_back(pos[v], pos[v]);
      run_bytes = 0;
    }
    run_bytes += slice_bytes;
    auto& [run_first, run_last] = lane.run_pieces.back();
    run_first = std::min(run_first, pos[v]);
    run_last = std::max(run_last, pos[v]);
    lane.first_piece = lane.slices.empty() ? pos[v] : std::min(lane.first_piece, pos[v]);
    lane.last_piece = std::max(lane.last_piece, pos[v]);
    lane.slices.push_back(i);
    lane.variables.push_back(v);
    ++plan->slices_of[v];
    so_far += slice_bytes;
  }
}

}  // namespace

LanePlan PlanLanes(const Placement& placement, const LanePlanOptions& options) {
  LanePlan plan;
  plan.slices_of.assign(placement.variable_size(), 0);
  // Variables whose gradients become final together: a bucket's, else each
  // alone (its own backward position).
  std::vector<int> ready_group(options.backward_pos);
  for (size_t v = 0; v < options.bucket.size(); ++v) {
    if (options.bucket[v] >= 0) ready_group[v] = -1 - options.bucket[v];
  }
  for (int p = 0; p < placement.num_ps(); ++p) {
    const std::vector<SliceRef> slices = SlicesOnPs(placement, p);
    std::vector<int> order(slices.size());
    std::iota(order.begin(), order.end(), 0);
    if (options.backward_order) {
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return options.backward_pos[slices[a].variable_index] <
               options.backward_pos[slices[b].variable_index];
      });
    }
    PlanPs(p, slices, order, ready_group, options, &plan);
  }
  return plan;
}

}  // namespace psflow::worker
