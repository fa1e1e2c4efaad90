// Causal prefill attention over the paged KV cache, FlashAttention-2 style (tensor cores, online softmax).
//
// Grid (row block, kv_head, sequence), 4 warps. The query rows of one (sequence, KV head) are the (token, group
// head) pairs r = i * G + g, so a 64-row CTA covers 64 / G tokens and every K/V tile loaded into shared memory is
// used by the whole GQA group. Each warp owns 16 rows: S = Q K^T (Q as the A operand in registers, K via ldmatrix),
// online softmax per row, P re-used in registers as the A operand (C->A fragment identity), O += P V (V via
// ldmatrix.trans). K/V tiles of 64 tokens, double-buffered with cp.async, block-table lookups per token (the
// tile's pages are resolved while the previous tile computes). Row blocks are launched heaviest (latest tokens)
// first. Semantics: kernels/paged_attention_ref.h.
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

constexpr int kPfWarps = 4;
constexpr int kPfThreads = kPfWarps * 32;
constexpr int kPfRows = kPfWarps * 16;
constexpr int kPfKv = 64;  // tokens per K/V tile

template <int D>
struct PrefillConfig {
  static constexpr int kChunks = D / 8;
  static constexpr int kTileElems = kPfKv * D;
  static constexpr int kChunksPerThread = kPfKv * kChunks / kPfThreads;
  static constexpr int kStages = 3;
  static constexpr size_t kSmemBytes = size_t{kStages} * 2 * kTileElems * 2;  // stages x (K, V)
};

struct PrefillArgs {
  PagedKv kv;
  GqaHeads heads;
  const void* q;
  const int32_t* cu_q_lens;
  const int32_t* seq_lens;
  const int32_t* skip;  // optional [batch]: nonzero = the sequence is another kernel's (nothing read or written)
  void* out;
  float* lse;
  float scale_log2;
};

template <typename T, int D>
__global__ void __launch_bounds__(kPfThreads) prefill_kernel(const PrefillArgs a) {
  using Tr = ElemTraits<T>;
  using Cfg = PrefillConfig<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* stages = reinterpret_cast<T*>(smem_raw);

  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c4 = lane & 3;
  const int G = a.heads.group;
  if (a.skip != nullptr && a.skip[b] != 0) return;  // e.g. a sparse decode row of a mixed step: its pages may be gone
  const int q_start = a.cu_q_lens[b];
  const int q_len = a.cu_q_lens[b + 1] - q_start;
  const int seq_len = a.seq_lens[b];
  const int n_rows = q_len * G;
  const int row_block = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  const int row0 = row_block * kPfRows;
  if (row0 >= n_rows) return;
  const int ctx0 = seq_len - q_len;  // position of query token 0
  const int cta_last_row = min(row0 + kPfRows, n_rows) - 1;
  const int kv_end = ctx0 + cta_last_row / G + 1;
  const int n_kv_tiles = (kv_end + kPfKv - 1) / kPfKv;

  const int wrow0 = row0 + warp * 16;
  const bool warp_active = wrow0 < n_rows;
  const int warp_last_pos = warp_active ? ctx0 + (min(wrow0 + 15, n_rows - 1)) / G : -1;
  // This lane's two rows (g and g + 8 of the warp tile); position -1 marks a padding row.
  const int ra = wrow0 + g;
  const int rb = wrow0 + g + 8;
  const int pos_a = ra < n_rows ? ctx0 + ra / G : -1;
  const int pos_b = rb < n_rows ? ctx0 + rb / G : -1;

  // Q A-fragments: a0a1 = Q[row g][16ks + 2c..], a2a3 = Q[row g+8][..], a4a5 = Q[row g][+8], a6a7 = Q[row g+8][+8].
  uint32_t qf[D / 16][4];
  {
    const T* qa = pos_a >= 0 ? static_cast<const T*>(a.q) +
                                   (static_cast<size_t>(q_start + ra / G) * a.heads.hq + kvh * G + ra % G) * D
                             : nullptr;
    const T* qb = pos_b >= 0 ? static_cast<const T*>(a.q) +
                                   (static_cast<size_t>(q_start + rb / G) * a.heads.hq + kvh * G + rb % G) * D
                             : nullptr;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int d = ks * 16 + 2 * c4;
      qf[ks][0] = qa != nullptr ? *reinterpret_cast<const uint32_t*>(qa + d) : 0u;
      qf[ks][1] = qb != nullptr ? *reinterpret_cast<const uint32_t*>(qb + d) : 0u;
      qf[ks][2] = qa != nullptr ? *reinterpret_cast<const uint32_t*>(qa + d + 8) : 0u;
      qf[ks][3] = qb != nullptr ? *reinterpret_cast<const uint32_t*>(qb + d + 8) : 0u;
    }
  }

  const size_t row_stride = a.kv.row_stride<D>();
  const T* kc = a.kv.k_head<T, D>(kvh);
  const T* vc = a.kv.v_head<T, D>(kvh);
  const int32_t* bt = a.kv.table_row(b);
  auto issue = [&](int tile, int stage) {
    T* sk = stages + stage * 2 * Cfg::kTileElems;
    T* sv = sk + Cfg::kTileElems;
    const int t0 = tile * kPfKv;
    for_each_tile_chunk<Cfg::kChunks, Cfg::kChunksPerThread, kPfThreads>(tid, t0, kv_end, [&](int tok, int col, int v,
                                                                                            bool valid) {
      const T* gk = kc;
      const T* gv = vc;
      if (valid) {
        const size_t row = a.kv.slot(__ldg(bt + a.kv.page_of(v)), v);
        gk = kc + row * row_stride;
        gv = vc + row * row_stride;
      }
      const int so = swz(tok, col, Cfg::kChunks);
      cp_async_16(sk + so, gk + col * 8, valid);
      cp_async_16(sv + so, gv + col * 8, valid);
    });
  };

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float ma = -INFINITY, mb = -INFINITY, la = 0.f, lb = 0.f;

#pragma unroll
  for (int st = 0; st < Cfg::kStages - 1; ++st) {
    if (st < n_kv_tiles) issue(st, st);
    cp_async_commit();
  }
  for (int j = 0; j < n_kv_tiles; ++j) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // tile j visible to all warps; every warp is done with tile j - 1 (its stage is refilled next)
    if (j + Cfg::kStages - 1 < n_kv_tiles) issue(j + Cfg::kStages - 1, (j + Cfg::kStages - 1) % Cfg::kStages);
    cp_async_commit();
    const int t0 = j * kPfKv;
    if (warp_active && t0 <= warp_last_pos) {
      const T* sk = stages + (j % Cfg::kStages) * 2 * Cfg::kTileElems;
      const T* sv = sk + Cfg::kTileElems;
      float s[kPfKv / 8][4];
#pragma unroll
      for (int nt = 0; nt < kPfKv / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int np = 0; np < kPfKv / 16; ++np) {
          uint32_t bf[4];
          const int i = lane >> 3;
          const int tok = np * 16 + (lane & 7) + ((i >> 1) << 3);
          ldmatrix_x4(bf, sk + swz(tok, 2 * ks + (i & 1), Cfg::kChunks));
          Tr::mma(s[2 * np], qf[ks], bf, s[2 * np]);
          Tr::mma(s[2 * np + 1], qf[ks], bf + 2, s[2 * np + 1]);
        }
      }
      // Causal mask + online softmax. s[nt][0..1]: row a, tokens t0 + 8nt + 2c (+1); s[nt][2..3]: row b.
      float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kPfKv / 8; ++nt) {
        const int v = t0 + nt * 8 + 2 * c4;
        s[nt][0] = v <= pos_a ? s[nt][0] * a.scale_log2 : -INFINITY;
        s[nt][1] = v + 1 <= pos_a ? s[nt][1] * a.scale_log2 : -INFINITY;
        s[nt][2] = v <= pos_b ? s[nt][2] * a.scale_log2 : -INFINITY;
        s[nt][3] = v + 1 <= pos_b ? s[nt][3] * a.scale_log2 : -INFINITY;
        mxa = fmaxf(mxa, fmaxf(s[nt][0], s[nt][1]));
        mxb = fmaxf(mxb, fmaxf(s[nt][2], s[nt][3]));
      }
      mxa = warp_max_xor(mxa, 1, 2);
      mxb = warp_max_xor(mxb, 1, 2);
      const float mna = fmaxf(ma, mxa);
      const float mnb = fmaxf(mb, mxb);
      const float ua = mna == -INFINITY ? 0.f : mna;  // rows with nothing valid yet stay at zero
      const float ub = mnb == -INFINITY ? 0.f : mnb;
      const float ala = exp2_approx(ma - ua);
      const float alb = exp2_approx(mb - ub);
      ma = mna;
      mb = mnb;
      float suma = 0.f, sumb = 0.f;
#pragma unroll
      for (int nt = 0; nt < kPfKv / 8; ++nt) {
        s[nt][0] = exp2_approx(s[nt][0] - ua);
        s[nt][1] = exp2_approx(s[nt][1] - ua);
        s[nt][2] = exp2_approx(s[nt][2] - ub);
        s[nt][3] = exp2_approx(s[nt][3] - ub);
        suma += s[nt][0] + s[nt][1];
        sumb += s[nt][2] + s[nt][3];
      }
      la = la * ala + suma;
      lb = lb * alb + sumb;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        o[nt][0] *= ala;
        o[nt][1] *= ala;
        o[nt][2] *= alb;
        o[nt][3] *= alb;
      }
#pragma unroll
      for (int kk = 0; kk < kPfKv / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = Tr::pack2(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = Tr::pack2(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = Tr::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = Tr::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t bf[4];
          const int i = lane >> 3;
          const int tok = kk * 16 + (lane & 7) + ((i & 1) << 3);
          ldmatrix_x4_trans(bf, sv + swz(tok, 2 * dp + (i >> 1), Cfg::kChunks));
          Tr::mma(o[2 * dp], pa, bf, o[2 * dp]);
          Tr::mma(o[2 * dp + 1], pa, bf + 2, o[2 * dp + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  la = warp_sum_xor(la, 1, 2);
  lb = warp_sum_xor(lb, 1, 2);
  T* out = static_cast<T*>(a.out);
  // Row r of the tile (accumulators o[.][half], o[.][half + 1]; running max m, sum l): its output and lse.
  auto store_row = [&](int r, int half, float m, float l) {
    const size_t qh = static_cast<size_t>(q_start + r / G) * a.heads.hq + kvh * G + r % G;
    const float inv = 1.f / l;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      *reinterpret_cast<uint32_t*>(out + qh * D + nt * 8 + 2 * c4) =
          Tr::pack2(o[nt][half] * inv, o[nt][half + 1] * inv);
    }
    if (a.lse != nullptr && c4 == 0) a.lse[qh] = (m + log2f(l)) * kLn2;
  };
  if (pos_a >= 0) store_row(ra, 0, ma, la);
  if (pos_b >= 0) store_row(rb, 2, mb, lb);
}

// The dynamic shared-memory limit of prefill_kernel<T, D> on the current device, set once (launch or prepare).
template <typename T, int D>
cudaError_t prefill_smem_attribute() {
  return ensure_smem_attribute<prefill_kernel<T, D>>(PrefillConfig<D>::kSmemBytes);
}

template <typename T, int D>
cudaError_t launch_prefill_typed(const PrefillArgs& a, int batch, int max_q_len, cudaStream_t stream) {
  using Cfg = PrefillConfig<D>;
  auto kernel = prefill_kernel<T, D>;
  cudaError_t e = prefill_smem_attribute<T, D>();
  if (e != cudaSuccess) return e;
  const dim3 grid(ceil_div(static_cast<long long>(max_q_len) * a.heads.group, kPfRows), a.kv.hkv, batch);
  kernel<<<grid, kPfThreads, Cfg::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace
}  // namespace detail

cudaError_t paged_prefill_attention(const PagedPrefillParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "paged_prefill_attention";
  const cudaError_t e = check_paged_attention(what, p);
  if (e != cudaSuccess) return e;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.block_table == nullptr || p.cu_q_lens == nullptr ||
      p.seq_lens == nullptr) {
    return invalid_argument(what, "k_cache, v_cache, block_table, cu_q_lens and seq_lens must be set");
  }
  if (p.max_q_len <= 0) return invalid_argument(what, "max_q_len ", p.max_q_len, " must be > 0");
  if ((reinterpret_cast<uintptr_t>(p.skip) & 3u) != 0) {
    return invalid_argument(what, "skip must be 4-byte aligned (an int32 array)");
  }
  PrefillArgs a{};
  a.kv = paged_kv(p, p.k_cache, p.v_cache);
  a.heads = gqa_heads(p);
  a.q = p.q;
  a.cu_q_lens = p.cu_q_lens;
  a.seq_lens = p.seq_lens;
  a.skip = p.skip;
  a.out = p.out;
  a.lse = p.lse;
  a.scale_log2 = p.scale * kLog2e;
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    return launch_prefill_typed<decltype(tag), decltype(dim)::value>(a, p.batch, p.max_q_len, stream);
  });
}

cudaError_t prepare_prefill_attention_kernels() {
  return detail::for_each_type_head_dim<__nv_bfloat16, __half>([](auto tag, auto dim) {
    return detail::prefill_smem_attribute<decltype(tag), decltype(dim)::value>();
  });
}

}  // namespace spade::kernels
