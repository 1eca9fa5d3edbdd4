#include "data/source.h"

#include "absl/strings/str_cat.h"
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

}  // namespace psflow::data
