// The checkpoint the multi-process GPU tests serve: a make_demo_checkpoint Qwen3 model with head_dim 64 (the GPU
// kernels' smallest; stories260K's head_dim 8 runs on the CPU path only), 4 layers, 4 query / 2 KV heads, random
// weights (seed 5), written once per test binary into a fresh temporary directory named ".../ckpt".
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>

#include "tests/inference_rank/cluster_client.h"
#include "tests/test_util.h"

namespace spade::test {

inline const std::string& gpu_demo_checkpoint() {
  static const std::string dir = [] {
    const std::string d = make_temp_dir("spade_gpu_cluster") + "/ckpt";
    ChildProcess mk(bin("inference_rank/make_demo_checkpoint"),
                    {"--out", d, "--hidden", "256", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--head-dim",
                     "64", "--intermediate", "512", "--seed", "5"},
                    {}, "make_demo_checkpoint");
    if (mk.wait_exit(std::chrono::seconds(60)) != 0) throw std::runtime_error("make_demo_checkpoint failed:\n" + mk.log());
    return d;
  }();
  return dir;
}

}  // namespace spade::test
