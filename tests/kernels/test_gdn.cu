// GPU tests of the Gated DeltaNet kernels (kernels/gdn.cuh) against their CPU references (kernels/gdn_ref.h):
// recurrent form with and without per-draft snapshots, chunkwise buffered decode (staggered batches that mix
// flushing and non-flushing sequences, KV-only sequences compressing into chunkwise ones, ragged buffered prefill,
// explicit and device-computed flush flags, a captured CUDA graph replayed across flushes), parallel verification
// with device commits over many rounds, the recurrent-baseline commit, and launcher errors.
//
// The CPU side runs GdnCache (the CPU data path, kernels/gdn_ref.h) on the fp32 images of the same bf16/fp16 inputs;
// the GPU side mirrors its arrays in device memory and must reproduce its outputs, flags, ring metadata and
// checkpoint states. Outputs are poisoned (0xFF = NaN) before each launch. Bounds (max over (token, head) rows of
// ||gpu - ref|| / ||ref||): outputs bf16 8e-3 / fp16 2e-3 (the output is rounded to the 16-bit type once; the
// buffered u / k^ are rounded identically on both sides up to rare 1-ulp ties), checkpoint states 1e-3, recurrent
// states (no 16-bit rounding) 1e-4.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/gdn.cuh"
#include "kernels/gdn_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::test {
namespace {

using kernels::GdnBufferedGpuParams;
using kernels::GdnCache;
using kernels::GdnCacheConfig;
using kernels::GdnDims;
using kernels::GdnRecurrentGpuParams;

double out_bound(DType t) { return t == DType::BF16 ? 8e-3 : 2e-3; }
constexpr double kStateBound = 1e-3;
constexpr double kRecurrentStateBound = 1e-4;

/// One step's tokens: 16-bit q/k/v with their fp32 images, fp32 g / beta, cu_tokens.
struct Tok {
  DType dtype = DType::BF16;
  std::vector<uint16_t> q, k, v;
  std::vector<float> q32, k32, v32, g, beta;
  std::vector<int32_t> cu;
  int total() const { return cu.back(); }
  kernels::GdnTokens view32() const {
    kernels::GdnTokens t;
    t.q = q32.data();
    t.k = k32.data();
    t.v = v32.data();
    t.g = g.data();
    t.beta = beta.data();
    t.cu_tokens = cu.data();
    t.batch = static_cast<int>(cu.size()) - 1;
    return t;
  }
};

Tok make_tokens(DType t, const GdnDims& d, const std::vector<int>& counts, std::mt19937_64& rng) {
  Tok x;
  x.dtype = t;
  x.cu.assign(1, 0);
  for (int c : counts) x.cu.push_back(x.cu.back() + c);
  const size_t n = static_cast<size_t>(x.total());
  x.q = random_half(t, n * d.num_k_heads * d.head_k_dim, 1.f, rng, &x.q32);
  x.k = random_half(t, n * d.num_k_heads * d.head_k_dim, 1.f, rng, &x.k32);
  x.v = random_half(t, n * d.num_v_heads * d.head_v_dim, 1.f, rng, &x.v32);
  std::uniform_real_distribution<float> dec(-0.06f, -0.002f);
  std::normal_distribution<float> nb(0.f, 1.f);
  x.g.resize(n * d.num_v_heads);
  x.beta.resize(n * d.num_v_heads);
  for (auto& e : x.g) e = dec(rng);
  for (auto& e : x.beta) e = 1.f / (1.f + std::exp(-nb(rng)));
  return x;
}

/// Device copy of a Tok. write() reuses the allocations when the sizes match (CUDA-graph replays).
struct DevTok {
  DevBuf<uint16_t> q, k, v;
  DevBuf<float> g, beta;
  DevBuf<int32_t> cu;
  template <typename T>
  static void put(DevBuf<T>& d, const std::vector<T>& h) {
    if (d.get() == nullptr || d.size() != h.size()) {
      d.upload(h);
    } else {
      EXPECT_EQ(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  void write(const Tok& t) {
    put(q, t.q);
    put(k, t.k);
    put(v, t.v);
    put(g, t.g);
    put(beta, t.beta);
    put(cu, t.cu);
  }
  kernels::GdnStepTokens view(int batch, int max_tokens) const {
    kernels::GdnStepTokens s;
    s.q = q.get();
    s.k = k.get();
    s.v = v.get();
    s.g = g.get();
    s.beta = beta.get();
    s.cu_tokens = cu.get();
    s.batch = batch;
    s.max_tokens = max_tokens;
    return s;
  }
};

std::vector<float> out_f32(DType t, const DevBuf<uint16_t>& o) { return to_f32(t, o.download()); }

/// "bf16_k16_v32_dk128_dv128": the dtype and GdnDims of a case.
std::string dims_name(DType t, const GdnDims& d) {
  return std::string(name_dtype(t)) + "_k" + std::to_string(d.num_k_heads) + "_v" + std::to_string(d.num_v_heads) +
         "_dk" + std::to_string(d.head_k_dim) + "_dv" + std::to_string(d.head_v_dim);
}

// =====================================================================================================================
// Recurrent form
// =====================================================================================================================

struct RecCase {
  DType dtype = DType::BF16;
  GdnDims dims;
  std::vector<int> counts;  // tokens per sequence
  bool drafts = false;      // per-draft state snapshots
  uint64_t seed = 0;
};

std::string case_name(const RecCase& c) {
  return dims_name(c.dtype, c.dims) + "_counts" + name_ints(c.counts) + (c.drafts ? "_drafts" : "");
}

void PrintTo(const RecCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_recurrent(const RecCase& c) {
  const uint64_t seed = c.seed;
  std::mt19937_64 rng(seed);
  const GdnDims& d = c.dims;
  const int batch = static_cast<int>(c.counts.size());
  const Tok tok = make_tokens(c.dtype, d, c.counts, rng);
  const size_t sf = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
  const int nslots = 2 * batch + tok.total() + 1;
  std::vector<float> pool(sf * nslots);
  std::normal_distribution<float> ns(0.f, 0.3f);
  for (auto& e : pool) e = ns(rng);
  // Slots: sequences use a shuffled subset; drafts get distinct other slots (-1 for every third token).
  std::vector<int32_t> order(nslots);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> slots(order.begin(), order.begin() + batch);
  std::vector<int32_t> dslots;
  if (c.drafts) {
    for (int i = 0; i < tok.total(); ++i) dslots.push_back(i % 3 == 2 ? -1 : order[batch + i]);
  }
  std::vector<float> ref_pool = pool;
  std::vector<float> ref_out(static_cast<size_t>(tok.total()) * d.num_v_heads * d.head_v_dim, std::nanf(""));
  kernels::GdnRecurrentParams rp;
  rp.dims = d;
  rp.tok = tok.view32();
  rp.out = ref_out.data();
  rp.state_pool = ref_pool.data();
  rp.num_state_slots = nslots;
  rp.state_slots = slots.data();
  rp.draft_state_slots = c.drafts ? dslots.data() : nullptr;
  kernels::gdn_recurrent_ref(rp);

  DevTok dt;
  dt.write(tok);
  DevBuf<float> dpool;
  dpool.upload(pool);
  DevBuf<int32_t> dslot, ddraft;
  dslot.upload(slots);
  if (c.drafts) ddraft.upload(dslots);
  DevBuf<uint16_t> out(ref_out.size());
  out.poison();
  GdnRecurrentGpuParams p;
  p.dtype = c.dtype;
  p.dims = d;
  p.tok = dt.view(batch, *std::max_element(c.counts.begin(), c.counts.end()));
  p.out = out.get();
  p.state_pool = dpool.get();
  p.num_state_slots = nslots;
  p.state_slots = dslot.get();
  p.draft_state_slots = c.drafts ? ddraft.get() : nullptr;
  SPADE_CUDA_OK(kernels::gdn_recurrent(p, nullptr));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LE(max_row_rel_err(out_f32(c.dtype, out), ref_out, d.head_v_dim), out_bound(c.dtype));
  const std::vector<float> got_pool = dpool.download();
  // Every slot (read-only ones must be untouched, written ones must match).
  for (int s = 0; s < nslots; ++s) {
    const std::vector<float> g(got_pool.begin() + sf * s, got_pool.begin() + sf * (s + 1));
    const std::vector<float> r(ref_pool.begin() + sf * s, ref_pool.begin() + sf * (s + 1));
    EXPECT_LE(max_row_rel_err(g, r, sf), kRecurrentStateBound) << "state slot " << s;
  }
}

// clang-format off
const std::vector<RecCase> kRecurrentCases = {
    // ragged batches: Qwen3.5 shape; GQA group 1, d 64
    {.dtype = DType::BF16, .dims = {.num_k_heads = 16, .num_v_heads = 32, .head_k_dim = 128, .head_v_dim = 128},
     .counts = {1, 3, 0, 7, 2, 1}, .seed = 11},
    {.dtype = DType::F16, .dims = {.num_k_heads = 4, .num_v_heads = 4, .head_k_dim = 64, .head_v_dim = 64},
     .counts = {2, 1, 5}, .seed = 12},
    // a decode batch of 64, group 4
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 8, .head_k_dim = 128, .head_v_dim = 128},
     .counts = std::vector<int>(64, 1), .seed = 13},
    // draft snapshots
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .counts = {8, 3, 1, 5}, .drafts = true, .seed = 14},
    {.dtype = DType::F16, .dims = {.num_k_heads = 1, .num_v_heads = 2, .head_k_dim = 64, .head_v_dim = 64},
     .counts = {4, 8}, .drafts = true, .seed = 15},
};
// clang-format on

class GdnRecurrentGpu : public ::testing::TestWithParam<RecCase> {};

TEST_P(GdnRecurrentGpu, MatchesReference) { run_recurrent(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, GdnRecurrentGpu, ::testing::ValuesIn(kRecurrentCases), CaseName());

TEST_F(GdnRecurrentGpu, VerifyCommitSwapsColumns) {
  std::mt19937_64 rng(16);
  const int batch = 37, T = 8;
  std::vector<int32_t> spec(batch * (T + 1)), acc(batch);
  std::iota(spec.begin(), spec.end(), 100);
  for (auto& a : acc) a = static_cast<int32_t>(rng() % (T + 1));
  std::vector<int32_t> ref = spec;
  kernels::gdn_recurrent_verify_commit_ref(ref.data(), acc.data(), batch, T);
  DevBuf<int32_t> ds, da;
  ds.upload(spec);
  da.upload(acc);
  SPADE_CUDA_OK(kernels::gdn_recurrent_verify_commit(ds.get(), da.get(), batch, T, nullptr));
  EXPECT_EQ(ds.download(), ref);
}

// =====================================================================================================================
// Buffered forms: a GPU mirror of GdnCache
// =====================================================================================================================

struct GpuMirror {
  GdnCacheConfig cfg;
  int max_blocks = 0;
  DevBuf<float> states, g;
  DevBuf<uint16_t> k, u;
  DevBuf<int32_t> ring_start, ring_len, ring_cap, tables, state_slots;
  DevBuf<uint8_t> state_valid;

  template <typename T>
  static void copy_from(DevBuf<T>& d, const T* h, size_t n) {
    if (d.get() == nullptr || d.size() != n) d.alloc(n);
    EXPECT_EQ(cudaMemcpy(d.get(), h, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  size_t tokens() const { return static_cast<size_t>(cfg.num_blocks) * cfg.block_size; }

  /// Everything from the CPU cache (pools, states, metadata).
  void sync_all(GdnCache& c) {
    cfg = c.config();
    const auto pool = c.pool();
    const auto tab = c.table();
    max_blocks = tab.max_blocks_per_seq;
    const GdnDims& d = cfg.dims;
    copy_from(states, c.state_pool(), static_cast<size_t>(c.num_state_slots()) * d.num_v_heads * d.head_k_dim *
                                          d.head_v_dim);
    copy_from(k, static_cast<const uint16_t*>(pool.k), tokens() * d.num_k_heads * d.head_k_dim);
    copy_from(u, static_cast<const uint16_t*>(pool.u), tokens() * d.num_v_heads * d.head_v_dim);
    copy_from(g, pool.g, tokens() * d.num_v_heads);
    copy_from(ring_start, tab.ring_start, tab.max_seqs);
    copy_from(ring_len, tab.ring_len, tab.max_seqs);
    copy_from(state_valid, tab.state_valid, tab.max_seqs);
    sync_static(c);
  }
  /// Host-owned metadata: ring capacities, block tables, state-slot assignment.
  void sync_static(GdnCache& c) {
    const auto tab = c.table();
    copy_from(ring_cap, tab.ring_capacity, tab.max_seqs);
    copy_from(tables, tab.block_tables, static_cast<size_t>(tab.max_seqs) * tab.max_blocks_per_seq);
    copy_from(state_slots, tab.state_slots, tab.max_seqs);
  }
  void expect_meta(GdnCache& c, const std::string& where) {
    const auto tab = c.table();
    const int n = tab.max_seqs;
    EXPECT_EQ(ring_start.download(), std::vector<int32_t>(tab.ring_start, tab.ring_start + n)) << where;
    EXPECT_EQ(ring_len.download(), std::vector<int32_t>(tab.ring_len, tab.ring_len + n)) << where;
    EXPECT_EQ(state_valid.download(), std::vector<uint8_t>(tab.state_valid, tab.state_valid + n)) << where;
  }
  void expect_states(GdnCache& c, const std::vector<uint64_t>& seqs, const std::string& where) {
    const GdnDims& d = cfg.dims;
    const size_t sf = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
    const std::vector<float> got = states.download();
    for (uint64_t s : seqs) {
      const int slot = c.state_slot(c.slot(s));
      if (slot < 0 || !c.state_valid(c.slot(s))) continue;
      const float* r = c.state_pool() + sf * slot;
      EXPECT_LE(max_row_rel_err(std::vector<float>(got.begin() + sf * slot, got.begin() + sf * (slot + 1)),
                                std::vector<float>(r, r + sf), sf),
                kStateBound)
          << where << " sequence " << s;
    }
  }
  GdnBufferedGpuParams params(DType t, const DevTok& dt, int batch, int max_tokens, const DevBuf<int32_t>& slots,
                              void* out) {
    GdnBufferedGpuParams p;
    p.dtype = t;
    p.dims = cfg.dims;
    p.tok = dt.view(batch, max_tokens);
    p.out = out;
    p.state_pool = states.get();
    p.num_state_slots = static_cast<int>(states.size() / (static_cast<size_t>(cfg.dims.num_v_heads) *
                                                          cfg.dims.head_k_dim * cfg.dims.head_v_dim));
    p.buf.k = k.get();
    p.buf.u = u.get();
    p.buf.g = g.get();
    p.buf.dtype = t;
    p.buf.num_blocks = cfg.num_blocks;
    p.buf.block_size = cfg.block_size;
    p.seqs.ring_start = ring_start.get();
    p.seqs.ring_len = ring_len.get();
    p.seqs.ring_capacity = ring_cap.get();
    p.seqs.block_tables = tables.get();
    p.seqs.state_slots = state_slots.get();
    p.seqs.state_valid = state_valid.get();
    p.seqs.max_seqs = cfg.max_seqs;
    p.seqs.max_blocks_per_seq = max_blocks;
    p.seq_slots = slots.get();
    p.max_ring_capacity = std::max(cfg.buffer_size, cfg.kv_only_limit);
    return p;
  }
};

kernels::GdnBufferedParams ref_params(GdnCache& c, const Tok& tok, const std::vector<int32_t>& slots,
                                      const std::vector<uint8_t>& flags, std::vector<float>& out) {
  out.assign(static_cast<size_t>(tok.total()) * c.config().dims.num_v_heads * c.config().dims.head_v_dim, std::nanf(""));
  kernels::GdnBufferedParams p;
  p.dims = c.config().dims;
  p.tok = tok.view32();
  p.out = out.data();
  p.state_pool = c.state_pool();
  p.num_state_slots = c.num_state_slots();
  p.buf = c.pool();
  p.seqs = c.table();
  p.seq_slots = slots.data();
  p.flags = flags.data();
  return p;
}

/// GdnCache configuration for `num_seqs` sequences plus spare sequence slots, state slots and buffer blocks.
GdnCacheConfig test_cache_config(DType t, const GdnDims& d, int num_seqs, int buffer_size, int block_size,
                                 int kv_only_limit) {
  GdnCacheConfig cfg;
  cfg.dims = d;
  cfg.max_seqs = num_seqs + 2;
  cfg.num_state_slots = num_seqs + 3;
  cfg.block_size = block_size;
  cfg.buffer_size = buffer_size;
  cfg.kv_only_limit = kv_only_limit;
  cfg.num_blocks = (num_seqs + 2) * std::max(buffer_size, kv_only_limit) / block_size + 5;
  cfg.buffer_dtype = t;
  return cfg;
}

/// Admits sequences first_id .. first_id + num_seqs - 1 (in order): sequence i starts in the KV-only form when
/// kv_only(i), else with a random N(0, 0.3) checkpoint. Appends their slots and ids.
template <typename KvOnly>
void admit_sequences(GdnCache& cache, int num_seqs, uint64_t first_id, KvOnly kv_only, std::mt19937_64& rng,
                     std::vector<int32_t>* slots, std::vector<uint64_t>* ids) {
  const GdnDims& d = cache.config().dims;
  const size_t sf = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
  std::normal_distribution<float> ns(0.f, 0.3f);
  for (int i = 0; i < num_seqs; ++i) {
    const uint64_t id = first_id + static_cast<uint64_t>(i);
    const bool kvo = kv_only(i);
    slots->push_back(cache.admit(id, kvo));
    ids->push_back(id);
    if (!kvo) {
      float* st = cache.state(id);
      for (size_t e = 0; e < sf; ++e) st[e] = ns(rng);
    }
  }
}

struct BufCase {
  DType dtype = DType::BF16;
  GdnDims dims;
  int buffer_size = 0;
  int block_size = 0;
  int kv_only_limit = 0;  // 0: no KV-only sequences
  int num_seqs = 0;
  int steps = 0;
  bool ragged = false;          // 0..3 tokens per sequence per step (buffered prefill path, max_tokens 8)
  bool explicit_flags = false;  // pass the host's flags instead of the device rule
  int tile_groups = 0;          // GdnBufferedGpuParams::tile_groups
  uint64_t seed = 0;
};

std::string case_name(const BufCase& c) {
  return dims_name(c.dtype, c.dims) + "_buf" + std::to_string(c.buffer_size) + "_block" +
         std::to_string(c.block_size) + (c.kv_only_limit != 0 ? "_kvonly" + std::to_string(c.kv_only_limit) : "") +
         "_seqs" + std::to_string(c.num_seqs) + "_steps" + std::to_string(c.steps) + (c.ragged ? "_ragged" : "") +
         (c.explicit_flags ? "_explicitflags" : "") +
         (c.tile_groups != 0 ? "_tilegroups" + std::to_string(c.tile_groups) : "");
}

void PrintTo(const BufCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

/// Snapshot of the rings' capacities (a change means GdnCache::finish_step relocated a compressed KV-only ring).
std::vector<int> capacities(GdnCache& c, const std::vector<int32_t>& slots) {
  std::vector<int> v;
  for (int s : slots) v.push_back(c.ring_capacity(s));
  return v;
}

void run_buffered_decode(const BufCase& bc) {
  const uint64_t seed = bc.seed;
  std::mt19937_64 rng(seed);
  GdnCache cache(
      test_cache_config(bc.dtype, bc.dims, bc.num_seqs, bc.buffer_size, bc.block_size, bc.kv_only_limit));
  std::vector<uint64_t> ids;
  std::vector<int32_t> all_slots;
  admit_sequences(
      cache, bc.num_seqs, 1000, [&](int i) { return bc.kv_only_limit > 0 && i % 2 == 0; }, rng, &all_slots, &ids);
  GpuMirror gpu;
  gpu.sync_all(cache);
  const int max_tokens = bc.ragged ? kernels::kGdnMaxStepTokens : 1;
  bool saw_mixed = false;
  int flushes = 0;
  for (int step = 0; step < bc.steps; ++step) {
    // Staggered admission into the batch (sequence i joins at step i), shuffled batch order.
    std::vector<int32_t> slots;
    for (int i = 0; i < bc.num_seqs; ++i)
      if (i <= step) slots.push_back(all_slots[i]);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int> counts(slots.size(), 1);
    if (bc.ragged)
      for (auto& c : counts) c = static_cast<int>(rng() % 4);
    const int next_tokens = bc.ragged ? 3 : 1;
    const Tok tok = make_tokens(bc.dtype, bc.dims, counts, rng);
    const std::vector<uint8_t> flags = cache.plan_decode(slots, tok.cu, next_tokens);
    gpu.sync_static(cache);  // state slots assigned to compressing KV-only sequences
    std::vector<float> ref_out;
    kernels::gdn_chunkwise_decode_ref(ref_params(cache, tok, slots, flags, ref_out));

    DevTok dt;
    dt.write(tok);
    DevBuf<int32_t> dslots;
    dslots.upload(slots);
    DevBuf<uint8_t> dflags, dflags_out(slots.size());
    dflags.upload(flags);
    dflags_out.poison();
    DevBuf<uint16_t> out(std::max<size_t>(ref_out.size(), 1));
    out.poison();
    GdnBufferedGpuParams p = gpu.params(bc.dtype, dt, static_cast<int>(slots.size()), max_tokens, dslots, out.get());
    p.flags = bc.explicit_flags ? dflags.get() : nullptr;
    p.tile_groups = bc.tile_groups;
    p.flags_out = dflags_out.get();
    p.next_tokens = next_tokens;
    SPADE_CUDA_OK(kernels::gdn_chunkwise_decode(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    const std::string where = "step " + std::to_string(step);
    EXPECT_EQ(dflags_out.download(), flags) << where;
    if (!ref_out.empty()) {
      std::vector<float> got = out_f32(bc.dtype, out);
      got.resize(ref_out.size());
      EXPECT_LE(max_row_rel_err(got, ref_out, bc.dims.head_v_dim), out_bound(bc.dtype)) << where;
    }
    gpu.expect_meta(cache, where);
    bool any0 = false, any1 = false;
    for (uint8_t f : flags) {
      (f ? any1 : any0) = true;
      flushes += f ? 1 : 0;
    }
    saw_mixed |= any0 && any1;
    const std::vector<int> cap_before = capacities(cache, all_slots);
    cache.finish_step();
    if (capacities(cache, all_slots) != cap_before) gpu.sync_all(cache);  // KV-only -> chunkwise relocation
    if (::testing::Test::HasFailure()) return;
  }
  gpu.expect_states(cache, ids, "end");
  EXPECT_TRUE(saw_mixed) << "no step mixed flushing and non-flushing sequences";
  EXPECT_GE(flushes, bc.num_seqs) << "too few flushes";
}

// clang-format off
const std::vector<BufCase> kChunkwiseCases = {
    // Qwen3.5 shape, L = 16; and with one CTA per head (4 tile groups)
    {.dtype = DType::BF16, .dims = {.num_k_heads = 16, .num_v_heads = 32, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 16, .block_size = 16, .num_seqs = 4, .steps = 40, .seed = 21},
    {.dtype = DType::BF16, .dims = {.num_k_heads = 16, .num_v_heads = 32, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 16, .block_size = 16, .num_seqs = 4, .steps = 40, .tile_groups = 4, .seed = 41},
    // two tile groups: KV-only sequences (ragged); d 64 (explicit flags)
    {.dtype = DType::F16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 16, .block_size = 8, .kv_only_limit = 128, .num_seqs = 3, .steps = 140, .ragged = true,
     .tile_groups = 2, .seed = 42},
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 64, .head_v_dim = 64},
     .buffer_size = 8, .block_size = 8, .kv_only_limit = 64, .num_seqs = 4, .steps = 80, .explicit_flags = true,
     .tile_groups = 2, .seed = 43},
    // L = 8, blocks of 4, explicit flags
    {.dtype = DType::F16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 64, .head_v_dim = 64},
     .buffer_size = 8, .block_size = 4, .num_seqs = 5, .steps = 30, .explicit_flags = true, .seed = 22},
    // L = 64, blocks of 16, group 1
    {.dtype = DType::BF16, .dims = {.num_k_heads = 4, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 64, .block_size = 16, .num_seqs = 3, .steps = 140, .seed = 23},
    // L = 4, blocks of 4
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 4, .block_size = 4, .num_seqs = 6, .steps = 20, .seed = 24},
    // KV-only sequences compress into chunkwise ones: KV-only limit = d_k = 64 (the [KVB] Sec. 3.4 switch), mixed
    // with chunkwise sequences.
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 64, .head_v_dim = 64},
     .buffer_size = 16, .block_size = 16, .kv_only_limit = 64, .num_seqs = 4, .steps = 90, .seed = 25},
    {.dtype = DType::F16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 16, .block_size = 8, .kv_only_limit = 128, .num_seqs = 3, .steps = 150, .seed = 26},
    // ragged buffered prefill
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .buffer_size = 16, .block_size = 8, .num_seqs = 5, .steps = 40, .ragged = true, .seed = 27},
    // ragged, KV-only, explicit flags
    {.dtype = DType::F16, .dims = {.num_k_heads = 1, .num_v_heads = 2, .head_k_dim = 64, .head_v_dim = 64},
     .buffer_size = 32, .block_size = 16, .kv_only_limit = 64, .num_seqs = 4, .steps = 60, .ragged = true,
     .explicit_flags = true, .seed = 28},
};
// clang-format on

class GdnChunkwiseGpu : public ::testing::TestWithParam<BufCase> {};

TEST_P(GdnChunkwiseGpu, MatchesReference) { run_buffered_decode(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, GdnChunkwiseGpu, ::testing::ValuesIn(kChunkwiseCases), CaseName());

// A decode step captured once as a CUDA graph and replayed across several buffer cycles (flushes happen inside the
// replays: the decision is device data), new token data copied into the same buffers before each replay.
TEST_F(GdnChunkwiseGpu, CudaGraphReplayAcrossFlushes) {
  std::mt19937_64 rng(29);
  const DType t = DType::BF16;
  const GdnCacheConfig cfg = test_cache_config(t, {16, 32, 128, 128}, 5, 16, 8, 0);
  GdnCache cache(cfg);
  std::vector<int32_t> slots;
  std::vector<uint64_t> ids;
  admit_sequences(cache, 5, 50, [](int) { return false; }, rng, &slots, &ids);
  GpuMirror gpu;
  gpu.sync_all(cache);
  // Stagger: sequence i runs i extra steps first (direct launches).
  for (int i = 0; i < 5; ++i) {
    for (int r = 0; r < 3 * i; ++r) {
      const std::vector<int32_t> one = {slots[i]};
      const Tok tok = make_tokens(t, cfg.dims, {1}, rng);
      const auto flags = cache.plan_decode(one, tok.cu);
      std::vector<float> ro;
      kernels::gdn_chunkwise_decode_ref(ref_params(cache, tok, one, flags, ro));
      cache.finish_step();
      DevTok dt;
      dt.write(tok);
      DevBuf<int32_t> ds;
      ds.upload(one);
      DevBuf<uint16_t> out(ro.size());
      SPADE_CUDA_OK(kernels::gdn_chunkwise_decode(gpu.params(t, dt, 1, 1, ds, out.get()), nullptr));
    }
  }
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  gpu.expect_meta(cache, "after stagger");
  const std::vector<int> counts(5, 1);
  Tok tok = make_tokens(t, cfg.dims, counts, rng);
  DevTok dt;
  dt.write(tok);
  DevBuf<int32_t> ds;
  ds.upload(slots);
  DevBuf<uint16_t> out(static_cast<size_t>(5) * 32 * 128);
  cudaStream_t stream;
  SPADE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SPADE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  GdnBufferedGpuParams p = gpu.params(t, dt, 5, 1, ds, out.get());
  const cudaError_t le = kernels::gdn_chunkwise_decode(p, stream);
  SPADE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  SPADE_CUDA_OK(le);
  SPADE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  int flushes = 0;
  for (int step = 0; step < 40; ++step) {
    if (step > 0) {
      tok = make_tokens(t, cfg.dims, counts, rng);
      dt.write(tok);
    }
    const auto flags = cache.plan_decode(slots, tok.cu);
    for (uint8_t f : flags) flushes += f;
    std::vector<float> ro;
    kernels::gdn_chunkwise_decode_ref(ref_params(cache, tok, slots, flags, ro));
    out.poison();
    SPADE_CUDA_OK(cudaGraphLaunch(exec, stream));
    SPADE_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_LE(max_row_rel_err(out_f32(t, out), ro, 128), out_bound(t)) << "replay " << step;
    gpu.expect_meta(cache, "replay " + std::to_string(step));
    cache.finish_step();
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GE(flushes, 10);
  gpu.expect_states(cache, ids, "end");
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// =====================================================================================================================
// Parallel verification
// =====================================================================================================================

struct VerifyCase {
  DType dtype = DType::BF16;
  GdnDims dims;
  int max_drafts = 0;  // T_b = max_drafts - b % max_drafts for sequence b (ragged over the batch)
  int buffer_size = 0;
  int block_size = 0;
  int kv_only_limit = 0;  // 0: no KV-only sequences
  int num_seqs = 0;
  int rounds = 0;
  int tile_groups = 0;
  uint64_t seed = 0;
};

std::string case_name(const VerifyCase& c) {
  return dims_name(c.dtype, c.dims) + "_drafts" + std::to_string(c.max_drafts) + "_buf" +
         std::to_string(c.buffer_size) + "_block" + std::to_string(c.block_size) +
         (c.kv_only_limit != 0 ? "_kvonly" + std::to_string(c.kv_only_limit) : "") + "_seqs" +
         std::to_string(c.num_seqs) + "_rounds" + std::to_string(c.rounds) +
         (c.tile_groups != 0 ? "_tilegroups" + std::to_string(c.tile_groups) : "");
}

void PrintTo(const VerifyCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void run_verify(const VerifyCase& vc) {
  const uint64_t seed = vc.seed;
  std::mt19937_64 rng(seed);
  GdnCache cache(
      test_cache_config(vc.dtype, vc.dims, vc.num_seqs, vc.buffer_size, vc.block_size, vc.kv_only_limit));
  std::vector<int32_t> slots;
  std::vector<uint64_t> ids;
  admit_sequences(
      cache, vc.num_seqs, 200, [&](int i) { return vc.kv_only_limit > 0 && i % 2 == 1; }, rng, &slots, &ids);
  GpuMirror gpu;
  gpu.sync_all(cache);
  const int batch = vc.num_seqs;
  DevBuf<int32_t> dslots;
  dslots.upload(slots);
  int flushes = 0, accepted_total = 0;
  for (int round = 0; round < vc.rounds; ++round) {
    const std::string where = "round " + std::to_string(round);
    const bool plain = round % 5 == 4;  // a plain decode step between verifications, next_tokens = max_drafts
    // Ragged over the batch, fixed per sequence ("flush one window early" plans for the next window of T_b drafts).
    std::vector<int> counts(batch, 1);
    if (!plain)
      for (int b = 0; b < batch; ++b) counts[b] = vc.max_drafts - b % vc.max_drafts;
    const Tok tok = make_tokens(vc.dtype, vc.dims, counts, rng);
    const std::vector<uint8_t> flags =
        plain ? cache.plan_decode(slots, tok.cu, vc.max_drafts) : cache.plan_verify(slots, tok.cu);
    gpu.sync_static(cache);
    std::vector<float> ref_out;
    auto rp = ref_params(cache, tok, slots, flags, ref_out);
    if (plain) {
      kernels::gdn_chunkwise_decode_ref(rp);
    } else {
      kernels::gdn_parallel_verify_ref(rp);
    }
    DevTok dt;
    dt.write(tok);
    DevBuf<uint8_t> dflags_out(batch);
    dflags_out.poison();
    DevBuf<uint16_t> out(ref_out.size());
    out.poison();
    GdnBufferedGpuParams p = gpu.params(vc.dtype, dt, batch, plain ? 1 : vc.max_drafts, dslots, out.get());
    p.flags_out = dflags_out.get();
    p.next_tokens = vc.max_drafts;
    p.tile_groups = vc.tile_groups;
    SPADE_CUDA_OK(plain ? kernels::gdn_chunkwise_decode(p, nullptr) : kernels::gdn_parallel_verify(p, nullptr));
    SPADE_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(dflags_out.download(), flags) << where;
    EXPECT_LE(max_row_rel_err(out_f32(vc.dtype, out), ref_out, vc.dims.head_v_dim), out_bound(vc.dtype)) << where;
    for (uint8_t f : flags) flushes += f;
    if (!plain) {
      std::vector<int32_t> acc(batch);
      for (int b = 0; b < batch; ++b) {
        acc[b] = static_cast<int32_t>(rng() % (counts[b] + 1));
        accepted_total += acc[b];
      }
      cache.commit(slots, tok.cu, acc);
      DevBuf<int32_t> dacc;
      dacc.upload(acc);
      kernels::GdnSeqTable t;
      t.ring_len = gpu.ring_len.get();
      SPADE_CUDA_OK(kernels::gdn_verify_commit(t, dslots.get(), dacc.get(), batch, nullptr));
      SPADE_CUDA_OK(cudaDeviceSynchronize());
    }
    gpu.expect_meta(cache, where);
    const std::vector<int> cap_before = capacities(cache, slots);
    cache.finish_step();
    if (capacities(cache, slots) != cap_before) gpu.sync_all(cache);
    if (::testing::Test::HasFailure()) return;
  }
  gpu.expect_states(cache, ids, "end");
  EXPECT_GE(flushes, vc.num_seqs);
  EXPECT_GT(accepted_total, 0);
}

// clang-format off
const std::vector<VerifyCase> kParallelVerifyCases = {
    // Qwen3.5 shape, T = 8, L = 16; and with one CTA per head (4 tile groups)
    {.dtype = DType::BF16, .dims = {.num_k_heads = 16, .num_v_heads = 32, .head_k_dim = 128, .head_v_dim = 128},
     .max_drafts = 8, .buffer_size = 16, .block_size = 16, .num_seqs = 3, .rounds = 30, .seed = 31},
    {.dtype = DType::BF16, .dims = {.num_k_heads = 16, .num_v_heads = 32, .head_k_dim = 128, .head_v_dim = 128},
     .max_drafts = 8, .buffer_size = 16, .block_size = 16, .num_seqs = 3, .rounds = 30, .tile_groups = 4, .seed = 36},
    // two tile groups, KV-only
    {.dtype = DType::F16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .max_drafts = 4, .buffer_size = 16, .block_size = 8, .kv_only_limit = 128, .num_seqs = 4, .rounds = 60,
     .tile_groups = 2, .seed = 37},
    {.dtype = DType::F16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
     .max_drafts = 4, .buffer_size = 32, .block_size = 8, .num_seqs = 4, .rounds = 40, .seed = 32},
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 2, .head_k_dim = 64, .head_v_dim = 64},
     .max_drafts = 2, .buffer_size = 4, .block_size = 4, .num_seqs = 5, .rounds = 40, .seed = 33},
    // KV-only compression during speculation
    {.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 64, .head_v_dim = 64},
     .max_drafts = 8, .buffer_size = 16, .block_size = 16, .kv_only_limit = 64, .num_seqs = 4, .rounds = 50,
     .seed = 34},
    // T = 1: one draft per sequence every round
    {.dtype = DType::F16, .dims = {.num_k_heads = 4, .num_v_heads = 8, .head_k_dim = 128, .head_v_dim = 128},
     .max_drafts = 1, .buffer_size = 8, .block_size = 8, .num_seqs = 6, .rounds = 30, .seed = 35},
};
// clang-format on

class GdnParallelVerifyGpu : public ::testing::TestWithParam<VerifyCase> {};

TEST_P(GdnParallelVerifyGpu, MatchesReference) { run_verify(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, GdnParallelVerifyGpu, ::testing::ValuesIn(kParallelVerifyCases), CaseName());

// The shared-memory size of a launch grows with the ring: a longer ring after a shorter one in the same
// instantiation (bf16, d 128, 8 tokens, one CTA per head) must launch (the limit once failed it: it was set to the
// first launch's size). Two cases in this order in one test, so not in the table.
TEST_F(GdnParallelVerifyGpu, LongerRingAfterShorterRing) {
  run_verify({.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
              .max_drafts = 8, .buffer_size = 16, .block_size = 16, .num_seqs = 2, .rounds = 30, .tile_groups = 4,
              .seed = 38});
  run_verify({.dtype = DType::BF16, .dims = {.num_k_heads = 2, .num_v_heads = 4, .head_k_dim = 128, .head_v_dim = 128},
              .max_drafts = 8, .buffer_size = 64, .block_size = 16, .num_seqs = 2, .rounds = 60, .tile_groups = 4,
              .seed = 39});
}

// =====================================================================================================================
// Launcher errors
// =====================================================================================================================

TEST(GdnGpuErrors, InvalidParametersNameTheField) {
  GdnRecurrentGpuParams r;
  r.dims = {2, 4, 128, 128};
  r.tok.batch = 1;
  int dummy = 0;
  r.tok.q = r.tok.k = r.tok.v = &dummy;
  r.tok.g = r.tok.beta = reinterpret_cast<const float*>(&dummy);
  r.tok.cu_tokens = &dummy;
  r.out = &dummy;
  r.state_pool = reinterpret_cast<float*>(&dummy);
  r.num_state_slots = 1;
  r.state_slots = &dummy;
  auto expect = [](cudaError_t e, const char* part) {
    EXPECT_EQ(e, cudaErrorInvalidValue);
    EXPECT_NE(std::string(kernels::launch_error_detail()).find(part), std::string::npos) << kernels::launch_error_detail();
  };
  GdnRecurrentGpuParams x = r;
  x.dtype = DType::F32;
  expect(kernels::gdn_recurrent(x, nullptr), "dtype");
  x = r;
  x.dims.head_k_dim = x.dims.head_v_dim = 96;
  expect(kernels::gdn_recurrent(x, nullptr), "kGdnHeadDims");
  x = r;
  x.dims.num_v_heads = 3;
  expect(kernels::gdn_recurrent(x, nullptr), "multiple of num_k_heads");
  x = r;
  x.state_slots = nullptr;
  expect(kernels::gdn_recurrent(x, nullptr), "state_slots");

  GdnBufferedGpuParams b;
  b.dims = r.dims;
  b.tok = r.tok;
  b.out = &dummy;
  b.state_pool = r.state_pool;
  b.num_state_slots = 1;
  b.buf.k = b.buf.u = &dummy;
  b.buf.g = reinterpret_cast<float*>(&dummy);
  b.buf.num_blocks = 1;
  b.buf.block_size = 16;
  b.seqs.ring_start = b.seqs.ring_len = &dummy;
  b.seqs.ring_capacity = b.seqs.block_tables = b.seqs.state_slots = &dummy;
  b.seqs.state_valid = reinterpret_cast<uint8_t*>(&dummy);
  b.seqs.max_seqs = 1;
  b.seqs.max_blocks_per_seq = 1;
  b.seq_slots = &dummy;
  b.max_ring_capacity = 16;
  GdnBufferedGpuParams y = b;
  y.tok.max_tokens = 9;
  expect(kernels::gdn_parallel_verify(y, nullptr), "kGdnMaxStepTokens");
  y = b;
  y.buf.dtype = DType::F16;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "buf.dtype");
  y = b;
  y.tile_groups = 3;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "tile_groups");
  y = b;
  y.seq_slots = nullptr;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "seq_slots");
  y = b;
  y.max_ring_capacity = 0;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "max_ring_capacity");
  y = b;
  y.next_tokens = 0;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "next_tokens");
  y = b;
  y.tok.batch = 2;
  expect(kernels::gdn_chunkwise_decode(y, nullptr), "max_seqs");
  expect(kernels::gdn_verify_commit(b.seqs, nullptr, &dummy, 1, nullptr), "null");
  expect(kernels::gdn_recurrent_verify_commit(&dummy, &dummy, 1, 0, nullptr), "num_drafts");
  // Nothing to do is not an error.
  y = b;
  y.tok.batch = 0;
  EXPECT_EQ(kernels::gdn_chunkwise_decode(y, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace spade::test
