#include "common/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/error.h"

namespace spade {

void validate(const SamplingParams& p) {
  SPADE_CHECK(std::isfinite(p.temperature) && p.temperature >= 0.f, "temperature must be >= 0, got {}",
              p.temperature);
  SPADE_CHECK(std::isfinite(p.top_p) && p.top_p > 0.f && p.top_p <= 1.f, "top_p must be in (0, 1], got {}", p.top_p);
  SPADE_CHECK(p.top_k >= 0, "top_k must be >= 0, got {}", p.top_k);
}

int argmax(const float* logits, int vocab) {
  int best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

int sample_token(const float* logits, int vocab, const SamplingParams& p, std::mt19937_64& rng) {
  if (p.temperature == 0.f || p.top_k == 1) return argmax(logits, vocab);
  // Candidates sorted by logit, descending (ties by id), truncated by top-k.
  std::vector<int> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  const int k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  auto cmp = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(k);
  const float inv_t = 1.0f / p.temperature;
  const float m = logits[idx[0]] * inv_t;
  std::vector<double> prob(k);
  double total = 0;
  for (int i = 0; i < k; ++i) {
    prob[i] = std::exp(static_cast<double>(logits[idx[i]] * inv_t - m));
    total += prob[i];
  }
  // top-p: keep the smallest prefix whose mass reaches top_p (always at least one token).
  int keep = k;
  if (p.top_p < 1.f) {
    double cum = 0;
    for (int i = 0; i < k; ++i) {
      cum += prob[i] / total;
      if (cum >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += prob[i];
  std::uniform_real_distribution<double> u(0.0, kept);
  double r = u(rng);
  for (int i = 0; i < keep; ++i) {
    r -= prob[i];
    if (r < 0) return idx[i];
  }
  return idx[keep - 1];
}

TokenLogprobs token_logprobs(const float* logits, int vocab, int token, int top_n) {
  SPADE_CHECK(vocab > 0 && token >= 0 && token < vocab, "token_logprobs: token {} is outside the vocabulary [0, {})",
              token, vocab);
  SPADE_CHECK(top_n >= 0 && top_n <= kMaxTopLogprobs, "token_logprobs: top_n must be in [0, {}], got {}",
              kMaxTopLogprobs, top_n);
  auto canon = [&](int i) { return std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i]; };
  float m = canon(0);
  for (int i = 1; i < vocab; ++i) m = std::max(m, canon(i));
  double s = 0;
  for (int i = 0; i < vocab; ++i) {
    const float c = canon(i);
    s += c == m ? 1.0 : std::exp(static_cast<double>(c) - static_cast<double>(m));
  }
  const double log_s = std::log(s);
  auto lp = [&](int i) {
    const float c = canon(i);
    return static_cast<float>((c == m ? 0.0 : static_cast<double>(c) - static_cast<double>(m)) - log_s);
  };
  TokenLogprobs out;
  out.logprob = lp(token);
  const size_t n = static_cast<size_t>(std::min(top_n, vocab));
  if (n > 0) {
    // The n best so far, best first; indices arrive ascending, so a tie never displaces an earlier id.
    std::vector<int> top;
    top.reserve(n + 1);
    auto better = [&](int a, int b) { return canon(a) > canon(b) || (canon(a) == canon(b) && a < b); };
    for (int i = 0; i < vocab; ++i) {
      if (top.size() == n && !better(i, top.back())) continue;
      size_t j = top.size();
      while (j > 0 && better(i, top[j - 1])) --j;
      top.insert(top.begin() + static_cast<long>(j), i);
      if (top.size() > n) top.pop_back();
    }
    for (int i : top) {
      out.top_ids.push_back(i);
      out.top_logprobs.push_back(lp(i));
    }
  }
  return out;
}

}  // namespace spade
