#include "common/metrics.h"

#include <fmt/format.h>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/error.h"

namespace spade::metrics {

namespace {

bool valid_metric_name(std::string_view n) {
  if (n.empty() || n.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!(alpha || (i > 0 && c >= '0' && c <= '9'))) return false;
  }
  return true;
}

bool valid_label_name(std::string_view n) {
  if (n.empty() || n.substr(0, 2) == "__") return false;
  for (size_t i = 0; i < n.size(); ++i) {
    const char c = n[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!(alpha || (i > 0 && c >= '0' && c <= '9'))) return false;
  }
  return true;
}

// prometheus-cpp 1.0's TextSerializer writes the help text as given: escape it here (\\ and newline).
std::string escape_help(std::string_view h) {
  std::string out;
  out.reserve(h.size());
  for (char c : h) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

void Counter::inc(double amount) {
  SPADE_CHECK(amount >= 0 && !std::isnan(amount), "counter increment must be >= 0, got {}", amount);
  c_->Increment(amount);
}
double Counter::value() const { return c_->Value(); }

void Gauge::set(double v) { g_->Set(v); }
void Gauge::inc(double amount) { g_->Increment(amount); }
void Gauge::dec(double amount) { g_->Decrement(amount); }
double Gauge::value() const { return g_->Value(); }

void Histogram::observe(double v) {
  if (std::isnan(v)) {  // prometheus-cpp 1.0 would count NaN in the first bucket; it belongs to +Inf only
    std::vector<double> increments(num_bounds_ + 1, 0.0);
    increments.back() = 1;
    h_->ObserveMultiple(increments, v);
    return;
  }
  h_->Observe(v);
}

Histogram::Snapshot Histogram::snapshot() const {
  const prometheus::ClientMetric m = h_->Collect();
  Snapshot s;
  for (const auto& b : m.histogram.bucket) {
    if (!std::isinf(b.upper_bound)) s.bounds.push_back(b.upper_bound);
    s.cumulative.push_back(b.cumulative_count);
  }
  s.sum = m.histogram.sample_sum;
  s.count = m.histogram.sample_count;
  return s;
}

template <typename M>
M& Family<M>::with(const std::vector<std::string>& values) {
  SPADE_CHECK(values.size() == label_names_.size(), "metric {}: {} label value(s) given, the family has {} label(s)",
              name_, values.size(), label_names_.size());
  std::lock_guard<std::mutex> lk(mu_);
  auto it = series_.find(values);
  if (it == series_.end()) {
    prometheus::Labels labels;
    for (size_t i = 0; i < values.size(); ++i) labels.emplace(label_names_[i], values[i]);
    typename Backend<M>::type* m = nullptr;
    if constexpr (std::is_same_v<M, Histogram>) {
      m = &family_->Add(labels, bounds_);
    } else {
      m = &family_->Add(labels);
    }
    std::unique_ptr<M> facade;
    if constexpr (std::is_same_v<M, Histogram>) {
      facade.reset(new Histogram(*m, bounds_.size()));
    } else {
      facade.reset(new M(*m));
    }
    it = series_.emplace(values, std::move(facade)).first;
  }
  return *it->second;
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> token_latency_buckets_seconds() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
          0.4,    0.5,   0.75,   1.0,   2.5,  5.0,   7.5,  10.0,  20.0, 40.0, 80.0};
}

std::vector<double> vllm_inter_token_latency_buckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> vllm_request_latency_buckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,   15.0,   20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> vllm_request_n_buckets() { return {1, 2, 5, 10, 20}; }

std::vector<double> exponential_buckets(double start, double factor, int count) {
  SPADE_CHECK(start > 0 && factor > 1 && count > 0, "exponential_buckets needs start > 0, factor > 1, count > 0");
  std::vector<double> b(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) b[static_cast<size_t>(i)] = start * std::pow(factor, i);
  return b;
}

std::vector<double> linear_buckets(double start, double width, int count) {
  SPADE_CHECK(width > 0 && count > 0, "linear_buckets needs width > 0 and count > 0");
  std::vector<double> b(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) b[static_cast<size_t>(i)] = start + width * i;
  return b;
}

Registry::Registry() : registry_(std::make_unique<prometheus::Registry>()) {}
Registry::~Registry() = default;

Registry::Entry* Registry::find_or_check(const std::string& name, MetricType type, const std::string& help,
                                         const std::vector<std::string>& labels, const std::vector<double>* bounds) {
  SPADE_CHECK(valid_metric_name(name), "invalid metric name '{}' (must match [a-zA-Z_:][a-zA-Z0-9_:]*, not starting with __)", name);
  if (type == MetricType::kCounter)
    SPADE_CHECK(name.size() > 6 && name.substr(name.size() - 6) == "_total",
                "counter '{}' must end in _total (Prometheus naming convention)", name);
  for (size_t i = 0; i < labels.size(); ++i) {
    SPADE_CHECK(valid_label_name(labels[i]), "metric {}: invalid label name '{}'", name, labels[i]);
    SPADE_CHECK(!(type == MetricType::kHistogram && labels[i] == "le"), "histogram {}: label 'le' is reserved",
                name);
    for (size_t j = 0; j < i; ++j) SPADE_CHECK(labels[i] != labels[j], "metric {}: duplicate label '{}'", name, labels[i]);
  }
  if (bounds) {
    for (size_t i = 0; i < bounds->size(); ++i) {
      const double b = (*bounds)[i];
      SPADE_CHECK(std::isfinite(b), "histogram {}: bucket bound {} is not finite", name, b);
      SPADE_CHECK(i == 0 || b > (*bounds)[i - 1], "histogram {}: bucket bounds must increase strictly ({} after {})",
                  name, b, (*bounds)[i - 1]);
    }
  }
  for (auto& e : entries_) {
    // The exposition format also reserves the histogram series names.
    auto clash = [&](const std::string& a, const std::string& b) {
      return a == b + "_bucket" || a == b + "_sum" || a == b + "_count";
    };
    SPADE_CHECK(!(e->type == MetricType::kHistogram && clash(name, e->name)) &&
                    !(type == MetricType::kHistogram && clash(e->name, name)),
                "metric '{}' clashes with the series of histogram '{}'", name, e->name);
    if (e->name != name) continue;
    const std::vector<std::string>* l = nullptr;
    const std::vector<double>* b = nullptr;
    if (e->counters) l = &e->counters->label_names_;
    if (e->gauges) l = &e->gauges->label_names_;
    if (e->histograms) l = &e->histograms->label_names_, b = &e->histograms->bounds_;
    SPADE_CHECK(e->type == type && e->help == help && *l == labels && (!bounds || *b == *bounds),
                "metric '{}' is already registered with a different type, help, labels or buckets", name);
    return e.get();
  }
  return nullptr;
}

template <typename M, typename Builder>
Family<M>& Registry::declare(MetricType type, Builder builder, std::unique_ptr<Family<M>> Entry::*slot,
                             const std::string& name, const std::string& help, std::vector<std::string> label_names,
                             std::vector<double> bounds) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::vector<double>* checked_bounds = type == MetricType::kHistogram ? &bounds : nullptr;
  if (auto* e = find_or_check(name, type, help, label_names, checked_bounds)) return *((*e).*slot);
  auto& backing = builder.Name(name).Help(escape_help(help)).Register(*registry_);
  auto e = std::make_unique<Entry>(Entry{type, name, help, nullptr, nullptr, nullptr});
  ((*e).*slot).reset(new Family<M>(name, std::move(label_names), std::move(bounds), backing));
  entries_.push_back(std::move(e));
  return *((*entries_.back()).*slot);
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   std::vector<std::string> label_names) {
  return declare(MetricType::kCounter, prometheus::BuildCounter(), &Entry::counters, name, help,
                 std::move(label_names), {});
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names) {
  return declare(MetricType::kGauge, prometheus::BuildGauge(), &Entry::gauges, name, help, std::move(label_names), {});
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                       std::vector<std::string> label_names) {
  return declare(MetricType::kHistogram, prometheus::BuildHistogram(), &Entry::histograms, name, help,
                 std::move(label_names), std::move(bounds));
}

std::string Registry::render() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::map<std::string, size_t> order;
  std::map<std::string, const std::vector<std::string>*> label_names;  // immutable once declared
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = *entries_[i];
      order.emplace(e.name, i);
      label_names.emplace(e.name, e.counters     ? &e.counters->label_names_
                                  : e.gauges     ? &e.gauges->label_names_
                                                 : &e.histograms->label_names_);
    }
  }
  // prometheus-cpp groups families by type, keeps a family's series in a hash map and a series' labels sorted by
  // name: put the labels back in declaration order and sort the series by their label values, so that the text is
  // the same from run to run and reads as declared.
  for (auto& f : families) {
    const std::vector<std::string>& names = *label_names.at(f.name);
    auto rank = [&](const prometheus::ClientMetric::Label& l) {
      return static_cast<size_t>(std::find(names.begin(), names.end(), l.name) - names.begin());
    };
    for (auto& m : f.metric)
      std::sort(m.label.begin(), m.label.end(),
                [&](const prometheus::ClientMetric::Label& a, const prometheus::ClientMetric::Label& b) {
                  return rank(a) < rank(b);
                });
    std::sort(f.metric.begin(), f.metric.end(), [](const prometheus::ClientMetric& a, const prometheus::ClientMetric& b) {
      return std::lexicographical_compare(
          a.label.begin(), a.label.end(), b.label.begin(), b.label.end(),
          [](const prometheus::ClientMetric::Label& x, const prometheus::ClientMetric::Label& y) { return x.value < y.value; });
    });
  }
  std::stable_sort(families.begin(), families.end(),
                   [&](const prometheus::MetricFamily& a, const prometheus::MetricFamily& b) {
                     return order.at(a.name) < order.at(b.name);
                   });
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace spade::metrics
