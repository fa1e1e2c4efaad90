// GPU tests: paged split-K decode attention and the two token-sparse decode variants against their CPU references
// (kernels/paged_attention_ref.h, kernels/sparse_attention_ref.h), on fresh random bf16/fp16 inputs with poisoned
// outputs, over lengths 1..128k, page sizes 16/32/64, GQA groups 1/4/8, head dims 64/128/256 and ragged batches.
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
#include "kernels/sparse_attention_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::PagedCache;

using spade::test::name_dtype;
using spade::test::name_ints;

/// "bf16_D128_page16_hkv8_group4": the attention shape of a case (group = num_q_heads / num_kv_heads).
std::string shape_name(DType dtype, int head_dim, int page_size, int num_q_heads, int num_kv_heads) {
  return std::string(name_dtype(dtype)) + "_D" + std::to_string(head_dim) + "_page" + std::to_string(page_size) +
         "_hkv" + std::to_string(num_kv_heads) + "_group" + std::to_string(num_q_heads / num_kv_heads);
}

struct DecodeCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> lens;  // per sequence
  int num_splits = 0;     // 0 = heuristic
  uint64_t seed = 0;
};

std::string case_name(const DecodeCase& c) {
  return spade::test::long_prefix(spade::test::max_of(c.lens) >= spade::test::kLongContext) +
         shape_name(c.dtype, c.head_dim, c.page_size, c.num_q_heads, c.num_kv_heads) + "_lens" + name_ints(c.lens) +
         (c.num_splits != 0 ? "_splits" + std::to_string(c.num_splits) : "");
}

std::string describe(const DecodeCase& c) {
  std::string s = std::string(spade::test::dtype_str(c.dtype)) + " D=" + std::to_string(c.head_dim) +
                  " ps=" + std::to_string(c.page_size) + " hq=" + std::to_string(c.num_q_heads) +
                  " hkv=" + std::to_string(c.num_kv_heads) + " splits=" + std::to_string(c.num_splits) + " lens=";
  for (int l : c.lens) s += std::to_string(l) + ",";
  return s;
}

class Workspace {
 public:
  Workspace(int batch, int hq, int hkv, int d) {
    bytes_ = decode_workspace_bytes(batch, hq, hkv, d);
    buf_.alloc(bytes_);
    EXPECT_EQ(decode_workspace_init({buf_.get(), bytes_}, nullptr), cudaSuccess);
  }
  DecodeWorkspace get() const { return {buf_.get(), bytes_}; }

 private:
  DevBuf<unsigned char> buf_;
  size_t bytes_ = 0;
};

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << describe(c) << " seed=" << c.seed; }

void run_paged_decode(const DecodeCase& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed);
  const int batch = static_cast<int>(c.lens.size());
  const int D = c.head_dim;
  PagedCache cache;
  cache.build(c.dtype, c.lens, c.page_size, c.num_kv_heads, D, rng);
  std::vector<float> q32;
  DevBuf<uint16_t> q;
  q.upload(spade::test::random_half(c.dtype, static_cast<size_t>(batch) * c.num_q_heads * D, 1.f, rng, &q32));
  DevBuf<int32_t> seq_lens;
  seq_lens.upload(std::vector<int32_t>(c.lens.begin(), c.lens.end()));
  DevBuf<uint16_t> out(static_cast<size_t>(batch) * c.num_q_heads * D);
  DevBuf<float> lse(static_cast<size_t>(batch) * c.num_q_heads);
  Workspace ws(batch, c.num_q_heads, c.num_kv_heads, D);

  // CPU reference on the exact fp32 images.
  std::vector<int32_t> cu(batch + 1);
  for (int b = 0; b <= batch; ++b) cu[b] = b;
  std::vector<float> ref(out.size()), ref_lse(lse.size());
  PagedAttentionParams rp;
  rp.q = q32.data();
  rp.k_cache = cache.k32.data();
  rp.v_cache = cache.v32.data();
  rp.block_table = cache.block_table.data();
  rp.cu_q_lens = cu.data();
  rp.seq_lens = c.lens.data();
  rp.out = ref.data();
  rp.lse = ref_lse.data();
  rp.batch = batch;
  rp.num_q_heads = c.num_q_heads;
  rp.num_kv_heads = c.num_kv_heads;
  rp.head_dim = D;
  rp.page_size = c.page_size;
  rp.max_pages_per_seq = cache.max_pages;
  rp.scale = 1.f / std::sqrt(static_cast<float>(D));
  paged_attention_ref(rp);

  PagedDecodeParams p;
  p.dtype = c.dtype;
  p.q = q.get();
  p.k_cache = cache.k.get();
  p.v_cache = cache.v.get();
  p.block_table = cache.bt.get();
  p.seq_lens = seq_lens.get();
  p.out = out.get();
  p.lse = lse.get();
  p.batch = batch;
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = D;
  p.page_size = c.page_size;
  p.max_pages_per_seq = cache.max_pages;
  p.max_seq_len = *std::max_element(c.lens.begin(), c.lens.end());
  p.scale = rp.scale;
  p.num_splits = c.num_splits;
  p.workspace = ws.get();
  for (int rep = 0; rep < 2; ++rep) {  // twice: the workspace counters must be left at zero
    out.poison();
    lse.poison();
    SPADE_CUDA_OK(paged_decode_attention(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = spade::test::to_f32(c.dtype, out.download());
    const double err = spade::test::max_row_rel_err(got, ref, D);
    EXPECT_LE(err, spade::test::attention_tolerance(c.dtype)) << "rep " << rep;
    const std::vector<float> got_lse = lse.download();
    for (size_t i = 0; i < got_lse.size(); ++i) {
      ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << i;
    }
  }
}

// clang-format off
const std::vector<DecodeCase> kPagedDecodeCases = {
    // ragged batch
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {1, 17, 300, 2500, 4096}, .seed = 1},
    {.dtype = DType::F16, .head_dim = 128, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {33, 1000, 7777}, .seed = 2},
    {.dtype = DType::BF16, .head_dim = 64, .page_size = 64, .num_q_heads = 4, .num_kv_heads = 4,
     .lens = {5, 64, 65, 3000}, .seed = 3},
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {129, 2049}, .seed = 4},
    {.dtype = DType::F16, .head_dim = 256, .page_size = 64, .num_q_heads = 2, .num_kv_heads = 2,
     .lens = {1, 50, 515}, .seed = 5},
    {.dtype = DType::BF16, .head_dim = 64, .page_size = 32, .num_q_heads = 8, .num_kv_heads = 1,
     .lens = {10000, 3}, .seed = 6},
    {.dtype = DType::F16, .head_dim = 64, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {32768}, .seed = 7},
    // forced split counts: one split, the most splits
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {1, 700, 3000}, .num_splits = 1, .seed = 8},
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {1, 700, 3000}, .num_splits = kMaxDecodeSplits, .seed = 9},
    // long contexts (names start with "Long_")
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {131072, 70001}, .seed = 10},
    {.dtype = DType::F16, .head_dim = 256, .page_size = 32, .num_q_heads = 8, .num_kv_heads = 1,
     .lens = {65536}, .seed = 11},
};
// clang-format on

class PagedDecodeGpu : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(PagedDecodeGpu, MatchesReference) { run_paged_decode(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, PagedDecodeGpu, ::testing::ValuesIn(kPagedDecodeCases), spade::test::CaseName());

TEST_F(PagedDecodeGpu, RejectsBadParameters) {
  PagedDecodeParams p;
  p.dtype = DType::BF16;
  int dummy = 0;
  p.q = p.k_cache = p.v_cache = p.out = &dummy;
  p.block_table = p.seq_lens = &dummy;
  p.batch = 1;
  p.num_q_heads = 8;
  p.num_kv_heads = 8;
  p.head_dim = 96;
  p.page_size = 16;
  p.max_pages_per_seq = 1;
  p.max_seq_len = 16;
  p.scale = 0.1f;
  EXPECT_EQ(paged_decode_attention(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("head_dim"), std::string::npos) << launch_error_detail();
  p.head_dim = 128;
  p.page_size = 24;
  EXPECT_EQ(paged_decode_attention(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("page_size"), std::string::npos) << launch_error_detail();
  p.page_size = 16;
  p.num_kv_heads = 1;  // group 8 ok, then 16 too large
  p.num_q_heads = 16;
  EXPECT_EQ(paged_decode_attention(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("GQA group"), std::string::npos) << launch_error_detail();
}

// One workspace, launches of different batch sizes in turn (a serving engine's steps): a small batch's split-K
// partials must not land where a larger batch's arrival counters are (they did when the layout followed each
// launch's batch: rows 32.. of the 64-row launch then merged unwritten partials).
TEST_F(PagedDecodeGpu, OneWorkspaceServesEveryBatchSizeInTurn) {
  const int hq = 8, hkv = 2, D = 128, ps = 16, big = 64;
  std::mt19937_64 rng(77);
  const std::vector<int> lens(big, 600);
  PagedCache cache;
  cache.build(DType::BF16, lens, ps, hkv, D, rng);
  std::vector<float> q32;
  DevBuf<uint16_t> q;
  q.upload(spade::test::random_half(DType::BF16, static_cast<size_t>(big) * hq * D, 1.f, rng, &q32));
  DevBuf<int32_t> seq_lens;
  seq_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  DevBuf<uint16_t> out(static_cast<size_t>(big) * hq * D);
  Workspace ws(big, hq, hkv, D);

  std::vector<int32_t> cu(big + 1);
  for (int b = 0; b <= big; ++b) cu[b] = b;
  std::vector<float> ref(out.size());
  PagedAttentionParams rp;
  rp.q = q32.data();
  rp.k_cache = cache.k32.data();
  rp.v_cache = cache.v32.data();
  rp.block_table = cache.block_table.data();
  rp.cu_q_lens = cu.data();
  rp.seq_lens = lens.data();
  rp.out = ref.data();
  rp.batch = big;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = ps;
  rp.max_pages_per_seq = cache.max_pages;
  rp.scale = 1.f / std::sqrt(static_cast<float>(D));
  paged_attention_ref(rp);

  PagedDecodeParams p;
  p.q = q.get();
  p.k_cache = cache.k.get();
  p.v_cache = cache.v.get();
  p.block_table = cache.bt.get();
  p.seq_lens = seq_lens.get();
  p.out = out.get();
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.max_seq_len = 600;
  p.scale = rp.scale;
  p.num_splits = 4;  // split-K with arrival counters
  p.workspace = ws.get();
  for (const int batch : {4, big, 16, big}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    p.batch = batch;
    out.poison();
    SPADE_CUDA_OK(paged_decode_attention(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got = spade::test::to_f32(DType::BF16, out.download());
    got.resize(static_cast<size_t>(batch) * hq * D);
    const std::vector<float> want(ref.begin(), ref.begin() + static_cast<long>(got.size()));
    EXPECT_LE(spade::test::max_row_rel_err(got, want, D), spade::test::attention_tolerance(DType::BF16));
  }
}

// ---- token-sparse: index list into the paged cache ----

struct SparseIndexedCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> lens;    // per sequence
  std::vector<int> counts;  // indices per sequence (and KV head)
  int index_stride = 0;
  uint64_t seed = 0;
};

std::string case_name(const SparseIndexedCase& c) {
  return spade::test::long_prefix(spade::test::max_of(c.lens) >= spade::test::kLongContext) +
         shape_name(c.dtype, c.head_dim, c.page_size, c.num_q_heads, c.num_kv_heads) + "_lens" + name_ints(c.lens) +
         "_counts" + name_ints(c.counts) + "_stride" + std::to_string(c.index_stride);
}

void PrintTo(const SparseIndexedCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_sparse_indexed(const SparseIndexedCase& c) {
  const DType dtype = c.dtype;
  const int D = c.head_dim, ps = c.page_size, hq = c.num_q_heads, hkv = c.num_kv_heads, stride = c.index_stride;
  const std::vector<int>& lens = c.lens;
  const std::vector<int>& counts = c.counts;
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(spade::test::dtype_str(dtype)) + " D=" + std::to_string(D) + " ps=" + std::to_string(ps) +
               " stride=" + std::to_string(stride));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(lens.size());
  PagedCache cache;
  cache.build(dtype, lens, ps, hkv, D, rng);
  std::vector<float> q32;
  DevBuf<uint16_t> q;
  q.upload(spade::test::random_half(dtype, static_cast<size_t>(batch) * hq * D, 1.f, rng, &q32));
  // Distinct random positions per (sequence, KV head), in random order.
  std::vector<int32_t> idx(static_cast<size_t>(batch) * hkv * stride, -7);
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> all(lens[b]);
    std::iota(all.begin(), all.end(), 0);
    for (int h = 0; h < hkv; ++h) {
      std::shuffle(all.begin(), all.end(), rng);
      std::copy(all.begin(), all.begin() + counts[b], idx.begin() + (static_cast<size_t>(b) * hkv + h) * stride);
    }
  }
  DevBuf<int32_t> d_idx, d_cnt;
  d_idx.upload(idx);
  d_cnt.upload(std::vector<int32_t>(counts.begin(), counts.end()));
  DevBuf<uint16_t> out(static_cast<size_t>(batch) * hq * D);
  DevBuf<float> lse(static_cast<size_t>(batch) * hq);
  Workspace ws(batch, hq, hkv, D);

  std::vector<float> ref(out.size()), ref_lse(lse.size());
  SparseIndexAttentionRefParams rp;
  rp.q = q32.data();
  rp.k_cache = cache.k32.data();
  rp.v_cache = cache.v32.data();
  rp.block_table = cache.block_table.data();
  rp.indices = idx.data();
  rp.num_indices = counts.data();
  rp.out = ref.data();
  rp.lse = ref_lse.data();
  rp.batch = batch;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = ps;
  rp.max_pages_per_seq = cache.max_pages;
  rp.index_stride = stride;
  rp.scale = 1.f / std::sqrt(static_cast<float>(D));
  sparse_index_attention_ref(rp);

  SparseIndexDecodeParams p;
  p.dtype = dtype;
  p.q = q.get();
  p.k_cache = cache.k.get();
  p.v_cache = cache.v.get();
  p.block_table = cache.bt.get();
  p.indices = d_idx.get();
  p.num_indices = d_cnt.get();
  p.out = out.get();
  p.lse = lse.get();
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.index_stride = stride;
  p.scale = rp.scale;
  p.workspace = ws.get();
  out.poison();
  lse.poison();
  SPADE_CUDA_OK(sparse_decode_attention_indexed(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = spade::test::to_f32(dtype, out.download());
  // Rows of empty sequences are exact zeros (the relative metric would divide by zero).
  for (int b = 0; b < batch; ++b) {
    if (counts[b] != 0) continue;
    for (int i = 0; i < hq * D; ++i) ASSERT_EQ(got[static_cast<size_t>(b) * hq * D + i], 0.f);
    for (int i = 0; i < hq * D; ++i) ref[static_cast<size_t>(b) * hq * D + i] = 0.f;
  }
  std::vector<float> got_nz, ref_nz;
  for (int b = 0; b < batch; ++b) {
    if (counts[b] == 0) continue;
    got_nz.insert(got_nz.end(), got.begin() + static_cast<size_t>(b) * hq * D, got.begin() + static_cast<size_t>(b + 1) * hq * D);
    ref_nz.insert(ref_nz.end(), ref.begin() + static_cast<size_t>(b) * hq * D, ref.begin() + static_cast<size_t>(b + 1) * hq * D);
  }
  EXPECT_LE(spade::test::max_row_rel_err(got_nz, ref_nz, D), spade::test::attention_tolerance(dtype));
  const std::vector<float> got_lse = lse.download();
  for (size_t i = 0; i < got_lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      EXPECT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse row " << i;
    } else {
      ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << i;
    }
  }
}

// clang-format off
const std::vector<SparseIndexedCase> kSparseIndexedCases = {
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {5000, 3000, 40}, .counts = {2048, 1000, 40}, .index_stride = 2048, .seed = 21},
    // sequence 1 selects nothing (an empty row: exact zeros, lse -inf)
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {900, 77, 3000}, .counts = {600, 0, 1}, .index_stride = 700, .seed = 22},
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 64, .num_q_heads = 4, .num_kv_heads = 4,
     .lens = {3000, 4100}, .counts = {1500, 4095}, .index_stride = 4096, .seed = 23},
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {131072}, .counts = {4096}, .index_stride = 4096, .seed = 24},
};
// clang-format on

class SparseIndexedDecodeGpu : public ::testing::TestWithParam<SparseIndexedCase> {};

TEST_P(SparseIndexedDecodeGpu, MatchesReference) { run_sparse_indexed(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, SparseIndexedDecodeGpu, ::testing::ValuesIn(kSparseIndexedCases), spade::test::CaseName());

// ---- token-sparse: packed gathered buffer + local window ----

// `windows` / `rows` (optional, per sequence): the serving variant that mixes sparse and dense sequences in one
// launch -- per-sequence windows (window = the host-side bound) and packed rows from per-slot held tables.
// `q_rows` (optional, per sequence, with `num_q_rows` rows of q / out): the decode rows of a mixed prefill + decode
// step -- sequence b's query is row q_rows[b] of the step's layout, -1 = skipped. Rows no sequence names must keep
// their poison (bit for bit), as must every row when all are skipped. `drop_outside_window`: every block-table
// entry of a page that lies entirely before the window is -1 (the GPU path drops those pages).
struct SparsePackedCase {
  DType dtype = DType::BF16;
  int head_dim = 128;
  int page_size = 16;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  std::vector<int> lens;    // per sequence
  std::vector<int> counts;  // packed (selected) tokens per sequence
  int capacity = 0;         // packed rows per (sequence, KV head)
  int window = 0;           // local window (the bound of `windows`)
  std::vector<int32_t> windows = {};  // optional per-sequence windows
  std::vector<int32_t> rows = {};     // optional per-sequence packed rows
  std::vector<int32_t> q_rows = {};   // optional per-sequence q rows (-1: skipped) of num_q_rows
  int num_q_rows = 0;
  bool drop_outside_window = false;
  uint64_t seed = 0;
};

std::string case_name(const SparsePackedCase& c) {
  return shape_name(c.dtype, c.head_dim, c.page_size, c.num_q_heads, c.num_kv_heads) + "_lens" + name_ints(c.lens) +
         "_counts" + name_ints(c.counts) + "_cap" + std::to_string(c.capacity) + "_window" + std::to_string(c.window) +
         (c.windows.empty() ? "" : "_windows" + name_ints(c.windows)) +
         (c.rows.empty() ? "" : "_rows" + name_ints(c.rows)) +
         (c.q_rows.empty() ? "" : "_qrows" + name_ints(c.q_rows) + "_of" + std::to_string(c.num_q_rows)) +
         (c.drop_outside_window ? "_droppedpages" : "");
}

void PrintTo(const SparsePackedCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_sparse_packed(const SparsePackedCase& c) {
  const DType dtype = c.dtype;
  const int D = c.head_dim, ps = c.page_size, hq = c.num_q_heads, hkv = c.num_kv_heads, capacity = c.capacity,
            window = c.window, num_q_rows = c.num_q_rows;
  const std::vector<int>& lens = c.lens;
  const std::vector<int>& counts = c.counts;
  const std::vector<int32_t>& windows = c.windows;
  const std::vector<int32_t>& rows = c.rows;
  const std::vector<int32_t>& q_rows = c.q_rows;
  const bool drop_outside_window = c.drop_outside_window;
  const uint64_t seed = c.seed;
  SCOPED_TRACE(std::string(spade::test::dtype_str(dtype)) + " D=" + std::to_string(D) + " ps=" + std::to_string(ps) +
               " cap=" + std::to_string(capacity) + " window=" + std::to_string(window) +
               (windows.empty() ? "" : " per-sequence windows") + (rows.empty() ? "" : " packed rows") +
               (q_rows.empty() ? "" : " q rows") + (drop_outside_window ? " dropped pages" : ""));
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(lens.size());
  const int qn = q_rows.empty() ? batch : num_q_rows;
  PagedCache cache;
  cache.build(dtype, lens, ps, hkv, D, rng);
  if (drop_outside_window) {
    for (int b = 0; b < batch; ++b) {
      const int wl = std::min(windows.empty() ? window : windows[static_cast<size_t>(b)], lens[static_cast<size_t>(b)]);
      for (int pg = 0; (pg + 1) * ps <= lens[static_cast<size_t>(b)] - wl; ++pg)
        cache.block_table[static_cast<size_t>(b) * cache.max_pages + pg] = -1;
    }
    cache.bt.upload(cache.block_table);
  }
  std::vector<float> q32, pk32, pv32;
  DevBuf<uint16_t> q, pk, pv;
  q.upload(spade::test::random_half(dtype, static_cast<size_t>(qn) * hq * D, 1.f, rng, &q32));
  const int packed_rows = rows.empty() ? batch : *std::max_element(rows.begin(), rows.end()) + 1;
  const size_t packed_n = static_cast<size_t>(packed_rows) * hkv * capacity * D;
  pk.upload(spade::test::random_half(dtype, packed_n, 1.f, rng, &pk32));
  pv.upload(spade::test::random_half(dtype, packed_n, 1.f, rng, &pv32));
  DevBuf<int32_t> d_cnt, d_lens;
  d_cnt.upload(std::vector<int32_t>(counts.begin(), counts.end()));
  d_lens.upload(std::vector<int32_t>(lens.begin(), lens.end()));
  DevBuf<uint16_t> out(static_cast<size_t>(qn) * hq * D);
  DevBuf<float> lse(static_cast<size_t>(qn) * hq);
  Workspace ws(batch, hq, hkv, D);

  std::vector<float> ref(out.size()), ref_lse(lse.size());
  SparsePackedAttentionRefParams rp;
  rp.q = q32.data();
  rp.packed_k = pk32.data();
  rp.packed_v = pv32.data();
  rp.num_packed = counts.data();
  rp.k_cache = cache.k32.data();
  rp.v_cache = cache.v32.data();
  rp.block_table = cache.block_table.data();
  rp.seq_lens = lens.data();
  rp.out = ref.data();
  rp.lse = ref_lse.data();
  rp.batch = batch;
  rp.num_q_heads = hq;
  rp.num_kv_heads = hkv;
  rp.head_dim = D;
  rp.page_size = ps;
  rp.max_pages_per_seq = cache.max_pages;
  rp.packed_capacity = capacity;
  rp.local_window = window;
  rp.scale = 1.f / std::sqrt(static_cast<float>(D));
  rp.local_windows = windows.empty() ? nullptr : windows.data();
  rp.packed_rows = rows.empty() ? nullptr : rows.data();
  rp.q_rows = q_rows.empty() ? nullptr : q_rows.data();
  sparse_packed_attention_ref(rp);
  DevBuf<int32_t> d_windows, d_rows, d_q_rows;
  if (!windows.empty()) d_windows.upload(windows);
  if (!rows.empty()) d_rows.upload(rows);
  if (!q_rows.empty()) d_q_rows.upload(q_rows);

  SparsePackedDecodeParams p;
  p.dtype = dtype;
  p.q = q.get();
  p.packed_k = pk.get();
  p.packed_v = pv.get();
  p.num_packed = d_cnt.get();
  p.k_cache = cache.k.get();
  p.v_cache = cache.v.get();
  p.block_table = cache.bt.get();
  p.seq_lens = d_lens.get();
  p.out = out.get();
  p.lse = lse.get();
  p.batch = batch;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = D;
  p.page_size = ps;
  p.max_pages_per_seq = cache.max_pages;
  p.packed_capacity = capacity;
  p.local_window = window;
  p.scale = rp.scale;
  p.workspace = ws.get();
  p.local_windows = windows.empty() ? nullptr : d_windows.get();
  p.packed_rows = rows.empty() ? nullptr : d_rows.get();
  p.q_rows = q_rows.empty() ? nullptr : d_q_rows.get();
  out.poison();
  lse.poison();
  SPADE_CUDA_OK(sparse_decode_attention_packed(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  if (q_rows.empty()) {
    const std::vector<float> got = spade::test::to_f32(dtype, out.download());
    EXPECT_LE(spade::test::max_row_rel_err(got, ref, D), spade::test::attention_tolerance(dtype));
    const std::vector<float> got_lse = lse.download();
    for (size_t i = 0; i < got_lse.size(); ++i) {
      ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << i;
    }
    return;
  }
  // Rows named by q_rows: the reference; every other row keeps its poison.
  std::vector<char> named(static_cast<size_t>(qn), 0);
  for (int32_t r : q_rows)
    if (r >= 0) named[static_cast<size_t>(r)] = 1;
  const std::vector<uint16_t> bits = out.download();
  const std::vector<float> got_lse = lse.download();
  const size_t row = static_cast<size_t>(hq) * D;
  std::vector<float> got_named, ref_named;
  for (int r = 0; r < qn; ++r) {
    const size_t o = static_cast<size_t>(r) * row;
    if (named[static_cast<size_t>(r)] == 0) {
      for (size_t i = 0; i < row; ++i) ASSERT_EQ(bits[o + i], 0xFFFFu) << "unnamed q row " << r << " was written";
      for (int h = 0; h < hq; ++h) {
        uint32_t w = 0;
        std::memcpy(&w, &got_lse[static_cast<size_t>(r) * hq + h], 4);
        ASSERT_EQ(w, 0xFFFFFFFFu) << "unnamed lse row " << r << " was written";
      }
      continue;
    }
    const std::vector<uint16_t> rb(bits.begin() + static_cast<long>(o), bits.begin() + static_cast<long>(o + row));
    const std::vector<float> rf = spade::test::to_f32(dtype, rb);
    got_named.insert(got_named.end(), rf.begin(), rf.end());
    ref_named.insert(ref_named.end(), ref.begin() + static_cast<long>(o), ref.begin() + static_cast<long>(o + row));
    for (int h = 0; h < hq; ++h) {
      const size_t i = static_cast<size_t>(r) * hq + h;
      ASSERT_NEAR(got_lse[i], ref_lse[i], 1e-3 + 1e-4 * std::fabs(ref_lse[i])) << "lse row " << r;
    }
  }
  if (!ref_named.empty()) {
    EXPECT_LE(spade::test::max_row_rel_err(got_named, ref_named, D), spade::test::attention_tolerance(dtype));
  }
}

// clang-format off
const std::vector<SparsePackedCase> kSparsePackedCases = {
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {5000, 100, 30}, .counts = {2048, 36, 0}, .capacity = 2048, .window = 64, .seed = 31},
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {700, 3}, .counts = {300, 1}, .capacity = 512, .window = 17, .seed = 32},
    // no window
    {.dtype = DType::BF16, .head_dim = 256, .page_size = 64, .num_q_heads = 2, .num_kv_heads = 2,
     .lens = {64, 64}, .counts = {1000, 999}, .capacity = 1000, .window = 0, .seed = 33},
    // A serving batch: sequences 0 and 2 sparse (selection + window 32), 1 and 3 dense (no selection, the whole
    // context as the window), selections held in per-slot tables (rows 5, -, 2, -; dense rows point anywhere valid).
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {4000, 700, 3000, 65}, .counts = {512, 0, 300, 0}, .capacity = 512, .window = 4000,
     .windows = {32, 700, 32, 65}, .rows = {5, 0, 2, 6}, .seed = 34},
    // per-sequence windows within the bound
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {900, 40, 2}, .counts = {100, 7, 0}, .capacity = 128, .window = 64,
     .windows = {64, 0, 2}, .seed = 35},
    // The sparse decode rows of a mixed prefill + decode step (q_rows): sequences 0, 2 and 3 decode sparsely at rows
    // 7, 0 and 12 of a 14-row step (the other rows are prefill chunks, left to the prefill kernel: their poison must
    // survive); sequence 1 is skipped. Long contexts, so the split-K merge runs, over block tables whose pages
    // before the window are dropped (-1: must never be read).
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 32, .num_kv_heads = 8,
     .lens = {5000, 700, 3000, 47}, .counts = {1024, 0, 512, 15}, .capacity = 1024, .window = 32,
     .windows = {32, 32, 32, 32}, .rows = {2, 0, 1, 3}, .q_rows = {7, -1, 0, 12}, .num_q_rows = 14,
     .drop_outside_window = true, .seed = 36},
    // q rows with per-sequence windows
    {.dtype = DType::F16, .head_dim = 64, .page_size = 32, .num_q_heads = 16, .num_kv_heads = 2,
     .lens = {90, 40}, .counts = {20, 7}, .capacity = 64, .window = 17,
     .windows = {17, 9}, .q_rows = {3, 1}, .num_q_rows = 5, .drop_outside_window = true, .seed = 37},
    // every row skipped: nothing is written
    {.dtype = DType::BF16, .head_dim = 128, .page_size = 16, .num_q_heads = 8, .num_kv_heads = 2,
     .lens = {300, 20}, .counts = {64, 4}, .capacity = 64, .window = 16,
     .q_rows = {-1, -1}, .num_q_rows = 3, .seed = 38},
};
// clang-format on

class SparsePackedDecodeGpu : public ::testing::TestWithParam<SparsePackedCase> {};

TEST_P(SparsePackedDecodeGpu, MatchesReference) { run_sparse_packed(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, SparsePackedDecodeGpu, ::testing::ValuesIn(kSparsePackedCases), spade::test::CaseName());

TEST_F(SparsePackedDecodeGpu, RejectsMisalignedPerSequenceArrays) {
  DevBuf<int32_t> arr(8);
  DevBuf<uint16_t> buf(1024);
  SparsePackedDecodeParams p;
  p.q = buf.get();
  p.out = buf.get();
  p.packed_k = buf.get();
  p.packed_v = buf.get();
  p.k_cache = buf.get();
  p.v_cache = buf.get();
  p.block_table = arr.get();
  p.num_packed = arr.get();
  p.seq_lens = arr.get();
  p.batch = 1;
  p.num_q_heads = 2;
  p.num_kv_heads = 2;
  p.head_dim = 64;
  p.page_size = 16;
  p.max_pages_per_seq = 1;
  p.packed_capacity = 4;
  p.local_window = 4;
  p.scale = 0.125f;
  p.q_rows = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(arr.get()) + 2);
  EXPECT_EQ(sparse_decode_attention_packed(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("q_rows"), std::string::npos) << launch_error_detail();
  (void)cudaGetLastError();
}

}  // namespace
}  // namespace spade::kernels
