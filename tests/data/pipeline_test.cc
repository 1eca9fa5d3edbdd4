#include "data/pipeline.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace psflow::data {
namespace {

using ::testing::HasSubstr;

// A data set in memory: file f holds records[f] records, record i of file f
// reads "f:i" and decodes to the one-float input f * 1000 + i with label
// (f * 1000 + i) % 10. A record "bad" fails to decode; a file may stop
// short of its count; every record read is counted.
class FakeFormat : public DataFormat {
 public:
  explicit FakeFormat(std::vector<int64_t> records) : records_(std::move(records)) {}

  int64_t num_files() const override { return static_cast<int64_t>(records_.size()); }
  int64_t records(int64_t file) const override { return records_[file]; }
  std::string file_name(int64_t file) const override { return absl::StrCat("file", file); }
  int64_t example_floats() const override { return 1; }
  const Decoder& decoder() const override { return decoder_; }

  absl::StatusOr<std::unique_ptr<RecordStream>> Open(int64_t file) const override {
    const auto it = actual_.find(file);
    return std::unique_ptr<RecordStream>(
        new Stream(file, it == actual_.end() ? records_[file] : it->second, bad_, &read_));
  }

  // File `file` really holds `n` records.
  void SetActual(int64_t file, int64_t n) { actual_[file] = n; }
  // Record `index` of `file` does not decode.
  void SetBad(int64_t file, int64_t index) { bad_ = {file, index}; }
  int64_t read() const { return read_.load(); }

 private:
  class Stream : public RecordStream {
   public:
    Stream(int64_t file, int64_t n, std::pair<int64_t, int64_t> bad, std::atomic<int64_t>* read)
        : file_(file), n_(n), bad_(bad), read_(read) {}
    absl::StatusOr<bool> Next(Record* r) override {
      if (i_ == n_) return false;
      r->bytes = (std::make_pair(file_, i_) == bad_) ? "bad" : absl::StrCat(file_, ":", i_);
      ++i_;
      ++*read_;
      return true;
    }
    absl::StatusOr<bool> Skip() override {
      if (i_ == n_) return false;
      ++i_;
      return true;
    }

   private:
    const int64_t file_, n_;
    const std::pair<int64_t, int64_t> bad_;
    std::atomic<int64_t>* const read_;
    int64_t i_ = 0;
  };

  class FakeDecoder : public Decoder {
   public:
    absl::Status Decode(const Record& r, uint64_t, bool, float* input, uint64_t*,
                        int32_t* label) const override {
      if (r.bytes == "bad") return absl::InvalidArgumentError("not a number");
      const size_t colon = r.bytes.find(':');
      int64_t f = 0, i = 0;
      if (!absl::SimpleAtoi(r.bytes.substr(0, colon), &f) ||
          !absl::SimpleAtoi(r.bytes.substr(colon + 1), &i)) {
        return absl::InternalError(r.bytes);
      }
      *input = static_cast<float>(f * 1000 + i);
      *label = static_cast<int32_t>((f * 1000 + i) % 10);
      return absl::OkStatus();
    }
  };

  const std::vector<int64_t> records_;
  std::map<int64_t, int64_t> actual_;
  std::pair<int64_t, int64_t> bad_{-1, -1};
  FakeDecoder decoder_;
  mutable std::atomic<int64_t> read_{0};
};

// The inputs of batch `position` of `epoch`.
std::vector<float> BatchAt(Pipeline* p, int64_t epoch, int64_t position) {
  absl::StatusOr<const Batch*> b = p->Get(epoch, position);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return {};
  for (size_t k = 0; k < (*b)->labels.size(); ++k) {
    EXPECT_EQ((*b)->labels[k], static_cast<int32_t>((*b)->images[k]) % 10);
  }
  return (*b)->images;
}

std::vector<float> Epoch(Pipeline* p, int64_t epoch) {
  std::vector<float> all;
  for (int64_t i = 0; i < p->batches_per_epoch(); ++i) {
    std::vector<float> b = BatchAt(p, epoch, i);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}

PipelineOptions Options(int workers, int worker) {
  PipelineOptions o;
  o.num_workers = workers;
  o.worker = worker;
  o.seed = 7;
  o.batch = 4;
  o.shuffle_buffer = 8;
  o.prefetch_batches = 2;
  o.threads = 2;
  return o;
}

TEST(AssignPiecesTest, WholeFilesRoundRobinWhenThatIsEvenEnough) {
  const std::vector<int64_t> records = {5, 6, 7, 8, 9, 5};
  const std::vector<Piece> w1 = AssignPieces(records, 2, 1);
  ASSERT_EQ(w1.size(), 3u);
  EXPECT_EQ(w1[0].file, 1);
  EXPECT_EQ(w1[1].file, 3);
  EXPECT_EQ(w1[2].file, 5);
  EXPECT_EQ(w1[0].first, 0);
  EXPECT_EQ(RecordsOf(w1), 19);
  EXPECT_EQ(RecordsOf(AssignPieces(records, 2, 0)), 21);
  EXPECT_EQ(SmallestShare(records, 2), 19);
}

TEST(AssignPiecesTest, RecordRangesWhenWholeFilesWouldBeUneven) {
  // Files 0 and 2 against file 1 would be 20 records to 10.
  const std::vector<int64_t> records = {10, 10, 10};
  EXPECT_EQ(RecordsOf(AssignPieces(records, 2, 0)), 15);
  EXPECT_EQ(RecordsOf(AssignPieces(records, 2, 1)), 15);
  const std::vector<Piece> w1 = AssignPieces(records, 2, 1);
  ASSERT_EQ(w1.size(), 2u);
  EXPECT_EQ(w1[0].file, 1);
  EXPECT_EQ(w1[0].first, 5);
  EXPECT_EQ(SmallestShare(records, 2), 15);
}

TEST(AssignPiecesTest, RecordRangesCoverEveryRecordOnceWhenFilesAreFew) {
  const std::vector<int64_t> records = {10, 3};
  std::set<std::pair<int64_t, int64_t>> seen;
  for (int w = 0; w < 4; ++w) {
    for (const Piece& p : AssignPieces(records, 4, w)) {
      for (int64_t i = p.first; i < p.first + p.count; ++i) {
        EXPECT_TRUE(seen.insert({p.file, i}).second) << "record read twice";
      }
    }
  }
  EXPECT_EQ(seen.size(), 13u);
  EXPECT_EQ(SmallestShare(records, 4), 3);
}

TEST(PipelineTest, AnEpochReadsEachRecordOfTheShareAtMostOnceInADrawnOrder) {
  FakeFormat format({10, 10, 10, 10});
  auto p = Pipeline::Create(&format, Options(2, 0));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ((*p)->share_records(), 20);
  EXPECT_EQ((*p)->batches_per_epoch(), 5);
  const std::vector<float> e0 = Epoch(p->get(), 0), e1 = Epoch(p->get(), 1);
  std::set<float> distinct(e0.begin(), e0.end());
  EXPECT_EQ(distinct.size(), 20u);
  for (float v : e0) {  // worker 0 reads files 0 and 2
    EXPECT_TRUE(v < 1000 || (v >= 2000 && v < 3000)) << v;
  }
  std::vector<float> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(e0, sorted) << "not shuffled";
  EXPECT_NE(e0, e1) << "the same order in two epochs";
}

TEST(PipelineTest, TheSameSeedGivesTheSameBatchesAndARestartResumesExactly) {
  FakeFormat format({13, 7, 9});
  auto a = Pipeline::Create(&format, Options(1, 0));
  auto b = Pipeline::Create(&format, Options(1, 0));
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<float> e2 = Epoch(a->get(), 2);
  ASSERT_EQ(e2.size(), 28u);
  // b jumps straight to batch 4 of epoch 2, then reads on.
  const std::vector<float> at4 = BatchAt(b->get(), 2, 4);
  EXPECT_EQ(at4, std::vector<float>(e2.begin() + 16, e2.begin() + 20));
  EXPECT_EQ(BatchAt(b->get(), 2, 5), std::vector<float>(e2.begin() + 20, e2.begin() + 24));
  // And back to an earlier one.
  EXPECT_EQ(BatchAt(b->get(), 2, 0), std::vector<float>(e2.begin(), e2.begin() + 4));
}

TEST(PipelineTest, EvaluationReadsInFileOrder) {
  FakeFormat format({3, 5});
  PipelineOptions o = Options(1, 0);
  o.train = false;
  o.batch = 2;
  auto p = Pipeline::Create(&format, o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(Epoch(p->get(), 0), (std::vector<float>{0, 1, 2, 1000, 1001, 1002, 1003, 1004}));
}

TEST(PipelineTest, ReadsAheadOnlyWhatItsBuffersHold) {
  FakeFormat format({1000});
  PipelineOptions o = Options(1, 0);
  auto p = Pipeline::Create(&format, o);
  ASSERT_TRUE(p.ok());
  BatchAt(p->get(), 0, 0);
  absl::SleepFor(absl::Milliseconds(200));
  // The shuffle buffer, the batch handed out and prefetch_batches more.
  EXPECT_LE(format.read(), o.shuffle_buffer + (o.prefetch_batches + 1) * o.batch);
}

TEST(PipelineTest, ARecordThatDoesNotDecodeNamesItsFileAndIndex) {
  FakeFormat format({8});
  format.SetBad(0, 5);
  PipelineOptions o = Options(1, 0);
  o.train = false;
  auto p = Pipeline::Create(&format, o);
  ASSERT_TRUE(p.ok());
  BatchAt(p->get(), 0, 0);
  absl::StatusOr<const Batch*> b = (*p)->Get(0, 1);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("file0, record 5: not a number"));
}

TEST(PipelineTest, AFileShorterThanCountedIsDataLoss) {
  FakeFormat format({8, 8});
  format.SetActual(1, 3);
  PipelineOptions o = Options(1, 0);
  o.train = false;
  auto p = Pipeline::Create(&format, o);
  ASSERT_TRUE(p.ok());
  absl::Status s;
  for (int64_t i = 0; i < (*p)->batches_per_epoch() && s.ok(); ++i) s = (*p)->Get(0, i).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("file1 ends after 3 records"));
}

TEST(PipelineTest, RefusesAShareSmallerThanTheBatchesAskedFor) {
  FakeFormat format({5, 5});
  PipelineOptions o = Options(2, 1);
  o.batches_per_epoch = 2;
  auto p = Pipeline::Create(&format, o);
  ASSERT_FALSE(p.ok());
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("worker 1 of 2 reads 5 records"));
}

}  // namespace
}  // namespace psflow::data
