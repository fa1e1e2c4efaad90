// cuBLASLt wrapper for the dense layers: y = x · W^T (+ bias). API and mapping: kernels/gemm.cuh. Plain C++ (nvcc's
// front end is not needed here).
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>

#include "kernels/gemm.cuh"
#include "kernels/launch_util.cuh"

namespace spade::kernels {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    case DType::F32:
      return CUDA_R_32F;
  }
  return CUDA_R_32F;
}

const char* type_name(DType t) { return t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : "f32"; }

cudaError_t map_status(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return cudaSuccess;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return cudaErrorNotSupported;
    case CUBLAS_STATUS_INVALID_VALUE:
      return cudaErrorInvalidValue;
    case CUBLAS_STATUS_ALLOC_FAILED:
      return cudaErrorMemoryAllocation;
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return cudaErrorInitializationError;
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return cudaErrorLaunchFailure;
    default:
      return cudaErrorUnknown;
  }
}

/// Largest power of two <= 256 dividing the address (256 for nullptr).
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && (a % static_cast<uintptr_t>(al)) != 0) al /= 2;
  return al;
}

struct PlanKey {
  int m, n, k;
  DType in, out;
  bool bias;
  int align_x, align_w, align_y;
  /// The plan key of a call: its shape, dtypes, epilogue and operand alignments.
  static PlanKey of(const GemmParams& p) {
    return {p.m, p.n, p.k, p.in_dtype, p.out_dtype, p.bias != nullptr,
            alignment_of(p.x), alignment_of(p.w), alignment_of(p.y)};
  }
  bool operator==(const PlanKey& o) const {
    return m == o.m && n == o.n && k == o.k && in == o.in && out == o.out && bias == o.bias &&
           align_x == o.align_x && align_w == o.align_w && align_y == o.align_y;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<uint32_t>(key.m));
    mix(static_cast<uint32_t>(key.n));
    mix(static_cast<uint32_t>(key.k));
    mix(static_cast<uint64_t>(key.in) | static_cast<uint64_t>(key.out) << 8 | static_cast<uint64_t>(key.bias) << 16);
    mix(static_cast<uint64_t>(key.align_x) | static_cast<uint64_t>(key.align_w) << 16 |
        static_cast<uint64_t>(key.align_y) << 32);
    return static_cast<size_t>(h);
  }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string name;      // GemmRunner::plan_name
  bool counted = false;  // its kernel is in GemmRunner::Impl::launched (checked once per plan, not per call)

  void destroy() {
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    op = nullptr;
    a = b = d = nullptr;
  }
};

std::string describe(const GemmParams& p) {
  std::ostringstream os;
  os << "m=" << p.m << " n=" << p.n << " k=" << p.k << " " << type_name(p.in_dtype) << "->" << type_name(p.out_dtype)
     << (p.bias != nullptr ? " +bias" : "");
  return os.str();
}

/// Records "gemm <shape>: <what>: <status name>" and returns the mapped error.
cudaError_t fail(const GemmParams& p, const char* what, cublasStatus_t s) {
  std::ostringstream os;
  os << what << ": " << cublasLtGetStatusName(s);
  detail::launch_error_slot() = "gemm " + describe(p) + ": " + os.str();
  return map_status(s);
}

std::string algo_name(const cublasLtMatmulAlgo_t& algo) {
  int id = -1, tile = -1, split_k = -1;
  size_t got = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &got);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof(split_k), &got);
  return "cublasLt algo " + std::to_string(id) + " tile " + std::to_string(tile) + " splitK " +
         std::to_string(split_k);
}

}  // namespace

using AlgoKey = std::array<uint64_t, 9>;

struct GemmRunner::Impl {
  cublasLtHandle_t handle = nullptr;
  std::set<AlgoKey> launched;  // kernels (dtypes, epilogue, algorithm) that ran at least once
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;

  ~Impl() {
    for (auto& kv : plans) kv.second.destroy();
    if (handle != nullptr) cublasLtDestroy(handle);
    if (workspace != nullptr) cudaFree(workspace);
  }

  cudaError_t make_plan(const GemmParams& p, const PlanKey& key, Plan* out) {
    Plan plan;
    const cudaDataType_t in = cuda_type(p.in_dtype), outt = cuda_type(p.out_dtype);
    cublasStatus_t s = cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return fail(p, "cublasLtMatmulDescCreate", s);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    s = cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (s == CUBLAS_STATUS_SUCCESS && key.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      s = cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
      if (s == CUBLAS_STATUS_SUCCESS) {
        const cudaDataType_t bt = outt;  // bias in the output type (cuBLASLt's default, stated explicitly)
        s = cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt));
      }
    }
    if (s != CUBLAS_STATUS_SUCCESS) {
      plan.destroy();
      return fail(p, "cublasLtMatmulDescSetAttribute", s);
    }
    // Column-major views: A = W as [k, n] (ld k, op T), B = x as [k, m] (ld k), D = y^T as [n, m] (ld n).
    s = cublasLtMatrixLayoutCreate(&plan.a, in, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.n), p.k);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&plan.b, in, static_cast<uint64_t>(p.k), static_cast<uint64_t>(p.m), p.k);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&plan.d, outt, static_cast<uint64_t>(p.n), static_cast<uint64_t>(p.m), p.n);
    if (s != CUBLAS_STATUS_SUCCESS) {
      plan.destroy();
      return fail(p, "cublasLtMatrixLayoutCreate", s);
    }
    cublasLtMatmulPreference_t pref = nullptr;
    s = cublasLtMatmulPreferenceCreate(&pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
      plan.destroy();
      return fail(p, "cublasLtMatmulPreferenceCreate", s);
    }
    const uint64_t ws = workspace_bytes;
    const uint32_t al_a = static_cast<uint32_t>(key.align_w), al_b = static_cast<uint32_t>(key.align_x),
                   al_d = static_cast<uint32_t>(key.align_y);
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
    if (s != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulPreferenceDestroy(pref);
      plan.destroy();
      return fail(p, "cublasLtMatmulPreferenceSetAttribute", s);
    }
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    s = cublasLtMatmulAlgoGetHeuristic(handle, plan.op, plan.a, plan.b, plan.d, plan.d, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) {
      plan.destroy();
      return fail(p, "cublasLtMatmulAlgoGetHeuristic", s);
    }
    if (returned == 0) {
      plan.destroy();
      detail::launch_error_slot() = "gemm " + describe(p) + ": cuBLASLt has no algorithm for this shape";
      return cudaErrorNotSupported;
    }
    plan.algo = result.algo;
    plan.name = algo_name(plan.algo);
    *out = plan;
    return cudaSuccess;
  }
};

GemmRunner::GemmRunner() = default;
GemmRunner::~GemmRunner() = default;

cudaError_t GemmRunner::init(size_t workspace_bytes) {
  if (impl_ != nullptr) return detail::invalid_argument("gemm", "GemmRunner::init called twice");
  auto impl = std::make_unique<Impl>();
  const cublasStatus_t s = cublasLtCreate(&impl->handle);
  if (s != CUBLAS_STATUS_SUCCESS) {
    detail::launch_error_slot() = std::string("gemm: cublasLtCreate: ") + cublasLtGetStatusName(s);
    return map_status(s);
  }
  if (workspace_bytes > 0) {
    const cudaError_t e = cudaMalloc(&impl->workspace, workspace_bytes);
    if (e != cudaSuccess) {
      detail::launch_error_slot() = "gemm: cudaMalloc of the " + std::to_string(workspace_bytes) + "-byte workspace";
      return e;
    }
  }
  impl->workspace_bytes = workspace_bytes;
  impl_ = std::move(impl);
  return cudaSuccess;
}

std::string GemmRunner::plan_name(const GemmParams& p) const {
  if (impl_ == nullptr) return "";
  const PlanKey key = PlanKey::of(p);
  const auto it = impl_->plans.find(key);
  return it == impl_->plans.end() ? "" : it->second.name;
}

size_t GemmRunner::cached_plans() const { return impl_ == nullptr ? 0 : impl_->plans.size(); }

size_t GemmRunner::launched_algorithms() const { return impl_ == nullptr ? 0 : impl_->launched.size(); }

cudaError_t GemmRunner::warm_up_rows(const GemmParams& p, int max_m, cudaStream_t stream, int* launches) {
  int n = 0;
  for (int m = 1; m <= max_m; ++m) {
    GemmParams q = p;
    q.m = m;
    bool fresh = false;
    const cudaError_t e = run_impl(q, stream, /*launch_only_if_new=*/true, &fresh);
    if (e != cudaSuccess) return e;
    n += fresh ? 1 : 0;
  }
  if (launches != nullptr) *launches = n;
  return cudaSuccess;
}

cudaError_t GemmRunner::run(const GemmParams& p, cudaStream_t stream) {
  return run_impl(p, stream, /*launch_only_if_new=*/false, nullptr);
}

cudaError_t GemmRunner::run_impl(const GemmParams& p, cudaStream_t stream, bool launch_only_if_new, bool* fresh) {
  const std::string shape = "gemm " + describe(p);
  if (impl_ == nullptr) return detail::invalid_argument(shape.c_str(), "GemmRunner::init was not called");
  if (p.in_dtype != DType::BF16 && p.in_dtype != DType::F16)
    return detail::invalid_argument(shape.c_str(), "in_dtype must be BF16 or F16");
  if (p.out_dtype != p.in_dtype && p.out_dtype != DType::F32)
    return detail::invalid_argument(shape.c_str(), "out_dtype must equal in_dtype or be F32");
  if (p.m < 0) return detail::invalid_argument(shape.c_str(), "m must be >= 0");
  if (p.n <= 0) return detail::invalid_argument(shape.c_str(), "n must be > 0");
  if (p.k <= 0) return detail::invalid_argument(shape.c_str(), "k must be > 0");
  if (p.m == 0) return cudaSuccess;
  if (p.x == nullptr || p.w == nullptr || p.y == nullptr)
    return detail::invalid_argument(shape.c_str(), "x, w and y must be set");
  const PlanKey key = PlanKey::of(p);
  auto it = impl_->plans.find(key);
  if (it == impl_->plans.end()) {
    Plan plan;
    const cudaError_t e = impl_->make_plan(p, key, &plan);
    if (e != cudaSuccess) return e;
    it = impl_->plans.emplace(key, plan).first;
  }
  Plan& plan = it->second;
  // The first use of a plan records its kernel: dtypes, epilogue and the algorithm's opaque configuration. Later
  // calls of the plan only launch (the kernel has run, or runs in the call that recorded it).
  bool is_new = false;
  if (!plan.counted) {
    AlgoKey id{};
    id[0] = static_cast<uint64_t>(p.in_dtype) | static_cast<uint64_t>(p.out_dtype) << 8 |
            static_cast<uint64_t>(p.bias != nullptr) << 16;
    static_assert(sizeof(plan.algo) <= sizeof(uint64_t) * (std::tuple_size_v<AlgoKey> - 1));
    std::memcpy(id.data() + 1, &plan.algo, sizeof(plan.algo));
    is_new = impl_->launched.insert(id).second;
    plan.counted = true;
  }
  if (fresh != nullptr) *fresh = is_new;
  if (launch_only_if_new && !is_new) return cudaSuccess;
  if (p.bias != nullptr) {
    const void* bias = p.bias;
    const cublasStatus_t s =
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    if (s != CUBLAS_STATUS_SUCCESS) return fail(p, "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", s);
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t s = cublasLtMatmul(impl_->handle, plan.op, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.y,
                                          plan.d, p.y, plan.d, &plan.algo, impl_->workspace, impl_->workspace_bytes,
                                          stream);
  if (s != CUBLAS_STATUS_SUCCESS) return fail(p, "cublasLtMatmul", s);
  return cudaSuccess;
}

}  // namespace spade::kernels
