// Prometheus metrics: an in-process registry of counters, gauges and histograms (optionally labelled) and the
// text exposition format 0.0.4 writer that every Spade process serves on GET /metrics.
//
// prometheus-cpp is not packaged on our machines, so this is the one small writer of the format; it is
// golden-tested (tests/common/test_metrics.cpp) and its output is checked with `promtool check metrics`.
// Format reference: https://prometheus.io/docs/instrumenting/exposition_formats/ (text format 0.0.4):
//   # HELP <name> <help, with \ and newline escaped>
//   # TYPE <name> counter|gauge|histogram
//   <name>{<label>="<value, with \ " and newline escaped>",...} <value>
//   histograms: <name>_bucket{...,le="<upper bound>"} <cumulative count> ... le="+Inf", <name>_sum, <name>_count.
// Values print as integers when they are integral (|v| < 2^53), else as the shortest decimal that round-trips;
// +Inf, -Inf, NaN.
//
// Names follow vLLM's metric names with a `spade_` prefix where vLLM has one (spade_num_requests_running,
// spade_time_to_first_token_seconds, ...); units are seconds and bytes; counters end in `_total`.
//
// Thread safety: every metric and family may be updated from any thread; render() takes a consistent-enough
// snapshot (each family under its own lock). Metrics live as long as the registry; references returned by
// family().with() stay valid.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace spade::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;  // (name, value), in declaration order

/// Monotonic counter. inc() with a negative amount throws spade::Error.
class Counter {
 public:
  void inc(double amount = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Gauge: a value that goes up and down.
class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void inc(double amount = 1.0);
  void dec(double amount = 1.0) { inc(-amount); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

/// Histogram with fixed upper bounds (strictly increasing; +Inf is implicit).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (size bounds + 1)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative), size bounds + 1
  double sum_ = 0;
  uint64_t count_ = 0;
};

enum class MetricType { kCounter, kGauge, kHistogram };

/// All series of one metric name: one per distinct label-value tuple.
template <typename M>
class Family {
 public:
  /// The series for `values` (one value per label name of the family, in order); created on first use.
  /// Throws spade::Error when the number of values differs from the family's label names.
  M& with(const std::vector<std::string>& values = {});

 private:
  friend class Registry;
  Family(std::string name, std::string help, std::vector<std::string> label_names, std::vector<double> bounds)
      : name_(std::move(name)),
        help_(std::move(help)),
        label_names_(std::move(label_names)),
        bounds_(std::move(bounds)) {}
  std::string name_, help_;
  std::vector<std::string> label_names_;
  std::vector<double> bounds_;  // histograms only
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> series_;
};

/// Default latency buckets in seconds (vLLM's TTFT buckets, 1 ms .. 2560 s).
std::vector<double> latency_buckets_seconds();
/// Finer buckets for per-token latency (vLLM's inter-token latency buckets, 10 ms .. 80 s, plus 1/2.5/5 ms).
std::vector<double> token_latency_buckets_seconds();
/// `count` buckets start, start*factor, ... (Prometheus' ExponentialBuckets).
std::vector<double> exponential_buckets(double start, double factor, int count);
/// `count` buckets start, start+width, ... (LinearBuckets).
std::vector<double> linear_buckets(double start, double width, int count);

class Registry {
 public:
  /// Declare (or fetch, if the same name was declared with the same type and labels) a metric family.
  /// Throws spade::Error for an invalid metric or label name ([a-zA-Z_:][a-zA-Z0-9_:]*, labels without ':' and
  /// not starting with "__", no "le" on histograms), a counter whose name does not end in "_total", or a name
  /// already declared with a different type, help or label names.
  Family<Counter>& counter(const std::string& name, const std::string& help,
                           std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                               std::vector<std::string> label_names = {});

  /// The text exposition format 0.0.4, families in declaration order, series sorted by label values.
  std::string render() const;

  /// Content-Type to serve render() with.
  static constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

 private:
  struct Entry {
    MetricType type;
    std::string name;
    std::unique_ptr<Family<Counter>> counters;
    std::unique_ptr<Family<Gauge>> gauges;
    std::unique_ptr<Family<Histogram>> histograms;
  };
  Entry* find_or_check(const std::string& name, MetricType type, const std::string& help,
                       const std::vector<std::string>& labels, const std::vector<double>* bounds);
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

/// Number formatting of the exposition format ("3", "0.25", "+Inf", "NaN").
std::string format_value(double v);
/// Label value escaping (\\, \", \n).
std::string escape_label_value(std::string_view v);

}  // namespace spade::metrics
