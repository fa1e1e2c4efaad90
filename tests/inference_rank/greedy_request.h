// A greedy request that ignores EOS: the request most inference-rank tests send. Kept apart from request_helpers.h
// (which needs C++20 headers) so that CUDA test files can use it too.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "inference_rank/engine.h"

namespace spade::test {

/// A greedy request for `n` tokens of `ids` that ignores EOS.
inline GenerateRequest greedy(std::vector<int32_t> ids, int n) {
  GenerateRequest r;
  r.prompt_ids = std::move(ids);
  r.max_tokens = n;
  r.sampling.temperature = 0.f;
  r.ignore_eos = true;
  return r;
}

}  // namespace spade::test
