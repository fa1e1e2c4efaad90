// inference_rank --serve: the rank inside a cluster. Registers with the coordinator (launch environment: flags,
// torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or Open MPI's OMPI_COMM_WORLD_*), connects the data plane to
// its paired cache rank (UCX), then serves GenerateRequests routed by the coordinator with continuous batching,
// streaming GenerateChunks back. Sparse decoding is configured per rank (SparseOptions; a request may opt out or set
// its own threshold through SparseParams); with no cache rank in the world, or after the cache rank died, requests
// are decoded densely. A CancelRequest ends its request (FINISH_CANCELLED) and frees its KV here and on the cache
// rank. With metrics_port set it serves Prometheus metrics (inference_rank/rank_metrics.h), /health (main loop
// alive) and /ready (weights loaded, rendezvous done, data plane connected). With device "cuda" the forward pass runs
// on one GPU and the data plane is a GpuLink (see ServeOptions); per-request token budgets are not supported there.
//
// Every field of a GenerateRequest is checked before the request reaches the engine: a rejected request is answered
// with one FINISH_ERROR chunk ("invalid request: ..." naming the field) and never runs. A PeerDown for the paired
// cache rank (the coordinator's heartbeat deadline, or its connection dropped) aborts the data-plane link at once,
// from the coordinator client's I/O thread, also while a step is waiting on that link: the sparse requests in flight
// fail naming the cache rank, every other and every new request decodes densely, and the pair reports itself
// degraded (/ready 200 {"status":"degraded"}, spade_pair_degraded 1) while /health stays 200. When a replacement
// cache rank registers (PeerReplaced), the rank offers it the data plane again through the coordinator (PairOffer; on
// the GPU a fresh NCCL / CUDA IPC offer), connects on a thread of its own within the rendezvous timeout and swaps the
// new link in between two steps: requests admitted before stay dense to their end, new ones decode sparsely, the pair
// is whole again (/ready, spade_pair_degraded 0). A failed re-handshake leaves it degraded, saying why.
//
// The units: run_serve (serve.cpp: setup, the loop, shutdown), the pair side (serve_pairing.h: PairHealth and the
// CPU / GPU DataPlane: links, engine, PeerDown / PeerReplaced, the pair's statistics) and the request side
// (serve_requests.h: parse_request and the RequestTable: intake, cancellation, chunks).
#pragma once

#include <chrono>
#include <string>
#include <utility>

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

/// One pass of the serving loop's request intake: hands `handle` every request that `next(deadline)` yields (an
/// std::optional), until it yields none. Only the first call waits, up to `first_deadline` (the loop passes now plus
/// its idle wait when nothing is running, else now); the later calls pass a deadline in the past and take only what
/// has already arrived, so a request that reaches an idle rank starts with the next step. Returns how many were
/// taken.
template <class Next, class Handle>
int take_requests(Next&& next, std::chrono::steady_clock::time_point first_deadline, Handle&& handle) {
  int taken = 0;
  auto deadline = first_deadline;
  while (auto r = next(deadline)) {
    handle(std::move(*r));
    ++taken;
    deadline = std::chrono::steady_clock::time_point{};  // the clock's epoch: already passed
  }
  return taken;
}

/// Runs until the coordinator shuts the world down (returns 0) or a fatal error (returns non-zero, message on
/// stderr naming the peer).
int run_serve(const ServeOptions& opt);

}  // namespace spade
