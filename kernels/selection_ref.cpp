#include "kernels/selection_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"

namespace spade::kernels {
namespace {

// Cholesky solve of (A + 0) x = rhs for a k x k SPD matrix A (row-major, fp64, A already holds eps on its
// diagonal). Returns false on a non-positive or non-finite pivot.
bool cholesky_solve(std::vector<double>& a, int k, std::vector<double>& rhs) {
  for (int j = 0; j < k; ++j) {
    double piv = a[j * k + j];
    for (int t = 0; t < j; ++t) piv -= a[j * k + t] * a[j * k + t];
    if (!(piv > 0.0) || !std::isfinite(piv)) return false;
    const double ljj = std::sqrt(piv);
    a[j * k + j] = ljj;
    for (int i = j + 1; i < k; ++i) {
      double s = a[i * k + j];
      for (int t = 0; t < j; ++t) s -= a[i * k + t] * a[j * k + t];
      a[i * k + j] = s / ljj;
    }
  }
  for (int i = 0; i < k; ++i) {  // L y = rhs
    double s = rhs[i];
    for (int t = 0; t < i; ++t) s -= a[i * k + t] * rhs[t];
    rhs[i] = s / a[i * k + i];
  }
  for (int i = k - 1; i >= 0; --i) {  // L^T x = y
    double s = rhs[i];
    for (int t = i + 1; t < k; ++t) s -= a[t * k + i] * rhs[t];
    rhs[i] = s / a[i * k + i];
  }
  return true;
}

double dot_f64(const float* x, const float* y, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  return s;
}

const float* paged_row(const float* cache, const int32_t* block_table, int b, int pos, int kvh, int page_size,
                       int max_pages, int num_kv_heads, int head_dim, const char* what) {
  const int32_t page = block_table[static_cast<size_t>(b) * max_pages + pos / page_size];
  SPADE_CHECK(page >= 0, "{}: block_table[{}][{}] = {} is not a page id (position {})", what, b, pos / page_size,
              page, pos);
  return cache + ((static_cast<size_t>(page) * page_size + pos % page_size) * num_kv_heads + kvh) * head_dim;
}

}  // namespace

uint32_t topk_key(float x) {
  if (std::isnan(x)) return 0u;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

PredictorKind parse_predictor_kind(const char* s) {
  const std::string v = s != nullptr ? s : "";
  if (v == "ridge") return PredictorKind::kRidge;
  if (v == "paper") return PredictorKind::kPaper;
  if (v == "last") return PredictorKind::kLastQuery;
  fail("predictor must be ridge, paper or last, got '{}'", v);
}

const char* predictor_kind_name(PredictorKind k) {
  switch (k) {
    case PredictorKind::kRidge: return "ridge";
    case PredictorKind::kPaper: return "paper";
    case PredictorKind::kLastQuery: return "last";
  }
  return "?";
}

void predict_next_query_ref(const PredictQueryRefParams& p) {
  SPADE_CHECK(p.window != nullptr && p.window_len != nullptr && p.q_hat != nullptr,
              "predict_next_query_ref: window, window_len and q_hat must be set");
  SPADE_CHECK(p.batch >= 0 && p.num_heads > 0 && p.head_dim > 0,
              "predict_next_query_ref: batch {} / num_heads {} / head_dim {} invalid", p.batch, p.num_heads,
              p.head_dim);
  SPADE_CHECK(p.window_capacity >= 1 && p.window_capacity <= kMaxPredictorWindow + 1,
              "predict_next_query_ref: window_capacity {} outside 1..{}", p.window_capacity,
              kMaxPredictorWindow + 1);
  SPADE_CHECK(p.max_regressors >= 1 && p.max_regressors <= kMaxPredictorWindow,
              "predict_next_query_ref: max_regressors {} outside 1..{}", p.max_regressors, kMaxPredictorWindow);
  SPADE_CHECK(p.eps > 0.f && std::isfinite(p.eps), "predict_next_query_ref: eps {} must be > 0", p.eps);
  const int D = p.head_dim;
  std::vector<double> gram;
  std::vector<double> omega;
  std::vector<double> acc(D);
  for (int b = 0; b < p.batch; ++b) {
    const int n = p.window_len[b];
    SPADE_CHECK(n >= 0 && n <= p.window_capacity, "predict_next_query_ref: window_len[{}] = {} outside 0..{}", b, n,
                p.window_capacity);
    for (int h = 0; h < p.num_heads; ++h) {
      const size_t row = static_cast<size_t>(b) * p.num_heads + h;
      const float* win = p.window + row * p.window_capacity * D;
      float* out = p.q_hat + row * D;
      if (n == 0) {
        std::fill(out, out + D, 0.f);
        continue;
      }
      const float* qt = win + static_cast<size_t>(n - 1) * D;  // Q_t
      const int m = p.kind == PredictorKind::kLastQuery ? 0 : std::min(n - 1, p.max_regressors);
      std::fill(acc.begin(), acc.end(), 0.0);
      int used = 0;
      double eps = p.eps;
      if (p.kind == PredictorKind::kRidge && m > 0) {  // relative: eps * mean squared norm of the m regressors
        double sq = 0.0;
        for (int i = 0; i < m; ++i) {
          const float* ri = win + static_cast<size_t>(n - 2 - i) * D;
          sq += dot_f64(ri, ri, D);
        }
        eps = static_cast<double>(p.eps) * (sq / m);
      }
      for (int k = 1; k <= m; ++k) {
        // Regressors Q_{t-i}, i = 1..k, live in slot n-1-i.
        gram.assign(static_cast<size_t>(k) * k, 0.0);
        omega.assign(k, 0.0);
        for (int i = 0; i < k; ++i) {
          const float* ri = win + static_cast<size_t>(n - 2 - i) * D;
          for (int j = 0; j <= i; ++j) {
            const double v = dot_f64(ri, win + static_cast<size_t>(n - 2 - j) * D, D);
            gram[i * k + j] = v;
            gram[j * k + i] = v;
          }
          gram[i * k + i] += eps;
          omega[i] = dot_f64(ri, qt, D);
        }
        if (!cholesky_solve(gram, k, omega)) break;  // larger windows contain this one: drop them too
        double sum = 1.0;
        if (p.kind == PredictorKind::kPaper) {  // Eq. 3: softmax over the ridge coefficients
          const double mx = *std::max_element(omega.begin(), omega.end());
          sum = 0.0;
          for (double& w : omega) {
            w = std::exp(w - mx);
            sum += w;
          }
        }
        // Shifted application: weight of Q_{t-i} (i = 1..k) multiplies Q_{t+1-i} (slot n-i).
        for (int i = 0; i < k; ++i) {
          const double w = omega[i] / sum;
          const float* succ = win + static_cast<size_t>(n - 1 - i) * D;
          for (int d = 0; d < D; ++d) acc[d] += w * succ[d];
        }
        ++used;
      }
      if (used == 0) {
        std::copy(qt, qt + D, out);
      } else {
        for (int d = 0; d < D; ++d) out[d] = static_cast<float>(acc[d] / used);
      }
    }
  }
}

void score_tokens_ref(const ScoreTokensRefParams& p) {
  SPADE_CHECK(p.q_hat != nullptr && p.k_cache != nullptr && p.block_table != nullptr && p.num_tokens != nullptr &&
                  p.scores != nullptr,
              "score_tokens_ref: q_hat, k_cache, block_table, num_tokens and scores must be set");
  SPADE_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
              "score_tokens_ref: num_q_heads {} is not a multiple of num_kv_heads {}", p.num_q_heads,
              p.num_kv_heads);
  SPADE_CHECK(p.head_dim > 0 && p.page_size > 0 && p.max_pages_per_seq > 0,
              "score_tokens_ref: head_dim {} / page_size {} / max_pages_per_seq {} must be > 0", p.head_dim,
              p.page_size, p.max_pages_per_seq);
  const int G = p.num_q_heads / p.num_kv_heads;
  const int D = p.head_dim;
  for (int b = 0; b < p.batch; ++b) {
    const int n = p.num_tokens[b];
    SPADE_CHECK(n >= 0 && n <= p.score_stride && n <= p.max_pages_per_seq * p.page_size,
                "score_tokens_ref: num_tokens[{}] = {} outside 0..min(score_stride {}, max_pages_per_seq*page_size)",
                b, n, p.score_stride);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      float* out = p.scores + (static_cast<size_t>(b) * p.num_kv_heads + kvh) * p.score_stride;
      const float* qg = p.q_hat + (static_cast<size_t>(b) * p.num_q_heads + kvh * G) * D;
      for (int t = 0; t < n; ++t) {
        const float* k = paged_row(p.k_cache, p.block_table, b, t, kvh, p.page_size, p.max_pages_per_seq,
                                   p.num_kv_heads, D, "score_tokens_ref");
        float best = -std::numeric_limits<float>::infinity();
        float sum = 0.f;
        for (int g = 0; g < G; ++g) {
          const float* q = qg + static_cast<size_t>(g) * D;
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += q[d] * k[d];
          best = std::max(best, s);
          sum += s;
        }
        out[t] = p.rule == GqaScoreRule::kMax ? best : sum / static_cast<float>(G);
      }
    }
  }
}

ScoreKeys parse_score_keys(const char* s) {
  const std::string v = s == nullptr ? "" : s;
  if (v == "bf16") return ScoreKeys::kBf16;
  if (v == "int8") return ScoreKeys::kInt8;
  fail("score keys must be bf16 or int8, got '{}'", v);
}

const char* score_keys_name(ScoreKeys k) { return k == ScoreKeys::kInt8 ? "int8" : "bf16"; }

void quantize_keys_ref(const QuantizeKeysRefParams& p) {
  SPADE_CHECK(p.rows == 0 || (p.k != nullptr && p.k_int8 != nullptr && p.k_scale != nullptr),
              "quantize_keys_ref: k, k_int8 and k_scale must be set");
  SPADE_CHECK(p.head_dim > 0, "quantize_keys_ref: head_dim {} must be > 0", p.head_dim);
  const size_t D = static_cast<size_t>(p.head_dim);
  for (size_t r = 0; r < p.rows; ++r) {
    const float* k = p.k + r * D;
    float amax = 0.f;
    bool nan = false;
    for (size_t d = 0; d < D; ++d) {
      nan = nan || std::isnan(k[d]);
      amax = std::fmax(amax, std::fabs(k[d]));
    }
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    p.k_scale[r] = scale;
    for (size_t d = 0; d < D; ++d) {
      float q = scale > 0.f && std::isfinite(scale) ? std::nearbyint(k[d] / scale) : 0.f;
      q = std::fmin(127.f, std::fmax(-127.f, q));
      p.k_int8[r * D + d] = static_cast<int8_t>(q);
    }
  }
}

void dequantize_keys_ref(const int8_t* k_int8, const float* k_scale, size_t rows, int head_dim, float* k) {
  SPADE_CHECK(rows == 0 || (k_int8 != nullptr && k_scale != nullptr && k != nullptr),
              "dequantize_keys_ref: k_int8, k_scale and k must be set");
  SPADE_CHECK(head_dim > 0, "dequantize_keys_ref: head_dim {} must be > 0", head_dim);
  const size_t D = static_cast<size_t>(head_dim);
  for (size_t r = 0; r < rows; ++r)
    for (size_t d = 0; d < D; ++d) k[r * D + d] = static_cast<float>(k_int8[r * D + d]) * k_scale[r];
}

void topk_ref(const TopkRefParams& p) {
  SPADE_CHECK(p.scores != nullptr && p.row_lens != nullptr && p.indices != nullptr,
              "topk_ref: scores, row_lens and indices must be set");
  SPADE_CHECK(p.k >= 1, "topk_ref: k {} must be >= 1", p.k);
  SPADE_CHECK(p.rows_per_batch > 0 && p.score_stride > 0, "topk_ref: rows_per_batch {} / score_stride {} invalid",
              p.rows_per_batch, p.score_stride);
  std::vector<int32_t> order;
  for (int b = 0; b < p.batch; ++b) {
    const int n = p.row_lens[b];
    SPADE_CHECK(n >= 0 && n <= p.score_stride, "topk_ref: row_lens[{}] = {} outside 0..{}", b, n, p.score_stride);
    for (int rr = 0; rr < p.rows_per_batch; ++rr) {
      const size_t row = static_cast<size_t>(b) * p.rows_per_batch + rr;
      const float* s = p.scores + row * p.score_stride;
      int32_t* out = p.indices + row * p.k;
      const int take = std::min(n, p.k);
      order.resize(n);
      for (int i = 0; i < n; ++i) order[i] = i;
      if (n > p.k) {
        const bool succ = p.successor;
        auto key = [s, succ](int32_t i) {
          const uint32_t own = topk_key(s[i]);
          return succ && i > 0 ? std::max(own, topk_key(s[i - 1])) : own;
        };
        auto better = [&key](int32_t x, int32_t y) {
          const uint32_t kx = key(x);
          const uint32_t ky = key(y);
          return kx != ky ? kx > ky : x < y;
        };
        std::nth_element(order.begin(), order.begin() + (p.k - 1), order.end(), better);
        order.resize(p.k);
        std::sort(order.begin(), order.end());
      }
      for (int i = 0; i < p.k; ++i) out[i] = i < take ? order[i] : -1;
      if (p.counts != nullptr) p.counts[row] = take;
    }
  }
}

void select_anchors_ref(const SelectAnchorsRefParams& p) {
  SPADE_CHECK(p.queries != nullptr && p.k_cache != nullptr && p.block_table != nullptr && p.anchors != nullptr,
              "select_anchors_ref: queries, k_cache, block_table and anchors must be set");
  SPADE_CHECK(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0 && p.head_dim > 0 && p.page_size > 0,
              "select_anchors_ref: num_q_heads {} / num_kv_heads {} / head_dim {} / page_size {} invalid",
              p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size);
  SPADE_CHECK(p.num_queries >= 0 && p.first_pos >= 0 && p.span >= 1 && p.begin >= 0 && p.begin <= p.end,
              "select_anchors_ref: num_queries {} / first_pos {} / span {} / [begin {}, end {}) invalid",
              p.num_queries, p.first_pos, p.span, p.begin, p.end);
  const int last = p.first_pos + p.num_queries;  // keys [0, last) are read
  SPADE_CHECK(last <= p.max_pages_per_seq * p.page_size,
              "select_anchors_ref: queries up to position {} beyond max_pages_per_seq {} * page_size {}", last - 1,
              p.max_pages_per_seq, p.page_size);
  const int G = p.num_q_heads / p.num_kv_heads, D = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::fill(p.anchors, p.anchors + static_cast<size_t>(p.num_kv_heads) * kMaxAnchors, -1);
  const int end = std::min(p.end, last);
  if (end <= p.begin || p.num_queries == 0) return;
  std::vector<float> best(static_cast<size_t>(end - p.begin));
  std::vector<double> s(static_cast<size_t>(last));
  for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
    std::fill(best.begin(), best.end(), 0.f);
    for (int i = 0; i < p.num_queries; ++i) {
      const int n = p.first_pos + i + 1;  // causal context of query i
      for (int g = 0; g < G; ++g) {
        const float* q = p.queries + (static_cast<size_t>(i) * p.num_q_heads + kvh * G + g) * D;
        double mx = -std::numeric_limits<double>::infinity();
        for (int t = 0; t < n; ++t) {
          const float* k = paged_row(p.k_cache, p.block_table, 0, t, kvh, p.page_size, p.max_pages_per_seq,
                                     p.num_kv_heads, D, "select_anchors_ref");
          float d = 0.f;
          for (int j = 0; j < D; ++j) d += q[j] * k[j];
          s[t] = d * scale;
          mx = std::max(mx, s[t]);
        }
        double z = 0.0;
        for (int t = 0; t < n; ++t) z += std::exp(s[t] - mx);
        for (int t = p.begin; t < std::min(end, n); ++t)
          best[t - p.begin] = std::max(best[t - p.begin], static_cast<float>(std::exp(s[t] - mx) / z));
      }
    }
    int32_t* out = p.anchors + static_cast<size_t>(kvh) * kMaxAnchors;
    for (int a = 0; a < kMaxAnchors; ++a) {
      int arg = -1;
      for (int t = p.begin; t < end; ++t) {
        if (best[t - p.begin] < kAnchorMinMass || (arg >= 0 && best[t - p.begin] <= best[arg - p.begin])) continue;
        bool near = false;
        for (int b = 0; b < a; ++b) near = near || std::abs(t - out[b]) < p.span;
        if (!near) arg = t;
      }
      if (arg < 0) break;
      out[a] = arg;
    }
  }
}

std::vector<int32_t> anchor_span_positions(const int32_t* anchors, int span, int budget, bool successor, int first_pos,
                                           int row_len) {
  SPADE_CHECK(anchors != nullptr && span >= 1 && budget >= 0 && row_len >= 0,
              "anchor_span_positions: anchors set, span {} >= 1, budget {} >= 0 and row_len {} >= 0 required", span,
              budget, row_len);
  std::vector<int32_t> out;
  const int cap = budget / 4;
  const int cost = span + (successor ? 1 : 0);  // the token after a span inherits its +inf with successor expansion
  int used = 0;
  for (int a = 0; a < kMaxAnchors; ++a) {
    const int32_t t0 = anchors[a];
    if (t0 < 0 || used + cost > cap) break;
    used += cost;
    for (int t = std::max(t0, first_pos); t < std::min(t0 + span, first_pos + row_len); ++t) out.push_back(t);
  }
  return out;
}

void apply_anchor_spans_ref(const ApplyAnchorSpansRefParams& p) {
  SPADE_CHECK(p.scores != nullptr && p.row_lens != nullptr && p.anchors != nullptr,
              "apply_anchor_spans_ref: scores, row_lens and anchors must be set");
  SPADE_CHECK(p.rows >= 0 && p.score_stride >= 0 && p.first_pos >= 0,
              "apply_anchor_spans_ref: rows {} / score_stride {} / first_pos {} invalid", p.rows, p.score_stride,
              p.first_pos);
  for (int r = 0; r < p.rows; ++r) {
    const int n = p.row_lens[r];
    SPADE_CHECK(n >= 0 && n <= p.score_stride, "apply_anchor_spans_ref: row_lens[{}] = {} outside [0, {}]", r, n,
                p.score_stride);
    for (int32_t t : anchor_span_positions(p.anchors + static_cast<size_t>(r) * kMaxAnchors, p.span, p.budget,
                                           p.successor, p.first_pos, n))
      p.scores[static_cast<size_t>(r) * p.score_stride + (t - p.first_pos)] = std::numeric_limits<float>::infinity();
  }
}

void gather_kv_ref(const GatherKvRefParams& p) {
  SPADE_CHECK(p.k_cache != nullptr && p.v_cache != nullptr && p.block_table != nullptr && p.indices != nullptr &&
                  p.packed_k != nullptr && p.packed_v != nullptr,
              "gather_kv_ref: all pointers must be set");
  SPADE_CHECK(p.num_kv_heads > 0 && p.head_dim > 0 && p.page_size > 0 && p.k >= 0,
              "gather_kv_ref: num_kv_heads {} / head_dim {} / page_size {} / k {} invalid", p.num_kv_heads,
              p.head_dim, p.page_size, p.k);
  const int D = p.head_dim;
  for (int b = 0; b < p.batch; ++b) {
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const size_t row = static_cast<size_t>(b) * p.num_kv_heads + kvh;
      for (int i = 0; i < p.k; ++i) {
        const int pos = p.indices[row * p.k + i];
        float* dk = p.packed_k + (row * p.k + i) * D;
        float* dv = p.packed_v + (row * p.k + i) * D;
        if (pos < 0) {
          std::fill(dk, dk + D, 0.f);
          std::fill(dv, dv + D, 0.f);
          continue;
        }
        SPADE_CHECK(pos < p.max_pages_per_seq * p.page_size,
                    "gather_kv_ref: indices[{}][{}][{}] = {} beyond max_pages_per_seq * page_size", b, kvh, i, pos);
        const float* sk = paged_row(p.k_cache, p.block_table, b, pos, kvh, p.page_size, p.max_pages_per_seq,
                                    p.num_kv_heads, D, "gather_kv_ref");
        const float* sv = paged_row(p.v_cache, p.block_table, b, pos, kvh, p.page_size, p.max_pages_per_seq,
                                    p.num_kv_heads, D, "gather_kv_ref");
        std::copy(sk, sk + D, dk);
        std::copy(sv, sv + D, dv);
      }
    }
  }
}

namespace {

// The block-table columns of sequence b's candidates [begin, end): first, count, and column j's token range.
struct QuestColumns {
  int first = 0, count = 0;
  int t0(int j, int begin, int ps) const { return std::max(begin, j * ps); }
  int t1(int j, int end, int ps) const { return std::min(end, (j + 1) * ps); }
};

QuestColumns quest_columns(int begin, int end, int ps) {
  if (end <= begin) return {};
  return {begin / ps, (end - 1) / ps - begin / ps + 1};
}

void check_quest_sizes(const char* what, const int32_t* num_tokens, int batch, int hkv, int ps, int max_pages,
                       int begin) {
  SPADE_CHECK(num_tokens != nullptr, "{}: num_tokens must be set", what);
  SPADE_CHECK(batch >= 0 && hkv > 0 && ps > 0 && max_pages > 0 && begin >= 0,
              "{}: batch {} / num_kv_heads {} / page_size {} / max_pages_per_seq {} / begin {} invalid", what, batch,
              hkv, ps, max_pages, begin);
  for (int b = 0; b < batch; ++b)
    SPADE_CHECK(num_tokens[b] >= 0 && num_tokens[b] <= max_pages * ps,
                "{}: num_tokens[{}] = {} outside [0, max_pages_per_seq * page_size = {}]", what, b, num_tokens[b],
                max_pages * ps);
}

}  // namespace

void quest_page_scores_ref(const QuestPageScoresRefParams& p) {
  const char* what = "quest_page_scores_ref";
  SPADE_CHECK(p.q != nullptr && p.k_cache != nullptr && p.block_table != nullptr && p.page_scores != nullptr,
              "{}: q, k_cache, block_table and page_scores must be set", what);
  check_quest_sizes(what, p.num_tokens, p.batch, p.num_kv_heads, p.page_size, p.max_pages_per_seq, p.begin);
  SPADE_CHECK(p.head_dim > 0 && p.num_q_heads > 0 && p.num_q_heads % p.num_kv_heads == 0,
              "{}: num_q_heads {} is not a positive multiple of num_kv_heads {} (head_dim {})", what, p.num_q_heads,
              p.num_kv_heads, p.head_dim);
  const int D = p.head_dim, G = p.num_q_heads / p.num_kv_heads, ps = p.page_size;
  std::vector<float> mn(static_cast<size_t>(D)), mx(static_cast<size_t>(D));
  for (int b = 0; b < p.batch; ++b) {
    const int end = p.num_tokens[b];
    const QuestColumns cols = quest_columns(p.begin, end, ps);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      for (int j = cols.first; j < cols.first + cols.count; ++j) {
        std::fill(mn.begin(), mn.end(), std::numeric_limits<float>::infinity());
        std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
        for (int t = cols.t0(j, p.begin, ps); t < cols.t1(j, end, ps); ++t) {
          const float* k = paged_row(p.k_cache, p.block_table, b, t, h, ps, p.max_pages_per_seq, p.num_kv_heads, D,
                                     what);
          for (int d = 0; d < D; ++d) {
            mn[static_cast<size_t>(d)] = std::min(mn[static_cast<size_t>(d)], k[d]);
            mx[static_cast<size_t>(d)] = std::max(mx[static_cast<size_t>(d)], k[d]);
          }
        }
        float combined = p.rule == GqaScoreRule::kMax ? -std::numeric_limits<float>::infinity() : 0.f;
        for (int g = 0; g < G; ++g) {
          const float* q = p.q + (static_cast<size_t>(b) * p.num_q_heads + static_cast<size_t>(h) * G + g) * D;
          float sc = 0.f;
          for (int d = 0; d < D; ++d)
            sc += std::max(q[d] * mn[static_cast<size_t>(d)], q[d] * mx[static_cast<size_t>(d)]);
          combined = p.rule == GqaScoreRule::kMax ? std::max(combined, sc) : combined + sc / G;
        }
        p.page_scores[(static_cast<size_t>(b) * p.num_kv_heads + h) * p.max_pages_per_seq + j] = combined;
      }
    }
  }
}

void quest_page_summaries_ref(const QuestPageSummariesRefParams& p) {
  const char* what = "quest_page_summaries_ref";
  SPADE_CHECK(p.k_cache != nullptr && p.block_table != nullptr && p.num_tokens != nullptr && p.k_summary != nullptr,
              "{}: k_cache, block_table, num_tokens and k_summary must be set", what);
  check_quest_sizes(what, p.num_tokens, p.batch, p.num_kv_heads, p.page_size, p.max_pages_per_seq, 0);
  SPADE_CHECK(p.head_dim > 0 && p.pages_back >= 1, "{}: head_dim {} / pages_back {} must be >= 1", what, p.head_dim,
              p.pages_back);
  const int D = p.head_dim, ps = p.page_size, H = p.num_kv_heads;
  for (int b = 0; b < p.batch; ++b) {
    const int full = p.num_tokens[b] / ps;
    for (int j = std::max(0, full - p.pages_back); j < full; ++j) {
      const int32_t page = p.block_table[static_cast<size_t>(b) * p.max_pages_per_seq + j];
      for (int h = 0; h < H; ++h) {
        float* mn = p.k_summary + (static_cast<size_t>(page) * 2 * H + h) * D;
        float* mx = mn + static_cast<size_t>(H) * D;
        std::fill(mn, mn + D, std::numeric_limits<float>::infinity());
        std::fill(mx, mx + D, -std::numeric_limits<float>::infinity());
        for (int t = j * ps; t < (j + 1) * ps; ++t) {
          const float* k = paged_row(p.k_cache, p.block_table, b, t, h, ps, p.max_pages_per_seq, H, D, what);
          for (int d = 0; d < D; ++d) {
            mn[d] = std::min(mn[d], k[d]);
            mx[d] = std::max(mx[d], k[d]);
          }
        }
      }
    }
  }
}

void quest_pick_ref(const QuestPickRefParams& p) {
  const char* what = "quest_pick_ref";
  SPADE_CHECK(p.page_scores != nullptr && p.indices != nullptr, "{}: page_scores and indices must be set", what);
  SPADE_CHECK(p.k >= 1, "{}: k {} must be >= 1", what, p.k);
  check_quest_sizes(what, p.num_tokens, p.batch, p.num_kv_heads, p.page_size, p.max_pages_per_seq, p.begin);
  const int ps = p.page_size;
  std::vector<std::pair<uint32_t, int>> order;
  std::vector<int32_t> pos;
  for (int b = 0; b < p.batch; ++b) {
    const int end = p.num_tokens[b];
    const QuestColumns cols = quest_columns(p.begin, end, ps);
    for (int h = 0; h < p.num_kv_heads; ++h) {
      const size_t row = static_cast<size_t>(b) * p.num_kv_heads + h;
      order.clear();
      for (int j = cols.first; j < cols.first + cols.count; ++j)
        order.emplace_back(topk_key(p.page_scores[row * p.max_pages_per_seq + j]), j);
      // Best first; ties: the earlier page.
      std::sort(order.begin(), order.end(),
                [](const auto& a, const auto& c) { return a.first != c.first ? a.first > c.first : a.second < c.second; });
      pos.clear();
      for (const auto& [key, j] : order) {
        (void)key;
        for (int t = cols.t0(j, p.begin, ps); t < cols.t1(j, end, ps) && static_cast<int>(pos.size()) < p.k; ++t)
          pos.push_back(t);
        if (static_cast<int>(pos.size()) >= p.k) break;
      }
      std::sort(pos.begin(), pos.end());
      int32_t* out = p.indices + row * p.k;
      std::fill(out, out + p.k, -1);
      std::copy(pos.begin(), pos.end(), out);
    }
  }
}

}  // namespace spade::kernels
