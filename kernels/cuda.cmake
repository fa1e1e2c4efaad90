# spade_kernels_cuda: the CUDA kernels of kernels/ (included by kernels/CMakeLists.txt when CUDA is enabled).
# One translation unit per kernel family (selection and the layer ops: one per stage / op); each instantiates its templates for the head dims of head_dims.cuh
# (SPADE_FOR_EACH_HEAD_DIM) and for bf16 / fp16. Public headers: attention.cuh, selection.cuh (plain C++).
# CMake < 3.26 (Debian 12's 3.25) has no C++20 flag for nvcc and fails at generate time with CMAKE_CUDA_STANDARD 20
# ("requires the language dialect CUDA20"). The CUDA sources need only C++17: fall back to it, here and for the
# directories added after kernels/ (tests/, bench/). Belongs in cmake/SpadeCuda.cmake (lead's file) eventually.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD 17 PARENT_SCOPE)
endif()

add_library(spade_kernels_cuda STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/decode_attention.cu    # paged + token-sparse split-K flash-decoding
  ${CMAKE_CURRENT_SOURCE_DIR}/prefill_attention.cu   # causal FlashAttention-2-style prefill
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_predict.cu  # selection: query windows, next-query predictor
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_score.cu    # selection: GQA-batched token scoring
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_topk.cu     # selection: radix top-k, prepare_selection_kernels
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_gather.cu   # selection: K/V gather into the packed send buffer
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_anchors.cu  # selection: prompt anchors (pick, spans)
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_delta.cu    # selection: delta transfer (slot plan) and its apply
  ${CMAKE_CURRENT_SOURCE_DIR}/selection_quest.cu    # selection: Quest page baseline, decode queries as fp32
  ${CMAKE_CURRENT_SOURCE_DIR}/gdn.cu                # Gated DeltaNet decoding forms (recurrent, buffered, verify)
  ${CMAKE_CURRENT_SOURCE_DIR}/hybrid_ops.cu)        # conv1d + state, GDN gating, gated RMSNorm, output gate, reset
# The kernels use headers only from common/ (dtype.h); device.cpp (cuda_check, DeviceBuffer, ...) throws spade::Error,
# hence spade_common below.
target_link_libraries(spade_kernels_cuda PUBLIC CUDA::cudart PRIVATE spade_warnings)
# Layer ops of the GPU inference rank (embedding, RMSNorm, RoPE + KV append, SwiGLU, sampling) and the cuBLASLt
# GEMM wrapper (kernels/layer_ops.cuh, kernels/gemm.cuh).
target_sources(spade_kernels_cuda PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_misc.cu      # embedding gather, SwiGLU
  ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_norm.cu      # RMSNorm (plain / fused residual / per head)
  ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_rope_kv.cu   # q/k-norm + RoPE + paged KV append
  ${CMAKE_CURRENT_SOURCE_DIR}/layer_ops_sampling.cu  # greedy argmax, temperature / top-k / top-p sampling
  ${CMAKE_CURRENT_SOURCE_DIR}/gemm.cpp            # cuBLASLt wrapper, plans and decode-shape tuning
  ${CMAKE_CURRENT_SOURCE_DIR}/gemm_small_m.cu     # small-M split-K tensor-core GEMM (decode)
  ${CMAKE_CURRENT_SOURCE_DIR}/tensor_ops.cu      # random init (--random-weights), dtype casts
  ${CMAKE_CURRENT_SOURCE_DIR}/device.cpp)        # cuda_check, CudaEvent, DeviceBuffer, GpuKvPool (device.h)
target_link_libraries(spade_kernels_cuda PUBLIC CUDA::cublasLt spade_common)
target_compile_options(spade_kernels_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra>)
# SPADE_PTXAS_VERBOSE=ON prints registers / spills / shared memory per kernel (no device needed).
option(SPADE_PTXAS_VERBOSE "Print ptxas resource usage for spade_kernels_cuda" OFF)
if(SPADE_PTXAS_VERBOSE)
  target_compile_options(spade_kernels_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=-v>)
endif()
