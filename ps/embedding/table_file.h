// Snapshot files of embedding tables: each ps writes its shard of each table
// to a file of its own, and a restore reads every file of the table, written
// by any number of ps, keeping the rows the restoring ps owns under its own
// num_ps (sharding.h). So a checkpoint written by 2 ps restores onto 3.
//
// Format (integers little-endian, as the records: EmbeddingShard::record_bytes):
//   header:  "PSFEMBED" (8 bytes), uint32 version (1), uint32 name length,
//            the table name, uint32 dim, uint32 optimizer kind
//            (SparseOptimizerConfig.Kind), uint32 slot floats per row,
//            int64 table rows (EmbeddingTableSpec.rows, 0: dynamic),
//            int64 rows in the file, uint32 masked CRC-32C of all the above
//   blocks:  uint32 rows (> 0), uint32 masked CRC-32C (common/crc32c.h) of
//            the records, then the records: uint64 id (a fixed table's row),
//            int64 last touch, dim floats of value, the slot floats
// The file ends after the header's row count, exactly.
//
// Thread-safe as EmbeddingShard: a shard may be written while it serves
// lookups and updates; each stripe is copied under its lock, so every row in
// the file is whole, but rows of different stripes may be from different
// moments. Write a snapshot between steps for a consistent one.
#ifndef PSFLOW_PS_EMBEDDING_TABLE_FILE_H_
#define PSFLOW_PS_EMBEDDING_TABLE_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/embedding.pb.h"
#include "ps/embedding/table.h"

namespace psflow::ps::embedding {

// Writes `shard` to `path`: a temporary name in the same directory first,
// fsynced and renamed over `path`, so that `path` is whole or absent.
// Errors (INTERNAL) name the file.
absl::Status WriteEmbeddingShard(const EmbeddingShard& shard, const std::string& path);

// A new shard of table `spec` for ps `ps_index` of `num_ps` (as
// EmbeddingShard::Create), holding the rows it owns from the files `paths`
// (every shard file of one snapshot of the table). Rows of a fixed table
// that no file holds keep their initial values. Errors name the file:
// NOT_FOUND (cannot open), DATA_LOSS (truncated, a bad checksum or magic,
// bytes after the last row), FAILED_PRECONDITION (a file of another table,
// dim, optimizer or row count).
absl::StatusOr<std::unique_ptr<EmbeddingShard>> RestoreEmbeddingShard(
    const EmbeddingTableSpec& spec, int num_ps, int ps_index, uint64_t seed,
    const std::vector<std::string>& paths);

}  // namespace psflow::ps::embedding

#endif  // PSFLOW_PS_EMBEDDING_TABLE_FILE_H_
