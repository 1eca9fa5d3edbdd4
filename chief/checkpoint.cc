#include "chief/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/log.h"
#include "common/placement.h"
#include "common/status_macros.h"
#include "common/tensor_view.h"

namespace psflow::chief {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "ckpt-";

// Checkpoint directories by step, newest first ("ckpt-<digits>" only).
std::vector<std::pair<int64_t, fs::path>> ListCheckpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (!absl::StartsWith(name, kPrefix) || !absl::SimpleAtoi(name.substr(strlen(kPrefix)), &step))
      continue;
    if (name != absl::StrCat(kPrefix, step) || !e.is_directory(ec)) continue;
    out.emplace_back(step, e.path());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

absl::StatusOr<Checkpoint> ReadOne(const fs::path& path) {
  absl::StatusOr<std::string> manifest_bytes = ReadFile((path / "manifest.pb").string());
  if (!manifest_bytes.ok()) return absl::DataLossError("no manifest");
  Checkpoint ckpt;
  if (!ckpt.manifest.ParseFromString(*manifest_bytes))
    return absl::DataLossError("manifest does not parse");
  absl::StatusOr<std::string> data = ReadFile((path / "data").string());
  if (!data.ok()) return absl::DataLossError("no data file");
  if (static_cast<int64_t>(data->size()) != ckpt.manifest.data_bytes()) {
    return absl::DataLossError(absl::StrCat(
        "data file has ", data->size(), " bytes, the manifest says ", ckpt.manifest.data_bytes()));
  }
  for (const CheckpointTensor& t : ckpt.manifest.tensor()) {
    absl::StatusOr<int64_t> n = CheckedNumElements(t.shape(), int64_t{1} << 32);
    if (!n.ok() || *n * 4 != t.bytes() || t.offset() < 0 ||
        t.offset() + t.bytes() > static_cast<int64_t>(data->size())) {
      return absl::DataLossError(
          absl::StrCat("tensor '", t.name(), "' ", t.slot(), " does not fit the data"));
    }
    if (Crc32(absl::string_view(data->data() + t.offset(), static_cast<size_t>(t.bytes()))) !=
        t.crc32()) {
      return absl::DataLossError(absl::StrCat("checksum mismatch in '", t.name(), "' ", t.slot()));
    }
    CheckpointTensorData d;
    d.name = t.name();
    d.slot = t.slot();
    d.shape.assign(t.shape().begin(), t.shape().end());
    d.values.resize(*n);
    std::memcpy(d.values.data(), data->data() + t.offset(), static_cast<size_t>(t.bytes()));
    ckpt.tensors.push_back(std::move(d));
  }
  ckpt.manifest.clear_tensor();
  ckpt.manifest.clear_data_bytes();
  return ckpt;
}

}  // namespace

Checkpoint EmptyCheckpoint(const JobConfig& job, int64_t step,
                           const std::vector<std::string>& slots) {
  Checkpoint ckpt;
  for (const VariablePlacement& v : job.placement().variable()) {
    std::vector<int64_t> shape(v.shape().begin(), v.shape().end());
    const size_t n = static_cast<size_t>(NumElements(shape));
    ckpt.tensors.push_back({v.name(), "", shape, std::vector<float>(n)});
    for (const std::string& slot : slots)
      ckpt.tensors.push_back({v.name(), slot, shape, std::vector<float>(n)});
  }
  CheckpointManifest& m = ckpt.manifest;
  m.set_step(step);
  *m.mutable_model() = job.model();
  *m.mutable_optimizer() = job.optimizer();
  m.set_steps_per_epoch(job.steps_per_epoch());
  m.set_num_workers(job.num_workers());
  m.set_batch_size(job.batch_size());
  m.set_seed(job.seed());
  m.set_num_ps(job.num_ps());
  for (int w = 0; w < job.num_workers(); ++w) {
    WorkerPosition* pos = m.add_worker();
    pos->set_worker(w);
    pos->set_epoch(step / job.steps_per_epoch());
    pos->set_examples_done((step % job.steps_per_epoch()) * WorkerBatch(job));
  }
  return ckpt;
}

std::string CheckpointsDir(const std::string& model_dir) {
  return absl::StrCat(model_dir, "/checkpoints");
}

absl::Status WriteCheckpoint(const std::string& model_dir, const Checkpoint& checkpoint, int keep) {
  const std::string dir = CheckpointsDir(model_dir);
  PSFLOW_RETURN_IF_ERROR(MakeDirectories(dir));
  const int64_t step = checkpoint.manifest.step();
  const fs::path final_path = fs::path(dir) / absl::StrCat(kPrefix, step);
  const fs::path tmp_path = fs::path(dir) / absl::StrCat(kPrefix, step, ".tmp");
  std::error_code ec;
  fs::remove_all(tmp_path, ec);
  PSFLOW_RETURN_IF_ERROR(MakeDirectories(tmp_path.string()));

  CheckpointManifest manifest = checkpoint.manifest;
  std::string data;
  for (const CheckpointTensorData& t : checkpoint.tensors) {
    CheckpointTensor* entry = manifest.add_tensor();
    entry->set_name(t.name);
    entry->set_slot(t.slot);
    for (int64_t d : t.shape) entry->add_shape(d);
    entry->set_offset(static_cast<int64_t>(data.size()));
    entry->set_bytes(static_cast<int64_t>(t.values.size() * sizeof(float)));
    const char* bytes = reinterpret_cast<const char*>(t.values.data());
    entry->set_crc32(Crc32(absl::string_view(bytes, t.values.size() * sizeof(float))));
    data.append(bytes, t.values.size() * sizeof(float));
  }
  manifest.set_data_bytes(static_cast<int64_t>(data.size()));
  manifest.set_written_unix_ms(absl::ToUnixMillis(absl::Now()));
  // The data first, the manifest last: a directory without a valid manifest
  // is not a checkpoint.
  PSFLOW_RETURN_IF_ERROR(WriteFileAtomically((tmp_path / "data").string(), data));
  PSFLOW_RETURN_IF_ERROR(
      WriteFileAtomically((tmp_path / "manifest.pb").string(), manifest.SerializeAsString()));
  fs::remove_all(final_path, ec);
  fs::rename(tmp_path, final_path, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp_path.string(), ": ", ec.message()));
  PSFLOW_RETURN_IF_ERROR(
      WriteFileAtomically(absl::StrCat(dir, "/checkpoint"), absl::StrCat(kPrefix, step, "\n")));

  // Keep the newest `keep`; drop leftovers of interrupted writes.
  std::vector<std::pair<int64_t, fs::path>> all = ListCheckpoints(dir);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < all.size(); ++i)
    fs::remove_all(all[i].second, ec);
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, kPrefix) && absl::EndsWith(name, ".tmp") && e.path() != tmp_path) {
      fs::remove_all(e.path(), ec);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Checkpoint> ReadNewestCheckpoint(const std::string& model_dir) {
  const std::string dir = CheckpointsDir(model_dir);
  for (const auto& [step, path] : ListCheckpoints(dir)) {
    absl::StatusOr<Checkpoint> ckpt = ReadOne(path);
    if (ckpt.ok() && ckpt->manifest.step() == step) return ckpt;
    PSLOG(WARNING) << "skipping checkpoint " << path.string() << ": "
                   << (ckpt.ok() ? std::string("its manifest names another step")
                                 : std::string(ckpt.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no valid checkpoint in ", dir));
}

}  // namespace psflow::chief
