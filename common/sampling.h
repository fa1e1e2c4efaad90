// Token sampling from logits: greedy, temperature, top-k, top-p (nucleus), seeded.
//
// Order of operations (as Hugging Face's logits warpers and vLLM apply them): temperature, then top-k, then top-p
// over the renormalised distribution, then a draw from std::mt19937_64. temperature == 0 means greedy (argmax, lowest
// id on ties); top_k == 0 and top_p == 1 disable those filters.
#pragma once

#include <cstdint>
#include <random>

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

}  // namespace spade
