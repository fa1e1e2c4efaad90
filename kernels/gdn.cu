// Gated DeltaNet decoding kernels (kernels/gdn.cuh). Math and layouts: kernels/gdn_ref.h, docs/GDN.md §7 and §11.
//
// Work decomposition (both kernels): one CTA of 128 threads per (sequence, value head, 32-column tile of d_v). The
// CTA keeps its [d_k, 32] fp32 slice of the state in registers: thread (tx = tid % 8, ty = tid / 8) holds columns
// 4tx..4tx+3 (one float4) of rows ty, ty + 16, ..., so a warp reads 4 full 128-byte row segments per load and every
// state element is read once and (when written) written once — the kernels are HBM-bound on the state.
// Column reductions over d_k (S^T x) are a thread-local sum over its rows, two shuffles (the 4 row groups of a warp)
// and a 4-warp sum through shared memory. The state loads are issued first so they are in flight while the CTA
// normalises q/k and stages the buffer.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gdn.cuh"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels {
namespace {

using detail::ElemTraits;
using detail::invalid_argument;

constexpr int kThreads = 128;
constexpr int kTileV = 32;  // d_v columns per CTA
constexpr int kWarps = kThreads / 32;

/// 4-byte global->shared asynchronous copy (L1-allocating), completed by cp_async_wait like cp_async_16.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(detail::smem_addr(smem)), "l"(gmem));
}

template <typename T>
__device__ __forceinline__ float ld_f(const T* p) {
  return ElemTraits<T>::to_float(*p);
}

// ---- the thread's slice of a [D, D] fp32 state head: rows ty + 16 r (r < D / 16), columns col..col+3 ----

template <int D>
__device__ __forceinline__ void load_state(float4 (&S)[D / 16], const float* head, bool valid, int ty, int col) {
#pragma unroll
  for (int r = 0; r < D / 16; ++r)
    S[r] = valid ? *reinterpret_cast<const float4*>(head + static_cast<size_t>(r * 16 + ty) * D + col)
                 : make_float4(0.f, 0.f, 0.f, 0.f);
}

template <int D>
__device__ __forceinline__ void store_state(float* head, const float4 (&S)[D / 16], int ty, int col) {
#pragma unroll
  for (int r = 0; r < D / 16; ++r) *reinterpret_cast<float4*>(head + static_cast<size_t>(r * 16 + ty) * D + col) = S[r];
}

/// Column sums S^T kx and S^T qx of the slice (kx, qx: [D] fp32 in shared memory) over the 4 row groups of the warp
/// (lanes 8 apart), reduced by transposition: two shuffle stages of 4 and 2 values (not 2 x 8) leave every lane two
/// sums, returned as {column 4 tx + 2 hi8, column 4 tx + 2 hi8 + 1} of vector `which` (0: S^T kx, 1: S^T qx), with
/// which = bit 4 and hi8 = bit 3 of the lane. The caller adds the warps of the tile.
template <int D>
__device__ __forceinline__ float2 readout(const float4 (&S)[D / 16], const float* kx, const float* qx, int ty,
                                          int lane) {
  float pa[4], pc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) pa[e] = pc[e] = 0.f;
#pragma unroll
  for (int r = 0; r < D / 16; ++r) {
    const float kr = kx[r * 16 + ty], qr = qx[r * 16 + ty];
    pa[0] += S[r].x * kr; pa[1] += S[r].y * kr; pa[2] += S[r].z * kr; pa[3] += S[r].w * kr;
    pc[0] += S[r].x * qr; pc[1] += S[r].y * qr; pc[2] += S[r].z * qr; pc[3] += S[r].w * qr;
  }
  const bool hi16 = (lane & 16) != 0, hi8 = (lane & 8) != 0;
  float keep[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) keep[e] = (hi16 ? pc[e] : pa[e]) + __shfl_xor_sync(0xffffffffu, hi16 ? pa[e] : pc[e], 16);
  float2 r;
  r.x = (hi8 ? keep[2] : keep[0]) + __shfl_xor_sync(0xffffffffu, hi8 ? keep[0] : keep[2], 8);
  r.y = (hi8 ? keep[3] : keep[1]) + __shfl_xor_sync(0xffffffffu, hi8 ? keep[1] : keep[3], 8);
  return r;
}

/// One warp: q^ = l2norm(q) * scale, k^ = l2norm(k) ([HF] l2norm; no normalisation when !l2) of one token's key head
/// (q, k: [D] 16-bit, global or shared memory) into qn, kn ([D] fp32, shared). Returns k^ . q^ when kWithDot.
template <typename T, int D, bool kWithDot>
__device__ __forceinline__ float normalise_qk_warp(const T* q, const T* k, float* qn, float* kn, float scale,
                                                   float eps, bool l2, int lane) {
  constexpr int E = D / 32;
  float qv[E], kv[E], sq = 0.f, sk = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    qv[i] = ElemTraits<T>::to_float(q[lane + 32 * i]);
    kv[i] = ElemTraits<T>::to_float(k[lane + 32 * i]);
    sq += qv[i] * qv[i];
    sk += kv[i] * kv[i];
  }
  sq = detail::warp_sum_xor(sq, 1, 16);
  sk = detail::warp_sum_xor(sk, 1, 16);
  const float fq = l2 ? scale / sqrtf(sq + eps) : scale;
  const float fk = l2 ? 1.f / sqrtf(sk + eps) : 1.f;
  float kq = 0.f;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    qn[lane + 32 * i] = qv[i] * fq;
    kn[lane + 32 * i] = kv[i] * fk;
    if constexpr (kWithDot) kq += (qv[i] * fq) * (kv[i] * fk);
  }
  if constexpr (kWithDot) kq = detail::warp_sum_xor(kq, 1, 16);
  return kq;
}

// =====================================================================================================================
// Recurrent form
// =====================================================================================================================

// What the recurrent and the buffered step kernels both take (step_args fills it from either params struct): the
// step's tokens (GdnStepTokens), the output and the state pool, the head counts and the q/k normalisation.
struct StepArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const int32_t* cu_tokens;
  void* out;
  float* state_pool;
  int hk_heads, hv_heads, group;
  float scale, eps;
  bool l2;
};

struct RecArgs : StepArgs {
  const int32_t* state_slots;
  const int32_t* draft_state_slots;
  int num_state_slots;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 8) gdn_recurrent_kernel(RecArgs a) {  // <= 64 registers: 8 CTAs per SM
  constexpr int RPT = D / 16;  // state rows per thread
  __shared__ float qn[D], kn[D], vs[kTileV], us[kTileV];
  __shared__ __align__(16) float red[2][kWarps][kTileV];
  __shared__ float sc[4];  // g, beta, k^.q^

  const int b = blockIdx.x, hv = blockIdx.y, c0 = blockIdx.z * kTileV;
  const int hk = hv / a.group;
  const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3, warp = tid >> 5, lane = tid & 31;
  const int t0 = a.cu_tokens[b], n = a.cu_tokens[b + 1] - t0;
  const int slot = a.state_slots[b];
  const bool slot_ok = slot >= 0 && slot < a.num_state_slots;
  const size_t head_off = (static_cast<size_t>(slot_ok ? slot : 0) * a.hv_heads + hv) * D * D;

  float4 S[RPT];
  load_state<D>(S, a.state_pool + head_off, slot_ok, ty, c0 + 4 * tx);
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);

  for (int s = 0; s < n; ++s) {
    const int t = t0 + s;
    // q^, k^ (warp 0), v tile (warp 1), g / beta.
    if (warp == 0) {
      const size_t row = (static_cast<size_t>(t) * a.hk_heads + hk) * D;
      const float kq = normalise_qk_warp<T, D, true>(q + row, k + row, qn, kn, a.scale, a.eps, a.l2, lane);
      if (lane == 0) sc[2] = kq;
    } else if (warp == 1) {
      vs[lane] = ld_f(v + (static_cast<size_t>(t) * a.hv_heads + hv) * D + c0 + lane);
      if (lane == 0) {
        sc[0] = a.g[static_cast<size_t>(t) * a.hv_heads + hv];
        sc[1] = a.beta[static_cast<size_t>(t) * a.hv_heads + hv];
      }
    }
    __syncthreads();
    // a = S^T k^, c = S^T q^ (old state).
    const float2 part = readout<D>(S, kn, qn, ty, lane);
    *reinterpret_cast<float2*>(&red[(lane >> 4) & 1][warp][4 * tx + 2 * ((lane >> 3) & 1)]) = part;
    __syncthreads();
    const float eg = expf(sc[0]);
    if (tid < kTileV) {
      float av = 0.f, cv = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        av += red[0][w][tid];
        cv += red[1][w][tid];
      }
      const float u = sc[1] * (vs[tid] - eg * av);  // u = beta (v - (e^g S)^T k^)
      us[tid] = u;
      const float o = eg * cv + sc[2] * u;          // o = (e^g S + k^ u^T)^T q^
      out[(static_cast<size_t>(t) * a.hv_heads + hv) * D + c0 + tid] = ElemTraits<T>::from_float(o);
    }
    __syncthreads();
    const float4 u4 = *reinterpret_cast<const float4*>(us + 4 * tx);
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const float kr = kn[r * 16 + ty];
      S[r].x = eg * S[r].x + kr * u4.x;
      S[r].y = eg * S[r].y + kr * u4.y;
      S[r].z = eg * S[r].z + kr * u4.z;
      S[r].w = eg * S[r].w + kr * u4.w;
    }
    if (a.draft_state_slots != nullptr) {
      const int ds = a.draft_state_slots[t];
      if (ds >= 0 && ds < a.num_state_slots)
        store_state<D>(a.state_pool + (static_cast<size_t>(ds) * a.hv_heads + hv) * D * D, S, ty, c0 + 4 * tx);
    }
    __syncthreads();  // smem of this token is reused by the next
  }
  if (a.draft_state_slots == nullptr && slot_ok && n > 0) store_state<D>(a.state_pool + head_off, S, ty, c0 + 4 * tx);
}

// =====================================================================================================================
// Buffered step (chunkwise decode / KV-only / parallel verification)
//
// One CTA per (sequence, value head, 32 * TPC columns) with TPC tile groups of 128 threads (the recurrent kernel's
// tile layout per group). The per-CTA dependency chain is short: seq slot -> ring metadata + block-table row (staged
// in shared memory) + checkpoint slot -> checkpoint and buffered entries; the shared phases (q/k normalisation, k^
// staging, dot products) run on all warps of the CTA. The ring metadata is updated by a second, one-thread-per-
// sequence kernel (gdn_buffered_finish_kernel) in the same stream, so no CTA waits on an atomic before it retires.
// =====================================================================================================================

struct BufArgs : StepArgs {
  void* buf_k;
  void* buf_u;
  float* buf_g;
  int32_t* ring_start;
  int32_t* ring_len;
  const int32_t* ring_capacity;
  const int32_t* block_tables;
  const int32_t* state_slots;
  uint8_t* state_valid;
  const int32_t* seq_slots;
  const uint8_t* flags;
  uint8_t* flags_out;
  int num_state_slots;
  int max_blocks_per_seq;
  int block_size;
  int tbl_entries;  // block-table entries staged per sequence: min(max_blocks_per_seq, ceil(cap_max / block_size))
  int next_tokens;
  int cap_max;      // max_ring_capacity: shared-memory sizing
  int max_tokens;   // host bound on tokens per sequence (<= MT)
  bool verify;
};

/// Shared-memory carve-up of one buffered-step CTA (offsets in bytes; every section 16-byte aligned).
struct BufSmem {
  int kb, ub, G, coef, tbl, tok, qn, kn, wk, wq, Ac, Qc, vs, bt, red, R, C, qr, kr, vr, gn, total;
  __host__ __device__ BufSmem(int D, int CW, int MT, int CAP, int TBL) {
    auto al = [](int x) { return (x + 15) & ~15; };
    int o = 0;
    kb = o;   o += al(CAP * D * 2);            // buffered k^ (16-bit), entries 0..h+n-1
    ub = o;   o += al(CAP * CW * 2);           // buffered u (16-bit) of the CTA's CW columns, entries 0..h+n-1
    G = o;    o += al(CAP * 4);                // cumulative log decay of entries 0..h+n-1
    coef = o; o += al(CAP * 4);                // flush coefficients
    tbl = o;  o += al(TBL * 4);                // the sequence's block-table row
    tok = o;  o += al(CAP * 4);                // pool token index of ring entries 0..h+n-1
    qn = o;   o += al(MT * D * 4);
    kn = o;   o += al(MT * D * 4);
    wk = o;   o += al(MT * CAP * 4);           // e^{G_s - G_j} k^_s . k^_j
    wq = o;   o += al(MT * CAP * 4);           // e^{G_s - G_j} q^_s . k^_j
    Ac = o;   o += al(MT * MT * 4);            // beta_s e^{G_s - G_t} k^_s . k^_t   (t < s)
    Qc = o;   o += al(MT * MT * 4);            // e^{G_s - G_t} q^_s . k^_t          (t <= s)
    vs = o;   o += al(MT * CW * 4);
    bt = o;   o += al(MT * 4);                 // beta
    red = o;  o += al(8 * MT * CW * 4);        // [tile][a|c][warp of tile][s][32] partial S^T x
    R = o;    o += al(MT * CW * 4);
    C = o;    o += al(MT * CW * 4);
    qr = o;   o += al(MT * D * 2);             // this step's raw q / k / v (16-bit) and g, staged asynchronously
    kr = o;   o += al(MT * D * 2);
    vr = o;   o += al(MT * CW * 2);
    gn = o;   o += al(MT * 4);
    total = o;
  }
};

// TPC tile groups of 128 threads per CTA, each group owning 32 columns of d_v: CTA = (sequence, value head, CW =
// 32 * TPC columns). TPC = D / 32 is one CTA per head (the dependency chain paid once per head, shared phases not
// repeated); TPC = 1 gives 4x more, smaller CTAs (more of them resident, so one CTA's chain overlaps others' loads).
// Registers are capped at 64 per thread (8 / TPC CTAs of 128 * TPC threads per SM).
template <typename T, int D, int MT, int TPC>
__global__ void __launch_bounds__(128 * TPC, 8 / TPC) gdn_buffered_kernel(BufArgs a) {
  constexpr int NT = 128 * TPC, NW = NT / 32, RPT = D / 16, CH = D / 8, CW = 32 * TPC;
  static_assert(MT >= 1 && MT <= 32 && 32 % MT == 0, "step tokens: a divisor of the warp (dot-product lanes, scan)");
  extern __shared__ __align__(16) unsigned char smem[];
  const BufSmem L(D, CW, MT, a.cap_max, a.tbl_entries);
  T* kb = reinterpret_cast<T*>(smem + L.kb);
  T* ub = reinterpret_cast<T*>(smem + L.ub);
  float* G = reinterpret_cast<float*>(smem + L.G);
  float* coef = reinterpret_cast<float*>(smem + L.coef);
  int32_t* tbl = reinterpret_cast<int32_t*>(smem + L.tbl);
  int32_t* tokx = reinterpret_cast<int32_t*>(smem + L.tok);
  float* qn = reinterpret_cast<float*>(smem + L.qn);
  float* kn = reinterpret_cast<float*>(smem + L.kn);
  float* wk = reinterpret_cast<float*>(smem + L.wk);
  float* wq = reinterpret_cast<float*>(smem + L.wq);
  float* Ac = reinterpret_cast<float*>(smem + L.Ac);
  float* Qc = reinterpret_cast<float*>(smem + L.Qc);
  float* vs = reinterpret_cast<float*>(smem + L.vs);
  float* bt = reinterpret_cast<float*>(smem + L.bt);
  float* red = reinterpret_cast<float*>(smem + L.red);
  float* Rs = reinterpret_cast<float*>(smem + L.R);
  float* Cs = reinterpret_cast<float*>(smem + L.C);
  T* qraw = reinterpret_cast<T*>(smem + L.qr);
  T* kraw = reinterpret_cast<T*>(smem + L.kr);
  T* vraw = reinterpret_cast<T*>(smem + L.vr);
  float* gnew = reinterpret_cast<float*>(smem + L.gn);

  const int b = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tg = tid >> 7, t7 = tid & 127, tx = t7 & 7, ty = t7 >> 3, lw = t7 >> 5;
  const int cb = blockIdx.z * CW;  // first column of the CTA
  const int c0 = cb + tg * 32;     // first column of this thread's tile

  // ---- level 1: this step's tokens (raw q / k / v rows, beta, g: asynchronous copies) and the sequence slot ----
  const int t0 = a.cu_tokens[b];
  const int n = min(a.cu_tokens[b + 1] - t0, MT);
  constexpr int UCH = CW / 8;  // 16-byte chunks of the CTA's u / v columns
  {
    const T* q = static_cast<const T*>(a.q);
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    for (int idx = tid; idx < n * (2 * CH + UCH); idx += NT) {  // per token: CH q chunks, CH k chunks, UCH v chunks
      const int s = idx / (2 * CH + UCH), w = idx % (2 * CH + UCH);  // compile-time divisors
      if (w < 2 * CH) {
        const int ch = w < CH ? w : w - CH;
        const T* src = (w < CH ? q : k) + (static_cast<size_t>(t0 + s) * a.hk_heads + hk) * D + ch * 8;
        detail::cp_async_16((w < CH ? qraw : kraw) + s * D + ch * 8, src, true);
      } else {
        const int ch = w - 2 * CH;
        detail::cp_async_16(vraw + s * CW + ch * 8, v + (static_cast<size_t>(t0 + s) * a.hv_heads + hv) * D + cb + ch * 8,
                            true);
      }
    }
    for (int s = tid; s < n; s += NT) {
      cp_async_4(bt + s, a.beta + static_cast<size_t>(t0 + s) * a.hv_heads + hv);
      cp_async_4(gnew + s, a.g + static_cast<size_t>(t0 + s) * a.hv_heads + hv);
    }
    detail::cp_async_commit();
  }
  // ---- level 2 (in parallel): ring metadata, block-table row, checkpoint slot ----
  const int slot = a.seq_slots[b];
  const int32_t* trow = a.block_tables + static_cast<size_t>(slot) * a.max_blocks_per_seq;
  for (int i = tid; i < a.tbl_entries; i += NT) tbl[i] = trow[i];
  const int start = a.ring_start[slot], h = a.ring_len[slot], cap = a.ring_capacity[slot];
  const int sslot = a.state_slots[slot];
  const bool can_write_state = sslot >= 0 && sslot < a.num_state_slots;
  const bool valid = a.state_valid[slot] != 0 && can_write_state;
  bool flush;
  if (a.flags != nullptr) {
    flush = (a.flags[b] & kGdnFlush) != 0;
  } else {
    flush = a.verify ? (h + 2 * n > cap) : (h + n + a.next_tokens > cap);
  }
  const size_t head_off = (static_cast<size_t>(can_write_state ? sslot : 0) * a.hv_heads + hv) * D * D;

  // ---- level 3: checkpoint loads first (they stream while the rest of the chain runs) ----
  float4 S[RPT];
  load_state<D>(S, a.state_pool + head_off, valid, ty, c0 + 4 * tx);

  __syncthreads();  // tbl

  // ---- level 4: buffered entries j < h (k^ and u rows in stored precision, g), asynchronous copies that land
  //      while the new tokens are normalised ----
  auto token_of = [&](int i) -> size_t {  // pool token index of logical entry i
    const int r = (start + i) % cap;
    return static_cast<size_t>(tbl[r / a.block_size]) * a.block_size + r % a.block_size;
  };
  const T* pk = static_cast<const T*>(a.buf_k);
  const T* pu = static_cast<const T*>(a.buf_u);
  for (int idx = tid; idx < h * (CH + UCH); idx += NT) {
    const bool is_k = idx < h * CH;  // k^ rows first, then u rows
    if (is_k) {
      const int j = idx / CH, ch = idx % CH;
      detail::cp_async_16(kb + static_cast<size_t>(j) * D + ch * 8, pk + (token_of(j) * a.hk_heads + hk) * D + ch * 8,
                          true);
    } else {
      const int li = idx - h * CH, j = li / UCH, ch = li % UCH;
      detail::cp_async_16(ub + static_cast<size_t>(j) * CW + ch * 8, pu + (token_of(j) * a.hv_heads + hv) * D + cb + ch * 8,
                          true);
    }
  }
  // The g rows are staged by warp 0 alone: it scans them while the other warps normalise the new tokens.
  if (warp == 0)
    for (int j = lane; j < h; j += 32) cp_async_4(G + j, a.buf_g + token_of(j) * a.hv_heads + hv);
  detail::cp_async_commit();
  // Pool token index of every entry (read after the next barrier: new-key, u and g writes); the pool size is
  // checked to fit int32 by the launcher.
  for (int i = tid; i < h + n; i += NT) tokx[i] = static_cast<int32_t>(token_of(i));

  // This step's rows (the first commit group) have landed once every thread waited for its own and passed the
  // barrier; the buffered entries (second group) may still be in flight.
  detail::cp_async_wait<1>();
  __syncthreads();

  // ---- while the buffered entries land: warp 0 waits for its own g copies (all of them) and scans the cumulative
  //      log decay since the checkpoint over entries 0..h+n-1; the other warps normalise the new tokens' q^, k^
  //      (fp32) and convert v from the staged rows ----
  const int m = h + n;
  if (warp == 0) {
    detail::cp_async_wait<0>();
    if (lane < n) G[h + lane] = gnew[lane];
    __syncwarp();
    float carry = 0.f;
    for (int base = 0; base < m; base += 32) {
      float x = base + lane < m ? G[base + lane] : 0.f;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      x += carry;
      if (base + lane < m) G[base + lane] = x;
      carry = __shfl_sync(0xffffffffu, x, 31);
    }
  }
  for (int s = warp - 1; s < n && warp > 0; s += NW - 1) {
    normalise_qk_warp<T, D, false>(qraw + s * D, kraw + s * D, qn + s * D, kn + s * D, a.scale, a.eps, a.l2, lane);
#pragma unroll
    for (int i = 0; i < TPC; ++i) vs[s * CW + lane + 32 * i] = ElemTraits<T>::to_float(vraw[s * CW + lane + 32 * i]);
  }
  detail::cp_async_wait<0>();
  __syncthreads();

  // ---- dot products k^_s . k_j and q^_s . k_j with their decay factors; checkpoint readouts ----
  // One warp per key j (history entries j < h in stored precision, then the new tokens in fp32); lane = (token s,
  // part g): LPS = 32 / MT lanes per token, each over EPL = D / LPS contiguous elements read in VW-wide vectors,
  // starting at a lane-rotated vector so the lanes of a quarter-warp hit distinct banks; log2(LPS) shuffle stages.
  {
    constexpr int LPS = 32 / MT, EPL = D / LPS, VW = EPL >= 4 ? 4 : EPL, NV = EPL / VW;
    const int ls = lane / LPS, lg = lane % LPS;
    for (int j = warp; j < m; j += NW) {
      const bool hist = j < h;
      float dk = 0.f, dq = 0.f;
      if (ls < n) {
        const float* krow = kn + ls * D + lg * EPL;
        const float* qrow = qn + ls * D + lg * EPL;
#pragma unroll
        for (int v0 = 0; v0 < NV; ++v0) {
          const int e = ((v0 + lane) % NV) * VW;
          float x[VW], kk[VW], qq[VW];
          if (hist) {
            const T* src = kb + static_cast<size_t>(j) * D + lg * EPL + e;
#pragma unroll
            for (int i = 0; i < VW; ++i) x[i] = ElemTraits<T>::to_float(src[i]);
          } else {
            const float* src = kn + (j - h) * D + lg * EPL + e;
#pragma unroll
            for (int i = 0; i < VW; ++i) x[i] = src[i];
          }
#pragma unroll
          for (int i = 0; i < VW; ++i) {
            kk[i] = krow[e + i];
            qq[i] = qrow[e + i];
          }
#pragma unroll
          for (int i = 0; i < VW; ++i) {
            dk += kk[i] * x[i];
            dq += qq[i] * x[i];
          }
        }
      }
#pragma unroll
      for (int o = 1; o < LPS; o <<= 1) {
        dk += __shfl_xor_sync(0xffffffffu, dk, o);
        dq += __shfl_xor_sync(0xffffffffu, dq, o);
      }
      if (lg == 0 && ls < n) {
        const int s = ls;
        if (hist) {
          const float e = expf(G[h + s] - G[j]);
          wk[s * a.cap_max + j] = e * dk;
          wq[s * a.cap_max + j] = e * dq;
        } else {
          const int t = j - h;
          const float e = expf(G[h + s] - G[h + t]);
          Ac[s * MT + t] = t < s ? bt[s] * e * dk : 0.f;
          Qc[s * MT + t] = t <= s ? e * dq : 0.f;
        }
      }
    }
  }
  if (valid) {
    for (int s = 0; s < n; ++s) {
      const float2 part = readout<D>(S, kn + s * D, qn + s * D, ty, lane);
      *reinterpret_cast<float2*>(
          &red[(((tg * 2 + ((lane >> 4) & 1)) * 4 + lw) * MT + s) * 32 + 4 * tx + 2 * ((lane >> 3) & 1)]) = part;
    }
  }
  __syncthreads();

  // ---- R_s = beta_s (v_s - e^{G_s} S0^T k^_s - sum_j wk u_j),  C_s = e^{G_s} S0^T q^_s + sum_j wq u_j ----
  for (int p = tid; p < n * CW; p += NT) {
    const int s = p / CW, c = p % CW, ct = c >> 5, cc = c & 31;
    float R = 0.f, C = 0.f;
    if (valid) {
      float av = 0.f, cv = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        av += red[(((ct * 2 + 0) * 4 + w) * MT + s) * 32 + cc];
        cv += red[(((ct * 2 + 1) * 4 + w) * MT + s) * 32 + cc];
      }
      const float e = expf(G[h + s]);
      R = e * av;
      C = e * cv;
    }
    const float* wks = wk + s * a.cap_max;
    const float* wqs = wq + s * a.cap_max;
    for (int j = 0; j < h; ++j) {
      const float u = ElemTraits<T>::to_float(ub[j * CW + c]);
      R += wks[j] * u;
      C += wqs[j] * u;
    }
    Rs[p] = bt[s] * (vs[p] - R);
    Cs[p] = C;
  }
  __syncthreads();

  // ---- U = (I + A)^{-1} R by forward substitution, outputs, buffer writes ----
  T* out = static_cast<T*>(a.out);
  if (t7 < 32) {
    const int lc = tg * 32 + t7, c = cb + lc;  // local / global column
    float Ur[MT];                              // U of this column, in registers (fully unrolled over MT)
#pragma unroll
    for (int s = 0; s < MT; ++s) {
      if (s < n) {
        float U = Rs[s * CW + lc];
#pragma unroll
        for (int t = 0; t < s; ++t) U -= Ac[s * MT + t] * Ur[t];
        Ur[s] = U;
        float o = Cs[s * CW + lc];
#pragma unroll
        for (int t = 0; t <= s; ++t) o += Qc[s * MT + t] * Ur[t];
        out[(static_cast<size_t>(t0 + s) * a.hv_heads + hv) * D + c] = ElemTraits<T>::from_float(o);
        const T ur = ElemTraits<T>::from_float(U);
        const size_t tok = static_cast<size_t>(tokx[h + s]);
        static_cast<T*>(a.buf_u)[(tok * a.hv_heads + hv) * D + c] = ur;
        ub[(h + s) * CW + lc] = ur;  // stored precision, for the decode flush
        if (c == 0) a.buf_g[tok * a.hv_heads + hv] = a.g[static_cast<size_t>(t0 + s) * a.hv_heads + hv];
      }
    }
  } else {
    // New keys in stored precision: smem copy for the flush; the pool copy once per key head.
    const bool writer = hv % a.group == 0 && blockIdx.z == 0;
    const int li = tg * 96 + (t7 - 32);
    for (int idx = li; idx < n * D; idx += 96 * TPC) {
      const int s = idx / D, i = idx % D;
      const T kr = ElemTraits<T>::from_float(kn[s * D + i]);
      kb[(h + s) * D + i] = kr;
      if (writer) static_cast<T*>(a.buf_k)[(static_cast<size_t>(tokx[h + s]) * a.hk_heads + hk) * D + i] = kr;
    }
  }

  // ---- flush: S <- e^{G_f} S0 + sum_{j < nf} e^{G_f - G_j} k^_j u_j^T, written once ----
  if (flush && can_write_state) {
    const int nf = a.verify ? h : h + n;
    const float Gf = nf > 0 ? G[nf - 1] : 0.f;
    for (int j = tid; j < nf; j += NT) coef[j] = expf(Gf - G[j]);
    __syncthreads();
    const float ef = expf(Gf);
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      S[r].x *= ef; S[r].y *= ef; S[r].z *= ef; S[r].w *= ef;
    }
    for (int j = 0; j < nf; ++j) {
      const uint2 raw = *reinterpret_cast<const uint2*>(ub + j * CW + tg * 32 + 4 * tx);
      const T* u = reinterpret_cast<const T*>(&raw);
      const float cj = coef[j];
      const float u0 = cj * ElemTraits<T>::to_float(u[0]), u1 = cj * ElemTraits<T>::to_float(u[1]);
      const float u2 = cj * ElemTraits<T>::to_float(u[2]), u3 = cj * ElemTraits<T>::to_float(u[3]);
#pragma unroll
      for (int r = 0; r < RPT; ++r) {
        const float kr = ElemTraits<T>::to_float(kb[j * D + r * 16 + ty]);
        S[r].x += kr * u0; S[r].y += kr * u1; S[r].z += kr * u2; S[r].w += kr * u3;
      }
    }
    store_state<D>(a.state_pool + head_off, S, ty, c0 + 4 * tx);
  }
}

/// Ring-metadata update after gdn_buffered_kernel (same stream): recomputes each sequence's flush decision from the
/// unchanged metadata (or reads `flags`) and applies gdn_ref.cpp's pointer moves.
__global__ void gdn_buffered_finish_kernel(BufArgs a, int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int slot = a.seq_slots[b];
  const int n = min(a.cu_tokens[b + 1] - a.cu_tokens[b], a.max_tokens);
  const int start = a.ring_start[slot], h = a.ring_len[slot], cap = a.ring_capacity[slot];
  const int sslot = a.state_slots[slot];
  const bool can_write_state = sslot >= 0 && sslot < a.num_state_slots;
  bool flush;
  if (a.flags != nullptr) {
    flush = (a.flags[b] & kGdnFlush) != 0;
  } else {
    flush = a.verify ? (h + 2 * n > cap) : (h + n + a.next_tokens > cap);
  }
  flush = flush && can_write_state;
  if (!a.verify) {
    if (flush) {
      a.ring_start[slot] = (start + h + n) % cap;
      a.ring_len[slot] = 0;
    } else {
      a.ring_len[slot] = h + n;
    }
  } else if (flush) {
    a.ring_start[slot] = (start + h) % cap;
    a.ring_len[slot] = 0;
  }
  if (flush) a.state_valid[slot] = 1;
  if (a.flags_out != nullptr) a.flags_out[b] = flush ? kGdnFlush : 0;
}

__global__ void gdn_verify_commit_kernel(int32_t* ring_len, const int32_t* seq_slots, const int32_t* accepted,
                                         int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) ring_len[seq_slots[b]] += accepted[b];
}

__global__ void gdn_recurrent_commit_kernel(int32_t* spec, const int32_t* accepted, int batch, int num_drafts) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int acc = accepted[b];
  if (acc <= 0 || acc > num_drafts) return;
  int32_t* row = spec + static_cast<size_t>(b) * (num_drafts + 1);
  const int32_t t = row[0];
  row[0] = row[acc];
  row[acc] = t;
}

// ---- launch plumbing -------------------------------------------------------------------------------------------

cudaError_t check_common(const char* fn, DType dtype, const GdnDims& d, const GdnOptions& o, const GdnStepTokens& t,
                         const void* out, const float* state_pool, int num_state_slots) {
  if (dtype != DType::BF16 && dtype != DType::F16) return invalid_argument(fn, "dtype must be BF16 or F16");
  if (d.num_k_heads < 1 || d.num_v_heads < 1 || d.num_v_heads % d.num_k_heads != 0)
    return invalid_argument(fn, "dims.num_v_heads ", d.num_v_heads, " must be a positive multiple of num_k_heads ",
                            d.num_k_heads);
  if (d.head_k_dim != d.head_v_dim || (d.head_k_dim != 64 && d.head_k_dim != 128))
    return invalid_argument(fn, "head_k_dim ", d.head_k_dim, " and head_v_dim ", d.head_v_dim,
                            " must be equal and one of kGdnHeadDims (64, 128)");
  if (!(o.scale >= 0.f) || !(o.l2norm_eps >= 0.f)) return invalid_argument(fn, "opt.scale / opt.l2norm_eps must be >= 0");
  if (t.batch < 0) return invalid_argument(fn, "tok.batch must be >= 0, got ", t.batch);
  if (t.batch > 65535) return invalid_argument(fn, "tok.batch ", t.batch, " > 65535");
  if (t.batch == 0) return cudaSuccess;
  if (!t.q || !t.k || !t.v || !t.g || !t.beta || !t.cu_tokens)
    return invalid_argument(fn, "tok.q/k/v/g/beta/cu_tokens must be non-null");
  if (out == nullptr) return invalid_argument(fn, "out is null");
  if (state_pool == nullptr || num_state_slots < 1)
    return invalid_argument(fn, "state_pool is null or num_state_slots < 1 (", num_state_slots, ")");
  if (t.max_tokens < 1) return invalid_argument(fn, "tok.max_tokens must be >= 1, got ", t.max_tokens);
  return cudaSuccess;
}

float resolve_scale(const GdnOptions& o, int dk) { return o.scale > 0.f ? o.scale : 1.f / sqrtf(static_cast<float>(dk)); }

// StepArgs of GdnRecurrentGpuParams or GdnBufferedGpuParams `p` (head dimension D).
template <int D, typename Params>
StepArgs step_args(const Params& p) {
  return StepArgs{p.tok.q,
                  p.tok.k,
                  p.tok.v,
                  p.tok.g,
                  p.tok.beta,
                  p.tok.cu_tokens,
                  p.out,
                  p.state_pool,
                  p.dims.num_k_heads,
                  p.dims.num_v_heads,
                  p.dims.num_v_heads / p.dims.num_k_heads,
                  resolve_scale(p.opt, D),
                  p.opt.l2norm_eps,
                  p.opt.qk_l2norm};
}

template <typename T, int D>
cudaError_t launch_recurrent(const GdnRecurrentGpuParams& p, cudaStream_t stream) {
  const RecArgs a{step_args<D>(p), p.state_slots, p.draft_state_slots, p.num_state_slots};
  const dim3 grid(p.tok.batch, p.dims.num_v_heads, D / kTileV);
  gdn_recurrent_kernel<T, D><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

/// Block-table entries a CTA stages: enough for the largest ring, at most the row length.
int table_entries(const GdnBufferedGpuParams& p) {
  return std::min(p.seqs.max_blocks_per_seq, (p.max_ring_capacity + p.buf.block_size - 1) / p.buf.block_size);
}

template <typename T, int D, int MT, int TPC>
cudaError_t launch_buffered(const GdnBufferedGpuParams& p, bool verify, cudaStream_t stream) {
  const int tbl = table_entries(p);
  const size_t smem = BufSmem(D, 32 * TPC, MT, p.max_ring_capacity, tbl).total;
  auto kernel = gdn_buffered_kernel<T, D, MT, TPC>;
  if (smem > 48 * 1024) {
    // The limit at the device's opt-in maximum: the size grows with max_ring_capacity.
    const cudaError_t e = detail::ensure_max_smem_attribute<gdn_buffered_kernel<T, D, MT, TPC>>();
    if (e != cudaSuccess) return e;
  }
  BufArgs a{};
  static_cast<StepArgs&>(a) = step_args<D>(p);
  a.buf_k = p.buf.k; a.buf_u = p.buf.u; a.buf_g = p.buf.g;
  a.ring_start = p.seqs.ring_start; a.ring_len = p.seqs.ring_len; a.ring_capacity = p.seqs.ring_capacity;
  a.block_tables = p.seqs.block_tables; a.state_slots = p.seqs.state_slots; a.state_valid = p.seqs.state_valid;
  a.seq_slots = p.seq_slots; a.flags = p.flags; a.flags_out = p.flags_out;
  a.num_state_slots = p.num_state_slots;
  a.max_blocks_per_seq = p.seqs.max_blocks_per_seq;
  a.block_size = p.buf.block_size;
  a.tbl_entries = tbl;
  a.max_tokens = p.tok.max_tokens;
  a.next_tokens = p.next_tokens;
  a.cap_max = p.max_ring_capacity;
  a.verify = verify;
  kernel<<<dim3(p.tok.batch, p.dims.num_v_heads, D / (32 * TPC)), 128 * TPC, smem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  gdn_buffered_finish_kernel<<<(p.tok.batch + 127) / 128, 128, 0, stream>>>(a, p.tok.batch);
  return cudaGetLastError();
}

/// Tile groups per CTA: the caller's choice, else 2 (bench_gdn: best or within 1% for chunkwise decode at L <= 16
/// up to batch 64) or one CTA per head for multi-token steps (verification: 2-3% faster at T = 8), for rings longer
/// than 32 tokens (KV-only: the k^ staging of up to d_k entries is then shared by all columns) and for batches of
/// 128 or more (H100, batch 256, L = 8 / 16: 249 us vs 256 / 262 us with 2), clamped to D / 32.
int tile_groups(const GdnBufferedGpuParams& p) {
  const bool one_per_head = p.max_ring_capacity > 32 || p.tok.max_tokens > 1 || p.tok.batch >= 128;
  const int want = p.tile_groups > 0 ? p.tile_groups : (one_per_head ? 4 : 2);
  return std::min(want, p.dims.head_k_dim / 32);
}

template <typename T, int D, int MT>
cudaError_t launch_tpc(const GdnBufferedGpuParams& p, bool verify, cudaStream_t stream) {
  switch (tile_groups(p)) {
    case 1: return launch_buffered<T, D, MT, 1>(p, verify, stream);
    case 2: return launch_buffered<T, D, MT, 2>(p, verify, stream);
    default:
      if constexpr (D >= 128) return launch_buffered<T, D, MT, 4>(p, verify, stream);
      return launch_buffered<T, D, MT, 2>(p, verify, stream);
  }
}

template <typename T>
cudaError_t dispatch_buffered(const GdnBufferedGpuParams& p, bool verify, cudaStream_t stream) {
  const bool one = p.tok.max_tokens == 1;
  if (p.dims.head_k_dim == 64)
    return one ? launch_tpc<T, 64, 1>(p, verify, stream) : launch_tpc<T, 64, kGdnMaxStepTokens>(p, verify, stream);
  return one ? launch_tpc<T, 128, 1>(p, verify, stream) : launch_tpc<T, 128, kGdnMaxStepTokens>(p, verify, stream);
}

cudaError_t run_buffered(const char* fn, const GdnBufferedGpuParams& p, bool verify, cudaStream_t stream) {
  cudaError_t e = check_common(fn, p.dtype, p.dims, p.opt, p.tok, p.out, p.state_pool, p.num_state_slots);
  if (e != cudaSuccess || p.tok.batch == 0) return e;
  if (p.tok.max_tokens > kGdnMaxStepTokens)
    return invalid_argument(fn, "tok.max_tokens ", p.tok.max_tokens, " > kGdnMaxStepTokens ", kGdnMaxStepTokens);
  if (p.buf.dtype != p.dtype) return invalid_argument(fn, "buf.dtype must equal dtype (16-bit buffer)");
  if (!p.buf.k || !p.buf.u || !p.buf.g || p.buf.num_blocks < 1 || p.buf.block_size < 1)
    return invalid_argument(fn, "buf.k/u/g must be non-null and num_blocks, block_size >= 1 (got ", p.buf.num_blocks,
                            ", ", p.buf.block_size, ")");
  if (static_cast<int64_t>(p.buf.num_blocks) * p.buf.block_size > INT32_MAX)
    return invalid_argument(fn, "buffer pool of ", p.buf.num_blocks, " blocks of ", p.buf.block_size,
                            " tokens exceeds 2^31 - 1 tokens");
  const GdnSeqTable& s = p.seqs;
  if (!s.ring_start || !s.ring_len || !s.ring_capacity || !s.block_tables || !s.state_slots || !s.state_valid ||
      s.max_seqs < 1 || s.max_blocks_per_seq < 1)
    return invalid_argument(fn, "every seqs array must be non-null and max_seqs, max_blocks_per_seq >= 1");
  if (!p.seq_slots) return invalid_argument(fn, "seq_slots is null");
  if (p.tok.batch > s.max_seqs) return invalid_argument(fn, "tok.batch ", p.tok.batch, " > seqs.max_seqs ", s.max_seqs);
  if (p.max_ring_capacity < 1 || p.max_ring_capacity > 256)
    return invalid_argument(fn, "max_ring_capacity must be in 1..256, got ", p.max_ring_capacity);
  if (!verify && p.flags == nullptr && (p.next_tokens < 1 || p.next_tokens > p.max_ring_capacity))
    return invalid_argument(fn, "next_tokens must be in 1..max_ring_capacity, got ", p.next_tokens);
  if (p.tile_groups < 0 || p.tile_groups == 3 || p.tile_groups > 4)
    return invalid_argument(fn, "tile_groups must be 0 (default), 1, 2 or 4, got ", p.tile_groups);
  const size_t smem = gdn_buffered_smem_bytes(p.dims.head_k_dim, p.tok.max_tokens, p.max_ring_capacity,
                                              table_entries(p), tile_groups(p));
  if (smem > 227 * 1024)
    return invalid_argument(fn, "shared memory ", smem, " B for max_ring_capacity ", p.max_ring_capacity,
                            " exceeds 227 KiB");
  return p.dtype == DType::BF16 ? dispatch_buffered<__nv_bfloat16>(p, verify, stream)
                                : dispatch_buffered<__half>(p, verify, stream);
}

}  // namespace

size_t gdn_buffered_smem_bytes(int head_dim, int max_tokens, int max_ring_capacity, int table_entries,
                               int tile_groups) {
  return static_cast<size_t>(BufSmem(head_dim, 32 * tile_groups, max_tokens == 1 ? 1 : kGdnMaxStepTokens,
                                     max_ring_capacity, table_entries)
                                 .total);
}

cudaError_t gdn_recurrent(const GdnRecurrentGpuParams& p, cudaStream_t stream) {
  const char* fn = "gdn_recurrent";
  cudaError_t e = check_common(fn, p.dtype, p.dims, p.opt, p.tok, p.out, p.state_pool, p.num_state_slots);
  if (e != cudaSuccess || p.tok.batch == 0) return e;
  if (p.state_slots == nullptr) return invalid_argument(fn, "state_slots is null");
  const bool bf = p.dtype == DType::BF16;
  if (p.dims.head_k_dim == 64)
    return bf ? launch_recurrent<__nv_bfloat16, 64>(p, stream) : launch_recurrent<__half, 64>(p, stream);
  return bf ? launch_recurrent<__nv_bfloat16, 128>(p, stream) : launch_recurrent<__half, 128>(p, stream);
}

cudaError_t gdn_chunkwise_decode(const GdnBufferedGpuParams& p, cudaStream_t stream) {
  return run_buffered("gdn_chunkwise_decode", p, false, stream);
}

cudaError_t gdn_parallel_verify(const GdnBufferedGpuParams& p, cudaStream_t stream) {
  return run_buffered("gdn_parallel_verify", p, true, stream);
}

cudaError_t gdn_verify_commit(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* accepted, int batch,
                              cudaStream_t stream) {
  const char* fn = "gdn_verify_commit";
  if (batch < 0) return invalid_argument(fn, "batch must be >= 0, got ", batch);
  if (batch == 0) return cudaSuccess;
  if (!seqs.ring_len || !seq_slots || !accepted) return invalid_argument(fn, "ring_len/seq_slots/accepted is null");
  gdn_verify_commit_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(seqs.ring_len, seq_slots, accepted, batch);
  return cudaGetLastError();
}

cudaError_t gdn_recurrent_verify_commit(int32_t* spec_state_slots, const int32_t* accepted, int batch,
                                        int num_drafts, cudaStream_t stream) {
  const char* fn = "gdn_recurrent_verify_commit";
  if (batch < 0 || num_drafts < 1)
    return invalid_argument(fn, "batch must be >= 0 and num_drafts >= 1, got ", batch, ", ", num_drafts);
  if (batch == 0) return cudaSuccess;
  if (!spec_state_slots || !accepted) return invalid_argument(fn, "spec_state_slots/accepted is null");
  gdn_recurrent_commit_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(spec_state_slots, accepted, batch, num_drafts);
  return cudaGetLastError();
}

}  // namespace spade::kernels
