#include "data/tfrecord/example.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace psflow::data {
namespace {

using example::Feature;

// The names TensorFlow's proto uses, which users see in their own code.
absl::string_view KindName(Feature::KindCase kind) {
  switch (kind) {
    case Feature::kBytesList:
      return "bytes_list";
    case Feature::kFloatList:
      return "float_list";
    case Feature::kInt64List:
      return "int64_list";
    case Feature::KIND_NOT_SET:
      break;
  }
  return "no list";
}

std::string WithArticle(Feature::KindCase kind) {
  return absl::StrCat(kind == Feature::kInt64List ? "an " : "a ", KindName(kind));
}

// The feature `key` if it holds a list of `kind` (or none: an empty list).
absl::StatusOr<const Feature*> FindFeature(const Example& example, absl::string_view key,
                                           Feature::KindCase kind) {
  const auto& features = example.features().feature();
  const auto it = features.find(std::string(key));
  if (it == features.end()) {
    return absl::InvalidArgumentError(absl::StrCat("the example has no feature '", key, "'"));
  }
  const Feature& feature = it->second;
  if (feature.kind_case() != kind && feature.kind_case() != Feature::KIND_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature '", key, "' is ", WithArticle(feature.kind_case()), ", not ", WithArticle(kind)));
  }
  return &feature;
}

absl::Status CheckCount(absl::string_view key, int64_t have, int64_t want) {
  if (want == kAnyCount || have == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("feature '", key, "' has ", have,
                                                 have == 1 ? " value" : " values", ", not ", want));
}

std::string DescribeFeature(absl::string_view key, const Feature& feature) {
  int64_t count = 0;
  switch (feature.kind_case()) {
    case Feature::kBytesList:
      count = feature.bytes_list().value_size();
      break;
    case Feature::kFloatList:
      count = feature.float_list().value_size();
      break;
    case Feature::kInt64List:
      count = feature.int64_list().value_size();
      break;
    case Feature::KIND_NOT_SET:
      break;
  }
  std::string line = absl::StrCat(key, ": ", KindName(feature.kind_case()), ", ", count,
                                  count == 1 ? " value" : " values");
  if (feature.has_bytes_list() && count > 0 && count <= 4) {
    std::vector<size_t> lengths;
    for (const std::string& value : feature.bytes_list().value()) lengths.push_back(value.size());
    absl::StrAppend(&line, " (", absl::StrJoin(lengths, ", "), " bytes)");
  }
  return line;
}

}  // namespace

absl::StatusOr<Example> ParseExample(absl::string_view record) {
  Example example;
  if (!example.ParseFromArray(record.data(), static_cast<int>(record.size()))) {
    return absl::InvalidArgumentError(absl::StrCat("not a tf.Example: a record of ", record.size(),
                                                   " bytes that does not parse as one"));
  }
  return example;
}

absl::StatusOr<absl::string_view> OneBytes(const Example& example, absl::string_view key) {
  PSFLOW_ASSIGN_OR_RETURN(const Feature* feature, FindFeature(example, key, Feature::kBytesList));
  PSFLOW_RETURN_IF_ERROR(CheckCount(key, feature->bytes_list().value_size(), 1));
  return absl::string_view(feature->bytes_list().value(0));
}

absl::StatusOr<int64_t> OneInt64(const Example& example, absl::string_view key) {
  PSFLOW_ASSIGN_OR_RETURN(const Feature* feature, FindFeature(example, key, Feature::kInt64List));
  PSFLOW_RETURN_IF_ERROR(CheckCount(key, feature->int64_list().value_size(), 1));
  return feature->int64_list().value(0);
}

absl::StatusOr<absl::Span<const float>> Floats(const Example& example, absl::string_view key,
                                               int64_t count) {
  PSFLOW_ASSIGN_OR_RETURN(const Feature* feature, FindFeature(example, key, Feature::kFloatList));
  const auto& values = feature->float_list().value();
  PSFLOW_RETURN_IF_ERROR(CheckCount(key, values.size(), count));
  return absl::Span<const float>(values.data(), values.size());
}

absl::StatusOr<absl::Span<const int64_t>> Int64s(const Example& example, absl::string_view key,
                                                 int64_t count) {
  PSFLOW_ASSIGN_OR_RETURN(const Feature* feature, FindFeature(example, key, Feature::kInt64List));
  const auto& values = feature->int64_list().value();
  PSFLOW_RETURN_IF_ERROR(CheckCount(key, values.size(), count));
  return absl::Span<const int64_t>(values.data(), values.size());
}

std::string DescribeFeatures(const Example& example) {
  const auto& features = example.features().feature();
  if (features.empty()) return "(no features)\n";
  // The proto's map has no order.
  std::vector<std::pair<absl::string_view, const Feature*>> sorted;
  for (const auto& [key, feature] : features) sorted.emplace_back(key, &feature);
  std::sort(sorted.begin(), sorted.end());
  std::string out;
  for (const auto& [key, feature] : sorted)
    absl::StrAppend(&out, DescribeFeature(key, *feature), "\n");
  return out;
}

void AddBytes(Example* example, absl::string_view key, absl::string_view value) {
  Feature& feature = (*example->mutable_features()->mutable_feature())[std::string(key)];
  feature.mutable_bytes_list()->add_value(std::string(value));
}

void AddInt64(Example* example, absl::string_view key, int64_t value) {
  AddInt64s(example, key, absl::MakeConstSpan(&value, 1));
}

void AddInt64s(Example* example, absl::string_view key, absl::Span<const int64_t> values) {
  Feature& feature = (*example->mutable_features()->mutable_feature())[std::string(key)];
  auto* list = feature.mutable_int64_list()->mutable_value();
  list->Add(values.begin(), values.end());
}

void AddFloats(Example* example, absl::string_view key, absl::Span<const float> values) {
  Feature& feature = (*example->mutable_features()->mutable_feature())[std::string(key)];
  auto* list = feature.mutable_float_list()->mutable_value();
  list->Add(values.begin(), values.end());
}

}  // namespace psflow::data
