// Selection, score stage: GQA-batched token scoring of predicted queries on tensor cores (kernels/selection_ref.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"
#include "kernels/paged_kv.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Scoring: grid (split, kv_head, sequence), 4 warps, each streaming 16-token key tiles through a private cp.async
// pipeline (same structure as the decode kernel). S^T[16 tokens x 8 cols] = K_tile . Qhat^T on tensor cores where the
// columns hold the hi and lo halves of each group head's fp32 query (hi = round(q), lo = round(q - hi)), so
// k . hi + k . lo carries ~16 mantissa bits of q and is accumulated in fp32. G <= 4: one mma per k-step (cols
// 0..G-1 hi, G..2G-1 lo); G in 5..8: two mmas.
// =====================================================================================================================

constexpr int kScoreWarps = 4;
constexpr int kScoreThreads = kScoreWarps * 32;
constexpr int kScoreTable = 2048;

// The token range [begin, end) of this block's split (blockIdx.x) of sequence blockIdx.z's candidates, and the
// block-table slice it reads, copied to shared memory: tab[i] = the page of logical page p0 + i. False when the split
// starts past the sequence's num_tokens (the whole block returns; the test is uniform over the block).
struct ScoreChunk {
  int begin = 0;
  int end = 0;
  int p0 = 0;
};

__device__ __forceinline__ bool load_score_chunk(const PagedKv& kv, const int32_t* num_tokens, int chunk, int32_t* tab,
                                                 ScoreChunk& c) {
  const int b = blockIdx.z;
  const int L = num_tokens[b];
  c.begin = blockIdx.x * chunk;
  if (c.begin >= L) return false;
  c.end = min(L, c.begin + chunk);
  c.p0 = kv.page_of(c.begin);
  const int np = kv.page_of(c.end - 1) - c.p0 + 1;
  const int32_t* bt = kv.table_row(b) + c.p0;
  for (int i = threadIdx.x; i < np; i += kScoreThreads) tab[i] = bt[i];
  __syncthreads();
  return true;
}

// The query heads whose parts this lane's B-operand column n = lane / 4 carries (n8 mma: 8 columns). Group G <= 4
// (two = false): one mma, columns 0..G-1 hold the heads' high parts and G..2G-1 their low parts (lo0). G in 5..8
// (two): two mmas, head0's high part in the first and head1's (the same head) low part in the second. -1: no head.
struct LaneHeads {
  bool two = false;
  int head0 = -1;
  bool lo0 = false;
  int head1 = -1;
};

__device__ __forceinline__ LaneHeads lane_heads(int lane, int G) {
  const int n = lane >> 2;
  LaneHeads h;
  h.two = 2 * G > 8;
  if (n < G) {
    h.head0 = n;
  } else if (!h.two && n < 2 * G) {
    h.head0 = n - G;
    h.lo0 = true;
  }
  h.head1 = (h.two && n < G) ? n : -1;
  return h;
}

// Writes a warp's m16n8 accumulators (s0; s1 too with `two`) transposed into its scratch: [16 tokens][9] floats per
// mma (8 columns and a pad), the second mma's tile at offset 144.
template <typename Acc>
__device__ __forceinline__ void store_score_fragments(float* scratch, int lane, const Acc s0[4], const Acc s1[4],
                                                      bool two) {
  const int g = lane >> 2;
  const int c2 = 2 * (lane & 3);
  scratch[g * 9 + c2] = static_cast<float>(s0[0]);
  scratch[g * 9 + c2 + 1] = static_cast<float>(s0[1]);
  scratch[(g + 8) * 9 + c2] = static_cast<float>(s0[2]);
  scratch[(g + 8) * 9 + c2 + 1] = static_cast<float>(s0[3]);
  if (two) {
    scratch[144 + g * 9 + c2] = static_cast<float>(s1[0]);
    scratch[144 + g * 9 + c2 + 1] = static_cast<float>(s1[1]);
    scratch[144 + (g + 8) * 9 + c2] = static_cast<float>(s1[2]);
    scratch[144 + (g + 8) * 9 + c2 + 1] = static_cast<float>(s1[3]);
  }
}

// What both scoring kernels (16-bit keys, int8 keys) set up before their pipelines: the block's KV head (blockIdx.y)
// and sequence (blockIdx.z), the warp's place, the split's candidates and block-table slice (load_score_chunk), the
// warp's slices of the staging area and the scratch, the query heads its lane's B-operand column carries
// (lane_heads), the tiles it scores and where their scores go. Dynamic shared memory: [kScoreTable int32 page table]
// [kScoreWarps x kStageBytes staged tiles][kScoreWarps x kScratch floats].
struct ScoreWarp {
  int kvh = 0;
  int b = 0;
  int warp = 0;
  int lane = 0;
  int G = 0;  // query heads per KV head
  ScoreChunk ch;
  const int32_t* tab = nullptr;     // the split's block-table slice (tab[i]: the page of logical page ch.p0 + i)
  unsigned char* stages = nullptr;  // this warp's kStageBytes of staged tiles
  float* scratch = nullptr;         // this warp's kScratch floats
  LaneHeads lh;
  const float* qbase = nullptr;  // q_hat of the group's first query head, [G, D] fp32
  float* out = nullptr;          // this (sequence, KV head)'s scores, indexed by token
  int nj = 0;                    // tiles this warp scores

  // First token of this warp's j-th tile (the split's 16-token tiles go round the warps).
  __device__ __forceinline__ int tile_begin(int j) const { return ch.begin + (warp + kScoreWarps * j) * 16; }

  // The group rule over the tile starting at token t0 (< end), once store_score_fragments has put its dot products in
  // the scratch: lane l < 16 folds token t0 + l's G query-head scores head_score(h, hi, lo) -- hi, lo: the dot products
  // with head h's high and low query parts (columns h and G + h, or h of the second mma) -- by max (rule_max) or
  // mean, multiplies by row_scale(l) and writes the token's score.
  template <typename HeadScore, typename RowScale>
  __device__ __forceinline__ void fold_group(int t0, int end, bool rule_max, HeadScore head_score,
                                             RowScale row_scale) const {
    if (lane >= 16 || t0 + lane >= end) return;
    const float* r0 = scratch + lane * 9;
    float best = -INFINITY;
    float sum = 0.f;
    for (int h = 0; h < G; ++h) {
      const float v = head_score(h, r0[h], lh.two ? r0[144 + h] : r0[G + h]);
      best = fmaxf(best, v);
      sum += v;
    }
    out[t0 + lane] = (rule_max ? best : sum / static_cast<float>(G)) * row_scale(lane);
  }
};

// Fills `w` (above) for ScoreArgs / ScoreI8Args `a`. False when the block's split starts past its sequence's tokens
// (the whole block returns).
template <int D, size_t kStageBytes, int kScratch, typename Args>
__device__ __forceinline__ bool score_warp_setup(unsigned char* smem, const Args& a, ScoreWarp& w) {
  w.kvh = blockIdx.y;
  w.b = blockIdx.z;
  w.warp = threadIdx.x >> 5;
  w.lane = threadIdx.x & 31;
  w.G = a.heads.group;
  int32_t* tab = reinterpret_cast<int32_t*>(smem);
  if (!load_score_chunk(a.kv, a.num_tokens, a.chunk, tab, w.ch)) return false;
  w.tab = tab;
  unsigned char* stage_base = smem + kScoreTable * 4;
  w.stages = stage_base + static_cast<size_t>(w.warp) * kStageBytes;
  w.scratch = reinterpret_cast<float*>(stage_base + size_t{kScoreWarps} * kStageBytes) + w.warp * kScratch;
  w.lh = lane_heads(w.lane, w.G);
  w.qbase = a.q_hat + (static_cast<size_t>(w.b) * a.heads.hq + w.kvh * w.G) * D;
  w.out = a.scores + (static_cast<size_t>(w.b) * a.kv.hkv + w.kvh) * a.score_stride;
  const int n_tiles = (w.ch.end - w.ch.begin + 15) / 16;
  w.nj = w.warp < n_tiles ? (n_tiles - w.warp + kScoreWarps - 1) / kScoreWarps : 0;
  return true;
}

template <int D>
struct ScoreConfig {
  // K only (half the bytes per stage of the decode kernel): deeper pipeline to keep as many bytes in flight.
  static constexpr int kStages = D == 256 ? 3 : 6;
  static constexpr int kChunks = D / 8;
  static constexpr int kChunksPerLane = 16 * kChunks / 32;
  static constexpr int kTileElems = 16 * D;
  static constexpr int kScratch = 2 * 16 * 9;  // floats per warp
  static constexpr size_t kSmemBytes =
      kScoreTable * 4 + size_t{kScoreWarps} * kStages * kTileElems * 2 + size_t{kScoreWarps} * kScratch * 4;
};

struct ScoreArgs {
  PagedKv kv;  // K only (kv.v unused); ScoreI8Args: the int8 keys
  GqaHeads heads;
  const float* q_hat;
  const int32_t* num_tokens;
  float* scores;
  int score_stride;
  int chunk;
  int rule_max;
};

template <typename T, int D>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(const ScoreArgs a) {
  using Tr = ElemTraits<T>;
  using Cfg = ScoreConfig<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ScoreWarp w;
  if (!score_warp_setup<D, size_t{Cfg::kStages} * Cfg::kTileElems * sizeof(T), Cfg::kScratch>(smem_raw, a, w)) return;
  const int lane = w.lane;
  const int end = w.ch.end;
  const size_t row_stride = a.kv.row_stride<D>();
  const T* kc = a.kv.k_head<T, D>(w.kvh);
  T* my_stages = reinterpret_cast<T*>(w.stages);
  auto issue = [&](int tile_start, int stage) {
    T* sk = my_stages + stage * Cfg::kTileElems;
    for_each_tile_chunk<Cfg::kChunks, Cfg::kChunksPerLane, 32>(lane, tile_start, end, [&](int tok, int col, int v,
                                                                                         bool valid) {
      const T* gk = kc;
      if (valid) gk = kc + a.kv.slot(w.tab[a.kv.page_of(v) - w.ch.p0], v) * row_stride;
      cp_async_16(sk + swz(tok, col, Cfg::kChunks), gk + col * 8, valid);
    });
  };

  // B operands: column n = lane / 4 of Qhat^T, rows d = 16ks + 2c (+1, +8, +9).
  const int c4 = lane & 3;
  const bool two = w.lh.two;
  const int head0 = w.lh.head0;
  const bool lo0 = w.lh.lo0;
  auto part = [&](int head, bool lo, int d) -> float {
    if (head < 0) return 0.f;
    const float q = w.qbase[static_cast<size_t>(head) * D + d];
    return lo ? q - Tr::to_float(Tr::from_float(q)) : q;
  };
  uint32_t qf0[D / 16][2];
  uint32_t qf1[D / 16][2];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int d = ks * 16 + 2 * c4;
    qf0[ks][0] = Tr::pack2(part(head0, lo0, d), part(head0, lo0, d + 1));
    qf0[ks][1] = Tr::pack2(part(head0, lo0, d + 8), part(head0, lo0, d + 9));
    qf1[ks][0] = Tr::pack2(part(w.lh.head1, true, d), part(w.lh.head1, true, d + 1));
    qf1[ks][1] = Tr::pack2(part(w.lh.head1, true, d + 8), part(w.lh.head1, true, d + 9));
  }

  auto issue_tile = [&](int j, int stage) { issue(w.tile_begin(j), stage); };
  warp_cp_async_pipeline<Cfg::kStages>(w.nj, issue_tile, [&](int j, int stage) {
    const T* sk = my_stages + stage * Cfg::kTileElems;
    float s0[4] = {0.f, 0.f, 0.f, 0.f};
    float s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t af[4];
      ldmatrix_tile_a(af, sk, lane, ks, [](int r, int c) { return swz(r, c, Cfg::kChunks); });
      Tr::mma(s0, af, qf0[ks], s0);
      if (two) Tr::mma(s1, af, qf1[ks], s1);
    }
    store_score_fragments(w.scratch, lane, s0, s1, two);
    __syncwarp();
    w.fold_group(
        w.tile_begin(j), end, a.rule_max, [](int, float hi, float lo) { return hi + lo; }, [](int) { return 1.f; });
    __syncwarp();
  });
}

// The dynamic shared-memory limit of score_kernel<T, D> on the current device, set once (launch or prepare).
template <typename T, int D>
cudaError_t score_smem_attribute() {
  return ensure_smem_attribute<score_kernel<T, D>>(ScoreConfig<D>::kSmemBytes);
}

// =====================================================================================================================
// Scoring with the compact int8 keys (ScoreKeys::kInt8): the same grid, warps and per-warp cp.async pipeline over
// 16-token tiles, half the key bytes per tile plus the tile's 16 fp32 row scales. S^T[16 x 8] = Kq_tile . Qq^T with
// mma.m16n8k32 on int8 (s32 accumulation, exact): each query head is carried as int8 hi + lo parts (x = q * 127 /
// max|q|, hi = rint(x), lo = rint((x - hi) * 254)), hi in columns 0..G-1 and lo in G..2G-1 (G <= 4), or hi and lo in
// two mmas (G in 5..8). score = k_scale[t] * (max|q| / 127) * (hi . k + lo . k / 254), combined over the group.
// The int8 tile's 16-byte chunks are laid out as the bf16 kernel's (same ldmatrix addressing: a b16 8x8 matrix row
// is 16 int8 keys, which is the m16n8k32 A fragment); rows of 4 chunks (D 64) swizzle by (row / 2) % 4.
// =====================================================================================================================

template <int D>
struct ScoreI8Config {
  static constexpr int kChunks = D / 16;  // 16-byte chunks per token row
  static constexpr int kChunksPerLane = 16 * kChunks / 32;
  // Half the bytes per tile of the bf16 kernel: twice its stages keep as many bytes in flight.
  static constexpr int kStages = D == 256 ? 6 : 12;
  static constexpr int kKeyBytes = 16 * D;
  static constexpr int kTileBytes = kKeyBytes + 16 * 4;  // keys, then the 16 rows' scales
  static constexpr int kScratch = 2 * 16 * 9 + 8;        // floats per warp: two 16 x 9 tiles, the heads' steps
  static constexpr size_t kSmemBytes =
      kScoreTable * 4 + size_t{kScoreWarps} * kStages * kTileBytes + size_t{kScoreWarps} * kScratch * 4;
};

// ScoreArgs over the int8 keys (kv.k), plus their row scales.
struct ScoreI8Args : ScoreArgs {
  const float* k_scale;  // [cache rows, hkv]
};

// Offset in 16-bit words of 16-byte chunk `chunk` of row `row` of an int8 tile with kChunks chunks per row.
template <int kChunks>
__device__ __forceinline__ int swz_i8(int row, int chunk) {
  if constexpr (kChunks >= 8) {
    return swz(row, chunk, kChunks);
  } else {
    return row * kChunks * 8 + ((chunk ^ ((row >> 1) & (kChunks - 1))) << 3);
  }
}

__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void mma_s8(int d[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_s8x4(int a, int b, int c, int d) {
  return (static_cast<uint32_t>(a) & 0xFFu) | ((static_cast<uint32_t>(b) & 0xFFu) << 8) |
         ((static_cast<uint32_t>(c) & 0xFFu) << 16) | ((static_cast<uint32_t>(d) & 0xFFu) << 24);
}

template <int D>
__global__ void __launch_bounds__(kScoreThreads) score_i8_kernel(const ScoreI8Args a) {
  using Cfg = ScoreI8Config<D>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ScoreWarp w;
  if (!score_warp_setup<D, size_t{Cfg::kStages} * Cfg::kTileBytes, Cfg::kScratch>(smem_raw, a, w)) return;
  const int lane = w.lane;
  const int end = w.ch.end;
  const int kvh = w.kvh;
  const size_t row_stride = static_cast<size_t>(a.kv.hkv) * D;  // bytes between cache rows
  const int8_t* kc = static_cast<const int8_t*>(a.kv.k) + static_cast<size_t>(kvh) * D;
  unsigned char* my_stages = w.stages;
  float* head_step = w.scratch + 2 * 16 * 9;  // [G] max|q| / 127 per group head
  auto issue = [&](int tile_start, int stage) {
    unsigned char* st = my_stages + stage * Cfg::kTileBytes;
    uint16_t* sk = reinterpret_cast<uint16_t*>(st);
    for_each_tile_chunk<Cfg::kChunks, Cfg::kChunksPerLane, 32>(lane, tile_start, end, [&](int tok, int col, int v,
                                                                                         bool valid) {
      const int8_t* gk = kc;
      if (valid) gk = kc + a.kv.slot(w.tab[a.kv.page_of(v) - w.ch.p0], v) * row_stride;
      cp_async_16(sk + swz_i8<Cfg::kChunks>(tok, col), gk + col * 16, valid);
    });
    if (lane < 16) {
      const int v = tile_start + lane;
      const bool valid = v < end;
      const float* gs = a.k_scale;
      if (valid) gs = a.k_scale + a.kv.slot(w.tab[a.kv.page_of(v) - w.ch.p0], v) * a.kv.hkv + kvh;
      cp_async_4(st + Cfg::kKeyBytes + lane * 4, gs, valid);
    }
  };

  // B operands (m16n8k32, int8): column n = lane / 4 of Qq^T, rows d = 32 ks + 4 c (+0..3) and 32 ks + 16 + 4 c.
  const int c4 = lane & 3;
  const bool two = w.lh.two;
  const int head0 = w.lh.head0;
  const bool lo0 = w.lh.lo0;
  const int head1 = w.lh.head1;
  const float* qbase = w.qbase;
  // max |q| of this lane's head (both of its operands are the same head): the 4 lanes of a column split d.
  float amax = 0.f;
  if (head0 >= 0) {
    const float* q = qbase + static_cast<size_t>(head0) * D;
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float x = q[ks * 32 + 16 * r + 4 * c4 + i];
          amax = fmaxf(amax, isnan(x) ? INFINITY : fabsf(x));
        }
  }
  amax = warp_max_xor(amax, 1, 2);
  // A non-finite query scores NaN (ranks lowest), a zero one 0.
  const bool usable = amax > 0.f && isfinite(amax);
  const float inv = usable ? __fdiv_rn(127.f, amax) : 0.f;
  if (c4 == 0 && head0 >= 0 && !lo0) head_step[head0] = usable ? amax / 127.f : (amax == 0.f ? 0.f : NAN);
  auto part = [&](int head, bool lo, int d) -> int {
    if (head < 0) return 0;
    const float x = qbase[static_cast<size_t>(head) * D + d] * inv;
    const float hi = fminf(127.f, fmaxf(-127.f, rintf(x)));
    return lo ? static_cast<int>(fminf(127.f, fmaxf(-127.f, rintf((x - hi) * 254.f)))) : static_cast<int>(hi);
  };
  uint32_t qf0[D / 32][2];
  uint32_t qf1[D / 32][2];
#pragma unroll
  for (int ks = 0; ks < D / 32; ++ks) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int d = ks * 32 + 16 * r + 4 * c4;
      qf0[ks][r] = pack_s8x4(part(head0, lo0, d), part(head0, lo0, d + 1), part(head0, lo0, d + 2),
                             part(head0, lo0, d + 3));
      qf1[ks][r] = pack_s8x4(part(head1, true, d), part(head1, true, d + 1), part(head1, true, d + 2),
                             part(head1, true, d + 3));
    }
  }
  __syncwarp();

  auto issue_tile = [&](int j, int stage) { issue(w.tile_begin(j), stage); };
  warp_cp_async_pipeline<Cfg::kStages>(w.nj, issue_tile, [&](int j, int stage) {
    const unsigned char* st = my_stages + stage * Cfg::kTileBytes;
    const uint16_t* sk = reinterpret_cast<const uint16_t*>(st);
    int s0[4] = {0, 0, 0, 0};
    int s1[4] = {0, 0, 0, 0};
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks) {
      uint32_t af[4];
      ldmatrix_tile_a(af, sk, lane, ks, [](int r, int c) { return swz_i8<Cfg::kChunks>(r, c); });
      mma_s8(s0, af, qf0[ks]);
      if (two) mma_s8(s1, af, qf1[ks]);
    }
    store_score_fragments(w.scratch, lane, s0, s1, two);
    __syncwarp();
    // hi, lo: int8 dot products of the key with the query's steps; lo's step is 1/254 of hi's.
    w.fold_group(
        w.tile_begin(j), end, a.rule_max,
        [&](int h, float hi, float lo) { return (hi + lo * (1.f / 254.f)) * head_step[h]; },
        [&](int l) { return reinterpret_cast<const float*>(st + Cfg::kKeyBytes)[l]; });
    __syncwarp();
  });
}

template <int D>
cudaError_t score_i8_smem_attribute() {
  return ensure_smem_attribute<score_i8_kernel<D>>(ScoreI8Config<D>::kSmemBytes);
}

// Launches scoring kernel `kernel` (score_kernel or score_i8_kernel, `smem_bytes` of dynamic shared memory, its
// limit already set) on grid (split, KV head, sequence): as many splits of max_len as fill the device at the kernel's
// occupancy, each short enough for its block-table slice to fit kScoreTable entries; sets a.chunk to the split length.
template <typename Args>
cudaError_t launch_score_splits(void (*kernel)(Args), size_t smem_bytes, Args a, int batch, int page_size,
                                int max_len, cudaStream_t stream) {
  int occ = 0;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kScoreThreads, smem_bytes);
  if (e != cudaSuccess) return e;
  const long long slots = static_cast<long long>(std::max(1, current_sm_count())) * std::max(1, occ);
  const long long cap = static_cast<long long>(kScoreTable - 2) * page_size;
  const int splits =
      choose_splits(static_cast<long long>(batch) * a.kv.hkv, slots, max_len, 256, ceil_div(max_len, cap), 1 << 20);
  a.chunk = ceil_div(ceil_div(max_len, splits), 16) * 16;
  const dim3 grid(ceil_div(max_len, a.chunk), a.kv.hkv, batch);
  kernel<<<grid, kScoreThreads, smem_bytes, stream>>>(a);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_score_i8(ScoreI8Args a, int batch, int page_size, int max_len, cudaStream_t stream) {
  const cudaError_t e = score_i8_smem_attribute<D>();
  if (e != cudaSuccess) return e;
  return launch_score_splits(score_i8_kernel<D>, ScoreI8Config<D>::kSmemBytes, a, batch, page_size, max_len, stream);
}

// =====================================================================================================================
// Quantize-on-append: one warp per (token, KV head), D / 32 contiguous keys per lane.
// =====================================================================================================================

constexpr int kQuantWarps = 8;

struct QuantArgs {
  const void* k;
  int8_t* q;
  float* scale;
  const int32_t* positions;
  const int32_t* seq_idx;
  const int32_t* block_table;
  int tokens, hkv, page_size, max_pages, num_pages, batch;
};

template <typename T, int D>
__global__ void __launch_bounds__(kQuantWarps * 32) quantize_keys_kernel(const QuantArgs a) {
  using Tr = ElemTraits<T>;
  constexpr int E = D / 32;
  const long long w = static_cast<long long>(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<long long>(a.tokens) * a.hkv) return;
  const int t = static_cast<int>(w / a.hkv);
  const int kvh = static_cast<int>(w % a.hkv);
  long long row = t;
  if (a.positions != nullptr) {
    const int b = a.seq_idx[t];
    const int pos = a.positions[t];
    if (b < 0 || b >= a.batch || pos < 0 ||
        static_cast<long long>(pos) >= static_cast<long long>(a.max_pages) * a.page_size)
      return;
    const int page = a.block_table[static_cast<size_t>(b) * a.max_pages + pos / a.page_size];
    if (page < 0 || page >= a.num_pages) return;
    row = static_cast<long long>(page) * a.page_size + pos % a.page_size;
  }
  const size_t base = (static_cast<size_t>(row) * a.hkv + kvh) * D + static_cast<size_t>(lane) * E;
  const T* src = static_cast<const T*>(a.k) + base;
  float v[E];
  float amax = 0.f;
  bool nan = false;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    v[i] = Tr::to_float(src[i]);
    nan = nan || isnan(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = warp_max_xor(amax, 1, 16);
  nan = __any_sync(0xffffffffu, nan);
  const float scale = nan ? NAN : __fdiv_rn(amax, 127.f);
  const bool usable = scale > 0.f && isfinite(scale);
  int8_t out[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const float x = usable ? rintf(__fdiv_rn(v[i], scale)) : 0.f;
    out[i] = static_cast<int8_t>(fminf(127.f, fmaxf(-127.f, x)));
  }
  int8_t* dst = a.q + base;
#pragma unroll
  for (int i = 0; i < E; ++i) dst[i] = out[i];
  if (lane == 0) a.scale[static_cast<size_t>(row) * a.hkv + kvh] = scale;
}

template <typename T, int D>
cudaError_t launch_score_typed(ScoreArgs a, int batch, int page_size, int max_len, cudaStream_t stream) {
  const cudaError_t e = score_smem_attribute<T, D>();
  if (e != cudaSuccess) return e;
  return launch_score_splits(score_kernel<T, D>, ScoreConfig<D>::kSmemBytes, a, batch, page_size, max_len, stream);
}

}  // namespace

cudaError_t prepare_score_kernels() {
  return for_each_type_head_dim<__nv_bfloat16, __half>([](auto tag, auto dim) {
    cudaError_t e = score_smem_attribute<decltype(tag), decltype(dim)::value>();
    if (e == cudaSuccess) e = score_i8_smem_attribute<decltype(dim)::value>();
    return e;
  });
}

}  // namespace detail

cudaError_t score_tokens(const ScoreTokensParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "score_tokens";
  if (p.keys != ScoreKeys::kBf16 && p.keys != ScoreKeys::kInt8)
    return invalid_argument(what, "keys ", static_cast<int>(p.keys), " is not bf16 or int8");
  const bool i8 = p.keys == ScoreKeys::kInt8;
  if (p.q_hat == nullptr || p.block_table == nullptr || p.num_tokens == nullptr || p.scores == nullptr) {
    return invalid_argument(what, "q_hat, block_table, num_tokens and scores must be set");
  }
  if (!i8 && p.k_cache == nullptr) return invalid_argument(what, "k_cache must be set (keys bf16)");
  if (i8 && (p.k_int8 == nullptr || p.k_scale == nullptr))
    return invalid_argument(what, "k_int8 and k_scale must be set (keys int8)");
  const cudaError_t e = check_paged_gqa(what, p);
  if (e != cudaSuccess) return e;
  if (p.score_stride <= 0) return invalid_argument(what, "score_stride ", p.score_stride, " must be > 0");
  ScoreArgs a{};
  a.kv = paged_kv(p, i8 ? static_cast<const void*>(p.k_int8) : p.k_cache, nullptr);
  a.heads = gqa_heads(p);
  a.q_hat = p.q_hat;
  a.num_tokens = p.num_tokens;
  a.scores = p.scores;
  a.score_stride = p.score_stride;
  a.rule_max = p.rule == GqaScoreRule::kMax ? 1 : 0;
  const int max_len = static_cast<int>(std::min<long long>(
      p.score_stride, static_cast<long long>(p.max_pages_per_seq) * p.page_size));
  if (i8) {
    ScoreI8Args a8{};
    static_cast<ScoreArgs&>(a8) = a;
    a8.k_scale = p.k_scale;
    return dispatch_head_dim(what, p.head_dim, [&](auto dim) {
      return launch_score_i8<decltype(dim)::value>(a8, p.batch, p.page_size, max_len, stream);
    });
  }
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    return launch_score_typed<decltype(tag), decltype(dim)::value>(a, p.batch, p.page_size, max_len, stream);
  });
}

cudaError_t quantize_keys(const QuantizeKeysParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "quantize_keys";
  if (p.tokens < 0) return invalid_argument(what, "tokens ", p.tokens, " must be >= 0");
  if (p.tokens == 0) return cudaSuccess;
  if (p.k_cache == nullptr || p.k_int8 == nullptr || p.k_scale == nullptr)
    return invalid_argument(what, "k_cache, k_int8 and k_scale must be set");
  if (p.num_kv_heads <= 0) return invalid_argument(what, "num_kv_heads ", p.num_kv_heads, " must be > 0");
  if (!is_pow2(p.page_size)) return invalid_argument(what, "page_size ", p.page_size, " must be a power of two");
  if (p.num_pages <= 0) return invalid_argument(what, "num_pages ", p.num_pages, " must be > 0");
  if (p.positions != nullptr) {
    if (p.seq_idx == nullptr || p.block_table == nullptr)
      return invalid_argument(what, "seq_idx and block_table must be set with positions");
    if (p.max_pages_per_seq <= 0 || p.batch <= 0)
      return invalid_argument(what, "max_pages_per_seq ", p.max_pages_per_seq, " / batch ", p.batch, " must be > 0");
  } else if (static_cast<long long>(p.tokens) > static_cast<long long>(p.num_pages) * p.page_size) {
    return invalid_argument(what, "tokens ", p.tokens, " exceed the pool's ", p.num_pages, " x ", p.page_size,
                            " cache rows");
  }
  QuantArgs a{p.k_cache, p.k_int8, p.k_scale, p.positions, p.seq_idx, p.block_table, p.tokens, p.num_kv_heads,
              p.page_size, p.max_pages_per_seq, p.num_pages, p.batch};
  const long long warps = static_cast<long long>(p.tokens) * p.num_kv_heads;
  return dispatch_elem_head_dim(what, p.dtype, p.head_dim, [&](auto tag, auto dim) {
    quantize_keys_kernel<decltype(tag), decltype(dim)::value>
        <<<ceil_div(warps, kQuantWarps), kQuantWarps * 32, 0, stream>>>(a);
    return cudaGetLastError();
  });
}

}  // namespace spade::kernels
