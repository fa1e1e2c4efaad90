// Token sampling from logits: greedy, temperature, top-k, top-p (nucleus), seeded.
//
// Order of operations (as Hugging Face's logits warpers and vLLM apply them): temperature, then top-k, then top-p
// over the renormalised distribution, then a draw from std::mt19937_64. temperature == 0 means greedy (argmax, lowest
// id on ties); top_k == 0 and top_p == 1 disable those filters.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace spade {

struct SamplingParams {
  float temperature = 1.0f;  // >= 0; 0 = greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // >= 0; 0 = off
  uint64_t seed = 0;         // per-request seed
};

/// Throws spade::Error naming the parameter when a value is out of range (negative temperature, top_p outside (0,1],
/// negative top_k, NaN).
void validate(const SamplingParams& p);

/// Index of the largest logit (lowest index on ties). logits: [vocab] fp32.
int argmax(const float* logits, int vocab);

/// Samples one token id. logits: [vocab] fp32 (not modified). rng advances by one draw unless greedy.
int sample_token(const float* logits, int vocab, const SamplingParams& p, std::mt19937_64& rng);

/// Most alternatives a request may ask for per token (OpenAI's top_logprobs bound; completions' logprobs is <= 5).
inline constexpr int kMaxTopLogprobs = 20;

/// The log-probabilities of one sampled token: OpenAI's logprobs in "raw" mode, i.e. the log-softmax of the model's
/// logits of that step, before temperature, top-k and top-p (vLLM's default logprobs_mode, raw_logprobs). Natural
/// log, fp32.
struct TokenLogprobs {
  float logprob = 0.f;              // of the sampled token; <= 0, -inf for probability 0
  std::vector<int32_t> top_ids;     // the most likely tokens, most likely first (ties: lower id)
  std::vector<float> top_logprobs;  // aligned with top_ids
};

/// log-softmax of `logits` [vocab] fp32 at `token`, and the `top_n` (0..min(kMaxTopLogprobs, vocab)) most likely
/// tokens with theirs. Logits are canonical as the sampler reads them (kernels/sampling_ref.h: NaN = -inf), with
/// m = max, S = sum_i e_i where e_i = 1 if l_i == m else exp(l_i - m), computed in double:
///   logprob_i = (l_i == m ? 0 : l_i - m) - log(S),
/// which is log_softmax for finite m and stays defined when the maximum is +-inf (all -inf: uniform). Order of
/// the top tokens: logit descending, ties by lower id. Throws spade::Error for a token outside [0, vocab) or a
/// top_n out of range.
TokenLogprobs token_logprobs(const float* logits, int vocab, int token, int top_n);

}  // namespace spade
