// tf.train.Example records (proto/example.proto): parsing a record, reading
// its features with their type and count checked, describing them, and
// building examples to write. Thread-safe (no shared state).
//
// Errors are INVALID_ARGUMENT on one line that names the feature:
//   "the example has no feature 'label'"
//   "feature 'label' is a bytes_list, not an int64_list"
//   "feature 'label' has 3 values, not 1"
// A feature whose list is not set reads as an empty list of any type, as
// TensorFlow reads it.
#ifndef PSFLOW_DATA_TFRECORD_EXAMPLE_H_
#define PSFLOW_DATA_TFRECORD_EXAMPLE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/example.pb.h"

namespace psflow::data {

using example::Example;

// `record` parsed as an Example; INVALID_ARGUMENT "not a tf.Example" (with
// its length) when it does not parse.
absl::StatusOr<Example> ParseExample(absl::string_view record);

// Count checks: kAnyCount takes a list of any length.
inline constexpr int64_t kAnyCount = -1;

// The single value of a bytes_list / int64_list feature.
absl::StatusOr<absl::string_view> OneBytes(const Example& example, absl::string_view key);
absl::StatusOr<int64_t> OneInt64(const Example& example, absl::string_view key);
// The values of a float_list / int64_list feature, `count` of them unless
// kAnyCount. Views into `example`, valid while it is unchanged.
absl::StatusOr<absl::Span<const float>> Floats(const Example& example, absl::string_view key,
                                               int64_t count = kAnyCount);
absl::StatusOr<absl::Span<const int64_t>> Int64s(const Example& example, absl::string_view key,
                                                 int64_t count = kAnyCount);

// One line per feature, sorted by key: its key, list type and number of
// values, and for a bytes_list of up to 4 values their lengths, e.g.
//   image/encoded: bytes_list, 1 value (20417 bytes)
//   label: int64_list, 1 value
// "(no features)" for an example without any.
std::string DescribeFeatures(const Example& example);

// Append values to the feature `key`, creating it. A feature of `key` that
// holds another type of list is replaced.
void AddBytes(Example* example, absl::string_view key, absl::string_view value);
void AddInt64(Example* example, absl::string_view key, int64_t value);
void AddInt64s(Example* example, absl::string_view key, absl::Span<const int64_t> values);
void AddFloats(Example* example, absl::string_view key, absl::Span<const float> values);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_TFRECORD_EXAMPLE_H_
