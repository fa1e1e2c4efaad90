// In-process GPU cache rank (see gpu_local.h).
#include "cache_rank/gpu_local.h"

#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "common/error.h"
#include "kernels/device.h"
#include "kernels/selection.cuh"

namespace spade::cache {

LocalGpuCacheRank::LocalGpuCacheRank(const ModelConfig& attn_cfg, const pair::SparseConfig& own, int device,
                                     std::chrono::milliseconds op_timeout, std::chrono::milliseconds hello_timeout)
    : cfg_(attn_cfg), own_(own), device_(device) {
  const char* blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
  SPADE_CHECK(blocking == nullptr || std::atoi(blocking) == 0,
              "in-process cache rank: CUDA_LAUNCH_BLOCKING={} is set: it makes every stream wait of the link block "
              "the thread that posts it, so the cache rank's receive of the first plan would block its start-up "
              "until that plan comes, and the inference side sends it only once the start-up is done (a hang); "
              "unset CUDA_LAUNCH_BLOCKING (compute-sanitizer checks kernels without it)",
              blocking);
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (conn == nullptr || std::atoi(conn) < 16)
    spdlog::warn("in-process cache rank: CUDA_DEVICE_MAX_CONNECTIONS is {} (set it to 32 before CUDA starts): the "
                 "two ranks' streams may serialise on shared hardware queues",
                 conn == nullptr ? "unset" : conn);
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  if (loading == nullptr || std::string(loading) != "EAGER")
    spdlog::warn("in-process cache rank: CUDA_MODULE_LOADING is {} (set it to EAGER before CUDA starts): a lazy "
                 "kernel load may synchronise the context while the other rank waits on this thread",
                 loading == nullptr ? "unset (lazy)" : loading);
  transport::CudaIpcLinkOptions lo;
  lo.device = device;
  lo.op_timeout = op_timeout;
  inf_ = transport::CudaIpcLink::create("cache rank (in-process, GPU " + std::to_string(device) + ")", lo);
  // Kernel set-up on this rank's device, while nothing is pending on the link (kernels/selection.cuh).
  cuda_check(cudaSetDevice(device), "in-process cache rank: cudaSetDevice");
  cuda_check(kernels::prepare_selection_kernels(), "in-process cache rank: selection kernels set-up");
  cache_ = transport::CudaIpcLink::open(inf_->address(), "inference rank (in-process)", lo);
  inf_->connect();
  hello_timeout_ = hello_timeout;
  // The thread starts in wait_ready(): its first act is a receive that stays posted until the hello comes, and
  // the inference side still allocates (GpuSparseController) before it sends the hello.
}

LocalGpuCacheRank::~LocalGpuCacheRank() {
  stop();
  server_.reset();
  cache_.reset();
  inf_.reset();
}

void LocalGpuCacheRank::serve_loop(std::chrono::milliseconds hello_timeout) {
  using Clock = std::chrono::steady_clock;
  // For the failure log: when the current serve_step call began (a step's enqueueing takes a few ms; a call that ran
  // much longer was blocked inside CUDA).
  Clock::time_point in_step{};
  uint64_t served_steps = 0;
  try {
    cuda_check(cudaSetDevice(device_), "in-process cache rank: cudaSetDevice");
    const std::string peer = "inference rank (in-process)";
    const GpuPairHello hello = recv_gpu_hello(*cache_, cfg_, peer, hello_timeout);
    {
      std::lock_guard<std::mutex> lk(mu_);
      SPADE_CHECK(!stop_, "the in-process cache rank was stopped before it started serving");
    }
    GpuCacheOptions opts = gpu_cache_options(hello, own_, device_);
    opts.pipeline = pipeline_;
    auto server = std::make_unique<GpuCacheServer>(cfg_, opts, *cache_, peer);
    {
      std::lock_guard<std::mutex> lk(mu_);
      server_ = std::move(server);
      serving_ = true;
    }
    for (;;) {
      const bool stopping = stop_.load();
      in_step = Clock::now();
      const bool served = server_->serve_step(std::chrono::milliseconds(stopping ? 500 : 20));
      in_step = {};
      if (served) {
        ++served_steps;
        std::lock_guard<std::mutex> lk(mu_);
        stats_ = server_->stats();
      }
      if (server_->closed() || (stopping && !served)) break;
    }
    server_->synchronize();
    // Still a receive pending (no close plan came): release it, or every later device-wide sync would wait on it.
    if (!server_->closed()) cache_->abort("the in-process cache rank stopped without the inference side's close");
  } catch (const std::exception& e) {
    if (in_step != Clock::time_point{})
      spdlog::warn("in-process cache rank: failed in its step after {} served steps; the failing serve_step call had "
                   "run {} ms (a plan wait returns every 20 ms: longer means the thread was blocked in a CUDA call)",
                   served_steps,
                   std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - in_step).count());
    {
      std::lock_guard<std::mutex> lk(mu_);
      error_ = e.what();
    }
    cache_->abort(std::string("the in-process cache rank failed: ") + e.what());
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (server_) stats_ = server_->stats();
}

void LocalGpuCacheRank::wait_ready(std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    SPADE_CHECK(!stop_, "the in-process cache rank was stopped");
    if (!thread_.joinable()) thread_ = std::thread([this] { serve_loop(hello_timeout_); });
  }
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      SPADE_CHECK(error_.empty(), "{}", error_);
      if (serving_) return;
    }
    SPADE_CHECK(std::chrono::steady_clock::now() < until, "the in-process cache rank did not start within {} ms",
                timeout.count());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void LocalGpuCacheRank::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    // Still waiting for a hello that will not come: end the wait now rather than at its deadline.
    if (!serving_ && thread_.joinable()) cache_->abort("the in-process cache rank was stopped before the pair hello");
  }
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
