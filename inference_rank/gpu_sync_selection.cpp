// The synchronous selection references on the GPU path (see gpu_sync_selection.h).
#include "inference_rank/gpu_sync_selection.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "kernels/attention.cuh"
#include "kernels/selection.cuh"

namespace spade {

struct GpuSyncSelection::State {
  ModelConfig cfg;
  GpuSparseOptions o;
  SelectionMode mode;
  int Hq = 0, Hkv = 0, D = 0, k = 0, R = 0, page_size = 0, max_batch = 0, max_pages = 0, score_stride = 0;
  GpuDenseAttention dense;
  SparseStepPlanner planner;
  // Per-row arrays of a step: [num_packed B][windows B][q_rows B][skip B][candidates B] (B = max_batch).
  DeviceBuffer arrays;
  int32_t* arrays_pinned = nullptr;
  CudaEvent arrays_copied;
  bool arrays_pending = false;
  DeviceBuffer q32;      // [max_batch, Hq * D] fp32: the sparse rows' true queries
  DeviceBuffer scores;   // oracle: [max_batch, Hkv, score_stride] fp32; quest: [max_batch, Hkv, max_pages] fp32
  DeviceBuffer indices;  // [max_batch, Hkv, k] int32
  DeviceBuffer packed;   // K then V: [max_batch, Hkv, k, D] bf16 each
  DeviceBuffer ws;       // the packed kernel's split-K workspace
  int64_t step = 0;

  State(const ModelConfig& c, const GpuSparseOptions& opts, SelectionMode m, int ps, int mb, int max_model_len)
      : cfg(c), o(opts), mode(m), Hq(c.num_q_heads), Hkv(c.num_kv_heads), D(c.head_dim),
        k(opts.sparse.selection.token_budget), R(opts.sparse.selection.local_window), page_size(ps), max_batch(mb),
        max_pages((max_model_len + ps - 1) / ps), score_stride(max_pages * ps), dense(c, ps, mb), planner(opts) {}
  ~State() {
    if (arrays_pinned != nullptr) cudaFreeHost(arrays_pinned);
  }
  const int32_t* arr(int field) const { return arrays.as<int32_t>() + static_cast<size_t>(field) * max_batch; }
  char* packed_k() const { return packed.as<char>(); }
  char* packed_v() const { return packed.as<char>() + packed.bytes() / 2; }
};

GpuSyncSelection::GpuSyncSelection(const ModelConfig& attn_cfg, const GpuSparseOptions& o, SelectionMode mode,
                                   int page_size, int max_batch, int max_model_len) {
  SPADE_CHECK(!attn_cfg.is_hybrid(), "GPU {}: pass the model's attention view", selection_mode_name(mode));
  SPADE_CHECK(mode == SelectionMode::Oracle || mode == SelectionMode::Quest,
              "GPU synchronous selection: mode {} is not oracle or quest", selection_mode_name(mode));
  const pair::SparseConfig& c = o.sparse;
  pair::validate(c);  // names the setting
  SPADE_CHECK(c.selection.sink_tokens == 0, "GPU {}: sink tokens {}: the GPU path attends no sink tokens of its own",
              selection_mode_name(mode), c.selection.sink_tokens);
  SPADE_CHECK(page_size > 0 && max_batch >= 1 && max_model_len >= 1,
              "GPU {}: page size {} / max batch {} / max model length {} out of range", selection_mode_name(mode),
              page_size, max_batch, max_model_len);
  SPADE_CHECK(mode != SelectionMode::Quest || (max_model_len + page_size - 1) / page_size <= kernels::kMaxQuestPages,
              "GPU quest: --max-model-len {} is {} pages of {} tokens, above the {} quest_select takes", max_model_len,
              (max_model_len + page_size - 1) / page_size, page_size, kernels::kMaxQuestPages);
  cuda_check(kernels::prepare_selection_kernels(), "GPU synchronous selection: selection kernels set-up");
  st_ = std::make_unique<State>(attn_cfg, o, mode, page_size, max_batch, max_model_len);
  State& s = *st_;
  const size_t B = static_cast<size_t>(max_batch);
  s.arrays = DeviceBuffer(5 * B * 4, "GPU synchronous selection: per-row arrays");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.arrays_pinned), 5 * B * 4),
             "GPU synchronous selection: pinned");
  s.q32 = DeviceBuffer(B * s.Hq * s.D * 4, "GPU synchronous selection: queries");
  const size_t per_row = mode == SelectionMode::Oracle ? static_cast<size_t>(s.score_stride) : s.max_pages;
  s.scores = DeviceBuffer(B * s.Hkv * per_row * 4, "GPU synchronous selection: scores");
  s.indices = DeviceBuffer(B * s.Hkv * s.k * 4, "GPU synchronous selection: indices");
  s.packed = DeviceBuffer(2 * B * s.Hkv * s.k * s.D * 2, "GPU synchronous selection: gathered K/V");
  s.ws = DeviceBuffer(kernels::decode_workspace_bytes(max_batch, s.Hq, s.Hkv, s.D),
                      "GPU synchronous selection: workspace");
  cuda_check(kernels::decode_workspace_init({s.ws.get(), s.ws.bytes()}, nullptr),
             "GPU synchronous selection: workspace init");
  cuda_check(cudaDeviceSynchronize(), "GPU synchronous selection: init");
}

GpuSyncSelection::~GpuSyncSelection() = default;

void GpuSyncSelection::attend(int, const ForwardBatch&, const float*, const float*, const float*, float*) {
  fail("GPU {}: the CPU attention hook is not used on the GPU path", selection_mode_name(st_->mode));
}

void GpuSyncSelection::on_release(uint64_t seq_id) { st_->planner.on_release(seq_id); }

void GpuSyncSelection::set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold) {
  st_->planner.set_request_options(seq_id, force_dense, sparse_threshold);
}

bool GpuSyncSelection::graph_safe(const ForwardBatch& fb) const {
  (void)fb;
  return !sparse_now_;
}

void GpuSyncSelection::begin_step(const ForwardBatch& fb, cudaStream_t stream) {
  State& st = *st_;
  const int B = fb.batch();
  SPADE_CHECK(B <= st.max_batch, "GPU {}: batch {} exceeds {}", selection_mode_name(st.mode), B, st.max_batch);
  // The predicted path's phases (the plan itself goes nowhere): the same rows are sparse at the same steps.
  const StepDecision d = st.planner.plan_step(fb, st.step++);
  sparse_now_ = d.sparse_now;
  switches_ += static_cast<uint64_t>(d.switches);
  if (!sparse_now_) return;
  const size_t MB = static_cast<size_t>(st.max_batch);
  std::vector<int32_t> w(5 * MB, 0);
  for (int r = 0; r < B; ++r) {
    const size_t i = static_cast<size_t>(r);
    const bool sparse = d.q_rows[i] >= 0;
    w[i] = d.num_packed[i];
    w[MB + i] = d.windows[i];
    w[2 * MB + i] = d.q_rows[i];
    w[3 * MB + i] = sparse ? 1 : 0;
    w[4 * MB + i] = sparse ? std::max(0, fb.seq_lens[i] - st.R) : 0;  // candidates [0, context - R)
    sparse_seq_steps_ += sparse ? 1 : 0;
  }
  if (st.arrays_pending) cuda_check(cudaEventSynchronize(st.arrays_copied.e), "GPU sync selection: arrays copy");
  std::memcpy(st.arrays_pinned, w.data(), w.size() * 4);
  cuda_check(cudaMemcpyAsync(st.arrays.get(), st.arrays_pinned, w.size() * 4, cudaMemcpyHostToDevice, stream),
             "GPU sync selection: arrays upload");
  cuda_check(cudaEventRecord(st.arrays_copied.e, stream), "GPU sync selection: arrays event");
  st.arrays_pending = true;
}

void GpuSyncSelection::attend(const GpuLayerStep& s, const GpuBatch& b, cudaStream_t stream) {
  State& st = *st_;
  if (!sparse_now_) {
    st.dense.attend(s, b, stream);
    return;
  }
  const char* name = st.mode == SelectionMode::Oracle ? "GPU oracle" : "GPU quest";
  // 1. The sparse rows' true queries (this layer's, after q-norm and RoPE) as fp32; other rows zero.
  kernels::GatherQueryRowsParams g;
  g.q = s.q;
  g.q_rows = st.arr(2);
  g.out = st.q32.as<float>();
  g.batch = b.batch;
  g.row_elems = st.Hq * st.D;
  cuda_check(kernels::gather_query_rows(g, stream), "GPU sync selection: queries");
  // 2. The selection over the candidates [0, context - R) of each sparse row (0 candidates elsewhere: -1 only).
  // The fields both selections read: the cache of this layer, the step's block table, the candidates per row.
  const kernels::PagedAttentionShape shape = attention_shape(st.cfg, b, st.page_size);
  const auto paged = [&](auto& p) {
    p.k_cache = s.k_cache;
    p.block_table = b.block_table;
    p.num_tokens = st.arr(4);
    p.attention_shape() = shape;
    p.rule = st.o.sparse.selection.gqa_rule;
  };
  if (st.mode == SelectionMode::Oracle) {
    kernels::ScoreTokensParams sp;
    paged(sp);
    sp.q_hat = st.q32.as<float>();
    sp.scores = st.scores.as<float>();
    sp.score_stride = st.score_stride;
    cuda_check(kernels::score_tokens(sp, stream), "GPU oracle: token scores");
    kernels::TopkParams tp;
    tp.scores = st.scores.as<float>();
    tp.row_lens = st.arr(4);
    tp.indices = st.indices.as<int32_t>();
    tp.batch = b.batch;
    tp.rows_per_batch = st.Hkv;
    tp.score_stride = st.score_stride;
    tp.k = st.k;
    tp.successor = st.o.sparse.selection.successor_expand;
    cuda_check(kernels::topk_select(tp, stream), "GPU oracle: top-k");
  } else {
    kernels::QuestSelectParams qp;
    paged(qp);
    qp.q = st.q32.as<float>();
    qp.page_scores = st.scores.as<float>();
    qp.indices = st.indices.as<int32_t>();
    qp.k = st.k;
    cuda_check(kernels::quest_select(qp, stream), "GPU quest: page selection");
  }
  // 3. The selected K/V rows, packed as the predicted path's held tables are.
  kernels::GatherKvParams gp;
  gp.k_cache = s.k_cache;
  gp.v_cache = s.v_cache;
  gp.block_table = b.block_table;
  gp.indices = st.indices.as<int32_t>();
  gp.packed_k = st.packed_k();
  gp.packed_v = st.packed_v();
  gp.kv_shape() = shape;
  gp.k = st.k;
  cuda_check(kernels::gather_kv(gp, stream), name);
  // 4. Attention: the selection + the local window for sparse rows, the whole context for the others.
  kernels::SparsePackedDecodeParams a;
  a.packed_k = st.packed_k();
  a.packed_v = st.packed_v();
  a.num_packed = st.arr(0);
  a.local_windows = st.arr(1);
  a.packed_capacity = st.k;
  a.workspace = {st.ws.get(), st.ws.bytes()};
  attend_packed_rows(a, st.cfg, s, b, st.page_size, st.R, st.arr(2), st.arr(3), stream, name);
}

}  // namespace spade
