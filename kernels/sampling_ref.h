// CPU reference of the GPU sampler (kernels/layer_ops.cuh sample_rows): temperature, top-k, top-p with a
// counter-based RNG, defined to the bit so the GPU kernel can be tested against it token for token.
//
// Semantics (the same filters, in the same order, as common/sampling.cpp and Hugging Face's logits warpers):
//   1. temperature <= 0 (or NaN) or top_k == 1: greedy = argmax, lowest index on ties, NaN never chosen.
//   2. Logits are canonicalised (NaN -> -inf, -0 -> +0) and ordered by value descending, ties by lower index.
//      top_k in (0, vocab) keeps the first top_k of that order (the candidates); otherwise all tokens.
//   3. inv_t = 1 / temperature (fp32 IEEE division), m = max_logit * inv_t (fp32); if m is not finite: greedy.
//      mass_i = floor(expf(l_i * inv_t - m) * 2^40) as uint64 (the fp32 product and difference are each rounded,
//      never fused; exp of the max is exactly 1, so every total is >= 2^40 and integer sums are exact and
//      order-independent -- the reason for fixed point: the GPU's parallel sums are deterministic).
//   4. top_p < 1: target = min(total, max(1, ceil(double(top_p) * double(total)))) over the candidates' total
//      mass; keep the shortest prefix of the candidate order whose mass reaches target (>= 1 token). Else keep all
//      candidates.
//   5. Draw: x = Philox4x32-10(counter = {step_lo, step_hi, 0, 0}, key = {seed_lo, seed_hi}) word 0;
//      r = (x * kept_total) >> 32 (0 <= r < kept_total). The kept tokens are walked in INDEX order; the result is
//      the first whose inclusive prefix mass exceeds r. (The walk order does not change the distribution; index
//      order lets the GPU avoid a sort.)
// Differences from common/sampling.cpp, which serves the CPU path: the RNG (Philox instead of mt19937_64), masses
// below 2^-40 of the maximum are 0 (never drawn), the walk order. The distribution is the same up to the 2^-40
// quantisation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__CUDACC__)
#define SPADE_HD __host__ __device__ __forceinline__
#else
#define SPADE_HD inline
#endif

namespace spade::kernels {

/// Philox4x32-10 (Salmon et al., SC'11; Random123's reference constants): out = philox(ctr, key).
SPADE_HD void philox4x32_10(const uint32_t ctr_in[4], const uint32_t key_in[2], uint32_t out[4]) {
  uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
  uint32_t k0 = key_in[0], k1 = key_in[1];
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/// The 32-bit word the sampler draws for (seed, step).
SPADE_HD uint32_t sample_random_word(uint64_t seed, uint64_t step) {
  const uint32_t ctr[4] = {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0u, 0u};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(ctr, key, out);
  return out[0];
}

/// Fixed-point scale of the sampler's masses: 2^40.
inline constexpr float kSampleMassScale = 1099511627776.0f;

/// Canonical logit: NaN -> -inf, -0 -> +0 (so equal floats have equal keys).
SPADE_HD float sample_canonical(float l) {
#if defined(__CUDA_ARCH__)
  if (l != l) return __int_as_float(0xff800000u);
#else
  if (l != l) return -std::numeric_limits<float>::infinity();
#endif
  return l == 0.0f ? 0.0f : l;
}

/// Order-preserving uint32 key of a canonical logit (larger logit <=> larger key).
SPADE_HD uint32_t sample_key(float canonical) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(canonical);
#else
  std::memcpy(&u, &canonical, 4);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/// Fixed-point mass of canonical logit l: floor(expf(l * inv_t - m) * 2^40); 0 for -inf.
SPADE_HD uint64_t sample_mass(float l, float inv_t, float m) {
#if defined(__CUDA_ARCH__)
  const float x = __fsub_rn(__fmul_rn(l, inv_t), m);
  const float e = expf(x);
  return static_cast<uint64_t>(__fmul_rn(e, kSampleMassScale));
#else
  volatile float prod = l * inv_t;  // volatile: no contraction into an fma
  const float x = prod - m;
  const float e = std::exp(x);
  return static_cast<uint64_t>(e * kSampleMassScale);
#endif
}

/// r = floor(x * total / 2^32), exact in 64-bit arithmetic: with total = hi * 2^32 + lo,
/// x * total / 2^32 = x * hi + x * lo / 2^32.
SPADE_HD uint64_t sample_scale_draw(uint32_t x, uint64_t total) {
  const uint64_t hi = total >> 32, lo = total & 0xffffffffull;
  return static_cast<uint64_t>(x) * hi + ((static_cast<uint64_t>(x) * lo) >> 32);
}

/// top-p target mass (step 4 of the header comment); top_p >= 1 or NaN means off (returns total).
SPADE_HD uint64_t sample_top_p_target(float top_p, uint64_t total) {
  if (!(top_p < 1.0f)) return total;
  double t = static_cast<double>(top_p) * static_cast<double>(total);
  if (t < 1.0) t = 1.0;
  uint64_t target = static_cast<uint64_t>(t);
  if (static_cast<double>(target) < t) ++target;  // ceil
  return target < total ? target : total;
}

/// What sample_ref decided, for tests.
struct SampleRefInfo {
  bool greedy = false;          // step 1 or 3 fell back to argmax
  int num_candidates = 0;       // after top-k
  int num_kept = 0;             // after top-p
  uint64_t candidate_mass = 0;  // total mass of the candidates
  uint64_t kept_mass = 0;       // total mass of the kept tokens
  uint64_t r = 0;               // the scaled draw
  std::vector<int> kept;        // kept token ids in candidate (sorted) order
  // True when a device computing expf with up to a few ulp of difference could legitimately decide differently:
  // r or the top-p target lies within 2^-21 of the relevant total (plus a few units per token) of a boundary.
  bool near_boundary = false;
};

/// Samples one token of `logits` [vocab] fp32 as the GPU sampler does (header comment). info may be nullptr.
int sample_ref(const float* logits, int vocab, float temperature, int top_k, float top_p, uint64_t seed,
               uint64_t step, SampleRefInfo* info);

/// Greedy rule of the sampler: index of the largest canonical logit, lowest index on ties (0 if all are NaN/-inf).
int argmax_ref(const float* logits, int vocab);

/// One (logprob, token id) pair of logprob_rows' output (kernels/layer_ops.cuh): 8 bytes.
struct LogprobEntry {
  float logprob;  // natural log, fp32; -inf for probability 0
  int32_t id;
};

/// CPU reference of logprob_rows for one row: n + 1 entries, n = min(top_n, vocab): [0] the sampled `token` and its
/// logprob, [1..n] the n most likely tokens, most likely first (ties: lower id). The values are common/sampling.h
/// token_logprobs' (raw mode: log-softmax of the canonical logits, computed in double); the kernel sums in fp32, so
/// its values agree within 1e-5 + 2^-20 |value| (tests/kernels/test_logprobs.cu), its ids exactly. Throws spade::Error for a token outside [0, vocab) or top_n outside
/// [0, kMaxTopLogprobs].
std::vector<LogprobEntry> logprobs_ref(const float* logits, int vocab, int token, int top_n);

}  // namespace spade::kernels
