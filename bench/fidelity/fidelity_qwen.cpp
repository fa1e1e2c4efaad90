// qwen3-synthetic: a Qwen3-shaped model with deterministic random weights on real prompts (AIME24, MATH500,
// GSM8K few-shot contexts, ShareGPT first turns; the Qwen2 tokenizer): the overlap probe and the plumbing
// check.
#include <fmt/format.h>

#include <cmath>
#include <map>
#include <sstream>

#include "bench/fidelity/fidelity_report.h"
#include "common/error.h"
#include "common/tokenizer.h"

namespace spade::fidelity::report {

namespace {

struct PromptSpec {
  std::string source;  // dataset file
  int target = 0;      // context tokens
  int first_row = 0;
};

using TextRows = std::vector<std::pair<std::string, std::string>>;

/// (problem, solution) pairs of a math jsonl file, or ShareGPT first turns (solution empty).
TextRows load_texts(const std::string& path) {
  TextRows rows;
  const std::string text = read_text(path);
  auto str = [&](const json& j, const char* field, int row) {
    if (!j.contains(field) || !j[field].is_string())
      fail("{}: row {}: field '{}' missing or not a string", path, row, field);
    return j[field].get<std::string>();
  };
  if (path.size() > 5 && path.substr(path.size() - 5) == ".json") {
    json arr;
    try {
      arr = json::parse(text);
    } catch (const json::exception& e) {
      fail("{}: invalid JSON: {}", path, e.what());
    }
    int i = 0;
    for (const auto& e : arr) {
      if (!e.contains("conversations") || !e["conversations"].is_array() || e["conversations"].empty())
        fail("{}: row {}: field 'conversations' missing or empty", path, i);
      rows.emplace_back(str(e["conversations"][0], "value", i), "");
      ++i;
    }
    return rows;
  }
  std::istringstream in(text);
  int i = 0;
  for (std::string line; std::getline(in, line); ++i) {
    if (line.empty()) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      fail("{}: line {}: invalid JSON: {}", path, i + 1, e.what());
    }
    if (j.contains("question")) {
      rows.emplace_back(str(j, "question", i), str(j, "answer", i));  // GSM8K
    } else {
      rows.emplace_back(str(j, "problem", i), str(j, "solution", i));  // AIME24, MATH500
    }
  }
  return rows;
}

/// A context of exactly spec.target tokens of real text: math sets as a few-shot prompt ("Problem:
/// ...\nSolution:
/// ...\n\n" shots ending with "Problem: <next>\nSolution:", the last target tokens kept); ShareGPT as the
/// first first-turn message (from spec.first_row on) with at least target tokens, its first target tokens
/// kept.
std::vector<int32_t> build_prompt(const Tokenizer& tok, const TextRows& rows, const PromptSpec& spec,
                                  std::string* description) {
  const bool chat = rows.empty() || rows[0].second.empty();
  if (chat) {
    for (size_t i = spec.first_row; i < rows.size(); ++i) {
      auto ids = tok.encode(rows[i].first, false);
      if (static_cast<int>(ids.size()) >= spec.target) {
        ids.resize(spec.target);
        *description = fmt::format("{} row {} (first turn, first {} tokens)", spec.source, i, spec.target);
        return ids;
      }
    }
    fail("{}: no first turn from row {} has {} tokens", spec.source, spec.first_row, spec.target);
  }
  std::string shots;
  for (size_t i = spec.first_row; i + 1 < rows.size(); ++i) {
    shots += "Problem: " + rows[i].first + "\nSolution: " + rows[i].second + "\n\n";
    auto ids = tok.encode(shots + "Problem: " + rows[i + 1].first + "\nSolution:", false);
    if (static_cast<int>(ids.size()) >= spec.target) {
      ids.erase(ids.begin(), ids.end() - spec.target);
      *description = fmt::format("{} rows {}..{} as a few-shot prompt (last {} tokens)", spec.source,
                                 spec.first_row, i + 1, spec.target);
      return ids;
    }
  }
  fail("{}: not enough rows for a {}-token few-shot prompt", spec.source, spec.target);
}

/// qwen3-0.6b's config.json with the synthetic shape of the options.
ModelConfig synthetic_config(const Options& o, const std::string& cfg_path) {
  json cj;
  try {
    cj = json::parse(read_text(cfg_path));
  } catch (const json::exception& e) {
    fail("{}: invalid JSON: {}", cfg_path, e.what());
  }
  cj["hidden_size"] = o.qwen_hidden;
  cj["intermediate_size"] = o.qwen_intermediate;
  cj["num_hidden_layers"] = o.qwen_layers;
  cj["max_window_layers"] = o.qwen_layers;
  cj["num_attention_heads"] = o.qwen_heads;
  cj["num_key_value_heads"] = o.qwen_kv_heads;
  cj["head_dim"] = o.qwen_head_dim;
  return parse_model_config(cj.dump(), cfg_path + " (with fidelity_report overrides)");
}

}  // namespace

bool run_qwen(const Options& o) {
  const auto t0 = Clock::now();
  const std::string cfg_path = o.data_dir + "/configs/qwen3-0.6b/config.json";
  auto model = Model::random(synthetic_config(o, cfg_path), o.qwen_seed);
  const ModelConfig& cfg = model->config();
  const Tokenizer tok = Tokenizer::from_dir(o.data_dir + "/tokenizers/qwen2");
  const int max_len = 2048;

  std::vector<PromptSpec> specs = {{"aime24.jsonl", 448, 0},
                                   {"aime24.jsonl", 896, 10},
                                   {"math500.jsonl", 256, 0},
                                   {"math500.jsonl", 640, 20},
                                   {"gsm8k_test.jsonl", 384, 0},
                                   {"gsm8k_test.jsonl", 960, 40},
                                   {"sharegpt_v3_first_turn_1000.json", 320, 0},
                                   {"sharegpt_sg90k_first_turn_2978_sorted.json", 768, 50}};
  if (o.quick) specs = {{"aime24.jsonl", 256, 0}, {"sharegpt_v3_first_turn_1000.json", 320, 0}};
  std::map<std::string, TextRows> texts;
  const std::vector<Variant> vars = make_variants(o);
  std::vector<VariantStats> stats(vars.size());
  for (auto& s : stats) s.init(cfg.num_layers, static_cast<int>(specs.size()));
  Checks checks;
  json prompts = json::array();
  const int N = o.qwen_max_tokens;
  for (size_t p = 0; p < specs.size(); ++p) {
    const PromptSpec& spec = specs[p];
    if (!texts.count(spec.source)) texts[spec.source] = load_texts(o.data_dir + "/prompts/" + spec.source);
    std::string desc;
    const std::vector<int32_t> ids = build_prompt(tok, texts[spec.source], spec, &desc);
    const int prompt_len = static_cast<int>(ids.size());
    const int last_context = prompt_len + N - 1;
    const auto dense = generate(*model, ids, N, max_len, nullptr);
    const auto probe_ids = generate(*model, ids, N, max_len, [&](const ModelConfig& c, KvCache& kv) {
      return std::make_unique<ProbeBackend>(c, kv, vars, stats, o.threshold, last_context,
                                            static_cast<int>(p));
    });
    checks.add(fmt::format("prompt {}: probe decodes like the engine's dense path", p), probe_ids == dense,
               probe_ids == dense ? "identical tokens" : "tokens differ");
    prompts.push_back({{"source", desc}, {"prompt_tokens", prompt_len}, {"generated_tokens", N}});
    if (static_cast<int>(p) < o.qwen_plumbing_prompts) {
      const int M = o.qwen_plumbing_tokens;
      const std::vector<int32_t> dense_m(dense.begin(), dense.begin() + std::min(M, N));
      for (SelectionMode mode : {SelectionMode::Predicted, SelectionMode::Oracle}) {
        uint64_t steps = 0;
        const auto out = generate_sparse(*model, ids, static_cast<int>(dense_m.size()), max_len, mode,
                                         std::min(o.threshold, prompt_len), o.layers_per_pack,
                                         selection_config(vars.front(), max_len), &steps);
        checks.add(
            fmt::format("prompt {}: plumbing, SparseAttention {} with budget {} >= context reproduces dense",
                        p, selection_mode_name(mode), max_len),
            out == dense_m && steps > 0,
            fmt::format("{} tokens, {} sparse steps; tokens {}", dense_m.size(), steps,
                        out == dense_m ? "identical" : "differ"));
      }
    }
    fmt::print(stderr, "[qwen3-synthetic] prompt {}/{} done ({} prompt tokens, {:.1f} s so far)\n", p + 1,
               specs.size(), prompt_len, seconds_since(t0));
  }
  add_probe_checks(checks, vars, stats);
  fmt::print(
      "\n==== qwen3-synthetic (Qwen3 shape, RANDOM weights, real prompts): {} prompts, {} generated tokens "
      "each "
      "====\n",
      specs.size(), N);
  fmt::print(
      "hidden {}, {} layers, {} q / {} kv heads, head_dim {}, vocab {}. Random weights: overlaps show the "
      "pipeline at these shapes, not fidelity; greedy agreement is not meaningful and not measured.\n",
      cfg.hidden_size, cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size);
  print_overlaps("qwen3-synthetic", vars, stats, cfg.num_layers, cfg.num_kv_heads);
  const double total_s = seconds_since(t0);
  fmt::print("[qwen3-synthetic] checks: {} ({} run); {:.1f} s\n", checks.ok ? "all passed" : "FAILED",
             checks.items.size(), total_s);

  json j = common_header(o, "qwen3-synthetic");
  j["model_info"] = model_shape_json(cfg);
  j["model_info"].update({{"config", cfg_path},
                          {"kind", "Qwen3 shape with deterministic random weights (spade::Model::random)"},
                          {"seed", o.qwen_seed},
                          {"hidden_size", cfg.hidden_size},
                          {"intermediate_size", cfg.intermediate_size},
                          {"vocab_size", cfg.vocab_size},
                          {"qk_norm", cfg.qk_norm},
                          {"tokenizer", o.data_dir + "/tokenizers/qwen2"}});
  j["parameters"]["generated_tokens"] = N;
  j["prompts"] = prompts;
  j["agreement"] = nullptr;
  j["agreement_note"] = "random weights: greedy tokens carry no meaning, agreement is not measured";
  finish_report(o, "qwen3-synthetic", vars, stats, checks, total_s, j);
  return checks.ok;
}

}  // namespace spade::fidelity::report
