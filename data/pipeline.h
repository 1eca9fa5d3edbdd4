// The streaming input of a worker: its share of a data set's records, read
// in an order drawn per epoch, shuffled through a bounded buffer, decoded on
// a pool of its own and handed out in batches, a bounded number read ahead.
//
// Which records a worker reads (AssignPieces): whole files, file i to worker
// i mod num_workers, when that gives every worker at least 90% of an even
// share (enough files of like sizes); else an equal range of all records,
// the files taken in order (a worker then skips to its first record). Each epoch the
// worker visits its pieces in an order drawn from (seed, epoch, worker) and
// passes the records through a shuffle buffer of `shuffle_buffer` records
// drawn from the same seed, so an epoch's sequence of batches is a pure
// function of (seed, epoch, worker): a restored job that asks for batch p of
// an epoch gets what it would have got, at the cost of reading (not
// decoding) the records of batches 0..p-1 again.
//
// Memory: the shuffle buffer's records, plus prefetch_batches + 1 decoded
// batches and their records. Nothing else grows with the data set.
//
// Thread-safety: Get is called from one thread (the training thread); the
// reader thread and the decode pool are the pipeline's own.
#ifndef PSFLOW_DATA_PIPELINE_H_
#define PSFLOW_DATA_PIPELINE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "data/reader.h"

namespace psflow::data {

// Records [first, first + count) of file `file`.
struct Piece {
  int64_t file = 0, first = 0, count = 0;
};

// The pieces worker `worker` of `num_workers` reads, for files holding
// `records[i]` records each (see the header comment).
std::vector<Piece> AssignPieces(const std::vector<int64_t>& records, int num_workers, int worker);
int64_t RecordsOf(const std::vector<Piece>& pieces);
// The fewest records any worker reads: every worker takes as many batches
// per epoch as this allows, so that all make the same number of steps.
int64_t SmallestShare(const std::vector<int64_t>& records, int num_workers);

// A 64-bit mix of two values (splitmix64's finalizer over a ^ rotated b):
// the seeds of epochs, workers and examples. The same on every platform.
uint64_t MixSeed(uint64_t a, uint64_t b);

struct PipelineOptions {
  int num_workers = 1;
  int worker = 0;
  uint64_t seed = 0;
  int64_t batch = 1;  // examples per batch
  // Batches per epoch; 0: as many whole batches as the worker's share holds.
  int64_t batches_per_epoch = 0;
  // Training: pieces visited in a drawn order, records shuffled through
  // shuffle_buffer records (0 or 1: none), examples augmented. Otherwise
  // pieces and records in file order and the evaluation transform.
  bool train = true;
  int shuffle_buffer = 0;
  int prefetch_batches = 2;  // >= 1
  int threads = 1;           // decode threads, >= 1
};

struct Batch {
  std::vector<float> images;  // batch * example_floats
  std::vector<uint64_t> ids;  // batch * example_ids (DataFormat)
  std::vector<int32_t> labels;
};

class Pipeline {
 public:
  // INVALID_ARGUMENT for options out of range and for a share of the data
  // smaller than batches_per_epoch batches (naming both).
  static absl::StatusOr<std::unique_ptr<Pipeline>> Create(const DataFormat* format,
                                                          const PipelineOptions& options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Batch `position` of `epoch`, valid until the next call. The batch after
  // the last one asked for is the one read ahead; any other restarts the
  // reading there. Errors: a record that cannot be read or decoded (naming
  // its file), a file holding fewer records than counted.
  absl::StatusOr<const Batch*> Get(int64_t epoch, int64_t position);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t share_records() const { return share_records_; }
  // Corrupt records passed over so far (DataConfig.skip_bad_records).
  int64_t bad_records() const { return bad_records_.load(); }
  // Time Get spent waiting for batches not ready yet.
  absl::Duration waited() const { return waited_; }

 private:
  struct Slot;
  Pipeline(const DataFormat* format, const PipelineOptions& options, std::vector<Piece> pieces,
           int64_t batches_per_epoch);
  void Start(int64_t epoch, int64_t position);
  void Stop();
  void Read(int64_t epoch, int64_t position);
  absl::Status ReadEpoch(int64_t epoch, int64_t position);
  Slot* FreeSlot();
  void Decode(Slot* slot, int index, uint64_t seed);
  void Finish(Slot* slot, const absl::Status& s);

  const DataFormat* const format_;
  const PipelineOptions options_;
  const std::vector<Piece> pieces_;
  const int64_t share_records_;
  const int64_t batches_per_epoch_;
  std::vector<std::unique_ptr<Slot>> slots_;
  ThreadPool pool_;

  absl::Mutex mu_;
  std::vector<Slot*> free_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot*> ready_ ABSL_GUARDED_BY(mu_);  // in batch order, decoded or not
  bool cancel_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status read_error_ ABSL_GUARDED_BY(mu_);
  std::thread reader_;

  // The training thread's.
  Slot* handed_out_ = nullptr;
  int64_t next_epoch_ = -1, next_position_ = -1;
  absl::Duration waited_;
  std::atomic<int64_t> bad_records_{0};
};

}  // namespace psflow::data

#endif  // PSFLOW_DATA_PIPELINE_H_
