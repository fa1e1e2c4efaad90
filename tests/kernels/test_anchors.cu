// Prompt anchors on the GPU (kernels/selection.cuh select_anchors, apply_anchor_spans) against their CPU
// references (kernels/selection_ref.h select_anchors_ref, apply_anchor_spans_ref). Label gpu.
//
// Random queries and keys give no token a probability near kAnchorMinMass, so the anchor cases plant needles:
// key rows set to c * (an anchor query of one head of the group), c chosen so each needle's probability is
// clearly above the threshold and distinct from the others (the GPU's softmax is fp32, the reference's fp64),
// two of them closer than the span (only the better one may be taken).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
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

struct AnchorCase {
  DType dtype;
  int head_dim, group;
  std::vector<int> lens;  // context per sequence
  std::vector<int> nq;    // anchor queries per sequence (0: the row is skipped and keeps its anchors)
  int capacity;           // anchor window capacity
};

std::string case_name(const AnchorCase& c) {
  return std::string(spade::test::name_dtype(c.dtype)) + "_D" + std::to_string(c.head_dim) + "_G" +
         std::to_string(c.group) + "_lens" + spade::test::name_ints(c.lens) + "_nq" +
         spade::test::name_ints(c.nq) + "_cap" + std::to_string(c.capacity);
}

const AnchorCase kAnchorCases[] = {
    {.dtype = DType::BF16,
     .head_dim = 128,
     .group = 4,
     .lens = {900, 300, 40, 200},
     .nq = {64, 64, 40, 0},
     .capacity = 64},
    {.dtype = DType::F16, .head_dim = 64, .group = 1, .lens = {700, 130}, .nq = {9, 64}, .capacity = 64},
    {.dtype = DType::BF16, .head_dim = 256, .group = 8, .lens = {1500}, .nq = {33}, .capacity = 48},
    {.dtype = DType::BF16, .head_dim = 128, .group = 2, .lens = {5000, 600}, .nq = {64, 17}, .capacity = 64},
};

class SelectAnchorsGpu : public ::testing::TestWithParam<AnchorCase> {};

TEST_P(SelectAnchorsGpu, MatchesReference) {
  const AnchorCase& c = GetParam();
  const int B = static_cast<int>(c.lens.size()), hkv = 2, hq = hkv * c.group, D = c.head_dim, ps = 16;
  const int span = 16, R = 32, A = c.capacity;
  std::mt19937_64 rng(7000 + D * 10 + c.group);
  PagedCache cache;
  cache.build(c.dtype, c.lens, ps, hkv, D, rng);
  std::vector<uint16_t> kbits = cache.k.download();

  // Anchor windows: window w = b + 1 (window 0 unused), entries oldest first; the queries, rounded to the
  // dtype.
  const int num_windows = B + 1;
  std::vector<float> win32(static_cast<size_t>(num_windows) * hq * A * D, 0.f);
  std::vector<uint16_t> winbits(win32.size(), 0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (size_t i = 0; i < win32.size(); ++i) {
    winbits[i] = spade::test::to_bits(c.dtype, nd(rng));
    win32[i] = spade::test::from_bits(c.dtype, winbits[i]);
  }
  auto wq = [&](int b, int h, int i) { return &win32[((static_cast<size_t>(b + 1) * hq + h) * A + i) * D]; };

  // Needles per (sequence, KV head): key rows aligned with an anchor query of one of the group's heads.
  int planted = 0, rows_planted = 0;
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[static_cast<size_t>(b)], nq = std::min({c.nq[static_cast<size_t>(b)], A, len});
    if (nq == 0) continue;
    const int end = std::min(std::max(span, len - std::max(R, nq)), len);
    if (end - span < 4 * span) continue;
    for (int kvh = 0; kvh < hkv; ++kvh) {
      ++rows_planted;
      std::uniform_int_distribution<int> pos(span, end - 1), qi(0, nq - 1), gi(0, c.group - 1);
      const float strength[] = {1.0f, 0.8f, 0.65f, 0.6f};  // the last one lands within the span of the first
      int first = -1;
      for (int n = 0; n < 4; ++n) {
        int t = pos(rng);
        if (n == 3) t = std::min(end - 1, first + span / 2);
        if (n == 0) first = t;
        const float* q = wq(b, kvh * c.group + gi(rng), qi(rng));
        const int page = cache.block_table[static_cast<size_t>(b) * cache.max_pages + t / ps];
        const size_t row = ((static_cast<size_t>(page) * ps + t % ps) * hkv + kvh) * D;
        // logit = 10 strength |q|^2 / D ~ 10 strength against N(0, 1) for the random keys: the strongest
        // needle takes most of its query's probability at every length here, the weaker ones depend on the
        // length.
        for (int d = 0; d < D; ++d) {
          kbits[row + d] =
              spade::test::to_bits(c.dtype, strength[n] * 10.f * q[d] / std::sqrt(static_cast<float>(D)));
          cache.k32[row + d] = spade::test::from_bits(c.dtype, kbits[row + d]);
        }
        ++planted;
      }
    }
  }
  cache.k.upload(kbits);

  // The reference, per sequence.
  const int32_t kSentinel = 123456;
  std::vector<int32_t> want(static_cast<size_t>(B) * hkv * kMaxAnchors, kSentinel);
  int anchors_found = 0;
  for (int b = 0; b < B; ++b) {
    const int len = c.lens[static_cast<size_t>(b)], nq = std::min({c.nq[static_cast<size_t>(b)], A, len});
    if (nq == 0) continue;
    std::vector<float> q(static_cast<size_t>(nq) * hq * D);
    for (int i = 0; i < nq; ++i)
      for (int h = 0; h < hq; ++h) std::copy_n(wq(b, h, i), D, &q[(static_cast<size_t>(i) * hq + h) * D]);
    SelectAnchorsRefParams rp;
    rp.queries = q.data();
    rp.k_cache = cache.k32.data();
    rp.block_table = cache.block_table.data() + static_cast<size_t>(b) * cache.max_pages;
    rp.anchors = want.data() + static_cast<size_t>(b) * hkv * kMaxAnchors;
    rp.num_queries = nq;
    rp.first_pos = len - nq;
    rp.num_q_heads = hq;
    rp.num_kv_heads = hkv;
    rp.head_dim = D;
    rp.page_size = ps;
    rp.max_pages_per_seq = cache.max_pages;
    rp.begin = span;
    rp.end = std::max(span, len - std::max(R, nq));
    rp.span = span;
    select_anchors_ref(rp);
    for (int i = 0; i < hkv * kMaxAnchors; ++i) anchors_found += rp.anchors[i] >= 0 ? 1 : 0;
  }
  ASSERT_GT(planted, 0);
  ASSERT_GE(anchors_found, rows_planted) << "the needles must make anchors, or the case checks nothing";

  // The device: rows written to anchors row (b * hkv + kvh) reversed, to check anchor_rows is honoured.
  std::vector<int32_t> idx(static_cast<size_t>(B)), nqv(static_cast<size_t>(B)), ctx(static_cast<size_t>(B)),
      rows(static_cast<size_t>(B) * hkv);
  for (int b = 0; b < B; ++b) {
    idx[static_cast<size_t>(b)] = b + 1;
    nqv[static_cast<size_t>(b)] = c.nq[static_cast<size_t>(b)];
    ctx[static_cast<size_t>(b)] = c.lens[static_cast<size_t>(b)];
    for (int h = 0; h < hkv; ++h) rows[static_cast<size_t>(b) * hkv + h] = B * hkv - 1 - (b * hkv + h);
  }
  DevBuf<uint16_t> d_win;
  d_win.upload(winbits);
  DevBuf<int32_t> d_idx, d_nq, d_ctx, d_rows, d_anchors;
  d_idx.upload(idx);
  d_nq.upload(nqv);
  d_ctx.upload(ctx);
  d_rows.upload(rows);
  d_anchors.upload(std::vector<int32_t>(static_cast<size_t>(B) * hkv * kMaxAnchors, kSentinel));
  SelectAnchorsParams p;
  p.dtype = c.dtype;
  p.windows = d_win.get();
  p.window_idx = d_idx.get();
  p.num_queries = d_nq.get();
  p.context_len = d_ctx.get();
  p.k_cache = cache.k.get();
  p.block_table = cache.bt.get();
  p.anchor_rows = d_rows.get();
  p.anchors = d_anchors.get();
  p.batch = B;
  p.num_windows = num_windows;
  p.window_capacity = A;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.begin = span;
  p.local_window = R;
  p.span = span;
  // The workspace starts as garbage (counts of 0x25252525): select_anchors must not read a region it did not write.
  p.workspace_bytes = select_anchors_workspace_bytes(B, hq, hkv, A);
  ASSERT_GT(p.workspace_bytes, 0u);
  DevBuf<uint8_t> d_ws;
  d_ws.upload(std::vector<uint8_t>(p.workspace_bytes, 0x25));
  p.workspace = d_ws.get();
  SPADE_CUDA_OK(select_anchors(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = d_anchors.download();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < hkv; ++h) {
      SCOPED_TRACE("sequence " + std::to_string(b) + " KV head " + std::to_string(h));
      const int32_t* g = &got[static_cast<size_t>(rows[static_cast<size_t>(b) * hkv + h]) * kMaxAnchors];
      const int32_t* w = &want[(static_cast<size_t>(b) * hkv + h) * kMaxAnchors];
      EXPECT_EQ(std::vector<int32_t>(g, g + kMaxAnchors), std::vector<int32_t>(w, w + kMaxAnchors));
    }
}

INSTANTIATE_TEST_SUITE_P(, SelectAnchorsGpu, ::testing::ValuesIn(kAnchorCases), spade::test::CaseName());

TEST_F(SelectAnchorsGpu, RefusesBadArguments) {
  SelectAnchorsParams p;
  p.dtype = DType::BF16;
  p.batch = 1;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 128;
  p.page_size = 16;
  p.max_pages_per_seq = 4;
  EXPECT_EQ(select_anchors(p, nullptr), cudaErrorInvalidValue);  // pointers unset
  int32_t* dummy = nullptr;
  ASSERT_EQ(cudaMalloc(&dummy, 1024), cudaSuccess);
  p.windows = p.k_cache = dummy;
  p.window_idx = p.num_queries = p.context_len = p.block_table = p.anchor_rows = dummy;
  p.anchors = dummy;
  p.num_windows = 1;
  p.window_capacity = kMaxAnchorWindow + 1;
  EXPECT_EQ(select_anchors(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("window_capacity"), std::string::npos)
      << launch_error_detail();
  p.window_capacity = 8;
  p.span = 0;
  EXPECT_EQ(select_anchors(p, nullptr), cudaErrorInvalidValue);
  p.span = 4;
  EXPECT_EQ(select_anchors(p, nullptr), cudaErrorInvalidValue);  // no workspace
  EXPECT_NE(std::string(launch_error_detail()).find("workspace"), std::string::npos) << launch_error_detail();
  p.workspace = dummy;
  p.workspace_bytes = select_anchors_workspace_bytes(p.batch, p.num_q_heads, p.num_kv_heads, 8) - 1;
  EXPECT_EQ(select_anchors(p, nullptr), cudaErrorInvalidValue);  // one byte short
  EXPECT_NE(std::string(launch_error_detail()).find("workspace_bytes"), std::string::npos) << launch_error_detail();
  cudaFree(dummy);
}

// ---- spans ----

TEST(ApplyAnchorSpansGpu, MatchesReference) {
  std::mt19937_64 rng(99);
  const int rows_per_batch = 2, batch = 5, rows = batch * rows_per_batch, stride = 600;
  std::vector<int32_t> lens = {600, 0, 40, 333, 17};
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> pos(0, 650);
  for (int budget : {0, 67, 68, 136, 400}) {
    for (bool successor : {false, true}) {
      for (int first_pos : {0, 4}) {
        SCOPED_TRACE("budget " + std::to_string(budget) + (successor ? " successor" : "") + " first_pos " +
                     std::to_string(first_pos));
        std::vector<float> scores(static_cast<size_t>(rows) * stride);
        for (float& x : scores) x = nd(rng);
        // 2 rows more than there are score rows: rows read their anchors through anchor_rows (reversed).
        std::vector<int32_t> anchors(static_cast<size_t>(rows + 2) * kMaxAnchors, -1), anchor_rows(rows);
        for (int r = 0; r < rows + 2; ++r) {
          const int n = r % (kMaxAnchors + 1);
          for (int a = 0; a < n; ++a) anchors[static_cast<size_t>(r) * kMaxAnchors + a] = pos(rng);
        }
        std::vector<int32_t> ref_anchors(static_cast<size_t>(rows) * kMaxAnchors);
        for (int r = 0; r < rows; ++r) {
          anchor_rows[static_cast<size_t>(r)] = rows + 1 - r;
          std::copy_n(&anchors[static_cast<size_t>(rows + 1 - r) * kMaxAnchors], kMaxAnchors,
                      &ref_anchors[static_cast<size_t>(r) * kMaxAnchors]);
        }
        std::vector<int32_t> ref_lens(static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r)
          ref_lens[static_cast<size_t>(r)] = lens[static_cast<size_t>(r / rows_per_batch)];
        std::vector<float> want = scores;
        ApplyAnchorSpansRefParams rp;
        rp.scores = want.data();
        rp.row_lens = ref_lens.data();
        rp.anchors = ref_anchors.data();
        rp.rows = rows;
        rp.score_stride = stride;
        rp.first_pos = first_pos;
        rp.span = 16;
        rp.budget = budget;
        rp.successor = successor;
        apply_anchor_spans_ref(rp);

        DevBuf<float> d_scores;
        d_scores.upload(scores);
        DevBuf<int32_t> d_lens, d_anchors, d_rows;
        d_lens.upload(lens);
        d_anchors.upload(anchors);
        d_rows.upload(anchor_rows);
        ApplyAnchorSpansParams p;
        p.scores = d_scores.get();
        p.row_lens = d_lens.get();
        p.anchors = d_anchors.get();
        p.anchor_rows = d_rows.get();
        p.rows = rows;
        p.rows_per_batch = rows_per_batch;
        p.score_stride = stride;
        p.first_pos = first_pos;
        p.span = 16;
        p.budget = budget;
        p.successor = successor;
        SPADE_CUDA_OK(apply_anchor_spans(p, nullptr));
        SPADE_CUDA_OK(cudaDeviceSynchronize());
        const std::vector<float> got = d_scores.download();
        ASSERT_EQ(got.size(), want.size());
        size_t infs = 0, diffs = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          infs += std::isinf(want[i]) ? 1 : 0;
          diffs += (got[i] != want[i]) ? 1 : 0;
        }
        EXPECT_EQ(diffs, 0u);
        if (budget >= 136) EXPECT_GT(infs, 0u) << "the case sets no span";
        if (budget / 4 < 16 + (successor ? 1 : 0))
          EXPECT_EQ(infs, 0u) << "no span fits in a quarter of the budget";
      }
    }
  }
}

TEST(QueryWindowGpu, AnchorWindowCapacityIsAccepted) {
  DevBuf<uint16_t> win(2 * kMaxAnchorWindow * 64), q(64);
  DevBuf<int32_t> len, idx, cu;
  len.upload({0});
  idx.upload({0});
  cu.upload({0, 1});
  PushQueryWindowParams p;
  p.windows = win.get();
  p.window_len = len.get();
  p.window_idx = idx.get();
  p.q = q.get();
  p.cu_tokens = cu.get();
  p.num_windows = 1;
  p.rows = 1;
  p.num_heads = 1;
  p.head_dim = 64;
  p.capacity = kMaxAnchorWindow;
  SPADE_CUDA_OK(push_query_window(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(len.download()[0], 1);
  p.capacity = kMaxAnchorWindow + 1;
  EXPECT_EQ(push_query_window(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace spade::kernels
