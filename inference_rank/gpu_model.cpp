// GPU forward pass of the inference rank (inference_rank/gpu_model.h).
#include "inference_rank/gpu_model.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "kernels/attention.cuh"
#include "kernels/gdn.cuh"
#include "kernels/gemm.cuh"
#include "kernels/head_dims.cuh"
#include "kernels/hybrid_ops.cuh"
#include "kernels/layer_ops.cuh"
#include "kernels/tensor_ops.cuh"

namespace spade {

// ---------------------------------------------------------------------------------------------------------------
// GpuStepBuffers: one int32 arena [tokens | positions | seq_idx | cu_q_lens | seq_lens | block_table | logit_rows |
// error_flag], uploaded with a single copy.
// ---------------------------------------------------------------------------------------------------------------

GpuStepBuffers::GpuStepBuffers(int max_tokens, int max_batch, int max_pages, int max_logit_rows, int num_pages,
                               int num_state_slots)
    : max_tokens_(max_tokens), max_batch_(max_batch), max_pages_(max_pages), max_logit_rows_(max_logit_rows),
      num_pages_(num_pages), num_state_slots_(num_state_slots) {
  SPADE_CHECK(max_tokens > 0 && max_batch > 0 && max_pages > 0 && max_logit_rows > 0 && num_pages > 0 &&
                  num_state_slots >= 0,
              "GpuStepBuffers: every bound must be positive");
  cuda_check(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming), "step buffers: event");
  words_ = 3 * static_cast<size_t>(max_tokens) + 3 * static_cast<size_t>(max_batch) + 1 +
           static_cast<size_t>(max_batch) * max_pages + max_logit_rows + 1;
  dev_ = DeviceBuffer(words_ * 4, "step buffers");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&pinned_), words_ * 4), "step buffers: cudaMallocHost");
}
GpuStepBuffers::~GpuStepBuffers() {
  if (copied_ != nullptr) {
    cudaEventSynchronize(copied_);
    cudaEventDestroy(copied_);
  }
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
}
int32_t* GpuStepBuffers::error_flag() const { return dev_.as<int32_t>() + words_ - 1; }

GpuBatch GpuStepBuffers::upload(const GpuStepHost& h, cudaStream_t stream) {
  const int T = static_cast<int>(h.tokens.size());
  const int B = static_cast<int>(h.seq_lens.size());
  const int R = static_cast<int>(h.logit_rows.size());
  SPADE_CHECK(T >= 1 && T <= max_tokens_, "step: {} tokens (this rank's buffers hold 1..{})", T, max_tokens_);
  SPADE_CHECK(B >= 1 && B <= max_batch_, "step: batch of {} (buffers hold 1..{})", B, max_batch_);
  SPADE_CHECK(R <= max_logit_rows_, "step: {} logit rows (buffers hold {})", R, max_logit_rows_);
  SPADE_CHECK(h.max_pages >= 1 && h.max_pages <= max_pages_, "step: max_pages {} (buffers hold 1..{})", h.max_pages,
              max_pages_);
  SPADE_CHECK(static_cast<int>(h.positions.size()) == T && static_cast<int>(h.seq_idx.size()) == T,
              "step: positions / seq_idx must have one entry per token ({})", T);
  SPADE_CHECK(static_cast<int>(h.cu_q_lens.size()) == B + 1 && h.cu_q_lens.front() == 0 && h.cu_q_lens.back() == T,
              "step: cu_q_lens must have batch + 1 = {} entries from 0 to {}", B + 1, T);
  SPADE_CHECK(h.block_table.size() == static_cast<size_t>(B) * h.max_pages, "step: block_table must be {} x {}", B,
              h.max_pages);
  int max_q = 0, max_len = 0;
  for (int b = 0; b < B; ++b) {
    const int q = h.cu_q_lens[b + 1] - h.cu_q_lens[b];
    SPADE_CHECK(q >= 1 && q <= h.seq_lens[b], "step: sequence {} has {} query tokens for context {}", b, q,
                h.seq_lens[b]);
    max_q = std::max(max_q, q);
    max_len = std::max(max_len, h.seq_lens[b]);
  }
  for (int r : h.logit_rows) SPADE_CHECK(r >= 0 && r < T, "step: logit row {} outside the {} tokens", r, T);
  for (int t = 0; t < T; ++t)
    SPADE_CHECK(h.seq_idx[t] >= 0 && h.seq_idx[t] < B, "step: token {} names sequence {} of a batch of {}", t,
                h.seq_idx[t], B);
  for (size_t i = 0; i < h.block_table.size(); ++i)
    SPADE_CHECK(h.block_table[i] >= -1 && h.block_table[i] < num_pages_,
                "step: block_table[{}][{}] = {} is not a page of the pool (0..{}, or -1)", i / h.max_pages,
                i % h.max_pages, h.block_table[i], num_pages_ - 1);
  SPADE_CHECK(h.max_seq_len == 0 || h.max_seq_len >= max_len, "step: max_seq_len {} below the longest context {}",
              h.max_seq_len, max_len);
  if (num_state_slots_ > 0) {
    SPADE_CHECK(static_cast<int>(h.state_slots.size()) == B, "step: {} state slots for a batch of {} (hybrid model)",
                h.state_slots.size(), B);
    std::vector<int32_t> seen;
    for (int b = 0; b < B; ++b) {
      SPADE_CHECK(h.state_slots[b] >= -1 && h.state_slots[b] < num_state_slots_,
                  "step: sequence {} names state slot {} (the pools hold 0..{}; -1 = padding)", b, h.state_slots[b],
                  num_state_slots_ - 1);
      if (h.state_slots[b] >= 0) seen.push_back(h.state_slots[b]);
    }
    std::sort(seen.begin(), seen.end());
    SPADE_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(),
                "step: two sequences share a state slot");
  } else {
    SPADE_CHECK(h.state_slots.empty(), "step: state slots given for a model without GDN layers");
  }

  if (pending_) cuda_check(cudaEventSynchronize(copied_), "step upload: previous copy");
  int32_t* p = pinned_;
  auto put = [&](const std::vector<int32_t>& v, size_t cap) {
    if (!v.empty()) std::memcpy(p, v.data(), v.size() * 4);
    int32_t* at = p;
    p += cap;
    return static_cast<size_t>(at - pinned_);
  };
  const size_t o_tok = put(h.tokens, max_tokens_), o_pos = put(h.positions, max_tokens_),
               o_sidx = put(h.seq_idx, max_tokens_), o_cu = put(h.cu_q_lens, max_batch_ + 1),
               o_len = put(h.seq_lens, max_batch_), o_bt = put(h.block_table, static_cast<size_t>(max_batch_) * max_pages_),
               o_lr = put(h.logit_rows, max_logit_rows_), o_ss = put(h.state_slots, max_batch_);
  pinned_[words_ - 1] = 0;  // error flag
  cuda_check(cudaMemcpyAsync(dev_.get(), pinned_, words_ * 4, cudaMemcpyHostToDevice, stream), "step upload");
  cuda_check(cudaEventRecord(copied_, stream), "step upload");
  pending_ = true;
  const int32_t* d = dev_.as<int32_t>();
  GpuBatch g;
  g.tokens = d + o_tok;
  g.positions = d + o_pos;
  g.seq_idx = d + o_sidx;
  g.cu_q_lens = d + o_cu;
  g.seq_lens = d + o_len;
  g.block_table = d + o_bt;
  g.logit_rows = d + o_lr;
  g.state_slots = num_state_slots_ > 0 ? d + o_ss : nullptr;
  g.error_flag = error_flag();
  g.num_tokens = T;
  g.batch = B;
  g.max_pages = h.max_pages;
  g.num_logit_rows = R;
  g.max_q_len = max_q;
  g.max_seq_len = h.max_seq_len > 0 ? h.max_seq_len : max_len;
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// GpuDenseAttention
// ---------------------------------------------------------------------------------------------------------------

GpuDenseAttention::GpuDenseAttention(const ModelConfig& cfg, int page_size, int max_batch)
    : cfg_(cfg), page_size_(page_size), max_batch_(max_batch) {
  // Every attention kernel's shared-memory limit now, not at its first launch (kernels/attention.cuh: a first
  // launch while a cache rank's receive is pending in this process would stall on cudaFuncSetAttribute).
  cuda_check(kernels::prepare_decode_attention_kernels(), "decode attention kernels: set-up");
  cuda_check(kernels::prepare_prefill_attention_kernels(), "prefill attention kernels: set-up");
  workspace_ = DeviceBuffer(kernels::decode_workspace_bytes(max_batch, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim),
                            "decode workspace");
  cuda_check(kernels::decode_workspace_init({workspace_.get(), workspace_.bytes()}, nullptr), "decode workspace init");
  cuda_check(cudaDeviceSynchronize(), "decode workspace init");
}

void GpuDenseAttention::attend(const GpuLayerStep& s, const GpuBatch& b, cudaStream_t stream) {
  if (b.decode_only()) {
    SPADE_CHECK(b.batch <= max_batch_, "dense attention: batch {} above the workspace's {}", b.batch, max_batch_);
    kernels::PagedDecodeParams p;
    fill_attention_params(p, cfg_, s, b, page_size_);
    p.max_seq_len = b.max_seq_len;
    p.workspace = {workspace_.get(), workspace_.bytes()};
    cuda_check(kernels::paged_decode_attention(p, stream), "dense paged decode attention");
    return;
  }
  kernels::PagedPrefillParams p;
  fill_attention_params(p, cfg_, s, b, page_size_);
  p.cu_q_lens = b.cu_q_lens;
  p.max_q_len = b.max_q_len;
  cuda_check(kernels::paged_prefill_attention(p, stream), "dense paged prefill attention");
}

void attend_packed_rows(kernels::SparsePackedDecodeParams& a, const ModelConfig& cfg, const GpuLayerStep& s,
                        const GpuBatch& b, int page_size, int local_window, const int32_t* q_rows,
                        const int32_t* skip, cudaStream_t stream, const char* what) {
  fill_attention_params(a, cfg, s, b, page_size);
  if (b.decode_only()) {
    a.local_window = std::max(b.max_seq_len, local_window);  // the bound of the per-sequence windows
  } else {
    kernels::PagedPrefillParams pf;
    fill_attention_params(pf, cfg, s, b, page_size);
    pf.cu_q_lens = b.cu_q_lens;
    pf.max_q_len = b.max_q_len;
    pf.skip = skip;
    const cudaError_t e = kernels::paged_prefill_attention(pf, stream);
    if (e != cudaSuccess) cuda_check(e, fmt::format("{}: prefill attention of a mixed step", what).c_str());
    a.q_rows = q_rows;
    a.local_window = local_window;  // sparse and window-only rows: windows <= R
  }
  const cudaError_t e = kernels::sparse_decode_attention_packed(a, stream);
  if (e != cudaSuccess) cuda_check(e, fmt::format("{}: attention", what).c_str());  // formatted on failure only
}

// ---------------------------------------------------------------------------------------------------------------
// GpuModel
// ---------------------------------------------------------------------------------------------------------------

struct GpuModel::Gemm {
  kernels::GemmRunner runner;
};

namespace {

void check_supported(const ModelConfig& cfg) {
  SPADE_CHECK(kernels::is_supported_head_dim(cfg.head_dim),
              "GPU path: head_dim {} of model '{}' is not compiled into the attention kernels (64, 128, 256)",
              cfg.head_dim, cfg.model_type);
  SPADE_CHECK(cfg.num_kv_heads > 0 && cfg.num_q_heads % cfg.num_kv_heads == 0 &&
                  cfg.gqa_group() <= kernels::kMaxGqaGroup,
              "GPU path: GQA group {} / {} unsupported (1..{})", cfg.num_q_heads, cfg.num_kv_heads,
              kernels::kMaxGqaGroup);
  SPADE_CHECK(cfg.hidden_size % 8 == 0 && cfg.intermediate_size % 8 == 0,
              "GPU path: hidden / intermediate sizes must be multiples of 8 (16-byte rows for cuBLASLt)");
  if (cfg.is_hybrid()) {
    const int dk = cfg.linear_key_head_dim, dv = cfg.linear_value_head_dim;
    bool dims_ok = dk == dv;
    bool compiled = false;
    for (int d : kernels::kGdnHeadDims) compiled = compiled || d == dk;
    SPADE_CHECK(dims_ok && compiled,
                "GPU path: model '{}' has Gated DeltaNet head dims k {} / v {}; the GDN kernels run equal dims of 64 "
                "or 128 (use the CPU path)",
                cfg.model_type, dk, dv);
    SPADE_CHECK(cfg.linear_conv_kernel_dim >= 1 && cfg.linear_conv_kernel_dim <= kernels::kMaxConvKernel,
                "GPU path: conv kernel width {} outside 1..{}", cfg.linear_conv_kernel_dim, kernels::kMaxConvKernel);
    SPADE_CHECK(cfg.linear_num_key_heads > 0 && cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0,
                "GPU path: {} GDN value heads are not a multiple of {} key heads", cfg.linear_num_value_heads,
                cfg.linear_num_key_heads);
    SPADE_CHECK(cfg.num_attention_layers() >= 1, "GPU path: model '{}' has no full-attention layer", cfg.model_type);
  }
}

constexpr size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// Rows of a full-attention layer's fused projection: q | k | v (| the output gate, Qwen3.5).
size_t qkv_rows_of(const ModelConfig& cfg) {
  return cfg.q_dim() + 2 * static_cast<size_t>(cfg.kv_dim()) + (cfg.attn_output_gate ? cfg.q_dim() : 0);
}
// Rows of a GDN layer's fused input projection: q | k | v (conv_dim) | z (value_dim) | b (Hv) | a (Hv).
size_t gdn_proj_rows_of(const ModelConfig& cfg) {
  return static_cast<size_t>(cfg.linear_conv_dim()) + cfg.linear_value_dim() + 2 * static_cast<size_t>(cfg.linear_num_value_heads);
}

}  // namespace

GpuModel::GpuModel(const ModelConfig& cfg, GpuModelOptions opts) : cfg_(cfg), opts_(opts) {
  check_supported(cfg_);
  SPADE_CHECK(opts.max_tokens > 0 && opts.max_logit_rows > 0, "GpuModelOptions: bounds must be positive");
  SPADE_CHECK(!cfg_.is_hybrid() || opts.max_state_slots >= 1,
              "GpuModelOptions: model '{}' has Gated DeltaNet layers and needs max_state_slots >= 1", cfg_.model_type);
  SPADE_CHECK(!cfg_.is_hybrid() || opts.max_tokens <= 65535,
              "GpuModelOptions: max_tokens {} > 65535, the most tokens a hybrid step's conv1d launch covers",
              opts.max_tokens);
  gemm_ = std::make_unique<Gemm>();
  cuda_check(gemm_->runner.init(), "cuBLASLt init");
}
GpuModel::~GpuModel() = default;

void GpuModel::allocate_weights() {
  const size_t H = cfg_.hidden_size, I = cfg_.intermediate_size, D = cfg_.head_dim, V = cfg_.vocab_size;
  const size_t qkv_rows = qkv_rows_of(cfg_);
  const bool qkv_bias = cfg_.attention_bias;
  const size_t C = cfg_.linear_conv_dim(), K = cfg_.linear_conv_kernel_dim, Hv = cfg_.linear_num_value_heads;
  const size_t VD = cfg_.linear_value_dim(), dv = cfg_.linear_value_head_dim;
  // Layout pass: offsets in one arena.
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  struct Off {
    size_t attn_norm = SIZE_MAX, mlp_norm = SIZE_MAX, q_norm = SIZE_MAX, k_norm = SIZE_MAX, qkv_w = SIZE_MAX,
           qkv_b = SIZE_MAX, o_w = SIZE_MAX, o_b = SIZE_MAX, gu_w = SIZE_MAX, gu_b = SIZE_MAX, down_w = SIZE_MAX,
           down_b = SIZE_MAX, in_proj = SIZE_MAX, conv = SIZE_MAX, a_log = SIZE_MAX, dt_bias = SIZE_MAX,
           gnorm = SIZE_MAX, out_proj = SIZE_MAX;
  };
  std::vector<Off> offs(static_cast<size_t>(cfg_.num_layers));
  const size_t embed_off = take(V * H * 2);
  const size_t lm_off = cfg_.tie_word_embeddings ? embed_off : take(V * H * 2);
  const size_t final_off = take(H * 4);
  for (size_t l = 0; l < offs.size(); ++l) {
    Off& o = offs[l];
    o.attn_norm = take(H * 4);
    o.mlp_norm = take(H * 4);
    if (cfg_.layer_type(static_cast<int>(l)) == LayerType::LinearAttention) {
      o.in_proj = take(gdn_proj_rows_of(cfg_) * H * 2);
      o.conv = take(C * K * 4);
      o.a_log = take(Hv * 4);
      o.dt_bias = take(Hv * 4);
      o.gnorm = take(dv * 4);
      o.out_proj = take(H * VD * 2);
    } else {
      o.q_norm = cfg_.qk_norm ? take(D * 4) : SIZE_MAX;
      o.k_norm = cfg_.qk_norm ? take(D * 4) : SIZE_MAX;
      o.qkv_w = take(qkv_rows * H * 2);
      o.qkv_b = qkv_bias ? take(qkv_rows * 2) : SIZE_MAX;
      o.o_w = take(H * cfg_.q_dim() * 2);
      o.o_b = cfg_.o_proj_bias ? take(H * 2) : SIZE_MAX;
    }
    o.gu_w = take(2 * I * H * 2);
    o.gu_b = cfg_.mlp_bias ? take(2 * I * 2) : SIZE_MAX;
    o.down_w = take(H * I * 2);
    o.down_b = cfg_.mlp_bias ? take(H * 2) : SIZE_MAX;
  }
  weights_ = DeviceBuffer(off, "model weights");
  weight_bytes_ = off;
  untied_embed_bytes_ = cfg_.tie_word_embeddings ? 0 : align256(V * H * 2);
  char* base = weights_.as<char>();
  auto at = [&](size_t o) -> void* { return o == SIZE_MAX ? nullptr : base + o; };
  embed_ = at(embed_off);
  lm_head_ = at(lm_off);
  final_norm_ = static_cast<float*>(at(final_off));
  // Each layer tensor's offset and the Layer pointer it becomes (nullptr where the offset is SIZE_MAX: absent).
  static constexpr std::pair<size_t Off::*, float* Layer::*> kF32Tensors[] = {
      {&Off::attn_norm, &Layer::attn_norm}, {&Off::mlp_norm, &Layer::mlp_norm}, {&Off::q_norm, &Layer::q_norm},
      {&Off::k_norm, &Layer::k_norm},       {&Off::conv, &Layer::conv_w},       {&Off::a_log, &Layer::a_log},
      {&Off::dt_bias, &Layer::dt_bias},     {&Off::gnorm, &Layer::gated_norm}};
  static constexpr std::pair<size_t Off::*, void* Layer::*> kBf16Tensors[] = {
      {&Off::qkv_w, &Layer::qkv_w},     {&Off::qkv_b, &Layer::qkv_b},         {&Off::o_w, &Layer::o_w},
      {&Off::o_b, &Layer::o_b},         {&Off::in_proj, &Layer::in_proj_w},   {&Off::out_proj, &Layer::out_proj_w},
      {&Off::gu_w, &Layer::gate_up_w},  {&Off::gu_b, &Layer::gate_up_b},      {&Off::down_w, &Layer::down_w},
      {&Off::down_b, &Layer::down_b}};
  layers_.resize(offs.size());
  int attn_idx = 0, gdn_idx = 0;
  for (size_t l = 0; l < offs.size(); ++l) {
    const Off& o = offs[l];
    Layer& L = layers_[l];
    L.type = cfg_.layer_type(static_cast<int>(l));
    L.index = L.type == LayerType::LinearAttention ? gdn_idx++ : attn_idx++;
    for (const auto& [field, ptr] : kF32Tensors) L.*ptr = static_cast<float*>(at(o.*field));
    for (const auto& [field, ptr] : kBf16Tensors) L.*ptr = at(o.*field);
  }
}

void GpuModel::allocate_activations() {
  const size_t T = opts_.max_tokens, R = opts_.max_logit_rows, H = cfg_.hidden_size, I = cfg_.intermediate_size;
  residual_ = DeviceBuffer(T * H * 4, "activations (residual)");
  x_ = DeviceBuffer(T * H * 2, "activations");
  h_ = DeviceBuffer(T * H * 2, "activations");
  qkv_ = DeviceBuffer(T * qkv_rows_of(cfg_) * 2, "activations (qkv)");
  q_ = DeviceBuffer(T * cfg_.q_dim() * 2, "activations (q)");
  attn_ = DeviceBuffer(T * cfg_.q_dim() * 2, "activations (attention)");
  gate_up_ = DeviceBuffer(T * 2 * I * 2, "activations (gate/up)");
  act_ = DeviceBuffer(T * I * 2, "activations (SwiGLU)");
  sel_ = DeviceBuffer(R * H * 2, "activations (logit rows)");
  logits_ = DeviceBuffer(R * static_cast<size_t>(cfg_.vocab_size) * 4, "logits");
  if (!cfg_.is_hybrid()) return;
  const size_t KD = cfg_.linear_key_dim(), VD = cfg_.linear_value_dim(), Hv = cfg_.linear_num_value_heads;
  const size_t C = cfg_.linear_conv_dim(), K = cfg_.linear_conv_kernel_dim, S = opts_.max_state_slots;
  const size_t G = cfg_.num_linear_layers();
  gproj_ = DeviceBuffer(T * gdn_proj_rows_of(cfg_) * 2, "activations (GDN in_proj)");
  gq_ = DeviceBuffer(T * KD * 2, "activations (GDN q)");
  gk_ = DeviceBuffer(T * KD * 2, "activations (GDN k)");
  gv_ = DeviceBuffer(T * VD * 2, "activations (GDN v)");
  gbeta_ = DeviceBuffer(T * Hv * 4, "activations (GDN beta)");
  gg_ = DeviceBuffer(T * Hv * 4, "activations (GDN g)");
  gcore_ = DeviceBuffer(T * VD * 2, "activations (GDN output)");
  gnormed_ = DeviceBuffer(T * VD * 2, "activations (GDN gated norm)");
  if (K > 1) conv_pool_ = DeviceBuffer(G * S * C * (K - 1) * 4, "GDN conv states");
  rec_pool_ = DeviceBuffer(G * S * Hv * cfg_.linear_key_head_dim * cfg_.linear_value_head_dim * 4,
                           "GDN recurrent states");
  cuda_check(cudaMemset(rec_pool_.get(), 0, rec_pool_.bytes()), "GDN state init");
  if (conv_pool_.get() != nullptr) cuda_check(cudaMemset(conv_pool_.get(), 0, conv_pool_.bytes()), "GDN state init");
}

std::unique_ptr<GpuModel> GpuModel::upload(const ModelConfig& cfg, const ModelWeights& w, GpuModelOptions opts) {
  std::unique_ptr<GpuModel> m(new GpuModel(cfg, opts));
  SPADE_CHECK(static_cast<int>(w.layers.size()) == cfg.num_layers, "GPU upload: {} layers of weights for {}",
              w.layers.size(), cfg.num_layers);
  m->allocate_weights();
  m->allocate_activations();
  std::vector<uint16_t> tmp;
  const size_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim, V = cfg.vocab_size;
  const size_t qkv_rows = qkv_rows_of(cfg);
  auto check_size = [&](const std::vector<float>& src, size_t want, const char* name) {
    SPADE_CHECK(src.size() == want, "GPU upload: tensor {} has {} elements, model '{}' needs {}", name, src.size(),
                cfg.model_type, want);
  };
  size_t want = 0;  // expected elements of the tensor put next
  auto put16 = [&](void* dst, const std::vector<float>& src, const char* name) {
    if (dst == nullptr) return;
    check_size(src, want, name);
    tmp.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) tmp[i] = f32_to_bf16(src[i]);
    cuda_check(cudaMemcpy(dst, tmp.data(), tmp.size() * 2, cudaMemcpyHostToDevice), name);
  };
  auto put32 = [&](float* dst, const std::vector<float>& src, const char* name) {
    if (dst == nullptr) return;
    check_size(src, want, name);
    cuda_check(cudaMemcpy(dst, src.data(), src.size() * 4, cudaMemcpyHostToDevice), name);
  };
  want = V * H;
  put16(m->embed_, w.embed, "embed_tokens");
  if (!cfg.tie_word_embeddings) put16(m->lm_head_, w.lm_head, "lm_head");
  want = H;
  put32(m->final_norm_, w.final_norm, "model.norm");
  for (int l = 0; l < cfg.num_layers; ++l) {
    const LayerWeights& s = w.layers[static_cast<size_t>(l)];
    Layer& d = m->layers_[static_cast<size_t>(l)];
    SPADE_CHECK(s.type == d.type, "GPU upload: layer {} of the weights is {}, the config says {}", l,
                layer_type_name(s.type), layer_type_name(d.type));
    want = H;
    put32(d.attn_norm, s.attn_norm, "input_layernorm");
    put32(d.mlp_norm, s.mlp_norm, "post_attention_layernorm");
    if (d.type == LayerType::LinearAttention) {
      want = gdn_proj_rows_of(cfg) * H;
      put16(d.in_proj_w, s.in_proj_w, "linear_attn.in_proj");
      want = static_cast<size_t>(cfg.linear_conv_dim()) * cfg.linear_conv_kernel_dim;
      put32(d.conv_w, s.conv1d_w, "linear_attn.conv1d");
      want = cfg.linear_num_value_heads;
      put32(d.a_log, s.A_log, "linear_attn.A_log");
      put32(d.dt_bias, s.dt_bias, "linear_attn.dt_bias");
      want = cfg.linear_value_head_dim;
      put32(d.gated_norm, s.gated_norm, "linear_attn.norm");
      want = H * cfg.linear_value_dim();
      put16(d.out_proj_w, s.out_proj_w, "linear_attn.out_proj");
    } else {
      want = D;
      put32(d.q_norm, s.q_norm, "q_norm");
      put32(d.k_norm, s.k_norm, "k_norm");
      want = qkv_rows * H;
      put16(d.qkv_w, s.qkv_w, "qkv_proj");
      want = qkv_rows;
      put16(d.qkv_b, s.qkv_b, "qkv bias");
      want = H * cfg.q_dim();
      put16(d.o_w, s.o_w, "o_proj");
      want = H;
      put16(d.o_b, s.o_b, "o_proj bias");
    }
    want = 2 * I * H;
    put16(d.gate_up_w, s.gate_up_w, "gate_up_proj");
    want = 2 * I;
    put16(d.gate_up_b, s.gate_up_b, "gate_up bias");
    want = H * I;
    put16(d.down_w, s.down_w, "down_proj");
    want = H;
    put16(d.down_b, s.down_b, "down_proj bias");
  }
  return m;
}

std::unique_ptr<GpuModel> GpuModel::random(const ModelConfig& cfg, uint64_t seed, GpuModelOptions opts) {
  std::unique_ptr<GpuModel> m(new GpuModel(cfg, opts));
  m->allocate_weights();
  m->allocate_activations();
  uint64_t tensor = 0;
  auto fill = [&](void* p, DType dt, size_t n, float scale, float offset) {
    if (p == nullptr) return;
    ++tensor;
    cuda_check(kernels::random_fill({dt, p, n, seed * 0x100000001B3ull + tensor * 0x9E3779B97F4A7C15ull, scale, offset},
                                    nullptr),
               "random weights");
  };
  const size_t H = cfg.hidden_size, I = cfg.intermediate_size, D = cfg.head_dim, V = cfg.vocab_size;
  const size_t qkv_rows = qkv_rows_of(cfg);
  const float u = 1.f / std::sqrt(3.f);  // scale of a unit-variance uniform fill giving a half-width of 1
  fill(m->embed_, DType::BF16, V * H, 1.f, 0.f);
  if (!cfg.tie_word_embeddings) fill(m->lm_head_, DType::BF16, V * H, 1.f / std::sqrt(float(H)), 0.f);
  fill(m->final_norm_, DType::F32, H, 0.1f, 1.f);
  for (Layer& L : m->layers_) {
    fill(L.attn_norm, DType::F32, H, 0.1f, 1.f);
    fill(L.mlp_norm, DType::F32, H, 0.1f, 1.f);
    fill(L.q_norm, DType::F32, D, 0.1f, 1.f);
    fill(L.k_norm, DType::F32, D, 0.1f, 1.f);
    fill(L.qkv_w, DType::BF16, qkv_rows * H, 1.f / std::sqrt(float(H)), 0.f);
    fill(L.qkv_b, DType::BF16, qkv_rows, 0.1f, 0.f);
    fill(L.o_w, DType::BF16, H * cfg.q_dim(), 1.f / std::sqrt(float(cfg.q_dim())), 0.f);
    fill(L.o_b, DType::BF16, H, 0.1f, 0.f);
    if (L.type == LayerType::LinearAttention) {
      const size_t K = cfg.linear_conv_kernel_dim, Hv = cfg.linear_num_value_heads;
      fill(L.in_proj_w, DType::BF16, gdn_proj_rows_of(cfg) * H, 1.f / std::sqrt(float(H)), 0.f);
      fill(L.conv_w, DType::F32, static_cast<size_t>(cfg.linear_conv_dim()) * K, 1.f / std::sqrt(float(K)), 0.f);
      // A_log uniform in [log 0.01, log 16] (transformers' init range), dt_bias 1 + 0.1 u.
      fill(L.a_log, DType::F32, Hv, u * 0.5f * (std::log(16.f) - std::log(0.01f)),
           0.5f * (std::log(16.f) + std::log(0.01f)));
      fill(L.dt_bias, DType::F32, Hv, 0.1f, 1.f);
      fill(L.gated_norm, DType::F32, cfg.linear_value_head_dim, 0.1f, 1.f);
      fill(L.out_proj_w, DType::BF16, H * cfg.linear_value_dim(), 1.f / std::sqrt(float(cfg.linear_value_dim())), 0.f);
    }
    fill(L.gate_up_w, DType::BF16, 2 * I * H, 1.f / std::sqrt(float(H)), 0.f);
    fill(L.gate_up_b, DType::BF16, 2 * I, 0.1f, 0.f);
    fill(L.down_w, DType::BF16, H * I, 1.f / std::sqrt(float(I)), 0.f);
    fill(L.down_b, DType::BF16, H, 0.1f, 0.f);
  }
  cuda_check(cudaDeviceSynchronize(), "random weights");
  return m;
}

int GpuModel::warm_up_gemms(cudaStream_t stream) {
  const int T = opts_.max_tokens, R = opts_.max_logit_rows, H = cfg_.hidden_size, I = cfg_.intermediate_size;
  int total = 0;
  auto warm = [&](const void* x, const void* w, const void* bias, void* y, int max_m, int n, int k, DType out,
                  const char* what) {
    const kernels::GemmParams g{.out_dtype = out, .x = x, .w = w, .bias = bias, .y = y, .n = n, .k = k};
    int launched = 0;
    cuda_check(gemm_->runner.warm_up_rows(g, max_m, stream, &launched), what);
    total += launched;
  };
  bool gdn_done = false, attn_done = false;
  for (const Layer& L : layers_) {  // the shapes (and biases) of the first layer of each kind
    if (L.type == LayerType::LinearAttention && !gdn_done) {
      warm(h_.get(), L.in_proj_w, nullptr, gproj_.get(), T, static_cast<int>(gdn_proj_rows_of(cfg_)), H, DType::BF16,
           "warm-up: linear_attn.in_proj");
      warm(gnormed_.get(), L.out_proj_w, nullptr, x_.get(), T, H, cfg_.linear_value_dim(), DType::BF16,
           "warm-up: linear_attn.out_proj");
      gdn_done = true;
    } else if (L.type != LayerType::LinearAttention && !attn_done) {
      warm(h_.get(), L.qkv_w, L.qkv_b, qkv_.get(), T, static_cast<int>(qkv_rows_of(cfg_)), H, DType::BF16,
           "warm-up: qkv_proj");
      warm(attn_.get(), L.o_w, L.o_b, x_.get(), T, H, cfg_.q_dim(), DType::BF16, "warm-up: o_proj");
      attn_done = true;
    }
  }
  const Layer& L0 = layers_.front();
  warm(h_.get(), L0.gate_up_w, L0.gate_up_b, gate_up_.get(), T, 2 * I, H, DType::BF16, "warm-up: gate_up_proj");
  warm(act_.get(), L0.down_w, L0.down_b, x_.get(), T, H, I, DType::BF16, "warm-up: down_proj");
  warm(sel_.get(), lm_head_, nullptr, logits_.get(), R, cfg_.vocab_size, H, DType::F32, "warm-up: lm_head");
  cuda_check(cudaStreamSynchronize(stream), "GEMM warm-up");
  return total;
}

void GpuModel::forward(const GpuBatch& b, GpuKvPool& kv, GpuAttention& attention, cudaStream_t stream) {
  SPADE_CHECK(b.num_tokens >= 1 && b.num_tokens <= opts_.max_tokens, "GPU forward: {} tokens (buffers hold 1..{})",
              b.num_tokens, opts_.max_tokens);
  SPADE_CHECK(b.num_logit_rows <= opts_.max_logit_rows, "GPU forward: {} logit rows (buffers hold {})",
              b.num_logit_rows, opts_.max_logit_rows);
  const int attn_layers = cfg_.num_attention_layers();
  SPADE_CHECK(kv.num_layers() == attn_layers && kv.num_kv_heads() == cfg_.num_kv_heads &&
                  kv.head_dim() == cfg_.head_dim,
              "GPU forward: KV pool geometry (layers {}, KV heads {}, head_dim {}) does not match model '{}' ({} "
              "full-attention layers, {}, {})",
              kv.num_layers(), kv.num_kv_heads(), kv.head_dim(), cfg_.model_type, attn_layers, cfg_.num_kv_heads,
              cfg_.head_dim);
  SPADE_CHECK(static_cast<long long>(b.max_seq_len) <= static_cast<long long>(b.max_pages) * kv.page_size(),
              "GPU forward: max_seq_len {} exceeds the block table's reach ({} pages of {} tokens)", b.max_seq_len,
              b.max_pages, kv.page_size());
  const bool hybrid = cfg_.is_hybrid();
  SPADE_CHECK(!hybrid || b.state_slots != nullptr, "GPU forward: model '{}' has Gated DeltaNet layers and the step "
              "has no state_slots", cfg_.model_type);
  const int T = b.num_tokens, H = cfg_.hidden_size, I = cfg_.intermediate_size;
  const int qkv_cols = static_cast<int>(qkv_rows_of(cfg_));
  auto gemm = [&](const void* x, const void* w, const void* bias, void* y, int m, int n, int k, DType out,
                  const char* what) {
    const kernels::GemmParams g{.out_dtype = out, .x = x, .w = w, .bias = bias, .y = y, .m = m, .n = n, .k = k};
    cuda_check(gemm_->runner.run(g, stream), what);
  };
  auto norm = [&](const void* x, const float* w, void* out, bool add_residual, int rows, const char* what) {
    kernels::RmsNormParams p;
    p.x = x;
    p.weight = w;
    p.weight_dtype = DType::F32;
    p.out = out;
    p.residual = add_residual ? residual_.get() : nullptr;
    p.residual_dtype = DType::F32;
    p.rows = rows;
    p.dim = H;
    p.eps = cfg_.rms_norm_eps;
    cuda_check(kernels::rmsnorm(p, stream), what);
  };

  // Embedding -> x; the residual stream starts at zero and the first fused norm adds x into it.
  kernels::EmbeddingParams e;
  e.token_ids = b.tokens;
  e.table = embed_;
  e.out = x_.get();
  e.error_flag = b.error_flag;
  e.num_tokens = T;
  e.vocab_size = cfg_.vocab_size;
  e.hidden = H;
  cuda_check(kernels::embedding_gather(e, stream), "embedding");
  cuda_check(cudaMemsetAsync(residual_.get(), 0, static_cast<size_t>(T) * H * 4, stream), "residual reset");

  // GDN geometry and the reset of the states of sequences that start in this step.
  const int C = cfg_.linear_conv_dim(), KD = cfg_.linear_key_dim(), VD = cfg_.linear_value_dim();
  const int Hv = cfg_.linear_num_value_heads, dv = cfg_.linear_value_head_dim, K = cfg_.linear_conv_kernel_dim;
  const int P = hybrid ? static_cast<int>(gdn_proj_rows_of(cfg_)) : 0;
  const size_t conv_elems = hybrid && K > 1 ? static_cast<size_t>(C) * (K - 1) : 0;
  const size_t rec_elems = hybrid ? static_cast<size_t>(Hv) * cfg_.linear_key_head_dim * dv : 0;
  const int S = opts_.max_state_slots;
  if (hybrid) {
    kernels::GdnResetStatesParams rs;
    rs.conv_pool = conv_pool_.as<float>();
    rs.conv_elems = conv_elems;
    rs.recurrent_pool = rec_pool_.as<float>();
    rs.recurrent_elems = rec_elems;
    rs.layers = cfg_.num_linear_layers();
    rs.num_state_slots = S;
    rs.state_slots = b.state_slots;
    rs.cu_tokens = b.cu_q_lens;
    rs.seq_lens = b.seq_lens;
    rs.batch = b.batch;
    cuda_check(kernels::gdn_reset_states(rs, stream), "GDN state reset");
  }

  for (int l = 0; l < cfg_.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    norm(x_.get(), L.attn_norm, h_.get(), true, T, "input_layernorm");
    if (L.type == LayerType::LinearAttention) {
      // Gated DeltaNet (transformers Qwen3_5GatedDeltaNet.forward; inference_rank/model.cpp gdn_layer).
      gemm(h_.get(), L.in_proj_w, nullptr, gproj_.get(), T, P, H, DType::BF16, "linear_attn.in_proj");
      const uint16_t* proj = gproj_.as<uint16_t>();
      kernels::GdnGatingParams gp;
      gp.b = proj + C + VD;
      gp.a = proj + C + VD + Hv;
      gp.stride = P;
      gp.a_log = L.a_log;
      gp.dt_bias = L.dt_bias;
      gp.beta = gbeta_.as<float>();
      gp.g = gg_.as<float>();
      gp.tokens = T;
      gp.num_v_heads = Hv;
      cuda_check(kernels::gdn_gating(gp, stream), "GDN gating");
      kernels::CausalConv1dGpuParams cp;
      cp.x = proj;
      cp.x_stride = P;
      cp.weight = L.conv_w;
      cp.out[0] = gq_.get();
      cp.out[1] = gk_.get();
      cp.out[2] = gv_.get();
      cp.split[0] = KD;
      cp.split[1] = 2 * KD;
      cp.state_pool = conv_elems > 0 ? conv_pool_.as<float>() + static_cast<size_t>(L.index) * S * conv_elems : nullptr;
      cp.num_state_slots = S;
      cp.state_slots = b.state_slots;
      cp.cu_tokens = b.cu_q_lens;
      cp.seq_idx = b.seq_idx;
      cp.total_tokens = T;
      cp.batch = b.batch;
      cp.channels = C;
      cp.kernel = K;
      cp.silu = true;
      cuda_check(kernels::causal_conv1d(cp, stream), "GDN causal conv1d");
      kernels::GdnRecurrentGpuParams rp;
      rp.dims = {cfg_.linear_num_key_heads, Hv, cfg_.linear_key_head_dim, dv};
      rp.opt = {};  // use_qk_l2norm_in_kernel=True, eps 1e-6, scale 1/sqrt(d_k)
      rp.tok.q = gq_.get();
      rp.tok.k = gk_.get();
      rp.tok.v = gv_.get();
      rp.tok.g = gg_.as<float>();
      rp.tok.beta = gbeta_.as<float>();
      rp.tok.cu_tokens = b.cu_q_lens;
      rp.tok.batch = b.batch;
      rp.tok.max_tokens = std::max(1, b.max_q_len);
      rp.out = gcore_.get();
      rp.state_pool = rec_pool_.as<float>() + static_cast<size_t>(L.index) * S * rec_elems;
      rp.num_state_slots = S;
      rp.state_slots = b.state_slots;
      cuda_check(kernels::gdn_recurrent(rp, stream), "GDN recurrent step");
      kernels::GatedRmsNormParams np;
      np.x = gcore_.get();
      np.z = proj + C;
      np.z_stride = P;
      np.weight = L.gated_norm;
      np.y = gnormed_.get();
      np.tokens = T;
      np.heads = Hv;
      np.dim = dv;
      np.eps = cfg_.rms_norm_eps;
      cuda_check(kernels::gated_rmsnorm(np, stream), "GDN gated norm");
      gemm(gnormed_.get(), L.out_proj_w, nullptr, x_.get(), T, H, VD, DType::BF16, "linear_attn.out_proj");
    } else {
      gemm(h_.get(), L.qkv_w, L.qkv_b, qkv_.get(), T, qkv_cols, H, DType::BF16, "qkv_proj");
      kv_layer(L, b, kv, attention, qkv_cols, stream);
      gemm(attn_.get(), L.o_w, L.o_b, x_.get(), T, H, cfg_.q_dim(), DType::BF16, "o_proj");
    }
    norm(x_.get(), L.mlp_norm, h_.get(), true, T, "post_attention_layernorm");
    gemm(h_.get(), L.gate_up_w, L.gate_up_b, gate_up_.get(), T, 2 * I, H, DType::BF16, "gate_up_proj");
    kernels::SwigluParams sw;
    sw.gate_up = gate_up_.get();
    sw.out = act_.get();
    sw.rows = T;
    sw.inter = I;
    cuda_check(kernels::swiglu(sw, stream), "SwiGLU");
    gemm(act_.get(), L.down_w, L.down_b, x_.get(), T, H, I, DType::BF16, "down_proj");
  }
  // Final norm over every row (x = the last MLP output added into the residual), then the logit rows only.
  norm(x_.get(), final_norm_, h_.get(), true, T, "model.norm");
  const int R = b.num_logit_rows;
  if (R == 0) return;
  kernels::EmbeddingParams g;
  g.token_ids = b.logit_rows;
  g.table = h_.get();
  g.out = sel_.get();
  g.num_tokens = R;
  g.vocab_size = T;
  g.hidden = H;
  cuda_check(kernels::embedding_gather(g, stream), "logit rows");
  gemm(sel_.get(), lm_head_, nullptr, logits_.get(), R, cfg_.vocab_size, H, DType::F32, "lm_head");
}

void GpuModel::kv_layer(const Layer& L, const GpuBatch& b, GpuKvPool& kv, GpuAttention& attention, int qkv_cols,
                        cudaStream_t stream) {
  const int T = b.num_tokens;
  const int a = L.index;  // among the full-attention layers: the KV pool's and the attention hook's layer
  kernels::RopeKvAppendParams r;
  r.qkv = qkv_.get();
  r.q_out = q_.get();
  r.k_cache = kv.k(a);
  r.v_cache = kv.v(a);
  r.positions = b.positions;
  r.seq_idx = b.seq_idx;
  r.block_table = b.block_table;
  r.q_norm_weight = L.q_norm;
  r.k_norm_weight = L.k_norm;
  r.norm_weight_dtype = DType::F32;
  r.error_flag = b.error_flag;
  r.tokens = T;
  r.attention_shape() = attention_shape(cfg_, b, kv.page_size());
  r.rot_dim = cfg_.rope_dim();
  r.qkv_stride = qkv_cols;
  r.num_pages = kv.num_pages();
  r.theta = cfg_.rope_theta;
  r.norm_eps = cfg_.rms_norm_eps;
  r.row_out = attention.rows_out(a, stream, &r.row_out_stride);
  cuda_check(kernels::rope_kv_append(r, stream), "q/k norm + RoPE + KV append");
  GpuLayerStep s;
  s.layer = a;
  s.qkv = qkv_.get();
  s.qkv_stride = qkv_cols;
  s.q = q_.get();
  s.k_cache = kv.k(a);
  s.v_cache = kv.v(a);
  s.out = attn_.get();
  attention.attend(s, b, stream);
  if (cfg_.attn_output_gate) {  // Qwen3.5: attn_output * sigmoid(gate), the gate after q | k | v
    kernels::OutputGateParams og;
    og.out = attn_.get();
    og.gate = qkv_.as<uint16_t>() + cfg_.q_dim() + 2 * cfg_.kv_dim();
    og.gate_stride = qkv_cols;
    og.tokens = T;
    og.dim = cfg_.q_dim();
    cuda_check(kernels::output_gate(og, stream), "attention output gate");
  }
}

void GpuModel::argmax(int rows, int32_t* out, cudaStream_t stream) const {
  kernels::ArgmaxParams a;
  a.logits = logits_.get();
  a.out_tokens = out;
  a.rows = rows;
  a.vocab = cfg_.vocab_size;
  cuda_check(kernels::argmax_rows(a, stream), "argmax");
}

// ---------------------------------------------------------------------------------------------------------------
// GpuGraph
// ---------------------------------------------------------------------------------------------------------------

GpuGraph::~GpuGraph() {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
}

void GpuGraph::capture(cudaStream_t stream, const std::function<void(cudaStream_t)>& work) {
  SPADE_CHECK(stream != nullptr, "GpuGraph: capture needs a non-default stream");
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "graph capture begin");
  try {
    work(stream);
  } catch (...) {
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(stream, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    throw;
  }
  cudaGraph_t g = nullptr;
  cuda_check(cudaStreamEndCapture(stream, &g), "graph capture end");
  cudaGraphExec_t e = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&e, g, 0);
  if (err != cudaSuccess) {
    cudaGraphDestroy(g);
    cuda_check(err, "graph instantiate");
  }
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  graph_ = g;
  exec_ = e;
}

void GpuGraph::upload(cudaStream_t stream) const {
  SPADE_CHECK(exec_ != nullptr, "GpuGraph: upload before capture");
  cuda_check(cudaGraphUpload(exec_, stream), "graph upload");
}

void GpuGraph::launch(cudaStream_t stream) const {
  SPADE_CHECK(exec_ != nullptr, "GpuGraph: launch before capture");
  cuda_check(cudaGraphLaunch(exec_, stream), "graph launch");
}

}  // namespace spade
