#include "pair/selection_flags.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace spade::pair {

void add_sparse_flags(CLI::App& app, SparseConfig& c, SparseFlagText& text, unsigned groups) {
  SelectionConfig& sc = c.selection;
  // An integer flag that must be > 0 (or >= 0).
  const auto counted = [&app](const char* name, int& value, const char* help, bool zero_ok = false) {
    app.add_option(name, value, help)
        ->check(zero_ok ? CLI::Validator(CLI::NonNegativeNumber) : CLI::Validator(CLI::PositiveNumber))
        ->capture_default_str();
  };
  if ((groups & kSelectionFlags) != 0) {
    counted("--token-budget", sc.token_budget, "selected tokens per layer and KV head");
    counted("--local-window", sc.local_window, "most recent tokens the inference rank attends from its own KV");
    counted("--sink-tokens", sc.sink_tokens, "first tokens the inference rank attends from its own KV", true);
    app.add_option("--query-window", sc.query_window, "W: queries the predictor regresses on (1..32)")
        ->capture_default_str();
    app.add_option("--ridge-eps", sc.ridge_eps,
                   "ridge regularisation: relative to the queries' mean squared norm (ridge), absolute (paper)")
        ->capture_default_str();
    app.add_option("--gqa-rule", text.gqa_rule, "how a KV head combines its query heads' scores: max | mean")
        ->capture_default_str();
    app.add_option("--predictor", text.predictor,
                   "next-query predictor: ridge (ridge regression, relative eps) | paper (AsyncSpade Algorithm 1: "
                   "softmax over the ridge coefficients) | last (the current query, no prediction)")
        ->capture_default_str();
    app.add_option("--successor-expand", sc.successor_expand,
                   "a token ranks by the higher of its own and its predecessor's score (a selected token brings the "
                   "next one)")
        ->capture_default_str();
    app.add_option("--anchor-queries", sc.anchor_queries,
                   "prompt anchors: the prompt's last N queries (0..64, shipped at the switch) pick per KV head the "
                   "tokens they attended most; each predicted selection keeps [anchor, anchor + span) of them within a "
                   "quarter of its budget (a retrieval head can fire at a step no earlier query predicts). 0 = off")
        ->capture_default_str();
    counted("--anchor-span", sc.anchor_span, "prompt anchors: tokens kept from each anchor on");
  }
  if ((groups & kScheduleFlags) != 0) {
    counted("--sparse-threshold", c.sparse_threshold, "context length at which decoding turns sparse");
    counted("--layers-per-pack", c.layers_per_pack, "layers per pack message");
  }
  if ((groups & kDeltaCapacityFlag) != 0) {
    counted("--delta-capacity", c.delta_capacity,
            "--device cuda: selection entries a steady step may change per (layer, KV head); a token that enters "
            "beyond it is sent at a later step. 0 = half the token budget (rounded up), where the measured churn puts "
            "a lossless delta; >= the budget: the budget, lossless by construction. Smaller values send fewer bytes "
            "and cost answers (docs/FIDELITY.md, \"Delta capacity at the measured churn\")",
            true);
  }
  text.score_keys = kernels::score_keys_name(sc.score_keys);
  if ((groups & kScoreKeysFlag) != 0) {
    app.add_option("--score-keys", text.score_keys,
                   "GPU cache rank: the keys its scoring reads: bf16 (the cache's) | int8 (a compact copy with one "
                   "scale per token and KV head, written on append: about half the bytes read per step, 26 % more "
                   "memory per page at head_dim 128). The K/V sent stays bf16 and exact")
        ->capture_default_str();
  }
  if ((groups & kOverlapSampleFlag) != 0) {
    counted("--overlap-sample-every", c.overlap_sample_every,
            "cache rank: every N steps, measure the predicted selection against the true query's top-k (the overlap "
            "ratio, AsyncSpade Eq. 1) and the selection churn (0 = off; one extra scoring pass per sampled step)",
            true);
  }
  if ((groups & kDeltaTransferFlag) != 0) {
    app.add_option("--delta-transfer", c.delta_transfer,
                   "send only the tokens that entered each selection, with the slot they replace (pair/delta.h)")
        ->capture_default_str();
  }
}

void resolve_sparse_flags(const SparseFlagText& text, SparseConfig& c) {
  SelectionConfig& sc = c.selection;
  if (text.gqa_rule == "max") {
    sc.gqa_rule = kernels::GqaScoreRule::kMax;
  } else if (text.gqa_rule == "mean") {
    sc.gqa_rule = kernels::GqaScoreRule::kMean;
  } else {
    fail("--gqa-rule must be max or mean, got '{}'", text.gqa_rule);
  }
  if (text.predictor == "ridge" || text.predictor == "paper" || text.predictor == "last") {
    sc.predictor = kernels::parse_predictor_kind(text.predictor.c_str());
  } else {
    fail("--predictor must be ridge, paper or last, got '{}'", text.predictor);
  }
  if (text.score_keys.empty()) {  // not registered: the config's value stands
  } else if (text.score_keys == "bf16" || text.score_keys == "int8") {
    sc.score_keys = kernels::parse_score_keys(text.score_keys.c_str());
  } else {
    fail("--score-keys must be bf16 or int8, got '{}'", text.score_keys);
  }
  validate(c);
}

void FlagRefusals::refuse(std::string_view mode, std::initializer_list<std::string_view> flags, std::string_view why) {
  for (std::string_view f : flags) {
    const CLI::Option* o = app_.get_option_no_throw(std::string(f));
    SPADE_CHECK(o != nullptr, "FlagRefusals: {} is not a flag of {}", f, app_.get_name());
    if (o->count() == 0 || std::find(flags_.begin(), flags_.end(), f) != flags_.end()) continue;
    flags_.emplace_back(f);
    lines_.push_back(fmt::format("{} does not apply to {} ({})", f, mode, why));
  }
}

void FlagRefusals::refuse_if(bool refused, std::string message) {
  if (refused) lines_.push_back(std::move(message));
}

void FlagRefusals::check() const {
  if (lines_.empty()) return;
  std::string msg = lines_[0];
  for (size_t i = 1; i < lines_.size(); ++i) msg += "\n" + lines_[i];
  fail("{}", msg);
}

}  // namespace spade::pair
