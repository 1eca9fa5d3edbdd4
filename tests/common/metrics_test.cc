// The metrics registry's text exposition (format 0.0.4) and its HTTP server.
#include "common/metrics.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "role/metrics_server.h"
#include "tests/common/http.h"

namespace psflow::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(MetricsTest, EmptyRegistryRendersNothing) { EXPECT_EQ(Registry().Render(), ""); }

TEST(MetricsTest, CounterAndGaugeWithHelpAndType) {
  Registry r;
  Counter* c = r.GetCounter("psflow_things_total", "Things done.");
  c->Add();
  c->Add(2.5);
  c->Add(-7);  // ignored: counters never go down
  c->Add(std::numeric_limits<double>::quiet_NaN());
  Gauge* g = r.GetGauge("psflow_level", "A level.");
  g->Set(10);
  g->Add(-12.5);
  EXPECT_EQ(r.Render(),
            "# HELP psflow_level A level.\n"
            "# TYPE psflow_level gauge\n"
            "psflow_level -2.5\n"
            "# HELP psflow_things_total Things done.\n"
            "# TYPE psflow_things_total counter\n"
            "psflow_things_total 3.5\n");
}

TEST(MetricsTest, SameNameAndLabelsIsTheSameSeries) {
  Registry r;
  Counter* a = r.GetCounter("psflow_errors_total", "Errors.", {{"code", "UNAVAILABLE"}});
  Counter* b = r.GetCounter("psflow_errors_total", "ignored", {{"code", "UNAVAILABLE"}});
  Counter* c = r.GetCounter("psflow_errors_total", "ignored", {{"code", "INTERNAL"}});
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  a->Add();
  b->Add();
  c->Add();
  // One family, its help the first one given, series in the order they were made.
  EXPECT_EQ(r.Render(),
            "# HELP psflow_errors_total Errors.\n"
            "# TYPE psflow_errors_total counter\n"
            "psflow_errors_total{code=\"UNAVAILABLE\"} 2\n"
            "psflow_errors_total{code=\"INTERNAL\"} 1\n");
}

TEST(MetricsTest, FamiliesAreSortedByName) {
  Registry r;
  r.GetGauge("psflow_b", "b");
  r.GetGauge("psflow_a", "a");
  r.GetCounter("psflow_c_total", "c");
  const std::string text = r.Render();
  EXPECT_LT(text.find("psflow_a "), text.find("psflow_b "));
  EXPECT_LT(text.find("psflow_b "), text.find("psflow_c_total "));
}

TEST(MetricsTest, LabelValuesAndHelpAreEscaped) {
  Registry r;
  r.GetGauge("psflow_x", "Back\\slash and\nnewline \"quoted\".",
             {{"path", "C:\\dir"}, {"quote", "say \"hi\""}, {"lines", "a\nb"}})
      ->Set(1);
  EXPECT_EQ(r.Render(),
            "# HELP psflow_x Back\\\\slash and\\nnewline \"quoted\".\n"
            "# TYPE psflow_x gauge\n"
            "psflow_x{path=\"C:\\\\dir\",quote=\"say \\\"hi\\\"\",lines=\"a\\nb\"} 1\n");
}

TEST(MetricsTest, HistogramBucketsAreCumulative) {
  Registry r;
  Histogram* h = r.GetHistogram("psflow_call_seconds", "Call time.", {0.01, 0.1, 1}, {{"m", "x"}});
  for (double v : {0.005, 0.01, 0.05, 0.5, 0.7, 3.0}) h->Observe(v);
  EXPECT_EQ(r.Render(),
            "# HELP psflow_call_seconds Call time.\n"
            "# TYPE psflow_call_seconds histogram\n"
            "psflow_call_seconds_bucket{m=\"x\",le=\"0.01\"} 2\n"
            "psflow_call_seconds_bucket{m=\"x\",le=\"0.1\"} 3\n"
            "psflow_call_seconds_bucket{m=\"x\",le=\"1\"} 5\n"
            "psflow_call_seconds_bucket{m=\"x\",le=\"+Inf\"} 6\n"
            "psflow_call_seconds_sum{m=\"x\"} 4.265\n"
            "psflow_call_seconds_count{m=\"x\"} 6\n");
  const Histogram::Snapshot s = h->snapshot();
  EXPECT_EQ(s.count, 6u);
  EXPECT_EQ(s.cumulative.back(), s.count);
}

TEST(MetricsTest, HistogramWithoutLabelsAndNoObservations) {
  Registry r;
  r.GetHistogram("psflow_bytes", "Sizes.", {1024, 4096});
  EXPECT_EQ(r.Render(),
            "# HELP psflow_bytes Sizes.\n"
            "# TYPE psflow_bytes histogram\n"
            "psflow_bytes_bucket{le=\"1024\"} 0\n"
            "psflow_bytes_bucket{le=\"4096\"} 0\n"
            "psflow_bytes_bucket{le=\"+Inf\"} 0\n"
            "psflow_bytes_sum 0\n"
            "psflow_bytes_count 0\n");
}

TEST(MetricsTest, FunctionSeriesAreReadAtEachRender) {
  Registry r;
  int calls = 0;
  r.SetGaugeFunction("psflow_version", "Version.", [&calls] { return ++calls * 10.0; });
  r.SetCounterFunction("psflow_stale_total", "Stale.", [] { return 4.0; }, {{"ps", "0"}});
  EXPECT_THAT(r.Render(), HasSubstr("\npsflow_version 10\n"));
  EXPECT_THAT(r.Render(), HasSubstr("\npsflow_version 20\n"));
  EXPECT_THAT(r.Render(), HasSubstr("# TYPE psflow_stale_total counter\n"
                                    "psflow_stale_total{ps=\"0\"} 4\n"));
  // Setting it again replaces the function.
  r.SetGaugeFunction("psflow_version", "Version.", [] { return -1.0; });
  EXPECT_THAT(r.Render(), HasSubstr("\npsflow_version -1\n"));
}

TEST(MetricsTest, ValuesAreFormattedAsPrometheusReadsThem) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(42), "42");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(0.0005), "0.0005");
  EXPECT_EQ(FormatValue(1e-5), "1e-05");
  EXPECT_EQ(FormatValue(123456789012), "123456789012");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(1e21), "1e+21");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  // Round trip: every digit needed, no more.
  EXPECT_EQ(std::stod(FormatValue(1.0 / 3)), 1.0 / 3);
}

TEST(MetricsTest, NameRules) {
  EXPECT_TRUE(IsValidMetricName("psflow_step"));
  EXPECT_TRUE(IsValidMetricName("a:b_c9"));
  EXPECT_FALSE(IsValidMetricName("9lives"));
  EXPECT_FALSE(IsValidMetricName("psflow-step"));
  EXPECT_FALSE(IsValidMetricName(""));
  EXPECT_TRUE(IsValidLabelName("code"));
  EXPECT_FALSE(IsValidLabelName("a:b"));
  EXPECT_FALSE(IsValidLabelName("__reserved"));
}

TEST(MetricsTest, BucketHelpers) {
  EXPECT_EQ(ExponentialBuckets(1, 2, 4), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(ByteBuckets().front(), 1024);
  EXPECT_EQ(ByteBuckets().back(), 1024.0 * 1024 * 1024);
  const std::vector<double> latency = LatencyBuckets();
  EXPECT_TRUE(std::is_sorted(latency.begin(), latency.end()));
}

TEST(MetricsTest, OrPrivateKeepsAGivenRegistryOrMakesOne) {
  Registry given;
  std::unique_ptr<Registry> fallback;
  EXPECT_EQ(Registry::OrPrivate(&given, fallback), &given);
  EXPECT_EQ(fallback, nullptr);
  Registry* made = Registry::OrPrivate(nullptr, fallback);
  ASSERT_NE(made, nullptr);
  EXPECT_EQ(made, fallback.get());
  EXPECT_EQ(Registry::OrPrivate(nullptr, fallback), made);  // made once
}

TEST(MetricsTest, ConcurrentUpdatesAreAllCounted) {
  Registry r;
  Counter* c = r.GetCounter("psflow_n_total", "n");
  Histogram* h = r.GetHistogram("psflow_h", "h", {0.5});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&r, c, h, t] {
      for (int i = 0; i < 10000; ++i) {
        c->Add();
        h->Observe(i % 2);
        // Lookups and renders race with the updates.
        if (i % 1000 == 0) {
          r.GetCounter("psflow_errors_total", "e", {{"thread", std::to_string(t)}})->Add();
          r.Render();
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c->value(), 40000);
  const Histogram::Snapshot s = h->snapshot();
  EXPECT_EQ(s.count, 40000u);
  EXPECT_EQ(s.cumulative[0], 20000u);
  EXPECT_EQ(s.sum, 20000);
  EXPECT_THAT(r.Render(), HasSubstr("psflow_errors_total{thread=\"3\"} 10\n"));
}

// ---------------------------------------------------------------------------
// The HTTP server.

using testing_http::Exchange;
using testing_http::StatusCode;

TEST(MetricsServerTest, ServesTheRegistryAtMetrics) {
  Registry r;
  Counter* c = r.GetCounter("psflow_requests_total", "Requests.");
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(0, &r);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  c->Add(3);
  std::string answer = Exchange(port, "GET /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusCode(answer), "200") << answer;
  EXPECT_THAT(answer, HasSubstr("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
  const size_t body = answer.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << answer;
  EXPECT_EQ(answer.substr(body + 4), r.Render());
  EXPECT_THAT(answer, HasSubstr("\npsflow_requests_total 3\n"));

  // Values move between scrapes.
  c->Add();
  EXPECT_THAT(Exchange(port, "GET /metrics HTTP/1.0\r\n\r\n"),
              HasSubstr("\npsflow_requests_total 4\n"));
  // HEAD: headers only.
  answer = Exchange(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusCode(answer), "200") << answer;
  EXPECT_THAT(answer, Not(HasSubstr("psflow_requests_total")));
  EXPECT_EQ(StatusCode(Exchange(port, "GET /other HTTP/1.0\r\n\r\n")), "404");
  EXPECT_EQ(StatusCode(Exchange(port, "GET /metrics/x HTTP/1.0\r\n\r\n")), "404");
  EXPECT_EQ(StatusCode(Exchange(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n")),
            "405");

  server->reset();  // stops: nothing listens any more
  EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.0\r\n\r\n"), "");
}

// /healthz answers 200 while the server runs; /readyz follows `ready` (503
// while it says no), and is not there without it.
TEST(MetricsServerTest, AnswersHttpProbes) {
  Registry r;
  std::atomic<bool> ready{false};
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(0, &r, [&ready] { return ready.load(); });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  std::string answer = Exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusCode(answer), "200") << answer;
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nok\n"));
  answer = Exchange(port, "GET /readyz HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusCode(answer), "503") << answer;
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nnot ready\n"));
  ready = true;
  answer = Exchange(port, "GET /readyz HTTP/1.0\r\n\r\n");
  EXPECT_EQ(StatusCode(answer), "200") << answer;
  EXPECT_THAT(answer, HasSubstr("\r\n\r\nready\n"));
  EXPECT_EQ(StatusCode(Exchange(port, "HEAD /readyz HTTP/1.0\r\n\r\n")), "200");
  EXPECT_EQ(StatusCode(Exchange(port, "POST /healthz HTTP/1.0\r\nContent-Length: 0\r\n\r\n")),
            "405");
  EXPECT_EQ(StatusCode(Exchange(port, "GET /readyz/x HTTP/1.0\r\n\r\n")), "404");

  absl::StatusOr<std::unique_ptr<MetricsServer>> without = MetricsServer::Start(0, &r);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(StatusCode(Exchange((*without)->port(), "GET /healthz HTTP/1.0\r\n\r\n")), "200");
  EXPECT_EQ(StatusCode(Exchange((*without)->port(), "GET /readyz HTTP/1.0\r\n\r\n")), "404");
}

TEST(MetricsServerTest, APortInUseIsAnError) {
  Registry r;
  absl::StatusOr<std::unique_ptr<MetricsServer>> first = MetricsServer::Start(0, &r);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start((*first)->port(), &r);
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("port " + std::to_string((*first)->port())));
}

// A start writes nothing to stderr (libmicrohttpd warned there, at every
// start, of its logger option given late); what the library says of a real
// failure, the port taken, comes through psflow's log, line by line.
TEST(MetricsServerTest, StartsQuietlyAndTheLibrarysErrorsGoThroughPsflowsLog) {
  Registry r;
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<MetricsServer>> first = MetricsServer::Start(0, &r);
  const std::string at_start = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(at_start, "");

  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start((*first)->port(), &r);
  const std::string refused = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(refused, HasSubstr("] metrics server: "));
  for (absl::string_view line : absl::StrSplit(refused, '\n', absl::SkipEmpty())) {
    EXPECT_THAT(std::string(line), HasSubstr("] metrics server: "));
  }
}

}  // namespace
}  // namespace psflow::metrics
