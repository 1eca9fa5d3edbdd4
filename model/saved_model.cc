#include "model/saved_model.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/tensor_view.h"
#include "model/spec.h"

namespace psflow::model {

absl::Status WriteSavedModel(const std::string& dir, const ModelSpec& spec, int64_t global_step,
                             const std::vector<std::vector<float>>& values) {
  std::vector<VariableShape> vars = ModelVariables(spec);
  if (vars.size() != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("saved model needs ", vars.size(), " variables, got ", values.size()));
  }
  SavedModel saved;
  *saved.mutable_spec() = spec;
  saved.set_global_step(global_step);
  for (size_t i = 0; i < vars.size(); ++i) {
    if (static_cast<int64_t>(values[i].size()) != NumElements(vars[i].shape)) {
      return absl::InvalidArgumentError(absl::StrCat("variable '", vars[i].name, "' has ",
                                                     values[i].size(), " values, expected ",
                                                     NumElements(vars[i].shape)));
    }
    TensorProto* t = saved.add_variable();
    t->set_name(vars[i].name);
    t->set_dtype(DT_FLOAT);
    for (int64_t d : vars[i].shape) t->add_shape(d);
    t->set_data(reinterpret_cast<const char*>(values[i].data()), values[i].size() * sizeof(float));
    t->set_crc32(Crc32(t->data()));
  }
  absl::Status s = MakeDirectories(dir);
  if (!s.ok()) return s;
  return WriteFileAtomically(absl::StrCat(dir, "/", kSavedModelFile), saved.SerializeAsString());
}

absl::Status CheckSavedModelDir(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path at = dir.empty() ? fs::path(".") : fs::path(dir);
  std::error_code ec;
  while (!fs::exists(at, ec) && !ec) {
    const fs::path parent = at.parent_path();
    at = parent.empty() ? fs::path(".") : parent;
  }
  const std::string cannot = absl::StrCat("cannot write the saved model to ", dir, ": ");
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat(cannot, at.string(), ": ", ec.message()));
  }
  if (!fs::is_directory(at, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(cannot, at.string(), " is not a directory"));
  }
  if (::access(at.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(cannot, at.string(), ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadedModel> ReadSavedModel(const std::string& path) {
  std::string file =
      std::filesystem::is_directory(path) ? absl::StrCat(path, "/", kSavedModelFile) : path;
  absl::StatusOr<std::string> bytes = ReadFile(file);
  if (!bytes.ok()) return absl::NotFoundError(absl::StrCat("no saved model at ", file));
  SavedModel saved;
  if (!saved.ParseFromString(*bytes)) {
    return absl::DataLossError(absl::StrCat(file, " is not a psflow saved model (cannot parse)"));
  }
  absl::StatusOr<std::vector<ActivationShape>> valid = ValidateModelSpec(saved.spec());
  if (!valid.ok()) {
    return absl::DataLossError(
        absl::StrCat(file, ": invalid model spec: ", valid.status().message()));
  }
  std::vector<VariableShape> vars = ModelVariables(saved.spec());
  if (static_cast<int>(vars.size()) != saved.variable_size()) {
    // Name the first variable of the spec the file lacks: saved models
    // written before batch norm kept running statistics lack those.
    for (const VariableShape& v : vars) {
      const bool present = std::any_of(saved.variable().begin(), saved.variable().end(),
                                       [&](const TensorProto& t) { return t.name() == v.name; });
      if (present) continue;
      return absl::DataLossError(absl::StrCat(
          file, ": no variable '", v.name, "'",
          v.trainable ? ""
                      : " (a saved model from before batch norm kept running statistics: "
                        "train the model again)"));
    }
    return absl::DataLossError(
        absl::StrCat(file, ": ", saved.variable_size(), " variables, the spec has ", vars.size()));
  }
  LoadedModel loaded;
  loaded.spec = saved.spec();
  loaded.global_step = saved.global_step();
  for (size_t i = 0; i < vars.size(); ++i) {
    const TensorProto& t = saved.variable(static_cast<int>(i));
    std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    if (t.name() != vars[i].name || shape != vars[i].shape || t.dtype() != DT_FLOAT ||
        static_cast<int64_t>(t.data().size()) != NumElements(shape) * 4) {
      return absl::DataLossError(absl::StrCat(file, ": variable ", i, " ('", t.name(),
                                              "') does not match the spec's '", vars[i].name, "' ",
                                              ShapeString(vars[i].shape)));
    }
    if (Crc32(t.data()) != t.crc32()) {
      return absl::DataLossError(absl::StrCat(file, ": checksum mismatch in '", t.name(), "'"));
    }
    std::vector<float> v(NumElements(shape));
    std::memcpy(v.data(), t.data().data(), t.data().size());
    loaded.values.push_back(std::move(v));
  }
  return loaded;
}

}  // namespace psflow::model
