#include "ps/embedding/sharding.h"

namespace psflow::ps::embedding {

int64_t Sharding::LocalRows(int ps_index) const {
  if (!fixed() || ps_index >= rows_) return 0;
  return (rows_ - ps_index + num_ps_ - 1) / num_ps_;
}

}  // namespace psflow::ps::embedding
