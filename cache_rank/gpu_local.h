// A GPU cache rank inside the inference rank's process: `inference_rank --device cuda --selection
// predicted` and the gpu tests. A GpuCacheServer on its own thread, paired with the caller over a CudaIpcLink on the
// same GPU (both ends in this process), serving the plans the caller's GpuSparseController sends.
//
// The split into two ranks stays real on the wire (the same plan / rows / delta messages as between two processes
// or two GPUs), but both ranks share one GPU's SMs and HBM: this is the single-GPU deployment, not the overlap
// measurement (bench/bench_tpot --link for that).
//
// Both ends in one process need CUDA_DEVICE_MAX_CONNECTIONS >= 16 and CUDA_MODULE_LOADING=EAGER in the environment
// before CUDA starts (transport/cuda_ipc/cuda_ipc_link.h); inference_rank sets both, the constructor warns when they
// are missing.
//
// CUDA_LAUNCH_BLOCKING=1 is refused (the constructor throws): it turns each stream wait of the link into a wait of the
// posting thread, and the two ends' threads then wait for each other (the cache rank's first plan receive blocks its
// start-up, which the inference side waits for before it sends that plan).
//
// Errors: the constructor throws spade::Error for bad options (GpuCacheServer's), CUDA_LAUNCH_BLOCKING set, or a link
// that cannot be set up.
// A server failure (malformed plan, CUDA error, link abort) ends the thread; error() then names it and the link is
// aborted with it, so the inference side fails its sparse sequences and goes on densely.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "cache_rank/gpu_server.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"

namespace spade::cache {

class LocalGpuCacheRank {
 public:
  /// `attn_cfg`: the model's attention view. `own` (copied): the pair's settings as parsed, of which the cache rank
  /// uses its own knobs (query window, predictor, ridge eps, GQA rule, successor expansion, score keys; the budget,
  /// window, pack size and delta capacity come from the hello: gpu_cache_options). The server thread starts in
  /// wait_ready() and waits up to `hello_timeout` for the inference side's hello (GpuSparseController::send_hello),
  /// which sizes the server. `op_timeout`: the link's deadline per posted transfer. Throws spade::Error if the link
  /// cannot be set up or CUDA_LAUNCH_BLOCKING is set (non-zero), naming it.
  LocalGpuCacheRank(const ModelConfig& attn_cfg, const pair::SparseConfig& own, int device,
                    std::chrono::milliseconds op_timeout = std::chrono::milliseconds(10000),
                    std::chrono::milliseconds hello_timeout = std::chrono::milliseconds(30000));
  /// Serves what the inference side already sent (until no plan comes for 500 ms), then stops the thread.
  ~LocalGpuCacheRank();
  LocalGpuCacheRank(const LocalGpuCacheRank&) = delete;
  LocalGpuCacheRank& operator=(const LocalGpuCacheRank&) = delete;

  /// The inference side's end of the link (send the hello on it, then give it to a GpuSparseController).
  transport::GpuLink& inference_link() { return *inf_; }
  /// The cache side's end (tests abort it to simulate a dead cache rank).
  transport::GpuLink& cache_link() { return *cache_; }
  /// Starts the server thread and waits until the hello came and the server is up (or failed: throws its error);
  /// call after the inference side's send_hello and before its first step. In one process, no CUDA call that synchronises the whole device may run
  /// while the server's receive of the next plan is pending: it would wait for that receive, and so for this
  /// process's own next plan. So the inference side allocates before the hello, and closes the stream
  /// (GpuSparseController::close) before it frees anything.
  void wait_ready(std::chrono::milliseconds timeout);
  /// Stops serving: the steps already sent are served first, until the close plan or 500 ms without a plan; a
  /// receive still pending then is released by aborting the link. Idempotent.
  void stop();
  /// GpuCacheOptions::pipeline of the server (default true); call before wait_ready().
  void set_pipeline(bool on) { pipeline_ = on; }
  /// The server's failure (including a bad or missing hello), empty while healthy.
  std::string error() const;
  /// Server counters (after stop(): final; before: a snapshot after the last served step).
  GpuCacheStats stats() const;

 private:
  void serve_loop(std::chrono::milliseconds hello_timeout);
  ModelConfig cfg_;
  pair::SparseConfig own_;
  int device_ = 0;
  bool pipeline_ = true;
  std::unique_ptr<transport::CudaIpcLink> inf_, cache_;
  std::unique_ptr<GpuCacheServer> server_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> serving_{false};  // the hello came and the server exists
  mutable std::mutex mu_;
  std::string error_;
  GpuCacheStats stats_;
  std::chrono::milliseconds hello_timeout_{30000};
  std::thread thread_;
};

}  // namespace spade::cache
