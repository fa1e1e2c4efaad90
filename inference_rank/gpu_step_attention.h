// What GpuEngineForward (gpu_engine.h) calls around each step's forward pass when the attention is not plain dense:
// GpuSparseController (gpu_sparse.h, sparse decoding through cache ranks) and GpuSyncSelection
// (gpu_sync_selection.h, the synchronous fidelity references with the true query) implement it.
#pragma once

#include <cuda_runtime_api.h>

#include "inference_rank/gpu_model.h"
#include "inference_rank/model.h"

namespace spade {

class GpuStepAttention : public GpuAttention {
 public:
  /// Before the step's forward (and its upload): decides every row's attention and enqueues what the step reads (per-row
  /// arrays) on `stream`. `fb` is the engine's step.
  virtual void begin_step(const ForwardBatch& fb, cudaStream_t stream) = 0;
  /// After the step's forward was enqueued on `stream`.
  virtual void end_step(cudaStream_t stream) = 0;
  /// After begin_step: whether the step `fb` may run as, or be captured into, a dense CUDA graph.
  virtual bool graph_safe(const ForwardBatch& fb) const = 0;
  /// After begin_step: whether this decode-only step may run as a link step's CUDA graph (graph_variant() picks it,
  /// set_layout_rows / set_capturing / ship_graph_step drive it: gpu_sparse.h). Default: never.
  virtual bool link_graph_ok(const ForwardBatch& fb) const {
    (void)fb;
    return false;
  }
  virtual int graph_variant() const { return 0; }
  virtual void set_layout_rows(int rows) { (void)rows; }
  virtual void set_capturing(bool on) { (void)on; }
  virtual void ship_graph_step() {}
};

}  // namespace spade
