// In-process GPU cache rank (see gpu_local.h).
#include "cache_rank/gpu_local.h"

#include <cuda_runtime_api.h>

#include "common/error.h"
#include "inference_rank/gpu_model.h"

namespace spade::cache {

LocalGpuCacheRank::LocalGpuCacheRank(const ModelConfig& attn_cfg, SelectionConfig selection, int device,
                                     std::chrono::milliseconds op_timeout, std::chrono::milliseconds hello_timeout)
    : cfg_(attn_cfg), selection_(selection), device_(device) {
  transport::CudaIpcLinkOptions lo;
  lo.device = device;
  lo.op_timeout = op_timeout;
  inf_ = transport::CudaIpcLink::create("cache rank (in-process, GPU " + std::to_string(device) + ")", lo);
  cache_ = transport::CudaIpcLink::open(inf_->address(), "inference rank (in-process)", lo);
  inf_->connect();
  thread_ = std::thread([this, hello_timeout] { serve_loop(hello_timeout); });
}

LocalGpuCacheRank::~LocalGpuCacheRank() {
  stop();
  server_.reset();
  cache_.reset();
  inf_.reset();
}

void LocalGpuCacheRank::serve_loop(std::chrono::milliseconds hello_timeout) {
  try {
    cuda_check(cudaSetDevice(device_), "in-process cache rank: cudaSetDevice");
    const std::string peer = "inference rank (in-process)";
    const GpuPairHello hello = recv_gpu_hello(*cache_, cfg_, peer, hello_timeout);
    server_ = std::make_unique<GpuCacheServer>(cfg_, gpu_cache_options(hello, selection_, device_), *cache_, peer);
    serving_ = true;
    for (;;) {
      const bool stopping = stop_.load();
      const bool served = server_->serve_step(std::chrono::milliseconds(stopping ? 500 : 20));
      if (served) {
        std::lock_guard<std::mutex> lk(mu_);
        stats_ = server_->stats();
      }
      if (stopping && !served) break;
    }
    server_->synchronize();
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      error_ = e.what();
    }
    cache_->abort(std::string("the in-process cache rank failed: ") + e.what());
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (server_) stats_ = server_->stats();
}

void LocalGpuCacheRank::stop() {
  stop_ = true;
  // Still waiting for a hello that will not come: end the wait now rather than at its deadline.
  if (!serving_ && thread_.joinable()) cache_->abort("the in-process cache rank was stopped before the pair hello");
  if (thread_.joinable()) thread_.join();
}

std::string LocalGpuCacheRank::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

GpuCacheStats LocalGpuCacheRank::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

}  // namespace spade::cache
