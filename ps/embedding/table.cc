#include "ps/embedding/table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <utility>

#include "absl/strings/str_cat.h"

namespace psflow::ps::embedding {
namespace {

constexpr int kMaxDim = 1 << 16;
// Fixed tables are allocated whole at once: a bound that catches a typo
// before it takes the machine's memory.
constexpr int64_t kMaxFixedRows = int64_t{1} << 34;
constexpr int64_t kSlabTargetBytes = 64 << 10;
// Salts that keep the streams of initial values and admission draws apart.
constexpr uint64_t kInitSalt = 0x5EED1A17ull;
constexpr uint64_t kAdmitSalt = 0xAD317ull;

uint64_t Fnv1a64(absl::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

// A uniform double in [0, 1) from the top 53 bits of x.
double Unit(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

int SlabShift(int64_t row_stride) {
  int shift = 0;
  while ((int64_t{2} << shift) * row_stride <= kSlabTargetBytes) ++shift;
  return shift;
}

int64_t MapBytes(size_t capacity, size_t slot_bytes) {
  // absl's swiss table: a slot and a control byte per entry of its capacity.
  return capacity == 0 ? 0 : static_cast<int64_t>(capacity * (slot_bytes + 1) + 16);
}

// A row's record spans at most two cache lines when it is short; the first
// two are what an update or a lookup of a short row reads.
void PrefetchRow(const char* row) {
  if (row != nullptr) {
    __builtin_prefetch(row);
    __builtin_prefetch(row + 64);
  }
}

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("EmbeddingTableSpec.", what));
}

absl::Status ValidateDynamicFields(const EmbeddingTableSpec& spec) {
  const float p = spec.admit_probability();
  if (!(p >= 0 && p <= 1)) return Bad(absl::StrCat("admit_probability must be in [0, 1], got ", p));
  if (spec.admit_min_count() < 0) {
    return Bad(absl::StrCat("admit_min_count must be >= 0, got ", spec.admit_min_count()));
  }
  if (spec.expire_steps() < 0) {
    return Bad(absl::StrCat("expire_steps must be >= 0, got ", spec.expire_steps()));
  }
  if (spec.rows() > 0 && (p != 0 || spec.admit_min_count() != 0 || spec.expire_steps() != 0)) {
    return Bad(absl::StrCat("admit_probability, admit_min_count and expire_steps are for dynamic ",
                            "tables (rows 0); table \"", spec.name(), "\" has ", spec.rows(),
                            " fixed rows"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateEmbeddingTableSpec(const EmbeddingTableSpec& spec) {
  if (spec.name().empty()) return Bad("name must not be empty");
  if (spec.dim() < 1 || spec.dim() > kMaxDim) {
    return Bad(absl::StrCat("dim must be in [1, ", kMaxDim, "], got ", spec.dim()));
  }
  if (spec.rows() < 0) return Bad(absl::StrCat("rows must be >= 0, got ", spec.rows()));
  if (spec.rows() > kMaxFixedRows) {
    return Bad(absl::StrCat("rows must be at most 2^34 (a fixed table is allocated whole), got ",
                            spec.rows(), "; a dynamic table (rows 0) takes any number of ids"));
  }
  if (!EmbeddingTableSpec::Initializer_IsValid(spec.initializer())) {
    return Bad(absl::StrCat("initializer ", static_cast<int>(spec.initializer()), " is unknown"));
  }
  if (!(std::isfinite(spec.init_scale()) && spec.init_scale() >= 0)) {
    return Bad(absl::StrCat("init_scale must be >= 0 and finite, got ", spec.init_scale()));
  }
  if (auto s = ValidateDynamicFields(spec); !s.ok()) return s;
  if (auto s = ValidateSparseOptimizer(spec.optimizer()); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("EmbeddingTableSpec.optimizer of table \"", spec.name(), "\": ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EmbeddingShard>> EmbeddingShard::Create(
    const EmbeddingTableSpec& spec, int num_ps, int ps_index, uint64_t seed) {
  if (auto s = ValidateEmbeddingTableSpec(spec); !s.ok()) return s;
  if (num_ps < 1 || ps_index < 0 || ps_index >= num_ps) {
    return absl::InvalidArgumentError(absl::StrCat("embedding table \"", spec.name(), "\": ps ",
                                                   ps_index, " of ", num_ps, " does not exist"));
  }
  const Sharding sharding(spec.rows(), num_ps);
  // A stripe's positions are 32-bit.
  if (sharding.LocalRows(ps_index) / kStripes >= std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "embedding table \"", spec.name(), "\": ", spec.rows(), " rows are too many for one ps"));
  }
  auto optimizer = SparseOptimizer::Create(spec.optimizer());
  if (!optimizer.ok()) return optimizer.status();
  std::unique_ptr<EmbeddingShard> shard(
      new EmbeddingShard(spec, num_ps, ps_index, seed, *std::move(optimizer)));
  shard->AllocateFixedRows();
  return shard;
}

EmbeddingShard::EmbeddingShard(const EmbeddingTableSpec& spec, int num_ps, int ps_index,
                               uint64_t seed, SparseOptimizer optimizer)
    : spec_(spec),
      sharding_(spec.rows(), num_ps),
      ps_index_(ps_index),
      seed_(seed),
      optimizer_(std::move(optimizer)),
      dim_(spec.dim()),
      slot_floats_(optimizer_.SlotFloats(spec.dim())),
      row_stride_(8 + 4 * int64_t{dim_ + slot_floats_}),
      slab_shift_(SlabShift(row_stride_)),
      init_scale_(spec.init_scale() > 0
                      ? spec.init_scale()
                      : static_cast<float>(1 / std::sqrt(static_cast<double>(dim_)))),
      name_hash_(Fnv1a64(spec.name())) {}

int EmbeddingShard::FirstStripe() {
  return static_cast<int>(next_first_stripe_.fetch_add(1, std::memory_order_relaxed) % kStripes);
}

void EmbeddingShard::AllocateFixedRows() {
  const int64_t local_rows = sharding_.LocalRows(ps_index_);
  for (int64_t local = 0; local < local_rows; ++local) {
    Stripe& s = stripes_[local % kStripes];
    absl::MutexLock lock(&s.mu);
    const uint32_t pos = NewPosition(s);
    const uint64_t row = static_cast<uint64_t>(local) * sharding_.num_ps() + ps_index_;
    InitRecord(row, 0, RowAt(s, pos));
  }
}

void EmbeddingShard::InitialRow(uint64_t key, float* out) const {
  const uint64_t base = SplitMix64(SplitMix64(seed_ ^ kInitSalt) ^ name_hash_) ^ key;
  const uint64_t row_seed = SplitMix64(base);
  auto draw = [&](int j) { return SplitMix64(row_seed + static_cast<uint64_t>(j)); };
  switch (spec_.initializer()) {
    case EmbeddingTableSpec::ZEROS:
      std::fill(out, out + dim_, 0.0f);
      return;
    case EmbeddingTableSpec::NORMAL:
      // Box-Muller, one draw per element pair (u1 in (0, 1]).
      for (int j = 0; j < dim_; j += 2) {
        const double u1 = 1 - Unit(draw(j)), u2 = Unit(draw(j + 1));
        const double r = std::sqrt(-2 * std::log(u1)) * init_scale_;
        out[j] = static_cast<float>(r * std::cos(2 * std::numbers::pi * u2));
        if (j + 1 < dim_) out[j + 1] = static_cast<float>(r * std::sin(2 * std::numbers::pi * u2));
      }
      return;
    default:
      for (int j = 0; j < dim_; ++j) {
        out[j] = static_cast<float>((2 * Unit(draw(j)) - 1) * init_scale_);
      }
  }
}

void EmbeddingShard::InitRecord(uint64_t key, int64_t touch, char* row) const {
  std::memcpy(row, &touch, 8);
  float* values = reinterpret_cast<float*>(row + 8);
  InitialRow(key, values);
  optimizer_.InitSlots(dim_, values + dim_);
}

EmbeddingShard::Place EmbeddingShard::PlaceOf(uint64_t key) const {
  if (sharding_.fixed()) {
    const int64_t local = sharding_.LocalIndex(key);
    return {static_cast<int>(local % kStripes), static_cast<uint32_t>(local / kStripes)};
  }
  return {static_cast<int>(SplitMix64(key) >> 58), 0};  // top 6 bits: independent of the owner
}

char* EmbeddingShard::RowAt(Stripe& s, uint32_t pos) const {
  return s.slabs[pos >> slab_shift_].get() + (pos & ((1u << slab_shift_) - 1)) * row_stride_;
}

const char* EmbeddingShard::RowAt(const Stripe& s, uint32_t pos) const {
  return s.slabs[pos >> slab_shift_].get() + (pos & ((1u << slab_shift_) - 1)) * row_stride_;
}

uint32_t EmbeddingShard::NewPosition(Stripe& s) {
  if (!s.free.empty()) {
    const uint32_t pos = s.free.back();
    s.free.pop_back();
    return pos;
  }
  if ((s.used >> slab_shift_) == s.slabs.size()) {
    s.slabs.emplace_back(new char[row_stride_ << slab_shift_]);
  }
  return s.used++;
}

bool EmbeddingShard::Admit(Stripe& s, uint64_t id, int64_t step) {
  const uint32_t min_count = static_cast<uint32_t>(std::max(1, spec_.admit_min_count()));
  if (min_count > 1) {
    uint32_t& count = s.pending[id];
    if (count < min_count) ++count;
    if (count < min_count) return false;
  }
  const float p = spec_.admit_probability();
  if (p > 0 && p < 1) {
    const uint64_t draw = SplitMix64(SplitMix64(seed_ ^ kAdmitSalt ^ SplitMix64(id)) + step);
    if (Unit(draw) >= p) return false;
  }
  if (min_count > 1) s.pending.erase(id);
  return true;
}

char* EmbeddingShard::FindRow(Stripe& s, Place place, uint64_t key, bool train, int64_t step) {
  if (sharding_.fixed()) return RowAt(s, place.pos);
  if (auto it = s.index.find(key); it != s.index.end()) return RowAt(s, it->second);
  if (!train) return nullptr;
  if (!Admit(s, key, step)) {
    ++s.refused;
    return nullptr;
  }
  const uint32_t pos = NewPosition(s);
  s.index.emplace(key, pos);
  char* row = RowAt(s, pos);
  InitRecord(key, step, row);
  ++s.created;
  return row;
}

absl::Status EmbeddingShard::CheckOwned(absl::Span<const uint64_t> ids) const {
  for (uint64_t id : ids) {
    const int owner = sharding_.Owner(id);
    if (owner != ps_index_) {
      return absl::InvalidArgumentError(absl::StrCat("embedding table \"", name(), "\": id ", id,
                                                     " belongs to ps ", owner, ", not ps ",
                                                     ps_index_, " (of ", sharding_.num_ps(), ")"));
    }
  }
  return absl::OkStatus();
}

void EmbeddingShard::GroupByStripe(absl::Span<const uint64_t> ids, std::vector<uint32_t>* order,
                                   std::array<uint32_t, kStripes + 1>* begin) const {
  std::vector<uint8_t> stripe(ids.size());
  std::array<uint32_t, kStripes + 1> count{};
  for (size_t i = 0; i < ids.size(); ++i) {
    stripe[i] = static_cast<uint8_t>(PlaceOf(Key(ids[i])).stripe);
    ++count[stripe[i] + 1];
  }
  for (int s = 0; s < kStripes; ++s) count[s + 1] += count[s];
  *begin = count;
  order->resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) (*order)[count[stripe[i]]++] = static_cast<uint32_t>(i);
}

void EmbeddingShard::FindRows(Stripe& s, absl::Span<const uint64_t> ids,
                              absl::Span<const uint32_t> group, bool train, int64_t step,
                              std::vector<char*>* rows) {
  // Rows are scattered over the slabs and the index: ask for the index
  // entries a few ids ahead, so that their cache misses overlap.
  constexpr size_t kAhead = 8;
  rows->resize(group.size());
  for (size_t k = 0; k < group.size(); ++k) {
    if (!sharding_.fixed() && k + kAhead < group.size()) {
      s.index.prefetch(Key(ids[group[k + kAhead]]));
    }
    const uint64_t key = Key(ids[group[k]]);
    (*rows)[k] = FindRow(s, PlaceOf(key), key, train, step);
  }
}

template <typename Fn>
void EmbeddingShard::ForEachStripe(absl::Span<const uint64_t> ids, bool train, int64_t step,
                                   Fn&& fn) {
  std::vector<uint32_t> order;
  std::array<uint32_t, kStripes + 1> begin;
  GroupByStripe(ids, &order, &begin);
  std::vector<char*> rows;
  const int first = FirstStripe();
  for (int n = 0; n < kStripes; ++n) {
    const int si = (first + n) % kStripes;
    if (begin[si] == begin[si + 1]) continue;
    const auto group = absl::MakeConstSpan(order).subspan(begin[si], begin[si + 1] - begin[si]);
    Stripe& s = stripes_[si];
    absl::MutexLock lock(&s.mu);
    FindRows(s, ids, group, train, step, &rows);
    fn(s, group, rows);
  }
}

absl::Status EmbeddingShard::Lookup(absl::Span<const uint64_t> ids, bool train, int64_t step,
                                    absl::Span<float> out) {
  if (out.size() != ids.size() * dim_) {
    return absl::InvalidArgumentError(absl::StrCat("embedding table \"", name(), "\": lookup of ",
                                                   ids.size(), " ids into ", out.size(),
                                                   " floats (dim ", dim_, ")"));
  }
  if (auto s = CheckOwned(ids); !s.ok()) return s;
  const size_t value_bytes = sizeof(float) * dim_;
  ForEachStripe(ids, train, step,
                [&](Stripe&, absl::Span<const uint32_t> group, const std::vector<char*>& rows) {
                  for (size_t k = 0; k < group.size(); ++k) {
                    if (k + 4 < group.size()) PrefetchRow(rows[k + 4]);
                    float* dst = out.data() + size_t{group[k]} * dim_;
                    char* row = rows[k];
                    if (row == nullptr) {
                      std::memset(dst, 0, value_bytes);
                      continue;
                    }
                    std::memcpy(dst, row + 8, value_bytes);
                    int64_t touch;
                    std::memcpy(&touch, row, 8);
                    if (train && step > touch) std::memcpy(row, &step, 8);
                  }
                });
  return absl::OkStatus();
}

absl::Status EmbeddingShard::CheckGradients(absl::Span<const uint64_t> ids,
                                            absl::Span<const float> grads) const {
  if (grads.size() != ids.size() * dim_) {
    return absl::InvalidArgumentError(absl::StrCat("embedding table \"", name(), "\": ", ids.size(),
                                                   " ids with ", grads.size(),
                                                   " gradient floats (dim ", dim_, ")"));
  }
  if (auto s = CheckOwned(ids); !s.ok()) return s;
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!std::isfinite(grads[k])) {
      return absl::InvalidArgumentError(absl::StrCat("embedding table \"", name(),
                                                     "\": non-finite gradient ", grads[k],
                                                     " for id ", ids[k / dim_]));
    }
  }
  absl::flat_hash_map<uint64_t, uint64_t> seen;  // key -> the first id with it
  seen.reserve(ids.size());
  for (uint64_t id : ids) {
    auto [it, inserted] = seen.emplace(Key(id), id);
    if (inserted) continue;
    return absl::InvalidArgumentError(
        it->second == id
            ? absl::StrCat("embedding table \"", name(), "\": id ", id, " twice in one update")
            : absl::StrCat("embedding table \"", name(), "\": ids ", it->second, " and ", id,
                           " share row ", it->first, " in one update (sum them first)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<EmbeddingShard::ApplyResult> EmbeddingShard::Apply(absl::Span<const uint64_t> ids,
                                                                  absl::Span<const float> grads,
                                                                  int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding table \"", name(), "\": update at step ", step, " (< 0)"));
  }
  if (auto s = CheckGradients(ids, grads); !s.ok()) return s;
  const SparseStep sparse_step = optimizer_.StepAt(step);
  ApplyResult result;
  ForEachStripe(ids, /*train=*/false, step,
                [&](Stripe&, absl::Span<const uint32_t> group, const std::vector<char*>& rows) {
                  for (size_t k = 0; k < group.size(); ++k) {
                    if (k + 4 < group.size()) PrefetchRow(rows[k + 4]);
                    if (rows[k] == nullptr) {
                      ++result.skipped;
                      continue;
                    }
                    float* w = reinterpret_cast<float*>(rows[k] + 8);
                    optimizer_.ApplyRow(sparse_step, dim_, grads.data() + size_t{group[k]} * dim_,
                                        w, w + dim_);
                    ++result.applied;
                  }
                });
  apply_skipped_ += result.skipped;
  return result;
}

int64_t EmbeddingShard::ExpireStripe(Stripe& s, int64_t step) {
  int64_t dropped = 0;
  for (auto it = s.index.begin(); it != s.index.end();) {
    int64_t touch;
    std::memcpy(&touch, RowAt(s, it->second), 8);
    if (step - touch > spec_.expire_steps()) {
      s.free.push_back(it->second);
      s.index.erase(it++);
      ++dropped;
    } else {
      ++it;
    }
  }
  s.expired += dropped;
  return dropped;
}

int64_t EmbeddingShard::Expire(int64_t step) {
  if (sharding_.fixed() || spec_.expire_steps() == 0) return 0;
  int64_t dropped = 0;
  for (Stripe& s : stripes_) {
    absl::MutexLock lock(&s.mu);
    dropped += ExpireStripe(s, step);
  }
  return dropped;
}

EmbeddingShard::Stats EmbeddingShard::GetStats() const {
  Stats st;
  st.row_bytes = row_stride_;
  for (const Stripe& s : stripes_) {
    absl::MutexLock lock(&s.mu);
    st.rows += static_cast<int64_t>(s.used) - static_cast<int64_t>(s.free.size());
    st.bytes += static_cast<int64_t>(s.slabs.size()) * (row_stride_ << slab_shift_);
    st.bytes += static_cast<int64_t>(s.slabs.capacity() * sizeof(s.slabs[0]));
    st.bytes += MapBytes(s.index.capacity(), sizeof(std::pair<const uint64_t, uint32_t>));
    st.bytes += MapBytes(s.pending.capacity(), sizeof(std::pair<const uint64_t, uint32_t>));
    st.bytes += static_cast<int64_t>(s.free.capacity() * sizeof(uint32_t));
    st.rows_created += s.created;
    st.rows_expired += s.expired;
    st.rows_restored += s.restored;
    st.admissions_refused += s.refused;
    st.pending_ids += static_cast<int64_t>(s.pending.size());
  }
  st.apply_skipped = apply_skipped_.load();
  st.bytes += static_cast<int64_t>(sizeof(*this));
  st.bytes_per_row = st.rows > 0 ? static_cast<double>(st.bytes) / st.rows : 0;
  return st;
}

int64_t EmbeddingShard::ExportStripe(int stripe, std::string* out) const {
  const Stripe& s = stripes_[stripe];
  absl::MutexLock lock(&s.mu);
  const int64_t rows = sharding_.fixed() ? s.used : static_cast<int64_t>(s.index.size());
  size_t at = out->size();
  out->resize(at + rows * record_bytes());
  auto put = [&](uint64_t key, uint32_t pos) ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    std::memcpy(out->data() + at, &key, 8);
    std::memcpy(out->data() + at + 8, RowAt(s, pos), row_stride_);
    at += record_bytes();
  };
  if (sharding_.fixed()) {
    for (uint32_t pos = 0; pos < s.used; ++pos) {
      const uint64_t local = uint64_t{pos} * kStripes + stripe;
      put(local * sharding_.num_ps() + ps_index_, pos);
    }
  } else {
    for (const auto& [id, pos] : s.index) put(id, pos);
  }
  return rows;
}

void EmbeddingShard::ImportRecord(Stripe& s, uint64_t key, const char* record) {
  uint32_t pos = PlaceOf(key).pos;
  if (!sharding_.fixed()) {
    auto [it, inserted] = s.index.try_emplace(key, 0);
    if (inserted) it->second = NewPosition(s);
    pos = it->second;
    s.pending.erase(key);
  }
  std::memcpy(RowAt(s, pos), record + 8, row_stride_);
  ++s.restored;
}

absl::StatusOr<int64_t> EmbeddingShard::ImportRecords(absl::string_view records) {
  const size_t n = records.size() / record_bytes();
  std::vector<uint64_t> keys;  // of the records this shard keeps
  std::vector<const char*> kept;
  for (size_t i = 0; i < n; ++i) {
    const char* record = records.data() + i * record_bytes();
    uint64_t key;
    std::memcpy(&key, record, 8);
    if (sharding_.fixed() && key >= static_cast<uint64_t>(spec_.rows())) {
      return absl::InvalidArgumentError(absl::StrCat("embedding table \"", name(), "\": row ", key,
                                                     " is beyond its ", spec_.rows(), " rows"));
    }
    // A fixed table's key is its row, whose owner is the row mod num_ps.
    if (sharding_.Owner(key) != ps_index_) continue;
    keys.push_back(key);
    kept.push_back(record);
  }
  std::vector<uint32_t> order;
  std::array<uint32_t, kStripes + 1> begin;
  GroupByStripe(keys, &order, &begin);
  for (int si = 0; si < kStripes; ++si) {
    Stripe& s = stripes_[si];
    absl::MutexLock lock(&s.mu);
    for (uint32_t k = begin[si]; k < begin[si + 1]; ++k) {
      if (!sharding_.fixed() && k + 8 < begin[si + 1]) s.index.prefetch(keys[order[k + 8]]);
      ImportRecord(s, keys[order[k]], kept[order[k]]);
    }
  }
  return static_cast<int64_t>(keys.size());
}

void EmbeddingShard::Reserve(int64_t rows) {
  if (sharding_.fixed() || rows <= 0) return;
  // Ids spread over the stripes by hash: allow for the spread.
  const int64_t per_stripe = rows / kStripes + rows / kStripes / 50 + 64;
  for (Stripe& s : stripes_) {
    absl::MutexLock lock(&s.mu);
    s.index.reserve(static_cast<size_t>(per_stripe));
  }
}

}  // namespace psflow::ps::embedding
