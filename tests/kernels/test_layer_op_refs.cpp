// CPU tests of the references added for the GPU layer ops: the sampler reference (kernels/sampling_ref.h: Philox
// known answers, greedy / top-k / top-p decisions, tie order, the drawn distribution) and the paged KV append
// (kernels/kv_append_ref.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/kv_append_ref.h"
#include "kernels/sampling_ref.h"

namespace spade::kernels {
namespace {

TEST(SamplingRef, PhiloxKnownAnswers) {  // Random123 kat_vectors for philox4x32_10
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.out[i]) << i;
  }
  // The sampler's word: counter = step, key = seed.
  uint32_t out[4];
  const uint32_t ctr[4] = {5u, 1u, 0u, 0u}, key[2] = {7u, 9u};
  philox4x32_10(ctr, key, out);
  EXPECT_EQ(sample_random_word((uint64_t{9} << 32) | 7u, (uint64_t{1} << 32) | 5u), out[0]);
}

TEST(SamplingRef, KeysOrderLikeFloats) {
  const float v[] = {-std::numeric_limits<float>::infinity(), -1e30f, -2.5f, -1e-40f, 0.0f, 1e-40f, 1.0f, 3e38f,
                     std::numeric_limits<float>::infinity()};
  for (size_t i = 0; i + 1 < std::size(v); ++i)
    EXPECT_LT(sample_key(sample_canonical(v[i])), sample_key(sample_canonical(v[i + 1]))) << i;
  EXPECT_EQ(sample_key(sample_canonical(-0.0f)), sample_key(sample_canonical(0.0f)));
  EXPECT_EQ(sample_key(sample_canonical(std::nanf(""))),
            sample_key(sample_canonical(-std::numeric_limits<float>::infinity())));
}

TEST(SamplingRef, GreedyRules) {
  const float nan = std::nanf("");
  std::vector<float> l = {1.f, 3.f, nan, 3.f, -2.f};
  EXPECT_EQ(argmax_ref(l.data(), 5), 1);                               // lowest index among ties
  EXPECT_EQ(sample_ref(l.data(), 5, 0.f, 0, 1.f, 1, 0, nullptr), 1);   // temperature 0
  EXPECT_EQ(sample_ref(l.data(), 5, -1.f, 0, 1.f, 1, 0, nullptr), 1);  // negative temperature
  EXPECT_EQ(sample_ref(l.data(), 5, nan, 0, 1.f, 1, 0, nullptr), 1);   // NaN temperature
  EXPECT_EQ(sample_ref(l.data(), 5, 1.f, 1, 1.f, 1, 0, nullptr), 1);   // top_k 1
  std::vector<float> n = {nan, nan, 2.f, nan};
  EXPECT_EQ(argmax_ref(n.data(), 4), 2);  // NaN never chosen
  std::vector<float> z = {-0.f, 0.f};
  EXPECT_EQ(argmax_ref(z.data(), 2), 0);  // -0 == +0: lowest index
  std::vector<float> all_nan = {nan, nan};
  EXPECT_EQ(argmax_ref(all_nan.data(), 2), 0);
  // A temperature so small that max / T overflows: greedy.
  std::vector<float> big = {1.f, 30.f, 2.f};
  SampleRefInfo info;
  EXPECT_EQ(sample_ref(big.data(), 3, 1e-38f, 0, 1.f, 1, 0, &info), 1);
  EXPECT_TRUE(info.greedy);
}

TEST(SamplingRef, TopKKeepsHighestWithLowestIndexTies) {
  // Values with ties at the cut: 5 (idx 3), 4 (idx 0, 2, 6), 1 ...
  std::vector<float> l = {4.f, 1.f, 4.f, 5.f, 0.f, 1.f, 4.f, -1.f};
  SampleRefInfo info;
  sample_ref(l.data(), 8, 1.f, 3, 1.f, 3, 0, &info);
  EXPECT_EQ(info.kept, (std::vector<int>{3, 0, 2}));
  sample_ref(l.data(), 8, 1.f, 5, 1.f, 3, 0, &info);
  EXPECT_EQ(info.kept, (std::vector<int>{3, 0, 2, 6, 1}));
  sample_ref(l.data(), 8, 1.f, 8, 1.f, 3, 0, &info);  // top_k == vocab: off
  EXPECT_EQ(info.num_kept, 8);
}

TEST(SamplingRef, TopPKeepsShortestPrefixReachingTarget) {
  // Probabilities (T = 1) proportional to 8, 4, 2, 1, 1 -> 0.5, 0.25, 0.125, 0.0625, 0.0625.
  const double ln2 = std::log(2.0);
  std::vector<float> l = {static_cast<float>(3 * ln2), static_cast<float>(2 * ln2), static_cast<float>(ln2), 0.f, 0.f};
  SampleRefInfo info;
  // Cumulative 0.5, 0.75, 0.875, 0.9375, 1 (up to fp32 rounding of the masses: no p sits on a boundary).
  const std::pair<float, int> cases[] = {{0.4f, 1}, {0.6f, 2}, {0.8f, 3}, {0.9f, 4}, {0.95f, 5}, {0.99f, 5},
                                         {1e-9f, 1}, {0.f, 1}, {1.f, 5}};
  for (auto [p, keep] : cases) {
    sample_ref(l.data(), 5, 1.f, 0, p, 11, 0, &info);
    EXPECT_EQ(info.num_kept, keep) << "top_p " << p;
    EXPECT_GE(info.candidate_mass, uint64_t{1} << 40);
  }
  // top-p applies within top-k: k = 2 leaves 8, 4 (2/3, 1/3); p = 0.7 keeps both, p = 0.6 one.
  sample_ref(l.data(), 5, 1.f, 2, 0.7f, 11, 0, &info);
  EXPECT_EQ(info.num_kept, 2);
  sample_ref(l.data(), 5, 1.f, 2, 0.6f, 11, 0, &info);
  EXPECT_EQ(info.num_kept, 1);
}

// The draws follow the renormalised distribution of the kept tokens (many steps of one seed).
TEST(SamplingRef, DrawFollowsDistribution) {
  std::vector<float> l = {0.3f, -1.f, 2.f, 0.f, 1.1f, -0.4f, 2.f};
  const float T = 0.8f;
  for (float top_p : {1.0f, 0.8f}) {
    SampleRefInfo info;
    sample_ref(l.data(), 7, T, 0, top_p, 42, 0, &info);
    std::vector<double> p(7, 0.0);
    double z = 0;
    for (int t : info.kept) z += std::exp((l[t] - 2.f) / T);
    for (int t : info.kept) p[t] = std::exp((l[t] - 2.f) / T) / z;
    const int n = 200000;
    std::vector<int> count(7, 0);
    for (int s = 0; s < n; ++s) ++count[sample_ref(l.data(), 7, T, 0, top_p, 42, static_cast<uint64_t>(s), nullptr)];
    for (int t = 0; t < 7; ++t) {
      const double sd = std::sqrt(n * p[t] * (1 - p[t])) + 1e-9;
      EXPECT_LE(std::fabs(count[t] - n * p[t]), 5 * sd + 1) << "token " << t << " top_p " << top_p;
      if (p[t] == 0) {
        EXPECT_EQ(count[t], 0) << "token " << t << " was filtered out but drawn";
      }
    }
  }
}

TEST(SamplingRef, DeterministicPerSeedAndStep) {
  std::mt19937 g(3);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> l(1000);
  for (auto& x : l) x = d(g);
  std::set<int> seen;
  for (uint64_t step = 0; step < 50; ++step) {
    const int a = sample_ref(l.data(), 1000, 1.f, 0, 1.f, 1234, step, nullptr);
    EXPECT_EQ(a, sample_ref(l.data(), 1000, 1.f, 0, 1.f, 1234, step, nullptr));
    seen.insert(a);
  }
  EXPECT_GT(seen.size(), 20u);  // different steps draw different tokens
}

TEST(KvAppendRef, WritesSlotsSkipsPaddingCountsBad) {
  const int hkv = 2, D = 4, ps = 4, num_pages = 6, max_pages = 3, batch = 2;
  const size_t row = hkv * D;
  std::vector<int32_t> bt = {4, 1, -1, /* seq 1 */ 2, 7, 0};  // page 7 out of range
  std::vector<int32_t> pos = {0, 5, 9, 3, 4, -1, 2, 13};
  std::vector<int32_t> seq = {0, 0, 0, 1, 1, 1, 5, 1};
  const int tokens = 8;
  std::vector<float> k(tokens * row), v(tokens * row);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i);
    v[i] = -static_cast<float>(i);
  }
  std::vector<float> kc(num_pages * ps * row, 0.5f), vc(kc.size(), 0.5f);
  KvAppendRefParams p;
  p.k = k.data();
  p.v = v.data();
  p.positions = pos.data();
  p.seq_idx = seq.data();
  p.block_table = bt.data();
  p.k_cache = kc.data();
  p.v_cache = vc.data();
  p.tokens = tokens;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.batch = batch;
  p.max_pages_per_seq = max_pages;
  p.page_size = ps;
  p.num_pages = num_pages;
  // t0: seq0 pos0 -> page 4 slot 0; t1: pos5 -> page 1 slot 1; t2: pos9 -> entry 2 = -1 (padding, skipped);
  // t3: seq1 pos3 -> page 2 slot 3; t4: pos4 -> entry 1 = page 7 (bad); t5: pos -1 (bad); t6: seq 5 (bad);
  // t7: pos 13 >= 3 * 4 (bad).
  EXPECT_EQ(kv_append_ref(p), 4);
  std::vector<float> ek(kc.size(), 0.5f), ev(kc.size(), 0.5f);
  auto put = [&](int t, int page, int slot) {
    for (size_t i = 0; i < row; ++i) {
      ek[(static_cast<size_t>(page) * ps + slot) * row + i] = k[t * row + i];
      ev[(static_cast<size_t>(page) * ps + slot) * row + i] = v[t * row + i];
    }
  };
  put(0, 4, 0);
  put(1, 1, 1);
  put(3, 2, 3);
  EXPECT_EQ(kc, ek);
  EXPECT_EQ(vc, ev);
}

}  // namespace
}  // namespace spade::kernels
