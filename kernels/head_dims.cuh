// The one list of compiled head_dim instantiations for every CUDA kernel family in kernels/.
//
// Each kernel translation unit expands SPADE_FOR_EACH_HEAD_DIM to instantiate its templates and to build its
// run-time head_dim switch, so adding a head_dim here adds it everywhere (tests iterate kSupportedHeadDims).
// Plain C++ (no CUDA types): includable from host code compiled by g++.
#pragma once

#define SPADE_FOR_EACH_HEAD_DIM(X) X(64) X(128) X(256)

namespace spade::kernels {

inline constexpr int kSupportedHeadDims[] = {64, 128, 256};

/// True when `head_dim` is one of kSupportedHeadDims.
constexpr bool is_supported_head_dim(int head_dim) {
  for (int d : kSupportedHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

}  // namespace spade::kernels
