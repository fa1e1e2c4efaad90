#include "kernels/sampling_ref.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/sampling.h"

namespace spade::kernels {

int argmax_ref(const float* logits, int vocab) {
  int best = 0;
  float bv = sample_canonical(logits[0]);
  for (int i = 1; i < vocab; ++i) {
    const float v = sample_canonical(logits[i]);
    if (v > bv) {
      bv = v;
      best = i;
    }
  }
  return best;
}

int sample_ref(const float* logits, int vocab, float temperature, int top_k, float top_p, uint64_t seed,
               uint64_t step, SampleRefInfo* info) {
  SampleRefInfo local;
  SampleRefInfo& I = info != nullptr ? *info : local;
  I = SampleRefInfo{};
  const int greedy_token = argmax_ref(logits, vocab);
  if (!(temperature > 0.f) || top_k == 1) {
    I.greedy = true;
    return greedy_token;
  }
  volatile float one = 1.0f;
  const float inv_t = one / temperature;
  const float m = sample_canonical(logits[greedy_token]) * inv_t;
  if (!std::isfinite(m)) {
    I.greedy = true;
    return greedy_token;
  }
  // Candidate order: canonical logit descending, ties by lower index.
  std::vector<float> c(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) c[i] = sample_canonical(logits[i]);
  std::vector<int> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  const int k = (top_k > 0 && top_k < vocab) ? top_k : vocab;
  auto cmp = [&](int a, int b) { return c[a] > c[b] || (c[a] == c[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(static_cast<size_t>(k));
  std::vector<uint64_t> mass(static_cast<size_t>(k));
  uint64_t total = 0;
  for (int i = 0; i < k; ++i) {
    mass[i] = sample_mass(c[idx[i]], inv_t, m);
    total += mass[i];
  }
  I.num_candidates = k;
  I.candidate_mass = total;
  // Slack of a device's prefix sums against these (expf within a few ulp, +-1 unit of truncation per token).
  const auto slack = [](uint64_t tot, int n) {
    return static_cast<uint64_t>(std::ldexp(static_cast<double>(tot), -21)) + 2 * static_cast<uint64_t>(n) + 4;
  };
  int keep = k;
  uint64_t kept_total = total;
  if (top_p < 1.0f) {
    const uint64_t target = sample_top_p_target(top_p, total);
    const uint64_t sl = slack(total, k);
    uint64_t cum = 0;
    for (int i = 0; i < k; ++i) {
      const uint64_t before = cum;
      cum += mass[i];
      if (cum >= target) {
        keep = i + 1;
        // Near: the cut would move if the prefix sums shifted by the slack.
        if (cum - target <= sl || target - before <= sl) I.near_boundary = true;
        break;
      }
    }
    kept_total = 0;
    for (int i = 0; i < keep; ++i) kept_total += mass[i];
  }
  I.num_kept = keep;
  I.kept_mass = kept_total;
  I.kept.assign(idx.begin(), idx.begin() + keep);
  // Draw, then walk the kept tokens in index order.
  const uint64_t r = sample_scale_draw(sample_random_word(seed, step), kept_total);
  I.r = r;
  std::vector<int> order(I.kept);
  std::sort(order.begin(), order.end());
  std::vector<int> pos_in_sorted(static_cast<size_t>(vocab), -1);
  for (int i = 0; i < keep; ++i) pos_in_sorted[static_cast<size_t>(idx[i])] = i;
  const uint64_t sl = 2 * slack(kept_total, keep);  // the prefix sums and r (through kept_total) both move
  uint64_t cum = 0;
  for (int t : order) {
    const uint64_t q = mass[static_cast<size_t>(pos_in_sorted[static_cast<size_t>(t)])];
    const uint64_t before = cum;
    cum += q;
    if (cum > r) {
      if (r - before <= sl || cum - r <= sl) I.near_boundary = true;
      return t;
    }
  }
  return order.back();  // unreachable: r < kept_total
}

std::vector<LogprobEntry> logprobs_ref(const float* logits, int vocab, int token, int top_n) {
  const TokenLogprobs t = token_logprobs(logits, vocab, token, top_n);
  std::vector<LogprobEntry> out;
  out.push_back({t.logprob, token});
  for (size_t i = 0; i < t.top_ids.size(); ++i) out.push_back({t.top_logprobs[i], t.top_ids[i]});
  return out;
}

}  // namespace spade::kernels
