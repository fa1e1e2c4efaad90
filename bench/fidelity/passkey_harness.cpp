#include "bench/fidelity/passkey_harness.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "pair/link.h"
#include "common/chat_template.h"
#include "common/error.h"

namespace spade::fidelity {

namespace {

// Prompt tokens each variant prefills itself (>= the largest window W + 1 = 33 and the prompt anchors' queries).
constexpr int kTail = pair::kMaxAnchorQueries + 8;
constexpr int kPrefillChunk = 2048;  // the engine's default max_num_batched_tokens

int argmax(const float* x, int n) { return static_cast<int>(std::max_element(x, x + n) - x); }

double log_softmax_at(const float* x, int n, int i) {
  const float mx = *std::max_element(x, x + n);
  double z = 0;
  for (int j = 0; j < n; ++j) z += std::exp(static_cast<double>(x[j]) - mx);
  return static_cast<double>(x[i]) - mx - std::log(z);
}

}  // namespace

std::vector<PasskeyPrompt> load_passkey_prompts(const std::string& path) {
  std::ifstream in(path);
  SPADE_CHECK(in.good(), "cannot open pass-key prompts {}", path);
  std::vector<PasskeyPrompt> out;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty()) continue;
    try {
      const auto j = nlohmann::json::parse(line);
      PasskeyPrompt p;
      p.id = j.value("id", static_cast<int>(out.size()));
      p.prompt = j.at("prompt").get<std::string>();
      p.expect = j.at("expect").get<std::string>();
      p.label = j.value("label", std::string());
      p.bytes = j.value("bytes", 0);
      p.needles = j.value("needles", 0);
      SPADE_CHECK(!p.expect.empty(), "empty 'expect'");
      out.push_back(std::move(p));
    } catch (const std::exception& e) {
      fail("{}:{}: malformed pass-key line: {}", path, lineno, e.what());
    }
  }
  SPADE_CHECK(!out.empty(), "{}: no pass-key prompts", path);
  return out;
}

Variant parse_variant(const std::string& spec, const pair::SelectionConfig& base) {
  Variant v;
  v.selection = base;
  const auto eq = spec.find('=');
  v.name = spec.substr(0, eq);
  std::string mode = eq == std::string::npos ? v.name : "";
  std::vector<std::string> kv;
  if (eq != std::string::npos) {
    std::stringstream ss(spec.substr(eq + 1));
    std::string item;
    bool first = true;
    while (std::getline(ss, item, ':')) {
      if (first) mode = item;
      else kv.push_back(item);
      first = false;
    }
  }
  if (mode == "dense") {
    v.mode = SelectionMode::Dense;
  } else if (mode == "oracle" || mode == "quest") {
    v.mode = mode == "oracle" ? SelectionMode::Oracle : SelectionMode::Quest;
    v.selection.successor_expand = false;
  } else if (mode == "predicted") {
    v.mode = SelectionMode::Predicted;
  } else if (mode == "paper") {
    v.mode = SelectionMode::Predicted;
    v.selection.predictor = kernels::PredictorKind::kPaper;
    v.selection.ridge_eps = 1e-3f;
    v.selection.successor_expand = false;
    v.selection.anchor_queries = 0;
  } else if (mode == "last") {
    v.mode = SelectionMode::Predicted;
    v.selection.predictor = kernels::PredictorKind::kLastQuery;
    v.selection.successor_expand = false;
    v.selection.anchor_queries = 0;
  } else {
    fail("variant '{}': unknown mode '{}' (dense | oracle | quest | predicted | paper | last)", spec, mode);
  }
  for (const std::string& item : kv) {
    const auto e = item.find('=');
    SPADE_CHECK(e != std::string::npos, "variant '{}': '{}' is not key=value", spec, item);
    const std::string key = item.substr(0, e), val = item.substr(e + 1);
    try {
      if (key == "predictor") {
        v.selection.predictor = kernels::parse_predictor_kind(val.c_str());
      } else if (key == "successor") {
        v.selection.successor_expand = val == "1" || val == "true";
      } else if (key == "window") {
        v.selection.query_window = std::stoi(val);
      } else if (key == "eps") {
        v.selection.ridge_eps = std::stof(val);
      } else if (key == "gqa") {
        SPADE_CHECK(val == "max" || val == "mean", "gqa must be max or mean");
        v.selection.gqa_rule = val == "max" ? kernels::GqaScoreRule::kMax : kernels::GqaScoreRule::kMean;
      } else if (key == "sinks") {
        v.selection.sink_tokens = std::stoi(val);
      } else if (key == "local") {
        v.selection.local_window = std::stoi(val);
      } else if (key == "anchors") {
        v.selection.anchor_queries = std::stoi(val);
      } else if (key == "span") {
        v.selection.anchor_span = std::stoi(val);
      } else {
        fail("unknown key");
      }
    } catch (const std::exception& ex) {
      fail("variant '{}': bad '{}': {} (keys: predictor, successor, window, eps, gqa, sinks, local, anchors, span)", spec, item,
           ex.what());
    }
  }
  pair::validate(v.selection);
  return v;
}

std::string Budget::name() const {
  if (tokens > 0) return std::to_string(tokens);
  const double inv = 1.0 / fraction;
  if (std::abs(inv - std::round(inv)) < 1e-9) return fmt::format("1/{}", static_cast<int>(std::round(inv)));
  return fmt::format("{:g}", fraction);
}

int Budget::resolve(int prompt_tokens) const {
  if (tokens > 0) return tokens;
  return std::max(1, static_cast<int>(std::ceil(fraction * prompt_tokens)));
}

Budget parse_budget(const std::string& s) {
  Budget b;
  try {
    const auto slash = s.find('/');
    if (slash != std::string::npos) {
      const double num = std::stod(s.substr(0, slash)), den = std::stod(s.substr(slash + 1));
      SPADE_CHECK(num > 0 && den > num, "not a fraction in (0, 1)");
      b.fraction = num / den;
    } else if (s.find('.') != std::string::npos) {
      b.fraction = std::stod(s);
      SPADE_CHECK(b.fraction > 0 && b.fraction < 1, "not a fraction in (0, 1)");
    } else {
      b.tokens = std::stoi(s);
      SPADE_CHECK(b.tokens > 0, "not a positive token count");
    }
  } catch (const std::exception& e) {
    fail("budget '{}': {} (write 128, 1/16 or 0.0625)", s, e.what());
  }
  return b;
}

std::vector<int32_t> chat_prompt_ids(const Tokenizer& tok, const std::string& user) {
  const auto tmpl = ChatTemplate::for_tokenizer(tok);
  const std::vector<ChatMessage> msgs = {{"user", user}};
  return tok.encode(tmpl.render(msgs), /*add_special_tokens=*/false);
}

namespace {

/// A batch of sequence 1 alone over pages 0..pages-1 (tokens, positions and lengths are the caller's).
ForwardBatch one_sequence_batch(int pages) {
  ForwardBatch fb;
  fb.max_pages = pages;
  for (int i = 0; i < pages; ++i) fb.block_table.push_back(i);
  fb.seq_ids = {1};
  return fb;
}

/// Runs [0, end) of `ids` (from `from`) through `be` in prefill chunks; returns the last chunk's final logits.
void prefill(const Model& model, AttentionBackend& be, const std::vector<int32_t>& ids, int from, int end, int pages,
             std::vector<float>& logits) {
  ForwardBatch fb = one_sequence_batch(pages);
  for (int s = from; s < end; s += kPrefillChunk) {
    const int e = std::min(end, s + kPrefillChunk);
    fb.tokens.assign(ids.begin() + s, ids.begin() + e);
    fb.positions.resize(e - s);
    for (int t = s; t < e; ++t) fb.positions[t - s] = t;
    fb.cu_q_lens = {0, e - s};
    fb.seq_lens = {e};
    fb.logit_rows = {e - s - 1};
    model.forward(fb, be, logits);
  }
}

struct Backend {
  std::unique_ptr<AttentionBackend> be;
  SparseAttention* sparse = nullptr;
  cache::InProcessLink* link = nullptr;
};

Backend make_backend(const ModelConfig& cfg, KvCache& kv, const Variant& v, int budget, const RunOptions& opt) {
  Backend b;
  if (v.mode == SelectionMode::Dense) {
    b.be = std::make_unique<DensePagedAttention>(cfg, kv);
    return b;
  }
  SparseOptions so;
  static_cast<pair::SparseConfig&>(so) = opt.sparse;
  so.mode = v.mode;
  so.selection = v.selection;
  so.selection.token_budget = budget;
  std::unique_ptr<pair::CacheRankLink> link;
  if (v.mode == SelectionMode::Predicted) {
    auto l = std::make_unique<cache::InProcessLink>(cfg, so.selection, kv.num_pages(), kv.page_size());
    b.link = l.get();
    link = std::move(l);
  }
  auto sa = std::make_unique<SparseAttention>(cfg, kv, so, std::move(link));
  b.sparse = sa.get();
  b.be = std::move(sa);
  return b;
}

void copy_kv(const ModelConfig& cfg, const KvCache& from, KvCache& to) {
  const size_t n = static_cast<size_t>(from.num_pages()) * from.page_size() * cfg.kv_dim();
  for (int l = 0; l < cfg.num_layers; ++l) {
    std::memcpy(to.k(l), from.k(l), n * sizeof(float));
    std::memcpy(to.v(l), from.v(l), n * sizeof(float));
  }
}

}  // namespace

PrefilledPrompt::PrefilledPrompt(const Model& model, std::vector<int32_t> ids, const RunOptions& opt)
    : model_(model), ids_(std::move(ids)), opt_(opt) {
  const int n = static_cast<int>(ids_.size());
  SPADE_CHECK(n >= 2, "pass-key prompt of {} tokens", n);
  pages_ = (n + opt_.max_new_tokens + opt_.page_size) / opt_.page_size + 1;
  prefix_ = std::max(1, n - kTail);
  kv_ = std::make_unique<KvCache>(model.config(), pages_, opt_.page_size);
  DensePagedAttention dense(model.config(), *kv_);
  std::vector<float> logits;
  prefill(model, dense, ids_, 0, prefix_, pages_, logits);
}

Reply PrefilledPrompt::decode(const Variant& v, int budget, const std::vector<int>& eos_ids, const Tokenizer& tok,
                              const std::string& expect) const {
  const ModelConfig& cfg = model_.config();
  KvCache kv(cfg, pages_, opt_.page_size);
  copy_kv(cfg, *kv_, kv);
  Backend b = make_backend(cfg, kv, v, budget, opt_);
  std::vector<float> logits;
  const int n = num_tokens();
  prefill(model_, *b.be, ids_, prefix_, n, pages_, logits);
  ForwardBatch fb = one_sequence_batch(pages_);
  fb.cu_q_lens = {0, 1};
  fb.logit_rows = {0};
  std::vector<int32_t> out;
  Reply r;
  for (int L = n; r.generated < opt_.max_new_tokens; ++L) {
    const int32_t t = argmax(logits.data(), cfg.vocab_size);
    ++r.generated;
    if (std::find(eos_ids.begin(), eos_ids.end(), t) != eos_ids.end()) break;
    out.push_back(t);
    if (r.generated == opt_.max_new_tokens) break;
    fb.tokens = {t};
    fb.positions = {L};
    fb.seq_lens = {L + 1};
    model_.forward(fb, *b.be, logits);
    if (b.sparse) {
      const auto failures = b.sparse->take_failures();
      SPADE_CHECK(failures.empty(), "variant {}: sparse decoding failed: {}", v.name,
                  failures.empty() ? "" : failures.front().second);
    }
  }
  if (b.sparse) r.sparse_steps = b.sparse->stats().sparse_seq_steps;
  r.text = tok.decode(out, /*skip_special_tokens=*/true);
  r.correct = r.text.find(expect) != std::string::npos;
  return r;
}

ForcedStats teacher_forced(const Model& model, const std::vector<int32_t>& doc, int context, int forced,
                           const Variant& v, int budget, const RunOptions& opt, std::vector<int32_t>& dense_argmax) {
  SPADE_CHECK(context >= 2 && forced >= 1 && static_cast<int>(doc.size()) >= context + forced,
              "teacher-forced document of {} tokens, context {} + forced {}", doc.size(), context, forced);
  const ModelConfig& cfg = model.config();
  const int pages = (context + forced + opt.page_size) / opt.page_size + 1;
  KvCache kv(cfg, pages, opt.page_size);
  Backend b = make_backend(cfg, kv, v, budget, opt);
  cache::OverlapSampler sampler(1);
  if (b.link) b.link->set_sampler(&sampler);
  std::vector<float> logits;
  prefill(model, *b.be, doc, 0, context, pages, logits);
  ForwardBatch fb = one_sequence_batch(pages);
  fb.cu_q_lens = {0, 1};
  fb.logit_rows = {0};
  ForcedStats st;
  const bool fill = dense_argmax.empty();
  for (int i = 0; i < forced; ++i) {
    const int32_t truth = doc[context + i];
    st.nll_sum -= log_softmax_at(logits.data(), cfg.vocab_size, truth);
    const int32_t am = argmax(logits.data(), cfg.vocab_size);
    if (fill) dense_argmax.push_back(am);
    st.top1_agree += am == dense_argmax[i];
    ++st.tokens;
    if (i + 1 == forced) break;
    fb.tokens = {truth};
    fb.positions = {context + i};
    fb.seq_lens = {context + i + 1};
    model.forward(fb, *b.be, logits);
  }
  st.heads = sampler.head_stats();
  return st;
}

}  // namespace spade::fidelity
