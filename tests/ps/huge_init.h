// The Init header of a job too big to load (tests/ps/service_test.cc and
// tests/integration/attack_test.cc send it alone, with no data after it).
#ifndef PSFLOW_TESTS_PS_HUGE_INIT_H_
#define PSFLOW_TESTS_PS_HUGE_INIT_H_

#include <cstdint>

#include "proto/ps.pb.h"

namespace psflow::ps {

// Job `job_id` of worker 0, under its own placement: one variable "huge" of
// 16384 x 16384 floats (1 GiB of values, and 2 GiB of Adam's slots), whole
// on ps 0 of 1. A ps that read it must allocate nothing until the data come.
inline InitHeader HugeInitHeader(uint64_t job_id) {
  constexpr int64_t kRows = 16384, kColumns = 16384;
  InitHeader h;
  h.set_job_id(job_id);
  h.set_ps_index(0);
  h.mutable_job()->mutable_optimizer()->set_kind(OptimizerConfig::ADAM);
  h.mutable_job()->mutable_optimizer()->set_learning_rate(0.001f);
  h.add_live_workers(0);
  Placement* placement = h.mutable_job()->mutable_placement();
  placement->set_num_ps(1);
  VariablePlacement* v = placement->add_variable();
  v->set_name("huge");
  SliceSpec* spec = h.add_slice();
  spec->set_name("huge");
  for (int64_t d : {kRows, kColumns}) {
    v->add_shape(d);
    spec->add_shape(d);
  }
  v->add_slice()->set_row_end(kRows);
  spec->set_row_end(kRows);
  return h;
}

}  // namespace psflow::ps

#endif  // PSFLOW_TESTS_PS_HUGE_INIT_H_
