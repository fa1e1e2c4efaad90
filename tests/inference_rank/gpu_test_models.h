// Small model configs the GPU tests share: shapes the GPU kernels accept (head_dim 64, their smallest), weights
// from GpuModel::random or weights.h random_source.
#pragma once

#include "common/config.h"

namespace spade::test {

/// Qwen3-like: 3 layers, hidden 256, 4 query / 2 KV heads of 64 (GQA 2), q/k norm, untied head, vocabulary 1024.
inline ModelConfig qwen3_like() {
  ModelConfig c;
  c.model_type = "qwen3";
  c.arch = ModelArch::Qwen3;
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 3;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.vocab_size = 1024;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.tie_word_embeddings = false;
  c.qk_norm = true;
  return c;
}

}  // namespace spade::test
