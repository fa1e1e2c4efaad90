// inference_rank --serve: the rank inside a cluster. Registers with the coordinator (launch environment: flags,
// torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or Open MPI's OMPI_COMM_WORLD_*), connects the data plane to
// its paired cache rank (UCX), then serves GenerateRequests routed by the coordinator with continuous batching,
// streaming GenerateChunks back. Sparse decoding is configured per rank (SparseOptions; a request may opt out or set
// its own threshold through SparseParams); with no cache rank in the world, or after the cache rank died, requests
// are decoded densely. A CancelRequest ends its request (FINISH_CANCELLED) and frees its KV here and on the cache
// rank. With metrics_port set it serves Prometheus metrics (inference_rank/rank_metrics.h), /health (main loop
// alive) and /ready (weights loaded, rendezvous done, data plane connected). With device "cuda" the forward pass runs
// on one GPU and the data plane is a GpuLink (see ServeOptions); per-request token budgets are not supported there.
#pragma once

#include <string>

#include "coordinator/launch_env.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"

namespace spade {

struct ServeOptions {
  std::string model_dir;
  coord::LaunchFlags launch;
  EngineOptions engine;
  SparseOptions sparse;
  std::chrono::milliseconds rendezvous_timeout{30000};
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 0;  // > 0: serve /metrics, /health, /ready there (common/status_endpoint.h)
  std::chrono::milliseconds health_timeout{30000};  // /health fails when the main loop stalls this long
  // GPU path (device "cuda"): the model in bf16 on GPU `gpu`, AsyncSpade over a GpuLink to a `cache_rank --device
  // cuda` (inference_rank/gpu_sparse.h). `gpu_link`: "nccl" (the cache rank on another GPU, NcclLink) or "ipc" (on the
  // same GPU, CudaIpcLink). The link's address goes through the coordinator (TRANSPORT_NCCL / TRANSPORT_CUDA_IPC);
  // the pair hello then sizes the cache rank from this rank's options.
  // The pair's settings come from `sparse` (delta_capacity included: inference_rank/sparse_planner.h
  // gpu_sparse_options). On the GPU its mode must be dense or predicted and its sink_tokens 0 (spade::Error).
  std::string device = "cpu";
  int gpu = 0;
  std::string gpu_link = "nccl";
  bool cuda_graphs = true;   // dense steps (and every step once the link failed)
};

/// Runs until the coordinator shuts the world down (returns 0) or a fatal error (returns non-zero, message on
/// stderr naming the peer).
int run_serve(const ServeOptions& opt);

}  // namespace spade
