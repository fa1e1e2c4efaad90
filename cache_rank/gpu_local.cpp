// In-process GPU cache rank (see gpu_local.h).
#include "cache_rank/gpu_local.h"

#include <cuda_runtime_api.h>

#include "common/error.h"

namespace spade::cache {

LocalGpuCacheRank::LocalGpuCacheRank(const ModelConfig& attn_cfg, GpuCacheOptions opts,
                                     std::chrono::milliseconds op_timeout) {
  transport::CudaIpcLinkOptions lo;
  lo.device = opts.device;
  lo.op_timeout = op_timeout;
  inf_ = transport::CudaIpcLink::create("cache rank (in-process, GPU " + std::to_string(opts.device) + ")", lo);
  cache_ = transport::CudaIpcLink::open(inf_->address(), "inference rank (in-process)", lo);
  inf_->connect();
  server_ = std::make_unique<GpuCacheServer>(attn_cfg, opts, *cache_, "inference rank (in-process)");
  thread_ = std::thread([this] { serve_loop(); });
}

LocalGpuCacheRank::~LocalGpuCacheRank() {
  stop();
  server_.reset();
  cache_.reset();
  inf_.reset();
}

void LocalGpuCacheRank::serve_loop() {
  try {
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
  stats_ = server_->stats();
}

void LocalGpuCacheRank::stop() {
  stop_ = true;
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
