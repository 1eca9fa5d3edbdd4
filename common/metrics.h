// A small registry of Prometheus metrics: counters, gauges and histograms
// with fixed buckets, each family optionally split into series by labels,
// rendered in the Prometheus text exposition format (version 0.0.4) for
// /metrics (role/metrics_server.h serves it over HTTP).
//
// A role's main creates one Registry and hands a pointer to whatever records
// metrics; there is no global registry. Classes that tests build without one
// take a null pointer and then record into a registry of their own that
// nobody reads (see OrPrivate below).
//
// Names and labels are fixed by the code, not by input: an invalid name, or
// one family asked for as two types, is a broken invariant (PSLOG(FATAL)).
//
// Thread-safety: every method of Registry, Counter, Gauge and Histogram may be
// called from any thread. Pointers the registry returns stay valid for the
// registry's lifetime.
#ifndef PSFLOW_COMMON_METRICS_H_
#define PSFLOW_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace psflow::metrics {

// Label names and values of one series, e.g. {{"code", "UNAVAILABLE"}}.
// Rendered in the order given.
using Labels = std::vector<std::pair<std::string, std::string>>;

// A value that only goes up (a count, a total of bytes or seconds).
class Counter {
 public:
  // Adds `by`; a negative or NaN `by` is ignored (a counter never goes down).
  void Add(double by = 1);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// A value that goes up and down (a state, the latest measurement).
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double by);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted in fixed buckets (upper bounds, each bucket counting
// the observations <= its bound; +Inf is implied), with their sum and count.
class Histogram {
 public:
  // `bounds` must be sorted, strictly increasing and finite.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;        // as given, without +Inf
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (== count)
    double sum = 0;
    uint64_t count = 0;
  };
  // A consistent view: the +Inf bucket equals the count.
  Snapshot snapshot() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket (not cumulative), +Inf last
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Bucket bounds start, start*factor, ... (`count` of them).
std::vector<double> ExponentialBuckets(double start, double factor, int count);
// Bounds for durations of calls, from 0.5 ms to 60 s.
std::vector<double> LatencyBuckets();
// Bounds for message sizes, from 1 KiB to 1 GiB by factors of 4.
std::vector<double> ByteBuckets();

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The series of family `name` with `labels`, made on first use (the
  // family's help is the first one given). Calling again with the same name
  // and labels returns the same object, so callers may look a series up
  // when they need it (say, per error code).
  Counter* GetCounter(absl::string_view name, absl::string_view help, const Labels& labels = {});
  Gauge* GetGauge(absl::string_view name, absl::string_view help, const Labels& labels = {});
  // A later call for an existing series ignores `bounds`.
  Histogram* GetHistogram(absl::string_view name, absl::string_view help,
                          const std::vector<double>& bounds, const Labels& labels = {});

  // A series whose value `read` gives at each scrape, for values kept
  // elsewhere (a count the ps shard keeps, a state). `read` runs under the
  // registry's lock: it must be thread-safe, must not call into this
  // registry, and must stay callable until the registry is no longer
  // rendered. A second call for the same series replaces its function.
  void SetCounterFunction(absl::string_view name, absl::string_view help,
                          std::function<double()> read, const Labels& labels = {});
  void SetGaugeFunction(absl::string_view name, absl::string_view help,
                        std::function<double()> read, const Labels& labels = {});

  // Every family sorted by name, each with its # HELP and # TYPE lines and
  // its series in the order they were made.
  std::string Render() const;

  // `registry`, or if it is null a registry owned by `fallback` (made on
  // first use), for classes whose metrics are optional.
  static Registry* OrPrivate(Registry* registry, std::unique_ptr<Registry>& fallback);

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Series {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::function<double()> read;  // set for function series
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<std::unique_ptr<Series>> series;
  };

  // The series (made empty if new) of family `name`, which must be of `type`.
  Series& SeriesLocked(absl::string_view name, absl::string_view help, Type type,
                       const Labels& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family, std::less<>> families_ ABSL_GUARDED_BY(mu_);
};

// The text format's rendering of a sample value: shortest round-trip decimal,
// "+Inf", "-Inf" or "NaN".
std::string FormatValue(double value);

// Whether `name` is a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or label
// name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with "__").
bool IsValidMetricName(absl::string_view name);
bool IsValidLabelName(absl::string_view name);

}  // namespace psflow::metrics

#endif  // PSFLOW_COMMON_METRICS_H_
