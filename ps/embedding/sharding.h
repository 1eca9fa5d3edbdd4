// Which ps owns an embedding id: a fixed, documented rule, so that workers,
// the chief, restores onto another ps count and programs outside psflow can
// compute it. Ids are unsigned 64-bit: an int64 id on the wire is read as its
// two's-complement bits (a span of int64_t may be passed on as uint64_t by
// reinterpret_cast: the signed and unsigned types may alias).
//
// Dynamic tables (EmbeddingTableSpec.rows 0):
//   owner = SplitMix64(id) mod num_ps
// where SplitMix64 is the finalizer of Steele, Lea and Flood's SplitMix64
// (all arithmetic mod 2^64):
//   x += 0x9E3779B97F4A7C15
//   x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
//   x = (x ^ (x >> 27)) * 0x94D049BB133111EB
//   x = x ^ (x >> 31)
// Fixed tables of R rows:
//   row = id mod R, owner = row mod num_ps, local index = row div num_ps
// so ps p holds the rows p, p + num_ps, p + 2 num_ps, ... in that order.
//
// Pure functions, thread-safe.
#ifndef PSFLOW_PS_EMBEDDING_SHARDING_H_
#define PSFLOW_PS_EMBEDDING_SHARDING_H_

#include <cstdint>

namespace psflow::ps::embedding {

// The SplitMix64 finalizer above (0 gives 0xE220A8397B1DCDAF).
constexpr uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The rule for one table over num_ps servers. `rows` is the table's
// EmbeddingTableSpec.rows (0: dynamic); num_ps must be > 0 and rows >= 0
// (the caller validates the spec).
class Sharding {
 public:
  Sharding(int64_t rows, int num_ps) : rows_(rows), num_ps_(num_ps) {}

  bool fixed() const { return rows_ > 0; }
  int num_ps() const { return num_ps_; }

  // The ps that owns `id`.
  int Owner(uint64_t id) const {
    const uint64_t n = static_cast<uint64_t>(num_ps_);
    return static_cast<int>(fixed() ? Row(id) % n : SplitMix64(id) % n);
  }
  // Fixed tables: the row of `id`, in [0, rows).
  uint64_t Row(uint64_t id) const { return id % static_cast<uint64_t>(rows_); }
  // Fixed tables: the index of `row` among its owner's rows.
  int64_t LocalIndex(uint64_t row) const {
    return static_cast<int64_t>(row / static_cast<uint64_t>(num_ps_));
  }
  // Fixed tables: how many rows ps `ps_index` holds.
  int64_t LocalRows(int ps_index) const;

 private:
  int64_t rows_;
  int num_ps_;
};

}  // namespace psflow::ps::embedding

#endif  // PSFLOW_PS_EMBEDDING_SHARDING_H_
