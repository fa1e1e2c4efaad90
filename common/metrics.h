// Prometheus metrics: a thin facade over prometheus-cpp's core library (Debian's prometheus-cpp-dev:
// prometheus::Registry, Family<Counter|Gauge|Histogram> and TextSerializer) that every Spade process serves on
// GET /metrics in the text exposition format 0.0.4.
//
// Why a facade: the call sites keep one line per series (`registry.counter(name, help, labels).with(values)`), the
// label names are declared once per family and checked (prometheus-cpp takes a label map per series), bad
// declarations throw spade::Error naming the metric, a negative counter increment throws (prometheus-cpp ignores
// it silently), NaN observations go to the +Inf bucket only (prometheus-cpp 1.0 counts them in the first), and
// render() gives a deterministic text (families, labels and series in a fixed order) that
// tests/common/test_metrics.cpp golden-tests and checks with `promtool check metrics`.
//
// Why our Beast endpoint (common/status_endpoint.h) serves the text and not prometheus-cpp's pull Exposer: the
// Exposer brings a second HTTP stack (civetweb) with its own threads and its own listening port; ours is already on
// every process's port (the coordinator serves /metrics on its API port next to /health and /ready), shares the
// bind-address flags (--http-host, --metrics-host), and needs no extra thread or port. Only prometheus-cpp-core is
// linked.
//
// What the text looks like (prometheus-cpp 1.0's TextSerializer):
//   # HELP <name> <help, \ and newline escaped here before prometheus-cpp sees it>
//   # TYPE <name> counter|gauge|histogram
//   <name>{<label>="<value, with \ " and newline escaped>",...} <value>       labels in declaration order
//   histograms: <name>_count, <name>_sum, then <name>_bucket{...,le="<bound>"} <cumulative count> ... le="+Inf".
// Values print with 16 significant digits ("0.1", "1048576", "1.234567890123457e+16"), "+Inf", "-Inf", "Nan".
// A family with no series yet prints nothing (not even its HELP/TYPE lines).
//
// Names: Spade's own series are vLLM's names with a `spade_` prefix where vLLM has one
// (spade_num_requests_running, spade_time_to_first_token_seconds, ...); the vLLM-compatible series carry vLLM's
// exact names (`vllm:num_requests_running`, ...; a ':' is legal in metric names, not in label names) with a
// `model_name` label. Units are seconds and bytes; counters end in `_total`.
//
// Thread safety: every metric and family may be updated from any thread; render() collects each series under its
// own lock. Metrics live as long as the registry; references returned by family().with() stay valid.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace spade::metrics {

/// Monotonic counter. inc() with a negative or NaN amount throws spade::Error.
class Counter {
 public:
  void inc(double amount = 1.0);
  double value() const;

 private:
  template <typename M>
  friend class Family;
  explicit Counter(prometheus::Counter& c) : c_(&c) {}
  prometheus::Counter* c_;
};

/// Gauge: a value that goes up and down.
class Gauge {
 public:
  void set(double v);
  void inc(double amount = 1.0);
  void dec(double amount = 1.0);
  double value() const;

 private:
  template <typename M>
  friend class Family;
  explicit Gauge(prometheus::Gauge& g) : g_(&g) {}
  prometheus::Gauge* g_;
};

/// Histogram with fixed upper bounds (strictly increasing; +Inf is implicit). A value v falls in every bucket
/// with v <= bound (Prometheus' "le"); NaN only in +Inf.
class Histogram {
 public:
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf (size bounds + 1)
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot snapshot() const;

 private:
  template <typename M>
  friend class Family;
  Histogram(prometheus::Histogram& h, size_t num_bounds) : h_(&h), num_bounds_(num_bounds) {}
  prometheus::Histogram* h_;
  size_t num_bounds_;
};

enum class MetricType { kCounter, kGauge, kHistogram };

/// The prometheus-cpp metric behind each facade type.
template <typename M>
struct Backend;
template <>
struct Backend<Counter> {
  using type = prometheus::Counter;
};
template <>
struct Backend<Gauge> {
  using type = prometheus::Gauge;
};
template <>
struct Backend<Histogram> {
  using type = prometheus::Histogram;
};

/// All series of one metric name: one per distinct label-value tuple.
template <typename M>
class Family {
 public:
  /// The series for `values` (one value per label name of the family, in declaration order); created on first use.
  /// Throws spade::Error when the number of values differs from the family's label names.
  M& with(const std::vector<std::string>& values = {});

 private:
  friend class Registry;
  using Backing = prometheus::Family<typename Backend<M>::type>;
  Family(std::string name, std::vector<std::string> label_names, std::vector<double> bounds, Backing& family)
      : name_(std::move(name)), label_names_(std::move(label_names)), bounds_(std::move(bounds)), family_(&family) {}
  std::string name_;
  std::vector<std::string> label_names_;
  std::vector<double> bounds_;  // histograms only
  Backing* family_;             // owned by the Registry's prometheus::Registry
  mutable std::mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<M>> series_;
};

/// vLLM's buckets for vllm:time_to_first_token_seconds (1 ms .. 2560 s, 22 bounds); also Spade's latency default.
std::vector<double> latency_buckets_seconds();
/// Finer buckets for per-token latency (vLLM's inter-token latency buckets, 10 ms .. 80 s, plus 0.5/1/2.5/5 ms).
std::vector<double> token_latency_buckets_seconds();
/// vLLM's buckets for vllm:inter_token_latency_seconds exactly (10 ms .. 80 s, 19 bounds).
std::vector<double> vllm_inter_token_latency_buckets();
/// vLLM's request_latency_buckets, for vllm:e2e_request_latency_seconds and vllm:request_queue_time_seconds
/// (0.3 s .. 7680 s, 21 bounds).
std::vector<double> vllm_request_latency_buckets();
/// vLLM's buckets of vllm:request_params_n (the n parameter, samples per request): 1, 2, 5, 10, 20.
std::vector<double> vllm_request_n_buckets();
/// `count` buckets start, start*factor, ... (Prometheus' ExponentialBuckets).
std::vector<double> exponential_buckets(double start, double factor, int count);
/// `count` buckets start, start+width, ... (LinearBuckets).
std::vector<double> linear_buckets(double start, double width, int count);

class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  /// Declare (or fetch, if the same name was declared with the same type, help, labels and buckets) a metric
  /// family. Throws spade::Error for an invalid metric or label name ([a-zA-Z_:][a-zA-Z0-9_:]*, labels without ':'
  /// and not starting with "__", no "le" on histograms), a counter whose name does not end in "_total", bucket
  /// bounds that are not finite and strictly increasing, or a name already declared differently (or clashing with
  /// a histogram's _bucket/_sum/_count series).
  Family<Counter>& counter(const std::string& name, const std::string& help,
                           std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(const std::string& name, const std::string& help,
                       std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                               std::vector<std::string> label_names = {});

  /// The text exposition format 0.0.4 (prometheus::TextSerializer), families in declaration order, each series'
  /// labels in declaration order, series sorted by their label values; families without series are left out.
  std::string render() const;

  /// Content-Type to serve render() with.
  static constexpr std::string_view kContentType = "text/plain; version=0.0.4; charset=utf-8";

 private:
  struct Entry {
    MetricType type;
    std::string name, help;
    std::unique_ptr<Family<Counter>> counters;
    std::unique_ptr<Family<Gauge>> gauges;
    std::unique_ptr<Family<Histogram>> histograms;
  };
  Entry* find_or_check(const std::string& name, MetricType type, const std::string& help,
                       const std::vector<std::string>& labels, const std::vector<double>* bounds);
  // counter() / gauge() / histogram(): the family `slot` of the entry named `name`, declared through `builder`
  // (a prometheus::Build* builder) on first use. bounds: histograms only.
  template <typename M, typename Builder>
  Family<M>& declare(MetricType type, Builder builder, std::unique_ptr<Family<M>> Entry::*slot,
                     const std::string& name, const std::string& help, std::vector<std::string> label_names,
                     std::vector<double> bounds);
  std::unique_ptr<prometheus::Registry> registry_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

}  // namespace spade::metrics
