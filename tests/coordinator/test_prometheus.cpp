// The real Prometheus server (Debian's `prometheus` package) scrapes a running cluster — coordinator, inference
// rank, cache rank — on loopback, and its HTTP API answers queries over our series: the exposition is not only
// promtool-clean but ingested and queryable, histograms included.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/coordinator/api_cluster.h"

namespace spade::test {
namespace {

using json = nlohmann::json;

std::string url_encode(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (std::isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~') {
      out += static_cast<char>(ch);
    } else {
      out += fmt::format("%{:02X}", ch);
    }
  }
  return out;
}

struct Prometheus {
  int port = free_port();
  std::string dir = make_temp_dir("spade-prometheus");
  std::unique_ptr<ChildProcess> proc;

  void start(const ApiCluster& c) {
    std::ofstream cfg(dir + "/prometheus.yml");
    cfg << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n";
    auto job = [&](const char* name, int p) {
      cfg << "  - job_name: " << name << "\n    static_configs:\n      - targets: ['127.0.0.1:" << p << "']\n";
    };
    job("spade-coordinator", c.http_port);
    job("spade-inference", c.inference_metrics_port);
    job("spade-cache", c.cache_metrics_port);
    cfg.close();
    proc = std::make_unique<ChildProcess>(
        "/usr/bin/prometheus",
        std::vector<std::string>{"--config.file=" + dir + "/prometheus.yml", "--storage.tsdb.path=" + dir + "/data",
                                 "--web.listen-address=127.0.0.1:" + std::to_string(port), "--log.level=warn"},
        std::map<std::string, std::string>{}, "prometheus");
  }
  /// The result vector of an instant query (empty on any failure).
  json query(const std::string& q) {
    try {
      auto r = http::http_request("127.0.0.1", static_cast<uint16_t>(port), "GET", "/api/v1/query?query=" + url_encode(q));
      if (r.status != 200) return json::array();
      const json j = json::parse(r.body);
      return j["data"]["result"];
    } catch (const std::exception&) {
      return json::array();
    }
  }
  /// Waits until `q` returns at least `n` series whose every value satisfies `pred`.
  json wait_for(const std::string& q, size_t n, const std::function<bool(double)>& pred,
                std::chrono::milliseconds timeout = 60s) {
    json last;
    for (auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;
         std::this_thread::sleep_for(250ms)) {
      last = query(q);
      if (last.size() < n) continue;
      bool ok = true;
      for (const auto& s : last) ok = ok && pred(std::stod(s["value"][1].get<std::string>()));
      if (ok) return last;
    }
    ADD_FAILURE() << "query " << q << " never satisfied; last result: " << last.dump();
    return last;
  }
};

TEST(Prometheus, ScrapesEveryProcessAndAnswersQueries) {
  ApiCluster c;
  ClusterOptions o;
  o.inference_flags = {"--selection", "predicted", "--sparse-threshold", "32", "--token-budget", "16",
                       "--local-window", "8"};
  o.cache_flags = {"--token-budget", "16", "--local-window", "8", "--overlap-sample-every", "2"};
  c.start_coordinator(o);
  c.start_ranks(o);
  ASSERT_TRUE(c.wait_ready(c.http_port)) << c.logs();
  ASSERT_TRUE(c.wait_ready(c.cache_metrics_port)) << c.logs();
  Prometheus prom;
  prom.start(c);
  for (int i = 0; i < 3; ++i) {
    auto r = c.post("/v1/completions", R"({"model":"stories260K","prompt":[1],"max_tokens":120,"temperature":0})");
    ASSERT_EQ(r.status, 200) << r.body << c.logs();
  }
  auto positive = [](double v) { return v > 0; };
  // Every target is up.
  prom.wait_for("up", 3, [](double v) { return v == 1; });
  // Engine counters and histograms from the inference rank.
  prom.wait_for(R"(spade_generation_tokens_total{job="spade-inference"})", 1, [](double v) { return v >= 360; });
  prom.wait_for(R"(spade_time_to_first_token_seconds_count{job="spade-inference"})", 1, [](double v) { return v >= 3; });
  prom.wait_for(R"(spade_request_success_total{job="spade-inference",finished_reason="length"})", 1,
                [](double v) { return v >= 3; });
  prom.wait_for(R"(histogram_quantile(0.5, sum by (le) (spade_inter_token_latency_seconds_bucket)))", 1, positive);
  // Sparse decoding: transfer bytes in both directions on both data-plane ends, selection time, overlap ratio.
  prom.wait_for(R"(spade_transfer_bytes_total{transport="ucx"})", 4, positive);
  prom.wait_for(R"(spade_sparse_sequence_steps_total)", 1, positive);
  prom.wait_for(R"(spade_selection_time_seconds_count{job="spade-cache"})", 1, positive);
  const json overlap = prom.wait_for(
      R"(spade_selection_overlap_ratio_sum{job="spade-cache"} / spade_selection_overlap_ratio_count{job="spade-cache"})",
      1, [](double v) { return v > 0 && v <= 1; });
  // Control plane: both ranks up, world complete, API request counts.
  prom.wait_for(R"(spade_rank_up{job="spade-coordinator"})", 2, [](double v) { return v == 1; });
  prom.wait_for(R"(spade_http_requests_total{endpoint="/v1/completions",code="200"})", 1,
                [](double v) { return v >= 3; });
  std::cerr << "mean sampled overlap ratio (budget 16): " << overlap.dump() << "\n";
  if (HasFailure()) std::cerr << prom.proc->log() << c.logs();
}

}  // namespace
}  // namespace spade::test
