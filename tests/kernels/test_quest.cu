// Quest page selection on the GPU (kernels/selection.cuh quest_select, quest_page_summaries) against its CPU
// references (kernels/selection_ref.h quest_page_scores_ref, quest_pick_ref, quest_page_summaries_ref), and
// gather_query_rows. Label gpu.
//
// The page scores are fp32 sums in another order than the reference's: they are compared within a tolerance, and the
// pick is compared exactly with the reference's pick over the scores the kernel wrote.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/selection.cuh"
#include "kernels/selection_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::PagedCache;

struct QuestCase {
  DType dtype;
  int head_dim, group, page_size, k, begin;
  std::vector<int> ends;  // candidates [begin, end) per sequence
  GqaScoreRule rule;
  bool flat = false;      // zero queries: every page scores 0 and the pick ranks by position alone
  int hkv = 2;            // KV heads
};

std::string case_name(const QuestCase& c) {
  return std::string(spade::test::name_dtype(c.dtype)) + "_D" + std::to_string(c.head_dim) + "_G" +
         std::to_string(c.group) + "_P" + std::to_string(c.page_size) + "_k" + std::to_string(c.k) + "_begin" +
         std::to_string(c.begin) + "_ends" + spade::test::name_ints(c.ends) +
         (c.rule == GqaScoreRule::kMax ? "_max" : "_mean") + (c.flat ? "_flat" : "") +
         (c.hkv != 2 ? "_Hkv" + std::to_string(c.hkv) : std::string());
}

const QuestCase kQuestCases[] = {
    // Budget not a multiple of the page (the last page taken is cut); ends not page-aligned; a row with no candidate.
    {.dtype = DType::BF16, .head_dim = 128, .group = 4, .page_size = 16, .k = 100, .begin = 0,
     .ends = {1000, 333, 0, 17}, .rule = GqaScoreRule::kMax},
    // Sink tokens not candidates (begin inside the first page), the mean rule, fp16.
    {.dtype = DType::F16, .head_dim = 64, .group = 2, .page_size = 32, .k = 64, .begin = 4,
     .ends = {700, 40, 4}, .rule = GqaScoreRule::kMean},
    // A budget above the candidates of every row; head_dim 256, group 8.
    {.dtype = DType::BF16, .head_dim = 256, .group = 8, .page_size = 16, .k = 600, .begin = 0, .ends = {500, 128},
     .rule = GqaScoreRule::kMax},
    // Long rows (more columns than threads), budget 1/16.
    {.dtype = DType::BF16, .head_dim = 128, .group = 4, .page_size = 16, .k = 480, .begin = 0, .ends = {7700, 5000},
     .rule = GqaScoreRule::kMax},
    // Every page ties: the pick's threshold is the common score and more columns than it ranks tie at it (the
    // ranking over all columns), and a row with fewer.
    {.dtype = DType::BF16, .head_dim = 128, .group = 4, .page_size = 16, .k = 200, .begin = 0, .ends = {20000, 3000},
     .rule = GqaScoreRule::kMax, .flat = true},
    // Long rows over many scoring CTAs and long runs of columns per thread in the pick's scan: begin inside the first
    // page, ends on and off a page boundary, a row with no candidate, 4 KV heads.
    {.dtype = DType::BF16, .head_dim = 128, .group = 4, .page_size = 16, .k = 301, .begin = 3,
     .ends = {30000, 29993, 12345, 3}, .rule = GqaScoreRule::kMax, .hkv = 4},
    // Page 4: 7500 columns in a row (runs of 30 columns per pick thread), the mean rule, fp16.
    {.dtype = DType::F16, .head_dim = 64, .group = 2, .page_size = 4, .k = 301, .begin = 0, .ends = {30000, 27001, 1},
     .rule = GqaScoreRule::kMean, .hkv = 4},
};

class QuestSelectGpu : public ::testing::TestWithParam<QuestCase> {};

TEST_P(QuestSelectGpu, MatchesReference) {
  const QuestCase& c = GetParam();
  const int B = static_cast<int>(c.ends.size()), hkv = c.hkv, hq = hkv * c.group, D = c.head_dim, ps = c.page_size;
  std::mt19937_64 rng(9100 + D + c.group);
  PagedCache cache;
  std::vector<int> lens;
  for (int e : c.ends) lens.push_back(std::max(e, 1));
  cache.build(c.dtype, lens, ps, hkv, D, rng);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(static_cast<size_t>(B) * hq * D);
  for (float& x : q) x = c.flat ? 0.f : nd(rng);
  DevBuf<float> dq;
  dq.upload(q);
  DevBuf<int32_t> dend;
  dend.upload(std::vector<int32_t>(c.ends.begin(), c.ends.end()));
  const size_t score_n = static_cast<size_t>(B) * hkv * cache.max_pages;
  DevBuf<float> dscores(score_n);
  DevBuf<int32_t> didx(static_cast<size_t>(B) * hkv * c.k);
  dscores.poison();
  didx.poison();

  QuestSelectParams p;
  p.dtype = c.dtype;
  p.q = dq.get();
  p.k_cache = cache.k.get();
  p.block_table = cache.bt.get();
  p.num_tokens = dend.get();
  p.page_scores = dscores.get();
  p.indices = didx.get();
  p.batch = B;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.k = c.k;
  p.begin = c.begin;
  p.rule = c.rule;
  SPADE_CUDA_OK(quest_select(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got_scores = dscores.download();
  const std::vector<int32_t> got = didx.download();

  std::vector<float> ref_scores(score_n, 0.f);
  QuestPageScoresRefParams rp;
  rp.q = q.data();
  rp.k_cache = cache.k32.data();
  rp.block_table = cache.block_table.data();
  const std::vector<int32_t> ends(c.ends.begin(), c.ends.end());
  rp.num_tokens = ends.data();
  rp.page_scores = ref_scores.data();
  rp.batch = B;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = ps;
  rp.max_pages_per_seq = cache.max_pages;
  rp.begin = c.begin;
  rp.rule = c.rule;
  quest_page_scores_ref(rp);
  int compared = 0;
  for (int b = 0; b < B; ++b) {
    if (ends[static_cast<size_t>(b)] <= c.begin) continue;
    for (int h = 0; h < hkv; ++h)
      for (int j = c.begin / ps; j <= (ends[static_cast<size_t>(b)] - 1) / ps; ++j) {
        const size_t i = (static_cast<size_t>(b) * hkv + h) * cache.max_pages + j;
        ASSERT_NEAR(got_scores[i], ref_scores[i], 1e-4f * (4.f + std::fabs(ref_scores[i])))
            << "b " << b << " h " << h << " column " << j;
        ++compared;
      }
  }
  EXPECT_GT(compared, 0);
  // The columns without a candidate (before begin's, after the row's last, every column of a row without one) keep
  // the poison: the scoring writes inside the candidates only.
  for (int b = 0; b < B; ++b) {
    const int e = ends[static_cast<size_t>(b)], lo = c.begin / ps, hi = e > c.begin ? (e - 1) / ps + 1 : lo;
    for (int h = 0; h < hkv; ++h)
      for (int j = 0; j < cache.max_pages; ++j) {
        if (j >= lo && j < hi) continue;
        uint32_t bits = 0;
        std::memcpy(&bits, &got_scores[(static_cast<size_t>(b) * hkv + h) * cache.max_pages + j], sizeof(bits));
        ASSERT_EQ(bits, 0xFFFFFFFFu) << "b " << b << " h " << h << " column " << j << " without a candidate";
      }
  }

  // Quest's page summaries (quest_page_summaries): every full page equals the reference's, and quest_select reading
  // them scores and picks exactly as it did from the keys.
  {
    const size_t sum_n = static_cast<size_t>(cache.num_pages) * 2 * hkv * D;
    DevBuf<uint16_t> dsum(sum_n);
    dsum.poison();
    DevBuf<int32_t> dlens;
    dlens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
    QuestPageSummariesParams sp;
    sp.dtype = c.dtype;
    sp.k_cache = cache.k.get();
    sp.block_table = cache.bt.get();
    sp.num_tokens = dlens.get();
    sp.k_summary = dsum.get();
    sp.batch = B;
    sp.num_kv_heads = hkv;
    sp.head_dim = D;
    sp.page_size = ps;
    sp.max_pages_per_seq = cache.max_pages;
    sp.pages_back = cache.max_pages;
    SPADE_CUDA_OK(quest_page_summaries(sp, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got_sum = dsum.download();
    std::vector<float> want_sum(sum_n, NAN);
    QuestPageSummariesRefParams sr;
    sr.k_cache = cache.k32.data();
    sr.block_table = cache.block_table.data();
    const std::vector<int32_t> lens32(lens.begin(), lens.end());
    sr.num_tokens = lens32.data();
    sr.k_summary = want_sum.data();
    sr.batch = B;
    sr.num_kv_heads = hkv;
    sr.head_dim = D;
    sr.page_size = ps;
    sr.max_pages_per_seq = cache.max_pages;
    sr.pages_back = cache.max_pages;
    quest_page_summaries_ref(sr);
    int pages = 0;
    for (size_t i = 0; i < sum_n; ++i) {
      if (std::isnan(want_sum[i])) continue;  // not a full page of any row
      ASSERT_EQ(spade::test::from_bits(c.dtype, got_sum[i]), want_sum[i]) << "summary element " << i;
      ++pages;
    }
    EXPECT_GT(pages, 0);
    DevBuf<float> dscores2(score_n);
    DevBuf<int32_t> didx2(static_cast<size_t>(B) * hkv * c.k);
    QuestSelectParams p2 = p;
    p2.k_summary = dsum.get();
    p2.page_scores = dscores2.get();
    p2.indices = didx2.get();
    SPADE_CUDA_OK(quest_select(p2, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> scores2 = dscores2.download();
    for (int b = 0; b < B; ++b) {
      if (ends[static_cast<size_t>(b)] <= c.begin) continue;
      for (int h = 0; h < hkv; ++h)
        for (int j = c.begin / ps; j <= (ends[static_cast<size_t>(b)] - 1) / ps; ++j) {
          const size_t i = (static_cast<size_t>(b) * hkv + h) * cache.max_pages + j;
          ASSERT_EQ(scores2[i], got_scores[i]) << "with summaries: b " << b << " h " << h << " column " << j;
        }
    }
    EXPECT_EQ(didx2.download(), got) << "the pick with summaries";
    // pages_back = 1 (a decode step): only each row's last full page is written.
    dsum.poison();
    sp.pages_back = 1;
    SPADE_CUDA_OK(quest_page_summaries(sp, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint16_t> last = dsum.download();
    std::vector<char> named(static_cast<size_t>(cache.num_pages), 0);
    for (int b = 0; b < B; ++b)
      if (lens[static_cast<size_t>(b)] / ps > 0)
        named[static_cast<size_t>(
            cache.block_table[static_cast<size_t>(b) * cache.max_pages + lens[static_cast<size_t>(b)] / ps - 1])] = 1;
    for (int pg = 0; pg < cache.num_pages; ++pg)
      for (size_t e = 0; e < static_cast<size_t>(2) * hkv * D; ++e) {
        const size_t i = static_cast<size_t>(pg) * 2 * hkv * D + e;
        if (named[static_cast<size_t>(pg)]) {
          ASSERT_EQ(spade::test::from_bits(c.dtype, last[i]), want_sum[i]) << "page " << pg;
        } else {
          ASSERT_EQ(last[i], 0xFFFF) << "page " << pg << " is not its row's last full page";
        }
      }
  }

  // The pick, exactly, over the scores the kernel wrote.
  std::vector<int32_t> want(got.size(), 7);
  QuestPickRefParams pp;
  pp.page_scores = got_scores.data();
  pp.num_tokens = ends.data();
  pp.indices = want.data();
  pp.batch = B;
  pp.num_kv_heads = hkv;
  pp.page_size = ps;
  pp.max_pages_per_seq = cache.max_pages;
  pp.k = c.k;
  pp.begin = c.begin;
  quest_pick_ref(pp);
  EXPECT_EQ(got, want);
  // And the rule's shape: min(k, candidates) ascending positions inside [begin, end), then -1.
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < hkv; ++h) {
      const int n = std::min(c.k, std::max(0, ends[static_cast<size_t>(b)] - c.begin));
      const int32_t* row = &got[(static_cast<size_t>(b) * hkv + h) * c.k];
      for (int i = 0; i < c.k; ++i) {
        if (i < n) {
          EXPECT_GE(row[i], c.begin);
          EXPECT_LT(row[i], ends[static_cast<size_t>(b)]);
          if (i > 0) EXPECT_LT(row[i - 1], row[i]);
        } else {
          EXPECT_EQ(row[i], -1) << "b " << b << " h " << h << " entry " << i;
        }
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, QuestSelectGpu, ::testing::ValuesIn(kQuestCases),
                         [](const ::testing::TestParamInfo<QuestCase>& i) { return case_name(i.param); });

TEST(QuestSelectGpu, RefusesBadArguments) {
  DevBuf<float> f(16);
  DevBuf<int32_t> n(16);
  DevBuf<uint16_t> k(16);
  QuestSelectParams p;
  p.q = f.get();
  p.k_cache = k.get();
  p.block_table = n.get();
  p.num_tokens = n.get();
  p.page_scores = f.get();
  p.indices = n.get();
  p.batch = 1;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 128;
  p.page_size = 16;
  p.max_pages_per_seq = 4;
  p.k = 0;
  EXPECT_EQ(quest_select(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("k 0"), std::string::npos) << launch_error_detail();
  p.k = 8;
  p.max_pages_per_seq = kMaxQuestPages + 1;
  EXPECT_EQ(quest_select(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("kMaxQuestPages"), std::string::npos) << launch_error_detail();
  p.max_pages_per_seq = 4;
  p.indices = nullptr;
  EXPECT_EQ(quest_select(p, nullptr), cudaErrorInvalidValue);
}

TEST(QuestPageSummariesGpu, RefusesBadArguments) {
  DevBuf<int32_t> n(16);
  DevBuf<uint16_t> k(16);
  QuestPageSummariesParams p;
  p.k_cache = k.get();
  p.block_table = n.get();
  p.num_tokens = n.get();
  p.k_summary = k.get();
  p.batch = 1;
  p.num_kv_heads = 2;
  p.head_dim = 128;
  p.page_size = 16;
  p.max_pages_per_seq = 4;
  p.pages_back = 0;
  EXPECT_EQ(quest_page_summaries(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("pages_back 0"), std::string::npos) << launch_error_detail();
  p.pages_back = 1;
  p.k_summary = nullptr;
  EXPECT_EQ(quest_page_summaries(p, nullptr), cudaErrorInvalidValue);
  p.k_summary = k.get();
  p.page_size = 12;
  EXPECT_EQ(quest_page_summaries(p, nullptr), cudaErrorInvalidValue);
}

TEST(GatherQueryRowsGpu, GathersRowsAsFp32AndZeroesSkippedOnes) {
  const int rows = 5, elems = 8 * 64, B = 3;
  std::mt19937_64 rng(4);
  std::vector<float> exact;
  DevBuf<uint16_t> q;
  q.upload(spade::test::random_half(DType::BF16, static_cast<size_t>(rows) * elems, 1.f, rng, &exact));
  const std::vector<int32_t> sel = {4, -1, 0};
  DevBuf<int32_t> dsel;
  dsel.upload(sel);
  DevBuf<float> out(static_cast<size_t>(B) * elems);
  out.poison();
  GatherQueryRowsParams p;
  p.q = q.get();
  p.q_rows = dsel.get();
  p.out = out.get();
  p.batch = B;
  p.row_elems = elems;
  SPADE_CUDA_OK(gather_query_rows(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = out.download();
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < elems; ++i) {
      const float want = sel[static_cast<size_t>(b)] < 0 ? 0.f : exact[static_cast<size_t>(sel[b]) * elems + i];
      ASSERT_EQ(got[static_cast<size_t>(b) * elems + i], want) << "b " << b << " i " << i;
    }
  p.row_elems = 0;
  EXPECT_EQ(gather_query_rows(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace spade::kernels
