// GPU tests: causal paged prefill (FlashAttention-2 style) against paged_attention_ref, including chunked prefill
// (q_len < seq_len), single-token rows and ragged batches, bf16/fp16, head dims 64/128/256, GQA groups 1/4/8; and
// `skip` (the sparse decode rows of a mixed step, whose pages outside the window are dropped): skipped rows keep
// their poison and their -1 block-table entries are never read.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.cuh"
#include "kernels/paged_attention_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::PagedCache;

struct PrefillCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> q_lens;    // query tokens per sequence (the chunk)
  std::vector<int> seq_lens;  // context per sequence, the chunk included
  std::vector<int32_t> skip = {};  // optional [batch]: nonzero = skipped (its pages are then dropped: -1)
  uint64_t seed = 0;
};

/// A chunk of this many query tokens or more makes a case long (its name starts with "Long_": bench/run_gpu.sh's
/// memcheck leaves those out by default).
constexpr int kLongPrefillChunk = 1024;

std::string case_name(const PrefillCase& c) {
  using spade::test::name_ints;
  return spade::test::long_prefix(spade::test::max_of(c.q_lens) >= kLongPrefillChunk) +
         spade::test::name_dtype(c.dtype) + "_D" + std::to_string(c.head_dim) + "_page" +
         std::to_string(c.page_size) + "_hkv" + std::to_string(c.num_kv_heads) + "_group" +
         std::to_string(c.num_q_heads / c.num_kv_heads) + "_qlens" + name_ints(c.q_lens) + "_seqlens" +
         name_ints(c.seq_lens) + (c.skip.empty() ? "" : "_skip" + name_ints(c.skip));
}

void PrintTo(const PrefillCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_prefill(const PrefillCase& c) {
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(spade::test::dtype_str(c.dtype)) + " D=" + std::to_string(c.head_dim) +
               " ps=" + std::to_string(c.page_size) + " hq=" + std::to_string(c.num_q_heads) +
               " hkv=" + std::to_string(c.num_kv_heads));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(c.q_lens.size());
  const int D = c.head_dim;
  PagedCache cache;
  cache.build(c.dtype, c.seq_lens, c.page_size, c.num_kv_heads, D, rng);
  if (!c.skip.empty()) {
    // A skipped sequence keeps only its last page (its local window, read by another kernel).
    for (int b = 0; b < batch; ++b) {
      if (c.skip[static_cast<size_t>(b)] == 0) continue;
      for (int pg = 0; pg + 1 < (c.seq_lens[static_cast<size_t>(b)] + c.page_size - 1) / c.page_size; ++pg)
        cache.block_table[static_cast<size_t>(b) * cache.max_pages + pg] = -1;
    }
    cache.bt.upload(cache.block_table);
  }
  std::vector<int32_t> cu(batch + 1, 0);
  for (int b = 0; b < batch; ++b) cu[b + 1] = cu[b] + c.q_lens[b];
  const int total_q = cu[batch];
  std::vector<float> q32;
  DevBuf<uint16_t> q;
  q.upload(spade::test::random_half(c.dtype, static_cast<size_t>(total_q) * c.num_q_heads * D, 1.f, rng, &q32));
  DevBuf<int32_t> d_cu, d_lens;
  d_cu.upload(cu);
  d_lens.upload(std::vector<int32_t>(c.seq_lens.begin(), c.seq_lens.end()));
  DevBuf<uint16_t> out(static_cast<size_t>(total_q) * c.num_q_heads * D);
  DevBuf<float> lse(static_cast<size_t>(total_q) * c.num_q_heads);

  std::vector<float> ref(out.size()), ref_lse(lse.size());
  PagedAttentionParams rp;
  rp.q = q32.data();
  rp.k_cache = cache.k32.data();
  rp.v_cache = cache.v32.data();
  rp.block_table = cache.block_table.data();
  rp.cu_q_lens = cu.data();
  rp.seq_lens = c.seq_lens.data();
  rp.out = ref.data();
  rp.lse = ref_lse.data();
  rp.batch = batch;
  rp.num_q_heads = c.num_q_heads;
  rp.num_kv_heads = c.num_kv_heads;
  rp.head_dim = D;
  rp.page_size = c.page_size;
  rp.max_pages_per_seq = cache.max_pages;
  rp.scale = 1.f / std::sqrt(static_cast<float>(D));
  rp.skip = c.skip.empty() ? nullptr : c.skip.data();
  paged_attention_ref(rp);
  DevBuf<int32_t> d_skip;
  if (!c.skip.empty()) d_skip.upload(c.skip);

  PagedPrefillParams p;
  p.dtype = c.dtype;
  p.q = q.get();
  p.k_cache = cache.k.get();
  p.v_cache = cache.v.get();
  p.block_table = cache.bt.get();
  p.cu_q_lens = d_cu.get();
  p.seq_lens = d_lens.get();
  p.out = out.get();
  p.lse = lse.get();
  p.batch = batch;
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = D;
  p.page_size = c.page_size;
  p.max_pages_per_seq = cache.max_pages;
  p.max_q_len = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  p.scale = rp.scale;
  p.skip = c.skip.empty() ? nullptr : d_skip.get();
  out.poison();
  lse.poison();
  SPADE_CUDA_OK(paged_prefill_attention(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  if (c.skip.empty()) {
    const std::vector<float> got = spade::test::to_f32(c.dtype, out.download());
    EXPECT_LE(spade::test::max_row_rel_err(got, ref, D), spade::test::attention_tolerance(c.dtype));
    const std::vector<float> got_lse = lse.download();
    for (size_t i = 0; i < got_lse.size(); ++i) {
      ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << i;
    }
    return;
  }
  // Rows of skipped sequences keep their poison; the others match the reference.
  const std::vector<uint16_t> bits = out.download();
  const std::vector<float> got_lse = lse.download();
  const size_t row = static_cast<size_t>(c.num_q_heads) * D;
  std::vector<float> got_kept, ref_kept;
  for (int b = 0; b < batch; ++b) {
    for (int t = cu[b]; t < cu[b + 1]; ++t) {
      const size_t o = static_cast<size_t>(t) * row;
      if (c.skip[static_cast<size_t>(b)] != 0) {
        for (size_t i = 0; i < row; ++i) ASSERT_EQ(bits[o + i], 0xFFFFu) << "skipped sequence " << b << " was written";
        for (int h = 0; h < c.num_q_heads; ++h) {
          uint32_t w = 0;
          std::memcpy(&w, &got_lse[static_cast<size_t>(t) * c.num_q_heads + h], 4);
          ASSERT_EQ(w, 0xFFFFFFFFu) << "skipped sequence " << b << ": lse written";
        }
        continue;
      }
      const std::vector<uint16_t> rb(bits.begin() + static_cast<long>(o), bits.begin() + static_cast<long>(o + row));
      const std::vector<float> rf = spade::test::to_f32(c.dtype, rb);
      got_kept.insert(got_kept.end(), rf.begin(), rf.end());
      ref_kept.insert(ref_kept.end(), ref.begin() + static_cast<long>(o), ref.begin() + static_cast<long>(o + row));
      for (int h = 0; h < c.num_q_heads; ++h) {
        const size_t i = static_cast<size_t>(t) * c.num_q_heads + h;
        ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << t;
      }
    }
  }
  if (!ref_kept.empty()) {
    EXPECT_LE(spade::test::max_row_rel_err(got_kept, ref_kept, D), spade::test::attention_tolerance(c.dtype));
  }
}

// clang-format off
const std::vector<PrefillCase> kPagedPrefillCases = {
    // ragged batch: single-token rows, chunks (q_len < seq_len), whole prompts
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .q_lens = {1, 37, 300, 129}, .seq_lens = {1, 100, 300, 1000}, .seed = 41},
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .q_lens = {65, 200}, .seq_lens = {65, 777}, .seed = 42},
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 64, .num_q_heads = 2, .num_kv_heads = 2,
     .q_lens = {100, 3}, .seq_lens = {260, 3}, .seed = 43},
    {.dtype = DType::F16, .head_dim = 128, .page_size = 64, .num_q_heads = 4, .num_kv_heads = 4,
     .q_lens = {513}, .seq_lens = {513}, .seed = 44},
    // a long chunk (name starts with "Long_")
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 4, .num_kv_heads = 1,
     .q_lens = {1024}, .seq_lens = {3000}, .seed = 45},
    // A mixed step: sequences 0 and 3 are sparse decode rows (one query each, served by the packed decode kernel,
    // their pages before the last one dropped), 1 and 4 prefill chunks, 2 a dense decode row.
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .q_lens = {1, 100, 1, 1, 37}, .seq_lens = {2000, 300, 77, 500, 37}, .skip = {1, 0, 0, 1, 0}, .seed = 46},
    // every sequence skipped
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .q_lens = {1, 1}, .seq_lens = {900, 33}, .skip = {1, 1}, .seed = 47},
};
// clang-format on

class PagedPrefillGpu : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(PagedPrefillGpu, MatchesReference) { run_prefill(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, PagedPrefillGpu, ::testing::ValuesIn(kPagedPrefillCases), spade::test::CaseName());

}  // namespace
}  // namespace spade::kernels
