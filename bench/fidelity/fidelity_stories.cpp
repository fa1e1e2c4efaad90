// stories260K (the real trained TinyStories model): the overlap probe, greedy agreement of sparse decoding
// (growing and fixed budget, predicted and oracle), the plumbing check and teacher-forced next-token
// agreement.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "bench/fidelity/fidelity_report.h"
#include "common/error.h"
#include "common/sampling.h"
#include "common/tokenizer.h"

namespace spade::fidelity::report {

namespace {

// Story openings (TinyStories style): the first is the opening of
// models/stories260K/expected_greedy_200tok.txt; the other eight were written for this report (simple words,
// a named child or animal, a small event).
const std::vector<std::string> kStoryPrompts = {
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.",
    "One day, a little boy named Tim went to the beach with his mom. He saw a big crab on the sand.",
    "Once upon a time, there was a small dog named Max. Max liked to run and jump in the green grass.",
    "Sue had a red ball. She liked to throw it high in the sky. One day, the ball went over the fence.",
    "There was a big tree in the forest. A little bird lived in the tree with her mom.",
    "Tom and his friend Sam wanted to build a tall tower with blocks. They worked hard all morning.",
    "Once upon a time, in a small house, there lived a kind old man. He had a cat named Tom.",
    "Lucy was very happy because it was her birthday. Her mom made a big cake with pink flowers.",
    "One sunny day, Ben found a shiny rock near the river. He wanted to show it to his sister.",
};

/// Greedy agreement of one (budget, policy, mode) over the prompts.
struct AgreeAcc {
  std::string policy, mode;
  double frac;
  std::vector<Agreement> per_prompt;
  Mean selected;
};

/// Teacher-forced agreement of one (variant, selection) over the prompts.
struct TfAcc {
  Variant v;
  SelectBy by;
  Mean top1, kl, recall, out_error;
  std::vector<Mean> top1_per_prompt;
};

void print_head(const char* title, const char* columns) {
  fmt::print("\n[stories260K] {}\n{}\n", title, columns);
}

json agreement_table(const std::vector<AgreeAcc>& agree) {
  print_head("greedy agreement with dense decoding over the tokens of sparse steps (mean over prompts)",
             "budget policy   mode       sel.tokens  sparse tokens  prefix-agree  overall-agree  identical");
  json out = json::array();
  for (const auto& a : agree) {
    Mean prefix, overall;
    int identical = 0, tokens = 0;
    json per = json::array();
    for (const auto& g : a.per_prompt) {
      const double pf = g.sparse_tokens ? static_cast<double>(g.prefix) / g.sparse_tokens : kNaN;
      const double ov = g.sparse_tokens ? static_cast<double>(g.matches) / g.sparse_tokens : kNaN;
      prefix.add(pf);
      overall.add(ov);
      identical += g.prefix == g.sparse_tokens;
      tokens += g.sparse_tokens;
      per.push_back({{"first_sparse_token", g.first_sparse},
                     {"sparse_tokens", g.sparse_tokens},
                     {"tokens_before_first_difference", g.prefix},
                     {"matching_tokens", g.matches}});
    }
    fmt::print("{:<6} {:<8} {:<10} {:>10.1f}  {:>13}  {:>12.3f}  {:>13.3f}  {:>5}/{}\n", frac_name(a.frac),
               a.policy, a.mode, a.selected.get(), tokens, prefix.get(), overall.get(), identical,
               a.per_prompt.size());
    out.push_back({{"budget_fraction", a.frac},
                   {"policy", a.policy},
                   {"mode", a.mode},
                   {"backend", a.policy == "fixed" ? "SparseAttention" : "GrowingBudgetSparse (this tool)"},
                   {"mean_selected_tokens_per_kv_head", num(a.selected.get())},
                   {"prefix_agreement", num(prefix.get())},
                   {"overall_agreement", num(overall.get())},
                   {"identical_prompts", identical},
                   {"per_prompt", per}});
  }
  return out;
}

json teacher_forced_table(const std::vector<TfAcc>& tf) {
  print_head(
      "teacher-forced next-token agreement over the sparse steps (each step fed the dense prefix; growing "
      "budget; "
      "mean over steps and prompts)",
      "budget GQA   selection    top-1 = dense   KL(dense||sparse) nats   mass recall   attn-out rel.err");
  json out = json::array();
  for (const auto& a : tf) {
    fmt::print("{:<6} {:<5} {:<11}  {:>13.3f}   {:>22.4f}   {:>11.3f}   {:>16.4f}\n", frac_name(a.v.frac),
               rule_name(a.v.rule), select_by_name(a.by), a.top1.get(), a.kl.get(), a.recall.get(),
               a.out_error.get());
    json per = json::array();
    for (const auto& m : a.top1_per_prompt) per.push_back(num(m.get()));
    out.push_back({{"budget_fraction", a.v.frac},
                   {"gqa_rule", rule_name(a.v.rule)},
                   {"selection", select_by_name(a.by)},
                   {"steps", a.top1.n},
                   {"top1_agreement", num(a.top1.get())},
                   {"mean_kl_nats", num(a.kl.get())},
                   {"mass_recall_in_run", num(a.recall.get())},
                   {"attention_output_rel_error", num(a.out_error.get())},
                   {"top1_agreement_per_prompt", per}});
  }
  return out;
}

}  // namespace

bool run_stories(const Options& o) {
  const auto t0 = Clock::now();
  const std::string dir = o.data_dir + "/models/stories260K";
  auto model = Model::load(dir);
  const ModelConfig& cfg = model->config();
  const Tokenizer tok = Tokenizer::from_dir(dir);
  const int max_len = cfg.max_position_embeddings;
  const std::vector<Variant> vars = make_variants(o);
  std::vector<VariantStats> stats(vars.size());
  const int P = std::min<int>(o.stories_prompts, static_cast<int>(kStoryPrompts.size()));
  for (auto& s : stats) s.init(cfg.num_layers, P);
  Checks checks;

  std::vector<AgreeAcc> agree;
  for (double f : o.budgets)
    for (const char* policy : {"growing", "fixed"})
      for (const char* mode : {"predicted", "oracle"}) agree.push_back({policy, mode, f, {}, {}});
  std::vector<TfAcc> tf;
  for (const Variant& v : vars) {
    if (v.group != "main" && v.group != "gqa") continue;
    for (SelectBy by : {SelectBy::Predicted, SelectBy::LastQuery, SelectBy::TrueQuery})
      tf.push_back({v, by, {}, {}, {}, {}, std::vector<Mean>(P)});
  }

  json prompts = json::array();
  double probe_s = 0, decode_s = 0, tf_s = 0;
  for (int p = 0; p < P; ++p) {
    const std::vector<int32_t> ids = tok.encode(kStoryPrompts[p], true);
    const int N = o.stories_max_tokens;
    const int prompt_len = static_cast<int>(ids.size());
    SPADE_CHECK(prompt_len + N <= max_len,
                "stories260K: prompt {} ({} tokens) + {} tokens exceeds {} positions", p, prompt_len, N,
                max_len);
    const int last_context = prompt_len + N - 1;
    auto t = Clock::now();
    const auto dense = generate(*model, ids, N, max_len, nullptr);
    std::vector<int32_t> probe_ids =
        generate(*model, ids, N, max_len, [&](const ModelConfig& c, KvCache& kv) {
          return std::make_unique<ProbeBackend>(c, kv, vars, stats, o.threshold, last_context, p);
        });
    probe_s += seconds_since(t);
    checks.add(fmt::format("prompt {}: probe decodes like the engine's dense path", p), probe_ids == dense,
               probe_ids == dense ? "identical tokens" : "tokens differ");
    prompts.push_back({{"text", kStoryPrompts[p]},
                       {"prompt_tokens", prompt_len},
                       {"generated_tokens", N},
                       {"dense_text", tok.decode(dense, true)}});

    t = Clock::now();
    const Variant& main_v = vars.front();
    for (auto& a : agree) {
      Variant v = main_v;
      v.frac = a.frac;
      const int K = fixed_budget(v, last_context);
      const SelectionMode mode = parse_selection_mode(a.mode);
      // GrowingBudgetSparse with a per-step budget (growing) or the fixed K (the check against
      // SparseAttention).
      auto growing_run = [&](int fixed_k, uint64_t* steps, Mean* selected) {
        return generate(
            *model, ids, N, max_len,
            [&](const ModelConfig& c, KvCache& kv) {
              return std::make_unique<GrowingBudgetSparse>(c, kv, select_by(mode), v, o.threshold,
                                                           o.layers_per_pack, fixed_k, last_context);
            },
            [&](AttentionBackend& be) {
              auto& g = dynamic_cast<GrowingBudgetSparse&>(be);
              *steps = g.sparse_seq_steps();
              if (selected) *selected = g.selected_tokens();
            });
      };
      uint64_t sparse_steps = 0;
      Mean sel_tokens;
      std::vector<int32_t> out;
      if (a.policy == "growing") {
        out = growing_run(0, &sparse_steps, &sel_tokens);
      } else {
        out = generate_sparse(*model, ids, N, max_len, mode, o.threshold, o.layers_per_pack,
                              selection_config(v, K), &sparse_steps);
        uint64_t mine_steps = 0;
        const auto mine = growing_run(K, &mine_steps, nullptr);
        checks.add(
            fmt::format("prompt {}: GrowingBudgetSparse({}, fixed K={}) == SparseAttention", p, a.mode, K),
            mine == out && mine_steps == sparse_steps,
            fmt::format("{} sparse steps each; tokens {}", sparse_steps,
                        mine == out ? "identical" : "differ"));
        sel_tokens.add(K);
      }
      const Agreement ag = agreement(dense, out, prompt_len, o.threshold);
      checks.add(fmt::format("prompt {}: {} {} {} decodes sparsely", p, a.policy, a.mode, frac_name(a.frac)),
                 sparse_steps > 0 && ag.pre_sparse_equal,
                 fmt::format("{} sparse steps; tokens before the first sparse step {}", sparse_steps,
                             ag.pre_sparse_equal ? "equal dense" : "DIFFER from dense"));
      a.per_prompt.push_back(ag);
      a.selected.add(sel_tokens.get());
    }
    // Plumbing: a budget >= the context reproduces dense greedy decoding exactly.
    for (SelectionMode mode : {SelectionMode::Predicted, SelectionMode::Oracle}) {
      uint64_t steps = 0;
      const auto out = generate_sparse(*model, ids, N, max_len, mode, o.threshold, o.layers_per_pack,
                                       selection_config(main_v, max_len), &steps);
      checks.add(
          fmt::format("prompt {}: plumbing, SparseAttention {} with budget {} >= context reproduces dense", p,
                      selection_mode_name(mode), max_len),
          out == dense && steps > 0,
          fmt::format("{} sparse steps; tokens {}", steps, out == dense ? "identical" : "differ"));
    }
    decode_s += seconds_since(t);
    // Teacher forcing: every step is fed the dense prefix, so a difference does not compound into the next
    // steps.
    t = Clock::now();
    const int V = cfg.vocab_size;
    const auto dense_tf =
        teacher_forced(*model, ids, dense, [&](KvCache& kv) -> std::unique_ptr<AttentionBackend> {
          return std::make_unique<DensePagedAttention>(cfg, kv);
        });
    int tf_equal = 0;
    for (int i = 0; i < N; ++i) tf_equal += argmax(&dense_tf[static_cast<size_t>(i) * V], V) == dense[i];
    checks.add(fmt::format("prompt {}: teacher-forced dense argmax == dense greedy tokens", p), tf_equal == N,
               fmt::format("{} of {} equal", tf_equal, N));
    const int first_sparse = agreement(dense, dense, prompt_len, o.threshold).first_sparse;
    for (auto& a : tf) {
      const auto lg = teacher_forced(
          *model, ids, dense,
          [&](KvCache& kv) -> std::unique_ptr<AttentionBackend> {
            auto be = std::make_unique<GrowingBudgetSparse>(cfg, kv, a.by, a.v, o.threshold,
                                                            o.layers_per_pack, 0, last_context);
            be->enable_diagnostics();
            return be;
          },
          [&](AttentionBackend& be) {
            const auto& g = dynamic_cast<const GrowingBudgetSparse&>(be);
            a.recall.add(g.mass_recall_in_run());
            a.out_error.add(g.attention_output_error());
          });
      for (int i = first_sparse; i < N; ++i) {
        const size_t off = static_cast<size_t>(i) * V;
        const bool eq = argmax(&lg[off], V) == dense[i];
        a.top1.add(eq);
        a.top1_per_prompt[p].add(eq);
        a.kl.add(kl_divergence(&dense_tf[off], &lg[off], V));
      }
    }
    tf_s += seconds_since(t);
    fmt::print(stderr, "[stories260K] prompt {}/{} done ({} prompt tokens, {:.1f} s so far)\n", p + 1, P,
               prompt_len, seconds_since(t0));
  }
  add_probe_checks(checks, vars, stats);

  // Report.
  fmt::print(
      "\n==== stories260K (real trained model): {} prompts, {} generated tokens each, sparse threshold {} "
      "====\n",
      P, o.stories_max_tokens, o.threshold);
  print_overlaps("stories260K", vars, stats, cfg.num_layers, cfg.num_kv_heads);
  const json agree_json = agreement_table(agree);
  const json tf_json = teacher_forced_table(tf);
  const double total_s = seconds_since(t0);
  fmt::print(
      "[stories260K] checks: {} ({} run); {:.1f} s (probe {:.1f} s, sparse decoding {:.1f} s, teacher-forced "
      "{:.1f} s)\n",
      checks.ok ? "all passed" : "FAILED", checks.items.size(), total_s, probe_s, decode_s, tf_s);

  json j = common_header(o, "stories260K");
  j["model_info"] = model_shape_json(cfg);
  j["model_info"].update({{"dir", dir},
                          {"kind", "real trained model (Karpathy tinyllamas stories260K, HF layout)"},
                          {"max_positions", cfg.max_position_embeddings}});
  j["parameters"]["generated_tokens"] = o.stories_max_tokens;
  j["prompts"] = prompts;
  j["agreement"] = agree_json;
  j["teacher_forced"] = tf_json;
  finish_report(o, "stories260K", vars, stats, checks, total_s, j);
  return checks.ok;
}

}  // namespace spade::fidelity::report
