// CPU reference of the attention output gate (see output_gate_ref.h).
#include "kernels/output_gate_ref.h"

#include "common/error.h"
#include "kernels/gdn_gating_ref.h"

namespace spade::kernels {

void output_gate_ref(float* out, const float* gate, int gate_stride, int tokens, int dim) {
  SPADE_CHECK(out != nullptr && gate != nullptr, "output_gate_ref: out and gate must be set");
  SPADE_CHECK(tokens >= 0 && dim > 0 && gate_stride >= dim, "output_gate_ref: tokens {} / dim {} / gate_stride {} invalid",
              tokens, dim, gate_stride);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < dim; ++i)
      out[static_cast<size_t>(t) * dim + i] *= sigmoid_ref(gate[static_cast<size_t>(t) * gate_stride + i]);
}

}  // namespace spade::kernels
