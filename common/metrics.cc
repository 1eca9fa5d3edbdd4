#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace psflow::metrics {
namespace {

bool NameChar(char c, bool first, bool colon) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') return true;
  if (colon && c == ':') return true;
  return !first && c >= '0' && c <= '9';
}

bool ValidName(absl::string_view name, bool colon) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!NameChar(name[i], i == 0, colon)) return false;
  }
  return true;
}

// Label values escape backslash, double quote and newline; help text
// backslash and newline.
std::string Escape(absl::string_view s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

// {a="x",b="y"} with `extra` (a histogram's le) last; "" without labels.
std::string LabelText(const Labels& labels, const std::pair<std::string, std::string>* extra) {
  if (labels.empty() && extra == nullptr) return "";
  std::string out = "{";
  bool first = true;
  auto add = [&](const std::pair<std::string, std::string>& l) {
    absl::StrAppend(&out, first ? "" : ",", l.first, "=\"", Escape(l.second, true), "\"");
    first = false;
  };
  for (const auto& l : labels) add(l);
  if (extra != nullptr) add(*extra);
  out += "}";
  return out;
}

}  // namespace

void Counter::Add(double by) {
  if (!(by > 0)) return;  // also NaN
  value_.fetch_add(by, std::memory_order_relaxed);
}

void Gauge::Add(double by) { value_.fetch_add(by, std::memory_order_relaxed); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    if (!std::isfinite(bounds_[i]) || (i > 0 && bounds_[i] <= bounds_[i - 1])) {
      PSLOG(FATAL) << "histogram bounds must be finite and strictly increasing";
    }
  }
  absl::MutexLock lock(&mu_);
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::Observe(double value) {
  // The first bucket whose bound is >= value; NaN lands in +Inf.
  const size_t bucket =
      std::isnan(value) ? bounds_.size()
                        : std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (uint64_t c : counts_) {
    total += c;
    s.cumulative.push_back(total);
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  double b = start;
  for (int i = 0; i < count; ++i, b *= factor) bounds.push_back(b);
  return bounds;
}

std::vector<double> LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

std::vector<double> ByteBuckets() { return ExponentialBuckets(1024, 4, 11); }

bool IsValidMetricName(absl::string_view name) { return ValidName(name, /*colon=*/true); }

bool IsValidLabelName(absl::string_view name) {
  return ValidName(name, /*colon=*/false) && name.substr(0, 2) != "__";
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // The shortest decimal that reads back as `value`, in positional notation
  // unless the exponent is below -4 or from 21 on (as Prometheus's own
  // clients write them: 0.0005, 1e-05, 123456).
  const double magnitude = std::abs(value);
  const bool scientific = magnitude != 0 && (magnitude < 1e-4 || magnitude >= 1e21);
  char buf[64];
  const std::to_chars_result r =
      std::to_chars(buf, buf + sizeof(buf), value,
                    scientific ? std::chars_format::scientific : std::chars_format::fixed);
  return std::string(buf, r.ptr);
}

Registry::Series& Registry::SeriesLocked(absl::string_view name, absl::string_view help, Type type,
                                         const Labels& labels) {
  if (!IsValidMetricName(name)) PSLOG(FATAL) << "invalid metric name '" << name << "'";
  for (const auto& [label, value] : labels) {
    if (!IsValidLabelName(label) || (type == Type::kHistogram && label == "le")) {
      PSLOG(FATAL) << "invalid label name '" << label << "' of metric " << name;
    }
  }
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}}).first;
  } else if (it->second.type != type) {
    PSLOG(FATAL) << "metric " << name << " registered as two types";
  }
  Family& family = it->second;
  for (const std::unique_ptr<Series>& s : family.series) {
    if (s->labels == labels) return *s;
  }
  family.series.push_back(std::make_unique<Series>());
  family.series.back()->labels = labels;
  return *family.series.back();
}

Counter* Registry::GetCounter(absl::string_view name, absl::string_view help,
                              const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(name, help, Type::kCounter, labels);
  if (s.read) PSLOG(FATAL) << "metric " << name << " is read by a function";
  if (s.counter == nullptr) s.counter = std::make_unique<Counter>();
  return s.counter.get();
}

Gauge* Registry::GetGauge(absl::string_view name, absl::string_view help, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(name, help, Type::kGauge, labels);
  if (s.read) PSLOG(FATAL) << "metric " << name << " is read by a function";
  if (s.gauge == nullptr) s.gauge = std::make_unique<Gauge>();
  return s.gauge.get();
}

Histogram* Registry::GetHistogram(absl::string_view name, absl::string_view help,
                                  const std::vector<double>& bounds, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(name, help, Type::kHistogram, labels);
  if (s.histogram == nullptr) s.histogram = std::make_unique<Histogram>(bounds);
  return s.histogram.get();
}

void Registry::SetCounterFunction(absl::string_view name, absl::string_view help,
                                  std::function<double()> read, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(name, help, Type::kCounter, labels);
  if (s.counter != nullptr) PSLOG(FATAL) << "metric " << name << " is a counter object";
  s.read = std::move(read);
}

void Registry::SetGaugeFunction(absl::string_view name, absl::string_view help,
                                std::function<double()> read, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  Series& s = SeriesLocked(name, help, Type::kGauge, labels);
  if (s.gauge != nullptr) PSLOG(FATAL) << "metric " << name << " is a gauge object";
  s.read = std::move(read);
}

std::string Registry::Render() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    const char* type = family.type == Type::kCounter ? "counter"
                       : family.type == Type::kGauge ? "gauge"
                                                     : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(family.help, false), "\n");
    absl::StrAppend(&out, "# TYPE ", name, " ", type, "\n");
    for (const std::unique_ptr<Series>& s : family.series) {
      if (family.type == Type::kHistogram) {
        const Histogram::Snapshot h = s->histogram->snapshot();
        for (size_t i = 0; i <= h.bounds.size(); ++i) {
          const std::pair<std::string, std::string> le = {
              "le", i < h.bounds.size() ? FormatValue(h.bounds[i]) : "+Inf"};
          absl::StrAppend(&out, name, "_bucket", LabelText(s->labels, &le), " ", h.cumulative[i],
                          "\n");
        }
        absl::StrAppend(&out, name, "_sum", LabelText(s->labels, nullptr), " ", FormatValue(h.sum),
                        "\n");
        absl::StrAppend(&out, name, "_count", LabelText(s->labels, nullptr), " ", h.count, "\n");
        continue;
      }
      double value = 0;
      if (s->read) {
        value = s->read();
      } else if (s->counter != nullptr) {
        value = s->counter->value();
      } else if (s->gauge != nullptr) {
        value = s->gauge->value();
      }
      absl::StrAppend(&out, name, LabelText(s->labels, nullptr), " ", FormatValue(value), "\n");
    }
  }
  return out;
}

Registry* Registry::OrPrivate(Registry* registry, std::unique_ptr<Registry>& fallback) {
  if (registry != nullptr) return registry;
  if (fallback == nullptr) fallback = std::make_unique<Registry>();
  return fallback.get();
}

}  // namespace psflow::metrics
