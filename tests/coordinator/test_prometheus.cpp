// The real Prometheus server (Debian's `prometheus` package) scrapes a running cluster — coordinator, inference
// rank, cache rank — on loopback, and its HTTP API answers queries over our series: the exposition is not only
// promtool-clean but ingested and queryable, histograms included, vLLM's vllm: names too. And the vllm: series
// themselves, scraped from the running processes: every name, on the process docs/DEPLOY.md names, with the served
// model name as model_name and vLLM's bucket boundaries.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <fstream>
#include <functional>
#include <sstream>
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
  // vLLM's names, as a vLLM dashboard queries them (the quantiles over the cumulative buckets: a rate() over a
  // window needs a scrape while the requests run, which a fast run may not give).
  prom.wait_for(R"(vllm:generation_tokens_total{model_name="stories260K"})", 1, [](double v) { return v >= 360; });
  prom.wait_for(R"(vllm:request_success_total{model_name="stories260K",finished_reason="length"})", 1,
                [](double v) { return v >= 3; });
  prom.wait_for(R"(sum(vllm:num_requests_running{model_name="stories260K"}))", 1, [](double v) { return v >= 0; });
  prom.wait_for(R"(vllm:time_to_first_token_seconds_count{job="spade-coordinator",model_name="stories260K"})", 1,
                [](double v) { return v >= 3; });
  prom.wait_for(
      R"(histogram_quantile(0.5, sum by (le) (vllm:e2e_request_latency_seconds_bucket{model_name="stories260K"})))",
      1, positive);
  prom.wait_for(
      R"(histogram_quantile(0.5, sum by (le) (vllm:inter_token_latency_seconds_bucket{model_name="stories260K"})))",
      1, positive);
  std::cerr << "mean sampled overlap ratio (budget 16): " << overlap.dump() << "\n";
  if (HasFailure()) std::cerr << prom.proc->log() << c.logs();
}

/// The `le` bounds of histogram `name`'s buckets in a /metrics text (in order, "+Inf" last).
std::vector<std::string> bucket_bounds(const std::string& text, const std::string& name) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "_bucket{", 0) != 0) continue;
    const size_t le = line.find("le=\"");
    out.push_back(line.substr(le + 4, line.find('"', le + 4) - le - 4));
  }
  return out;
}

TEST(VllmMetrics, EveryNameOnItsProcessWithTheServedModelName) {
  ApiCluster c;
  ClusterOptions o;
  o.coordinator_flags = {"--served-model-name", "spade-test-model"};
  c.start_coordinator(o);
  c.start_ranks(o);
  ASSERT_TRUE(c.wait_ready(c.http_port)) << c.logs();
  for (int i = 0; i < 2; ++i) {
    auto r = c.post("/v1/completions", R"({"model":"spade-test-model","prompt":[1],"max_tokens":20,"temperature":0})");
    ASSERT_EQ(r.status, 200) << r.body << c.logs();
  }
  auto r = c.post("/v1/chat/completions", R"({"model":"spade-test-model","messages":[{"role":"user","content":"Hi"}],)"
                                          R"("max_tokens":8,"temperature":0,"stream":true})");
  ASSERT_EQ(r.status, 200) << r.body << c.logs();
  const std::string m = R"(model_name="spade-test-model")";
  const std::string length = "vllm:request_success_total{" + m + R"(,finished_reason="length"})";
  const std::string stop = "vllm:request_success_total{" + m + R"(,finished_reason="stop"})";
  // The rank counts a request finished right after its last chunk left: wait (bounded) for all three.
  std::string inf_text;
  std::map<std::string, double> inf;
  for (auto until = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(100ms)) {
    inf_text = c.metrics_text(c.inference_metrics_port);
    inf = parse_metrics(inf_text);
    if (inf.count(length) && inf.count(stop) && inf.at(length) + inf.at(stop) >= 3) break;
  }
  const std::string coord_text = c.metrics_text(c.http_port);
  const std::string cache_text = c.metrics_text(c.cache_metrics_port);
  const auto coord = parse_metrics(coord_text);
  // Where each name lives (docs/DEPLOY.md, "Metrics"): one kind of process per name, so sums count it once.
  const std::vector<std::string> on_inference = {"vllm:num_requests_running", "vllm:num_requests_waiting",
                                                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                                                 "vllm:generation_tokens_total", "vllm:request_success_total",
                                                 "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
                                                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"};
  const std::vector<std::string> on_coordinator = {"vllm:time_to_first_token_seconds",
                                                   "vllm:e2e_request_latency_seconds", "vllm:request_params_n"};
  auto has_type = [](const std::string& text, const std::string& name) {
    return text.find("# TYPE " + name + " ") != std::string::npos;
  };
  for (const auto& n : on_inference) {
    EXPECT_TRUE(has_type(inf_text, n)) << n << " missing on the inference rank:\n" << inf_text;
    EXPECT_FALSE(has_type(coord_text, n)) << n << " also on the coordinator";
    EXPECT_FALSE(has_type(cache_text, n)) << n << " on the cache rank";
  }
  for (const auto& n : on_coordinator) {
    EXPECT_TRUE(has_type(coord_text, n)) << n << " missing on the coordinator:\n" << coord_text;
    EXPECT_FALSE(has_type(inf_text, n)) << n << " also on the inference rank";
  }
  // Values: the twins agree, every series carries the served model name.
  EXPECT_EQ(inf.at("vllm:generation_tokens_total{" + m + "}"), inf.at("spade_generation_tokens_total"));
  EXPECT_GE(inf.at("vllm:generation_tokens_total{" + m + "}"), 48);
  EXPECT_EQ(inf.at("vllm:prompt_tokens_total{" + m + "}"), inf.at("spade_prompt_tokens_total"));
  EXPECT_EQ(inf.at(length) + inf.at(stop), 3);
  EXPECT_EQ(inf.at(length), inf.at(R"(spade_request_success_total{finished_reason="length"})"));
  EXPECT_EQ(inf.at("vllm:num_requests_running{" + m + "}"), 0);
  EXPECT_EQ(inf.at("vllm:num_requests_waiting{" + m + "}"), 0);
  const double kv = inf.at("vllm:kv_cache_usage_perc{" + m + "}");
  EXPECT_TRUE(kv >= 0 && kv <= 1) << kv;
  EXPECT_EQ(inf.at("vllm:request_queue_time_seconds_count{" + m + "}"), 3);
  EXPECT_EQ(inf.at("vllm:inter_token_latency_seconds_count{" + m + "}"),
            inf.at("spade_inter_token_latency_seconds_count"));
  EXPECT_EQ(coord.at("vllm:time_to_first_token_seconds_count{" + m + "}"), 3);
  EXPECT_EQ(coord.at("vllm:e2e_request_latency_seconds_count{" + m + "}"), 3);
  // The n parameter: three requests of one sample each, in vLLM's buckets (1, 2, 5, 10, 20), and its spade_ twin.
  EXPECT_EQ(coord.at("vllm:request_params_n_count{" + m + "}"), 3);
  EXPECT_EQ(coord.at("vllm:request_params_n_sum{" + m + "}"), 3);
  EXPECT_EQ(coord.at("vllm:request_params_n_bucket{" + m + R"(,le="1"})"), 3);
  EXPECT_EQ(coord.at("vllm:request_params_n_bucket{" + m + R"(,le="20"})"), 3);
  EXPECT_EQ(coord.at("spade_api_request_params_n_count"), 3);
  EXPECT_LE(coord.at("vllm:time_to_first_token_seconds_sum{" + m + "}"),
            coord.at("vllm:e2e_request_latency_seconds_sum{" + m + "}"));
  // vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
  const std::vector<std::string> ttft = {"0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1",
                                         "0.25",  "0.5",   "0.75", "1",    "2.5",  "5",    "7.5",  "10",
                                         "20",    "40",    "80",   "160",  "640",  "2560", "+Inf"};
  const std::vector<std::string> itl = {"0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2",
                                        "0.3",  "0.4",   "0.5",  "0.75",  "1",   "2.5",  "5",
                                        "7.5",  "10",    "20",   "40",    "80",  "+Inf"};
  const std::vector<std::string> request = {"0.3", "0.5", "0.8", "1",   "1.5", "2",   "2.5", "5",
                                            "10",  "15",  "20",  "30",  "40",  "50",  "60",  "120",
                                            "240", "480", "960", "1920", "7680", "+Inf"};
  EXPECT_EQ(bucket_bounds(coord_text, "vllm:time_to_first_token_seconds"), ttft);
  EXPECT_EQ(bucket_bounds(coord_text, "vllm:e2e_request_latency_seconds"), request);
  EXPECT_EQ(bucket_bounds(inf_text, "vllm:inter_token_latency_seconds"), itl);
  EXPECT_EQ(bucket_bounds(inf_text, "vllm:request_queue_time_seconds"), request);
  // Every vllm: sample line names the model.
  for (const std::string& text : {std::cref(coord_text), std::cref(inf_text)}) {
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("vllm:", 0) == 0) {
        EXPECT_NE(line.find(m), std::string::npos) << line;
      }
    }
  }
  if (HasFailure()) std::cerr << c.logs();
}

}  // namespace
}  // namespace spade::test
