// GPU forward pass behind the Engine (inference_rank/gpu_engine.h).
#include "inference_rank/gpu_engine.h"

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "kernels/layer_ops.cuh"
#include "kernels/sampling_ref.h"  // kernels::LogprobEntry

namespace spade {

namespace {
// Per logit row: seed u64, step u64, temperature f32, top_p f32, top_k i32, logprob top-n i32, logprob offset i32.
constexpr size_t kSampleParamBytes = 36;

int bucket_for(int batch) {
  int b = 1;
  while (b < batch) b *= 2;
  return b;
}
}  // namespace

GpuEngineOptions gpu_engine_options(const EngineOptions& e, bool cuda_graphs) {
  GpuEngineOptions g;
  g.engine = e;
  g.cuda_graphs = cuda_graphs;
  return g;
}

GpuModelOptions GpuEngineForward::model_options(const GpuEngineOptions& opt) {
  const EngineOptions& e = opt.engine;
  const int rows = std::max(e.max_num_batched_tokens, bucket_for(e.max_num_seqs));
  // GDN state slots: one per sequence the engine runs at once (graph padding rows use none: slot -1).
  return GpuModelOptions{rows, rows, e.max_num_seqs};
}

GpuEngineForward::GpuEngineForward(std::unique_ptr<GpuModel> model, const GpuEngineOptions& opt)
    : model_(std::move(model)), opt_(opt),
      max_pages_((std::max(opt.engine.max_model_len, 1) + opt.engine.page_size - 1) / opt.engine.page_size),
      kv_(model_->config().num_attention_layers(), opt.engine.num_pages + 1, opt.engine.page_size,
          model_->config().num_kv_heads, model_->config().head_dim),
      attention_(model_->config(), opt.engine.page_size, bucket_for(opt.engine.max_num_seqs)),
      steps_(std::max(opt.engine.max_num_batched_tokens, bucket_for(opt.engine.max_num_seqs)),
             bucket_for(opt.engine.max_num_seqs), max_pages_,
             std::max(opt.engine.max_num_batched_tokens, bucket_for(opt.engine.max_num_seqs)),
             opt.engine.num_pages + 1, model_->config().is_hybrid() ? opt.engine.max_num_seqs : 0) {
  SPADE_CHECK(!model_->config().is_hybrid() || model_->options().max_state_slots >= opt.engine.max_num_seqs,
              "GPU engine: the model holds {} GDN state slots for {} sequences at once (build it with "
              "model_options())",
              model_->options().max_state_slots, opt.engine.max_num_seqs);
  SPADE_CHECK(opt.engine.num_pages > 0 && opt.engine.max_model_len > 0,
              "GPU engine: num_pages and max_model_len must be set");
  max_rows_ = model_options(opt).max_logit_rows;
  sample_params_ = DeviceBuffer(static_cast<size_t>(max_rows_) * kSampleParamBytes, "GPU engine sampling parameters");
  sampled_ = DeviceBuffer(static_cast<size_t>(max_rows_) * 4, "GPU engine sampled tokens");
  logprob_entries_ = DeviceBuffer(static_cast<size_t>(max_rows_) * (kMaxTopLogprobs + 1) * sizeof(kernels::LogprobEntry),
                                  "GPU engine logprobs");
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "GPU engine stream");
}

GpuEngineForward::~GpuEngineForward() {
  graphs_.clear();
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void GpuEngineForward::set_sparse(GpuStepAttention* sparse) {
  if (sparse_ != nullptr && sparse != sparse_) {
    cuda_check(cudaStreamSynchronize(stream_), "GPU engine: stream before replacing the sparse controller");
    graphs_.clear();
  }
  sparse_ = sparse;
}

int GpuEngineForward::max_batch() const { return bucket_for(opt_.engine.max_num_seqs); }

int GpuEngineForward::warm_up() {
  SPADE_CHECK(sparse_ == nullptr, "GPU engine: warm_up() runs before set_sparse()");
  const int scratch = opt_.engine.num_pages, max_len = max_pages_ * opt_.engine.page_size;
  const bool hybrid = model_->config().is_hybrid();
  // `lens[b]` tokens of sequence b at positions 0.., every block-table entry on the scratch page; logits of the last
  // token of each sequence.
  const auto step = [&](const std::vector<int>& lens) {
    ForwardBatch fb;
    fb.max_pages = max_pages_;
    fb.cu_q_lens.push_back(0);
    for (size_t b = 0; b < lens.size(); ++b) {
      for (int t = 0; t < lens[b]; ++t) {
        fb.tokens.push_back(0);
        fb.positions.push_back(lens[b] == 1 ? 0 : t);
      }
      fb.cu_q_lens.push_back(static_cast<int32_t>(fb.tokens.size()));
      fb.seq_lens.push_back(lens[b]);
      fb.seq_ids.push_back(b);
      if (hybrid) fb.state_slots.push_back(-1);
      fb.logit_rows.push_back(static_cast<int32_t>(fb.tokens.size()) - 1);
    }
    fb.block_table.assign(lens.size() * static_cast<size_t>(max_pages_), scratch);
    run(fb);
    finish(fb);
  };
  // Every cuBLASLt kernel a step of up to max_num_batched_tokens rows can pick (chunked prefill makes any count).
  model_->warm_up_gemms(stream_);
  int steps = 0;
  // The largest prompt step: max_num_batched_tokens tokens over as few sequences as max_model_len allows.
  const int T = opt_.engine.max_num_batched_tokens;
  const int seqs = std::min(opt_.engine.max_num_seqs, (T + max_len - 1) / max_len);
  std::vector<int> lens(static_cast<size_t>(seqs), std::min(max_len, T / seqs));
  if (lens[0] > 1) {
    step(lens);
    ++steps;
  }
  for (int b = 1; b <= max_batch(); b *= 2) {
    step(std::vector<int>(static_cast<size_t>(std::min(b, opt_.engine.max_num_seqs)), 1));
    ++steps;
  }
  return steps;
}

void GpuEngineForward::run(const ForwardBatch& fb) {
  const int T = fb.total_tokens(), B = fb.batch();
  SPADE_CHECK(fb.max_pages <= max_pages_, "GPU engine: block table of {} pages exceeds max_model_len's {}",
              fb.max_pages, max_pages_);
  const bool decode = T == B && static_cast<int>(fb.logit_rows.size()) == B;
  // The sparse controller first: its plan and per-row arrays decide whether this step may run as a graph (a dense
  // one once the link is gone, or a link step's graph with external event nodes and the sends after the launch).
  if (sparse_ != nullptr) sparse_->begin_step(fb, stream_);
  const bool link_graph =
      decode && opt_.cuda_graphs && opt_.link_graphs && sparse_ != nullptr && sparse_->link_graph_ok(fb);
  const bool graphs = opt_.cuda_graphs && (sparse_ == nullptr || sparse_->graph_safe(fb) || link_graph);
  const int rows = decode && graphs ? bucket_for(B) : B;  // graph bucket: pad with scratch sequences
  const int scratch_page = opt_.engine.num_pages;
  GpuStepHost h;
  h.tokens = fb.tokens;
  h.positions = fb.positions;
  h.cu_q_lens = fb.cu_q_lens;
  h.seq_lens = fb.seq_lens;
  h.logit_rows = fb.logit_rows;
  h.state_slots = fb.state_slots;
  h.max_pages = max_pages_;
  h.block_table.assign(static_cast<size_t>(rows) * max_pages_, -1);
  for (int b = 0; b < B; ++b) {
    std::copy(fb.block_table.begin() + static_cast<long>(b) * fb.max_pages,
              fb.block_table.begin() + static_cast<long>(b + 1) * fb.max_pages,
              h.block_table.begin() + static_cast<long>(b) * max_pages_);
    for (int t = fb.cu_q_lens[b]; t < fb.cu_q_lens[b + 1]; ++t) h.seq_idx.push_back(b);
  }
  // Padding: one token at position 0 on the scratch page (logits ignored); hybrid models: state slot -1 (a zero state
  // in, nothing stored).
  for (int b = B; b < rows; ++b) {
    if (!h.state_slots.empty()) h.state_slots.push_back(-1);
    h.logit_rows.push_back(static_cast<int32_t>(h.tokens.size()));
    h.tokens.push_back(0);
    h.positions.push_back(0);
    h.seq_idx.push_back(b);
    h.cu_q_lens.push_back(b + 1);
    h.seq_lens.push_back(1);
    h.block_table[static_cast<size_t>(b) * max_pages_] = scratch_page;
  }
  if (decode && graphs) h.max_seq_len = max_pages_ * opt_.engine.page_size;
  const GpuBatch batch = steps_.upload(h, stream_);
  if (link_graph) sparse_->set_layout_rows(rows);  // the graph's padded rows per layer in the send buffers
  GpuAttention& attention = sparse_ != nullptr ? static_cast<GpuAttention&>(*sparse_) : attention_;
  if (decode && graphs) {
    // Graphs by batch bucket; a link step's by bucket and controller variant (arrays parity, sparse or dense).
    const int key = link_graph ? rows * 8 + 4 + sparse_->graph_variant() : rows * 8;
    auto& g = graphs_[key];
    if (!g) {
      g = std::make_unique<GpuGraph>();
      if (link_graph) sparse_->set_capturing(true);
      try {
        g->capture(stream_, [&](cudaStream_t s) { model_->forward(batch, kv_, attention, s); });
      } catch (...) {
        if (link_graph) sparse_->set_capturing(false);
        g.reset();
        throw;
      }
      if (link_graph) sparse_->set_capturing(false);
    }
    g->launch(stream_);
    if (link_graph) sparse_->ship_graph_step();
    ++graph_steps_;
    if (link_graph) ++link_graph_steps_;
  } else {
    model_->forward(batch, kv_, attention, stream_);
    ++eager_steps_;
  }
  if (sparse_ != nullptr) sparse_->end_step(stream_);
}

void GpuEngineForward::finish(const ForwardBatch& fb) {
  int32_t flag = 0;
  cuda_check(cudaMemcpyAsync(&flag, steps_.error_flag(), 4, cudaMemcpyDeviceToHost, stream_), "GPU engine: flag");
  cuda_check(cudaStreamSynchronize(stream_), "GPU engine: step");
  SPADE_CHECK(flag == 0, "GPU engine: the step of {} sequences / {} tokens has a token id, position or page outside "
              "the model / KV pool", fb.batch(), fb.total_tokens());
}

void GpuEngineForward::operator()(const ForwardBatch& fb, std::vector<float>& logits) {
  run(fb);
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  logits.resize(fb.logit_rows.size() * vocab);
  cuda_check(cudaMemcpyAsync(logits.data(), model_->logits(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_),
             "GPU engine: logits");
  finish(fb);
}

void GpuEngineForward::sample(const ForwardBatch& fb, const std::vector<RowSampling>& rows,
                              std::vector<int32_t>& tokens, std::vector<TokenLogprobs>& logprobs) {
  const int R = static_cast<int>(fb.logit_rows.size());
  const int vocab = model_->config().vocab_size;
  SPADE_CHECK(static_cast<int>(rows.size()) == R, "GPU engine: {} sampling rows for {} logit rows", rows.size(), R);
  SPADE_CHECK(R <= max_rows_, "GPU engine: {} logit rows exceed the {} the step buffers hold", R, max_rows_);
  // One upload of the rows' parameters: [seeds u64][steps u64][temperature f32][top_p f32][top_k i32][logprob top-n
  // i32][logprob offset i32], R each. Rows asking for logprobs get n + 1 entries each in logprob_entries_.
  std::vector<uint8_t>& h = sample_host_;
  h.assign(static_cast<size_t>(R) * kSampleParamBytes, 0);
  auto* seeds = reinterpret_cast<uint64_t*>(h.data());
  auto* steps = seeds + R;
  auto* temp = reinterpret_cast<float*>(steps + R);
  auto* top_p = temp + R;
  auto* top_k = reinterpret_cast<int32_t*>(top_p + R);
  auto* lp_n = top_k + R;
  auto* lp_off = lp_n + R;
  int entries = 0;
  for (int r = 0; r < R; ++r) {
    seeds[r] = rows[r].params.seed;
    steps[r] = rows[r].step;
    temp[r] = rows[r].params.temperature;
    top_p[r] = rows[r].params.top_p;
    top_k[r] = rows[r].params.top_k;
    SPADE_CHECK(rows[r].logprobs <= kMaxTopLogprobs, "GPU engine: row {} asks for {} top logprobs (at most {})", r,
                rows[r].logprobs, kMaxTopLogprobs);
    lp_n[r] = rows[r].logprobs < 0 ? -1 : std::min(rows[r].logprobs, vocab);
    lp_off[r] = entries;
    if (lp_n[r] >= 0) entries += lp_n[r] + 1;
  }
  run(fb);
  char* d = sample_params_.as<char>();
  cuda_check(cudaMemcpyAsync(d, h.data(), h.size(), cudaMemcpyHostToDevice, stream_), "GPU engine: sampling params");
  kernels::SampleParams p;
  p.logits_dtype = DType::F32;
  p.logits = model_->logits();
  p.seeds = reinterpret_cast<const uint64_t*>(d);
  p.steps = p.seeds + R;
  p.temperature = reinterpret_cast<const float*>(p.steps + R);
  p.top_p = p.temperature + R;
  p.top_k = reinterpret_cast<const int32_t*>(p.top_p + R);
  p.out_tokens = sampled_.as<int32_t>();
  p.rows = R;
  p.vocab = vocab;
  cuda_check(kernels::sample_rows(p, stream_), "GPU engine: sampling");
  std::vector<kernels::LogprobEntry>& lp_host = logprob_host_;
  lp_host.resize(static_cast<size_t>(entries));
  if (entries > 0) {  // from the same logits, on the device: n + 1 (logprob, id) pairs per row come back
    kernels::LogprobParams lp;
    lp.logits_dtype = DType::F32;
    lp.logits = model_->logits();
    lp.tokens = p.out_tokens;
    lp.top_n = p.top_k + R;
    lp.out_offset = lp.top_n + R;
    lp.out = logprob_entries_.as<kernels::LogprobEntry>();
    lp.rows = R;
    lp.vocab = vocab;
    cuda_check(kernels::logprob_rows(lp, stream_), "GPU engine: logprobs");
    cuda_check(cudaMemcpyAsync(lp_host.data(), lp.out, lp_host.size() * sizeof(kernels::LogprobEntry),
                               cudaMemcpyDeviceToHost, stream_),
               "GPU engine: logprobs");
  }
  tokens.resize(R);
  cuda_check(cudaMemcpyAsync(tokens.data(), sampled_.get(), static_cast<size_t>(R) * 4, cudaMemcpyDeviceToHost,
                             stream_),
             "GPU engine: sampled tokens");
  finish(fb);
  logprobs.assign(static_cast<size_t>(R), TokenLogprobs{});
  for (int r = 0; r < R; ++r) {
    if (lp_n[r] < 0) continue;
    const kernels::LogprobEntry* e = lp_host.data() + lp_off[r];
    SPADE_CHECK(e[0].id == tokens[r], "GPU engine: the logprobs of row {} are for token {}, sampled {}", r, e[0].id,
                tokens[r]);
    TokenLogprobs& t = logprobs[static_cast<size_t>(r)];
    t.logprob = e[0].logprob;
    for (int i = 1; i <= lp_n[r]; ++i) {
      t.top_ids.push_back(e[i].id);
      t.top_logprobs.push_back(e[i].logprob);
    }
  }
}

}  // namespace spade
