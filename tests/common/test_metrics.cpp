// The Prometheus text-format writer: golden output, escaping, validation errors, concurrency, and
// `promtool check metrics` on the rendered text (promtool comes with Debian's prometheus package, which
// deploy/scripts/setup_deps.sh installs; the test fails, never skips, without it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <thread>

#include "common/error.h"
#include "common/metrics.h"
#include "tests/test_util.h"

namespace spade::metrics {
namespace {

using ::testing::HasSubstr;

std::string golden_text() {
  Registry r;
  auto& running = r.gauge("spade_num_requests_running", "Number of requests in the running batch.");
  running.with().set(3);
  auto& success = r.counter("spade_request_success_total", "Finished requests by finish reason.", {"finished_reason"});
  success.with({"stop"}).inc(5);
  success.with({"length"}).inc(2);
  success.with({"abort"}).inc();
  auto& bytes = r.counter("spade_transfer_bytes_total", "Bytes moved \\ by the \"data plane\".\nSecond line.",
                          {"direction", "transport"});
  bytes.with({"send", "ucx"}).inc(1048576);
  bytes.with({"recv", "ucx"}).inc(0.5);
  auto& ttft = r.histogram("spade_time_to_first_token_seconds", "Time to first token.", {0.01, 0.1, 1});
  ttft.with().observe(0.005);
  ttft.with().observe(0.01);  // le is inclusive
  ttft.with().observe(0.5);
  ttft.with().observe(3);
  auto& sel = r.histogram("spade_selection_time_seconds", "Selection time per layer pack.", {0.25}, {"pack"});
  sel.with({"0"}).observe(0.125);
  r.gauge("spade_label_escape", "Label escaping.", {"path"}).with({"a\\b\"c\nd"}).set(-1.25);
  r.gauge("spade_special_values", "Non-finite values.", {"kind"}).with({"inf"}).set(
      std::numeric_limits<double>::infinity());
  r.gauge("spade_special_values", "Non-finite values.", {"kind"}).with({"nan"}).set(std::nan(""));
  r.gauge("spade_declared_but_empty", "A labelled family with no series yet.", {"rank"});
  return r.render();
}

TEST(Metrics, GoldenTextFormat) {
  const std::string got = golden_text();
  const std::string want = test::read_file(std::string(SPADE_SOURCE_DIR) + "/tests/common/golden/metrics.txt");
  EXPECT_EQ(got, want) << "rendered:\n" << got;
}

TEST(Metrics, PromtoolAcceptsTheOutput) {
  const std::string dir = test::make_temp_dir("spade-metrics");
  const std::string file = dir + "/metrics.txt";
  std::ofstream(file) << golden_text();
  const std::string cmd = "promtool check metrics < " + file + " > " + dir + "/promtool.log 2>&1";
  const int rc = std::system(cmd.c_str());
  ASSERT_EQ(rc, 0) << "promtool check metrics failed (is Debian's prometheus package installed? "
                      "deploy/scripts/setup_deps.sh installs it):\n"
                   << test::read_file(dir + "/promtool.log");
}

TEST(Metrics, PromtoolRejectsBrokenText) {
  // The check above must be able to fail: a counter without _total and a malformed line are reported.
  const std::string dir = test::make_temp_dir("spade-metrics-bad");
  const std::string file = dir + "/bad.txt";
  std::ofstream(file) << "# HELP x_seconds a\n# TYPE x_seconds counter\nx_seconds 1\nbroken{ 2\n";
  const std::string cmd = "promtool check metrics < " + file + " > /dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
}

TEST(Metrics, FormatValue) {
  EXPECT_EQ(format_value(0), "0");
  EXPECT_EQ(format_value(-7), "-7");
  EXPECT_EQ(format_value(0.25), "0.25");
  EXPECT_EQ(format_value(1e300), "1e+300");
  EXPECT_EQ(format_value(0.1), "0.1");
  EXPECT_EQ(format_value(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(format_value(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(format_value(std::nan("")), "NaN");
  EXPECT_EQ(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST(Metrics, RejectsBadDeclarations) {
  Registry r;
  auto expect_error = [](auto fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected one mentioning '" << part << "'";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(part));
    }
  };
  expect_error([&] { r.counter("requests", "no suffix"); }, "must end in _total");
  expect_error([&] { r.gauge("1bad", "x"); }, "invalid metric name '1bad'");
  expect_error([&] { r.gauge("spade_x", "x", {"__reserved"}); }, "invalid label name '__reserved'");
  expect_error([&] { r.gauge("spade_x", "x", {"a", "a"}); }, "duplicate label 'a'");
  expect_error([&] { r.histogram("spade_h", "x", {1, 1}); }, "increase strictly");
  expect_error([&] { r.histogram("spade_h", "x", {1}, {"le"}); }, "'le' is reserved");
  r.gauge("spade_y", "help");
  EXPECT_NO_THROW(r.gauge("spade_y", "help"));  // same declaration: same family
  expect_error([&] { r.gauge("spade_y", "other help"); }, "different type");
  expect_error([&] { r.counter("spade_y", "help"); }, "must end in _total");
  r.histogram("spade_lat", "x", {1});
  expect_error([&] { r.gauge("spade_lat_bucket", "x"); }, "clashes with the series of histogram 'spade_lat'");
  auto& fam = r.gauge("spade_z", "x", {"rank"});
  expect_error([&] { fam.with({}); }, "0 label value(s) given, the family has 1");
  expect_error([&] { r.counter("spade_c_total", "x").with().inc(-1); }, "must be >= 0");
}

TEST(Metrics, ConcurrentUpdatesAreNotLost) {
  Registry r;
  auto& c = r.counter("spade_events_total", "x", {"t"});
  auto& h = r.histogram("spade_lat_seconds", "x", {0.5});
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < 10000; ++i) {
        c.with({std::to_string(t % 2)}).inc();
        h.with().observe(i % 2 ? 0.25 : 1.0);
        if (i % 1000 == 0) (void)r.render();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(c.with({"0"}).value() + c.with({"1"}).value(), 40000);
  const auto s = h.with().snapshot();
  EXPECT_EQ(s.count, 40000u);
  EXPECT_EQ(s.cumulative[0], 20000u);
  EXPECT_DOUBLE_EQ(s.sum, 20000 * 0.25 + 20000 * 1.0);
}

}  // namespace
}  // namespace spade::metrics
