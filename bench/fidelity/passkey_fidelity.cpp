// passkey_fidelity: pass-key accuracy of sparse decoding on a real trained long-context model, CPU path (fp32), by
// prompt length x needles x token budget, for dense, oracle (true-query exact top-k), Quest-style page top-k,
// AsyncSpade's predicted selection and its variants; and teacher-forced metrics on held-out code (bits per byte,
// top-1 agreement with dense, overlap ratio per layer and KV head, selection churn). Method: passkey_harness.h;
// results and their reading: docs/FIDELITY.md. The GPU path's table comes from bench/fidelity/passkey_gpu.sh.
//
//   passkey_fidelity --model ../shared/data/models/longctx-22m [--bytes 1000,2000] [--per-group 4]
//       [--variants dense,oracle,quest,predicted,paper,last] [--budgets 128,1/16,1/32] [selection flags]
//       [--heldout-docs 4] --json-out FILE --md-out FILE
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "bench/fidelity/passkey_harness.h"
#include "bench/run_stamp.h"
#include "pair/selection_flags.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"

namespace {

using json = nlohmann::json;
using namespace spade;
using namespace spade::fidelity;

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string data_dir() {
  const char* d = std::getenv("SPADE_DATA_DIR");
  return d != nullptr ? d : SPADE_DEFAULT_DATA_DIR;
}

std::vector<int32_t> read_heldout_docs(const std::string& path, int min_bytes, int count) {
  std::ifstream in(path, std::ios::binary);
  SPADE_CHECK(in.good(), "cannot open held-out code {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string sep = "<|endoftext|>";
  std::vector<int32_t> flat;  // documents of >= min_bytes, each cut to min_bytes, concatenated
  size_t pos = 0;
  int taken = 0;
  while (pos < text.size() && taken < count) {
    size_t end = text.find(sep, pos);
    if (end == std::string::npos) end = text.size();
    if (static_cast<int>(end - pos) >= min_bytes) {
      for (int i = 0; i < min_bytes; ++i) flat.push_back(static_cast<uint8_t>(text[pos + i]));
      ++taken;
    }
    pos = end + sep.size();
  }
  SPADE_CHECK(taken == count, "{}: only {} documents of >= {} bytes (wanted {})", path, taken, min_bytes, count);
  return flat;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Pass-key fidelity of sparse decoding on a real long-context model (CPU path)"};
  std::string model_dir, prompts_path, bytes_filter, needles_filter, json_out, md_out, log_level = "warn";
  std::string variants_arg = "dense,oracle,quest,predicted,paper,last", budgets_arg = "128,1/16,1/32";
  int per_group = 1000;
  RunOptions ro;
  pair::SparseFlagText sparse_text;
  int heldout_docs = 0, heldout_context = 2048, heldout_forced = 64;
  std::string heldout_budget = "1/16";
  app.add_option("--model", model_dir, "checkpoint directory (longctx-7m / longctx-22m)")->required();
  app.add_option("--prompts", prompts_path, "pass-key jsonl (default: $SPADE_DATA_DIR/prompts/passkey_public.jsonl)");
  app.add_option("--bytes", bytes_filter, "only prompts of these sizes, e.g. 1000,2000 (default: all)");
  app.add_option("--needles", needles_filter, "only prompts with these needle counts, e.g. 1,4 (default: all)");
  std::string ids_filter;
  app.add_option("--ids", ids_filter, "only the prompts with these ids, e.g. 63,66 (default: all)");
  app.add_option("--per-group", per_group, "first N prompts of each (bytes, needles) group")->check(CLI::PositiveNumber);
  app.add_option("--variants", variants_arg, "comma-separated variants (passkey_harness.h parse_variant)")
      ->capture_default_str();
  app.add_option("--budgets", budgets_arg, "comma-separated token budgets: tokens (128) or fractions of the prompt (1/16)")
      ->capture_default_str();
  app.add_option("--max-new-tokens", ro.max_new_tokens, "greedy tokens per reply at most")->capture_default_str();
  // The pair's flags (pair/selection_flags.h): the selection is the base of the variants.
  pair::add_sparse_flags(app, ro.sparse, sparse_text, pair::kSelectionFlags | pair::kScheduleFlags);
  app.add_option("--heldout-docs", heldout_docs, "teacher-forced documents of held-out code (0 = skip)");
  app.add_option("--heldout-context", heldout_context, "teacher-forced: prefilled bytes per document")
      ->capture_default_str();
  app.add_option("--heldout-forced", heldout_forced, "teacher-forced: decode steps per document")->capture_default_str();
  app.add_option("--heldout-budget", heldout_budget, "teacher-forced: token budget (tokens or fraction of the context)")
      ->capture_default_str();
  app.add_option("--json-out", json_out, "write the results here (JSON)");
  app.add_option("--md-out", md_out, "write the tables here (Markdown)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  CLI11_PARSE(app, argc, argv);
  try {
    init_logging("passkey_fidelity", log_level);
    pair::resolve_sparse_flags(sparse_text, ro.sparse);
    const pair::SelectionConfig& base = ro.sparse.selection;
    if (prompts_path.empty()) prompts_path = data_dir() + "/prompts/passkey_public.jsonl";
    std::vector<Variant> variants;
    for (const auto& s : split(variants_arg)) variants.push_back(parse_variant(s, base));
    std::vector<Budget> budgets;
    for (const auto& s : split(budgets_arg)) budgets.push_back(parse_budget(s));
    std::set<int> want_bytes, want_needles, want_ids;
    for (const auto& s : split(ids_filter)) want_ids.insert(std::stoi(s));
    for (const auto& s : split(bytes_filter)) want_bytes.insert(std::stoi(s));
    for (const auto& s : split(needles_filter)) want_needles.insert(std::stoi(s));

    const auto t_load = std::chrono::steady_clock::now();
    const auto model = Model::load(model_dir);
    const Tokenizer tok = Tokenizer::from_dir(model_dir);
    const GenerationConfig gen = load_generation_config(model_dir, model->config());
    std::vector<PasskeyPrompt> prompts;
    std::map<std::pair<int, int>, int> group_count;
    for (auto& p : load_passkey_prompts(prompts_path)) {
      if (!want_bytes.empty() && !want_bytes.count(p.bytes)) continue;
      if (!want_needles.empty() && !want_needles.count(p.needles)) continue;
      if (!want_ids.empty() && !want_ids.count(p.id)) continue;
      if (group_count[{p.bytes, p.needles}]++ >= per_group) continue;
      prompts.push_back(std::move(p));
    }
    SPADE_CHECK(!prompts.empty(), "no prompt matches --bytes '{}' --needles '{}'", bytes_filter, needles_filter);
    fmt::print(stderr, "passkey_fidelity: {} prompts, {} variants, {} budgets, model {} ({:.1f} s to load)\n",
               prompts.size(), variants.size(), budgets.size(), model_dir,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());

    json runs = json::array();
    // acc[variant][budget][bytes] = {correct, total}
    std::map<std::string, std::map<std::string, std::map<int, std::pair<int, int>>>> acc;
    for (const PasskeyPrompt& p : prompts) {
      const auto t0 = std::chrono::steady_clock::now();
      const PrefilledPrompt pre(*model, chat_prompt_ids(tok, p.prompt), ro);
      std::string line = fmt::format("prompt {:2d} ({} B, {} needles, {} tokens):", p.id, p.bytes, p.needles,
                                     pre.num_tokens());
      for (const Variant& v : variants) {
        const bool dense = v.mode == SelectionMode::Dense;
        for (size_t bi = 0; bi < (dense ? size_t{1} : budgets.size()); ++bi) {
          const int budget = dense ? 0 : budgets[bi].resolve(pre.num_tokens());
          const std::string bname = dense ? "full" : budgets[bi].name();
          const Reply r = pre.decode(v, budget, gen.eos_token_ids, tok, p.expect);
          auto& a = acc[v.name][bname][p.bytes];
          a.first += r.correct;
          ++a.second;
          runs.push_back({{"prompt_id", p.id}, {"bytes", p.bytes}, {"needles", p.needles},
                          {"prompt_tokens", pre.num_tokens()}, {"variant", v.name}, {"budget", bname},
                          {"budget_tokens", budget}, {"correct", r.correct}, {"reply", r.text},
                          {"sparse_steps", r.sparse_steps}});
          line += fmt::format(" {}@{}={}", v.name, bname, r.correct ? "ok" : "MISS");
        }
      }
      fmt::print(stderr, "{} [{:.1f} s]\n", line,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }

    // Tables: accuracy per variant x budget, by prompt size and overall; ratio to the oracle at the same budget.
    std::set<int> sizes;
    for (const auto& p : prompts) sizes.insert(p.bytes);
    std::string md = fmt::format("### Pass-key accuracy, CPU (fp32), {} ({} prompts)\n\n", model_dir, prompts.size());
    md += "| variant | budget |";
    for (int b : sizes) md += fmt::format(" {} B |", b);
    md += " all | / oracle |\n|---|---|";
    for (size_t i = 0; i <= sizes.size() + 1; ++i) md += "---:|";
    md += "\n";
    json summary = json::array();
    for (const Variant& v : variants) {
      for (const auto& [bname, by_size] : acc[v.name]) {
        int c = 0, t = 0;
        md += fmt::format("| {} | {} |", v.name, bname);
        for (int b : sizes) {
          const auto it = by_size.find(b);
          if (it == by_size.end()) {
            md += " – |";
            continue;
          }
          md += fmt::format(" {}/{} |", it->second.first, it->second.second);
          c += it->second.first;
          t += it->second.second;
        }
        double ratio = -1;
        const auto o = acc.find("oracle");
        if (o != acc.end() && o->second.count(bname)) {
          int oc = 0;
          for (const auto& [b, ct] : o->second.at(bname)) oc += ct.first;
          if (oc > 0) ratio = static_cast<double>(c) / oc;
        }
        md += fmt::format(" {}/{} | {} |\n", c, t, ratio < 0 ? std::string("–") : fmt::format("{:.2f}", ratio));
        summary.push_back({{"variant", v.name}, {"budget", bname}, {"correct", c}, {"total", t},
                           {"vs_oracle", ratio < 0 ? json(nullptr) : json(ratio)}});
      }
    }

    json forced = json::array();
    if (heldout_docs > 0) {
      const int doc_len = heldout_context + heldout_forced;
      const auto flat = read_heldout_docs(data_dir() + "/prompts/heldout_code_py.txt", doc_len, heldout_docs);
      const Budget hb = parse_budget(heldout_budget);
      const int budget = hb.resolve(heldout_context);
      md += fmt::format("\n### Teacher-forced on held-out code: {} documents, {} bytes prefilled + {} forced, budget {} "
                        "({} tokens)\n\n| variant | bits/byte | Δ vs dense | top-1 = dense | overlap (mean) | churn "
                        "(mean) | overlap per layer (KV heads) |\n|---|---:|---:|---:|---:|---:|---|\n",
                        heldout_docs, heldout_context, heldout_forced, hb.name(), budget);
      std::vector<std::vector<int32_t>> dense_argmax(heldout_docs);
      double dense_bpb = 0;
      // Dense first: it fills the argmax the others are compared with.
      std::vector<const Variant*> order;
      for (const Variant& v : variants)
        if (v.mode == SelectionMode::Dense) order.insert(order.begin(), &v);
        else order.push_back(&v);
      SPADE_CHECK(!order.empty() && order.front()->mode == SelectionMode::Dense,
                  "teacher-forced metrics need the dense variant in --variants");
      for (const Variant* v : order) {
        ForcedStats all;
        for (int d = 0; d < heldout_docs; ++d) {
          const std::vector<int32_t> doc(flat.begin() + static_cast<long>(d) * doc_len,
                                         flat.begin() + static_cast<long>(d + 1) * doc_len);
          ForcedStats s = teacher_forced(*model, doc, heldout_context, heldout_forced, *v, budget, ro, dense_argmax[d]);
          all.nll_sum += s.nll_sum;
          all.tokens += s.tokens;
          all.top1_agree += s.top1_agree;
          if (all.heads.size() < s.heads.size()) all.heads.resize(s.heads.size());
          for (size_t l = 0; l < s.heads.size(); ++l) {
            if (all.heads[l].size() < s.heads[l].size()) all.heads[l].resize(s.heads[l].size());
            for (size_t h = 0; h < s.heads[l].size(); ++h) {
              all.heads[l][h].overlap_sum += s.heads[l][h].overlap_sum;
              all.heads[l][h].overlap_n += s.heads[l][h].overlap_n;
              all.heads[l][h].churn_sum += s.heads[l][h].churn_sum;
              all.heads[l][h].churn_n += s.heads[l][h].churn_n;
            }
          }
        }
        const double bpb = all.nll_sum / all.tokens / std::log(2.0);
        if (v->mode == SelectionMode::Dense) dense_bpb = bpb;
        double osum = 0, csum = 0;
        int64_t on = 0, cn = 0;
        std::string per_layer;
        json layers = json::array();
        for (size_t l = 0; l < all.heads.size(); ++l) {
          json heads = json::array();
          std::string cell;
          for (const auto& h : all.heads[l]) {
            osum += h.overlap_sum, on += h.overlap_n, csum += h.churn_sum, cn += h.churn_n;
            const double o = h.overlap_n ? h.overlap_sum / h.overlap_n : 0, c = h.churn_n ? h.churn_sum / h.churn_n : 0;
            heads.push_back({{"overlap", o}, {"churn", c}});
            cell += fmt::format("{}{:.2f}", cell.empty() ? "" : "/", o);
          }
          per_layer += fmt::format("{}L{} {}", per_layer.empty() ? "" : ", ", l, cell);
          layers.push_back(heads);
        }
        const bool has_sel = on > 0;
        md += fmt::format("| {} | {:.4f} | {:+.4f} | {:.1f} % | {} | {} | {} |\n", v->name, bpb, bpb - dense_bpb,
                          100.0 * all.top1_agree / all.tokens,
                          has_sel ? fmt::format("{:.3f}", osum / on) : "–",
                          cn > 0 ? fmt::format("{:.3f}", csum / cn) : "–", has_sel ? per_layer : "–");
        forced.push_back({{"variant", v->name}, {"bits_per_byte", bpb}, {"delta_vs_dense", bpb - dense_bpb},
                          {"top1_agreement", static_cast<double>(all.top1_agree) / all.tokens},
                          {"overlap_mean", has_sel ? json(osum / on) : json(nullptr)},
                          {"churn_mean", cn > 0 ? json(csum / cn) : json(nullptr)}, {"per_layer_head", layers}});
      }
    }
    std::fputs(md.c_str(), stdout);

    json variants_json = json::array();
    for (const Variant& v : variants)
      variants_json.push_back({{"name", v.name}, {"mode", selection_mode_name(v.mode)},
                               {"predictor", kernels::predictor_kind_name(v.selection.predictor)},
                               {"successor_expand", v.selection.successor_expand},
                               {"anchor_queries", v.selection.anchor_queries},
                               {"anchor_span", v.selection.anchor_span},
                               {"query_window", v.selection.query_window}, {"ridge_eps", v.selection.ridge_eps},
                               {"gqa_rule", v.selection.gqa_rule == kernels::GqaScoreRule::kMax ? "max" : "mean"},
                               {"sink_tokens", v.selection.sink_tokens}, {"local_window", v.selection.local_window}});
    json out = {{"tool", "passkey_fidelity"},
                {"path", "cpu-fp32"},
                      {"model", model_dir},
                      {"prompts", prompts_path},
                      {"sparse_threshold", ro.sparse.sparse_threshold},
                      {"layers_per_pack", ro.sparse.layers_per_pack},
                      {"max_new_tokens", ro.max_new_tokens},
                      {"variants", variants_json},
                      {"summary", summary},
                      {"teacher_forced", forced},
                      {"runs", runs}};
    bench::stamp_run(out);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    out["device"] = fmt::format("CPU, {} threads, host {}", sysconf(_SC_NPROCESSORS_ONLN), host);
    if (!json_out.empty()) {
      std::ofstream f(json_out);
      SPADE_CHECK(f.good(), "cannot write {}", json_out);
      f << out.dump(1) << "\n";
    }
    if (!md_out.empty()) {
      std::ofstream f(md_out);
      SPADE_CHECK(f.good(), "cannot write {}", md_out);
      f << md;
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "passkey_fidelity: error: {}\n", e.what());
    return 2;
  }
}
