// One ps's shard of an embedding table: creation, lookups, admission,
// updates, expiry, memory accounting, concurrent use, and its snapshot files.
#include "ps/embedding/table.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/embedding/table_file.h"

namespace psflow::ps::embedding {
namespace {

using ::testing::HasSubstr;

EmbeddingTableSpec Spec(const std::string& name, int dim, int64_t rows,
                        SparseOptimizerConfig::Kind kind = SparseOptimizerConfig::SGD) {
  EmbeddingTableSpec spec;
  spec.set_name(name);
  spec.set_dim(dim);
  spec.set_rows(rows);
  spec.mutable_optimizer()->set_kind(kind);
  spec.mutable_optimizer()->set_learning_rate(0.5f);
  return spec;
}

std::unique_ptr<EmbeddingShard> MakeShard(const EmbeddingTableSpec& spec, int num_ps = 1,
                                          int ps_index = 0, uint64_t seed = 1) {
  auto shard = EmbeddingShard::Create(spec, num_ps, ps_index, seed);
  EXPECT_TRUE(shard.ok()) << shard.status();
  return shard.ok() ? *std::move(shard) : nullptr;
}

std::vector<float> Read(EmbeddingShard& shard, const std::vector<uint64_t>& ids, bool train,
                        int64_t step = 0) {
  std::vector<float> out(ids.size() * shard.dim(), -7.0f);
  absl::Status s = shard.Lookup(ids, train, step, absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::vector<float> Initial(const EmbeddingShard& shard, uint64_t key) {
  std::vector<float> v(shard.dim());
  shard.InitialRow(key, v.data());
  return v;
}

// The ids of [0, limit) that ps `ps` of `num_ps` owns in a dynamic table.
std::vector<uint64_t> OwnedIds(int num_ps, int ps, int count) {
  std::vector<uint64_t> ids;
  Sharding sharding(0, num_ps);
  for (uint64_t id = 0; static_cast<int>(ids.size()) < count; ++id) {
    if (sharding.Owner(id) == ps) ids.push_back(id);
  }
  return ids;
}

TEST(EmbeddingShardTest, CreateRefusesBadSpecs) {
  auto code = [](const EmbeddingTableSpec& spec, int num_ps = 1, int ps = 0) {
    return EmbeddingShard::Create(spec, num_ps, ps, 1).status();
  };
  EXPECT_THAT(code(Spec("", 4, 0)).message(), HasSubstr("name"));
  EXPECT_THAT(code(Spec("t", 0, 0)).message(), HasSubstr("dim"));
  EXPECT_THAT(code(Spec("t", 4, -1)).message(), HasSubstr("rows"));
  EXPECT_THAT(code(Spec("t", 4, int64_t{1} << 40)).message(),
              HasSubstr("rows must be at most 2^34 (a fixed table is allocated whole)"));
  EmbeddingTableSpec spec = Spec("t", 4, 10);
  spec.set_expire_steps(5);
  EXPECT_THAT(code(spec).message(), HasSubstr("dynamic"));
  spec = Spec("t", 4, 0);
  spec.set_admit_probability(1.5f);
  EXPECT_THAT(code(spec).message(), HasSubstr("admit_probability"));
  spec = Spec("t", 4, 0);
  spec.mutable_optimizer()->set_learning_rate(-1);
  EXPECT_THAT(code(spec).message(), HasSubstr("learning_rate"));
  EXPECT_EQ(code(Spec("t", 4, 0), 2, 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(EmbeddingShardTest, FixedTableHoldsItsRowsFromTheStart) {
  // 10 rows over 3 ps: ps 1 holds rows 1, 4, 7.
  auto shard = MakeShard(Spec("fixed", 3, 10), 3, 1);
  EXPECT_EQ(shard->GetStats().rows, 3);
  // Ids 4 and 14 share row 4; an evaluation lookup reads it too.
  std::vector<float> got = Read(*shard, {4, 14, 7}, /*train=*/false);
  std::vector<float> row4 = Initial(*shard, 4), row7 = Initial(*shard, 7);
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 3), row4);
  EXPECT_EQ(std::vector<float>(got.begin() + 3, got.begin() + 6), row4);
  EXPECT_EQ(std::vector<float>(got.begin() + 6, got.end()), row7);
  EXPECT_NE(row4, row7);
  std::vector<float> out(3);
  absl::Status s = shard->Lookup({uint64_t{5}}, false, 0, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("id 5 belongs to ps 2"));
  EXPECT_FALSE(shard->Lookup({uint64_t{4}}, false, 0, absl::MakeSpan(out).subspan(1)).ok());
}

TEST(EmbeddingShardTest, InitialValuesDependOnSeedNameAndIdOnly) {
  // The same id on a shard of 2 ps and one of 3 starts alike.
  const uint64_t id = OwnedIds(6, 5, 1)[0];
  auto a = MakeShard(Spec("t", 8, 0), 2, Sharding(0, 2).Owner(id), 9);
  auto b = MakeShard(Spec("t", 8, 0), 3, Sharding(0, 3).Owner(id), 9);
  std::vector<float> va = Read(*a, {id}, true, 3);
  EXPECT_EQ(va, Read(*b, {id}, true, 70));
  EXPECT_EQ(va, Initial(*a, id));
  EXPECT_NE(va, Initial(*MakeShard(Spec("t", 8, 0), 1, 0, 10), id));
  EXPECT_NE(va, Initial(*MakeShard(Spec("u", 8, 0), 1, 0, 9), id));
  const float bound = 1 / std::sqrt(8.0f);  // the default scale
  for (float x : va) EXPECT_LE(std::fabs(x), bound);
}

TEST(EmbeddingShardTest, InitializersHaveTheirDistributions) {
  EmbeddingTableSpec spec = Spec("t", 1000, 0);
  spec.set_initializer(EmbeddingTableSpec::NORMAL);
  spec.set_init_scale(2);
  std::vector<float> v = Initial(*MakeShard(spec), 3);
  double sum = 0, sq = 0;
  for (float x : v) sum += x, sq += double{x} * x;
  EXPECT_NEAR(sum / 1000, 0, 0.2);
  EXPECT_NEAR(std::sqrt(sq / 1000), 2, 0.2);
  spec.set_initializer(EmbeddingTableSpec::UNIFORM);
  v = Initial(*MakeShard(spec), 3);
  float lo = 0, hi = 0;
  for (float x : v) lo = std::min(lo, x), hi = std::max(hi, x);
  EXPECT_LT(lo, -1.9f);
  EXPECT_GT(hi, 1.9f);
  EXPECT_GE(lo, -2.0f);
  EXPECT_LE(hi, 2.0f);
  spec.set_initializer(EmbeddingTableSpec::ZEROS);
  EXPECT_EQ(Initial(*MakeShard(spec), 3), std::vector<float>(1000, 0.0f));
}

TEST(EmbeddingShardTest, DynamicRowsComeFromTrainingLookupsOnly) {
  auto shard = MakeShard(Spec("t", 4, 0));
  EXPECT_EQ(Read(*shard, {11, 12}, false), std::vector<float>(8, 0.0f));
  EXPECT_EQ(shard->GetStats().rows, 0);
  std::vector<float> trained = Read(*shard, {11, 12, 11}, true, 4);
  EXPECT_EQ(shard->GetStats().rows, 2);
  EXPECT_EQ(shard->GetStats().rows_created, 2);
  EXPECT_EQ(std::vector<float>(trained.begin(), trained.begin() + 4), Initial(*shard, 11));
  EXPECT_EQ(std::vector<float>(trained.begin() + 8, trained.end()), Initial(*shard, 11));
  EXPECT_EQ(Read(*shard, {11, 12}, false),
            std::vector<float>(trained.begin(), trained.begin() + 8));
}

TEST(EmbeddingShardTest, ApplyUpdatesRowsAndSkipsIdsWithoutOne) {
  auto shard = MakeShard(Spec("t", 2, 0));
  Read(*shard, {1, 2}, true);
  std::vector<float> before = Read(*shard, {1, 2}, false);
  auto result = shard->Apply({2, 1, 3}, {1, 2, 3, 4, 5, 6}, 0);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->applied, 2);
  EXPECT_EQ(result->skipped, 1);  // 3 has no row
  EXPECT_EQ(shard->GetStats().apply_skipped, 1);
  EXPECT_EQ(shard->GetStats().rows, 2);  // an update creates nothing
  std::vector<float> after = Read(*shard, {1, 2}, false);
  EXPECT_EQ(after[0], before[0] - 0.5f * 3);
  EXPECT_EQ(after[1], before[1] - 0.5f * 4);
  EXPECT_EQ(after[2], before[2] - 0.5f * 1);
  EXPECT_EQ(after[3], before[3] - 0.5f * 2);
}

TEST(EmbeddingShardTest, BadUpdatesChangeNothing) {
  auto shard = MakeShard(Spec("t", 2, 0));
  Read(*shard, {1, 2}, true);
  std::vector<float> before = Read(*shard, {1, 2}, false);
  auto dup = shard->Apply({1, 2, 1}, {1, 1, 1, 1, 1, 1}, 0);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("id 1 twice"));
  auto nan = shard->Apply({1, 2}, {1, 1, 1, NAN}, 0);
  EXPECT_THAT(nan.status().message(), HasSubstr("non-finite gradient nan for id 2"));
  EXPECT_FALSE(shard->Apply({1, 2}, {1, 1, 1}, 0).ok());
  EXPECT_THAT(shard->Apply({1}, {1, 1}, -1).status().message(), HasSubstr("step -1"));
  EXPECT_EQ(Read(*shard, {1, 2}, false), before);
  // A fixed table: two ids of one row in one update.
  auto fixed = MakeShard(Spec("f", 2, 5));
  auto shared = fixed->Apply({3, 8}, {1, 1, 1, 1}, 0);
  EXPECT_THAT(shared.status().message(), HasSubstr("ids 3 and 8 share row 3"));
}

TEST(EmbeddingShardTest, AdmissionByCountWaitsForTheNthTouch) {
  EmbeddingTableSpec spec = Spec("t", 2, 0);
  spec.set_admit_min_count(3);
  auto shard = MakeShard(spec);
  EXPECT_EQ(Read(*shard, {5}, true, 0), std::vector<float>(2, 0.0f));
  EXPECT_EQ(Read(*shard, {5}, false, 0), std::vector<float>(2, 0.0f));  // not a touch
  EXPECT_EQ(Read(*shard, {5}, true, 1), std::vector<float>(2, 0.0f));
  EXPECT_EQ(shard->GetStats().pending_ids, 1);
  EXPECT_EQ(shard->GetStats().admissions_refused, 2);
  EXPECT_EQ(Read(*shard, {5}, true, 2), Initial(*shard, 5));
  EXPECT_EQ(shard->GetStats().rows, 1);
  EXPECT_EQ(shard->GetStats().pending_ids, 0);
}

TEST(EmbeddingShardTest, AdmissionByProbabilityIsADrawOfSeedIdAndStep) {
  EmbeddingTableSpec spec = Spec("t", 1, 0);
  spec.set_admit_probability(0.25f);
  auto a = MakeShard(spec, 1, 0, 4);
  auto b = MakeShard(spec, 1, 0, 4);
  std::vector<uint64_t> ids;
  for (uint64_t id = 0; id < 4000; ++id) ids.push_back(id);
  Read(*a, ids, true, 7);
  Read(*b, ids, true, 7);
  const int64_t admitted = a->GetStats().rows;
  EXPECT_NEAR(admitted, 1000, 120);
  EXPECT_EQ(a->GetStats().admissions_refused, 4000 - admitted);
  // The same draws on another shard: the same rows.
  EXPECT_EQ(Read(*a, ids, false), Read(*b, ids, false));
  // Another step draws again: more ids get in.
  Read(*a, ids, true, 8);
  EXPECT_GT(a->GetStats().rows, admitted + 500);
}

TEST(EmbeddingShardTest, ExpireDropsStaleRowsAndReusesTheirSpace) {
  EmbeddingTableSpec spec = Spec("t", 4, 0, SparseOptimizerConfig::ROWWISE_ADAGRAD);
  spec.set_expire_steps(5);
  auto shard = MakeShard(spec);
  std::vector<uint64_t> old_ids, new_ids;
  for (uint64_t id = 0; id < 3000; ++id) (id % 3 == 0 ? new_ids : old_ids).push_back(id);
  Read(*shard, old_ids, true, 0);
  Read(*shard, new_ids, true, 0);
  Read(*shard, new_ids, true, 10);                        // the last touch of these: 10
  ASSERT_TRUE(shard->Apply({1}, {1, 1, 1, 1}, 10).ok());  // an update is not a touch
  Read(*shard, old_ids, /*train=*/false, 14);             // nor is an evaluation lookup
  // Touched at 0: dropped. At 10: kept (15 - 10 is not more than 5).
  EXPECT_EQ(shard->Expire(15), static_cast<int64_t>(old_ids.size()));
  EmbeddingShard::Stats st = shard->GetStats();
  EXPECT_EQ(st.rows, 1000);
  EXPECT_EQ(st.rows_expired, 2000);
  EXPECT_EQ(Read(*shard, {1}, false), std::vector<float>(4, 0.0f));
  auto gone = shard->Apply({1, 0}, {1, 1, 1, 1, 1, 1, 1, 1}, 16);  // 1 expired, 0 kept
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(gone->skipped, 1);
  EXPECT_EQ(gone->applied, 1);
  // New rows take the freed positions: no slab grows.
  Read(*shard, old_ids, true, 17);
  EXPECT_EQ(shard->GetStats().bytes - st.bytes, 0);
  EXPECT_EQ(Read(*shard, {1}, false), Initial(*shard, 1));  // created afresh
  EXPECT_EQ(MakeShard(Spec("f", 4, 9))->Expire(100), 0);
}

TEST(EmbeddingShardTest, StatsCountEveryByte) {
  auto shard = MakeShard(Spec("t", 16, 0, SparseOptimizerConfig::ROWWISE_ADAGRAD));
  std::vector<uint64_t> ids;
  for (uint64_t id = 0; id < 100000; ++id) ids.push_back(id);
  Read(*shard, ids, true);
  EmbeddingShard::Stats st = shard->GetStats();
  EXPECT_EQ(st.rows, 100000);
  EXPECT_EQ(st.row_bytes, 8 + 4 * (16 + 1));  // last touch, values, accumulator
  // Slabs plus the index: at least a row and a map entry (12 bytes) each.
  EXPECT_GT(st.bytes, st.rows * (st.row_bytes + 12));
  EXPECT_LT(st.bytes_per_row, 2.0 * st.row_bytes);
  EXPECT_EQ(st.bytes_per_row, static_cast<double>(st.bytes) / st.rows);
}

TEST(EmbeddingShardTest, ConcurrentLookupsAndUpdatesLoseNothing) {
  // SGD with lr 0.5 and gradient 0.25: each update subtracts 0.125, the
  // same float operation whatever the order, so the end value is exact.
  auto shard = MakeShard(Spec("t", 4, 0));
  std::vector<uint64_t> ids;
  for (uint64_t id = 0; id < 512; ++id) ids.push_back(id);
  Read(*shard, ids, true);
  const std::vector<float> start = Read(*shard, ids, false);
  constexpr int kThreads = 4, kRounds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> grads(ids.size() * 4, 0.25f), out(ids.size() * 4);
      for (int r = 0; r < kRounds; ++r) {
        EXPECT_TRUE(shard->Lookup(ids, true, r, absl::MakeSpan(out)).ok());
        EXPECT_TRUE(shard->Apply(ids, grads, t * kRounds + r).ok());
      }
    });
  }
  // Snapshots, stats and expiry meanwhile: each row in a file is whole.
  threads.emplace_back([&] {
    const std::string path = ::testing::TempDir() + "/concurrent_" + std::to_string(::getpid());
    for (int r = 0; r < 10; ++r) {
      EXPECT_TRUE(WriteEmbeddingShard(*shard, path).ok());
      EXPECT_EQ(shard->Expire(r), 0);  // expire_steps 0: never
      EXPECT_EQ(shard->GetStats().rows, 512);
    }
    auto copy = RestoreEmbeddingShard(shard->spec(), 1, 0, 1, {path});
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ((*copy)->GetStats().rows, 512);
    for (uint64_t id : ids) {
      // An update subtracts 0.125 from every element of the row at once: the
      // file holds each row after the same number of updates in all four.
      std::vector<float> row = Read(**copy, {id}, false),
                         w(start.begin() + id * 4, start.begin() + id * 4 + 4);
      int updates = 0;
      for (; w[0] != row[0] && updates <= kThreads * kRounds; ++updates) {
        for (float& x : w) x -= 0.5f * 0.25f;
      }
      EXPECT_EQ(w, row) << id << " after " << updates << " updates";
    }
    std::filesystem::remove(path);
  });
  for (auto& t : threads) t.join();
  std::vector<float> want = start;
  for (float& w : want) {
    for (int k = 0; k < kThreads * kRounds; ++k) w -= 0.5f * 0.25f;
  }
  EXPECT_EQ(Read(*shard, ids, false), want);
}

}  // namespace
}  // namespace psflow::ps::embedding

namespace psflow::ps::embedding {
namespace {

class EmbeddingFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/embedding_file_test_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

std::vector<uint64_t> Range(uint64_t n) {
  std::vector<uint64_t> ids(n);
  for (uint64_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

// The ids of `all` that `shard` owns.
std::vector<uint64_t> Mine(const EmbeddingShard& shard, const std::vector<uint64_t>& all) {
  std::vector<uint64_t> ids;
  for (uint64_t id : all) {
    if (shard.sharding().Owner(id) == shard.ps_index()) ids.push_back(id);
  }
  return ids;
}

// Trains `shard` a little: lookups at steps 0..2, updates with gradients
// that depend on the id, so rows and their optimizer state differ.
void Train(EmbeddingShard& shard, const std::vector<uint64_t>& all) {
  std::vector<uint64_t> ids = Mine(shard, all);
  for (int64_t step = 0; step < 3; ++step) {
    Read(shard, ids, true, step);
    std::vector<float> grads;
    for (uint64_t id : ids) {
      for (int j = 0; j < shard.dim(); ++j) grads.push_back(0.01f * static_cast<float>(id % 7 + j));
    }
    ASSERT_TRUE(shard.Apply(ids, grads, step).ok());
  }
}

TEST_F(EmbeddingFileTest, DynamicTableFromTwoPsRestoresOntoThree) {
  EmbeddingTableSpec spec = Spec("clicks", 4, 0, SparseOptimizerConfig::ROWWISE_ADAGRAD);
  spec.set_expire_steps(10);
  const std::vector<uint64_t> all = Range(3000);
  std::vector<std::unique_ptr<EmbeddingShard>> old;
  std::vector<std::string> paths;
  for (int ps = 0; ps < 2; ++ps) {
    old.push_back(MakeShard(spec, 2, ps, 5));
    Train(*old.back(), all);
    paths.push_back(Path("clicks-" + std::to_string(ps)));
    ASSERT_TRUE(WriteEmbeddingShard(*old.back(), paths.back()).ok());
  }
  ASSERT_EQ(old[0]->GetStats().rows + old[1]->GetStats().rows, 3000);
  int64_t rows = 0;
  for (int ps = 0; ps < 3; ++ps) {
    auto shard = RestoreEmbeddingShard(spec, 3, ps, 5, paths);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EmbeddingShard& fresh = **shard;
    rows += fresh.GetStats().rows;
    EXPECT_EQ(fresh.GetStats().rows, fresh.GetStats().rows_restored);
    for (uint64_t id : Mine(fresh, all)) {
      EmbeddingShard& before = *old[Sharding(0, 2).Owner(id)];
      ASSERT_EQ(Read(fresh, {id}, false), Read(before, {id}, false)) << id;
      // The accumulator came along: one more update moves both alike.
      const std::vector<float> g = {0.3f, -0.2f, 0.1f, 0.5f};
      ASSERT_TRUE(fresh.Apply({id}, g, 9).ok());
      ASSERT_TRUE(before.Apply({id}, g, 9).ok());
      ASSERT_EQ(Read(fresh, {id}, false), Read(before, {id}, false)) << id;
    }
    // The last touches came along: all were at step 2.
    EXPECT_EQ(fresh.Expire(12), 0);
    EXPECT_EQ(fresh.Expire(13), fresh.GetStats().rows_restored);
  }
  EXPECT_EQ(rows, 3000);
}

TEST_F(EmbeddingFileTest, FixedTableRestoresOntoAnotherPsCount) {
  EmbeddingTableSpec spec = Spec("slots", 3, 50, SparseOptimizerConfig::FTRL);
  const std::vector<uint64_t> all = Range(50);
  std::vector<std::unique_ptr<EmbeddingShard>> old;
  std::vector<std::string> paths;
  for (int ps = 0; ps < 3; ++ps) {
    old.push_back(MakeShard(spec, 3, ps, 2));
    Train(*old.back(), all);
    paths.push_back(Path("slots-" + std::to_string(ps)));
    ASSERT_TRUE(WriteEmbeddingShard(*old.back(), paths.back()).ok());
  }
  for (int ps = 0; ps < 2; ++ps) {
    auto shard = RestoreEmbeddingShard(spec, 2, ps, 2, paths);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ((*shard)->GetStats().rows, 25);
    EXPECT_EQ((*shard)->GetStats().rows_restored, 25);
    for (uint64_t id : Mine(**shard, all)) {
      EXPECT_EQ(Read(**shard, {id}, false), Read(*old[id % 3], {id}, false)) << id;
    }
  }
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Spill(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST_F(EmbeddingFileTest, BadFilesAreOneClearError) {
  EmbeddingTableSpec spec = Spec("t", 4, 0, SparseOptimizerConfig::LAZY_ADAM);
  auto shard = MakeShard(spec);
  Read(*shard, Range(5000), true);
  const std::string path = Path("t-0");
  ASSERT_TRUE(WriteEmbeddingShard(*shard, path).ok());
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 1);  // no temporary
  const std::string good = Slurp(path);
  auto restore = [&](const EmbeddingTableSpec& s) {
    return RestoreEmbeddingShard(s, 1, 0, 1, {path}).status();
  };
  ASSERT_TRUE(restore(spec).ok());
  auto expect = [&](absl::StatusCode code, absl::string_view text) {
    absl::Status s = restore(spec);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(path));
    EXPECT_THAT(std::string(s.message()), HasSubstr(text));
  };
  Spill(path, good.substr(0, good.size() - 100));
  expect(absl::StatusCode::kDataLoss, "truncated in block ");
  Spill(path, good.substr(0, 30));
  expect(absl::StatusCode::kDataLoss, "truncated in the header");
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x20;
  Spill(path, flipped);
  expect(absl::StatusCode::kDataLoss, "checksum mismatch");
  Spill(path, good + "x");
  expect(absl::StatusCode::kDataLoss, "bytes after the last row");
  Spill(path, "not a snapshot at all");
  expect(absl::StatusCode::kDataLoss, "bad magic");
  // A header (checksum and all) that counts far more rows than the file
  // holds is refused before anything is sized by it. Its row count is the
  // int64 before the header's checksum.
  std::string huge = good;
  const size_t header_end = 8 + 4 + 4 + 1 + 4 + 4 + 4 + 8 + 8;  // magic .. rows ("t": 1 byte)
  const int64_t rows = int64_t{1} << 50;
  std::memcpy(&huge[header_end - 8], &rows, sizeof(rows));
  const uint32_t crc = MaskCrc32c(Crc32c(absl::string_view(huge).substr(0, header_end)));
  std::memcpy(&huge[header_end], &crc, sizeof(crc));
  Spill(path, huge);
  expect(absl::StatusCode::kDataLoss, "the header counts 1125899906842624 rows, more than its");
  Spill(path, good);
  EmbeddingTableSpec other = spec;
  other.set_dim(8);
  EXPECT_THAT(restore(other).message(), HasSubstr("dim 4, not 8"));
  other = spec;
  other.mutable_optimizer()->set_kind(SparseOptimizerConfig::FTRL);
  EXPECT_THAT(restore(other).message(), HasSubstr("optimizer lazy_adam, not ftrl"));
  EXPECT_EQ(restore(other).code(), absl::StatusCode::kFailedPrecondition);
  other = spec;
  other.set_name("u");
  EXPECT_THAT(restore(other).message(), HasSubstr("table t, not u"));
  EXPECT_EQ(RestoreEmbeddingShard(spec, 1, 0, 1, {Path("none")}).status().code(),
            absl::StatusCode::kNotFound);
  absl::Status s = WriteEmbeddingShard(*shard, Path("no/such/dir/t"));
  EXPECT_THAT(s.message(), HasSubstr("no/such/dir/t"));
}

}  // namespace
}  // namespace psflow::ps::embedding
