// GPU forward pass behind the Engine (inference_rank/gpu_engine.h).
#include "inference_rank/gpu_engine.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace spade {

namespace {
int bucket_for(int batch) {
  int b = 1;
  while (b < batch) b *= 2;
  return b;
}
}  // namespace

GpuEngineOptions gpu_engine_options(const EngineOptions& e, bool cuda_graphs) {
  GpuEngineOptions g;
  g.num_pages = e.num_pages;
  g.page_size = e.page_size;
  g.max_num_seqs = e.max_num_seqs;
  g.max_num_batched_tokens = e.max_num_batched_tokens;
  g.max_model_len = e.max_model_len;
  g.cuda_graphs = cuda_graphs;
  return g;
}

GpuModelOptions GpuEngineForward::model_options(const GpuEngineOptions& opt) {
  const int rows = std::max(opt.max_num_batched_tokens, bucket_for(opt.max_num_seqs));
  return GpuModelOptions{rows, rows};
}

GpuEngineForward::GpuEngineForward(std::unique_ptr<GpuModel> model, const GpuEngineOptions& opt)
    : model_(std::move(model)), opt_(opt),
      max_pages_((std::max(opt.max_model_len, 1) + opt.page_size - 1) / opt.page_size),
      kv_(model_->config().num_layers, opt.num_pages + 1, opt.page_size, model_->config().num_kv_heads,
          model_->config().head_dim),
      attention_(model_->config(), opt.page_size, bucket_for(opt.max_num_seqs)),
      steps_(std::max(opt.max_num_batched_tokens, bucket_for(opt.max_num_seqs)), bucket_for(opt.max_num_seqs),
             max_pages_, std::max(opt.max_num_batched_tokens, bucket_for(opt.max_num_seqs)), opt.num_pages + 1) {
  SPADE_CHECK(opt.num_pages > 0 && opt.max_model_len > 0, "GPU engine: num_pages and max_model_len must be set");
  cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "GPU engine stream");
}

GpuEngineForward::~GpuEngineForward() {
  graphs_.clear();
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void GpuEngineForward::operator()(const ForwardBatch& fb, std::vector<float>& logits) {
  const int T = fb.total_tokens(), B = fb.batch();
  SPADE_CHECK(fb.max_pages <= max_pages_, "GPU engine: block table of {} pages exceeds max_model_len's {}",
              fb.max_pages, max_pages_);
  const bool decode = T == B && static_cast<int>(fb.logit_rows.size()) == B;
  const int rows = decode && opt_.cuda_graphs ? bucket_for(B) : B;  // graph bucket: pad with scratch sequences
  const int scratch_page = opt_.num_pages;
  GpuStepHost h;
  h.tokens = fb.tokens;
  h.positions = fb.positions;
  h.cu_q_lens = fb.cu_q_lens;
  h.seq_lens = fb.seq_lens;
  h.logit_rows = fb.logit_rows;
  h.max_pages = max_pages_;
  h.block_table.assign(static_cast<size_t>(rows) * max_pages_, -1);
  for (int b = 0; b < B; ++b) {
    std::copy(fb.block_table.begin() + static_cast<long>(b) * fb.max_pages,
              fb.block_table.begin() + static_cast<long>(b + 1) * fb.max_pages,
              h.block_table.begin() + static_cast<long>(b) * max_pages_);
    for (int t = fb.cu_q_lens[b]; t < fb.cu_q_lens[b + 1]; ++t) h.seq_idx.push_back(b);
  }
  for (int b = B; b < rows; ++b) {  // padding: one token at position 0 on the scratch page (logits ignored)
    h.logit_rows.push_back(static_cast<int32_t>(h.tokens.size()));
    h.tokens.push_back(0);
    h.positions.push_back(0);
    h.seq_idx.push_back(b);
    h.cu_q_lens.push_back(b + 1);
    h.seq_lens.push_back(1);
    h.block_table[static_cast<size_t>(b) * max_pages_] = scratch_page;
  }
  if (decode && opt_.cuda_graphs) h.max_seq_len = max_pages_ * opt_.page_size;
  const GpuBatch batch = steps_.upload(h, stream_);
  if (decode && opt_.cuda_graphs) {
    auto& g = graphs_[rows];
    if (!g) {
      g = std::make_unique<GpuGraph>();
      g->capture(stream_, [&](cudaStream_t s) { model_->forward(batch, kv_, attention_, s); });
    }
    g->launch(stream_);
    ++graph_steps_;
  } else {
    model_->forward(batch, kv_, attention_, stream_);
    ++eager_steps_;
  }
  const int R = static_cast<int>(fb.logit_rows.size());
  const size_t vocab = static_cast<size_t>(model_->config().vocab_size);
  logits.resize(static_cast<size_t>(R) * vocab);
  int32_t flag = 0;
  cuda_check(cudaMemcpyAsync(logits.data(), model_->logits(), logits.size() * 4, cudaMemcpyDeviceToHost, stream_),
             "GPU engine: logits");
  cuda_check(cudaMemcpyAsync(&flag, steps_.error_flag(), 4, cudaMemcpyDeviceToHost, stream_), "GPU engine: flag");
  cuda_check(cudaStreamSynchronize(stream_), "GPU engine: step");
  SPADE_CHECK(flag == 0, "GPU engine: the step of {} sequences / {} tokens has a token id, position or page outside "
              "the model / KV pool", B, T);
}

}  // namespace spade
