// One ps's shard of one embedding table (proto/embedding.proto): the rows of
// the ids this ps owns (sharding.h), their optimizer state, and the lookups
// and sparse updates of training.
//
// A fixed table (spec.rows > 0) holds all its rows from the start. A dynamic
// table (spec.rows 0) creates an id's row at a training lookup that admits
// it (EmbeddingTableSpec.admit_*) and drops rows that no training lookup has
// touched for expire_steps (Expire). A row's initial value is a pure function
// of (seed, table name, id), or of the row for a fixed table: the same on any
// ps and at any time, so that a row created again after a restore onto
// another ps count, or after it expired, starts where it would have.
//
// Storage: the shard is cut into kStripes stripes by a hash of the id, each
// with its own lock, so lookups and updates of ids in different stripes run
// concurrently. A stripe keeps its rows in slabs of about 64 KiB, a row's
// record (last touch, values, optimizer state) contiguous, found through an
// id -> position map (dynamic tables; a fixed table's position is computed),
// and reuses the positions of expired rows (slabs never shrink). No
// allocation per row. A stripe's index grows (rehashes) under its lock
// alone, so the memory of a rehash is a 64th of the index's.
//
// Thread-safe: every method may be called from several threads at once. A
// call locks one stripe at a time, so a concurrent call sees each row either
// before or after another call's change to it, never half of it; a Lookup
// and an Apply of the same rows racing each other have no order beyond that.
//
// Errors: bad arguments are INVALID_ARGUMENT, found before anything changes.
#ifndef PSFLOW_PS_EMBEDDING_TABLE_H_
#define PSFLOW_PS_EMBEDDING_TABLE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/embedding.pb.h"
#include "ps/embedding/sharding.h"
#include "ps/embedding/sparse_optimizer.h"

namespace psflow::ps::embedding {

// INVALID_ARGUMENT naming the first bad field of `spec` (its optimizer's
// too), or a dynamic-only field set on a fixed table.
absl::Status ValidateEmbeddingTableSpec(const EmbeddingTableSpec& spec);

class EmbeddingShard {
 public:
  static constexpr int kStripes = 64;

  // The shard of ps `ps_index` of `num_ps`. INVALID_ARGUMENT for a bad spec
  // (ValidateEmbeddingTableSpec) or ps. A fixed table's rows are allocated
  // and initialized here.
  static absl::StatusOr<std::unique_ptr<EmbeddingShard>> Create(const EmbeddingTableSpec& spec,
                                                                int num_ps, int ps_index,
                                                                uint64_t seed);

  // Copies the rows of `ids` into `out` ([ids.size(), dim], row-major).
  // train: a dynamic table creates the rows of admitted ids that have none,
  // and every row read records `step` as its last touch (the largest step
  // seen); an id not admitted reads as zeros. !train: ids without a row
  // read as zeros; nothing is created or touched. An id may appear more
  // than once (each occurrence is a touch). INVALID_ARGUMENT: an id another
  // ps owns (the message names it and its owner), or `out` of the wrong size.
  absl::Status Lookup(absl::Span<const uint64_t> ids, bool train, int64_t step,
                      absl::Span<float> out);

  struct ApplyResult {
    int64_t applied = 0;  // rows updated
    int64_t skipped = 0;  // ids without a row (not admitted, or expired): dropped
  };
  // One step of the table's optimizer (global step `step`) for each id's row
  // with its gradient row of `grads` ([ids.size(), dim]). INVALID_ARGUMENT,
  // before any row changes: an id twice (for a fixed table, two ids of one
  // row: the caller sums them), a non-finite gradient, an id another ps owns,
  // `grads` of the wrong size, a negative step.
  absl::StatusOr<ApplyResult> Apply(absl::Span<const uint64_t> ids, absl::Span<const float> grads,
                                    int64_t step);

  // Dynamic tables with expire_steps > 0: drops the rows whose last touch is
  // more than expire_steps before `step`; returns how many. Else 0.
  int64_t Expire(int64_t step);

  struct Stats {
    int64_t rows = 0;       // rows held
    int64_t row_bytes = 0;  // one row's record: last touch, values, optimizer state
    // Everything the shard has allocated: slabs (free positions included),
    // the id index, the free list and the admission counts.
    int64_t bytes = 0;
    double bytes_per_row = 0;  // bytes / rows (0 when empty)
    int64_t rows_created = 0;  // by training lookups (not restores)
    int64_t rows_expired = 0;
    int64_t rows_restored = 0;
    int64_t admissions_refused = 0;  // training touches of ids left without a row
    // Ids counting touches toward admit_min_count: kept until admitted, so
    // they grow with the distinct ids seen that never reach the count.
    int64_t pending_ids = 0;
    int64_t apply_skipped = 0;
  };
  Stats GetStats() const;

  const EmbeddingTableSpec& spec() const { return spec_; }
  const std::string& name() const { return spec_.name(); }
  int dim() const { return dim_; }
  int slot_floats() const { return slot_floats_; }
  int ps_index() const { return ps_index_; }
  const Sharding& sharding() const { return sharding_; }
  const SparseOptimizer& optimizer() const { return optimizer_; }

  // The initial value of the row of `key` (the id; the row for a fixed
  // table): dim floats into `out`.
  void InitialRow(uint64_t key, float* out) const;

  // For snapshots (table_file.h). A record is: uint64 key (the id; the row
  // for a fixed table), int64 last touch, dim floats of value, slot_floats()
  // floats of state, in the host's byte order (little-endian on the
  // machines psflow runs on).
  int64_t record_bytes() const { return 8 + row_stride_; }
  // Appends stripe `stripe`'s records to `out`; returns how many.
  int64_t ExportStripe(int stripe, std::string* out) const;
  // Stores the records of `records` (whole records) that this shard owns
  // under its sharding, replacing rows it holds; returns how many it kept.
  // INVALID_ARGUMENT for a fixed table's row out of range.
  absl::StatusOr<int64_t> ImportRecords(absl::string_view records);
  // Dynamic tables: sizes the id index for about `rows` rows on this shard,
  // so that growing to them does not rehash (a restore knows its count).
  void Reserve(int64_t rows);

 private:
  struct Stripe {
    mutable absl::Mutex mu;
    absl::flat_hash_map<uint64_t, uint32_t> index ABSL_GUARDED_BY(mu);    // id -> position
    absl::flat_hash_map<uint64_t, uint32_t> pending ABSL_GUARDED_BY(mu);  // id -> touches
    std::vector<std::unique_ptr<char[]>> slabs ABSL_GUARDED_BY(mu);
    uint32_t used ABSL_GUARDED_BY(mu) = 0;  // positions handed out
    std::vector<uint32_t> free ABSL_GUARDED_BY(mu);
    int64_t created ABSL_GUARDED_BY(mu) = 0;
    int64_t expired ABSL_GUARDED_BY(mu) = 0;
    int64_t restored ABSL_GUARDED_BY(mu) = 0;
    int64_t refused ABSL_GUARDED_BY(mu) = 0;
  };
  // Where a key's row is, or would be.
  struct Place {
    int stripe;
    uint32_t pos;  // fixed tables only
  };

  EmbeddingShard(const EmbeddingTableSpec& spec, int num_ps, int ps_index, uint64_t seed,
                 SparseOptimizer optimizer);
  void AllocateFixedRows();
  int FirstStripe();
  absl::Status CheckOwned(absl::Span<const uint64_t> ids) const;
  absl::Status CheckGradients(absl::Span<const uint64_t> ids, absl::Span<const float> grads) const;
  // The key of an id (its row for a fixed table) and where it lives.
  uint64_t Key(uint64_t id) const { return sharding_.fixed() ? sharding_.Row(id) : id; }
  Place PlaceOf(uint64_t key) const;
  // The positions of `ids` grouped by stripe: order[begin[s]..begin[s+1]).
  void GroupByStripe(absl::Span<const uint64_t> ids, std::vector<uint32_t>* order,
                     std::array<uint32_t, kStripes + 1>* begin) const;

  char* RowAt(Stripe& s, uint32_t pos) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  const char* RowAt(const Stripe& s, uint32_t pos) const ABSL_SHARED_LOCKS_REQUIRED(s.mu);
  uint32_t NewPosition(Stripe& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // The row of `key` in stripe `s`, or null. Training may create it.
  char* FindRow(Stripe& s, Place place, uint64_t key, bool train, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // FindRow for ids[group[k]] into (*rows)[k].
  void FindRows(Stripe& s, absl::Span<const uint64_t> ids, absl::Span<const uint32_t> group,
                bool train, int64_t step, std::vector<char*>* rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Calls fn(s, group, rows) once for each stripe s holding some of `ids`,
  // under s's lock, the walk starting at FirstStripe(): `group` are the
  // positions in `ids` of s's ids and rows[k] is the row of ids[group[k]]
  // (FindRows with `train` and `step`).
  template <typename Fn>
  void ForEachStripe(absl::Span<const uint64_t> ids, bool train, int64_t step, Fn&& fn);
  bool Admit(Stripe& s, uint64_t id, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  void InitRecord(uint64_t key, int64_t touch, char* row) const;
  int64_t ExpireStripe(Stripe& s, int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // One record of `key`, which this shard owns.
  void ImportRecord(Stripe& s, uint64_t key, const char* record)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);

  const EmbeddingTableSpec spec_;
  const Sharding sharding_;
  const int ps_index_;
  const uint64_t seed_;
  const SparseOptimizer optimizer_;
  const int dim_;
  const int slot_floats_;
  const int64_t row_stride_;  // bytes of a row in a slab: int64 touch, then floats
  const int slab_shift_;      // a slab holds 1 << slab_shift_ rows
  const float init_scale_;
  const uint64_t name_hash_;  // FNV-1a of the table name: seeds initial values
  // Where the next Lookup or Apply starts its walk over the stripes: calls
  // that start apart do not queue behind each other stripe after stripe. A
  // hint only; any value is correct.
  std::atomic<uint32_t> next_first_stripe_{0};
  std::atomic<int64_t> apply_skipped_{0};  // Stats::apply_skipped
  std::array<Stripe, kStripes> stripes_;
};

}  // namespace psflow::ps::embedding

#endif  // PSFLOW_PS_EMBEDDING_TABLE_H_
