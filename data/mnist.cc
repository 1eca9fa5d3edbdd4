#include "data/mnist.h"

#include <zlib.h>

#include <cassert>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow::data {
namespace {

// Reads the whole file, inflating it if it is gzipped: gzread passes plain
// files through unchanged, so detection is by content, not by name.
absl::StatusOr<std::vector<uint8_t>> ReadMaybeGzipped(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("no such file: ", path));
  }
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  gzbuffer(file, 1 << 20);
  std::vector<uint8_t> out;
  constexpr size_t kChunk = 1 << 20;
  while (true) {
    const size_t old_size = out.size();
    out.resize(old_size + kChunk);
    const int n = gzread(file, out.data() + old_size, kChunk);
    if (n < 0) {
      int errnum = 0;
      const std::string message = gzerror(file, &errnum);
      gzclose(file);
      return absl::InvalidArgumentError(absl::StrCat(path, " is truncated or corrupt: ", message));
    }
    out.resize(old_size + n);
    if (n == 0) break;
  }
  // A gzip stream cut short can end the loop without a read error; zlib then
  // reports it on close.
  int errnum = 0;
  const char* message = gzerror(file, &errnum);
  const std::string pending = (errnum != Z_OK && message != nullptr) ? message : "";
  const int close_rc = gzclose(file);
  if (errnum != Z_OK || close_rc == Z_BUF_ERROR) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is truncated or corrupt: ", pending.empty() ? "unexpected end of file" : pending));
  }
  return out;
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [0, bound) by rejection, so the result depends only on the
// engine's output (std::uniform_int_distribution is implementation-defined).
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t reject_from = -bound % bound;  // 2^64 mod bound
  while (true) {
    const uint64_t r = rng();
    if (r >= reject_from) return r % bound;
  }
}

// Tries <dir>/<name>, then <dir>/<name>.gz.
absl::StatusOr<std::pair<std::string, IdxFile>> ReadNamed(const std::string& dir,
                                                          const std::string& name) {
  const std::string plain = (std::filesystem::path(dir) / name).string();
  const std::string gz = plain + ".gz";
  std::error_code ec;
  std::string path;
  if (std::filesystem::exists(plain, ec)) {
    path = plain;
  } else if (std::filesystem::exists(gz, ec)) {
    path = gz;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("no such file: ", plain, "[.gz]"));
  }
  absl::StatusOr<IdxFile> idx = ReadIdxFile(path);
  if (!idx.ok()) return idx.status();
  return std::make_pair(path, *std::move(idx));
}

}  // namespace

absl::StatusOr<IdxFile> ReadIdxFileInDir(const std::string& dir, const std::string& name) {
  absl::StatusOr<std::pair<std::string, IdxFile>> named = ReadNamed(dir, name);
  if (!named.ok()) return named.status();
  return std::move(named->second);
}

namespace {

std::string Magic(size_t ndims) { return absl::StrFormat("0x%08x", 0x800u + ndims); }

}  // namespace

absl::StatusOr<IdxFile> ReadIdxFile(const std::string& path) {
  absl::StatusOr<std::vector<uint8_t>> bytes = ReadMaybeGzipped(path);
  if (!bytes.ok()) return bytes.status();
  const std::vector<uint8_t>& b = *bytes;
  if (b.size() < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is truncated: ", b.size(), " bytes, no IDX header"));
  }
  const uint32_t magic = BigEndian32(b.data());
  const int ndims = b[3];
  // Only unsigned-byte IDX files (type code 0x08) with 1..4 dimensions.
  if (b[0] != 0 || b[1] != 0 || b[2] != 0x08 || ndims < 1 || ndims > 4) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has bad magic number 0x%08x (expected 0x0000080N, an unsigned-byte IDX file)", path,
        magic));
  }
  const size_t header = 4 + 4 * static_cast<size_t>(ndims);
  if (b.size() < header) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is truncated: %d bytes, shorter than its %d-byte header", path, b.size(), header));
  }
  IdxFile idx;
  uint64_t expected = 1;
  for (int i = 0; i < ndims; ++i) {
    const uint32_t dim = BigEndian32(b.data() + 4 + 4 * i);
    idx.dims.push_back(dim);
    if (dim != 0 && expected > std::numeric_limits<uint64_t>::max() / dim) {
      return absl::InvalidArgumentError(absl::StrCat(path, " has absurd dimensions"));
    }
    expected *= dim;
  }
  const uint64_t have = b.size() - header;
  if (have < expected) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is truncated: %d data bytes, its header promises %d", path, have, expected));
  }
  if (have > expected) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has %d bytes after the %d its header promises", path, have - expected, expected));
  }
  idx.data.assign(b.begin() + header, b.end());
  return idx;
}

absl::StatusOr<Dataset> LoadMnist(const std::string& dir, Split split) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  auto images = ReadNamed(dir, prefix + "-images-idx3-ubyte");
  if (!images.ok()) return images.status();
  auto labels = ReadNamed(dir, prefix + "-labels-idx1-ubyte");
  if (!labels.ok()) return labels.status();
  const auto& [image_path, image_idx] = *images;
  const auto& [label_path, label_idx] = *labels;
  if (image_idx.dims.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(image_path, " has magic number ",
                                                   Magic(image_idx.dims.size()),
                                                   ", expected 0x00000803 (images)"));
  }
  if (label_idx.dims.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(label_path, " has magic number ",
                                                   Magic(label_idx.dims.size()),
                                                   ", expected 0x00000801 (labels)"));
  }
  if (image_idx.dims[0] != label_idx.dims[0]) {
    return absl::InvalidArgumentError(absl::StrFormat("%s has %d images but %s has %d labels",
                                                      image_path, image_idx.dims[0], label_path,
                                                      label_idx.dims[0]));
  }
  Dataset ds;
  ds.count = image_idx.dims[0];
  ds.channels = 1;
  ds.height = static_cast<int>(image_idx.dims[1]);
  ds.width = static_cast<int>(image_idx.dims[2]);
  ds.num_classes = 10;
  ds.labels.resize(ds.count);
  for (int64_t i = 0; i < ds.count; ++i) {
    const uint8_t label = label_idx.data[i];
    if (label >= ds.num_classes) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: label %d at index %d is not below %d",
                                                        label_path, label, i, ds.num_classes));
    }
    ds.labels[i] = label;
  }
  ds.images.resize(image_idx.data.size());
  for (size_t i = 0; i < image_idx.data.size(); ++i) {
    ds.images[i] = image_idx.data[i] * (1.0f / 255.0f);
  }
  return ds;
}

ShardSampler::ShardSampler(int64_t count, int num_workers, int worker_index, uint64_t seed)
    : count_(count), num_workers_(num_workers), worker_index_(worker_index), seed_(seed) {
  assert(count >= 0 && num_workers >= 1 && worker_index >= 0 && worker_index < num_workers);
}

int64_t ShardSampler::shard_size() const {
  if (count_ <= 0 || num_workers_ < 1 || worker_index_ < 0 || worker_index_ >= num_workers_) {
    return 0;  // invalid arguments (asserted in debug builds): an empty shard
  }
  return (count_ + num_workers_ - 1) / num_workers_;
}

std::vector<int64_t> ShardSampler::EpochIndices(int64_t epoch) const {
  const int64_t size = shard_size();
  if (size == 0) return {};
  // Every worker draws the same permutation: the engine depends only on
  // (seed, epoch), and the shuffle only on the engine's raw output.
  std::mt19937_64 rng(SplitMix64(seed_ ^ SplitMix64(static_cast<uint64_t>(epoch))));
  std::vector<int64_t> perm(count_);
  for (int64_t i = 0; i < count_; ++i) perm[i] = i;
  for (int64_t i = count_ - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(UniformBelow(rng, static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  std::vector<int64_t> out;
  out.reserve(size);
  for (int64_t k = 0; k < size; ++k) {
    const int64_t position = worker_index_ + k * num_workers_;  // < size * num_workers
    out.push_back(perm[position % count_]);                     // padding wraps around
  }
  return out;
}

absl::Status GatherBatch(const Dataset& dataset, absl::Span<const int64_t> indices, float* images,
                         uint64_t* ids, int32_t* labels) {
  if (indices.empty()) return absl::OkStatus();
  const int64_t floats = dataset.example_floats(), id_count = dataset.example_ids();
  if (images == nullptr || labels == nullptr || (id_count > 0 && ids == nullptr)) {
    return absl::InvalidArgumentError("GatherBatch: null output buffer");
  }
  if (static_cast<int64_t>(dataset.images.size()) < dataset.count * floats ||
      static_cast<int64_t>(dataset.ids.size()) < dataset.count * id_count ||
      static_cast<int64_t>(dataset.labels.size()) < dataset.count) {
    return absl::InvalidArgumentError("GatherBatch: dataset is smaller than its count says");
  }
  for (size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || indices[i] >= dataset.count) {
      return absl::InvalidArgumentError(
          absl::StrFormat("GatherBatch: index %d at position %d is out of range [0, %d)",
                          indices[i], i, dataset.count));
    }
  }
  for (size_t i = 0; i < indices.size(); ++i) {
    const int64_t index = indices[i];
    std::memcpy(images + i * floats, dataset.images.data() + index * floats,
                sizeof(float) * floats);
    if (id_count > 0) {
      std::memcpy(ids + i * id_count, dataset.ids.data() + index * id_count,
                  sizeof(uint64_t) * id_count);
    }
    labels[i] = dataset.labels[index];
  }
  return absl::OkStatus();
}

}  // namespace psflow::data
