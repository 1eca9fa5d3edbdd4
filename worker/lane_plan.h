// Which slices of which ps travel together in a lane (a run of consecutive
// slices of one ps, pulled and pushed on its own connection), and how each
// lane's slices are cut into runs that become final together during the
// backward pass. A pure function of the placement and the options:
// PsExchange::MakeLanes attaches the buffers (worker/ps_exchange.h).
//
// Thread-safety: no state. Errors: none (every input gives a plan).
#ifndef PSFLOW_WORKER_LANE_PLAN_H_
#define PSFLOW_WORKER_LANE_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "proto/job.pb.h"

namespace psflow::worker {

struct LanePlanOptions {
  // A ps's slices travel in at most this many lanes, of at least
  // lane_bytes (counted as fp32) each.
  int lanes_per_ps = 4;
  int64_t lane_bytes = int64_t{1} << 20;
  // A run of a lane's slices goes on to the next variable while it holds
  // fewer than this many bytes, unless one of the two is in a bucket
  // (`bucket`). 0: a run per variable.
  int64_t min_run_bytes = int64_t{256} << 10;
  // By variable: its position in the order the backward pass completes the
  // variables (every variable; a permutation of 0..n-1).
  std::vector<int> backward_pos;
  // By variable: the bucket whose gradients become final together (a GPU's
  // copies to the host), or -1 (or empty: none) for a variable final alone.
  // A bucket's variables form runs of their own, whatever their size.
  std::vector<int> bucket;
  // Each ps's slices in the backward order (pushing during the backward
  // pass: each lane waits for one stretch of it), else in the ps's order.
  bool backward_order = false;
};

// Consecutive slices of one ps that travel together.
struct LaneSpec {
  int ps = 0;
  std::vector<int> slices;     // indices into SlicesOnPs(placement, ps)
  std::vector<int> variables;  // the variable of each slice
  // The first and last backward positions of its slices' variables.
  int first_piece = 0, last_piece = -1;
  // Its runs: where each starts in `slices`, and the first and last
  // backward positions of its variables.
  std::vector<size_t> run_starts;
  std::vector<std::pair<int, int>> run_pieces;
};

struct LanePlan {
  std::vector<LaneSpec> lanes;  // every ps's, in ps order
  std::vector<int> slices_of;   // by variable: its number of slices
};

// Cuts each ps's slices into lanes of about the same bytes.
LanePlan PlanLanes(const Placement& placement, const LanePlanOptions& options);

}  // namespace psflow::worker

#endif  // PSFLOW_WORKER_LANE_PLAN_H_
