// Split-K flash-decoding over the paged KV cache: dense paged decode and the two token-sparse variants
// (index list into the paged cache; packed gathered buffer + local window). One kernel template serves all three;
// only the "where is virtual token v" rule differs (KvSource).
//
// Work decomposition (docs/KERNELS.md has the measurements):
//   grid (split, KV-head group, sequence). Dense paged decode with head_dim <= 128 runs 8-warp CTAs, the sparse
//   variants and head_dim 256 4-warp CTAs. A CTA owns the token range [split*chunk, (split+1)*chunk) of one
//   sequence for `heads_per_cta` KV heads (1, 2, 4 or 8; always 1 for the sparse variants) and serves each head's
//   whole GQA group (<= 8 query heads) from one read of each K/V row. The warps of one KV head stream its 16-token
//   tiles round robin (warp w takes tiles w, w + warps_per_head, ...) through private cp.async pipelines of kStages
//   shared-memory stages (L2 evict-first, 128-byte L2 fetches); there is no CTA barrier in the main loop.
//   The launcher picks the fewest KV heads per CTA whose grid fits one wave (one CTA per SM for the 8-warp
//   kernel), then the most splits that still fit it: the measured optimum of the split sweep.
//   Per tile: S^T[16 tokens x 8 heads] = K_tile . Q^T on tensor cores (mma.m16n8k16, K via ldmatrix, Q^T held in
//   registers as the B operand); online softmax in the exp2 domain; P^T turned into the B operand with movmatrix;
//   O^T[D x 8 heads] += V_tile^T . P^T (V via ldmatrix.trans).
//   Block-table entries (paged; loaded while seq_lens[b] is still in flight) or per-token cache rows (sparse) of
//   the CTA's range are prefetched into shared memory before the loop, so no K/V load waits on a dependent global
//   load (the paged-KV paper's 1.8x stall).
//   Warps merge in shared memory; with several splits, each CTA writes its normalised partials and log-sum-exps
//   to the workspace, and the last CTA of the (sequence, KV-head group) to arrive (atomic counter) merges them
//   (float4 loads of the partials).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/attention.cuh"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"

namespace spade::kernels {
namespace detail {
namespace {

enum class KvSource : int { kPaged = 0, kIndexed = 1, kPacked = 2 };

constexpr int kTile = 16;            // tokens per tile (the M of one mma)
constexpr int kMinTokensPerSplit = 128;

// Dense paged decode with D <= 128 runs 8-warp CTAs that can serve up to 8 KV heads of one token range (a page of
// 16 tokens is then read as one contiguous block by one SM); the sparse variants and D = 256 run 4-warp CTAs of
// one KV head.
template <int D, KvSource SRC>
struct DecodeConfig {
  // int32 block-table entries (paged) / token rows (sparse) prefetched per CTA.
  static constexpr int kTableEntries = SRC == KvSource::kPaged ? 4096 : 2048;
  static constexpr int kWarps = (SRC == KvSource::kPaged && D <= 128) ? 8 : 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMaxHeadsPerCta = SRC == KvSource::kPaged ? kWarps : 1;  // KV heads per CTA
  static constexpr int kMaxCtaHeads = kMaxHeadsPerCta * kMaxGqaGroup;            // query heads per CTA
  static constexpr int kStages = D == 64 ? 4 : 3;
  static constexpr int kChunks = D / 8;  // 16-byte chunks per K/V row
  static constexpr int kChunksPerLane = kTile * kChunks / 32;
  static constexpr int kTileElems = kTile * D;
  static constexpr size_t kStageBytes = size_t{kWarps} * kStages * 2 * kTileElems * 2;
  static constexpr size_t kMergeBytes =
      (size_t{kWarps} * kMaxGqaGroup * D + 2 * kWarps * kMaxGqaGroup + size_t{kMaxCtaHeads} * kMaxDecodeSplits +
       kMaxCtaHeads + 4) *
      4;
  static_assert(kMergeBytes <= kStageBytes, "merge area must fit in the stage buffers");
  static constexpr size_t kSmemBytes = kTableEntries * 4 + kStageBytes;
};

struct DecodeArgs {
  PagedKv kv;  // k / v: packed_k / packed_v when the packed variant has no paged window
  GqaHeads heads;
  const void* q;
  const int32_t* seq_lens;
  const int32_t* indices;
  const int32_t* num_indices;
  const void* packed_k;
  const void* packed_v;
  const int32_t* num_packed;
  const int32_t* local_windows;  // optional per-sequence windows (packed)
  const int32_t* packed_rows;    // optional per-sequence packed rows (packed)
  const int32_t* q_rows;         // optional per-sequence q / out / lse rows, < 0 = skipped (packed)
  void* out;
  float* lse;
  float* ws_o;
  float* ws_lse;
  int* counters;
  int index_stride;
  int packed_capacity;
  int local_window;
  int chunk;
  int heads_per_cta;  // KV heads served by one CTA (blockIdx.y covers heads [y * heads_per_cta, ...))
  float scale_log2;
};

template <typename T, int D, KvSource SRC>
__global__ void __launch_bounds__(DecodeConfig<D, SRC>::kThreads) decode_kernel(const DecodeArgs a) {
  using Tr = ElemTraits<T>;
  using Cfg = DecodeConfig<D, SRC>;
  constexpr int kTableEntries = Cfg::kTableEntries;
  constexpr int kWarps = Cfg::kWarps;
  constexpr int kThreads = Cfg::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int32_t* tab = reinterpret_cast<int32_t*>(smem_raw);
  T* stage_base = reinterpret_cast<T*>(smem_raw + kTableEntries * 4);

  const int split = blockIdx.x;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int G = a.heads.group;
  // The CTA serves KV heads [kvh0, kvh0 + hpc) = query heads [cta_head0, cta_head0 + n_heads); warp w works for KV
  // head kvh0 + w / wph and streams that head's tiles wt, wt + wph, ... of the CTA's token range.
  const int hpc = SRC == KvSource::kPaged ? a.heads_per_cta : 1;
  const int wph = kWarps / hpc;
  const int hl = warp / wph;
  const int wt = warp - hl * wph;
  const int kvh0 = blockIdx.y * hpc;
  const int kvh = kvh0 + hl;
  const int cta_head0 = kvh0 * G;
  const int n_heads = hpc * G;
  const int head0 = kvh * G;

  // Packed with q_rows: the row of q / out / lse of this sequence's query; a skipped sequence reads and writes
  // nothing (so none of its CTAs touches the split-K counters either).
  int qrow = b;
  if constexpr (SRC == KvSource::kPacked) {
    if (a.q_rows != nullptr) {
      qrow = a.q_rows[b];
      if (qrow < 0) return;
    }
  }
  // Paged: the block-table slice of the CTA's whole token range is loaded before seq_lens[b] arrives (the row has
  // max_pages entries; entries past the sequence are never used).
  const int32_t* bt = a.kv.table_row(b);
  int p0 = 0;
  if constexpr (SRC == KvSource::kPaged) {
    p0 = a.kv.page_of(split * a.chunk);
    const int np = min(a.kv.page_of(split * a.chunk + a.chunk - 1) - p0 + 1, a.kv.max_pages - p0);
    for (int i = tid; i < np; i += kThreads) tab[i] = bt[p0 + i];
  }
  // Virtual sequence of this (sequence, KV head).
  int L = 0;
  int n_sel = 0;
  int wstart = 0;
  if constexpr (SRC == KvSource::kPaged) {
    L = a.seq_lens[b];
  } else if constexpr (SRC == KvSource::kIndexed) {
    L = a.num_indices[b];
  } else {
    const int seq_len = a.seq_lens[b];
    n_sel = a.num_packed[b];
    const int wl = min(a.local_windows != nullptr ? a.local_windows[b] : a.local_window, seq_len);
    wstart = seq_len - wl;
    L = n_sel + wl;
  }
  T* out = static_cast<T*>(a.out);
  T* outp = out + (static_cast<size_t>(qrow) * a.heads.hq + cta_head0) * D;
  if (L <= 0) {  // nothing to attend to: zeros, lse = -inf
    if (split == 0) {
      for (int idx = tid; idx < n_heads * D; idx += kThreads) outp[idx] = Tr::from_float(0.f);
      if (a.lse != nullptr && tid < n_heads) a.lse[qrow * a.heads.hq + cta_head0 + tid] = -INFINITY;
    }
    return;
  }
  const int n_splits = (L + a.chunk - 1) / a.chunk;
  if (split >= n_splits) return;
  const int begin = split * a.chunk;
  const int end = min(L, begin + a.chunk);

  // ---- prefetch the CTA's block-table entries / token rows into shared memory ----
  if constexpr (SRC == KvSource::kIndexed) {
    const int32_t* idx = a.indices + (static_cast<size_t>(b) * a.kv.hkv + kvh) * a.index_stride + begin;
    for (int i = tid; i < end - begin; i += kThreads) {
      const int pos = idx[i];
      tab[i] = a.kv.slot32(bt[a.kv.page_of(pos)], pos);
    }
  } else if constexpr (SRC == KvSource::kPacked) {
    for (int i = tid; i < end - begin; i += kThreads) {
      const int v = begin + i;
      if (v < n_sel) {
        tab[i] = -(v + 1);
      } else {
        const int pos = wstart + (v - n_sel);
        tab[i] = a.kv.slot32(bt[a.kv.page_of(pos)], pos);
      }
    }
  }
  __syncthreads();

  const size_t row_stride = a.kv.row_stride<D>();
  const T* kc = a.kv.k_head<T, D>(kvh);
  const T* vc = a.kv.v_head<T, D>(kvh);
  const T* pk = nullptr;
  const T* pv = nullptr;
  if constexpr (SRC == KvSource::kPacked) {
    const int prow = a.packed_rows != nullptr ? a.packed_rows[b] : b;
    const size_t base = (static_cast<size_t>(prow) * a.kv.hkv + kvh) * a.packed_capacity * D;
    pk = static_cast<const T*>(a.packed_k) + base;
    pv = static_cast<const T*>(a.packed_v) + base;
  }

  // ---- per-warp cp.async pipeline ----
  // K/V are streamed once: L2 evict-first policy and 128-byte L2 fetches (measured: docs/KERNELS.md).
  const uint64_t l2_policy = l2_evict_first_policy();
  T* my_stages = stage_base + static_cast<size_t>(warp) * Cfg::kStages * 2 * Cfg::kTileElems;
  auto issue = [&](int tile_start, int stage) {
    T* sk = my_stages + stage * 2 * Cfg::kTileElems;
    T* sv = sk + Cfg::kTileElems;
    for_each_tile_chunk<Cfg::kChunks, Cfg::kChunksPerLane, 32>(lane, tile_start, end, [&](int tok, int col, int v,
                                                                                         bool valid) {
      const T* gk = kc;
      const T* gv = vc;
      if (valid) {
        if constexpr (SRC == KvSource::kPaged) {
          const size_t row = a.kv.slot(tab[a.kv.page_of(v) - p0], v);
          gk = kc + row * row_stride;
          gv = vc + row * row_stride;
        } else {
          const int r = tab[v - begin];
          if (SRC == KvSource::kPacked && r < 0) {
            gk = pk + static_cast<size_t>(-r - 1) * D;
            gv = pv + static_cast<size_t>(-r - 1) * D;
          } else {
            gk = kc + static_cast<size_t>(r) * row_stride;
            gv = vc + static_cast<size_t>(r) * row_stride;
          }
        }
      }
      const int so = swz(tok, col, Cfg::kChunks);
      cp_async_16_stream(sk + so, gk + col * 8, valid, l2_policy);
      cp_async_16_stream(sv + so, gv + col * 8, valid, l2_policy);
    });
  };

  // Q^T as the B operand: b0b1 = Q[head g][16ks + 2c ..], b2b3 = Q[head g][16ks + 2c + 8 ..]; heads >= G are zero.
  const int g = lane >> 2;
  const int c4 = lane & 3;
  uint32_t qf[D / 16][2];
  {
    const T* qp = static_cast<const T*>(a.q) + (static_cast<size_t>(qrow) * a.heads.hq + head0 + g) * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      if (g < G) {
        qf[ks][0] = *reinterpret_cast<const uint32_t*>(qp + ks * 16 + 2 * c4);
        qf[ks][1] = *reinterpret_cast<const uint32_t*>(qp + ks * 16 + 2 * c4 + 8);
      } else {
        qf[ks][0] = 0u;
        qf[ks][1] = 0u;
      }
    }
  }

  const int n_tiles = (end - begin + kTile - 1) / kTile;
  const int nj = wt < n_tiles ? (n_tiles - wt + wph - 1) / wph : 0;
  auto tile_begin = [&](int j) { return begin + (wt + wph * j) * kTile; };

  float o[D / 16][4];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads 2c and 2c+1 of this lane

  auto issue_tile = [&](int j, int stage) { issue(tile_begin(j), stage); };
  warp_cp_async_pipeline<Cfg::kStages>(nj, issue_tile, [&](int j, int stage) {
    const T* sk = my_stages + stage * 2 * Cfg::kTileElems;
    const T* sv = sk + Cfg::kTileElems;
    const int t0 = tile_begin(j);

    // S^T = K_tile . Q^T  (16 tokens x 8 heads)
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t af[4];
      ldmatrix_tile_a(af, sk, lane, ks, [](int r, int c) { return swz(r, c, Cfg::kChunks); });
      Tr::mma(s, af, qf[ks], s);
    }
    // Online softmax (exp2 domain); token g holds s0,s1, token g+8 holds s2,s3.
    const bool ok0 = t0 + g < end;
    const bool ok1 = t0 + g + 8 < end;
    const float x0 = ok0 ? s[0] * a.scale_log2 : -INFINITY;
    const float x1 = ok0 ? s[1] * a.scale_log2 : -INFINITY;
    const float x2 = ok1 ? s[2] * a.scale_log2 : -INFINITY;
    const float x3 = ok1 ? s[3] * a.scale_log2 : -INFINITY;
    const float mn0 = fmaxf(m0, warp_max_xor(fmaxf(x0, x2), 4, 16));
    const float mn1 = fmaxf(m1, warp_max_xor(fmaxf(x1, x3), 4, 16));
    const float al0 = exp2_approx(m0 - mn0);
    const float al1 = exp2_approx(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    const float p0 = exp2_approx(x0 - mn0);
    const float p1 = exp2_approx(x1 - mn1);
    const float p2 = exp2_approx(x2 - mn0);
    const float p3 = exp2_approx(x3 - mn1);
    l0 = l0 * al0 + p0 + p2;
    l1 = l1 * al1 + p1 + p3;
    uint32_t pb[2];
    pb[0] = movmatrix_trans(Tr::pack2(p0, p1));
    pb[1] = movmatrix_trans(Tr::pack2(p2, p3));
    // O^T += V_tile^T . P^T
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      o[mt][0] *= al0;
      o[mt][1] *= al1;
      o[mt][2] *= al0;
      o[mt][3] *= al1;
      uint32_t vf[4];
      const int i = lane >> 3;
      const int tok = (lane & 7) + ((i >> 1) << 3);
      ldmatrix_x4_trans(vf, sv + swz(tok, 2 * mt + (i & 1), Cfg::kChunks));
      Tr::mma(o[mt], vf, pb, o[mt]);
    }
  });
  l0 = warp_sum_xor(l0, 4, 16);
  l1 = warp_sum_xor(l1, 4, 16);

  // ---- merge the warps of each KV head in shared memory (reusing the stage buffers) ----
  __syncthreads();
  float* wo = reinterpret_cast<float*>(stage_base);           // [warps][8][D]
  float* wm = wo + kWarps * kMaxGqaGroup * D;                  // [warps][8]
  float* wl = wm + kWarps * kMaxGqaGroup;                      // [warps][8]
  float* sw = wl + kWarps * kMaxGqaGroup;                      // [kMaxCtaHeads][kMaxDecodeSplits]
  float* slse = sw + Cfg::kMaxCtaHeads * kMaxDecodeSplits;     // [kMaxCtaHeads]
  int* s_last = reinterpret_cast<int*>(slse + Cfg::kMaxCtaHeads);  // [1]
  if (g == 0) {
    wm[warp * kMaxGqaGroup + 2 * c4] = m0;
    wm[warp * kMaxGqaGroup + 2 * c4 + 1] = m1;
    wl[warp * kMaxGqaGroup + 2 * c4] = l0;
    wl[warp * kMaxGqaGroup + 2 * c4 + 1] = l1;
  }
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    const int d0 = 16 * mt + g;
    float* r0 = wo + (warp * kMaxGqaGroup + 2 * c4) * D;
    float* r1 = r0 + D;
    r0[d0] = o[mt][0];
    r1[d0] = o[mt][1];
    r0[d0 + 8] = o[mt][2];
    r1[d0 + 8] = o[mt][3];
  }
  __syncthreads();

  for (int idx = tid; idx < n_heads * D; idx += kThreads) {
    const int hh = idx / D;  // query head of the CTA
    const int d = idx - hh * D;
    const int w0 = (hh / G) * wph;  // first warp of its KV head
    const int h = hh % G;
    float M = -INFINITY;
    for (int t = 0; t < wph; ++t) M = fmaxf(M, wm[(w0 + t) * kMaxGqaGroup + h]);
    float lsum = 0.f;
    float acc = 0.f;
    for (int t = 0; t < wph; ++t) {
      const int w = w0 + t;
      const float sc = exp2_approx(wm[w * kMaxGqaGroup + h] - M);
      lsum += sc * wl[w * kMaxGqaGroup + h];
      acc += sc * wo[(w * kMaxGqaGroup + h) * D + d];
    }
    const float val = acc / lsum;
    const float lse2 = M + log2f(lsum);
    if (n_splits == 1) {
      outp[idx] = Tr::from_float(val);
      if (a.lse != nullptr && d == 0) a.lse[qrow * a.heads.hq + cta_head0 + hh] = lse2 * kLn2;
    } else {
      const size_t row = (static_cast<size_t>(b) * a.heads.hq + cta_head0 + hh) * kMaxDecodeSplits + split;
      a.ws_o[row * D + d] = val;
      if (d == 0) a.ws_lse[row] = lse2;
    }
  }
  if (n_splits == 1) return;

  // ---- split-K merge by the last CTA of this (sequence, KV-head group) ----
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* ctr = a.counters + b * a.kv.hkv + kvh0;
    const int prev = atomicAdd(ctr, 1);
    const int last = prev == n_splits - 1;
    if (last) atomicExch(ctr, 0);
    *s_last = last;
  }
  __syncthreads();
  if (*s_last == 0) return;
  __threadfence();
  // Split weights: warp w reduces query heads w, w + kWarps, ...: the n_splits (<= 64) log-sum-exps, two per lane.
  for (int hh = warp; hh < n_heads; hh += kWarps) {
    const float* lp = a.ws_lse + (static_cast<size_t>(b) * a.heads.hq + cta_head0 + hh) * kMaxDecodeSplits;
    const float l0s = lane < n_splits ? __ldcg(lp + lane) : -INFINITY;
    const float l1s = lane + 32 < n_splits ? __ldcg(lp + lane + 32) : -INFINITY;
    const float M = warp_max_xor(fmaxf(l0s, l1s), 1, 16);
    const float w0 = exp2_approx(l0s - M);
    const float w1 = exp2_approx(l1s - M);
    const float sum = warp_sum_xor(w0 + w1, 1, 16);
    const float inv = 1.f / sum;
    if (lane < n_splits) sw[hh * kMaxDecodeSplits + lane] = w0 * inv;
    if (lane + 32 < n_splits) sw[hh * kMaxDecodeSplits + lane + 32] = w1 * inv;
    if (lane == 0) slse[hh] = M + log2f(sum);
  }
  __syncthreads();
  // Weighted sum of the partials, 4 consecutive dims (one float4 per split) per thread and step.
  constexpr int kD4 = D / 4;
  for (int it = tid; it < n_heads * kD4; it += kThreads) {
    const int hh = it / kD4;
    const int d = 4 * (it - hh * kD4);
    const float4* op = reinterpret_cast<const float4*>(
        a.ws_o + (static_cast<size_t>(b) * a.heads.hq + cta_head0 + hh) * kMaxDecodeSplits * D + d);
    const float* wsp = sw + hh * kMaxDecodeSplits;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < n_splits; ++s) {
      const float4 v = __ldcg(op + static_cast<size_t>(s) * kD4);
      const float w = wsp[s];
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    uint2 packed;
    packed.x = Tr::pack2(acc.x, acc.y);
    packed.y = Tr::pack2(acc.z, acc.w);
    *reinterpret_cast<uint2*>(outp + hh * D + d) = packed;
    if (a.lse != nullptr && d == 0) a.lse[qrow * a.heads.hq + cta_head0 + hh] = slse[hh] * kLn2;
  }
}

// ---- host side ----

struct WorkspaceLayout {
  size_t counters = 0, lse = 0, o = 0, total = 0;
};

constexpr size_t align256(size_t x) { return (x + 255) & ~size_t{255}; }

WorkspaceLayout workspace_layout(int batch, int num_q_heads, int num_kv_heads, int head_dim) {
  WorkspaceLayout w;
  w.counters = 0;
  w.lse = align256(sizeof(int) * static_cast<size_t>(batch) * num_kv_heads);
  w.o = w.lse + align256(sizeof(float) * static_cast<size_t>(batch) * num_q_heads * kMaxDecodeSplits);
  w.total = w.o + sizeof(float) * static_cast<size_t>(batch) * num_q_heads * kMaxDecodeSplits * head_dim;
  return w;
}

// The layout of a workspace of `bytes` bytes: the one of the largest batch that fits (at least `batch`'s when the
// workspace is big enough for it). Every launch on a workspace uses this one layout, whatever its own batch: the
// split-K counters must stay where the last CTAs left them at zero; a layout that moved with the launch's batch would
// read an earlier launch's partial log-sum-exps as counters (a wrong "last CTA", a merge of unwritten partials).
WorkspaceLayout workspace_layout_of(size_t bytes, int batch, int num_q_heads, int num_kv_heads, int head_dim) {
  const auto fits = [&](int n) { return workspace_layout(n, num_q_heads, num_kv_heads, head_dim).total <= bytes; };
  int lo = std::max(batch, 1);  // fits: the caller checked
  int hi = lo;
  while (fits(hi) && hi < (1 << 24)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {  // lo fits, hi does not (or is the bound)
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return workspace_layout(lo, num_q_heads, num_kv_heads, head_dim);
}

struct DecodeShape {
  int batch, hq, hkv, head_dim, page_size, max_len, forced_splits, forced_heads_per_cta;
};

// The dynamic shared-memory limit of decode_kernel<T, D, SRC> on the current device, set once (launch or prepare).
template <typename T, int D, KvSource SRC>
cudaError_t decode_smem_attribute() {
  return ensure_smem_attribute<decode_kernel<T, D, SRC>>(DecodeConfig<D, SRC>::kSmemBytes);
}

template <typename T, int D>
cudaError_t decode_smem_attributes() {
  for (const cudaError_t e : {decode_smem_attribute<T, D, KvSource::kPaged>(),
                              decode_smem_attribute<T, D, KvSource::kIndexed>(),
                              decode_smem_attribute<T, D, KvSource::kPacked>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

template <typename T, int D, KvSource SRC>
cudaError_t launch_decode_typed(DecodeArgs args, const DecodeShape& sh, const DecodeWorkspace& ws,
                                cudaStream_t stream) {
  using Cfg = DecodeConfig<D, SRC>;
  constexpr int kTableEntries = Cfg::kTableEntries;
  auto kernel = decode_kernel<T, D, SRC>;
  cudaError_t e = decode_smem_attribute<T, D, SRC>();
  if (e != cudaSuccess) return e;

  int hpc_forced = sh.forced_heads_per_cta;
  if (hpc_forced > 0 && (!is_pow2(hpc_forced) || hpc_forced > Cfg::kMaxHeadsPerCta || sh.hkv % hpc_forced != 0)) {
    return invalid_argument("decode attention", "kv_heads_per_cta ", hpc_forced,
                            " must be a power of two dividing num_kv_heads ", sh.hkv, " and <= ",
                            Cfg::kMaxHeadsPerCta, " for head_dim ", D);
  }
  // Tokens one CTA may cover: its block-table slice / token rows must fit the prefetch table.
  const long long cap = SRC == KvSource::kPaged ? static_cast<long long>(kTableEntries - 2) * sh.page_size
                                                : static_cast<long long>(kTableEntries);
  const int min_splits = ceil_div(sh.max_len, cap);
  int occ = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, Cfg::kThreads, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const long long slots = static_cast<long long>(std::max(1, current_sm_count())) * std::max(1, occ);
  // KV heads per CTA and split count: the smallest heads-per-CTA whose grid fits one wave at the minimum split
  // count, then the most splits that still fit one wave (one CTA per SM streams; see docs/KERNELS.md sweep).
  int hpc = 1;
  int splits = sh.forced_splits;
  {
    int best_h = 0;
    for (int h = 1; h <= Cfg::kMaxHeadsPerCta; h *= 2) {
      if (sh.hkv % h != 0 || (hpc_forced > 0 && h != hpc_forced)) continue;
      best_h = h;
      const long long rows = static_cast<long long>(sh.batch) * (sh.hkv / h);
      const int s0 = sh.forced_splits > 0 ? std::max(sh.forced_splits, min_splits) : min_splits;
      if (rows * s0 <= slots) break;
    }
    hpc = best_h;
    if (splits <= 0) {
      const long long rows = static_cast<long long>(sh.batch) * (sh.hkv / hpc);
      const int s_cap = std::min<long long>(kMaxDecodeSplits, std::max(1, ceil_div(sh.max_len, kMinTokensPerSplit)));
      splits = static_cast<int>(std::max<long long>(1, std::min<long long>(s_cap, slots / rows)));
    }
  }
  splits = std::max(splits, min_splits);
  if (splits > kMaxDecodeSplits) {
    return invalid_argument("decode attention", "max length ", sh.max_len, " needs ", splits,
                            " splits, more than kMaxDecodeSplits = ", kMaxDecodeSplits);
  }
  int chunk = ceil_div(ceil_div(sh.max_len, splits), kTile) * kTile;
  if (chunk > cap) chunk = static_cast<int>(cap / kTile) * kTile;
  const int grid_x = ceil_div(sh.max_len, chunk);
  args.chunk = chunk;
  args.heads_per_cta = hpc;
  if (grid_x > 1) {
    const size_t need = workspace_layout(sh.batch, sh.hq, sh.hkv, D).total;
    if (ws.ptr == nullptr || ws.bytes < need) {
      return invalid_argument("decode attention", "workspace has ", ws.bytes, " bytes, ", need,
                              " needed (decode_workspace_bytes)");
    }
    const WorkspaceLayout w = workspace_layout_of(ws.bytes, sh.batch, sh.hq, sh.hkv, D);
    char* base = static_cast<char*>(ws.ptr);
    args.counters = reinterpret_cast<int*>(base + w.counters);
    args.ws_lse = reinterpret_cast<float*>(base + w.lse);
    args.ws_o = reinterpret_cast<float*>(base + w.o);
  }
  const dim3 grid(grid_x, sh.hkv / hpc, sh.batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <KvSource SRC>
cudaError_t launch_decode(DType dtype, const DecodeArgs& args, const DecodeShape& sh, const DecodeWorkspace& ws,
                          cudaStream_t stream) {
  return dispatch_elem_head_dim("decode attention", dtype, sh.head_dim, [&](auto tag, auto dim) {
    return launch_decode_typed<decltype(tag), decltype(dim)::value, SRC>(args, sh, ws, stream);
  });
}

// Shared validation of the fields every decode variant's params P has: cudaSuccess or the invalid-value error.
template <class P>
cudaError_t check_common(const char* what, const P& p) {
  const cudaError_t e = check_paged_attention(what, p);
  if (e != cudaSuccess) return e;
  if (p.num_splits < 0 || p.num_splits > kMaxDecodeSplits) {
    return invalid_argument(what, "num_splits ", p.num_splits, " outside 0..", kMaxDecodeSplits);
  }
  return cudaSuccess;
}

// The fields every decode variant fills from its params P; k / v: the cache (or packed) K / V base pointers.
template <class P>
DecodeArgs base_args(const P& p, const void* k, const void* v) {
  DecodeArgs a{};
  a.kv = paged_kv(p, k, v);
  a.heads = gqa_heads(p);
  a.q = p.q;
  a.out = p.out;
  a.lse = p.lse;
  a.scale_log2 = p.scale * kLog2e;
  return a;
}

}  // namespace
}  // namespace detail

size_t decode_workspace_bytes(int batch, int num_q_heads, int num_kv_heads, int head_dim) {
  return detail::workspace_layout(batch, num_q_heads, num_kv_heads, head_dim).total;
}

cudaError_t decode_workspace_init(DecodeWorkspace ws, cudaStream_t stream) {
  if (ws.ptr == nullptr || ws.bytes == 0) return cudaSuccess;
  return cudaMemsetAsync(ws.ptr, 0, ws.bytes, stream);
}

const char* launch_error_detail() { return detail::launch_error_slot().c_str(); }

cudaError_t paged_decode_attention(const PagedDecodeParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "paged_decode_attention";
  const cudaError_t e = check_common(what, p);
  if (e != cudaSuccess) return e;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr || p.seq_lens == nullptr) {
    return invalid_argument(what, "k_cache, v_cache, block_table and seq_lens must be set");
  }
  if (p.max_seq_len <= 0) return invalid_argument(what, "max_seq_len ", p.max_seq_len, " must be > 0");
  if (static_cast<long long>(p.max_pages_per_seq) * p.page_size < p.max_seq_len) {
    return invalid_argument(what, "max_seq_len ", p.max_seq_len, " exceeds max_pages_per_seq * page_size");
  }
  DecodeArgs a = base_args(p, p.k_cache, p.v_cache);
  a.seq_lens = p.seq_lens;
  if (p.kv_heads_per_cta < 0) {
    return invalid_argument(what, "kv_heads_per_cta ", p.kv_heads_per_cta, " must be >= 0");
  }
  const DecodeShape sh{p.batch,       p.num_q_heads, p.num_kv_heads, p.head_dim,
                       p.page_size,   p.max_seq_len, p.num_splits,   p.kv_heads_per_cta};
  return launch_decode<KvSource::kPaged>(p.dtype, a, sh, p.workspace, stream);
}

cudaError_t sparse_decode_attention_indexed(const SparseIndexDecodeParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "sparse_decode_attention_indexed";
  const cudaError_t e = check_common(what, p);
  if (e != cudaSuccess) return e;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr || p.indices == nullptr ||
      p.num_indices == nullptr) {
    return invalid_argument(what, "k_cache, v_cache, block_table, indices and num_indices must be set");
  }
  if (p.index_stride <= 0) return invalid_argument(what, "index_stride ", p.index_stride, " must be > 0");
  DecodeArgs a = base_args(p, p.k_cache, p.v_cache);
  a.indices = p.indices;
  a.num_indices = p.num_indices;
  a.index_stride = p.index_stride;
  const DecodeShape sh{p.batch,     p.num_q_heads,  p.num_kv_heads, p.head_dim,
                       p.page_size, p.index_stride, p.num_splits,   1};
  return launch_decode<KvSource::kIndexed>(p.dtype, a, sh, p.workspace, stream);
}

cudaError_t sparse_decode_attention_packed(const SparsePackedDecodeParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "sparse_decode_attention_packed";
  const cudaError_t e = check_common(what, p);
  if (e != cudaSuccess) return e;
  if (p.packed_k == nullptr || p.packed_v == nullptr || p.num_packed == nullptr || p.seq_lens == nullptr) {
    return invalid_argument(what, "packed_k, packed_v, num_packed and seq_lens must be set");
  }
  if (p.local_window < 0 || p.packed_capacity < 0 || p.packed_capacity + p.local_window <= 0) {
    return invalid_argument(what, "packed_capacity ", p.packed_capacity, " / local_window ", p.local_window,
                            " must be >= 0 with a positive sum");
  }
  if (p.local_window > 0 && (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr)) {
    return invalid_argument(what, "k_cache, v_cache and block_table must be set when local_window > 0");
  }
  const int32_t* const per_seq[] = {p.local_windows, p.packed_rows, p.q_rows};
  const char* const per_seq_names[] = {"local_windows", "packed_rows", "q_rows"};
  for (int i = 0; i < 3; ++i) {
    if ((reinterpret_cast<uintptr_t>(per_seq[i]) & 3u) != 0) {
      return invalid_argument(what, per_seq_names[i], " must be 4-byte aligned (an int32 array)");
    }
  }
  DecodeArgs a = base_args(p, p.k_cache != nullptr ? p.k_cache : p.packed_k,
                           p.v_cache != nullptr ? p.v_cache : p.packed_v);
  a.seq_lens = p.seq_lens;
  a.packed_k = p.packed_k;
  a.packed_v = p.packed_v;
  a.num_packed = p.num_packed;
  a.local_windows = p.local_windows;
  a.packed_rows = p.packed_rows;
  a.q_rows = p.q_rows;
  a.packed_capacity = p.packed_capacity;
  a.local_window = p.local_window;
  const DecodeShape sh{p.batch,     p.num_q_heads, p.num_kv_heads, p.head_dim, p.page_size,
                       p.packed_capacity + p.local_window, p.num_splits, 1};
  return launch_decode<KvSource::kPacked>(p.dtype, a, sh, p.workspace, stream);
}

cudaError_t prepare_decode_attention_kernels() {
  return detail::for_each_type_head_dim<__nv_bfloat16, __half>([](auto tag, auto dim) {
    return detail::decode_smem_attributes<decltype(tag), decltype(dim)::value>();
  });
}

}  // namespace spade::kernels
