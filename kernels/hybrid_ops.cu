// Layer ops of the hybrid Qwen3.5 decoder around the GDN kernels (see hybrid_ops.cuh): causal conv1d with its state,
// GDN gating, gated RMSNorm, attention output gate, state reset.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/hybrid_ops.cuh"
#include "kernels/kernel_common.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels {
namespace detail {
namespace {

__device__ __forceinline__ float sigmoid_dev(float x) { return 1.f / (1.f + __expf(-x)); }
// torch's softplus (beta 1, threshold 20); log1pf/expf (not the fast intrinsics): g feeds an exponential decay.
__device__ __forceinline__ float softplus_dev(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// ---- causal conv1d: outputs (one thread per (token, channel)) ----
constexpr int kConvThreads = 128;

struct ConvArgs {
  const void* x;
  int x_stride;
  const float* weight;
  const float* bias;
  void* out0;
  void* out1;
  void* out2;
  int split0, split1;
  float* state_pool;
  int num_slots;
  const int32_t* state_slots;
  const int32_t* cu_tokens;
  const int32_t* seq_idx;
  int channels, kernel;
  bool silu;
};

template <typename T>
__global__ void __launch_bounds__(kConvThreads) conv_out_kernel(const ConvArgs a) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int t = blockIdx.y;
  if (c >= a.channels) return;
  const int b = __ldg(a.seq_idx + t);
  const int t0 = __ldg(a.cu_tokens + b);
  const int i = t - t0;  // index of this token within its sequence's tokens of the step
  const int slot = __ldg(a.state_slots + b);
  const bool have_state = slot >= 0 && slot < a.num_slots;
  const int K = a.kernel;
  const float* w = a.weight + static_cast<size_t>(c) * K;
  const float* st = have_state ? a.state_pool + (static_cast<size_t>(slot) * a.channels + c) * (K - 1) : nullptr;
  const T* x = static_cast<const T*>(a.x);
  float acc = a.bias != nullptr ? __ldg(a.bias + c) : 0.f;
  // xx = [state (K-1) | tokens]: tap j reads xx[i + j], i.e. token i + j - (K-1), or state entry K-1 + (that) < 0.
  for (int j = 0; j < K; ++j) {
    const int src = i + j - (K - 1);
    float v = 0.f;
    if (src >= 0) {
      v = to_f(x[static_cast<size_t>(t0 + src) * a.x_stride + c]);
    } else if (st != nullptr) {
      v = st[K - 1 + src];
    }
    acc = fmaf(__ldg(w + j), v, acc);
  }
  if (a.silu) acc = acc * sigmoid_dev(acc);
  if (c < a.split0) {
    static_cast<T*>(a.out0)[static_cast<size_t>(t) * a.split0 + c] = from_f<T>(acc);
  } else if (c < a.split1) {
    static_cast<T*>(a.out1)[static_cast<size_t>(t) * (a.split1 - a.split0) + (c - a.split0)] = from_f<T>(acc);
  } else {
    static_cast<T*>(a.out2)[static_cast<size_t>(t) * (a.channels - a.split1) + (c - a.split1)] = from_f<T>(acc);
  }
}

// ---- causal conv1d: new states (one thread per (sequence, channel)), after every output read the old ones ----
template <typename T>
__global__ void __launch_bounds__(kConvThreads) conv_state_kernel(const ConvArgs a) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int b = blockIdx.y;
  if (c >= a.channels) return;
  const int slot = __ldg(a.state_slots + b);
  if (slot < 0 || slot >= a.num_slots) return;
  const int K = a.kernel;
  const int t0 = __ldg(a.cu_tokens + b);
  const int n = __ldg(a.cu_tokens + b + 1) - t0;
  float* st = a.state_pool + (static_cast<size_t>(slot) * a.channels + c) * (K - 1);
  const T* x = static_cast<const T*>(a.x);
  float next[kMaxConvKernel];
  // New state entry j = xx[n + j] with xx = [old state (K-1) | n tokens].
  for (int j = 0; j < K - 1; ++j) {
    const int src = n + j - (K - 1);  // token index, or < 0: old state entry K-1 + src
    next[j] = src >= 0 ? to_f(x[static_cast<size_t>(t0 + src) * a.x_stride + c]) : st[K - 1 + src];
  }
  for (int j = 0; j < K - 1; ++j) st[j] = next[j];
}

template <typename T>
cudaError_t launch_conv(const ConvArgs& a, int total_tokens, int batch, cudaStream_t stream) {
  const int cblocks = ceil_div(a.channels, kConvThreads);
  if (total_tokens > 0) {
    conv_out_kernel<T><<<dim3(cblocks, total_tokens), kConvThreads, 0, stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (a.kernel > 1 && batch > 0) conv_state_kernel<T><<<dim3(cblocks, batch), kConvThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// ---- GDN gating: one thread per (token, value head) ----
template <typename T>
__global__ void gating_kernel(const T* b, const T* a, int stride, const float* a_log, const float* dt_bias,
                              float* beta, float* g, int tokens, int hv) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= tokens * hv) return;
  const int t = idx / hv, h = idx - t * hv;
  const size_t i = static_cast<size_t>(t) * stride + h;
  beta[idx] = 1.f / (1.f + expf(-to_f(b[i])));
  g[idx] = -expf(__ldg(a_log + h)) * softplus_dev(to_f(a[i]) + __ldg(dt_bias + h));
}

// ---- gated RMSNorm: one warp per (token, head) row ----
constexpr int kNormThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kNormThreads) gated_norm_kernel(const T* x, const T* z, int z_stride,
                                                                   const float* w, T* y, int rows, int heads, int dim,
                                                                   float eps) {
  const int row = blockIdx.x * (kNormThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int t = row / heads, h = row - t * heads;
  const T* xr = x + static_cast<size_t>(row) * dim;
  const T* zr = z + static_cast<size_t>(t) * z_stride + static_cast<size_t>(h) * dim;
  float ss = 0.f;
  for (int i = lane; i < dim; i += 32) {
    const float v = to_f(xr[i]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum_xor(ss, 1, 16);
  const float inv = rsqrtf(ss / static_cast<float>(dim) + eps);
  T* yr = y + static_cast<size_t>(row) * dim;
  for (int i = lane; i < dim; i += 32) {
    const float zv = to_f(zr[i]);
    yr[i] = from_f<T>(__ldg(w + i) * (to_f(xr[i]) * inv) * (zv * (1.f / (1.f + expf(-zv)))));
  }
}

// ---- output gate: one thread per pair of elements ----
template <typename T>
__global__ void output_gate_kernel(T* out, const T* gate, int gate_stride, int tokens, int dim) {
  const int pairs = dim / 2;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= tokens * pairs) return;
  const int t = idx / pairs, i = 2 * (idx - t * pairs);
  T* o = out + static_cast<size_t>(t) * dim + i;
  const T* g = gate + static_cast<size_t>(t) * gate_stride + i;
  o[0] = from_f<T>(to_f(o[0]) * sigmoid_dev(to_f(g[0])));
  o[1] = from_f<T>(to_f(o[1]) * sigmoid_dev(to_f(g[1])));
}

// ---- state reset: grid (chunks, batch * layers) ----
constexpr int kResetThreads = 256;

__global__ void __launch_bounds__(kResetThreads) reset_kernel(const GdnResetStatesParams a, int chunks) {
  const int b = blockIdx.y / a.layers;
  const int l = blockIdx.y - b * a.layers;
  const int q_len = __ldg(a.cu_tokens + b + 1) - __ldg(a.cu_tokens + b);
  if (__ldg(a.seq_lens + b) != q_len) return;  // continues: keep its state
  const int slot = __ldg(a.state_slots + b);
  if (slot < 0 || slot >= a.num_state_slots) return;
  const size_t per_layer_slot = static_cast<size_t>(l) * a.num_state_slots + slot;
  const size_t stride = static_cast<size_t>(chunks) * kResetThreads;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kResetThreads + threadIdx.x; i < a.recurrent_elems; i += stride)
    a.recurrent_pool[per_layer_slot * a.recurrent_elems + i] = 0.f;
  if (a.conv_pool != nullptr)
    for (size_t i = static_cast<size_t>(blockIdx.x) * kResetThreads + threadIdx.x; i < a.conv_elems; i += stride)
      a.conv_pool[per_layer_slot * a.conv_elems + i] = 0.f;
}

}  // namespace
}  // namespace detail

cudaError_t causal_conv1d(const CausalConv1dGpuParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "causal_conv1d";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.total_tokens < 0 || p.batch < 0) return invalid_argument(what, "negative total_tokens / batch");
  if (p.total_tokens == 0 && p.batch == 0) return cudaSuccess;
  if (p.channels < 1 || p.kernel < 1 || p.kernel > kMaxConvKernel) {
    return invalid_argument(what, "channels ", p.channels, " / kernel ", p.kernel, " invalid (kernel 1..",
                            kMaxConvKernel, ")");
  }
  if (p.x_stride < p.channels) return invalid_argument(what, "x_stride ", p.x_stride, " < channels ", p.channels);
  if (!(p.split[0] > 0 && p.split[0] <= p.split[1] && p.split[1] <= p.channels)) {
    return invalid_argument(what, "split {", p.split[0], ", ", p.split[1], "} must satisfy 0 < split0 <= split1 <= ",
                            p.channels);
  }
  if (p.x == nullptr || p.weight == nullptr || p.out[0] == nullptr || (p.split[1] > p.split[0] && p.out[1] == nullptr) ||
      (p.channels > p.split[1] && p.out[2] == nullptr) || p.state_slots == nullptr || p.cu_tokens == nullptr ||
      p.seq_idx == nullptr || (p.kernel > 1 && p.state_pool == nullptr)) {
    return invalid_argument(what, "x, weight, the used outputs, state_slots, cu_tokens, seq_idx and (kernel > 1) "
                            "state_pool must be set");
  }
  if (p.total_tokens > 65535) return invalid_argument(what, "total_tokens ", p.total_tokens, " > 65535");
  if (p.batch > 65535) return invalid_argument(what, "batch ", p.batch, " > 65535");
  const ConvArgs a{p.x,        p.x_stride,        p.weight,        p.bias,      p.out[0],     p.out[1],
                   p.out[2],   p.split[0],        p.split[1],      p.state_pool, p.num_state_slots,
                   p.state_slots, p.cu_tokens,    p.seq_idx,       p.channels,  p.kernel,     p.silu};
  return p.dtype == DType::BF16 ? launch_conv<__nv_bfloat16>(a, p.total_tokens, p.batch, stream)
                                : launch_conv<__half>(a, p.total_tokens, p.batch, stream);
}

cudaError_t gdn_gating(const GdnGatingParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gdn_gating";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.tokens < 0 || p.num_v_heads < 1 || p.stride < p.num_v_heads) {
    return invalid_argument(what, "tokens ", p.tokens, " / num_v_heads ", p.num_v_heads, " / stride ", p.stride,
                            " invalid");
  }
  if (p.tokens == 0) return cudaSuccess;
  if (p.b == nullptr || p.a == nullptr || p.a_log == nullptr || p.dt_bias == nullptr || p.beta == nullptr ||
      p.g == nullptr) {
    return invalid_argument(what, "every pointer must be set");
  }
  const int n = p.tokens * p.num_v_heads, threads = 256;
  if (p.dtype == DType::BF16) {
    gating_kernel<__nv_bfloat16><<<ceil_div(n, threads), threads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(p.b), static_cast<const __nv_bfloat16*>(p.a), p.stride, p.a_log, p.dt_bias,
        p.beta, p.g, p.tokens, p.num_v_heads);
  } else {
    gating_kernel<__half><<<ceil_div(n, threads), threads, 0, stream>>>(
        static_cast<const __half*>(p.b), static_cast<const __half*>(p.a), p.stride, p.a_log, p.dt_bias, p.beta, p.g,
        p.tokens, p.num_v_heads);
  }
  return cudaGetLastError();
}

cudaError_t gated_rmsnorm(const GatedRmsNormParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gated_rmsnorm";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.tokens < 0 || p.heads < 1 || p.dim < 1 || p.dim > 1024 || p.z_stride < p.heads * p.dim) {
    return invalid_argument(what, "tokens ", p.tokens, " / heads ", p.heads, " / dim ", p.dim, " / z_stride ",
                            p.z_stride, " invalid");
  }
  if (p.tokens == 0) return cudaSuccess;
  if (p.x == nullptr || p.z == nullptr || p.weight == nullptr || p.y == nullptr) {
    return invalid_argument(what, "x, z, weight and y must be set");
  }
  const int rows = p.tokens * p.heads, per_block = kNormThreads / 32;
  if (p.dtype == DType::BF16) {
    gated_norm_kernel<__nv_bfloat16><<<ceil_div(rows, per_block), kNormThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(p.x), static_cast<const __nv_bfloat16*>(p.z), p.z_stride, p.weight,
        static_cast<__nv_bfloat16*>(p.y), rows, p.heads, p.dim, p.eps);
  } else {
    gated_norm_kernel<__half><<<ceil_div(rows, per_block), kNormThreads, 0, stream>>>(
        static_cast<const __half*>(p.x), static_cast<const __half*>(p.z), p.z_stride, p.weight,
        static_cast<__half*>(p.y), rows, p.heads, p.dim, p.eps);
  }
  return cudaGetLastError();
}

cudaError_t output_gate(const OutputGateParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "output_gate";
  if (p.dtype != DType::BF16 && p.dtype != DType::F16) return invalid_argument(what, "dtype must be BF16 or F16");
  if (p.tokens < 0 || p.dim < 2 || p.dim % 2 != 0 || p.gate_stride < p.dim) {
    return invalid_argument(what, "tokens ", p.tokens, " / dim ", p.dim, " / gate_stride ", p.gate_stride,
                            " invalid (dim even)");
  }
  if (p.tokens == 0) return cudaSuccess;
  if (p.out == nullptr || p.gate == nullptr) return invalid_argument(what, "out and gate must be set");
  const int n = p.tokens * (p.dim / 2), threads = 256;
  if (p.dtype == DType::BF16) {
    output_gate_kernel<__nv_bfloat16><<<ceil_div(n, threads), threads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(p.out), static_cast<const __nv_bfloat16*>(p.gate), p.gate_stride, p.tokens,
        p.dim);
  } else {
    output_gate_kernel<__half><<<ceil_div(n, threads), threads, 0, stream>>>(
        static_cast<__half*>(p.out), static_cast<const __half*>(p.gate), p.gate_stride, p.tokens, p.dim);
  }
  return cudaGetLastError();
}

cudaError_t gdn_reset_states(const GdnResetStatesParams& p, cudaStream_t stream) {
  using namespace detail;
  const char* what = "gdn_reset_states";
  if (p.batch < 0 || p.layers < 0) return invalid_argument(what, "negative batch / layers");
  if (p.batch == 0 || p.layers == 0) return cudaSuccess;
  if (p.recurrent_pool == nullptr || p.recurrent_elems == 0 || p.num_state_slots < 1 || p.state_slots == nullptr ||
      p.cu_tokens == nullptr || p.seq_lens == nullptr || (p.conv_elems > 0 && p.conv_pool == nullptr)) {
    return invalid_argument(what, "recurrent_pool (with recurrent_elems), num_state_slots, state_slots, cu_tokens, "
                            "seq_lens and (with conv_elems) conv_pool must be set");
  }
  if (static_cast<long long>(p.batch) * p.layers > 65535) {
    return invalid_argument(what, "batch ", p.batch, " x layers ", p.layers, " > 65535");
  }
  const size_t most = std::max(p.recurrent_elems, p.conv_elems);
  const int chunks = static_cast<int>(std::min<size_t>(64, (most + kResetThreads - 1) / kResetThreads));
  GdnResetStatesParams a = p;
  if (a.conv_elems == 0) a.conv_pool = nullptr;
  reset_kernel<<<dim3(chunks, p.batch * p.layers), kResetThreads, 0, stream>>>(a, chunks);
  return cudaGetLastError();
}

}  // namespace spade::kernels
