#include "common/byte_size.h"

#include <cmath>
#include <cstdlib>
#include <iterator>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace psflow {
namespace {

constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};

}  // namespace

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  auto bad = [&text](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size in bytes (", why,
                                                   "; e.g. 1048576, 512MiB or 1.5GiB)"));
  };
  absl::string_view s = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < s.size() && (absl::ascii_isdigit(s[digits]) || s[digits] == '.')) ++digits;
  if (digits == 0) return bad("no number");
  double number = 0;
  if (!absl::SimpleAtod(s.substr(0, digits), &number) || !std::isfinite(number)) {
    return bad("no number");
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(s.substr(digits)));
  if (unit.size() > 1 && unit.back() == 'b') unit.pop_back();   // "mb" as "m"
  if (unit.size() == 2 && unit.back() == 'i') unit.pop_back();  // "mi" (of "mib") as "m"
  int power = -1;
  for (const auto& [name, p] :
       {std::pair<const char*, int>{"", 0}, {"b", 0}, {"k", 1}, {"m", 2}, {"g", 3}, {"t", 4}}) {
    if (unit == name) power = p;
  }
  if (power < 0) return bad("unknown unit");
  const double bytes = std::floor(number * std::pow(1024.0, power));
  if (!(bytes < 9223372036854775808.0)) return bad("too large");
  return static_cast<int64_t>(bytes);
}

std::string FormatByteSize(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

}  // namespace psflow
