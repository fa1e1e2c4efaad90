// Selection, delta transfer: slot plan of a selection against the holder's table and its apply (selection_delta_ref.h).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "kernels/launch_util.cuh"
#include "kernels/selection.cuh"
#include "kernels/selection_common.cuh"

namespace spade::kernels {
namespace detail {
namespace {

// =====================================================================================================================
// Delta transfer (selection_delta_ref's rule). One CTA of 256 threads per row; the row's selection, the free slots
// by rank, a kept bitmap over the selection and a class per slot (kept / empty / stale) live in shared memory
// (36.5 KB at k = 4096). Ranks come from block-wide exclusive scans in 256-element chunks with running totals; the
// free slots' scan carries two counters packed in one int (empty in the low 16 bits, stale in the high ones:
// a 256-element chunk adds at most 256 to either). A row with more entering tokens than `capacity` finds the capacity-th best entering key with a
// 4-pass 8-bit radix select (a shared 256-bin histogram, radix_select_digit), then keeps the keys above it and the earliest equal ones
// (topk's tie rule).
// =====================================================================================================================

constexpr int kDeltaThreads = 256;

struct DeltaArgs {
  const int32_t* indices;
  const float* scores;
  int32_t* mirror;
  const int32_t* mirror_rows;
  int32_t* delta_slots;
  int32_t* delta_positions;
  int32_t* row_info;
  unsigned long long* totals;
  int k;
  int capacity;
  int score_stride;
};

constexpr size_t delta_smem_bytes(int k) {
  return static_cast<size_t>(k) * 4 * 2 + static_cast<size_t>((k + 31) / 32) * 4 + static_cast<size_t>(k);
}

__device__ __forceinline__ int lower_bound_i32(const int32_t* a, int n, int32_t x) {
  int lo = 0;
  int hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kDeltaThreads) delta_kernel(const DeltaArgs a) {
  using Scan = cub::BlockScan<int, kDeltaThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ int s_n, s_kept, s_empty, s_digit, s_above;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int k = a.k;
  int32_t* sel = reinterpret_cast<int32_t*>(smem_raw);                      // [k] the new selection
  int32_t* free_slot = sel + k;                                               // [k] free slots by rank
  uint32_t* kept_bits = reinterpret_cast<uint32_t*>(free_slot + k);           // [ceil(k / 32)] over sel
  uint8_t* cls = reinterpret_cast<uint8_t*>(kept_bits + (k + 31) / 32);       // [k] 0 kept, 1 empty, 2 stale
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int32_t* in = a.indices + static_cast<size_t>(row) * k;
  const int mrow = a.mirror_rows != nullptr ? __ldg(a.mirror_rows + row) : row;
  int32_t* mir = a.mirror + static_cast<size_t>(mrow < 0 ? 0 : mrow) * k;
  int32_t* ds = a.delta_slots + static_cast<size_t>(row) * a.capacity;
  int32_t* dp = a.delta_positions + static_cast<size_t>(row) * a.capacity;
  int32_t* info = a.row_info + static_cast<size_t>(row) * kDeltaInfoFields;
  if (mrow < 0) {  // no mirror row: refused (block-uniform)
    for (int j = tid; j < a.capacity; j += kDeltaThreads) {
      ds[j] = -1;
      dp[j] = -1;
    }
    if (tid == 0) {
      info[kDeltaCount] = 0;
      info[kDeltaEntering] = -1;
      info[kDeltaEntries] = 0;
      info[kDeltaHoles] = 0;
      if (a.totals != nullptr) atomicAdd(a.totals + kDeltaInfoFields, 1ull);
    }
    return;
  }

  if (tid == 0) {
    s_n = 0;
    s_kept = 0;
    s_empty = 0;
  }
  for (int i = tid; i < (k + 31) / 32; i += kDeltaThreads) kept_bits[i] = 0u;
  __syncthreads();
  int cnt = 0;
  for (int i = tid; i < k; i += kDeltaThreads) {
    const int32_t v = __ldg(in + i);
    sel[i] = v;
    cnt += v >= 0 ? 1 : 0;
  }
  atomicAdd(&s_n, cnt);
  __syncthreads();
  const int n = s_n;
  // "ascending positions, then -1": the first n entries are the non-negative ones, strictly increasing.
  int bad = 0;
  for (int i = tid; i < k; i += kDeltaThreads) {
    const int32_t v = sel[i];
    if (i < n ? (v < 0 || (i > 0 && v <= sel[i - 1])) : v != -1) bad = 1;
  }
  // Classify the slots below n; a token held twice, or a value below -1, means the mirror is corrupt.
  int kept = 0;
  int empty = 0;
  for (int s = tid; s < n; s += kDeltaThreads) {
    const int32_t pos = mir[s];
    uint8_t c = 2;
    if (pos < -1) {
      bad = 1;
    } else if (pos < 0) {
      c = 1;
      ++empty;
    } else {
      const int i = lower_bound_i32(sel, n, pos);
      if (i < n && sel[i] == pos) {
        const uint32_t bit = 1u << (i & 31);
        if ((atomicOr(&kept_bits[i >> 5], bit) & bit) != 0u) bad = 1;
        c = 0;
        ++kept;
      }
    }
    cls[s] = c;
  }
  atomicAdd(&s_kept, kept);
  atomicAdd(&s_empty, empty);
  // Refusal (block-uniform; the mirror is still untouched): no entries, E = -1, counted in totals.
  auto refuse = [&] {
    for (int j = tid; j < a.capacity; j += kDeltaThreads) {
      ds[j] = -1;
      dp[j] = -1;
    }
    if (tid == 0) {
      info[kDeltaCount] = n;
      info[kDeltaEntering] = -1;
      info[kDeltaEntries] = 0;
      info[kDeltaHoles] = 0;
      if (a.totals != nullptr) atomicAdd(a.totals + kDeltaInfoFields, 1ull);
    }
  };
  if (__syncthreads_or(bad)) {
    refuse();
    return;
  }
  const int n_empty = s_empty;
  const int E = n - s_kept;
  const int m = min(E, a.capacity);

  // Free slots by rank: the empty ones ascending, then the stale ones ascending.
  {
    int run_e = 0;
    int run_s = 0;
    for (int base = 0; base < n; base += kDeltaThreads) {
      const int s = base + tid;
      const int c = s < n ? cls[s] : 0;
      const int flag = (c == 1 ? 1 : 0) | (c == 2 ? (1 << 16) : 0);
      int rank = 0;
      int total = 0;
      Scan(scan_tmp).ExclusiveSum(flag, rank, total);
      if (c == 1) free_slot[run_e + (rank & 0xFFFF)] = s;
      if (c == 2) free_slot[n_empty + run_s + (rank >> 16)] = s;
      run_e += total & 0xFFFF;
      run_s += total >> 16;
      __syncthreads();  // scan_tmp reuse
    }
  }

  // Overflow: the capacity-th best key among the entering tokens (radix select), and how many equal keys to keep.
  const float* sc = a.scores + static_cast<size_t>(row) * a.score_stride;
  auto key_of = [&](int32_t pos) -> uint32_t { return pos < a.score_stride ? topk_key_dev(__ldg(sc + pos)) : 0u; };
  auto entering = [&](int i) { return i < n && (kept_bits[i >> 5] & (1u << (i & 31))) == 0u; };
  uint32_t thr = 0;
  int kr = 0;
  const bool overflow = E > a.capacity;
  if (overflow) {
    // The scores row must cover every entering position (the reference's check); else refuse the row.
    for (int i = tid; i < n; i += kDeltaThreads) bad |= entering(i) && sel[i] >= a.score_stride ? 1 : 0;
    if (__syncthreads_or(bad)) {
      refuse();
      return;
    }
    uint32_t prefix = 0;
    uint32_t mask = 0;
    kr = a.capacity;
#pragma unroll 1
    for (int shift = 24; shift >= 0; shift -= 8) {
      hist[tid] = 0;  // kDeltaThreads == 256 bins, bin 255 - d counts digit d
      __syncthreads();
      for (int i = tid; i < n; i += kDeltaThreads) {
        if (!entering(i)) continue;
        const uint32_t key = key_of(sel[i]);
        if ((key & mask) == prefix) atomicAdd(&hist[255 - ((key >> shift) & 0xFFu)], 1);
      }
      __syncthreads();
      radix_select_digit(hist, shift, prefix, mask, kr, s_digit, s_above);
    }
    thr = prefix;
  }

  // Sent tokens in ascending position order take the free slots in rank order.
  {
    int run_eq = 0;
    int run_sent = 0;
    for (int base = 0; base < n; base += kDeltaThreads) {
      const int i = base + tid;
      const bool ent = entering(i);
      bool take = ent;
      if (overflow) {
        const uint32_t key = ent ? key_of(sel[i]) : 0u;
        const int eq = ent && key == thr ? 1 : 0;
        int eq_rank = 0;
        int eq_total = 0;
        Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
        __syncthreads();
        take = ent && (key > thr || (eq != 0 && run_eq + eq_rank < kr));
        run_eq += eq_total;
      }
      int rank = 0;
      int total = 0;
      Scan(scan_tmp).ExclusiveSum(take ? 1 : 0, rank, total);
      if (take) {
        const int j = run_sent + rank;
        const int slot = free_slot[j];
        ds[j] = slot;
        dp[j] = sel[i];
        mir[slot] = sel[i];
      }
      run_sent += total;
      __syncthreads();
    }
  }
  for (int j = m + tid; j < a.capacity; j += kDeltaThreads) {
    ds[j] = -1;
    dp[j] = -1;
  }
  for (int s = n + tid; s < k; s += kDeltaThreads) mir[s] = -1;
  if (tid == 0) {
    const int holes = max(0, n_empty - m);
    info[kDeltaCount] = n;
    info[kDeltaEntering] = E;
    info[kDeltaEntries] = m;
    info[kDeltaHoles] = holes;
    if (a.totals != nullptr) {
      atomicAdd(a.totals + kDeltaCount, static_cast<unsigned long long>(n));
      atomicAdd(a.totals + kDeltaEntering, static_cast<unsigned long long>(E));
      atomicAdd(a.totals + kDeltaEntries, static_cast<unsigned long long>(m));
      atomicAdd(a.totals + kDeltaHoles, static_cast<unsigned long long>(holes));
    }
  }
}

// Apply: one thread per 16-byte chunk of an entry's K and V rows.
constexpr int kApplyThreads = 256;

struct ApplyArgs {
  const int32_t* delta_slots;
  const int32_t* delta_positions;
  const void* delta_k;
  const void* delta_v;
  void* held_k;
  void* held_v;
  int32_t* held_positions;
  const int32_t* held_rows;
  int k;
  int capacity;
  int head_dim;
  int row0;  // first row of this launch (grid.y is at most 65535 rows)
};

__global__ void __launch_bounds__(kApplyThreads) apply_delta_kernel(const ApplyArgs a) {
  const int chunks = a.head_dim / 8;
  const int idx = blockIdx.x * kApplyThreads + threadIdx.x;
  if (idx >= a.capacity * chunks) return;
  const int row = a.row0 + static_cast<int>(blockIdx.y);
  const int j = idx / chunks;
  const int col = idx - j * chunks;
  const size_t e = static_cast<size_t>(row) * a.capacity + j;
  const int slot = __ldg(a.delta_slots + e);
  if (slot < 0 || slot >= a.k) return;
  const int hrow = a.held_rows != nullptr ? __ldg(a.held_rows + row) : row;
  if (hrow < 0) return;
  const size_t src = e * a.head_dim + col * 8;
  const size_t dst = (static_cast<size_t>(hrow) * a.k + slot) * a.head_dim + col * 8;
  const uint4 kv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.delta_k) + src));
  const uint4 vv = __ldcs(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.delta_v) + src));
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.held_k) + dst) = kv;
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.held_v) + dst) = vv;
  if (a.held_positions != nullptr && col == 0)
    a.held_positions[static_cast<size_t>(hrow) * a.k + slot] = __ldg(a.delta_positions + e);
}

}  // namespace
}  // namespace detail

cudaError_t selection_delta(const SelectionDeltaParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "selection_delta";
  if (p.indices == nullptr || p.mirror == nullptr || p.delta_slots == nullptr || p.delta_positions == nullptr ||
      p.row_info == nullptr) {
    return invalid_argument(what, "indices, mirror, delta_slots, delta_positions and row_info must be set");
  }
  if (p.rows < 0 || p.k < 1 || p.k > kMaxDeltaBudget || p.capacity < 1 || p.capacity > p.k) {
    return invalid_argument(what, "rows ", p.rows, " / k ", p.k, " / capacity ", p.capacity,
                            " invalid (k in 1..", kMaxDeltaBudget, ", capacity in 1..k)");
  }
  if (p.capacity < p.k && (p.scores == nullptr || p.score_stride < 1)) {
    return invalid_argument(what, "capacity ", p.capacity, " < k needs scores and score_stride >= 1");
  }
  if (p.rows == 0) return cudaSuccess;
  const DeltaArgs a{p.indices, p.scores,   p.mirror,      p.mirror_rows, p.delta_slots, p.delta_positions,
                    p.row_info, p.totals,  p.k,           p.capacity,    p.score_stride};
  delta_kernel<<<p.rows, kDeltaThreads, delta_smem_bytes(p.k), stream>>>(a);
  return cudaGetLastError();
}

cudaError_t apply_selection_delta(const ApplySelectionDeltaParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "apply_selection_delta";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.delta_slots == nullptr || p.delta_k == nullptr || p.delta_v == nullptr || p.held_k == nullptr ||
      p.held_v == nullptr || (p.held_positions != nullptr && p.delta_positions == nullptr)) {
    return invalid_argument(what, "delta_slots, delta_k, delta_v, held_k, held_v (and delta_positions with "
                            "held_positions) must be set");
  }
  if (p.rows < 0 || p.k < 1 || p.capacity < 1) {
    return invalid_argument(what, "rows ", p.rows, " / k ", p.k, " / capacity ", p.capacity, " invalid");
  }
  if (!is_supported_head_dim(p.head_dim)) return invalid_argument(what, "head_dim ", p.head_dim, " not supported");
  if (p.rows == 0) return cudaSuccess;
  ApplyArgs a{p.delta_slots, p.delta_positions, p.delta_k,  p.delta_v,   p.held_k,   p.held_v,
              p.held_positions, p.held_rows,    p.k,        p.capacity,  p.head_dim, 0};
  constexpr int kMaxGridY = 65535;
  for (int r0 = 0; r0 < p.rows; r0 += kMaxGridY) {
    a.row0 = r0;
    const dim3 grid(ceil_div(static_cast<long long>(p.capacity) * (p.head_dim / 8), kApplyThreads),
                    std::min(kMaxGridY, p.rows - r0));
    apply_delta_kernel<<<grid, kApplyThreads, 0, stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace spade::kernels
