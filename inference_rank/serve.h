// inference_rank --serve: the rank inside a cluster. Registers with the coordinator (launch environment: flags,
// torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or Open MPI's OMPI_COMM_WORLD_*), connects the data plane to
// its paired cache rank (UCX), then serves GenerateRequests routed by the coordinator with continuous batching,
// streaming GenerateChunks back. Sparse decoding is configured per rank (SparseOptions); with no cache rank in the
// world, or after the cache rank died, requests are decoded densely.
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
};

/// Runs until the coordinator shuts the world down (returns 0) or a fatal error (returns non-zero, message on
/// stderr naming the peer).
int run_serve(const ServeOptions& opt);

}  // namespace spade
