#include "data/pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace psflow::data {

struct Pipeline::Slot {
  Batch batch;
  std::vector<Record> records;
  // Under the pipeline's mu_: decodes not finished, and the first error.
  int pending = 0;
  absl::Status status;
};

namespace {

// Draws from a counter run through MixSeed: the same sequence everywhere.
class Draws {
 public:
  explicit Draws(uint64_t seed) : state_(seed) {}
  // Uniform in [0, n), n > 0.
  uint64_t Below(uint64_t n) {
    state_ += 0x9E3779B97F4A7C15ull;
    return static_cast<uint64_t>((static_cast<unsigned __int128>(MixSeed(state_, 0)) * n) >> 64);
  }

 private:
  uint64_t state_;
};

template <typename T>
void Permute(std::vector<T>* v, Draws* draws) {
  for (size_t i = v->size(); i > 1; --i) std::swap((*v)[i - 1], (*v)[draws->Below(i)]);
}

// The records of one epoch of a worker: its pieces in the given order,
// through a shuffle buffer of `buffer` records (0 or 1: none). Records of a
// file lost to corruption (skipped and counted by its stream) leave the
// epoch short; it then goes on from its first piece again, as a sampler pads
// a share, so every epoch has the same number of batches.
class EpochRecords {
 public:
  EpochRecords(const DataFormat& format, std::vector<Piece> pieces, int buffer, uint64_t seed,
               std::atomic<int64_t>* bad_records)
      : format_(format),
        pieces_(std::move(pieces)),
        capacity_(std::max(buffer, 1)),
        draws_(seed),
        bad_records_(bad_records) {}

  absl::Status Next(Record* out) {
    while (static_cast<int>(buffer_.size()) < capacity_) {
      Record r;
      PSFLOW_ASSIGN_OR_RETURN(const bool got, ReadOne(&r));
      if (!got) break;
      buffer_.push_back(std::move(r));
    }
    if (buffer_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("no record could be read from ", format_.file_name(pieces_[0].file)));
    }
    std::swap(buffer_[draws_.Below(buffer_.size())], buffer_.back());
    *out = std::move(buffer_.back());
    buffer_.pop_back();
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<bool> ReadOne(Record* out) {
    for (;;) {
      if (stream_ != nullptr && left_ > 0) {
        PSFLOW_ASSIGN_OR_RETURN(const bool got, stream_->Next(out));
        if (got) {
          out->file = file_;
          out->index = index_++;
          --left_;
          return true;
        }
        PSFLOW_RETURN_IF_ERROR(ShortFile());
        left_ = 0;
      }
      if (stream_ != nullptr) {
        read_any_ |= index_ > 0;
        *bad_records_ += stream_->bad_records();
        stream_.reset();
      }
      if (next_ == pieces_.size()) {
        // The end of the pieces: the epoch is over, unless corrupt records
        // were skipped, which the caller makes up by reading on from the start.
        if (!skipped_ || !read_any_) return false;
        next_ = 0;
      }
      PSFLOW_RETURN_IF_ERROR(OpenPiece(pieces_[next_++]));
    }
  }

  absl::Status OpenPiece(const Piece& p) {
    PSFLOW_ASSIGN_OR_RETURN(stream_, format_.Open(p.file));
    file_ = p.file;
    for (index_ = 0; index_ < p.first; ++index_) {
      PSFLOW_ASSIGN_OR_RETURN(const bool got, stream_->Skip());
      if (!got) return ShortFile();
    }
    left_ = p.count;
    return absl::OkStatus();
  }

  // A file that ended before the records counted in it: corrupt records
  // skipped (fine), or a file changed since it was counted (an error).
  absl::Status ShortFile() {
    if (stream_->bad_records() > 0) {
      skipped_ = true;
      return absl::OkStatus();
    }
    return absl::DataLossError(absl::StrCat(format_.file_name(file_), " ends after ", index_,
                                            " records, fewer than counted at the start (",
                                            format_.records(file_), "): has it changed?"));
  }

  const DataFormat& format_;
  const std::vector<Piece> pieces_;
  const int capacity_;
  Draws draws_;
  std::atomic<int64_t>* const bad_records_;
  std::vector<Record> buffer_;
  std::unique_ptr<RecordStream> stream_;
  size_t next_ = 0;
  int64_t file_ = -1, index_ = 0, left_ = 0;
  bool skipped_ = false, read_any_ = false;
};

}  // namespace

uint64_t MixSeed(uint64_t a, uint64_t b) {
  uint64_t z = a ^ ((b << 29) | (b >> 35)) ^ (b * 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {

// Whole files, file f to worker f mod num_workers.
std::vector<Piece> WholeFiles(const std::vector<int64_t>& records, int num_workers, int worker) {
  std::vector<Piece> pieces;
  for (size_t f = worker; f < records.size(); f += num_workers) {
    if (records[f] > 0) pieces.push_back({static_cast<int64_t>(f), 0, records[f]});
  }
  return pieces;
}

// Whether whole files give every worker at least 90% of an even share.
bool WholeFilesAreEven(const std::vector<int64_t>& records, int num_workers) {
  if (static_cast<int64_t>(records.size()) < num_workers) return false;
  int64_t total = 0, least = -1;
  for (int64_t r : records) total += r;
  for (int w = 0; w < num_workers; ++w) {
    const int64_t n = RecordsOf(WholeFiles(records, num_workers, w));
    least = least < 0 ? n : std::min(least, n);
  }
  return least * num_workers * 10 >= total * 9;
}

}  // namespace

std::vector<Piece> AssignPieces(const std::vector<int64_t>& records, int num_workers, int worker) {
  if (WholeFilesAreEven(records, num_workers)) return WholeFiles(records, num_workers, worker);
  std::vector<Piece> pieces;
  const int64_t files = static_cast<int64_t>(records.size());
  int64_t total = 0;
  for (int64_t r : records) total += r;
  // Records [begin, end) of all files taken in order.
  const int64_t begin = total * worker / num_workers, end = total * (worker + 1) / num_workers;
  int64_t at = 0;
  for (int64_t f = 0; f < files; at += records[f], ++f) {
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + records[f]);
    if (lo < hi) pieces.push_back({f, lo - at, hi - lo});
  }
  return pieces;
}

int64_t RecordsOf(const std::vector<Piece>& pieces) {
  int64_t n = 0;
  for (const Piece& p : pieces) n += p.count;
  return n;
}

int64_t SmallestShare(const std::vector<int64_t>& records, int num_workers) {
  int64_t least = -1;
  for (int w = 0; w < num_workers; ++w) {
    const int64_t n = RecordsOf(AssignPieces(records, num_workers, w));
    least = least < 0 ? n : std::min(least, n);
  }
  return std::max<int64_t>(least, 0);
}

absl::StatusOr<std::unique_ptr<Pipeline>> Pipeline::Create(const DataFormat* format,
                                                           const PipelineOptions& o) {
  if (o.num_workers < 1 || o.worker < 0 || o.worker >= o.num_workers || o.batch < 1 ||
      o.batches_per_epoch < 0 || o.shuffle_buffer < 0 || o.prefetch_batches < 1 || o.threads < 1) {
    return absl::InvalidArgumentError("input pipeline options out of range");
  }
  std::vector<int64_t> records(format->num_files());
  for (int64_t f = 0; f < format->num_files(); ++f) records[f] = format->records(f);
  std::vector<Piece> pieces = AssignPieces(records, o.num_workers, o.worker);
  const int64_t whole = RecordsOf(pieces) / o.batch;
  const int64_t batches = o.batches_per_epoch > 0 ? o.batches_per_epoch : whole;
  if (batches == 0 || batches > whole) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker ", o.worker, " of ", o.num_workers, " reads ", RecordsOf(pieces),
        " records, fewer than ", std::max<int64_t>(batches, 1), " batches of ", o.batch));
  }
  return std::unique_ptr<Pipeline>(new Pipeline(format, o, std::move(pieces), batches));
}

Pipeline::Pipeline(const DataFormat* format, const PipelineOptions& options,
                   std::vector<Piece> pieces, int64_t batches_per_epoch)
    : format_(format),
      options_(options),
      pieces_(std::move(pieces)),
      share_records_(RecordsOf(pieces_)),
      batches_per_epoch_(batches_per_epoch),
      pool_(options.threads) {
  absl::MutexLock l(&mu_);
  for (int i = 0; i < options_.prefetch_batches + 1; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->batch.images.resize(static_cast<size_t>(options_.batch * format_->example_floats()));
    slot->batch.ids.resize(static_cast<size_t>(options_.batch * format_->example_ids()));
    slot->batch.labels.resize(static_cast<size_t>(options_.batch));
    slot->records.resize(static_cast<size_t>(options_.batch));
    free_.push_back(slot.get());
    slots_.push_back(std::move(slot));
  }
}

Pipeline::~Pipeline() { Stop(); }

void Pipeline::Start(int64_t epoch, int64_t position) {
  next_epoch_ = epoch;
  next_position_ = position;
  reader_ = std::thread([this, epoch, position] { Read(epoch, position); });
}

void Pipeline::Stop() {
  {
    absl::MutexLock l(&mu_);
    cancel_ = true;
  }
  if (reader_.joinable()) reader_.join();
  absl::MutexLock l(&mu_);
  // Decodes under way write into the slots: wait for them.
  mu_.Await(absl::Condition(
      +[](std::vector<Slot*>* ready) {
        return std::all_of(ready->begin(), ready->end(), [](Slot* s) { return s->pending == 0; });
      },
      &ready_));
  free_.insert(free_.end(), ready_.begin(), ready_.end());
  ready_.clear();
  if (handed_out_ != nullptr) free_.push_back(handed_out_);
  handed_out_ = nullptr;
  cancel_ = false;
  read_error_ = absl::OkStatus();
  next_epoch_ = next_position_ = -1;
}

void Pipeline::Read(int64_t epoch, int64_t position) {
  for (;; ++epoch, position = 0) {
    absl::Status s = ReadEpoch(epoch, position);
    absl::MutexLock l(&mu_);
    if (cancel_) return;
    if (!s.ok()) {
      read_error_ = s;
      return;
    }
  }
}

Pipeline::Slot* Pipeline::FreeSlot() {
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](Pipeline* p)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->cancel_ || !p->free_.empty(); },
      this));
  if (cancel_) return nullptr;
  Slot* slot = free_.back();
  free_.pop_back();
  return slot;
}

absl::Status Pipeline::ReadEpoch(int64_t epoch, int64_t position) {
  const uint64_t epoch_seed = MixSeed(MixSeed(options_.seed, epoch), options_.worker);
  std::vector<Piece> order = pieces_;
  Draws order_draws(MixSeed(epoch_seed, 1));
  if (options_.train) Permute(&order, &order_draws);
  EpochRecords records(*format_, std::move(order), options_.train ? options_.shuffle_buffer : 0,
                       MixSeed(epoch_seed, 2), &bad_records_);
  // Back to `position`: the records of the batches before it are read again
  // (to fill the shuffle buffer as it was), not decoded.
  Record passed;
  for (int64_t i = 0; i < position * options_.batch; ++i) {
    if (i % 256 == 0) {
      absl::MutexLock l(&mu_);
      if (cancel_) return absl::OkStatus();
    }
    PSFLOW_RETURN_IF_ERROR(records.Next(&passed));
  }
  for (int64_t p = position; p < batches_per_epoch_; ++p) {
    Slot* slot = FreeSlot();
    if (slot == nullptr) return absl::OkStatus();  // stopped
    absl::Status read;
    for (Record& r : slot->records) {
      read = records.Next(&r);
      if (!read.ok()) break;
    }
    absl::MutexLock l(&mu_);
    if (!read.ok()) {
      free_.push_back(slot);
      return read;
    }
    slot->pending = static_cast<int>(options_.batch);
    slot->status = absl::OkStatus();
    ready_.push_back(slot);
    for (int k = 0; k < static_cast<int>(options_.batch); ++k) {
      const uint64_t seed = MixSeed(epoch_seed, static_cast<uint64_t>(p * options_.batch + k));
      pool_.Schedule([this, slot, k, seed] { Decode(slot, k, seed); });
    }
  }
  return absl::OkStatus();
}

void Pipeline::Decode(Slot* slot, int index, uint64_t seed) {
  const Record& r = slot->records[index];
  absl::Status s = format_->decoder().Decode(
      r, seed, options_.train, slot->batch.images.data() + index * format_->example_floats(),
      slot->batch.ids.data() + index * format_->example_ids(), &slot->batch.labels[index]);
  if (!s.ok()) {
    s = absl::Status(s.code(), absl::StrCat(format_->file_name(r.file), ", record ", r.index, ": ",
                                            s.message()));
  }
  Finish(slot, s);
}

void Pipeline::Finish(Slot* slot, const absl::Status& s) {
  absl::MutexLock l(&mu_);
  if (!s.ok() && slot->status.ok()) slot->status = s;
  --slot->pending;
}

absl::StatusOr<const Batch*> Pipeline::Get(int64_t epoch, int64_t position) {
  if (epoch != next_epoch_ || position != next_position_) {
    Stop();
    Start(epoch, position);
  }
  const absl::Time t0 = absl::Now();
  absl::MutexLock l(&mu_);
  if (handed_out_ != nullptr) free_.push_back(handed_out_);
  handed_out_ = nullptr;
  mu_.Await(absl::Condition(
      +[](Pipeline* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
        return p->ready_.empty() ? !p->read_error_.ok() : p->ready_.front()->pending == 0;
      },
      this));
  waited_ += absl::Now() - t0;
  if (ready_.empty()) {
    next_epoch_ = next_position_ = -1;  // restart at the next call
    return read_error_;
  }
  Slot* slot = ready_.front();
  ready_.erase(ready_.begin());
  if (!slot->status.ok()) {
    free_.push_back(slot);
    next_epoch_ = next_position_ = -1;
    return slot->status;
  }
  handed_out_ = slot;
  if (++next_position_ == batches_per_epoch_) {
    ++next_epoch_;
    next_position_ = 0;
  }
  return &slot->batch;
}

}  // namespace psflow::data
