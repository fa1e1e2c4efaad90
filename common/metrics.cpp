#include "common/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace spade::metrics {

namespace {

bool valid_metric_name(std::string_view n) {
  if (n.empty()) return false;
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

void atomic_add(std::atomic<double>& a, double d) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + d, std::memory_order_relaxed)) {
  }
}

std::string label_block(const std::vector<std::string>& names, const std::vector<std::string>& values,
                        const std::string& extra_name = "", const std::string& extra_value = "") {
  if (names.empty() && extra_name.empty()) return "";
  std::string s = "{";
  bool first = true;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!first) s += ',';
    first = false;
    s += names[i] + "=\"" + escape_label_value(values[i]) + "\"";
  }
  if (!extra_name.empty()) {
    if (!first) s += ',';
    s += extra_name + "=\"" + extra_value + "\"";
  }
  return s + "}";
}

}  // namespace

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);  // shortest representation that round-trips
}

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Counter::inc(double amount) {
  SPADE_CHECK(amount >= 0 && !std::isnan(amount), "counter increment must be >= 0, got {}", amount);
  atomic_add(value_, amount);
}

void Gauge::inc(double amount) { atomic_add(value_, amount); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    SPADE_CHECK(std::isfinite(bounds_[i]), "histogram bucket bound {} is not finite", bounds_[i]);
    SPADE_CHECK(i == 0 || bounds_[i] > bounds_[i - 1], "histogram bucket bounds must increase strictly ({} after {})",
                bounds_[i], bounds_[i - 1]);
  }
}

void Histogram::observe(double v) {
  // Bucket i counts v <= bounds[i] (Prometheus' "le"); NaN lands in +Inf only.
  const size_t i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lk(mu_);
  counts_[std::isnan(v) ? bounds_.size() : i] += 1;
  sum_ += v;
  count_ += 1;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  std::lock_guard<std::mutex> lk(mu_);
  s.cumulative.resize(counts_.size());
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    acc += counts_[i];
    s.cumulative[i] = acc;
  }
  s.sum = sum_;
  s.count = count_;
  return s;
}

template <typename M>
M& Family<M>::with(const std::vector<std::string>& values) {
  SPADE_CHECK(values.size() == label_names_.size(), "metric {}: {} label value(s) given, the family has {} label(s)",
              name_, values.size(), label_names_.size());
  std::lock_guard<std::mutex> lk(mu_);
  auto it = series_.find(values);
  if (it == series_.end()) {
    std::unique_ptr<M> m;
    if constexpr (std::is_same_v<M, Histogram>) {
      m = std::make_unique<Histogram>(bounds_);
    } else {
      m = std::make_unique<M>();
    }
    it = series_.emplace(values, std::move(m)).first;
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

Registry::Entry* Registry::find_or_check(const std::string& name, MetricType type, const std::string& help,
                                         const std::vector<std::string>& labels, const std::vector<double>* bounds) {
  SPADE_CHECK(valid_metric_name(name), "invalid metric name '{}' (must match [a-zA-Z_:][a-zA-Z0-9_:]*)", name);
  if (type == MetricType::kCounter)
    SPADE_CHECK(name.size() > 6 && name.substr(name.size() - 6) == "_total",
                "counter '{}' must end in _total (Prometheus naming convention)", name);
  for (size_t i = 0; i < labels.size(); ++i) {
    SPADE_CHECK(valid_label_name(labels[i]), "metric {}: invalid label name '{}'", name, labels[i]);
    SPADE_CHECK(!(type == MetricType::kHistogram && labels[i] == "le"), "histogram {}: label 'le' is reserved",
                name);
    for (size_t j = 0; j < i; ++j) SPADE_CHECK(labels[i] != labels[j], "metric {}: duplicate label '{}'", name, labels[i]);
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
    const std::string* h = nullptr;
    const std::vector<std::string>* l = nullptr;
    const std::vector<double>* b = nullptr;
    if (e->counters) h = &e->counters->help_, l = &e->counters->label_names_;
    if (e->gauges) h = &e->gauges->help_, l = &e->gauges->label_names_;
    if (e->histograms) h = &e->histograms->help_, l = &e->histograms->label_names_, b = &e->histograms->bounds_;
    SPADE_CHECK(e->type == type && *h == help && *l == labels && (!bounds || *b == *bounds),
                "metric '{}' is already registered with a different type, help, labels or buckets", name);
    return e.get();
  }
  return nullptr;
}

Family<Counter>& Registry::counter(const std::string& name, const std::string& help,
                                   std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lk(mu_);
  if (auto* e = find_or_check(name, MetricType::kCounter, help, label_names, nullptr)) return *e->counters;
  auto e = std::make_unique<Entry>();
  e->type = MetricType::kCounter;
  e->name = name;
  e->counters.reset(new Family<Counter>(name, help, std::move(label_names), {}));
  entries_.push_back(std::move(e));
  return *entries_.back()->counters;
}

Family<Gauge>& Registry::gauge(const std::string& name, const std::string& help,
                               std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lk(mu_);
  if (auto* e = find_or_check(name, MetricType::kGauge, help, label_names, nullptr)) return *e->gauges;
  auto e = std::make_unique<Entry>();
  e->type = MetricType::kGauge;
  e->name = name;
  e->gauges.reset(new Family<Gauge>(name, help, std::move(label_names), {}));
  entries_.push_back(std::move(e));
  return *entries_.back()->gauges;
}

Family<Histogram>& Registry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                       std::vector<std::string> label_names) {
  std::lock_guard<std::mutex> lk(mu_);
  Histogram check(bounds);  // validates the bounds
  (void)check;
  if (auto* e = find_or_check(name, MetricType::kHistogram, help, label_names, &bounds)) return *e->histograms;
  auto e = std::make_unique<Entry>();
  e->type = MetricType::kHistogram;
  e->name = name;
  e->histograms.reset(new Family<Histogram>(name, help, std::move(label_names), std::move(bounds)));
  entries_.push_back(std::move(e));
  return *entries_.back()->histograms;
}

std::string Registry::render() const {
  std::string out;
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& e : entries_) {
    auto header = [&](const std::string& help, const char* type) {
      out += "# HELP " + e->name + " " + escape_help(help) + "\n";
      out += "# TYPE " + e->name + " " + type + "\n";
    };
    if (e->counters || e->gauges) {
      const bool is_counter = e->counters != nullptr;
      const auto& help = is_counter ? e->counters->help_ : e->gauges->help_;
      const auto& names = is_counter ? e->counters->label_names_ : e->gauges->label_names_;
      header(help, is_counter ? "counter" : "gauge");
      auto emit = [&](const auto& fam) {
        std::lock_guard<std::mutex> fl(fam.mu_);
        for (const auto& [values, m] : fam.series_)
          out += e->name + label_block(names, values) + " " + format_value(m->value()) + "\n";
      };
      if (is_counter) {
        emit(*e->counters);
      } else {
        emit(*e->gauges);
      }
      continue;
    }
    const auto& fam = *e->histograms;
    header(fam.help_, "histogram");
    std::lock_guard<std::mutex> fl(fam.mu_);
    for (const auto& [values, h] : fam.series_) {
      const auto s = h->snapshot();
      for (size_t i = 0; i <= s.bounds.size(); ++i) {
        const std::string le = i < s.bounds.size() ? format_value(s.bounds[i]) : "+Inf";
        out += e->name + "_bucket" + label_block(fam.label_names_, values, "le", le) + " " +
               format_value(static_cast<double>(s.cumulative[i])) + "\n";
      }
      out += e->name + "_sum" + label_block(fam.label_names_, values) + " " + format_value(s.sum) + "\n";
      out += e->name + "_count" + label_block(fam.label_names_, values) + " " +
             format_value(static_cast<double>(s.count)) + "\n";
    }
  }
  return out;
}

}  // namespace spade::metrics
