#include "kernels/causal_conv1d_ref.h"

#include <cmath>
#include <cstddef>
#include <vector>

#include "common/error.h"

namespace spade::kernels {

void causal_conv1d_ref(const CausalConv1dParams& p) {
  const char* fn = "causal_conv1d_ref";
  SPADE_CHECK(p.batch >= 0, "{}: batch {} must be >= 0", fn, p.batch);
  if (p.batch == 0) return;
  SPADE_CHECK(p.channels >= 1 && p.kernel >= 1, "{}: channels {} and kernel {} must be >= 1", fn, p.channels,
              p.kernel);
  SPADE_CHECK(p.x && p.weight && p.out && p.cu_tokens && p.state_slots,
              "{}: x, weight, out, cu_tokens and state_slots must be non-null", fn);
  SPADE_CHECK(p.cu_tokens[0] == 0, "{}: cu_tokens[0] = {} must be 0", fn, p.cu_tokens[0]);
  for (int b = 0; b < p.batch; ++b)
    SPADE_CHECK(p.cu_tokens[b + 1] >= p.cu_tokens[b], "{}: cu_tokens decreases at {} ({} -> {})", fn, b,
                p.cu_tokens[b], p.cu_tokens[b + 1]);
  const int S = p.kernel - 1;  // state length
  if (S > 0) {
    SPADE_CHECK(p.state_pool && p.num_state_slots >= 1, "{}: state_pool is null or num_state_slots {} < 1", fn,
                p.num_state_slots);
    std::vector<char> used(static_cast<size_t>(p.num_state_slots), 0);
    for (int b = 0; b < p.batch; ++b) {
      const int s = p.state_slots[b];
      SPADE_CHECK(s >= 0 && s < p.num_state_slots, "{}: state_slots[{}] = {} outside 0..{}", fn, b, s,
                  p.num_state_slots - 1);
      SPADE_CHECK(!used[static_cast<size_t>(s)], "{}: state slot {} is used by two sequences (state_slots[{}])", fn,
                  s, b);
      used[static_cast<size_t>(s)] = 1;
    }
  }
  const int C = p.channels, K = p.kernel;

#pragma omp parallel for schedule(static) if (static_cast<long>(p.cu_tokens[p.batch]) * C * K > (1L << 18))
  for (long w = 0; w < static_cast<long>(p.batch) * C; ++w) {
    const int b = static_cast<int>(w / C), c = static_cast<int>(w % C);
    const int t0 = p.cu_tokens[b], n = p.cu_tokens[b + 1] - t0;
    float* st = S > 0 ? p.state_pool + (static_cast<size_t>(p.state_slots[b]) * C + c) * S : nullptr;
    const float* wc = p.weight + static_cast<size_t>(c) * K;
    // xx(i) = state[i] for i < S, else x[t0 + i - S, c]
    auto xx = [&](int i) { return i < S ? st[i] : p.x[static_cast<size_t>(t0 + i - S) * C + c]; };
    for (int t = 0; t < n; ++t) {
      float acc = p.bias ? p.bias[c] : 0.f;
      for (int j = 0; j < K; ++j) acc += wc[j] * xx(t + j);
      if (p.silu) acc = acc / (1.f + std::exp(-acc));
      p.out[static_cast<size_t>(t0 + t) * C + c] = acc;
    }
    if (S > 0 && n > 0) {
      // New state = last S entries of xx (length S + n): xx(n) .. xx(n + S - 1). Read before overwrite: shift in
      // increasing index order, since xx(n + i) with n >= 1 only reads state entries > i.
      for (int i = 0; i < S; ++i) st[i] = xx(n + i);
    }
  }
}

}  // namespace spade::kernels
