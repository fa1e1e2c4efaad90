// CPU reference: SwiGLU activation of a fused gate/up projection (Shazeer 2020): out = silu(gate) * up.
#pragma once

namespace spade::kernels {

/// gate, up: [rows, dim] fp32; out: [rows, dim] fp32 (may alias gate).
void swiglu_ref(const float* gate, const float* up, float* out, int rows, int dim);

}  // namespace spade::kernels
