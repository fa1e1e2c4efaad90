// The small GQA model shape the pack-wire and selector unit tests share (no checkpoint behind it).
#pragma once

#include "common/config.h"

namespace spade::test {

/// `num_layers` layers, 4 query heads over 2 KV heads of dim 8, hidden size 32.
inline ModelConfig small_cfg(int num_layers = 2) {
  ModelConfig c;
  c.num_layers = num_layers;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.hidden_size = 32;
  return c;
}

}  // namespace spade::test
