// passkey_diag: where does the asynchronous selection lose a pass key? A diagnosis tool for one prompt (CPU, fp32).
//
// The prompt is decoded densely (greedy) while every layer's query of every step is recorded. Then, at the steps
// around the one that writes the key's first digit (input position p, context L = p + 1), each (layer, KV head) is
// examined with the cache rank's own cache::Selector fed as the cache rank is:
//   oracle   top-k of the true query q_p over [S, L - R) (no successor expansion);
//   pred     the selection the cache rank sends for that step: KV [0, L - 1), query window ending at q_{p-1}
//            (the configured predictor and expansion, --selection flags);
//   lastx    the previous step's true query q_{p-1} with successor expansion;
// and prints how many of the key's digit tokens each selection holds, the true attention mass of q_p and q_{p-1} on
// the needle line (max over the group's query heads), and the rank of the first digit in the predicted scores.
//
//   passkey_diag --model ../shared/data/models/longctx-22m --id 63 [--budget 1/16] [--before 4] [--after 2]
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <span>

#include "bench/fidelity/passkey_harness.h"
#include "cache_rank/selector.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"
#include "pair/selection_flags.h"

namespace {

using namespace spade;
using namespace spade::fidelity;

std::string data_dir() {
  const char* d = std::getenv("SPADE_DATA_DIR");
  return d != nullptr ? d : SPADE_DEFAULT_DATA_DIR;
}

/// Dense attention that keeps every layer's query rows (post-RoPE) by position.
class Recorder : public AttentionBackend {
 public:
  Recorder(const ModelConfig& cfg, KvCache& kv) : cfg_(cfg), dense_(cfg, kv), q_(cfg.num_layers) {}
  void attend(int layer, const ForwardBatch& b, const float* q, const float* k, const float* v, float* out) override {
    const int n = b.cu_q_lens[1], L = b.seq_lens[0], Q = cfg_.q_dim();
    auto& m = q_[layer];
    for (int i = std::max(0, n - 40); i < n; ++i)
      m[L - n + i].assign(q + static_cast<size_t>(i) * Q, q + static_cast<size_t>(i + 1) * Q);
    dense_.attend(layer, b, q, k, v, out);
  }
  const std::vector<float>& q(int layer, int pos) const { return q_[layer].at(pos); }

 private:
  const ModelConfig& cfg_;
  DensePagedAttention dense_;
  std::vector<std::map<int, std::vector<float>>> q_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Where the asynchronous selection loses a pass key (one prompt, CPU)"};
  std::string model_dir, prompts_path, budget_arg = "1/16";
  int id = -1, before = 4, after = 2, max_new = 40;
  pair::SparseConfig sparse;
  pair::SparseFlagText sparse_text;
  app.add_option("--model", model_dir, "checkpoint directory")->required();
  app.add_option("--prompts", prompts_path, "pass-key jsonl (default: $SPADE_DATA_DIR/prompts/passkey_public.jsonl)");
  app.add_option("--id", id, "prompt id")->required();
  app.add_option("--budget", budget_arg, "token budget (tokens or fraction of the prompt)")->capture_default_str();
  app.add_option("--before", before, "steps examined before the first digit")->capture_default_str();
  app.add_option("--after", after, "steps examined after the first digit")->capture_default_str();
  pair::add_sparse_flags(app, sparse, sparse_text, pair::kSelectionFlags);
  CLI11_PARSE(app, argc, argv);
  try {
    init_logging("passkey_diag", "warn");
    pair::resolve_sparse_flags(sparse_text, sparse);
    if (prompts_path.empty()) prompts_path = data_dir() + "/prompts/passkey_public.jsonl";
    PasskeyPrompt pp;
    for (auto& p : load_passkey_prompts(prompts_path))
      if (p.id == id) pp = p;
    SPADE_CHECK(pp.id == id, "{}: no prompt with id {}", prompts_path, id);
    const auto model = Model::load(model_dir);
    const ModelConfig& cfg = model->config();
    const Tokenizer tok = Tokenizer::from_dir(model_dir);
    std::vector<int32_t> ids = chat_prompt_ids(tok, pp.prompt);
    const int n = static_cast<int>(ids.size());
    const int budget = parse_budget(budget_arg).resolve(n);
    const int page = 16, pages = (n + max_new + page) / page + 1;
    KvCache kv(cfg, pages, page);
    Recorder rec(cfg, kv);
    ForwardBatch fb;
    fb.max_pages = pages;
    for (int i = 0; i < pages; ++i) fb.block_table.push_back(i);
    fb.seq_ids = {1};
    std::vector<float> logits;
    for (int s = 0; s < n; s += 2048) {
      const int e = std::min(n, s + 2048);
      fb.tokens.assign(ids.begin() + s, ids.begin() + e);
      fb.positions.clear();
      for (int t = s; t < e; ++t) fb.positions.push_back(t);
      fb.cu_q_lens = {0, e - s};
      fb.seq_lens = {e};
      fb.logit_rows = {e - s - 1};
      model->forward(fb, rec, logits);
    }
    std::vector<int32_t> out;
    for (int L = n; static_cast<int>(out.size()) < max_new; ++L) {
      const int32_t t = static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + cfg.vocab_size) -
                                             logits.begin());
      out.push_back(t);
      ids.push_back(t);
      fb.tokens = {t};
      fb.positions = {L};
      fb.cu_q_lens = {0, 1};
      fb.seq_lens = {L + 1};
      fb.logit_rows = {0};
      model->forward(fb, rec, logits);
    }
    // Text offsets of every token (byte-level: one token, one piece).
    std::string text;
    std::vector<int> start;
    for (int32_t t : ids) {
      start.push_back(static_cast<int>(text.size()));
      text += tok.decode(std::span<const int32_t>(&t, 1), false);
    }
    auto pos_of_char = [&](int c) {
      return static_cast<int>(std::upper_bound(start.begin(), start.end(), c) - start.begin()) - 1;
    };
    std::string key;
    for (char c : pp.expect)
      if (c >= '0' && c <= '9') key += c;
    const std::string reply = tok.decode(out, true);
    const int kc = static_cast<int>(text.find(key));
    SPADE_CHECK(kc >= 0 && kc < start[n], "key {} not in the prompt", key);
    std::vector<int> digits;
    for (int i = 0; i < 5; ++i) digits.push_back(pos_of_char(kc + i));
    const int line0 = pos_of_char(static_cast<int>(text.rfind("The pass key", kc)));
    const std::string prompt_text = text.substr(0, start[n]);
    const int rc = static_cast<int>(text.find(key, start[n]));
    fmt::print("prompt {} ({} B, {} needles, {} tokens), budget {}, key {} at tokens {}..{} (line from {}): '{}'\n",
               pp.id, pp.bytes, pp.needles, n, budget, key, digits.front(), digits.back(), line0,
               text.substr(start[line0], start[digits.back()] - start[line0] + 1));
    fmt::print("dense reply: '{}' ({})\n", reply, reply.find(pp.expect) != std::string::npos ? "right" : "WRONG");
    SPADE_CHECK(rc >= 0, "dense reply does not contain the key: nothing to diagnose");
    const int first_step_pos = pos_of_char(rc) - 1;  // input position of the step that writes the first digit
    fmt::print("first digit written by the step at input position {} (reply token {}; the switch step is {})\n",
               first_step_pos, first_step_pos - n + 1, n);

    const int Hkv = cfg.num_kv_heads, G = cfg.gqa_group(), D = cfg.head_dim, KV = cfg.kv_dim();
    pair::SelectionConfig so = sparse.selection, sp = sparse.selection, sl = sparse.selection;
    so.token_budget = sp.token_budget = sl.token_budget = budget;
    so.successor_expand = false;
    sl.predictor = kernels::PredictorKind::kLastQuery;
    sl.successor_expand = true;
    const int W1 = sp.query_window + 1;
    const std::set<int> dset(digits.begin(), digits.end());
    auto kv_rows = [&](int layer, int len, std::vector<float>& k, std::vector<float>& v) {
      k.resize(static_cast<size_t>(len) * KV);
      v.resize(k.size());
      for (int t = 0; t < len; ++t) {
        const size_t off = (static_cast<size_t>(t / page) * page + t % page) * KV;
        std::memcpy(&k[static_cast<size_t>(t) * KV], kv.k(layer) + off, KV * sizeof(float));
        std::memcpy(&v[static_cast<size_t>(t) * KV], kv.v(layer) + off, KV * sizeof(float));
      }
    };
    auto window = [&](int layer, int last_pos) {
      std::vector<float> w;
      for (int p = last_pos - W1 + 1; p <= last_pos; ++p) {
        const auto& q = rec.q(layer, p);
        w.insert(w.end(), q.begin(), q.end());
      }
      return w;
    };
    // Mass of q (one query head) at `pos` set over [0, L), softmax with 1/sqrt(D).
    auto mass = [&](int layer, const float* q, int kvh, int L, int from, int to) {
      std::vector<double> s(L);
      double mx = -1e300;
      for (int t = 0; t < L; ++t) {
        const float* k = kv.k(layer) + (static_cast<size_t>(t / page) * page + t % page) * KV + kvh * D;
        double d = 0;
        for (int i = 0; i < D; ++i) d += static_cast<double>(q[i]) * k[i];
        s[t] = d / std::sqrt(static_cast<double>(D));
        mx = std::max(mx, s[t]);
      }
      double z = 0, m = 0;
      for (int t = 0; t < L; ++t) {
        const double e = std::exp(s[t] - mx);
        z += e;
        if (t >= from && t <= to) m += e;
      }
      return m / z;
    };
    auto top_of = [&](int layer, const float* q, int kvh, int end, int k) {
      std::vector<std::pair<float, int>> sc;
      for (int t = 0; t < end; ++t) {
        const float* kr = kv.k(layer) + (static_cast<size_t>(t / page) * page + t % page) * KV + kvh * D;
        float best = -1e30f;
        for (int g = 0; g < G; ++g) {
          float d = 0;
          for (int i = 0; i < D; ++i) d += q[(kvh * G + g) * D + i] * kr[i];
          best = std::max(best, d);
        }
        sc.push_back({best, t});
      }
      std::sort(sc.begin(), sc.end(), std::greater<>());
      sc.resize(std::min(k, end));
      return sc;
    };
    auto snippet = [&](int t) {
      std::string s = text.substr(start[std::max(0, t - 6)], start[t + 1] - start[std::max(0, t - 6)]);
      for (char& c : s)
        if (c == '\n') c = '|';
      return s;
    };
    // Which recorded queries (the prompt's last 40 and the reply's) put mass on the needle line, per (layer, head).
    fmt::print("\nqueries with >= 5% of a query head's attention on the needle line [{}, {}] (mass line/digits):\n",
               line0, digits.back());
    for (int p = n - 40; p < static_cast<int>(ids.size()) - 1; ++p) {
      std::string row;
      for (int layer = 0; layer < cfg.num_layers; ++layer)
        for (int qh = 0; qh < cfg.num_q_heads; ++qh) {
          const float* q = rec.q(layer, p).data() + qh * D;
          const double ml = mass(layer, q, qh / G, p + 1, line0, digits.back());
          if (ml >= 0.05) {
            int best = line0;
            double bm = 0;
            for (int t = line0; t <= digits.back(); ++t) {
              const double m1 = mass(layer, q, qh / G, p + 1, t, t);
              if (m1 > bm) bm = m1, best = t;
            }
            row += fmt::format(" L{}q{}:{:.2f}/{:.2f} top {}'{}' {:.2f}", layer, qh, ml,
                               mass(layer, q, qh / G, p + 1, digits[0], digits.back()), best, snippet(best), bm);
          }
        }
      if (!row.empty()) fmt::print("  pos {} '{}':{}\n", p, snippet(p), row);
    }
    for (int p = first_step_pos - before; p <= first_step_pos + after; ++p) {
      const int L = p + 1;
      fmt::print("\n== step at input position {} ('{}' -> writes '{}'), context {}\n", p, snippet(p),
                 text.substr(start[p + 1], start[p + 2] - start[p + 1]), L);
      std::vector<float> k, v;
      for (int layer = 0; layer < cfg.num_layers; ++layer) {
        cache::Selector A(cfg, so, pages, page), B(cfg, sp, pages, page), C(cfg, sl, pages, page);
        kv_rows(layer, L, k, v);
        const auto wo = window(layer, p), wp = window(layer, p - 1);
        // Selectors hold only this layer; the other layers are given the same KV (unused).
        for (int l2 = 0; l2 < cfg.num_layers; ++l2) {
          A.init_layer(1, l2, L, k.data(), v.data(), W1, wo.data());
          B.init_layer(1, l2, L - 1, k.data(), v.data(), W1, wp.data());
          C.init_layer(1, l2, L - 1, k.data(), v.data(), W1, wp.data());
        }
        pair::LayerSelection so_, sp_, sl_;
        A.select(1, layer, L, rec.q(layer, p).data(), so_);
        B.select(1, layer, L, nullptr, sp_);
        C.select(1, layer, L, nullptr, sl_);
        std::vector<float> qhat(cfg.q_dim());
        B.predict(1, layer, qhat.data());
        for (int h = 0; h < Hkv; ++h) {
          auto count = [&](const pair::LayerSelection& s) {
            int c = 0;
            for (int j = 0; j < budget; ++j) c += dset.count(s.positions[static_cast<size_t>(h) * budget + j]);
            return c;
          };
          double m_now = 0, m_prev = 0, m_now_d = 0, m_prev_d = 0, m_hat_d = 0;
          for (int g = 0; g < G; ++g) {
            const int qh = h * G + g;
            m_now = std::max(m_now, mass(layer, rec.q(layer, p).data() + qh * D, h, L, line0, digits.back()));
            m_now_d = std::max(m_now_d, mass(layer, rec.q(layer, p).data() + qh * D, h, L, digits[0], digits.back()));
            m_prev = std::max(m_prev, mass(layer, rec.q(layer, p - 1).data() + qh * D, h, L - 1, line0, digits.back()));
            m_prev_d = std::max(m_prev_d,
                                mass(layer, rec.q(layer, p - 1).data() + qh * D, h, L - 1, digits[0], digits.back()));
            m_hat_d = std::max(m_hat_d, mass(layer, qhat.data() + qh * D, h, L - 1, digits[0], digits.back()));
          }
          const auto top = top_of(layer, qhat.data(), h, L - 1 - sp.local_window, 3);
          const auto topq = top_of(layer, rec.q(layer, p).data(), h, L - sp.local_window, 3);
          fmt::print("L{} h{}: digits in oracle {} pred {} lastx {} | mass line/digits q_p {:.3f}/{:.3f} q_p-1 "
                     "{:.3f}/{:.3f} qhat digits {:.3f} | pred top {} | true top {}\n",
                     layer, h, count(so_), count(sp_), count(sl_), m_now, m_now_d, m_prev, m_prev_d, m_hat_d,
                     fmt::join([&] {
                       std::vector<std::string> r;
                       for (auto& [s, t] : top) r.push_back(fmt::format("{}'{}'", t, snippet(t)));
                       return r;
                     }(), " "),
                     fmt::join([&] {
                       std::vector<std::string> r;
                       for (auto& [s, t] : topq) r.push_back(fmt::format("{}'{}'", t, snippet(t)));
                       return r;
                     }(), " "));
        }
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "passkey_diag: {}\n", e.what());
    return 2;
  }
}
