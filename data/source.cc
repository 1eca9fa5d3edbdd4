#include "data/source.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "data/formats.h"
#include "data/synthetic.h"

namespace psflow::data {
namespace {

std::string Describe(const ExampleShape& s) {
  return absl::StrCat(s.channels, "x", s.height, "x", s.width, " with ", s.num_classes, " classes");
}

}  // namespace

ModelInput ModelInputOf(const ModelSpec& spec) {
  const InputSpec& in = spec.input();
  return {spec.name(), {in.channels(), in.height(), in.width(), spec.num_classes()}};
}

DataConfig InMemoryData(const std::string& format, const std::string& data_dir,
                        int64_t synthetic_examples) {
  DataConfig config;
  config.set_format(format);
  config.set_data_dir(data_dir);
  config.set_synthetic_examples(synthetic_examples);
  return config;
}

std::string DescribeSource(const DataConfig& config) {
  if (config.format() == "synthetic") return "the synthetic images";
  if (config.format() == "idx") return absl::StrCat("the images in ", config.data_dir());
  return absl::StrCat("the ", config.format(), " data");
}

absl::Status CheckFitsModel(const ExampleShape& data, absl::string_view origin,
                            const ModelInput& model) {
  const ExampleShape& m = model.shape;
  if (data.channels == m.channels && data.height == m.height && data.width == m.width &&
      data.num_classes == m.num_classes) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "model ", model.model_name, " takes ", m.channels, "x", m.height, "x", m.width,
      " inputs with ", m.num_classes, " classes, but ", origin, " are ", Describe(data)));
}

absl::Status CheckFitsModel(const Dataset& data, const ModelInput& model) {
  return CheckFitsModel(data.shape(), "the data", model);
}

absl::StatusOr<Dataset> LoadDataset(const DataConfig& config, const ModelInput& model, Split split,
                                    int threads) {
  absl::StatusOr<Dataset> data;
  if (config.format() == "idx") {
    data = LoadMnist(config.data_dir(), split);
  } else if (config.format() == "synthetic") {
    data = MakeSynthetic(model.shape, config.synthetic_examples(), split);
  } else if (IsStreamed(config.format())) {
    absl::StatusOr<std::unique_ptr<DataFormat>> format = OpenDataFormat(config, model.shape, split);
    if (!format.ok()) return format.status();
    data = ReadExamples(**format, model.shape, -1, threads);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("data format '", config.format(), "' is not one of ", kDataFormats));
  }
  if (!data.ok()) return data.status();
  absl::Status fits = CheckFitsModel(data->shape(), DescribeSource(config), model);
  if (!fits.ok()) return fits;
  return data;
}

absl::StatusOr<IdSelection> IdSelection::Create(const std::vector<IdFeature>& data,
                                                absl::string_view origin, const ModelSpec& model) {
  IdSelection s;
  s.data_ids_ = IdsPerExample(data);
  for (const IdFeatureSpec& want : model.input().id_feature()) {
    const int width = want.width() > 0 ? want.width() : 1;
    int64_t first = 0;
    bool found = false;
    for (const IdFeature& f : data) {
      if (f.name == want.name() && f.width == width) {
        for (int k = 0; k < width; ++k) s.sources_.push_back(first + k);
        found = true;
        break;
      }
      first += f.width;
    }
    if (found) continue;
    std::vector<std::string> have;
    for (const IdFeature& f : data) {
      have.push_back(f.width == 1 ? f.name : absl::StrCat(f.name, " (", f.width, ")"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "model ", model.name(), " reads id feature '", want.name(), "' (", width,
        width == 1 ? " id" : " ids", " per example), which ", origin, " lack (",
        have.empty() ? "they carry no ids" : absl::StrCat("they have ", absl::StrJoin(have, ", ")),
        ")"));
  }
  return s;
}

void IdSelection::Select(const uint64_t* data, int64_t examples, uint64_t* out) const {
  const int64_t n = model_ids();
  for (int64_t e = 0; e < examples; ++e) {
    const uint64_t* in = data + e * data_ids_;
    for (int64_t k = 0; k < n; ++k) out[e * n + k] = in[sources_[k]];
  }
}

}  // namespace psflow::data
