// The GPU cache rank's per-step server (see gpu_server.h).
#include "cache_rank/gpu_server.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "common/error.h"
#include "cache_rank/gpu_slot_book.h"
#include "kernels/device.h"
#include "kernels/layer_ops.cuh"
#include "kernels/selection.cuh"

namespace spade::cache {

using pair::DeltaLayout;
using pair::GpuPackSizes;
using pair::GpuPlanRow;
using pair::GpuStepPlan;
using pair::decode_gpu_hello;
using pair::decode_gpu_plan;
using pair::gpu_pack_sizes;
using pair::gpu_plan_max_rows;
using pair::kGpuHelloBytes;
using pair::kGpuPlanBytes;
using pair::kRowFirstSelect;
using pair::kRowFresh;

namespace {

using Clock = std::chrono::steady_clock;

using Event = CudaEvent;

// The two selection groups of a step: steady rows (delta capacity C) and first rows (the full budget).
enum Group { kSteady = 0, kFirst = 1 };

}  // namespace

struct GpuCacheServer::State {
  ModelConfig cfg;
  GpuCacheOptions o;
  transport::GpuLink& link;
  std::string peer;
  int L = 0, Hq = 0, Hkv = 0, D = 0, P = 0, packs = 0, cap_w = 0, k = 0, C = 0, stride = 0;  // C: the delta capacity
  size_t row_elems = 0;  // (Hq + 2 Hkv) * D per token and layer
  cudaStream_t up = nullptr, work = nullptr, down = nullptr;
  // Pipelined selection (GpuCacheOptions::pipeline): scoring on `score` (low priority), top-k / delta / gather on
  // `sel` (high priority); both are `work` otherwise.
  cudaStream_t score = nullptr, sel = nullptr;

  GpuKvPool pool;
  // The compact scoring copy of the keys (SelectionConfig::score_keys int8; empty for bf16), layer-major like the
  // pool: [L][num_pages][page_size][Hkv][D] int8 and [L][num_pages][page_size][Hkv] fp32 scales.
  DeviceBuffer kq, kscale;
  bool int8_keys = false;
  DeviceBuffer windows;  // [slots][L][Hq][cap_w][D] bf16
  // Prompt anchors (SelectionConfig::anchor_queries = A > 0): the last A queries of each (slot, layer) until the
  // slot's first selection, which picks its anchors from them (kernels::select_anchors), and the anchors every
  // selection of the slot then holds (kernels::apply_anchor_spans).
  int A = 0;
  DeviceBuffer awin;      // [slots][L][Hq][A][D] bf16
  DeviceBuffer awin_len;  // [slots * L] int32
  DeviceBuffer anchors;   // [slots][L][Hkv][kMaxAnchors] int32, -1 padding
  DeviceBuffer anchor_ws;  // select_anchors' scratch for one layer's launch (batch = slots), reused layer by layer
  DeviceBuffer mirror;   // [slots][L][Hkv][k] int32
  DeviceBuffer window_len;  // [slots * L] int32 (the kernel's counts; the host keeps its own copy)
  DeviceBuffer plan_dev;
  uint8_t* plan_host = nullptr;  // pinned
  DeviceBuffer rows;     // [packs][P * max_step_tokens * row_elems] bf16: pack p's message, [layers][T][row]
  DeviceBuffer q_out;    // [max_step_tokens][Hq][D] bf16: one layer's queries
  // Step arrays (int32), one upload per step: see fill_meta().
  DeviceBuffer meta;
  int32_t* meta_host = nullptr;  // pinned
  size_t meta_words = 0;
  Event meta_copied;
  bool meta_pending = false;
  // Selection scratch, reused selection after selection (one per non-empty group and pack). win_scratch and
  // indices are written and read on one stream each; q_hat (predict -> score) and scores (score -> top-k, delta)
  // cross streams and alternate between two sets by the selection's number, with events: predicted[b] (q_hat[b]
  // written), scored[b] (q_hat[b] read, scores[b] written), selected[b] (scores[b] read).
  DeviceBuffer win_scratch, indices;
  DeviceBuffer q_hat[2], scores[2];
  Event predicted[2], scored[2], selected[2];
  uint64_t selection_seq = 0;
  Event sel_step_end;  // the sel stream's last operation of the previous step (the step arrays are rewritten after it)
  bool sel_step_pending = false;
  DeviceBuffer msg[2][2];  // [group][pack parity]: outgoing messages
  std::vector<std::unique_ptr<Event>> rows_ready, appended, sel_done[2], sent[2];  // per pack
  Event plan_ready;
  bool plan_posted = false;
  bool closed = false;  // the close plan came

  // Sampling (gpu_server.h: Sampling); buffers allocated only when it is on.
  int sample_every = 0;
  bool sampling = false;  // this step samples its steady rows
  DeviceBuffer q_true;    // [L][max_slots][Hq * D] fp32: the steady rows' true queries of this step
  DeviceBuffer o_idx[2];  // [P * max_slots * Hkv][k] int32: the true query's top-k (per scores buffer, as q_hat)
  DeviceBuffer o_mirror, o_slots, o_pos;  // [P * max_slots * Hkv][k] int32: held tables' copy, delta outputs
  DeviceBuffer o_info;                           // [P * max_slots * Hkv][kDeltaInfoFields] int32
  int32_t* sample_host = nullptr;  // pinned [2][packs][2 (oracle, churn)][P * max_slots * Hkv * kDeltaInfoFields]
  struct PackSample {
    bool pending = false;
    int layers = 0, first_layer = 0, S = 0;
    std::unique_ptr<Event> done;
  };
  std::vector<PackSample> pack_samples;  // [2 (sampled-step parity)][packs]
  uint64_t sampled_steps = 0;
  std::vector<double> overlap_ratios;  // per sampled (sequence, layer), until taken
  size_t sample_words() const { return static_cast<size_t>(P) * o.max_slots * Hkv * kernels::kDeltaInfoFields; }
  int32_t* sample_buf(int parity, int p, int kind) const {
    return sample_host + ((static_cast<size_t>(parity) * packs + p) * 2 + kind) * sample_words();
  }

  // The host bookkeeping of the plans: slots' pages in the pool, window counts, retained prefixes, pending anchors.
  GpuSlotBook book;

  // Offsets (words) of this step's arrays in meta.
  struct Meta {
    size_t tok_pos = 0, tok_row = 0, bt = 0, cu = 0, win_idx = 0, reset = 0, awin_idx = 0;
    size_t g_bt[2] = {0, 0}, g_lens[2] = {0, 0}, g_wlen[2] = {0, 0}, g_mrows[2] = {0, 0};
    size_t g_aw[2] = {0, 0}, g_anq[2] = {0, 0}, g_actx[2] = {0, 0};  // anchors: windows [L][S], queries, context [S]
    size_t g_qrow[2] = {0, 0}, g_olens[2] = {0, 0};  // sampling: token row [S], the oracle's candidates [P][S]
  } m;
  std::vector<int> group_rows[2];  // plan row indices of each group

  State(const ModelConfig& c, const GpuCacheOptions& opts, transport::GpuLink& l, std::string pr)
      : cfg(c), o(opts), link(l), peer(std::move(pr)), L(c.num_layers), Hq(c.num_q_heads), Hkv(c.num_kv_heads),
        D(c.head_dim), P(opts.sparse.layers_per_pack),
        packs((c.num_layers + opts.sparse.layers_per_pack - 1) / opts.sparse.layers_per_pack),
        cap_w(opts.sparse.selection.query_window + 1), k(opts.sparse.selection.token_budget),
        C(opts.sparse.effective_delta_capacity()),
        stride(opts.max_pages_per_seq * opts.page_size),
        row_elems(static_cast<size_t>(c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim),
        pool(c.num_layers, opts.num_pages, opts.page_size, c.num_kv_heads, c.head_dim),
        A(opts.sparse.selection.anchor_queries),
        book(opts.num_pages, opts.page_size, opts.max_slots, cap_w, A, peer) {}
  ~State() {
    for (cudaStream_t s : {score, sel})
      if (s != nullptr && s != work) cudaStreamDestroy(s);
    for (cudaStream_t s : {up, work, down})
      if (s != nullptr) cudaStreamDestroy(s);
    if (plan_host != nullptr) cudaFreeHost(plan_host);
    if (meta_host != nullptr) cudaFreeHost(meta_host);
    if (sample_host != nullptr) cudaFreeHost(sample_host);
  }

  int pack_layers(int p) const { return std::min(P, L - p * P); }
  size_t layer_rows() const { return static_cast<size_t>(o.num_pages) * o.page_size * Hkv; }  // (token, KV head)
  int8_t* layer_kq(int l) const { return kq.as<int8_t>() + static_cast<size_t>(l) * layer_rows() * D; }
  float* layer_kscale(int l) const { return kscale.as<float>() + static_cast<size_t>(l) * layer_rows(); }
  uint16_t* pack_rows(int p) const {
    return rows.as<uint16_t>() + static_cast<size_t>(p) * P * o.max_step_tokens * row_elems;
  }
  size_t win_elems() const { return static_cast<size_t>(Hq) * cap_w * D; }
  bool anchors_on() const { return A > 0; }

  // The pool's paged geometry as a launch over `batch` block-table rows (each max_pages_per_seq wide) sees it.
  kernels::PagedAttentionShape pool_shape(int batch) const {
    kernels::PagedAttentionShape s;
    s.batch = batch;
    s.num_q_heads = Hq;
    s.num_kv_heads = Hkv;
    s.head_dim = D;
    s.page_size = o.page_size;
    s.max_pages_per_seq = o.max_pages_per_seq;
    return s;
  }

  void post_plan_recv() {
    link.recv(plan_dev.get(), kGpuPlanBytes, up, "the next step's plan", transport::GpuLink::kNoTimeout);
    cuda_check(cudaMemcpyAsync(plan_host, plan_dev.get(), kGpuPlanBytes, cudaMemcpyDeviceToHost, up), "plan copy");
    cuda_check(cudaEventRecord(plan_ready.e, up), "plan event");
    plan_posted = true;
  }

  // Forgets a slot's held-table mirror (on the sel stream, which uses it): its next selection is a first one.
  void reset_mirror(int slot) {
    const size_t mirror_slot = static_cast<size_t>(L) * Hkv * k;
    cuda_check(cudaMemsetAsync(mirror.as<int32_t>() + static_cast<size_t>(slot) * mirror_slot, 0xFF, mirror_slot * 4,
                               sel),
               "mirror reset");
  }

  // The device side of this step's forks, on the work stream after the step's upload (fill_meta), before any push:
  // each child's query windows, anchor windows, their counts and its anchors become its parent's.
  void copy_fork_windows(const GpuStepPlan& plan) {
    auto copy = [&](const DeviceBuffer& buf, size_t slot_bytes, const pair::GpuPlanFork& f, const char* what) {
      cuda_check(cudaMemcpyAsync(buf.as<char>() + static_cast<size_t>(f.child) * slot_bytes,
                                 buf.as<char>() + static_cast<size_t>(f.parent) * slot_bytes, slot_bytes,
                                 cudaMemcpyDeviceToDevice, work),
                 what);
    };
    for (const pair::GpuPlanFork& f : plan.forks) {
      if ((f.flags & pair::kForkFromRetained) != 0) {  // empty windows (the sequence computes their queries itself)
        cuda_check(cudaMemsetAsync(window_len.as<int32_t>() + static_cast<size_t>(f.child) * L, 0,
                                   static_cast<size_t>(L) * 4, work),
                   "GPU cache rank: fork's window lengths");
        if (anchors_on())
          cuda_check(cudaMemsetAsync(awin_len.as<int32_t>() + static_cast<size_t>(f.child) * L, 0,
                                     static_cast<size_t>(L) * 4, work),
                     "GPU cache rank: fork's anchor window lengths");
        continue;
      }
      copy(windows, static_cast<size_t>(L) * win_elems() * 2, f, "GPU cache rank: fork's query windows");
      copy(window_len, static_cast<size_t>(L) * 4, f, "GPU cache rank: fork's window lengths");
      if (anchors_on()) {
        copy(awin, static_cast<size_t>(L) * Hq * A * D * 2, f, "GPU cache rank: fork's anchor windows");
        copy(awin_len, static_cast<size_t>(L) * 4, f, "GPU cache rank: fork's anchor window lengths");
        copy(anchors, static_cast<size_t>(L) * Hkv * kernels::kMaxAnchors * 4, f, "GPU cache rank: fork's anchors");
      }
    }
  }

  // Builds and uploads the step's arrays (one pinned staging buffer, one copy on the work stream).
  void fill_meta(const GpuStepPlan& plan) {
    const int B = static_cast<int>(plan.rows.size()), T = plan.total_tokens();
    const int maxp = o.max_pages_per_seq;
    std::vector<int32_t> w;
    auto take = [&](size_t n) {
      const size_t at = w.size();
      w.resize(at + n, 0);
      return at;
    };
    m.tok_pos = take(static_cast<size_t>(T));
    m.tok_row = take(static_cast<size_t>(T));
    m.bt = take(static_cast<size_t>(B) * maxp);
    m.cu = take(static_cast<size_t>(B) + 1);
    m.win_idx = take(static_cast<size_t>(L) * B);
    m.reset = take(static_cast<size_t>(B));
    m.awin_idx = take(static_cast<size_t>(L) * B);
    int t = 0;
    for (int b = 0; b < B; ++b) {
      const GpuPlanRow& r = plan.rows[static_cast<size_t>(b)];
      const std::vector<int32_t>& pages = book.block_table(r.slot);
      SPADE_CHECK(static_cast<int>(pages.size()) <= maxp, "{}: slot {} holds {} pages, the table has {}", peer, r.slot,
                  pages.size(), maxp);
      std::fill(w.begin() + static_cast<long>(m.bt + static_cast<size_t>(b) * maxp),
                w.begin() + static_cast<long>(m.bt + static_cast<size_t>(b + 1) * maxp), -1);
      std::copy(pages.begin(), pages.end(), w.begin() + static_cast<long>(m.bt + static_cast<size_t>(b) * maxp));
      w[m.cu + static_cast<size_t>(b)] = t;
      for (int i = 0; i < r.q_len; ++i, ++t) {
        w[m.tok_pos + static_cast<size_t>(t)] = r.ctx_len - r.q_len + i;
        w[m.tok_row + static_cast<size_t>(t)] = b;
      }
      const bool pending = book.anchor_pending(r.slot);
      for (int l = 0; l < L; ++l) {
        w[m.win_idx + static_cast<size_t>(l) * B + b] = r.slot * L + l;
        w[m.awin_idx + static_cast<size_t>(l) * B + b] = pending ? r.slot * L + l : -1;
      }
      w[m.reset + static_cast<size_t>(b)] = (r.flags & kRowFresh) != 0 ? 1 : 0;
    }
    w[m.cu + static_cast<size_t>(B)] = t;
    for (int g = 0; g < 2; ++g) {
      const std::vector<int>& rows_g = group_rows[g];
      const int S = static_cast<int>(rows_g.size());
      m.g_bt[g] = take(static_cast<size_t>(S) * maxp);
      m.g_lens[g] = take(static_cast<size_t>(P) * S);
      m.g_wlen[g] = take(static_cast<size_t>(P) * S);
      m.g_mrows[g] = take(static_cast<size_t>(L) * S * Hkv);
      m.g_aw[g] = take(static_cast<size_t>(L) * S);
      m.g_anq[g] = take(static_cast<size_t>(S));
      m.g_actx[g] = take(static_cast<size_t>(S));
      m.g_qrow[g] = take(static_cast<size_t>(S));
      m.g_olens[g] = take(static_cast<size_t>(P) * S);
      for (int s = 0; s < S; ++s) {
        const int b = rows_g[static_cast<size_t>(s)];
        const GpuPlanRow& r = plan.rows[static_cast<size_t>(b)];
        std::copy_n(w.begin() + static_cast<long>(m.bt + static_cast<size_t>(b) * maxp), maxp,
                    w.begin() + static_cast<long>(m.g_bt[g] + static_cast<size_t>(s) * maxp));
        // The next step's context is ctx_len + 1; its last R positions are the inference rank's local window.
        const int selectable = std::max(0, r.ctx_len + 1 - o.sparse.selection.local_window);
        for (int j = 0; j < P; ++j) {
          w[m.g_lens[g] + static_cast<size_t>(j) * S + s] = std::min(selectable, r.ctx_len);
          w[m.g_wlen[g] + static_cast<size_t>(j) * S + s] = book.window_len(r.slot);
        }
        for (int l = 0; l < L; ++l)
          for (int h = 0; h < Hkv; ++h)
            w[m.g_mrows[g] + (static_cast<size_t>(l) * S + s) * Hkv + h] = (r.slot * L + l) * Hkv + h;
        // Anchors are picked at a sequence's first selection, from the anchor window pushed until then (a later
        // FIRST row, a table restart, keeps the anchors it has).
        const bool picks = g == kFirst && book.anchor_pending(r.slot);
        for (int l = 0; l < L; ++l) w[m.g_aw[g] + static_cast<size_t>(l) * S + s] = r.slot * L + l;
        w[m.g_anq[g] + static_cast<size_t>(s)] = picks ? book.anchor_window_len(r.slot) : 0;
        w[m.g_actx[g] + static_cast<size_t>(s)] = r.ctx_len;
        // Sampling: the row's (last) token, and the candidates of the selection made for this step one step ago
        // (that step's selectable range, context - 1 + 1 - R); rows of several tokens are not sampled (0).
        w[m.g_qrow[g] + static_cast<size_t>(s)] = w[m.cu + static_cast<size_t>(b)] + r.q_len - 1;
        const int oracle_len =
            r.q_len == 1 ? std::min(std::max(0, r.ctx_len - o.sparse.selection.local_window), r.ctx_len - 1) : 0;
        for (int j = 0; j < P; ++j) w[m.g_olens[g] + static_cast<size_t>(j) * S + s] = oracle_len;
      }
    }
    SPADE_CHECK(w.size() <= meta_words, "{}: step arrays of {} words exceed the {} reserved", peer, w.size(),
                meta_words);
    if (meta_pending) cuda_check(cudaEventSynchronize(meta_copied.e), "GPU cache rank: previous upload");
    // The previous step's selections still read the arrays on the score / sel streams (sel ends after score).
    if (sel_step_pending) cuda_check(cudaStreamWaitEvent(work, sel_step_end.e, 0), "wait previous selections");
    std::memcpy(meta_host, w.data(), w.size() * 4);
    cuda_check(cudaMemcpyAsync(meta.get(), meta_host, w.size() * 4, cudaMemcpyHostToDevice, work), "step upload");
    cuda_check(cudaEventRecord(meta_copied.e, work), "step upload");
    meta_pending = true;
  }

  const int32_t* md(size_t off) const { return meta.as<int32_t>() + off; }
  float* true_queries(int l) const {
    return q_true.as<float>() + static_cast<size_t>(l) * o.max_slots * Hq * D;
  }

  /// Sums the sampled pack `ps` (its copies complete: the caller waited) into `st`.
  void harvest(PackSample& ps, const int32_t* oracle, const int32_t* churn, GpuCacheStats& st) {
    constexpr int F = kernels::kDeltaInfoFields;
    for (int j = 0; j < ps.layers; ++j)
      for (int sq = 0; sq < ps.S; ++sq) {
        double ratio_sum = 0;
        int heads = 0;
        for (int h = 0; h < Hkv; ++h) {
          const size_t r = (static_cast<size_t>(j) * ps.S + sq) * Hkv + h;
          SelectionSampleStats& hs = st.head_samples[static_cast<size_t>(ps.first_layer + j) * Hkv + h];
          const int32_t* oi = oracle + r * F;
          if (oi[kernels::kDeltaCount] > 0 && oi[kernels::kDeltaEntering] >= 0) {
            const double ratio = 1.0 - static_cast<double>(oi[kernels::kDeltaEntering]) / oi[kernels::kDeltaCount];
            hs.overlap_sum += ratio;
            ++hs.overlap_n;
            ratio_sum += ratio;
            ++heads;
          }
          const int32_t* ci = churn + r * F;
          if (ci[kernels::kDeltaCount] > 0 && ci[kernels::kDeltaEntering] >= 0) {
            hs.churn_sum += static_cast<double>(ci[kernels::kDeltaEntering]) / ci[kernels::kDeltaCount];
            ++hs.churn_n;
          }
        }
        if (heads > 0) overlap_ratios.push_back(ratio_sum / heads);
      }
    ps.pending = false;
  }
  /// Sums pending sample i (pack_samples' index) if its copies are done; `wait`: waits for them.
  void harvest_one(size_t i, bool wait, GpuCacheStats& st) {
    PackSample& ps = pack_samples[i];
    if (!ps.pending) return;
    if (wait) {
      cuda_check(cudaEventSynchronize(ps.done->e), "GPU cache rank: sampled selections");
    } else {
      const cudaError_t q = cudaEventQuery(ps.done->e);
      if (q == cudaErrorNotReady) return;
      cuda_check(q, "GPU cache rank: sampled selections");
    }
    const int parity = static_cast<int>(i) / packs, p = static_cast<int>(i) % packs;
    harvest(ps, sample_buf(parity, p, 0), sample_buf(parity, p, 1), st);
  }
  void harvest_all(bool wait, GpuCacheStats& st) {
    for (size_t i = 0; i < pack_samples.size(); ++i) harvest_one(i, wait, st);
  }

  void append_pack(const GpuStepPlan& plan, int p) {
    const int B = static_cast<int>(plan.rows.size()), T = plan.total_tokens(), n = pack_layers(p);
    cuda_check(cudaStreamWaitEvent(work, rows_ready[static_cast<size_t>(p)]->e, 0), "wait rows");
    // The step's token rows in the paged pool, as the KV append and the key compaction both address them.
    auto set_token_rows = [&](auto& x) {
      x.positions = md(m.tok_pos);
      x.seq_idx = md(m.tok_row);
      x.tokens = T;
      x.block_table = md(m.bt);
      x.kv_shape() = pool_shape(B);
      x.num_pages = o.num_pages;
    };
    for (int j = 0; j < n; ++j) {
      const int l = p * P + j;
      kernels::RopeKvAppendParams r;
      r.qkv = pack_rows(p) + static_cast<size_t>(j) * T * row_elems;
      r.q_out = q_out.get();
      r.k_cache = pool.k(l);
      r.v_cache = pool.v(l);
      set_token_rows(r);
      r.num_q_heads = Hq;  // the rest of the shape: set_token_rows
      r.rot_dim = 0;  // normed and rotated by the inference rank
      cuda_check(kernels::rope_kv_append(r, work), "GPU cache rank: KV append");
      if (int8_keys) {
        kernels::QuantizeKeysParams qk;
        qk.k_cache = pool.k(l);
        qk.k_int8 = layer_kq(l);
        qk.k_scale = layer_kscale(l);
        set_token_rows(qk);
        cuda_check(kernels::quantize_keys(qk, work), "GPU cache rank: compact keys");
      }
      kernels::PushQueryWindowParams w;
      w.windows = windows.get();
      w.window_len = window_len.as<int32_t>();
      w.window_idx = md(m.win_idx + static_cast<size_t>(l) * B);
      w.q = q_out.get();
      w.cu_tokens = md(m.cu);
      w.reset = md(m.reset);
      w.num_windows = o.max_slots * L;
      w.rows = B;
      w.num_heads = Hq;
      w.capacity = cap_w;
      w.head_dim = D;
      cuda_check(kernels::push_query_window(w, work), "GPU cache rank: query windows");
      if (sampling && !group_rows[kSteady].empty()) {  // the steady rows' true queries of this layer
        kernels::GatherQueryRowsParams gq;
        gq.dtype = DType::BF16;
        gq.q = q_out.get();
        gq.q_rows = md(m.g_qrow[kSteady]);
        gq.out = true_queries(l);
        gq.batch = static_cast<int>(group_rows[kSteady].size());
        gq.row_elems = Hq * D;
        cuda_check(kernels::gather_query_rows(gq, work), "GPU cache rank: sampled true queries");
      }
      if (anchors_on()) {  // the rows whose anchors are still to be picked (window index -1 for the others)
        w.windows = awin.get();
        w.window_len = awin_len.as<int32_t>();
        w.window_idx = md(m.awin_idx + static_cast<size_t>(l) * B);
        w.capacity = A;
        cuda_check(kernels::push_query_window(w, work), "GPU cache rank: anchor windows");
      }
    }
    cuda_check(cudaEventRecord(appended[static_cast<size_t>(p)]->e, work), "appended event");
  }

  // The keys layer l's scoring reads: the rank's (SelectionConfig::score_keys), or with `exact` the cache's bf16.
  void set_scoring_keys(kernels::ScoreTokensParams& sp, int l, bool exact) const {
    sp.keys = exact ? kernels::ScoreKeys::kBf16 : o.sparse.selection.score_keys;
    if (int8_keys && !exact) {
      sp.k_int8 = layer_kq(l);
      sp.k_scale = layer_kscale(l);
    } else {
      sp.k_cache = pool.k(l);
    }
  }

  void select_pack(const GpuStepPlan& plan, int p, int g, const DeltaLayout& lay) {
    const int S = static_cast<int>(group_rows[g].size()), n = pack_layers(p);
    if (S == 0) return;
    const int cap = g == kSteady ? C : k;
    char* out = msg[g][p % 2].as<char>();
    const int b = static_cast<int>(selection_seq++ % 2);
    float* qh = q_hat[o.pipeline ? b : 0].as<float>();  // one set on one stream
    float* sc = scores[o.pipeline ? b : 0].as<float>();
    // q_hat[b] is free once the selection two before this one was scored.
    cuda_check(cudaStreamWaitEvent(work, scored[b].e, 0), "wait q_hat");
    // 1. windows of the group's rows for the pack's layers, rows (j, s)
    for (int j = 0; j < n; ++j)
      for (int s = 0; s < S; ++s) {
        const int slot = plan.rows[static_cast<size_t>(group_rows[g][static_cast<size_t>(s)])].slot;
        cuda_check(cudaMemcpyAsync(win_scratch.as<uint16_t>() + (static_cast<size_t>(j) * S + s) * win_elems(),
                                   windows.as<uint16_t>() + (static_cast<size_t>(slot) * L + p * P + j) * win_elems(),
                                   win_elems() * 2, cudaMemcpyDeviceToDevice, work),
                   "window gather");
      }
    // 2. next-query prediction
    kernels::PredictQueryParams pq;
    pq.window_dtype = DType::BF16;
    pq.window = win_scratch.get();
    pq.window_len = md(m.g_wlen[g]);
    pq.q_hat = qh;
    pq.batch = n * S;
    pq.num_heads = Hq;
    pq.window_capacity = cap_w;
    pq.head_dim = D;
    pq.max_regressors = o.sparse.selection.query_window;
    pq.eps = o.sparse.selection.ridge_eps;
    pq.kind = o.sparse.selection.predictor;
    cuda_check(kernels::predict_next_query(pq, work), "GPU cache rank: predict");
    cuda_check(cudaEventRecord(predicted[b].e, work), "predicted event");
    // 3. scores of every selectable key, per layer (score stream), into scores[b] once the selection two before
    // this one read them
    cuda_check(cudaStreamWaitEvent(score, predicted[b].e, 0), "wait predict");
    cuda_check(cudaStreamWaitEvent(score, selected[b].e, 0), "wait scores");
    // The paged-cache geometry of this group's S rows, as score_tokens and select_anchors read it.
    const auto paged_rows = [&](auto& x) {
      x.block_table = md(m.g_bt[g]);
      x.attention_shape() = pool_shape(S);
    };
    // Scores of the pack's layers for the group's rows (query(j): layer j's fp32 queries; lens: the candidates),
    // and their top-k per (layer, sequence, KV head).
    const auto score_pack = [&](auto query, const int32_t* lens, bool exact, const char* what) {
      for (int j = 0; j < n; ++j) {
        kernels::ScoreTokensParams sp;
        sp.q_hat = query(j);
        set_scoring_keys(sp, p * P + j, exact);
        paged_rows(sp);
        sp.num_tokens = lens;
        sp.scores = sc + static_cast<size_t>(j) * S * Hkv * stride;
        sp.score_stride = stride;
        sp.rule = o.sparse.selection.gqa_rule;
        cuda_check(kernels::score_tokens(sp, score), what);
      }
    };
    const auto topk_pack = [&](const int32_t* lens, int32_t* top, cudaStream_t st, const char* what) {
      kernels::TopkParams tp;
      tp.scores = sc;
      tp.row_lens = lens;
      tp.indices = top;
      tp.batch = n * S;
      tp.rows_per_batch = Hkv;
      tp.score_stride = stride;
      tp.k = k;
      tp.successor = o.sparse.selection.successor_expand;
      cuda_check(kernels::topk_select(tp, st), what);
    };
    const bool sample = sampling && g == kSteady;
    if (sample) {  // 3a. sampling: the true query's exact top-k over this step's candidates (gpu_server.h)
      score_pack([&](int j) { return true_queries(p * P + j); }, md(m.g_olens[g]), true,
                 "GPU cache rank: sampled scores");
      topk_pack(md(m.g_olens[g]), o_idx[o.pipeline ? b : 0].as<int32_t>(), score, "GPU cache rank: sampled top-k");
    }
    score_pack([&](int j) { return qh + static_cast<size_t>(j) * S * Hq * D; }, md(m.g_lens[g]), false,
               "GPU cache rank: score");
    if (g == kFirst && group_picks_anchors) {  // 3b. the anchors of the rows at their first selection
      for (int j = 0; j < n; ++j) {
        const int l = p * P + j;
        kernels::SelectAnchorsParams ap;
        ap.windows = awin.get();
        ap.window_idx = md(m.g_aw[g] + static_cast<size_t>(l) * S);
        ap.num_queries = md(m.g_anq[g]);
        ap.context_len = md(m.g_actx[g]);
        ap.k_cache = pool.k(l);
        paged_rows(ap);
        ap.anchor_rows = md(m.g_mrows[g] + static_cast<size_t>(l) * S * Hkv);
        ap.anchors = anchors.as<int32_t>();
        ap.num_windows = o.max_slots * L;
        ap.window_capacity = A;
        // The GPU path has no sink tokens: anchors leave out the first `span` positions (Selector: max(sinks, span)).
        ap.begin = o.sparse.selection.anchor_span;
        ap.local_window = o.sparse.selection.local_window;
        ap.span = o.sparse.selection.anchor_span;
        ap.workspace = anchor_ws.get();  // the score stream orders the layers' launches: one workspace serves all
        ap.workspace_bytes = anchor_ws.bytes();
        cuda_check(kernels::select_anchors(ap, score), "GPU cache rank: prompt anchors");
      }
    }
    cuda_check(cudaEventRecord(scored[b].e, score), "scored event");
    // 4. top-k per (layer, sequence, KV head) (sel stream, as everything after it)
    cuda_check(cudaStreamWaitEvent(sel, scored[b].e, 0), "wait scores");
    if (anchors_on()) {  // every selection holds its sequence's anchor spans (none before they are picked: -1)
      kernels::ApplyAnchorSpansParams as;
      as.scores = sc;
      as.row_lens = md(m.g_lens[g]);
      as.anchors = anchors.as<int32_t>();
      as.anchor_rows = md(m.g_mrows[g] + static_cast<size_t>(p) * P * S * Hkv);
      as.rows = n * S * Hkv;
      as.rows_per_batch = Hkv;
      as.score_stride = stride;
      as.first_pos = 0;
      as.span = o.sparse.selection.anchor_span;
      as.budget = k;
      as.successor = o.sparse.selection.successor_expand;
      cuda_check(kernels::apply_anchor_spans(as, sel), "GPU cache rank: anchor spans");
    }
    topk_pack(md(m.g_lens[g]), indices.as<int32_t>(), sel, "GPU cache rank: top-k");
    // The message buffer of this parity was last sent for pack p - 2 (this step) or by the previous step.
    cuda_check(cudaStreamWaitEvent(sel, sent[g][static_cast<size_t>(p % 2)]->e, 0), "wait send");
    // 5. the slot plan against the per-slot mirrors, into the message
    if (sample) {  // 4b. sampling: what of the true query's top-k the held tables (this step's selection) miss
      const size_t row_bytes = static_cast<size_t>(Hkv) * k * 4;
      for (int j = 0; j < n; ++j)
        for (int sq = 0; sq < S; ++sq) {
          const int slot = plan.rows[static_cast<size_t>(group_rows[g][static_cast<size_t>(sq)])].slot;
          cuda_check(cudaMemcpyAsync(o_mirror.as<char>() + (static_cast<size_t>(j) * S + sq) * row_bytes,
                                     mirror.as<char>() + (static_cast<size_t>(slot) * L + p * P + j) * row_bytes,
                                     row_bytes, cudaMemcpyDeviceToDevice, sel),
                     "GPU cache rank: sampled held tables");
        }
      kernels::SelectionDeltaParams op;
      op.indices = o_idx[o.pipeline ? b : 0].as<int32_t>();
      op.mirror = o_mirror.as<int32_t>();
      op.delta_slots = o_slots.as<int32_t>();
      op.delta_positions = o_pos.as<int32_t>();
      op.row_info = o_info.as<int32_t>();
      op.rows = n * S * Hkv;
      op.k = k;
      op.capacity = k;  // every entering token counted, none ranked by score
      op.score_stride = stride;
      cuda_check(kernels::selection_delta(op, sel), "GPU cache rank: sampled overlap");
    }
    kernels::SelectionDeltaParams dp;
    dp.indices = indices.as<int32_t>();
    dp.scores = sc;
    dp.mirror = mirror.as<int32_t>();
    dp.mirror_rows = md(m.g_mrows[g] + static_cast<size_t>(p) * P * S * Hkv);
    dp.delta_slots = reinterpret_cast<int32_t*>(out + lay.slots);
    dp.delta_positions = reinterpret_cast<int32_t*>(out + lay.positions);
    dp.row_info = reinterpret_cast<int32_t*>(out + lay.info);
    dp.rows = n * S * Hkv;
    dp.k = k;
    dp.capacity = cap;
    dp.score_stride = stride;
    cuda_check(kernels::selection_delta(dp, sel), "GPU cache rank: selection delta");
    cuda_check(cudaEventRecord(selected[b].e, sel), "selected event");
    if (sample) {  // both row infos to the host (summed by harvest_all once copied)
      const int parity = static_cast<int>(sampled_steps % 2);
      const size_t si = static_cast<size_t>(parity) * packs + p;
      harvest_one(si, true, *stats);  // its last use, two samples back: long done
      PackSample& ps = pack_samples[si];
      const size_t bytes = static_cast<size_t>(n) * S * Hkv * kernels::kDeltaInfoFields * 4;
      cuda_check(cudaMemcpyAsync(sample_buf(parity, p, 0), o_info.get(), bytes, cudaMemcpyDeviceToHost, sel),
                 "GPU cache rank: sampled overlap download");
      cuda_check(cudaMemcpyAsync(sample_buf(parity, p, 1), out + lay.info, bytes, cudaMemcpyDeviceToHost, sel),
                 "GPU cache rank: sampled churn download");
      cuda_check(cudaEventRecord(ps.done->e, sel), "sample event");
      ps.pending = true;
      ps.layers = n;
      ps.S = S;
      ps.first_layer = p * P;
    }
    // 6. the entries' K / V, per layer
    for (int j = 0; j < n; ++j) {
      const size_t first = static_cast<size_t>(j) * S * Hkv * cap;
      kernels::GatherKvParams gp;
      gp.k_cache = pool.k(p * P + j);
      gp.v_cache = pool.v(p * P + j);
      gp.block_table = md(m.g_bt[g]);
      gp.indices = reinterpret_cast<const int32_t*>(out + lay.positions) + first;
      gp.packed_k = out + lay.k + first * D * 2;
      gp.packed_v = out + lay.v + first * D * 2;
      gp.kv_shape() = pool_shape(S);
      gp.k = cap;
      cuda_check(kernels::gather_kv(gp, sel), "GPU cache rank: gather");
    }
    cuda_check(cudaEventRecord(sel_done[g][static_cast<size_t>(p)]->e, sel), "selection event");
    cuda_check(cudaStreamWaitEvent(down, sel_done[g][static_cast<size_t>(p)]->e, 0), "wait selection");
    link.send(out, lay.bytes, down, g == kSteady ? "steady selections of a pack" : "first selections of a pack");
    cuda_check(cudaEventRecord(sent[g][static_cast<size_t>(p % 2)]->e, down), "sent event");
    stats_bytes_sent += lay.bytes;
  }
  uint64_t stats_bytes_sent = 0;
  GpuCacheStats* stats = nullptr;  // the server's (harvest_all sums the samples into it)
  bool group_picks_anchors = false;  // this step's FIRST group has a row whose anchors are still to be picked
};

GpuCacheServer::GpuCacheServer(const ModelConfig& attn_cfg, GpuCacheOptions opts, transport::GpuLink& link,
                               std::string peer) {
  SPADE_CHECK(!attn_cfg.is_hybrid(), "GPU cache rank: pass the model's attention view (no GDN layers)");
  pair::validate(opts.sparse);
  SPADE_CHECK(opts.max_slots >= 1 && opts.max_step_tokens >= 1 && opts.num_pages >= 1 && opts.page_size >= 1 &&
                  opts.max_pages_per_seq >= 1,
              "GPU cache rank: max_slots {}, max_step_tokens {}, num_pages {}, page_size {}, max_pages_per_seq {} must "
              "be positive",
              opts.max_slots, opts.max_step_tokens, opts.num_pages, opts.page_size, opts.max_pages_per_seq);
  SPADE_CHECK(opts.sparse.selection.token_budget <= kernels::kMaxDeltaBudget,
              "GPU cache rank: token budget {} must be <= {}", opts.sparse.selection.token_budget,
              kernels::kMaxDeltaBudget);
  SPADE_CHECK(opts.max_slots <= gpu_plan_max_rows(), "GPU cache rank: {} slots exceed a plan's {} rows",
              opts.max_slots, gpu_plan_max_rows());
  cuda_check(cudaSetDevice(opts.device), "GPU cache rank: cudaSetDevice");
  // The selection kernels' shared-memory limits now, before the first receive is posted (kernels/selection.cuh).
  cuda_check(kernels::prepare_selection_kernels(), "GPU cache rank: selection kernels set-up");
  st_ = std::make_unique<State>(attn_cfg, opts, link, std::move(peer));
  stats_.pool_pages = static_cast<uint64_t>(opts.num_pages);
  State& s = *st_;
  for (cudaStream_t* x : {&s.up, &s.work, &s.down})
    cuda_check(cudaStreamCreateWithFlags(x, cudaStreamNonBlocking), "GPU cache rank: stream");
  s.score = s.sel = s.work;
  if (opts.pipeline) {
    int least = 0, greatest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "GPU cache rank: stream priorities");
    cuda_check(cudaStreamCreateWithPriority(&s.score, cudaStreamNonBlocking, least), "GPU cache rank: score stream");
    cuda_check(cudaStreamCreateWithPriority(&s.sel, cudaStreamNonBlocking, greatest), "GPU cache rank: sel stream");
  }
  const size_t S = static_cast<size_t>(opts.max_slots), Lz = static_cast<size_t>(s.L), P = static_cast<size_t>(s.P);
  s.int8_keys = opts.sparse.selection.score_keys == kernels::ScoreKeys::kInt8;
  if (s.int8_keys) {
    s.kq = DeviceBuffer(Lz * s.layer_rows() * s.D, "GPU cache rank: int8 scoring keys");
    s.kscale = DeviceBuffer(Lz * s.layer_rows() * 4, "GPU cache rank: int8 key scales");
  }
  s.windows = DeviceBuffer(S * Lz * s.win_elems() * 2, "GPU cache rank: query windows");
  if (s.anchors_on()) {
    s.awin = DeviceBuffer(S * Lz * s.Hq * static_cast<size_t>(s.A) * s.D * 2, "GPU cache rank: anchor windows");
    s.awin_len = DeviceBuffer(S * Lz * 4, "GPU cache rank: anchor window lengths");
    cuda_check(cudaMemset(s.awin_len.get(), 0, s.awin_len.bytes()), "anchor window init");
    s.anchors = DeviceBuffer(S * Lz * s.Hkv * kernels::kMaxAnchors * 4, "GPU cache rank: prompt anchors");
    cuda_check(cudaMemset(s.anchors.get(), 0xFF, s.anchors.bytes()), "anchors init");
    s.anchor_ws = DeviceBuffer(kernels::select_anchors_workspace_bytes(static_cast<int>(S), s.Hq, s.Hkv, s.A),
                               "GPU cache rank: anchor pick workspace");
  }
  s.mirror = DeviceBuffer(S * Lz * s.Hkv * s.k * 4, "GPU cache rank: slot table mirrors");
  cuda_check(cudaMemset(s.mirror.get(), 0xFF, s.mirror.bytes()), "mirror init");
  s.window_len = DeviceBuffer(S * Lz * 4, "GPU cache rank: window lengths");
  cuda_check(cudaMemset(s.window_len.get(), 0, s.window_len.bytes()), "window init");
  s.plan_dev = DeviceBuffer(kGpuPlanBytes, "GPU cache rank: plan");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.plan_host), kGpuPlanBytes), "GPU cache rank: pinned plan");
  s.rows = DeviceBuffer(static_cast<size_t>(s.packs) * P * opts.max_step_tokens * s.row_elems * 2,
                        "GPU cache rank: received rows");
  s.q_out = DeviceBuffer(static_cast<size_t>(opts.max_step_tokens) * s.Hq * s.D * 2, "GPU cache rank: queries");
  const size_t T = opts.max_step_tokens, maxp = opts.max_pages_per_seq;
  s.meta_words = 2 * T + S * maxp + S + 1 + 2 * Lz * S + S +
                 2 * (S * maxp + 3 * P * S + Lz * S * s.Hkv + Lz * S + 3 * S);
  s.meta = DeviceBuffer(s.meta_words * 4, "GPU cache rank: step arrays");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.meta_host), s.meta_words * 4), "GPU cache rank: pinned");
  s.win_scratch = DeviceBuffer(P * S * s.win_elems() * 2, "GPU cache rank: window scratch");
  for (int b = 0; b < (opts.pipeline ? 2 : 1); ++b) {
    s.q_hat[b] = DeviceBuffer(P * S * s.Hq * s.D * 4, "GPU cache rank: predicted queries");
    s.scores[b] = DeviceBuffer(P * S * s.Hkv * static_cast<size_t>(s.stride) * 4, "GPU cache rank: scores");
  }

  s.indices = DeviceBuffer(P * S * s.Hkv * s.k * 4, "GPU cache rank: top-k");
  s.stats = &stats_;
  s.sample_every = opts.sparse.overlap_sample_every;
  if (s.sample_every > 0) {
    const size_t rows = P * S * s.Hkv;
    s.q_true = DeviceBuffer(Lz * S * s.Hq * s.D * 4, "GPU cache rank: sampled true queries");
    for (DeviceBuffer* x : {&s.o_idx[0], &s.o_idx[1], &s.o_mirror, &s.o_slots, &s.o_pos})
      *x = DeviceBuffer(rows * s.k * 4, "GPU cache rank: sampled selections");
    s.o_info = DeviceBuffer(rows * kernels::kDeltaInfoFields * 4, "GPU cache rank: sampled row infos");
    cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.sample_host), 2 * s.packs * 2 * s.sample_words() * 4),
               "GPU cache rank: pinned samples");
    s.pack_samples.resize(2 * static_cast<size_t>(s.packs));
    for (auto& ps : s.pack_samples) ps.done = std::make_unique<Event>();
    stats_.head_samples.assign(Lz * s.Hkv, SelectionSampleStats{});
  }
  for (int g = 0; g < 2; ++g) {
    const DeltaLayout most(P * S * s.Hkv, g == kSteady ? s.C : s.k, s.D);
    for (auto& b : s.msg[g]) b = DeviceBuffer(most.bytes, "GPU cache rank: selection messages");
  }
  for (int p = 0; p < s.packs; ++p) {
    s.rows_ready.push_back(std::make_unique<Event>());
    s.appended.push_back(std::make_unique<Event>());
    for (int g = 0; g < 2; ++g) s.sel_done[g].push_back(std::make_unique<Event>());
  }
  for (int g = 0; g < 2; ++g)
    for (int i = 0; i < 2; ++i) s.sent[g].push_back(std::make_unique<Event>());
  cuda_check(cudaDeviceSynchronize(), "GPU cache rank: init");
  s.post_plan_recv();
}

GpuCacheServer::~GpuCacheServer() {
  if (st_ != nullptr && !st_->link.failed()) {
    for (cudaStream_t x : {st_->work, st_->score, st_->sel, st_->down}) cudaStreamSynchronize(x);
  }
}

bool GpuCacheServer::closed() const { return st_->closed; }

void GpuCacheServer::synchronize() {
  for (cudaStream_t x : {st_->work, st_->score, st_->sel, st_->down})
    cuda_check(cudaStreamSynchronize(x), "GPU cache rank: synchronize");
  st_->harvest_all(true, stats_);
  stats_.sampled_steps = st_->sampled_steps;
}

std::vector<double> GpuCacheServer::take_overlap_ratios() {
  std::vector<double> out;
  out.swap(st_->overlap_ratios);
  return out;
}

size_t GpuCacheServer::device_bytes() const {
  const State& s = *st_;
  size_t b = s.pool.bytes();
  for (const DeviceBuffer* x : {&s.kq, &s.kscale, &s.windows, &s.awin, &s.awin_len, &s.anchors, &s.anchor_ws, &s.mirror,
                                &s.window_len, &s.plan_dev, &s.rows, &s.q_out, &s.meta, &s.win_scratch, &s.q_hat[0], &s.q_hat[1], &s.scores[0], &s.scores[1], &s.indices,
                                &s.q_true, &s.o_idx[0], &s.o_idx[1], &s.o_mirror, &s.o_slots, &s.o_pos, &s.o_info})
    b += x->bytes();
  for (const auto& g : s.msg)
    for (const auto& m : g) b += m.bytes();
  return b;
}

bool GpuCacheServer::serve_step(std::chrono::milliseconds wait) {
  State& s = *st_;
  cuda_check(cudaSetDevice(s.o.device), "GPU cache rank: cudaSetDevice");
  // 1. the plan
  if (s.closed) return false;
  const auto deadline = Clock::now() + wait;
  for (;;) {
    const cudaError_t q = cudaEventQuery(s.plan_ready.e);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) cuda_check(q, "GPU cache rank: plan");
    SPADE_CHECK(!s.link.failed(), "{}", s.link.failure());
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  s.plan_posted = false;
  if (s.link.failed()) {
    // A released receive completes on garbage, but the close plan may have arrived just before the peer's
    // teardown failed the link: only that exact message counts, anything else is the failure.
    GpuStepPlan last;
    try {
      last = decode_gpu_plan(s.plan_host, kGpuPlanBytes, s.o.max_slots, s.peer);
    } catch (const Error&) {
    }
    if (last.is_close()) {
      s.closed = true;
      return false;
    }
    fail("{}", s.link.failure());
  }
  const GpuStepPlan plan = decode_gpu_plan(s.plan_host, kGpuPlanBytes, s.o.max_slots, s.peer);
  if (plan.is_close()) {  // the inference rank is done with the link: post nothing more
    s.closed = true;
    return false;
  }
  stats_.bytes_received += kGpuPlanBytes;  // as the inference rank counts it
  // The bookkeeping's gauges, after a plan's retains, forks, drops and releases.
  const auto book_gauges = [&] {
    stats_.retained_prefixes = static_cast<uint64_t>(s.book.retained());
    stats_.sequences = static_cast<uint64_t>(s.book.live_slots());
    stats_.pages_held = static_cast<uint64_t>(s.book.pages_held());
    stats_.peak_pages_held = std::max(stats_.peak_pages_held, stats_.pages_held);
  };
  if (plan.is_flush()) {  // between steps: the released slots, retains and drops only; no packs follow
    s.book.apply(plan, [&s](int slot) { s.reset_mirror(slot); });
    book_gauges();
    ++stats_.idle_flushes;
    s.post_plan_recv();
    return true;
  }
  const int B = static_cast<int>(plan.rows.size()), T = plan.total_tokens();
  SPADE_CHECK(T <= s.o.max_step_tokens, "{}: step {} has {} tokens, this rank holds {}", s.peer, plan.step, T,
              s.o.max_step_tokens);

  // 2. bookkeeping
  s.harvest_all(false, stats_);  // earlier samples whose copies are done
  s.sampling = s.sample_every > 0 && plan.step % s.sample_every == 0 && !plan.steady_rows().empty();
  s.book.apply(plan, [&s](int slot) { s.reset_mirror(slot); });
  s.group_picks_anchors = false;
  for (const GpuPlanRow& r : plan.rows) {
    if ((r.flags & kRowFirstSelect) == 0) continue;
    s.reset_mirror(r.slot);
    // A FIRST row whose anchor window is still pushed picks its anchors.
    s.group_picks_anchors = s.group_picks_anchors || s.book.anchor_pending(r.slot);
  }
  s.group_rows[kSteady] = plan.steady_rows();
  s.group_rows[kFirst] = plan.first_rows();
  s.fill_meta(plan);
  s.copy_fork_windows(plan);
  for (const pair::GpuPlanFork& f : plan.forks) {
    const bool retained = (f.flags & pair::kForkFromRetained) != 0;
    stats_.forks += retained ? 0 : 1;
    stats_.retained_hits += retained ? 1 : 0;
    stats_.retained_hit_tokens += retained ? static_cast<uint64_t>(f.tokens) : 0;
  }
  book_gauges();

  // 3. the packs' rows, then per pack: append, windows, selections
  for (int p = 0; p < s.packs; ++p) {
    const size_t bytes = static_cast<size_t>(s.pack_layers(p)) * T * s.row_elems * 2;
    // One message per pack, [layers][T][row]; its buffer is free once the previous step appended it.
    cuda_check(cudaStreamWaitEvent(s.up, s.appended[static_cast<size_t>(p)]->e, 0), "wait append");
    s.link.recv(s.pack_rows(p), bytes, s.up, "q|k|v rows of a pack");
    cuda_check(cudaEventRecord(s.rows_ready[static_cast<size_t>(p)]->e, s.up), "rows event");
    stats_.bytes_received += bytes;
  }
  for (int p = 0; p < s.packs; ++p) {
    s.append_pack(plan, p);
    const GpuPackSizes sizes = gpu_pack_sizes(plan, s.pack_layers(p), s.cfg, s.k, s.C);
    s.select_pack(plan, p, kSteady, sizes.steady);
    s.select_pack(plan, p, kFirst, sizes.first);
  }
  cuda_check(cudaEventRecord(s.sel_step_end.e, s.sel), "step end event");
  s.sel_step_pending = true;
  // The first selections of this step picked their anchors: those slots' queries no longer go to anchor windows.
  for (int b : s.group_rows[kFirst]) s.book.anchors_picked(plan.rows[static_cast<size_t>(b)].slot);
  // 4. the next plan
  s.post_plan_recv();
  ++stats_.steps;
  if (s.sampling) ++s.sampled_steps;
  stats_.sampled_steps = s.sampled_steps;
  stats_.tokens_appended += static_cast<uint64_t>(T);
  stats_.selections += s.group_rows[kSteady].size() + s.group_rows[kFirst].size();
  stats_.first_selections += s.group_rows[kFirst].size();
  stats_.bytes_sent = s.stats_bytes_sent;
  (void)B;
  return true;
}

size_t gpu_cache_page_bytes(const ModelConfig& attn_cfg, int page_size, kernels::ScoreKeys keys) {
  const size_t rows = static_cast<size_t>(attn_cfg.num_layers) * page_size * attn_cfg.num_kv_heads;
  const size_t kv = rows * attn_cfg.head_dim * 2 * 2;  // K and V, bf16
  return kv + (keys == kernels::ScoreKeys::kInt8 ? rows * (static_cast<size_t>(attn_cfg.head_dim) + 4) : 0);
}

GpuPairHello recv_gpu_hello(transport::GpuLink& link, const ModelConfig& attn_cfg, const std::string& peer,
                            std::chrono::milliseconds timeout) {
  cuda_check(cudaSetDevice(link.device()), "GPU pair hello: cudaSetDevice");
  DeviceBuffer buf(kGpuHelloBytes, "GPU pair hello");
  std::vector<uint8_t> host(kGpuHelloBytes, 0);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "GPU pair hello: stream");
  std::string err;
  try {
    link.recv(buf.get(), kGpuHelloBytes, stream, "the pair hello", timeout);
    cuda_check(cudaMemcpyAsync(host.data(), buf.get(), kGpuHelloBytes, cudaMemcpyDeviceToHost, stream),
               "GPU pair hello: download");
    cuda_check(cudaStreamSynchronize(stream), "GPU pair hello: receive");
  } catch (const std::exception& e) {
    err = e.what();
  }
  cudaStreamDestroy(stream);
  if (err.empty() && link.failed()) err = link.failure();
  SPADE_CHECK(err.empty(), "waiting for the pair hello of {}: {}", peer, err);
  return decode_gpu_hello(host.data(), host.size(), attn_cfg, peer);
}

GpuCacheOptions gpu_cache_options(const GpuPairHello& h, const pair::SparseConfig& own, int device) {
  GpuCacheOptions o;
  o.device = device;
  o.sparse = own;
  o.sparse.selection.token_budget = h.token_budget;
  o.sparse.selection.local_window = h.local_window;
  o.sparse.layers_per_pack = h.layers_per_pack;
  o.sparse.delta_capacity = h.delta_capacity;
  o.max_slots = h.max_slots;
  o.max_step_tokens = h.max_step_tokens;
  o.num_pages = h.num_pages;
  o.page_size = h.page_size;
  o.max_pages_per_seq = h.max_pages_per_seq;
  return o;
}

}  // namespace spade::cache
