#include "data/source.h"

#include "absl/strings/str_cat.h"
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

std::string DescribeSource(const DataSource& source) {
  return source.dataset == "synthetic" ? "the synthetic images"
                                       : absl::StrCat("the images in ", source.data_dir);
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

absl::StatusOr<Dataset> LoadDataset(const DataSource& source, const ModelInput& model,
                                    Split split) {
  absl::StatusOr<Dataset> data;
  if (source.dataset == "idx") {
    data = LoadMnist(source.data_dir, split);
  } else if (source.dataset == "synthetic") {
    data = MakeSynthetic(model.shape, source.synthetic_examples, split);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset '", source.dataset, "' is not one of idx, synthetic"));
  }
  if (!data.ok()) return data.status();
  absl::Status fits = CheckFitsModel(data->shape(), DescribeSource(source), model);
  if (!fits.ok()) return fits;
  return data;
}

}  // namespace psflow::data
