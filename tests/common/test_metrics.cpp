// The metrics facade over prometheus-cpp: golden text output (the contract of every /metrics), escaping, vLLM's
// colon names, validation errors, concurrency, and `promtool check metrics` on the rendered text (promtool comes
// with Debian's prometheus package, which deploy/scripts/setup_deps.sh installs; the test fails, never skips,
// without it).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <thread>

#include "common/error.h"
#include "common/metrics.h"
#include "tests/promtool_check.h"
#include "tests/test_util.h"

namespace spade::metrics {
namespace {

using ::testing::HasSubstr;
using test::promtool_check_metrics;

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
  r.gauge("spade_precision", "Value formatting.", {"v"}).with({"tenth"}).set(0.1);
  r.gauge("spade_precision", "Value formatting.", {"v"}).with({"sum"}).set(0.1 + 0.2);
  r.gauge("spade_precision", "Value formatting.", {"v"}).with({"big"}).set(12345678901234567.0);
  // vLLM's names: a ':' in the metric name, the model_name label; labels print sorted by name.
  auto& vsuccess = r.counter("vllm:request_success_total", "Count of successfully processed requests.",
                             {"model_name", "finished_reason"});
  vsuccess.with({"stories260K", "stop"}).inc(5);
  vsuccess.with({"stories260K", "length"}).inc(2);
  auto& vttft = r.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                            {0.5, 1}, {"model_name"});
  vttft.with({"stories260K"}).observe(0.25);
  return r.render();
}

TEST(Metrics, GoldenTextFormat) {
  const std::string got = golden_text();
  const std::string want = test::read_file(std::string(SPADE_SOURCE_DIR) + "/tests/common/golden/metrics.txt");
  EXPECT_EQ(got, want) << "rendered:\n" << got;
}

TEST(Metrics, PromtoolAcceptsTheOutput) {
  const std::string problems = promtool_check_metrics(golden_text());
  EXPECT_EQ(problems, "");
}

TEST(Metrics, PromtoolRejectsBrokenText) {
  // The check above must be able to fail: a counter without _total, a colon name that is not vLLM's, and a
  // malformed line are each reported.
  EXPECT_NE(promtool_check_metrics("# HELP x_seconds a\n# TYPE x_seconds counter\nx_seconds 1\n"), "");
  EXPECT_NE(promtool_check_metrics("# HELP spade:x a\n# TYPE spade:x gauge\nspade:x 1\n"), "");
  EXPECT_NE(promtool_check_metrics("# HELP vllm:x_seconds a\n# TYPE vllm:x_seconds counter\nvllm:x_seconds 1\n"), "");
  EXPECT_NE(promtool_check_metrics("# HELP y a\n# TYPE y gauge\nbroken{ 2\n"), "");
}

TEST(Metrics, SnapshotAndValues) {
  Registry r;
  auto& h = r.histogram("spade_h_seconds", "x", {0.5, 1});
  h.with().observe(0.5);  // le is inclusive
  h.with().observe(2);
  h.with().observe(std::nan(""));  // NaN counts in +Inf only
  const auto s = h.with().snapshot();
  EXPECT_EQ(s.bounds, (std::vector<double>{0.5, 1}));
  EXPECT_EQ(s.cumulative, (std::vector<uint64_t>{1, 1, 3}));
  EXPECT_EQ(s.count, 3u);
  auto& g = r.gauge("spade_g", "x").with();
  g.set(2);
  g.inc(0.5);
  g.dec(3);
  EXPECT_DOUBLE_EQ(g.value(), -0.5);
  auto& c = r.counter("spade_c_total", "x").with();
  c.inc(2);
  c.inc();
  EXPECT_DOUBLE_EQ(c.value(), 3);
  // Same declaration, same series: with() hands back the same object.
  EXPECT_EQ(&r.counter("spade_c_total", "x").with(), &c);
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
  expect_error([&] { r.gauge("__internal", "x"); }, "invalid metric name '__internal'");
  expect_error([&] { r.gauge("vllm:x", "x", {"model:name"}); }, "invalid label name 'model:name'");
  expect_error([&] { r.histogram("spade_h", "x", {1, std::numeric_limits<double>::infinity()}); }, "not finite");
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
  expect_error([&] { r.counter("spade_c_total", "x").with().inc(std::nan("")); }, "must be >= 0");
  expect_error([&] { r.histogram("spade_lat", "x", {2}); }, "different type, help, labels or buckets");
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
