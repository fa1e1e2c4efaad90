// Gated DeltaNet decoding benchmark (bench/run_gpu.sh runs it): the kernels of kernels/gdn.cuh at the
// Qwen3-Next / Qwen3.5 GDN shape (16 key heads, 32 value heads, d_k = d_v = 128, bf16 activations and buffer, fp32
// state), per layer.
//
// Tables (the shapes of KVBuffer Fig. 3 / ReplaySSM Fig. 7, KVBuffer Fig. 4 and Fig. 6):
//   recurrent   decode step of the recurrent kernel (load state, update, read out, store), batch 1..256: time, the bytes
//               it must move, GB/s and the ratio to the device-to-device copy bandwidth measured in the same run.
//   chunkwise   chunkwise buffered decode, buffer sizes L = 4..64 (block size min(L, 16)), batch 1..256, latency
//               averaged over a full buffer cycle including the flush steps: sequences start at staggered buffer
//               phases (sequence b at h = b mod L), every step is timed, the per-step medians of each cycle position
//               are averaged over the L positions. Speedup = recurrent time / cycle-average time.
//   verify      T = 1..8 drafts: parallel verification (one T x T solve, flush one window early, ring
//               L = max(16, 4T), (T + 1) / 2 drafts accepted per round) + its device commit, vs the recurrent
//               verification with T per-draft state snapshots + its swap commit ([RS] Algorithm 7), batch 1..256.
//   kv_only     KV-only parallel form (no state) at short contexts c (h = c - 1 buffered entries) vs the chunkwise
//               cycle average (L = 16) and the recurrent step, batch 64.
//   memory      bytes per request and GDN layer for speculative decoding: (T + 1) snapshot states vs one state + a
//               ring of L tokens (kernels/gdn_ref.h gdn_spec_bytes_*).
// Every timed launch is preceded by an L2 flush (a 256 MiB memset outside the timed region): between two steps of
// one layer a real model runs all its other layers, so the state never starts in L2. Each launch has its own pair of
// CUDA events; medians over >= 50 samples after warm-up. Inputs are random (never zero).
// Usage: bench_gdn --out results.json [--quick] [--only TABLES] [--batches LIST]   (TABLES: comma-separated of
//        recurrent, chunkwise, tile_groups, verify, kv_only, memory; default all. LIST: batch sizes, e.g. 64,256)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_util.cuh"
#include "bench/run_stamp.h"
#include "kernels/gdn.cuh"
#include "kernels/gdn_ref.h"

namespace {

using nlohmann::json;
using namespace spade::kernels;
using namespace spade::bench;
using spade::DType;

constexpr int kHk = 16, kHv = 32, kD = 128;
constexpr size_t kStateBytes = size_t{kHv} * kD * kD * 4;                // 2 MiB
constexpr size_t kEntryBytes = size_t{kHk} * kD * 2 + size_t{kHv} * kD * 2 + size_t{kHv} * 4;  // 12,416 B
constexpr size_t kTokenIoBytes = size_t{kHk} * kD * 2 * 2 + size_t{kHv} * kD * 2 * 2 + size_t{kHv} * 8;  // q,k,v,out,g,beta

struct Bench {
  bool quick = false;
  std::string only;            // comma-separated tables to run (--only), empty = all
  std::vector<int> batch_list; // --batches: overrides the batch list of every table
  int verify_ring = 0;          // --verify-ring: ring size L of the parallel verification (0: max(16, 4T))
  bool wants(const char* table) const {
    return only.empty() || ("," + only + ",").find("," + std::string(table) + ",") != std::string::npos;
  }
  std::string out;
  cudaDeviceProp prop{};
  double copy_gbps = 0;
  void* l2_scratch = nullptr;
  size_t l2_scratch_bytes = size_t{256} << 20;
  int flush_counter = 0;
  json rows = json::array();

  void flush_l2() { CK(cudaMemsetAsync(l2_scratch, (flush_counter++) & 0xFF, l2_scratch_bytes)); }

  // Times `fn` n times, each after `prep` (untimed) and an L2 flush, one event pair per launch; returns per-sample
  // microseconds.
  std::vector<double> sample(int n, int warmup, const std::function<void(int)>& fn,
                             const std::function<void()>& prep = nullptr) {
    for (int i = 0; i < warmup; ++i) {
      if (prep) prep();
      fn(i);
    }
    CK(cudaDeviceSynchronize());
    std::vector<cudaEvent_t> ev(2 * n);
    for (auto& e : ev) CK(cudaEventCreate(&e));
    for (int i = 0; i < n; ++i) {
      if (prep) prep();
      flush_l2();
      CK(cudaEventRecord(ev[2 * i]));
      fn(warmup + i);
      CK(cudaEventRecord(ev[2 * i + 1]));
    }
    CK(cudaDeviceSynchronize());
    std::vector<double> us(n);
    for (int i = 0; i < n; ++i) {
      float ms = 0.f;
      CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      us[i] = 1000.0 * ms;
    }
    for (auto& e : ev) CK(cudaEventDestroy(e));
    return us;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double measure_copy(Bench& b) {
  const size_t bytes = size_t{1} << 30;
  char* x = dalloc<char>(bytes);
  char* y = dalloc<char>(bytes);
  fill16(x, bytes / 2, 1);
  std::vector<double> us;
  for (int i = 0; i < 3; ++i) CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice));
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 50; ++i) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(1000.0 * ms);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaFree(x));
  CK(cudaFree(y));
  const double t = median(us);
  const double gbps = 2.0 * bytes / (t * 1e3);
  b.rows.push_back({{"table", "copy"}, {"name", "copy_d2d_1GiB"}, {"median_us", t}, {"gb_per_s", gbps},
                    {"note", "cudaMemcpyAsync device-to-device, bytes = read + write, median of 50"}});
  std::printf("copy bandwidth (1 GiB D2D, read + write): %.1f GB/s\n", gbps);
  return gbps;
}

/// Device buffers of one GDN layer for `batch` sequences: tokens (up to max_tokens each), states, buffer pool, rings.
struct Layer {
  int batch = 0, max_tokens = 1, cap = 16, block = 16, blocks_per_seq = 1, num_state_slots = 0;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *bk = nullptr, *bu = nullptr;
  float *g = nullptr, *beta = nullptr, *states = nullptr, *bg = nullptr;
  int32_t *cu = nullptr, *slots = nullptr, *ring_start = nullptr, *ring_len = nullptr, *ring_cap = nullptr,
          *tables = nullptr, *state_slots = nullptr, *draft_slots = nullptr,
          *accepted = nullptr, *spec = nullptr;
  uint8_t* valid = nullptr;
  std::vector<int32_t> h_ring_len;

  // phase(b): initial buffered entries of sequence b; valid_state: chunkwise (true) or KV-only (false).
  void init(int batch_, int tokens_per_seq, int cap_, int block_, int extra_state_slots, bool valid_state,
            const std::function<int(int)>& phase) {
    batch = batch_;
    max_tokens = tokens_per_seq;
    cap = cap_;
    block = block_;
    blocks_per_seq = (cap + block - 1) / block;
    num_state_slots = batch * (1 + extra_state_slots);
    const size_t toks = size_t{static_cast<size_t>(batch)} * tokens_per_seq;
    q = dalloc<char>(toks * kHk * kD * 2);
    k = dalloc<char>(toks * kHk * kD * 2);
    v = dalloc<char>(toks * kHv * kD * 2);
    out = dalloc<char>(toks * kHv * kD * 2);
    g = dalloc<float>(toks * kHv);
    beta = dalloc<float>(toks * kHv);
    fill16(q, toks * kHk * kD, 11);
    fill16(k, toks * kHk * kD, 12);
    fill16(v, toks * kHv * kD, 13);
    fill32(g, toks * kHv, 14, -0.06f, -0.002f);
    fill32(beta, toks * kHv, 15, 0.2f, 0.8f);
    states = dalloc<float>(size_t{static_cast<size_t>(num_state_slots)} * kHv * kD * kD);
    fill32(states, size_t{static_cast<size_t>(num_state_slots)} * kHv * kD * kD, 16, -0.05f, 0.05f);
    const size_t pool_tokens = size_t{static_cast<size_t>(batch)} * cap;
    bk = dalloc<char>(pool_tokens * kHk * kD * 2);
    bu = dalloc<char>(pool_tokens * kHv * kD * 2);
    bg = dalloc<float>(pool_tokens * kHv);
    fill16(bk, pool_tokens * kHk * kD, 17, 0.088f);  // ~unit-norm keys
    fill16(bu, pool_tokens * kHv * kD, 18);
    fill32(bg, pool_tokens * kHv, 19, -0.06f, -0.002f);
    std::vector<int32_t> cu_h(batch + 1), sl(batch), rs(batch, 0), rl(batch), rc(batch, cap), tb(batch * blocks_per_seq),
        ss(batch);
    std::vector<uint8_t> va(batch, valid_state ? 1 : 0);
    for (int b = 0; b < batch; ++b) {
      cu_h[b + 1] = cu_h[b] + tokens_per_seq;
      sl[b] = b;
      rl[b] = phase(b);
      ss[b] = b;
      for (int i = 0; i < blocks_per_seq; ++i) tb[b * blocks_per_seq + i] = b * blocks_per_seq + i;
    }
    h_ring_len = rl;
    cu = upload(cu_h);
    slots = upload(sl);
    ring_start = upload(rs);
    ring_len = upload(rl);
    ring_cap = upload(rc);
    tables = upload(tb);
    state_slots = upload(ss);
    valid = upload(va);
    // Recurrent verification baseline: state slot b, draft snapshots in slots batch + b * T + s.
    std::vector<int32_t> ds(toks), sp(size_t{static_cast<size_t>(batch)} * (tokens_per_seq + 1)),
        acc(batch, (tokens_per_seq + 1) / 2);
    for (int b = 0; b < batch; ++b) {
      sp[b * (tokens_per_seq + 1)] = b;
      for (int s = 0; s < tokens_per_seq; ++s) {
        const int slot = extra_state_slots >= tokens_per_seq ? batch + b * tokens_per_seq + s : -1;
        ds[b * tokens_per_seq + s] = slot;
        sp[b * (tokens_per_seq + 1) + 1 + s] = slot;
      }
    }
    draft_slots = upload(ds);
    spec = upload(sp);
    accepted = upload(acc);
    CK(cudaDeviceSynchronize());
  }
  void reset_rings() {
    CK(cudaMemcpy(ring_len, h_ring_len.data(), h_ring_len.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CK(cudaMemset(ring_start, 0, batch * sizeof(int32_t)));
  }
  void release() {
    for (void* p : std::initializer_list<void*>{q, k, v, out, bk, bu, g, beta, states, bg, cu, slots, ring_start,
                                                ring_len, ring_cap, tables, state_slots, draft_slots,
                                                accepted, spec, valid})
      CK(cudaFree(p));
  }
  GdnStepTokens tokens(int max_t) const {
    GdnStepTokens t;
    t.q = q;
    t.k = k;
    t.v = v;
    t.g = g;
    t.beta = beta;
    t.cu_tokens = cu;
    t.batch = batch;
    t.max_tokens = max_t;
    return t;
  }
  // The fields both GDN step forms share: dtype, dims, the step's tokens, the output and the state pool.
  template <typename Params>
  Params step_params() const {
    Params p;
    p.dtype = DType::BF16;
    p.dims = {kHk, kHv, kD, kD};
    p.tok = tokens(max_tokens);
    p.out = out;
    p.state_pool = states;
    p.num_state_slots = num_state_slots;
    return p;
  }
  GdnRecurrentGpuParams recurrent(bool drafts) const {
    auto p = step_params<GdnRecurrentGpuParams>();
    p.state_slots = slots;  // sequence b uses state slot b
    p.draft_state_slots = drafts ? draft_slots : nullptr;
    return p;
  }
  GdnBufferedGpuParams buffered() const {
    auto p = step_params<GdnBufferedGpuParams>();
    p.buf.k = bk;
    p.buf.u = bu;
    p.buf.g = bg;
    p.buf.dtype = DType::BF16;
    p.buf.num_blocks = batch * blocks_per_seq;
    p.buf.block_size = block;
    p.seqs.ring_start = ring_start;
    p.seqs.ring_len = ring_len;
    p.seqs.ring_capacity = ring_cap;
    p.seqs.block_tables = tables;
    p.seqs.state_slots = state_slots;
    p.seqs.state_valid = valid;
    p.seqs.max_seqs = batch;
    p.seqs.max_blocks_per_seq = blocks_per_seq;
    p.seq_slots = slots;
    p.max_ring_capacity = cap;
    return p;
  }
};

json row(Bench& b, const char* table, const std::string& name, double us, double bytes) {
  json r;
  r["table"] = table;
  r["name"] = name;
  r["median_us"] = us;
  r["bytes"] = bytes;
  r["gb_per_s"] = bytes / (us * 1e3);
  r["ratio_to_copy"] = bytes / (us * 1e3) / b.copy_gbps;
  r["floor_us_at_copy_bw"] = bytes / (b.copy_gbps * 1e3);
  return r;
}

double bench_recurrent(Bench& b, int batch) {
  Layer L;
  L.init(batch, 1, 16, 16, 0, true, [](int) { return 0; });
  const GdnRecurrentGpuParams p = L.recurrent(false);
  const double t = median(b.sample(b.quick ? 50 : 100, 5, [&](int) { CK(gdn_recurrent(p, nullptr)); }));
  const double bytes = batch * (2.0 * kStateBytes + kTokenIoBytes);
  json r = row(b, "recurrent", "recurrent_b" + std::to_string(batch), t, bytes);
  r["batch"] = batch;
  b.rows.push_back(r);
  std::printf("recurrent  B=%-4d %9.2f us  %7.1f GB/s  %5.1f%% of copy\n", batch, t, r["gb_per_s"].get<double>(),
              100.0 * r["ratio_to_copy"].get<double>());
  L.release();
  return t;
}

// Chunkwise decode averaged over a buffer cycle. Returns the cycle-average time.
double bench_chunkwise(Bench& b, int batch, int cap, double recurrent_us, int tile_groups = 0) {
  const int block = std::min(cap, 16);
  Layer L;
  L.init(batch, 1, cap, block, 0, true, [cap](int s) { return s % cap; });
  GdnBufferedGpuParams p = L.buffered();
  p.next_tokens = 1;
  p.tile_groups = tile_groups;
  const int cycles = b.quick ? 20 : 50;
  const int n = cycles * cap;
  // Warm-up of exactly one cycle keeps the phases aligned with the sample index.
  const std::vector<double> us = b.sample(n, cap, [&](int) { CK(gdn_chunkwise_decode(p, nullptr)); });
  double avg = 0.0;
  for (int pos = 0; pos < cap; ++pos) {
    std::vector<double> at;
    for (int i = pos; i < n; i += cap) at.push_back(us[i]);
    avg += median(at);
  }
  avg /= cap;
  // Bytes per step (average): state read per sequence, one state write per sequence per cycle, buffer reads of
  // (L - 1) / 2 entries on average plus the new entry written, token I/O.
  const double bytes = batch * (kStateBytes + kStateBytes / cap + (cap - 1) / 2.0 * kEntryBytes + kEntryBytes +
                                kTokenIoBytes);
  json r = row(b, tile_groups == 0 ? "chunkwise" : "chunkwise_tile_groups",
               "chunkwise_b" + std::to_string(batch) + "_L" + std::to_string(cap) +
                   (tile_groups == 0 ? "" : "_tg" + std::to_string(tile_groups)),
               avg, bytes);
  r["batch"] = batch;
  r["tile_groups"] = tile_groups;  // 0 = automatic
  r["buffer_size"] = cap;
  r["block_size"] = block;
  r["median_step_us"] = median(us);
  r["recurrent_us"] = recurrent_us;
  r["speedup_vs_recurrent"] = recurrent_us / avg;
  r["timing"] = "mean over the L cycle positions of the per-position median (>= 20 cycles, staggered phases)";
  b.rows.push_back(r);
  std::printf("chunkwise  B=%-4d L=%-3d tg=%d %9.2f us  (median step %8.2f)  %5.1f%% of copy  speedup %.2fx\n", batch,
              cap, r["tile_groups"].get<int>(), avg, median(us), 100.0 * r["ratio_to_copy"].get<double>(),
              recurrent_us / avg);
  L.release();
  return avg;
}

void bench_verify(Bench& b, int batch, int T, int tile_groups = 0) {
  // L = 4T (>= 16): one flush every (2T) / a + 1 rounds instead of every round at L = 2T. Since the history dot
  // products went from one warp per (token, entry) pair to one warp per entry (2026-11-24), L = 4T is the faster:
  // T = 8, batch 256: 529 us at L = 32 vs 633 us at L = 16 (H100; before: 944 vs 808 us).
  const int cap = b.verify_ring > 0 ? std::max(b.verify_ring, 2 * T) : std::max(16, 4 * T);
  // Parallel verification: committed entries at staggered phases below the early-flush threshold region.
  Layer P;
  P.init(batch, T, cap, 16, 0, true, [cap, T](int s) { return s % (cap - T + 1); });
  GdnBufferedGpuParams pp = P.buffered();
  pp.tok.max_tokens = T;
  pp.tile_groups = tile_groups;
  const int n = b.quick ? 60 : 120;
  const std::vector<double> par = b.sample(n, 8, [&](int) {
    CK(gdn_parallel_verify(pp, nullptr));
    CK(gdn_verify_commit(pp.seqs, P.slots, P.accepted, batch, nullptr));
  });
  P.release();
  // Recurrent verification with per-draft snapshots.
  Layer R;
  R.init(batch, T, 16, 16, T, true, [](int) { return 0; });
  const GdnRecurrentGpuParams rp = R.recurrent(true);
  const std::vector<double> rec = b.sample(n, 8, [&](int) {
    CK(gdn_recurrent(rp, nullptr));
    CK(gdn_recurrent_verify_commit(R.spec, R.accepted, batch, T, nullptr));
  });
  R.release();
  const double tp = median(par), tr = median(rec);
  // One flush (state write) every (L - 2T) / a + 1 rounds with a = (T + 1) / 2 accepted per round.
  const double rounds_per_flush = (cap - 2 * T) / ((T + 1) / 2) + 1;
  const double bytes_par = batch * (kStateBytes + kStateBytes / rounds_per_flush + (cap - T) / 2.0 * kEntryBytes +
                                    T * kEntryBytes + T * kTokenIoBytes);
  const double bytes_rec = batch * ((1.0 + T) * kStateBytes + T * kTokenIoBytes);
  json r = row(b, tile_groups == 0 ? "verify" : "verify_tile_groups",
               "verify_b" + std::to_string(batch) + "_T" + std::to_string(T) +
                   (tile_groups == 0 ? "" : "_tg" + std::to_string(tile_groups)),
               tp, bytes_par);
  r["tile_groups"] = tile_groups;  // 0 = automatic
  r["batch"] = batch;
  r["drafts"] = T;
  r["ring"] = cap;
  r["recurrent_snapshots_us"] = tr;
  r["recurrent_snapshots_bytes"] = bytes_rec;
  r["recurrent_ratio_to_copy"] = bytes_rec / (tr * 1e3) / b.copy_gbps;
  r["speedup_vs_recurrent"] = tr / tp;
  b.rows.push_back(r);
  std::printf("verify     B=%-4d T=%d tg=%d parallel %9.2f us  recurrent+snapshots %9.2f us  speedup %.2fx\n", batch, T,
              r["tile_groups"].get<int>(), tp,
              tr, tr / tp);
}

void bench_kv_only(Bench& b, int batch, int ctx, double chunk_us, double rec_us) {
  Layer L;
  L.init(batch, 1, 128, 16, 0, false, [ctx](int) { return ctx - 1; });
  GdnBufferedGpuParams p = L.buffered();
  // Every sample starts at context ctx: the rings are reset before the L2 flush, outside the timed region.
  const std::vector<double> us = b.sample(
      b.quick ? 50 : 100, 4, [&](int) { CK(gdn_chunkwise_decode(p, nullptr)); }, [&] { L.reset_rings(); });
  L.release();
  const double t = median(us);
  const double bytes = batch * ((ctx - 1) * kEntryBytes + kEntryBytes + kTokenIoBytes);
  json r = row(b, "kv_only", "kv_only_b" + std::to_string(batch) + "_c" + std::to_string(ctx), t, bytes);
  r["batch"] = batch;
  r["context"] = ctx;
  r["chunkwise_L16_cycle_us"] = chunk_us;
  r["recurrent_us"] = rec_us;
  b.rows.push_back(r);
  std::printf("kv_only    B=%-4d c=%-4d %9.2f us  chunkwise(L16) %9.2f us  recurrent %9.2f us\n", batch, ctx, t,
              chunk_us, rec_us);
}

void memory_table(Bench& b) {
  const GdnDims d{kHk, kHv, kD, kD};
  std::printf("memory per request and GDN layer (bf16 buffer, block 16):\n");
  for (int T : {1, 2, 4, 8}) {
    const double snap = static_cast<double>(gdn_spec_bytes_snapshots(d, T));
    for (int Lb : {16, 32}) {
      const int Lr = std::max(Lb, 2 * T);
      const double ours = static_cast<double>(gdn_spec_bytes_buffered(d, T, Lr, 16, DType::BF16));
      b.rows.push_back({{"table", "memory"}, {"drafts", T}, {"buffer_size", Lr}, {"snapshot_bytes", snap},
                        {"buffered_bytes", ours}, {"ratio", snap / ours}});
      std::printf("  T=%d L=%-3d snapshots %7.2f MiB  ours %6.2f MiB  %.2fx\n", T, Lr, snap / 1048576.0,
                  ours / 1048576.0, snap / ours);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      b.out = argv[++i];
    } else if (a == "--quick") {
      b.quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      b.only = argv[++i];
    } else if (a == "--verify-ring" && i + 1 < argc) {
      b.verify_ring = std::atoi(argv[++i]);
    } else if (a == "--batches" && i + 1 < argc) {
      for (const char* c = argv[++i]; *c != '\0';) {
        char* end = nullptr;
        const long v = std::strtol(c, &end, 10);
        if (end == c || v < 1 || v > 65535) {
          std::fprintf(stderr, "--batches: expected a comma-separated list of batch sizes, got %s\n", argv[i]);
          return 2;
        }
        b.batch_list.push_back(static_cast<int>(v));
        c = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--out file.json] [--quick] [--only recurrent,chunkwise,tile_groups,verify,kv_only,memory]"
                   " [--batches 64,256] [--verify-ring L]\n",
                   argv[0]);
      return 2;
    }
  }
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&b.prop, dev));
  std::printf("device: %s, %d SMs, L2 %d MB\n", b.prop.name, b.prop.multiProcessorCount, b.prop.l2CacheSize >> 20);
  CK(cudaMalloc(&b.l2_scratch, b.l2_scratch_bytes));
  b.copy_gbps = measure_copy(b);

  const std::vector<int> batches = !b.batch_list.empty() ? b.batch_list
                                   : b.quick             ? std::vector<int>{1, 64, 256}
                                                         : std::vector<int>{1, 4, 16, 64, 128, 256};
  const std::vector<int> caps = b.quick ? std::vector<int>{8, 16, 32} : std::vector<int>{4, 8, 16, 32, 64};
  // The recurrent times are the denominators of the chunkwise and KV-only tables: measured whenever those run.
  const bool need_rec = b.wants("recurrent") || b.wants("chunkwise") || b.wants("tile_groups") || b.wants("kv_only");
  std::vector<double> rec(batches.size());
  double chunk16_b64 = 0, rec_b64 = 0;
  for (size_t i = 0; i < batches.size() && need_rec; ++i) {
    rec[i] = bench_recurrent(b, batches[i]);
    if (batches[i] == 64) rec_b64 = rec[i];
  }
  if (b.wants("chunkwise") || b.wants("kv_only")) {
    std::printf("\nchunkwise / recurrent speedup (cycle average, incl. flush):\n");
    std::vector<std::vector<double>> sp(batches.size());
    for (size_t i = 0; i < batches.size(); ++i) {
      for (int L : caps) {
        if (!b.wants("chunkwise") && !(batches[i] == 64 && L == 16)) continue;
        const double t = bench_chunkwise(b, batches[i], L, rec[i]);
        sp[i].push_back(rec[i] / t);
        if (batches[i] == 64 && L == 16) chunk16_b64 = t;
      }
    }
    if (b.wants("chunkwise")) {
      std::printf("\n%8s", "B \\ L");
      for (int L : caps) std::printf("%8d", L);
      std::printf("\n");
      for (size_t i = 0; i < batches.size(); ++i) {
        std::printf("%8d", batches[i]);
        for (double s : sp[i]) std::printf("%7.2fx", s);
        std::printf("\n");
      }
    }
  }
  if (b.wants("tile_groups")) {
    std::printf("\ntile groups per CTA (tg=0: automatic = 2 at batch < 128, 4 (one CTA per head) from 128):\n");
    for (size_t i = 0; i < batches.size(); ++i) {
      if (batches[i] != 64 && batches[i] != 256) continue;
      for (int L : {8, 16})
        for (int tg : {1, 2, 4}) bench_chunkwise(b, batches[i], L, rec[i], tg);
    }
  }
  if (b.wants("verify")) {
    std::printf("\n");
    const std::vector<int> vb = !b.batch_list.empty() ? b.batch_list
                                : b.quick             ? std::vector<int>{1, 64}
                                                      : std::vector<int>{1, 16, 64, 256};
    for (int B : vb)
      for (int T : {1, 2, 4, 8}) bench_verify(b, B, T);
    if (std::find(vb.begin(), vb.end(), 256) != vb.end())
      for (int tg : {1, 4}) bench_verify(b, 256, 8, tg);
  }
  if (b.wants("kv_only") && rec_b64 > 0 && chunk16_b64 > 0) {
    std::printf("\n");
    for (int c : {8, 16, 32, 64, 96, 120}) bench_kv_only(b, 64, c, chunk16_b64, rec_b64);
  }
  if (b.wants("memory")) {
    std::printf("\n");
    memory_table(b);
  }

  json doc;
  doc["benchmark"] = "bench_gdn";
  doc["device"] = b.prop.name;
  doc["sm_count"] = b.prop.multiProcessorCount;
  doc["l2_bytes"] = b.prop.l2CacheSize;
  spade::bench::stamp_run(doc);
  doc["shape"] = {{"num_k_heads", kHk}, {"num_v_heads", kHv}, {"head_dim", kD}, {"dtype", "bf16"}, {"state", "fp32"}};
  doc["copy_gbps"] = b.copy_gbps;
  doc["timing"] = "one CUDA event pair per launch, L2 flushed (256 MiB memset) before each; medians";
  doc["results"] = b.rows;
  if (!b.out.empty()) {
    std::ofstream f(b.out);
    f << doc.dump(2) << "\n";
    std::printf("wrote %s\n", b.out.c_str());
  }
  CK(cudaFree(b.l2_scratch));
  return 0;
}
