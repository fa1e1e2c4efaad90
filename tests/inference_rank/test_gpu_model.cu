// GPU forward pass (inference_rank/gpu_model.h) against the CPU fp32 forward pass (inference_rank/model.h).
//
// - Parity: two small dense configs built here -- Qwen3-like (q/k norm, GQA 2, untied lm_head, theta 1e6)
//   and Llama-like with every bias (q/k/v, o_proj, MLP), GQA 8 and tied embeddings -- run with the same
//   host weights (weights.h random_source) on both paths: a ragged prefill of 3 sequences (13, 29, 7 tokens)
//   in one step with the logits of every token, then 12 decode steps fed with the CPU's greedy tokens (batch
//   rows in a rotating order), the same shuffled, non-contiguous page ids in the CPU KvCache and the GPU
//   pool (page_size 16).
//   Bound per logit row: max|gpu - cpu| / max|cpu| <= 0.05. The GPU keeps the weights and every activation
//   between ops (GEMM inputs/outputs, q/k/v, the KV cache, the attention output) in bf16 -- relative rounding
//   up to 2^-9 each -- with fp32 accumulation and an fp32 residual stream. Rounding only the weights to bf16
//   in the CPU model gives 0.6-1.0% (worst row, ~0.5% mean) on these configs; activation rounding about
//   doubles that, so the GPU is expected near 1-2.5%, while a layout bug (head order, RoPE pairing, a missing
//   bias, a wrong page) is of order 1.
//   Argmax: GpuModel::argmax must equal the CPU argmax on every row whose CPU top-1/top-2 margin exceeds 4x
//   that row's observed max error, and at least a quarter of the rows must qualify, so the check is not
//   vacuous. (The weights-only emulation has 75-90% of rows qualifying at its own error, 60-75% at 2x, 20-60%
//   at 3-5x: requiring a majority would be flaky.)
// - Chunked prefill: 10 + 10 + 9 tokens over three steps (mixed with another sequence's prefill and decode)
//   give the last-token logits of the one-step prefill within 1e-2 relative (only GEMM row counts and the
//   attention tiling differ: fp32 summation order and the occasional different bf16 rounding).
// - CUDA graph: a decode step of batch 4 captured once (GpuGraph, non-blocking stream) and replayed for 8
//   steps with new data copied into the same GpuStepBuffers equals eager forwards of the same steps on an
//   identical setup within 1e-6 relative (same kernels and split-K grid: max_seq_len fixed at 256 for both).
// - GpuModel::random: same seed -> bitwise-identical finite logits; another seed -> different logits.
// - Hybrid Qwen3.5-like (qwen35_like: 3 GDN layers + 1 gated full-attention layer): the same parity bound and
//   argmax rule, the chunked-prefill check (conv and recurrent states carried across steps), and the GPU engine
//   against the CPU engine (the engine's state slot ids index the GPU state pools).
// - Bad input: unsupported head_dim / GQA group / GDN head dims / hybrid without state slots throw spade::Error
//   naming the cause;
//   malformed steps are rejected by GpuStepBuffers::upload (oversized ones by forward); an out-of-vocabulary
//   token id sets the device error flag without a CUDA error.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/error.h"
#include "inference_rank/engine.h"
#include "inference_rank/gpu_engine.h"
#include "tests/inference_rank/gpu_test_models.h"
#include "inference_rank/gpu_model.h"
#include "inference_rank/model.h"
#include "inference_rank/weights.h"
#include "tests/test_util.h"

namespace spade {
namespace {

constexpr int kPageSize = 16;
constexpr int kMaxTokens = 128;
constexpr int kMaxLogitRows = 64;
constexpr int kMaxPagesPerSeq = 16;  // 256 tokens: room for the graph test's fixed max_seq_len bound
constexpr int kStateSlots = 5;  // hybrid models: GDN state slots of the test pools
constexpr GpuModelOptions kOpts{kMaxTokens, kMaxLogitRows, kStateSlots};
constexpr double kParityTol = 0.05;

using test::qwen3_like;

// Llama with attention_bias (q/k/v and o_proj bias, as config.cpp maps it for llama) and mlp_bias: every bias
// buffer of the GPU path is exercised.
ModelConfig llama_biased() {
  ModelConfig c;
  c.model_type = "llama";
  c.arch = ModelArch::Llama;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.num_layers = 2;
  c.num_q_heads = 8;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.vocab_size = 1000;
  c.max_position_embeddings = 2048;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = true;
  c.attention_bias = true;
  c.o_proj_bias = true;
  c.mlp_bias = true;
  return c;
}

// Hybrid Qwen3.5-like (qwen3_5_text): Gated DeltaNet layers 0, 1, 3 (GDN head dims 64, the kernels' smallest; 2 key
// heads, 4 value heads, conv kernel 4) and a gated full-attention layer 2 (q/k norm, partial RoPE over 16 of 64
// dims, sigmoid output gate), zero-centred norms folded by the loader.
ModelConfig qwen35_like() {
  ModelConfig c = qwen3_like();
  c.model_type = "qwen3_5_text";
  c.arch = ModelArch::Qwen3_5;
  c.num_layers = 4;
  c.layer_types = {LayerType::LinearAttention, LayerType::LinearAttention, LayerType::FullAttention,
                   LayerType::LinearAttention};
  c.attn_output_gate = true;
  c.norm_unit_offset = true;
  c.rotary_dim = 16;
  c.rope_theta = 1e7;
  c.linear_conv_kernel_dim = 4;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 64;
  c.linear_value_head_dim = 64;
  return c;
}

std::vector<int32_t> random_tokens(int n, int vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = d(rng);
  return t;
}

int argmax_row(const float* row, int n) {
  return static_cast<int>(std::max_element(row, row + n) - row);
}

// Sequences owning shuffled, non-contiguous pages; one block table serves the CPU KvCache and the GPU pool.
struct Seqs {
  int max_pages = 0, num_pages = 0;
  std::vector<std::vector<int32_t>> table;  // [seq][max_pages]: its pages, then -1
  std::vector<int> len;                     // context length so far
};

Seqs make_seqs(int n, int pages_each, int max_pages, std::mt19937_64& rng) {
  Seqs s;
  s.max_pages = max_pages;
  s.num_pages = n * pages_each + 5;  // a few pages nobody owns
  std::vector<int32_t> perm(static_cast<size_t>(s.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> row(static_cast<size_t>(max_pages), -1);
    std::copy_n(perm.begin() + i * pages_each, pages_each, row.begin());
    s.table.push_back(row);
  }
  s.len.assign(static_cast<size_t>(n), 0);
  return s;
}

// One ragged step for both paths: batch row i is sequence which[i] appending chunks[i]; logits of every new
// token (all_rows) or of each sequence's last one.
struct Step {
  std::vector<int> which;
  ForwardBatch cpu;
  GpuStepHost gpu;
};

// `slots`: hybrid models, the GDN state slot of each sequence id (null for dense models).
Step make_step(Seqs& s, const std::vector<int>& which, const std::vector<std::vector<int32_t>>& chunks,
               bool all_rows, int max_seq_len = 0, const std::vector<int32_t>* slots = nullptr) {
  Step st;
  st.which = which;
  ForwardBatch& f = st.cpu;
  f.max_pages = s.max_pages;
  f.cu_q_lens = {0};
  for (size_t i = 0; i < which.size(); ++i) {
    const size_t q = static_cast<size_t>(which[i]);
    const int n = static_cast<int>(chunks[i].size());
    for (int j = 0; j < n; ++j) {
      if (all_rows || j == n - 1) f.logit_rows.push_back(f.total_tokens());
      f.tokens.push_back(chunks[i][static_cast<size_t>(j)]);
      f.positions.push_back(s.len[q] + j);
      st.gpu.seq_idx.push_back(static_cast<int32_t>(i));
    }
    s.len[q] += n;
    f.cu_q_lens.push_back(f.total_tokens());
    f.seq_lens.push_back(s.len[q]);
    f.block_table.insert(f.block_table.end(), s.table[q].begin(), s.table[q].end());
    f.seq_ids.push_back(q + 1);
    if (slots != nullptr) f.state_slots.push_back((*slots)[q]);
  }
  GpuStepHost& g = st.gpu;
  g.tokens = f.tokens;
  g.positions = f.positions;
  g.cu_q_lens = f.cu_q_lens;
  g.seq_lens = f.seq_lens;
  g.block_table = f.block_table;
  g.logit_rows = f.logit_rows;
  g.state_slots = f.state_slots;
  g.max_pages = f.max_pages;
  g.max_seq_len = max_seq_len;
  return st;
}

// Greedy next token of every sequence of `st` (its last logit row), indexed by sequence id.
std::vector<int32_t> greedy(const Step& st, const std::vector<float>& logits, int vocab, size_t num_seqs) {
  std::vector<int32_t> next(num_seqs, -1);
  for (size_t r = 0; r < st.cpu.logit_rows.size(); ++r) {
    const int b = st.gpu.seq_idx[static_cast<size_t>(st.cpu.logit_rows[r])];
    next[static_cast<size_t>(st.which[static_cast<size_t>(b)])] = argmax_row(&logits[r * vocab], vocab);
  }
  return next;
}

// A GpuModel with its own KV pool, dense attention, step buffers and non-blocking stream.
class GpuRunner {
 public:
  GpuRunner(std::unique_ptr<GpuModel> model, int num_pages, int max_batch)
      : model_(std::move(model)),
        kv_(cfg().num_attention_layers(), num_pages, kPageSize, cfg().num_kv_heads, cfg().head_dim),
        attn_(cfg(), kPageSize, max_batch),
        bufs_(kMaxTokens, max_batch, kMaxPagesPerSeq, kMaxLogitRows, num_pages, cfg().is_hybrid() ? kStateSlots : 0),
        top_(kMaxLogitRows * sizeof(int32_t), "argmax output") {
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  ~GpuRunner() { cudaStreamDestroy(stream_); }
  GpuRunner(const GpuRunner&) = delete;
  GpuRunner& operator=(const GpuRunner&) = delete;

  const ModelConfig& cfg() const { return model_->config(); }
  cudaStream_t stream() const { return stream_; }
  GpuBatch upload(const GpuStepHost& h) { return bufs_.upload(h, stream_); }
  void forward(const GpuBatch& b) { model_->forward(b, kv_, attn_, stream_); }
  void capture(GpuGraph& graph, const GpuBatch& b) {
    graph.capture(stream_, [&](cudaStream_t s) { model_->forward(b, kv_, attn_, s); });
  }
  // The first `rows` logit rows of the last forward (synchronises the stream).
  std::vector<float> logits(int rows) {
    std::vector<float> out(static_cast<size_t>(rows) * cfg().vocab_size);
    cuda_check(cudaMemcpyAsync(out.data(), model_->logits(), out.size() * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_),
               "logits download");
    cuda_check(cudaStreamSynchronize(stream_), "step");
    return out;
  }
  std::vector<float> run(const GpuStepHost& h) {
    const GpuBatch b = upload(h);
    forward(b);
    return logits(b.num_logit_rows);
  }
  std::vector<int32_t> argmax(int rows) {
    std::vector<int32_t> out(static_cast<size_t>(rows));
    model_->argmax(rows, top_.as<int32_t>(), stream_);
    cuda_check(cudaMemcpyAsync(out.data(), top_.get(), out.size() * 4, cudaMemcpyDeviceToHost, stream_),
               "argmax");
    cuda_check(cudaStreamSynchronize(stream_), "argmax");
    return out;
  }
  int32_t error_flag() {
    int32_t f = -1;
    cuda_check(cudaMemcpyAsync(&f, bufs_.error_flag(), 4, cudaMemcpyDeviceToHost, stream_), "error flag");
    cuda_check(cudaStreamSynchronize(stream_), "error flag");
    return f;
  }

 private:
  std::unique_ptr<GpuModel> model_;
  GpuKvPool kv_;
  GpuDenseAttention attn_;
  GpuStepBuffers bufs_;
  DeviceBuffer top_;
  cudaStream_t stream_ = nullptr;
};

double max_abs(const float* a, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i])));
  return m;
}
double max_abs_diff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}
bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

struct ParityStats {
  double worst = 0;
  int rows = 0, decisive = 0;
};

void compare_rows(const std::vector<float>& cpu, const std::vector<float>& gpu,
                  const std::vector<int32_t>& gpu_top, int vocab, const std::string& where, ParityStats& st) {
  const size_t V = static_cast<size_t>(vocab), rows = cpu.size() / V;
  ASSERT_EQ(gpu.size(), cpu.size()) << where;
  ASSERT_EQ(gpu_top.size(), rows) << where;
  ASSERT_TRUE(all_finite(gpu)) << where;
  for (size_t r = 0; r < rows; ++r) {
    const float* c = &cpu[r * V];
    const float* g = &gpu[r * V];
    const double err = max_abs_diff(g, c, V), mag = max_abs(c, V), rel = err / mag;
    st.worst = std::max(st.worst, rel);
    ++st.rows;
    EXPECT_LE(rel, kParityTol) << where << " row " << r << ": max|gpu-cpu| " << err << ", max|cpu| " << mag;
    EXPECT_EQ(gpu_top[r], argmax_row(g, vocab))
        << where << " row " << r << ": GpuModel::argmax vs its own logits";
    const int c1 = argmax_row(c, vocab);
    float second = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < vocab; ++i)
      if (i != c1) second = std::max(second, c[i]);
    if (c[c1] - second > 4 * err) {
      ++st.decisive;
      EXPECT_EQ(gpu_top[r], c1) << where << " row " << r << ": CPU margin " << c[c1] - second << ", error "
                                << err;
    }
  }
}

// Rounds to bf16 every tensor GpuModel::upload stores in bf16 (the put16 tensors of inference_rank/gpu_model.cpp).
void round_bf16_tensors(ModelWeights& w) {
  const auto round = [](std::vector<float>& v) {
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  };
  round(w.embed);
  round(w.lm_head);
  for (LayerWeights& l : w.layers) {
    for (std::vector<float>* v : {&l.qkv_w, &l.qkv_b, &l.o_w, &l.o_b, &l.in_proj_w, &l.out_proj_w, &l.gate_up_w,
                                  &l.gate_up_b, &l.down_w, &l.down_b})
      round(*v);
  }
}

void check_parity(const ModelConfig& cfg, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int V = cfg.vocab_size, kDecodeSteps = 12;
  Seqs seqs = make_seqs(3, 3, 4, rng);  // contexts up to 29 + 12 = 41 tokens: 3 pages each (+ one -1 entry)
  ModelWeights w = load_weights(cfg, random_source(seed));
  // random_source's N(0, 1) embeddings dominate the residual stream, so a tied head only echoes the input
  // token (one logit ~ hidden, the rest ~ sqrt(hidden)) and max|cpu| would hide errors in everything else.
  // Trained checkpoints have embedding entries ~0.02, which gives ordinary logit rows.
  if (cfg.tie_word_embeddings)
    for (float& x : w.embed) x *= 0.02f;
  // The GPU holds the matrices (and biases) in bf16: the CPU reference gets the same bf16-rounded values, so the
  // comparison measures the GPU's arithmetic (bf16 activations, fp32 accumulation), not the weights' rounding.
  round_bf16_tensors(w);
  GpuRunner gpu(GpuModel::upload(cfg, w, kOpts), seqs.num_pages, 3);
  const Model cpu(cfg, std::move(w));
  const ModelConfig view = cfg.attention_view();  // the KV cache holds the full-attention layers
  KvCache cache(view, seqs.num_pages, kPageSize);
  DensePagedAttention cpu_attn(view, cache);
  // Hybrid: the CPU pool hands out the slot ids and the GPU pools use the same ids (slot 0 is taken first, so
  // sequence i's slot is not simply i).
  std::unique_ptr<GdnStatePool> states;
  std::vector<int32_t> slot_of;
  if (cfg.is_hybrid()) {
    states = std::make_unique<GdnStatePool>(cfg, kStateSlots);
    states->allocate();
    for (int i = 0; i < 3; ++i) slot_of.push_back(states->allocate());
  }
  const std::vector<int32_t>* slots = cfg.is_hybrid() ? &slot_of : nullptr;

  Step step = make_step(seqs, {0, 1, 2},
                        {random_tokens(13, V, rng), random_tokens(29, V, rng), random_tokens(7, V, rng)},
                        /*all_rows=*/true, 0, slots);
  ParityStats st;
  std::vector<float> ref;
  for (int s = 0; s <= kDecodeSteps; ++s) {
    cpu.forward(step.cpu, cpu_attn, ref, states.get());
    const std::vector<float> got = gpu.run(step.gpu);
    const std::vector<int32_t> top = gpu.argmax(static_cast<int>(step.cpu.logit_rows.size()));
    compare_rows(ref, got, top, V,
                 cfg.model_type + (s == 0 ? " prefill" : " decode step " + std::to_string(s)), st);
    if (::testing::Test::HasFatalFailure()) return;
    // Both paths continue with the CPU's greedy tokens, batch rows rotated (row != sequence id).
    const std::vector<int32_t> next = greedy(step, ref, V, 3);
    const std::vector<int> order = {s % 3, (s + 1) % 3, (s + 2) % 3};
    std::vector<std::vector<int32_t>> chunks;
    for (int q : order) chunks.push_back({next[static_cast<size_t>(q)]});
    step = make_step(seqs, order, chunks, false, 0, slots);
  }
  std::printf(
      "[ parity   ] %s: %d logit rows, worst max|gpu-cpu|/max|cpu| = %.5f (bound %.2f), %d rows with a "
      "decisive CPU margin\n",
      cfg.model_type.c_str(), st.rows, st.worst, kParityTol, st.decisive);
  EXPECT_EQ(st.rows, 49 + 3 * kDecodeSteps);
  EXPECT_GE(4 * st.decisive, st.rows) << "too few rows with a CPU top-1/top-2 margin above 4x the observed "
                                         "error: the argmax check is vacuous";
}

TEST(GpuModelParity, Qwen3LikeQkNormGqa2UntiedHead) {
  check_parity(qwen3_like(), 101);
}

TEST(GpuModelParity, Qwen35LikeHybridGdnAndGatedAttention) {
  check_parity(qwen35_like(), 303);
}

TEST(GpuModelParity, LlamaLikeAllBiasesGqa8TiedEmbeddings) {
  check_parity(llama_biased(), 202);
}

// Dense and hybrid: chunked prefill carries the KV (and, hybrid, the conv and recurrent states) across steps.
void check_chunked_prefill(const ModelConfig& cfg) {
  const int V = cfg.vocab_size;
  std::mt19937_64 rng(7);
  Seqs seqs = make_seqs(3, 2, 4, rng);
  GpuRunner gpu(GpuModel::random(cfg, 11, kOpts), seqs.num_pages, 3);
  const std::vector<int32_t> slot_of = {4, 2, 0};
  const std::vector<int32_t>* slots = cfg.is_hybrid() ? &slot_of : nullptr;
  const std::vector<int32_t> prompt = random_tokens(29, V, rng);
  const std::vector<float> one = gpu.run(make_step(seqs, {0}, {prompt}, false, 0, slots).gpu);

  // Sequence 1 gets the same prompt in chunks; sequence 2 prefills and decodes alongside it.
  const auto cut = [&](int a, int b) { return std::vector<int32_t>(prompt.begin() + a, prompt.begin() + b); };
  gpu.run(make_step(seqs, {1, 2}, {cut(0, 10), random_tokens(5, V, rng)}, false, 0, slots).gpu);
  gpu.run(make_step(seqs, {2, 1}, {random_tokens(1, V, rng), cut(10, 20)}, false, 0, slots).gpu);
  const std::vector<float> chunked = gpu.run(make_step(seqs, {1}, {cut(20, 29)}, false, 0, slots).gpu);

  ASSERT_EQ(one.size(), static_cast<size_t>(V));
  ASSERT_EQ(chunked.size(), one.size());
  ASSERT_TRUE(all_finite(one) && all_finite(chunked));
  const double mag = max_abs(one.data(), one.size()),
               err = max_abs_diff(chunked.data(), one.data(), one.size());
  ASSERT_GT(mag, 0.1);
  EXPECT_LE(err / mag, 1e-2) << cfg.model_type << " chunked vs one-step prefill: max diff " << err
                             << ", max logit " << mag;
}

TEST(GpuModel, ChunkedPrefillMatchesOneStepPrefill) { check_chunked_prefill(qwen3_like()); }

TEST(GpuModel, HybridChunkedPrefillCarriesTheGdnStates) { check_chunked_prefill(qwen35_like()); }

TEST(GpuModel, CudaGraphReplayMatchesEagerDecode) {
  const ModelConfig cfg = qwen3_like();
  const int V = cfg.vocab_size, kBatch = 4, kSteps = 8, kBound = 256;
  std::mt19937_64 rng(21);
  // <= 33 + 8 tokens each in 3 pages; block-table rows padded with -1 to 16 pages (the 256-token bound).
  Seqs seqs = make_seqs(kBatch, 3, kMaxPagesPerSeq, rng);
  GpuRunner eager(GpuModel::random(cfg, 5, kOpts), seqs.num_pages, kBatch);
  GpuRunner graphed(GpuModel::random(cfg, 5, kOpts), seqs.num_pages, kBatch);

  const Step prefill = make_step(seqs, {0, 1, 2, 3},
                                 {random_tokens(5, V, rng), random_tokens(17, V, rng),
                                  random_tokens(33, V, rng), random_tokens(9, V, rng)},
                                 false);
  const std::vector<float> pre = eager.run(prefill.gpu);
  ASSERT_TRUE(graphed.run(prefill.gpu) == pre) << "identical setups disagree before the graph is involved";
  std::vector<int32_t> next = greedy(prefill, pre, V, static_cast<size_t>(kBatch));

  GpuGraph graph;
  GpuBatch captured;
  for (int s = 0; s < kSteps; ++s) {
    const Step st =
        make_step(seqs, {0, 1, 2, 3}, {{next[0]}, {next[1]}, {next[2]}, {next[3]}}, false, kBound);
    const std::vector<float> want = eager.run(st.gpu);
    const GpuBatch b = graphed.upload(st.gpu);
    ASSERT_TRUE(b.decode_only());
    ASSERT_EQ(b.max_seq_len, kBound);
    if (!graph.captured()) {
      graphed.capture(graph, b);
      captured = b;
    }
    ASSERT_EQ(b.tokens, captured.tokens) << "GpuStepBuffers::upload moved the step's device buffers";
    ASSERT_EQ(b.block_table, captured.block_table);
    ASSERT_EQ(b.error_flag, captured.error_flag);
    graph.launch(graphed.stream());
    const std::vector<float> got = graphed.logits(kBatch);
    ASSERT_TRUE(all_finite(got));
    const double err = max_abs_diff(got.data(), want.data(), want.size());
    EXPECT_LE(err, 1e-6 * max_abs(want.data(), want.size()))
        << "graph replay step " << s << ": max diff " << err;
    EXPECT_EQ(graphed.error_flag(), 0);
    next = greedy(st, want, V, static_cast<size_t>(kBatch));
  }
}

TEST(GpuModel, RandomWeightsAreAFunctionOfTheSeed) {
  const ModelConfig cfg = llama_biased();
  std::mt19937_64 rng(3);
  Seqs seqs = make_seqs(2, 2, 4, rng);
  const Step st =
      make_step(seqs, {0, 1}, {random_tokens(20, cfg.vocab_size, rng), random_tokens(6, cfg.vocab_size, rng)},
                /*all_rows=*/true);
  const auto logits_of = [&](uint64_t seed) {
    GpuRunner g(GpuModel::random(cfg, seed, kOpts), seqs.num_pages, 2);
    return g.run(st.gpu);
  };
  const std::vector<float> a = logits_of(42), b = logits_of(42), c = logits_of(43);
  ASSERT_EQ(a.size(), static_cast<size_t>(26) * cfg.vocab_size);
  ASSERT_TRUE(all_finite(a) && all_finite(c));
  ASSERT_GT(max_abs(a.data(), a.size()), 0.1);
  ASSERT_EQ(b.size(), a.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "same seed, different logits";
  EXPECT_GT(max_abs_diff(a.data(), c.data(), a.size()), 0.1 * max_abs(a.data(), a.size()))
      << "seeds 42 and 43 give (nearly) the same logits";
}

// Runs f, which must throw spade::Error whose message contains `key`.
template <typename F>
void expect_error(F&& f, const std::string& key) {
  try {
    f();
    ADD_FAILURE() << "no spade::Error thrown (expected one mentioning '" << key << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << "message: " << e.what();
  }
}

TEST(GpuModelBadInput, UnsupportedConfigsThrow) {
  ModelConfig c = qwen3_like();
  c.head_dim = 16;
  expect_error([&] { GpuModel::random(c, 1, kOpts); }, "head_dim 16");

  c = qwen3_like();
  c.num_q_heads = 16;
  c.num_kv_heads = 1;  // GQA group 16 > 8
  expect_error([&] { GpuModel::random(c, 1, kOpts); }, "GQA");

  c = qwen35_like();  // GDN head dims the kernels lack (the tiny transformers fixture's 16)
  c.linear_key_head_dim = 16;
  c.linear_value_head_dim = 16;
  ASSERT_TRUE(c.is_hybrid());
  expect_error([&] { GpuModel::random(c, 1, kOpts); }, "Gated DeltaNet head dims k 16 / v 16");

  c = qwen35_like();  // hybrid without state slots
  expect_error([&] { GpuModel::random(c, 1, GpuModelOptions{kMaxTokens, kMaxLogitRows, 0}); }, "max_state_slots");
}

TEST(GpuModelBadInput, HybridStepsNeedValidStateSlots) {
  std::mt19937_64 rng(19);
  Seqs seqs = make_seqs(1, 2, 4, rng);
  GpuRunner hybrid(GpuModel::random(qwen35_like(), 3, kOpts), seqs.num_pages, 2);
  Step st = make_step(seqs, {0}, {random_tokens(4, 1024, rng)}, false);
  expect_error([&] { hybrid.upload(st.gpu); }, "state slots");
  st.gpu.state_slots = {kStateSlots};
  expect_error([&] { hybrid.upload(st.gpu); }, "state slot 5");
  st.gpu.state_slots = {-2};
  expect_error([&] { hybrid.upload(st.gpu); }, "state slot -2");
  // A step uploaded without slots (another buffer set) reaches forward without them.
  GpuStepBuffers plain(kMaxTokens, 2, kMaxPagesPerSeq, kMaxLogitRows, seqs.num_pages);
  st.gpu.state_slots.clear();
  const GpuBatch b = plain.upload(st.gpu, hybrid.stream());
  expect_error([&] { hybrid.forward(b); }, "state_slots");
  // A dense model's buffers refuse slots.
  GpuRunner dense(GpuModel::random(qwen3_like(), 3, kOpts), seqs.num_pages, 2);
  st.gpu.state_slots = {0};
  expect_error([&] { dense.upload(st.gpu); }, "without GDN layers");
  cudaStreamSynchronize(hybrid.stream());
}

TEST(GpuModelBadInput, MalformedStepsAreRejected) {
  std::mt19937_64 rng(9);
  Seqs seqs = make_seqs(2, 1, 2, rng);
  const Step ok = make_step(seqs, {0, 1}, {random_tokens(5, 100, rng), random_tokens(3, 100, rng)}, true);
  GpuStepBuffers bufs(/*max_tokens=*/8, /*max_batch=*/2, /*max_pages=*/2, /*max_logit_rows=*/8, seqs.num_pages);
  EXPECT_NO_THROW(bufs.upload(ok.gpu, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  GpuStepHost h = ok.gpu;  // 9 tokens for buffers of 8
  h.tokens.push_back(1);
  h.positions.push_back(3);
  h.seq_idx.push_back(1);
  h.cu_q_lens.back() = 9;
  h.seq_lens.back() = 4;
  expect_error([&] { bufs.upload(h, nullptr); }, "9 tokens");

  h = ok.gpu;
  h.cu_q_lens.back() = 7;  // prefix sums that do not end at the 8 tokens
  expect_error([&] { bufs.upload(h, nullptr); }, "cu_q_lens");
  h = ok.gpu;
  h.cu_q_lens[1] = 9;  // not monotonic: sequence 0 gets 9 query tokens for a context of 5, sequence 1 gets -1
  expect_error([&] { bufs.upload(h, nullptr); }, "query tokens");

  h = ok.gpu;
  h.logit_rows.back() = 8;
  expect_error([&] { bufs.upload(h, nullptr); }, "logit row 8");

  h = ok.gpu;
  h.block_table.back() = seqs.num_pages;  // one past the pool
  expect_error([&] { bufs.upload(h, nullptr); }, "not a page of the pool");
  h = ok.gpu;
  h.seq_idx[0] = 2;  // a batch of 2 has no sequence 2
  expect_error([&] { bufs.upload(h, nullptr); }, "names sequence 2");

  // A step within the buffers but beyond the model's activation bounds: forward rejects it.
  GpuRunner small(GpuModel::random(qwen3_like(), 1, GpuModelOptions{4, 4}), seqs.num_pages, 2);
  const GpuBatch b = small.upload(ok.gpu);
  expect_error([&] { small.forward(b); }, "GPU forward");
}

TEST(GpuModelBadInput, OutOfVocabularyTokenSetsTheErrorFlag) {
  const ModelConfig cfg = qwen3_like();
  const int V = cfg.vocab_size;
  std::mt19937_64 rng(13);
  Seqs seqs = make_seqs(2, 2, 4, rng);
  GpuRunner gpu(GpuModel::random(cfg, 17, kOpts), seqs.num_pages, 2);

  gpu.run(make_step(seqs, {0, 1}, {random_tokens(6, V, rng), random_tokens(4, V, rng)}, false).gpu);
  EXPECT_EQ(gpu.error_flag(), 0) << "a valid step set the error flag";

  std::vector<int32_t> bad = random_tokens(3, V, rng);
  bad[1] = V;  // one past the vocabulary; the other sequence decodes a negative id
  EXPECT_NO_THROW(gpu.run(make_step(seqs, {0, 1}, {bad, {-7}}, false).gpu));
  EXPECT_EQ(gpu.error_flag(), 1) << "out-of-vocabulary token ids went unnoticed";

  const std::vector<float> after =
      gpu.run(make_step(seqs, {0, 1}, {random_tokens(1, V, rng), random_tokens(1, V, rng)}, false).gpu);
  EXPECT_EQ(gpu.error_flag(), 0) << "upload must clear the flag of the previous step";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(after.size(), static_cast<size_t>(2) * V);
}


// ---- The GPU path behind the continuous-batching Engine (gpu_engine.h) ----

using test::binary_dir;
using test::data_path;
using test::make_temp_dir;

struct EngineRun {
  std::vector<std::vector<int32_t>> tokens;  // per request, in submit order
  std::vector<FinishReason> reasons;
};

// Five requests of different prompt lengths and max_tokens through an engine with 3 running sequences and 16
// tokens per step: prefill is chunked, decode and prefill mix, requests join as others finish.
EngineRun run_engine(Engine& engine, int vocab, const SamplingParams* sampling = nullptr) {
  std::mt19937_64 rng(77);
  const int prompt_lens[5] = {5, 23, 1, 40, 9}, max_tokens[5] = {12, 7, 20, 5, 16};
  EngineRun out;
  out.tokens.resize(5);
  out.reasons.resize(5, FinishReason::None);
  for (int i = 0; i < 5; ++i) {
    GenerateRequest r;
    r.prompt_ids = random_tokens(prompt_lens[i], vocab, rng);
    r.max_tokens = max_tokens[i];
    r.sampling.temperature = 0.f;
    if (sampling != nullptr) {
      r.sampling = *sampling;
      r.sampling.seed += static_cast<uint64_t>(i);
    }
    r.ignore_eos = true;
    engine.submit(r, [&out, i](const TokenEvent& ev) {
      if (ev.token >= 0) out.tokens[i].push_back(ev.token);
      if (ev.finished) out.reasons[i] = ev.reason;
    });
  }
  engine.run_until_idle();
  return out;
}

// 3 running sequences, 16 tokens per step: chunked prefill and mixed steps (run_engine's workload).
EngineOptions small_engine_options() {
  EngineOptions eo;
  eo.page_size = 16;
  eo.num_pages = 64;
  eo.max_num_seqs = 3;
  eo.max_num_batched_tokens = 16;
  eo.max_model_len = 256;
  return eo;
}

// The Engine over the GPU forward pass against the CPU engine on run_engine's workload (dense and, with the GDN
// states on the GPU indexed by the engine's slot ids, hybrid).
void check_engine_agrees(const ModelConfig& cfg) {
  const ModelWeights w = load_weights(cfg, random_source(21));
  const EngineOptions eo = small_engine_options();
  Model cpu_model(cfg, w);
  Engine cpu(cpu_model, eo);
  const EngineRun want = run_engine(cpu, cfg.vocab_size);

  for (const bool graphs : {true, false}) {
    const GpuEngineOptions go = gpu_engine_options(eo, graphs);
    GpuEngineForward gpu(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
    Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) { gpu(b, l); });
    const EngineRun got = run_engine(engine, cfg.vocab_size);
    size_t total = 0, matched_prefix = 0, first_match = 0;
    for (int i = 0; i < 5; ++i) {
      ASSERT_EQ(got.reasons[i], FinishReason::Length) << "request " << i;
      ASSERT_EQ(got.tokens[i].size(), want.tokens[i].size()) << "request " << i;
      total += want.tokens[i].size();
      size_t k = 0;
      while (k < got.tokens[i].size() && got.tokens[i][k] == want.tokens[i][k]) ++k;
      matched_prefix += k;
      first_match += k > 0;
    }
    std::printf("[ engine   ] %s graphs=%d: %zu of %zu greedy tokens agree with the CPU engine before the first "
                "divergence; first token agrees for %zu of 5 requests; %llu graph / %llu eager steps\n",
                cfg.model_type.c_str(), graphs, matched_prefix, total, first_match,
                static_cast<unsigned long long>(gpu.graph_steps()),
                static_cast<unsigned long long>(gpu.eager_steps()));
    // bf16 may flip a near-tie (then the sequences legitimately diverge), but a row mix-up or a stale KV page
    // would break agreement from the first decode step on.
    EXPECT_GE(first_match, 4u);
    EXPECT_GE(matched_prefix * 2, total);
    EXPECT_GT(gpu.eager_steps(), 0u);
    if (graphs) {
      EXPECT_GT(gpu.graph_steps(), 0u);
    } else {
      EXPECT_EQ(gpu.graph_steps(), 0u);
    }
  }
}

TEST(GpuEngine, ContinuousBatchingAgreesWithTheCpuEngine) { check_engine_agrees(qwen3_like()); }

TEST(GpuEngine, HybridContinuousBatchingAgreesWithTheCpuEngine) { check_engine_agrees(qwen35_like()); }

// inference_rank --device cuda samples on the device (GpuEngineForward::sample): greedy gives exactly the tokens of
// host sampling over the same GPU logits; seeded sampling is a function of the seed (same seed, same text; another
// seed, other text), with graphs and without.
TEST(GpuEngine, OnDeviceSamplingAgreesWithHostSamplingAndIsSeeded) {
  const ModelConfig cfg = qwen3_like();
  const ModelWeights w = load_weights(cfg, random_source(21));
  const EngineOptions eo = small_engine_options();
  for (const bool graphs : {true, false}) {
    const GpuEngineOptions go = gpu_engine_options(eo, graphs);
    GpuEngineForward host_side(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
    Engine host(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) { host_side(b, l); });
    const EngineRun want = run_engine(host, cfg.vocab_size);
    auto device_engine = [&](GpuEngineForward& g) {
      return Engine(cfg, eo,
                    ForwardSampleFn([&g](const ForwardBatch& b, const std::vector<RowSampling>& r,
                                         std::vector<int32_t>& t, std::vector<TokenLogprobs>& l) {
                      g.sample(b, r, t, l);
                    }));
    };
    GpuEngineForward dev_side(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
    Engine dev = device_engine(dev_side);
    const EngineRun got = run_engine(dev, cfg.vocab_size);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(got.tokens[i], want.tokens[i]) << "greedy request " << i << " graphs " << graphs;
      EXPECT_EQ(got.reasons[i], FinishReason::Length);
    }
    SamplingParams sp;
    sp.temperature = 0.9f;
    sp.top_p = 0.95f;
    sp.top_k = 500;
    sp.seed = 1234;
    std::vector<EngineRun> runs;
    for (uint64_t seed : {1234, 1234, 99}) {
      sp.seed = seed;
      GpuEngineForward g(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
      Engine e = device_engine(g);
      runs.push_back(run_engine(e, cfg.vocab_size, &sp));
    }
    int differ_from_greedy = 0, differ_from_other_seed = 0;
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(runs[0].tokens[i], runs[1].tokens[i]) << "same seed, request " << i;
      ASSERT_EQ(runs[0].tokens[i].size(), want.tokens[i].size());
      for (int32_t t : runs[0].tokens[i]) EXPECT_TRUE(t >= 0 && t < cfg.vocab_size) << t;
      differ_from_greedy += runs[0].tokens[i] != want.tokens[i];
      differ_from_other_seed += runs[0].tokens[i] != runs[2].tokens[i];
    }
    EXPECT_GE(differ_from_greedy, 3) << "temperature 0.9 should leave greedy decoding";
    EXPECT_GE(differ_from_other_seed, 3) << "another seed should give other text";
  }
}

// n samples of one prompt on the GPU path (Engine::submit_samples over GpuEngineForward with on-device sampling):
// the prompt's whole pages are computed once and held by every sample, so the peak KV is the shared prompt once plus
// n tails, against n whole prompts for n independent requests; and every sample decodes what an independent request
// with its seed decodes in a batch of the same size (bf16 may flip a near-tie where the prompt's KV was computed in
// another chunking, so the agreement is counted as in ContinuousBatchingAgreesWithTheCpuEngine; a sample reading a
// wrong page would disagree from its first token).
TEST(GpuEngine, SamplesShareThePromptPagesAndDecodeAsIndependentRequests) {
  const ModelConfig cfg = qwen3_like();
  const ModelWeights w = load_weights(cfg, random_source(21));
  EngineOptions eo = small_engine_options();
  eo.max_num_seqs = 4;
  eo.max_num_batched_tokens = 64;
  eo.num_pages = 128;
  constexpr int kSamples = 4, kTokens = 24;
  std::mt19937_64 rng(5);
  GenerateRequest req;
  req.prompt_ids = random_tokens(100, cfg.vocab_size, rng);  // 6 whole pages of 16 and a partial one
  req.max_tokens = kTokens;
  req.ignore_eos = true;
  req.sampling.temperature = 0.9f;
  req.sampling.top_k = 500;
  req.sampling.seed = 700;
  for (const bool graphs : {true, false}) {
    const GpuEngineOptions go = gpu_engine_options(eo, graphs);
    auto run = [&](bool shared, int* peak_pages) {
      GpuEngineForward g(GpuModel::upload(cfg, w, GpuEngineForward::model_options(go)), go);
      Engine e(cfg, eo,
               ForwardSampleFn([&g](const ForwardBatch& b, const std::vector<RowSampling>& r, std::vector<int32_t>& t,
                                    std::vector<TokenLogprobs>& l) { g.sample(b, r, t, l); }));
      std::map<uint64_t, std::vector<int32_t>> by_id;
      std::map<uint64_t, FinishReason> reason;
      auto cb = [&](const TokenEvent& ev) {
        if (ev.token >= 0) by_id[ev.request_id].push_back(ev.token);
        if (ev.finished) reason[ev.request_id] = ev.reason;
      };
      std::vector<uint64_t> ids;
      if (shared) {
        ids = e.submit_samples(req, kSamples, cb);
      } else {
        for (int i = 0; i < kSamples; ++i) {
          GenerateRequest r = req;
          r.sampling.seed = req.sampling.seed + static_cast<uint64_t>(i);
          ids.push_back(e.submit(r, cb));
        }
      }
      int low = e.pages().num_free_pages();
      while (!e.idle()) {
        e.step();
        low = std::min(low, e.pages().num_free_pages());
      }
      *peak_pages = e.pages().num_pages() - low;
      EXPECT_EQ(e.pages().num_free_pages(), e.pages().num_pages()) << "a page is still held after every sample ended";
      std::vector<std::vector<int32_t>> out;
      for (uint64_t id : ids) {
        EXPECT_EQ(reason[id], FinishReason::Length) << "request " << id;
        out.push_back(by_id[id]);
      }
      return out;
    };
    int peak_shared = 0, peak_alone = 0;
    const auto samples = run(true, &peak_shared);
    const auto alone = run(false, &peak_alone);
    size_t total = 0, matched_prefix = 0, first_match = 0, distinct = 0;
    for (int i = 0; i < kSamples; ++i) {
      ASSERT_EQ(samples[i].size(), static_cast<size_t>(kTokens)) << "sample " << i;
      ASSERT_EQ(alone[i].size(), static_cast<size_t>(kTokens)) << "request " << i;
      total += alone[i].size();
      size_t k = 0;
      while (k < samples[i].size() && samples[i][k] == alone[i][k]) ++k;
      matched_prefix += k;
      first_match += k > 0;
      distinct += i > 0 && samples[i] != samples[0];
    }
    std::printf("[ samples  ] graphs=%d: peak KV %d pages for %d samples of a 100-token prompt, %d for %d independent "
                "requests; %zu of %zu tokens agree before the first divergence, first token %zu of %d\n",
                graphs, peak_shared, kSamples, peak_alone, kSamples, matched_prefix, total, first_match, kSamples);
    // Shared: 6 prompt pages once + per sample its partial page and tail (100 + 24 tokens -> pages 6 and 7);
    // independent: up to 8 pages each, the prompt's 6 among them (when their decodes overlap, as here).
    EXPECT_LE(peak_shared, 6 + kSamples * 2);
    EXPECT_GE(peak_alone, peak_shared + 2 * 6) << "fewer than two prompt copies saved";
    EXPECT_GE(first_match, 3u);
    EXPECT_GE(matched_prefix * 2, total);
    EXPECT_GE(distinct, 2u) << "the samples' seeds differ, so should most of their texts";
  }
}

TEST(GpuEngine, OverlongRequestIsRejectedAndNothingIsLost) {
  const ModelConfig cfg = qwen3_like();
  EngineOptions eo;
  eo.num_pages = 32;
  eo.max_num_seqs = 2;
  eo.max_num_batched_tokens = 32;
  eo.max_model_len = 64;
  const GpuEngineOptions go = gpu_engine_options(eo);
  GpuEngineForward gpu(GpuModel::random(cfg, 3, GpuEngineForward::model_options(go)), go);
  Engine engine(cfg, eo, [&](const ForwardBatch& b, std::vector<float>& l) { gpu(b, l); });
  GenerateRequest big;
  big.prompt_ids.assign(60, 7);
  big.max_tokens = 10;
  expect_error([&] { engine.submit(big, [](const TokenEvent&) {}); }, "maximum context length is 64");
  GenerateRequest ok;
  ok.prompt_ids.assign(10, 7);
  ok.max_tokens = 4;
  int n = 0;
  FinishReason reason = FinishReason::None;
  engine.submit(ok, [&](const TokenEvent& ev) {
    n += ev.token >= 0;
    if (ev.finished) reason = ev.reason;
  });
  engine.run_until_idle();
  EXPECT_EQ(n, 4);
  EXPECT_EQ(reason, FinishReason::Length);
  // A hybrid model behind an external forward pass gets GDN state slot ids from the engine, distinct per running
  // sequence and in [0, max_num_seqs).
  const ModelConfig hybrid = qwen35_like();
  std::vector<std::vector<int32_t>> slots_seen;
  Engine he(hybrid, eo, [&](const ForwardBatch& b, std::vector<float>& l) {
    slots_seen.push_back(b.state_slots);
    l.assign(b.logit_rows.size() * static_cast<size_t>(hybrid.vocab_size), 0.f);
  });
  std::mt19937_64 rng(3);
  for (int i = 0; i < 4; ++i) {
    GenerateRequest r;
    r.prompt_ids = random_tokens(3 + i, hybrid.vocab_size, rng);
    r.max_tokens = 3;
    r.ignore_eos = true;
    he.submit(r, [](const TokenEvent&) {});
  }
  he.run_until_idle();
  ASSERT_FALSE(slots_seen.empty());
  for (const auto& step : slots_seen) {
    std::vector<int32_t> sorted = step;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end()) << "two sequences share a slot";
    for (int32_t s : step) EXPECT_TRUE(s >= 0 && s < eo.max_num_seqs) << "slot " << s;
  }
}

// A small Qwen3 config.json with the real Qwen2 tokenizer's vocabulary (head_dim 64: the GPU kernels' smallest).
std::string write_small_qwen3(const std::string& name) {
  const std::string dir = make_temp_dir(name);
  {
    std::FILE* f = std::fopen((dir + "/config.json").c_str(), "w");
    if (f == nullptr) throw Error("cannot write " + dir + "/config.json");
    std::fputs(R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
      "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 64, "vocab_size": 151936, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
      "rope_theta": 1000000, "tie_word_embeddings": false, "eos_token_id": 151645, "bos_token_id": 151643})",
               f);
    std::fclose(f);
  }
  return dir;
}

std::string run_command(const std::string& cmd, int* rc) {
  std::FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *rc = -1;
    return "popen failed: " + cmd;
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  *rc = pclose(p);
  return out;
}

// The binary: `inference_rank --device cuda --random-weights` on a config.json of any size, streaming tokens and
// reporting TPOT.
TEST(GpuEngine, InferenceRankBinaryRunsRandomWeightsOnTheGpu) {
  const std::string dir = write_small_qwen3("gpu_cli");
  const std::string tok = data_path("tokenizers/qwen2");
  int rc = 0;
  const std::string out = run_command(binary_dir() + "/inference_rank/inference_rank --model " + dir +
                                          " --device cuda --random-weights --tokenizer " + tok +
                                          " --prompt 'The capital of France is' --prompt 'One two three' "
                                          "--max-tokens 24 --ignore-eos 2>&1",
                                      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("generated_tokens=48"), std::string::npos) << out;
  EXPECT_NE(out.find("=== prompt 1 ==="), std::string::npos) << out;
  // The synchronous references run on the GPU too (gpu_sync_selection.h): both prompts decode sparsely.
  for (const std::string sel : {"oracle", "quest"}) {
    const std::string ref = run_command(binary_dir() + "/inference_rank/inference_rank --model " + dir +
                                            " --device cuda --random-weights --tokenizer " + tok +
                                            " --prompt 'The capital of France is' --prompt 'One two three' "
                                            "--max-tokens 24 --ignore-eos --selection " + sel +
                                            " --sparse-threshold 8 --token-budget 8 --local-window 4 2>&1",
                                        &rc);
    EXPECT_EQ(rc, 0) << ref;
    EXPECT_NE(ref.find("generated_tokens=48"), std::string::npos) << ref;
    EXPECT_NE(ref.find("[spade] selection=" + sel + " device=cuda sparse_seq_steps="), std::string::npos) << ref;
    EXPECT_EQ(ref.find("sparse_seq_steps=0 "), std::string::npos) << ref;
  }
  // Bad input: a knob of the predicted selection given to a reference is refused with a clear error.
  const std::string err = run_command(binary_dir() + "/inference_rank/inference_rank --model " + dir +
                                          " --device cuda --random-weights --tokenizer " + tok +
                                          " --prompt hi --selection oracle --query-window 4 2>&1",
                                      &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("--query-window does not apply to --selection oracle --device cuda"), std::string::npos)
      << err;
}

// AsyncSpade in the binary: `--selection predicted` pairs the GPU forward pass with the in-process GPU cache rank
// (CudaIpcLink). The prompts pass the sparse threshold during prefill, so the very first step already ships its
// q|k|v rows while the cache rank's receives are pending: the first launch of any kernel then (a
// cudaFuncSetAttribute, a library's first use) would stall until the link's deadline and fail the pair. Kernel
// set-up and the warm-up pass happen before the hello, so the run must decode sparsely with no cache-rank error.
TEST(GpuEngine, InferenceRankBinaryDecodesSparselyWithTheInProcessCacheRank) {
  const std::string dir = write_small_qwen3("gpu_cli_sparse");
  const std::string tok = data_path("tokenizers/qwen2");
  std::string prompt;
  for (int i = 0; i < 12; ++i) prompt += "The quick brown fox jumps over the lazy dog near the river bank. ";
  int rc = 0;
  const std::string out = run_command(
      binary_dir() + "/inference_rank/inference_rank --model " + dir + " --device cuda --random-weights --tokenizer " +
          tok + " --prompt '" + prompt + "' --prompt '" + prompt + "A second one.' --max-tokens 64 --ignore-eos " +
          "--selection predicted --sparse-threshold 96 --token-budget 64 --local-window 16 --delta-capacity 16 " +
          "--layers-per-pack 1 2>&1",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("generated_tokens=128"), std::string::npos) << out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("sparse_seq_steps=(\\d+) switches=(\\d+) failed=(\\d+) "
                                                   "cache_selections=(\\d+)")))
      << out;
  EXPECT_GE(std::stoll(m[1].str()), 2 * 48) << out;  // both sequences decode sparsely for most of their tokens
  EXPECT_EQ(m[3].str(), "0") << out;
  EXPECT_GT(std::stoll(m[4].str()), 0) << out;
  // The sparse sequences' pages outside the local window were freed (page dropping).
  std::smatch md;
  ASSERT_TRUE(std::regex_search(out, md, std::regex("dropped_pages=(\\d+)"))) << out;
  EXPECT_GT(std::stoll(md[1].str()), 0) << out;
  EXPECT_EQ(out.find("cache_rank_error"), std::string::npos) << out;
  EXPECT_EQ(out.find("not complete"), std::string::npos) << out;
}

}  // namespace
}  // namespace spade
