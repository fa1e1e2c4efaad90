// The measured variants, the checks, the tables printed to stdout and the JSON report (fidelity_<model>.json).
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "bench/fidelity/fidelity_report.h"
#include "common/error.h"

namespace spade::fidelity::report {

std::vector<Variant> make_variants(const Options& o) {
  std::vector<Variant> v;
  auto base = [&](const std::string& name, const std::string& group, double frac) {
    Variant x;
    x.name = name;
    x.group = group;
    x.frac = frac;
    x.S = o.sinks;
    x.R = o.local_window;
    return x;
  };
  for (double f : o.budgets) {
    Variant m = base(fmt::format("main {}", frac_name(f)), "main", f);
    m.fixed = true;
    m.lastq = true;
    v.push_back(m);
  }
  const double f0 = o.budgets.front();
  if (o.sweep) {
    for (int W : {4, 8, 16}) {
      for (float eps : {1e-3f, 1e-2f, 1e-1f}) {
        Variant s = base(fmt::format("W={} eps={:g}", W, eps), "sweep", f0);
        s.W = W;
        s.eps = eps;
        v.push_back(s);
      }
    }
  }
  Variant g = base("GQA mean", "gqa", f0);
  g.rule = GqaScoreRule::kMean;
  g.lastq = true;
  v.push_back(g);
  Variant p = base("paper candidates (S=0, R=1)", "paper", f0);
  p.S = 0;
  p.R = 1;
  p.lastq = true;
  v.push_back(p);
  return v;
}

void Checks::add(const std::string& name, bool pass, const std::string& detail) {
  items.push_back({{"check", name}, {"pass", pass}, {"detail", detail}});
  if (!pass) {
    ok = false;
    fmt::print(stderr, "CHECK FAILED: {}: {}\n", name, detail);
  }
}

void add_probe_checks(Checks& checks, const std::vector<Variant>& vars,
                      const std::vector<VariantStats>& stats) {
  for (size_t i = 0; i < vars.size(); ++i) {
    const VariantStats& st = stats[i];
    if (vars[i].fixed)
      checks.add(
          fmt::format("{}: probe selections == cache::Selector's own path, K/V == engine's", vars[i].name),
          st.selector_mismatches == 0 && st.selector_compares > 0,
          st.selector_mismatches == 0
              ? fmt::format("{} selections compared, all identical", st.selector_compares)
              : fmt::format("{} of {} differ; first: {}", st.selector_mismatches, st.selector_compares,
                            st.first_mismatch));
    checks.add(fmt::format("{}: measured", vars[i].name), st.steps > 0 && pooled(st.pred).n > 0,
               fmt::format("{} steps", st.steps));
  }
}

// ---- environment ------------------------------------------------------------------------------------------

namespace {

std::string run_capture(const std::string& cmd) {
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    std::array<char, 256> buf{};
    while (fgets(buf.data(), buf.size(), p)) out += buf.data();
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

json machine_info() {
  std::array<char, 256> host{};
  gethostname(host.data(), host.size() - 1);
  std::string cpu;
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  return {{"host", host.data()}, {"cpu", cpu}, {"hardware_threads", std::thread::hardware_concurrency()}};
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  std::array<char, 32> buf{};
  std::strftime(buf.data(), buf.size(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf.data();
}

std::string pct(double x) {
  return std::isnan(x) ? "   -  " : fmt::format("{:6.3f}", x);
}

}  // namespace

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}", path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ---- JSON -------------------------------------------------------------------------------------------------

json num(double x) {
  return std::isnan(x) ? json(nullptr) : json(std::round(x * 1e6) / 1e6);
}

namespace {

json layer_array(const std::vector<Mean>& v) {
  json a = json::array();
  for (const auto& m : v) a.push_back(num(m.get()));
  return a;
}

json variant_json(const Variant& v, const VariantStats& st) {
  json j = {{"name", v.name},
            {"group", v.group},
            {"budget_fraction", v.frac},
            {"query_window", v.W},
            {"ridge_eps", v.eps},
            {"gqa_rule", rule_name(v.rule)},
            {"sink_tokens", v.S},
            {"local_window", v.R},
            {"measured_steps", st.steps},
            {"growing_budget",
             {{"predicted", layer_array(st.pred)},
              {"reuse_last_selection", layer_array(st.reuse)},
              {"chance", layer_array(st.chance)},
              {"mean",
               {{"predicted", num(pooled(st.pred).get())},
                {"reuse_last_selection", num(pooled(st.reuse).get())},
                {"chance", num(pooled(st.chance).get())}}}}}};
  if (v.lastq) {
    j["growing_budget"]["last_query"] = layer_array(st.lastq);
    j["growing_budget"]["mean"]["last_query"] = num(pooled(st.lastq).get());
    j["attention_mass_recall"] = {{"predicted", layer_array(st.mass_pred)},
                                  {"reuse_last_selection", layer_array(st.mass_reuse)},
                                  {"last_query", layer_array(st.mass_lastq)},
                                  {"true_query", layer_array(st.mass_true)},
                                  {"mean",
                                   {{"predicted", num(pooled(st.mass_pred).get())},
                                    {"reuse_last_selection", num(pooled(st.mass_reuse).get())},
                                    {"last_query", num(pooled(st.mass_lastq).get())},
                                    {"true_query", num(pooled(st.mass_true).get())}}}};
  }
  json pp = json::array(), rp = json::array();
  for (const auto& m : st.pred_per_prompt) pp.push_back(num(m.get()));
  for (const auto& m : st.reuse_per_prompt) rp.push_back(num(m.get()));
  j["growing_budget"]["predicted_per_prompt"] = pp;
  j["growing_budget"]["reuse_last_selection_per_prompt"] = rp;
  if (v.fixed) {
    j["fixed_budget"] = {{"predicted", layer_array(st.pred_fixed)},
                         {"reuse_last_selection", layer_array(st.reuse_fixed)},
                         {"chance", layer_array(st.chance_fixed)},
                         {"mean",
                          {{"predicted", num(pooled(st.pred_fixed).get())},
                           {"reuse_last_selection", num(pooled(st.reuse_fixed).get())},
                           {"chance", num(pooled(st.chance_fixed).get())}}},
                         {"selector_compares", st.selector_compares},
                         {"selector_mismatches", st.selector_mismatches}};
  }
  return j;
}

}  // namespace

json model_shape_json(const ModelConfig& cfg) {
  return {{"layers", cfg.num_layers},
          {"q_heads", cfg.num_q_heads},
          {"kv_heads", cfg.num_kv_heads},
          {"head_dim", cfg.head_dim}};
}

json common_header(const Options& o, const std::string& model) {
  const std::string src = SPADE_SOURCE_DIR;
  std::string commit = run_capture("git -C '" + src + "' rev-parse HEAD 2>/dev/null");
  const std::string dirty = run_capture("git -C '" + src + "' status --porcelain 2>/dev/null | head -1");
  return {{"tool", "fidelity_report"},
          {"model", model},
          {"date_utc", utc_now()},
          {"commit", commit.empty() ? json(nullptr) : json(commit)},
          {"worktree_dirty", !dirty.empty()},
          {"machine", machine_info()},
          {"quick", o.quick},
          {"parameters",
           {{"sparse_threshold", o.threshold},
            {"sink_tokens", o.sinks},
            {"local_window", o.local_window},
            {"budget_fractions", o.budgets},
            {"budget_definition",
             "growing: k_t = ceil(frac * n_t), n_t = L_t - local_window - sink_tokens candidates at step t; "
             "fixed: K = "
             "ceil(frac * n_last), n_last = candidates at the sequence's last decode step"},
            {"overlap_definition",
             "Eq. 1: |X ∩ T_t| / |T_t| per (step, prompt, layer, KV head), T_t = top-k of the true query "
             "q_t; X = "
             "predicted (Algorithm 1 on the window ending at q_{t-1}), reuse_last_selection (T_{t-1}), "
             "last_query "
             "(top-k of q_{t-1} over the current candidates); chance = k_t / n_t (expected overlap of a "
             "random set)"},
            {"layers_per_pack", o.layers_per_pack},
            {"page_size", kPageSize}}}};
}

void finish_report(const Options& o, const std::string& name, const std::vector<Variant>& vars,
                   const std::vector<VariantStats>& stats, const Checks& checks, double total_s, json& j) {
  json vj = json::array();
  for (size_t i = 0; i < vars.size(); ++i) vj.push_back(variant_json(vars[i], stats[i]));
  j["variants"] = vj;
  j["checks"] = checks.items;
  j["checks_passed"] = checks.ok;
  j["runtime_s"] = std::round(total_s * 10) / 10;
  if (o.out_dir.empty()) {
    fmt::print("(no --out-dir: JSON for {} not written)\n", name);
    return;
  }
  std::filesystem::create_directories(o.out_dir);
  const std::string path = o.out_dir + "/fidelity_" + name + ".json";
  std::ofstream out(path);
  if (!out) fail("cannot write {}", path);
  out << j.dump(2) << "\n";
  if (!out) fail("error writing {}", path);
  fmt::print("wrote {}\n", path);
}

// ---- tables -----------------------------------------------------------------------------------------------

void print_overlaps(const std::string& model, const std::vector<Variant>& vars,
                    const std::vector<VariantStats>& st, int layers, int kv_heads) {
  // The value of layer l, or pooled over the layers on the "all" row (l == layers).
  auto at = [layers](const std::vector<Mean>& m, int l) { return l < layers ? m[l].get() : pooled(m).get(); };
  auto row_name = [layers](int l) { return l < layers ? std::to_string(l) : std::string("all"); };
  for (size_t i = 0; i < vars.size(); ++i) {
    const Variant& v = vars[i];
    if (v.group != "main") continue;
    fmt::print(
        "\n[{}] overlap ratio (Eq. 1) with the true-query top-k, budget {} of the candidates; S={} R={} W={} "
        "eps={:g} GQA {}; {} measured steps x {} KV heads per layer\n",
        model, frac_name(v.frac), v.S, v.R, v.W, v.eps, rule_name(v.rule), st[i].steps, kv_heads);
    fmt::print("        |        growing k_t = ceil({} n_t)          |     fixed K = ceil({} n_last)\n",
               frac_name(v.frac), frac_name(v.frac));
    fmt::print("layer   | predicted  reuse-last  last-query  chance | predicted  reuse-last  chance\n");
    for (int l = 0; l <= layers; ++l)
      fmt::print("{:<7} |  {}     {}      {}    {} |  {}     {}    {}\n", row_name(l), pct(at(st[i].pred, l)),
                 pct(at(st[i].reuse, l)), pct(at(st[i].lastq, l)), pct(at(st[i].chance, l)),
                 pct(at(st[i].pred_fixed, l)), pct(at(st[i].reuse_fixed, l)), pct(at(st[i].chance_fixed, l)));
  }
  // Attention-mass recall.
  fmt::print(
      "\n[{}] attention-mass recall (growing budget): share of the true attention probability over the "
      "candidates that the selection covers; mean over steps, prompts and query heads\n",
      model);
  fmt::print("{:<28} {:<11} |", "variant", "selection");
  for (int l = 0; l < layers; ++l) fmt::print(" layer{:<2}", l);
  fmt::print(" |   all\n");
  for (size_t i = 0; i < vars.size(); ++i) {
    if (!vars[i].lastq) continue;
    const std::pair<const char*, const std::vector<Mean>*> rows[] = {{"predicted", &st[i].mass_pred},
                                                                     {"reuse-last", &st[i].mass_reuse},
                                                                     {"last-query", &st[i].mass_lastq},
                                                                     {"oracle", &st[i].mass_true}};
    for (const auto& [sel_name, m] : rows) {
      fmt::print("{:<28} {:<11} |", vars[i].name, sel_name);
      for (int l = 0; l < layers; ++l) fmt::print("  {}", pct((*m)[l].get()));
      fmt::print(" | {}\n", pct(pooled(*m).get()));
    }
  }
  // W x eps sweep.
  bool any_sweep = false;
  for (const auto& v : vars) any_sweep = any_sweep || v.group == "sweep";
  if (any_sweep) {
    fmt::print("\n[{}] predictor sweep: predicted-query overlap (all layers; growing budget {})\n", model,
               frac_name(vars.front().frac));
    fmt::print("W \\ eps |  1e-3    1e-2    1e-1\n");
    for (int W : {4, 8, 16}) {
      fmt::print("{:<7} |", W);
      for (float eps : {1e-3f, 1e-2f, 1e-1f}) {
        double x = kNaN;
        for (size_t i = 0; i < vars.size(); ++i)
          if (vars[i].group == "sweep" && vars[i].W == W && vars[i].eps == eps) x = pooled(st[i].pred).get();
        fmt::print(" {} ", pct(x));
      }
      fmt::print("\n");
    }
  }
  // GQA rule and paper-style candidates, per layer next to the main variant of the same budget.
  const size_t main0 = 0;
  for (size_t i = 0; i < vars.size(); ++i) {
    if (vars[i].group != "gqa" && vars[i].group != "paper") continue;
    fmt::print(
        "\n[{}] {} (budget {}): per layer predicted / reuse-last / last-query / chance; main variant's "
        "predicted for comparison\n",
        model, vars[i].name, frac_name(vars[i].frac));
    fmt::print("layer   | predicted  reuse-last  last-query  chance | main predicted\n");
    for (int l = 0; l <= layers; ++l)
      fmt::print("{:<7} |  {}     {}      {}    {} |  {}\n", row_name(l), pct(at(st[i].pred, l)),
                 pct(at(st[i].reuse, l)), pct(at(st[i].lastq, l)), pct(at(st[i].chance, l)),
                 pct(at(st[main0].pred, l)));
  }
}

}  // namespace spade::fidelity::report
