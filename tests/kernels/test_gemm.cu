// GPU tests of the cuBLASLt GEMM wrapper (kernels/gemm.cuh) against kernels/linear_ref on the exact fp32 images of
// random bf16/fp16 operands: Qwen3-8B layer shapes (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down
// 4096x12288, LM head 151936x4096) at decode and prefill token counts, odd small shapes, bias, fp32 output,
// misaligned operands, the plan cache, CUDA-graph capture and invalid parameters; the small-M split-K kernel
// (small_m_gemm) at every token-tile width and several split counts, its determinism, graph replay (its arrival
// counters) and the shapes it refuses.
//
// Bounds (fp32 accumulation, one rounding of the output): per row ||y - ref|| / ||ref|| <= 4e-3 (bf16 out),
// 1e-3 (fp16 out), 2e-5 (fp32 out), and every element within 2^-7 |ref| + 0.02 rms(ref row) (one wrong element or
// column cannot hide in the row norm).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm.cuh"
#include "kernels/linear_ref.h"
#include "tests/kernels/test_gpu_common.cuh"

namespace spade::kernels {
namespace {

using spade::test::DevBuf;
using spade::test::from_bits;
using spade::test::random_half;
using spade::test::to_bits;

const char* name(DType t) { return t == DType::BF16 ? "bf16" : t == DType::F16 ? "f16" : "f32"; }

struct GemmCase {
  DType in = DType::BF16, out = DType::BF16;
  int m = 0, n = 0, k = 0;
  bool bias = false;
  int x_offset = 0;  // elements: misaligns x (and y by the same) when > 0
  uint64_t seed = 0;  // GemmGpu.MatchesReference's (the other tests pass run_gemm theirs)
};

std::string case_name(const GemmCase& c) {
  return std::string(spade::test::name_dtype(c.in)) + "_to_" + spade::test::name_dtype(c.out) + "_m" +
         std::to_string(c.m) + "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k) + (c.bias ? "_bias" : "") +
         (c.x_offset != 0 ? "_offset" + std::to_string(c.x_offset) : "");
}

void PrintTo(const GemmCase& c, std::ostream* os) { *os << case_name(c) << " seed=" << c.seed; }

void check_rows(const std::vector<float>& got, const std::vector<float>& ref, int m, int n, DType out) {
  const double row_tol = out == DType::BF16 ? 4e-3 : out == DType::F16 ? 1e-3 : 2e-5;
  const double elem_rel = out == DType::F32 ? 1e-5 : 1.0 / 128;
  int bad = 0;
  for (int r = 0; r < m; ++r) {
    double num = 0, den = 0;
    for (int j = 0; j < n; ++j) {
      const size_t i = static_cast<size_t>(r) * n + j;
      num += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
      den += static_cast<double>(ref[i]) * ref[i];
    }
    const double rms = std::sqrt(den / n);
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), row_tol) << "row " << r;
    for (int j = 0; j < n; ++j) {
      const size_t i = static_cast<size_t>(r) * n + j;
      const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
      if (!(err <= elem_rel * std::fabs(ref[i]) + (out == DType::F32 ? 1e-4 : 0.02) * rms)) {
        if (++bad <= 5) ADD_FAILURE() << "y[" << r << "][" << j << "] = " << got[i] << " ref " << ref[i];
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// Runs `gemm` on case c (twice: a cached plan, the small-M kernel's counters left at zero) and checks each result;
// returns the second result's raw output bits (bf16 / fp16 as uint16, fp32 as uint32) for determinism checks.
std::vector<uint32_t> check_gemm(const GemmCase& c, uint64_t seed,
                                 const std::function<cudaError_t(const GemmParams&)>& gemm) {
  SCOPED_TRACE(std::string(name(c.in)) + "->" + name(c.out) + " m=" + std::to_string(c.m) + " n=" +
               std::to_string(c.n) + " k=" + std::to_string(c.k) + (c.bias ? " bias" : "") +
               " offset=" + std::to_string(c.x_offset));
  std::mt19937_64 rng(seed);
  std::vector<float> x32, w32, b32;
  const float sx = 1.f, sw = 1.f / std::sqrt(static_cast<float>(c.k));
  std::vector<uint16_t> xb = random_half(c.in, static_cast<size_t>(c.m) * c.k + c.x_offset, sx, rng, &x32);
  const std::vector<uint16_t> wb = random_half(c.in, static_cast<size_t>(c.n) * c.k, sw, rng, &w32);
  DevBuf<uint16_t> x, w, y16, b16;
  DevBuf<float> y32, bf;
  x.upload(xb);
  w.upload(wb);
  const float* bias_ref = nullptr;
  const void* bias_dev = nullptr;
  if (c.bias) {
    std::normal_distribution<float> d(0.f, 0.5f);
    b32.resize(c.n);
    if (c.out == DType::F32) {
      for (auto& v : b32) v = d(rng);
      bf.upload(b32);
      bias_dev = bf.get();
    } else {
      std::vector<uint16_t> bb(c.n);
      for (int j = 0; j < c.n; ++j) {
        bb[j] = to_bits(c.out, d(rng));
        b32[j] = from_bits(c.out, bb[j]);
      }
      b16.upload(bb);
      bias_dev = b16.get();
    }
    bias_ref = b32.data();
  }
  std::vector<float> ref(static_cast<size_t>(c.m) * c.n);
  linear_ref(x32.data() + c.x_offset, w32.data(), bias_ref, ref.data(), c.m, c.n, c.k);
  const size_t ny = static_cast<size_t>(c.m) * c.n + c.x_offset;
  if (c.out == DType::F32) y32.alloc(ny); else y16.alloc(ny);
  GemmParams p;
  p.in_dtype = c.in;
  p.out_dtype = c.out;
  p.x = x.get() + c.x_offset;
  p.w = w.get();
  p.bias = bias_dev;
  p.y = c.out == DType::F32 ? static_cast<void*>(y32.get() + c.x_offset) : static_cast<void*>(y16.get() + c.x_offset);
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  std::vector<uint32_t> bits(ref.size());
  for (int rep = 0; rep < 2; ++rep) {  // the second call uses the cached plan
    if (c.out == DType::F32) y32.poison(); else y16.poison();
    const cudaError_t e = gemm(p);
    EXPECT_EQ(e, cudaSuccess) << launch_error_detail();
    const cudaError_t sync = e == cudaSuccess ? cudaDeviceSynchronize() : e;
    EXPECT_EQ(sync, cudaSuccess) << cudaGetErrorString(sync);
    if (sync != cudaSuccess) return bits;
    std::vector<float> got(ref.size());
    if (c.out == DType::F32) {
      const std::vector<float> h = y32.download();
      for (size_t i = 0; i < got.size(); ++i) {
        got[i] = h[i + c.x_offset];
        std::memcpy(&bits[i], &got[i], sizeof(float));
      }
    } else {
      const std::vector<uint16_t> h = y16.download();
      for (size_t i = 0; i < got.size(); ++i) {
        got[i] = from_bits(c.out, h[i + c.x_offset]);
        bits[i] = h[i + c.x_offset];
      }
    }
    check_rows(got, ref, c.m, c.n, c.out);
  }
  return bits;
}

void run_gemm(GemmRunner& runner, const GemmCase& c, uint64_t seed) {
  check_gemm(c, seed, [&](const GemmParams& p) { return runner.run(p, nullptr); });
}

class GemmGpu : public ::testing::TestWithParam<GemmCase> {
 protected:
  void SetUp() override { ASSERT_EQ(runner_.init(), cudaSuccess) << launch_error_detail(); }
  GemmRunner runner_;
};

// clang-format off
const std::vector<GemmCase> kGemmCases = {
    // Qwen3 decode shapes
    {.in = DType::BF16, .out = DType::BF16, .m = 1, .n = 6144, .k = 4096, .seed = 1},    // qkv
    {.in = DType::BF16, .out = DType::BF16, .m = 8, .n = 4096, .k = 4096, .seed = 2},    // o_proj
    {.in = DType::BF16, .out = DType::BF16, .m = 8, .n = 24576, .k = 4096, .seed = 3},   // gate_up
    {.in = DType::BF16, .out = DType::BF16, .m = 8, .n = 4096, .k = 12288, .seed = 4},   // down
    {.in = DType::BF16, .out = DType::F32, .m = 3, .n = 151936, .k = 4096, .seed = 5},   // LM head, fp32 logits
    // Qwen3 prefill shapes
    {.in = DType::BF16, .out = DType::BF16, .m = 300, .n = 6144, .k = 4096, .seed = 6},
    {.in = DType::F16, .out = DType::F16, .m = 129, .n = 4096, .k = 12288, .seed = 7},
    {.in = DType::BF16, .out = DType::BF16, .m = 64, .n = 24576, .k = 4096, .seed = 8},
    // bias (Qwen2 style)
    {.in = DType::BF16, .out = DType::BF16, .m = 5, .n = 1536 + 2 * 256, .k = 1536, .bias = true, .seed = 9},
    {.in = DType::F16, .out = DType::F16, .m = 17, .n = 100, .k = 64, .bias = true, .seed = 10},
    {.in = DType::BF16, .out = DType::F32, .m = 4, .n = 1000, .k = 256, .bias = true, .seed = 11},
    // odd small shapes
    {.in = DType::BF16, .out = DType::BF16, .m = 3, .n = 5, .k = 37, .seed = 12},
    {.in = DType::F16, .out = DType::F16, .m = 1, .n = 1, .k = 8, .seed = 13},
    {.in = DType::BF16, .out = DType::F32, .m = 7, .n = 33, .k = 24, .bias = true, .seed = 14},
    // misaligned operands (x_offset 1: 2-byte aligned x and y)
    {.in = DType::BF16, .out = DType::BF16, .m = 4, .n = 256, .k = 128, .x_offset = 1, .seed = 15},
    {.in = DType::F16, .out = DType::F32, .m = 3, .n = 64, .k = 64, .bias = true, .x_offset = 3, .seed = 16},
};
// clang-format on

TEST_P(GemmGpu, MatchesReference) { run_gemm(runner_, GetParam(), GetParam().seed); }

INSTANTIATE_TEST_SUITE_P(, GemmGpu, ::testing::ValuesIn(kGemmCases), spade::test::CaseName());
TEST_F(GemmGpu, PlanCachePerShape) {
  EXPECT_EQ(runner_.cached_plans(), 0u);
  run_gemm(runner_, {DType::BF16, DType::BF16, 2, 128, 64, false}, 17);
  EXPECT_EQ(runner_.cached_plans(), 1u);
  run_gemm(runner_, {DType::BF16, DType::BF16, 2, 128, 64, false}, 18);  // same shape: reused
  EXPECT_EQ(runner_.cached_plans(), 1u);
  run_gemm(runner_, {DType::BF16, DType::BF16, 3, 128, 64, false}, 19);
  run_gemm(runner_, {DType::BF16, DType::BF16, 2, 128, 64, true}, 20);
  EXPECT_EQ(runner_.cached_plans(), 3u);
}

// warm_up_rows plans every row count up to max_m and launches each distinct cuBLASLt kernel once (the launch count
// equals the distinct kernels recorded, and a second pass launches nothing). Afterwards, calls over the range use
// the warmed plans (same shapes and 256-byte alignment: what the forward pass does with its buffers), so they add no
// kernel, which the in-process GPU pair relies on, and their results are still right.
TEST_F(GemmGpu, WarmUpRowsLaunchesEveryAlgorithmOfTheRangeOnce) {
  const int max_m = 300, n = 1024, k = 512;
  DevBuf<uint16_t> x, w, y;
  std::mt19937_64 rng(22);
  std::vector<float> unused;
  x.upload(random_half(DType::BF16, static_cast<size_t>(max_m) * k, 1.f, rng, &unused));
  w.upload(random_half(DType::BF16, static_cast<size_t>(n) * k, 0.05f, rng, &unused));
  y.alloc(static_cast<size_t>(max_m) * n);
  GemmParams p;
  p.x = x.get();
  p.w = w.get();
  p.y = y.get();
  p.n = n;
  p.k = k;
  int launches = -1;
  SPADE_CUDA_OK(runner_.warm_up_rows(p, max_m, nullptr, &launches));
  SPADE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(runner_.cached_plans(), static_cast<size_t>(max_m));
  EXPECT_GE(launches, 1);
  EXPECT_LE(launches, max_m);
  EXPECT_EQ(runner_.launched_algorithms(), static_cast<size_t>(launches));
  int again = -1;
  SPADE_CUDA_OK(runner_.warm_up_rows(p, max_m, nullptr, &again));
  EXPECT_EQ(again, 0);
  for (int m : {1, 7, 64, 129, 255, 300}) {
    run_gemm(runner_, {DType::BF16, DType::BF16, m, n, k, false}, 100 + static_cast<uint64_t>(m));
  }
  EXPECT_EQ(runner_.launched_algorithms(), static_cast<size_t>(launches)) << "a row count in the warmed range "
                                                                               "picked a kernel that had not run";
  std::printf("[ gemm     ] m 1..%d, n %d, k %d: %d distinct cuBLASLt kernels\n", max_m, n, k, launches);
}

// Captures launch(p, stream) (a bf16 GEMM of m x n x k) in a CUDA graph and replays it `reps` times with new x
// between replays (the graph reads the buffer at replay time), checking each result. `setup` runs before the capture
// (e.g. a plan made outside it).
void check_graph_replays(int m, int n, int k, float w_scale, int reps, uint64_t seed,
                         const std::function<cudaError_t(const GemmParams&, cudaStream_t)>& launch,
                         const std::function<void(const GemmParams&, cudaStream_t)>& setup = nullptr) {
  std::mt19937_64 rng(seed);
  std::vector<float> x32, w32, ref(static_cast<size_t>(m) * n);
  DevBuf<uint16_t> x, w, y(static_cast<size_t>(m) * n);
  x.upload(random_half(DType::BF16, static_cast<size_t>(m) * k, 1.f, rng, &x32));
  w.upload(random_half(DType::BF16, static_cast<size_t>(n) * k, w_scale, rng, &w32));
  GemmParams p;
  p.x = x.get();
  p.w = w.get();
  p.y = y.get();
  p.m = m;
  p.n = n;
  p.k = k;
  cudaStream_t stream;
  SPADE_CUDA_OK(cudaStreamCreate(&stream));
  if (setup) setup(p, stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SPADE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const cudaError_t e = launch(p, stream);
  SPADE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_EQ(e, cudaSuccess) << launch_error_detail();
  SPADE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < reps; ++rep) {
    const std::vector<uint16_t> xb = random_half(DType::BF16, static_cast<size_t>(m) * k, 1.f, rng, &x32);
    SPADE_CUDA_OK(cudaMemcpy(x.get(), xb.data(), xb.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
    y.poison();
    SPADE_CUDA_OK(cudaGraphLaunch(exec, stream));
    SPADE_CUDA_OK(cudaStreamSynchronize(stream));
    linear_ref(x32.data(), w32.data(), nullptr, ref.data(), m, n, k);
    check_rows(spade::test::to_f32(DType::BF16, y.download()), ref, m, n, DType::BF16);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_F(GemmGpu, GraphCaptureReplays) {
  check_graph_replays(
      4, 512, 256, 0.1f, 2, 21, [&](const GemmParams& p, cudaStream_t st) { return runner_.run(p, st); },
      [&](const GemmParams& p, cudaStream_t st) {  // the plan, created outside the capture
        SPADE_CUDA_OK(runner_.run(p, st));
        SPADE_CUDA_OK(cudaStreamSynchronize(st));
      });
}

// small_m_gemm with a forced split count, its own workspace (what GemmRunner passes it).
class SmallMGemmGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    partials_.alloc(size_t{4} << 20);
    counters_.alloc(8192);
    SPADE_CUDA_OK(cudaMemset(counters_.get(), 0, 8192 * sizeof(int)));
    ws_.partials = partials_.get();
    ws_.partial_elems = size_t{4} << 20;
    ws_.counters = counters_.get();
    ws_.num_counters = 8192;
  }
  std::vector<uint32_t> run(const GemmCase& c, int splits, uint64_t seed) {
    SCOPED_TRACE("splits " + std::to_string(splits));
    return check_gemm(c, seed, [&](const GemmParams& p) { return small_m_gemm(p, splits, ws_, nullptr); });
  }
  DevBuf<float> partials_;
  DevBuf<int> counters_;
  SmallMGemmWorkspace ws_;
};

TEST_F(SmallMGemmGpu, MatchesReferenceAtEveryTileWidthAndSplit) {
  // clang-format off
  const std::vector<GemmCase> cases = {
      {.in = DType::BF16, .out = DType::BF16, .m = 1, .n = 4096, .k = 4096},        // o_proj, one token tile
      {.in = DType::BF16, .out = DType::BF16, .m = 8, .n = 6144, .k = 4096},        // qkv
      {.in = DType::BF16, .out = DType::BF16, .m = 13, .n = 4096, .k = 12288},      // down, two tiles, 5 rows idle
      {.in = DType::BF16, .out = DType::BF16, .m = 32, .n = 1000, .k = 1024, .bias = true},  // four tiles, n % 32 != 0
      {.in = DType::F16, .out = DType::F16, .m = 5, .n = 100, .k = 96, .bias = true},        // K of 3 blocks
      {.in = DType::BF16, .out = DType::F32, .m = 3, .n = 20000, .k = 512, .bias = true},    // logits-like, fp32 out
      {.in = DType::F16, .out = DType::F32, .m = 17, .n = 33, .k = 2048},
  };
  // clang-format on
  uint64_t seed = 200;
  for (const GemmCase& c : cases) {
    SCOPED_TRACE(case_name(c));
    for (int splits : {1, 2, 3, 8, 32}) {
      if (splits > c.k / 32) continue;
      run(c, splits, ++seed);
    }
  }
}

// The split partials are summed in split order by whichever CTA arrives last: the same bits every call.
TEST_F(SmallMGemmGpu, DeterministicAcrossCalls) {
  const GemmCase c{.in = DType::BF16, .out = DType::BF16, .m = 8, .n = 4096, .k = 12288};
  const std::vector<uint32_t> a = run(c, 16, 300), b = run(c, 16, 300);
  EXPECT_EQ(a, b);
}

// A captured split-K call replays correctly (each call leaves the arrival counters at zero for the next).
TEST_F(SmallMGemmGpu, GraphCaptureReplays) {
  check_graph_replays(6, 2048, 4096, 0.02f, 3, 31,
                      [&](const GemmParams& p, cudaStream_t st) { return small_m_gemm(p, 8, ws_, st); });
  const std::vector<int> counters = counters_.download();
  for (size_t i = 0; i < counters.size(); ++i) ASSERT_EQ(counters[i], 0) << "counter " << i;
}

TEST_F(SmallMGemmGpu, RefusesWhatItDoesNotTake) {
  DevBuf<uint16_t> buf(size_t{1} << 20);
  GemmParams p;
  p.x = buf.get();
  p.w = buf.get() + 4096;
  p.y = buf.get() + 8192;
  p.m = 4;
  p.n = 64;
  p.k = 256;
  ASSERT_TRUE(small_m_gemm_supports(p, 8, ws_));
  auto refused = [&](const GemmParams& q, int splits, const SmallMGemmWorkspace& ws, const char* why) {
    SCOPED_TRACE(why);
    EXPECT_FALSE(small_m_gemm_supports(q, splits, ws));
    EXPECT_EQ(small_m_gemm(q, splits, ws, nullptr), cudaErrorInvalidValue);
    EXPECT_NE(std::string(launch_error_detail()).find("small_m_gemm"), std::string::npos) << launch_error_detail();
  };
  GemmParams q = p;
  q.m = kSmallMMaxRows + 1;
  refused(q, 1, ws_, "m past kSmallMMaxRows");
  q = p;
  q.k = 48;
  refused(q, 1, ws_, "k % 32 != 0");
  q = p;
  q.x = buf.get() + 1;
  refused(q, 1, ws_, "x not 16-byte aligned");
  q = p;
  q.w = buf.get() + 4;
  refused(q, 1, ws_, "w not 16-byte aligned");
  refused(p, 9, ws_, "splits > k / 32");
  refused(p, 0, ws_, "splits 0");
  q = p;
  q.in_dtype = DType::F32;
  refused(q, 1, ws_, "fp32 input");
  SmallMGemmWorkspace small = ws_;
  small.partial_elems = static_cast<size_t>(8) * p.m * p.n - 1;
  refused(p, 8, small, "partials too small");
  small = ws_;
  small.num_counters = 1;
  refused(p, 8, small, "too few counters");
  EXPECT_TRUE(small_m_gemm_supports(p, 1, SmallMGemmWorkspace{}));  // one split needs no workspace
}

TEST(GemmGpuErrors, RejectsBadParametersNamingTheShape) {
  int dummy[16] = {};
  GemmParams p;
  p.x = p.w = dummy;
  p.y = dummy;
  p.m = 2;
  p.n = 3;
  p.k = 4;
  GemmRunner not_init;
  EXPECT_EQ(not_init.run(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("init"), std::string::npos) << launch_error_detail();
  GemmRunner r;
  ASSERT_EQ(r.init(1 << 20), cudaSuccess) << launch_error_detail();
  EXPECT_EQ(r.init(), cudaErrorInvalidValue);  // twice
  p.n = 0;
  EXPECT_EQ(r.run(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("m=2 n=0 k=4"), std::string::npos) << launch_error_detail();
  p.n = 3;
  p.m = -1;
  EXPECT_EQ(r.run(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("m=-1"), std::string::npos) << launch_error_detail();
  p.m = 2;
  p.in_dtype = DType::F32;
  EXPECT_EQ(r.run(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("in_dtype"), std::string::npos) << launch_error_detail();
  p.in_dtype = DType::BF16;
  p.out_dtype = DType::F16;
  EXPECT_EQ(r.run(p, nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(launch_error_detail()).find("out_dtype"), std::string::npos) << launch_error_detail();
  p.out_dtype = DType::BF16;
  p.y = nullptr;
  EXPECT_EQ(r.run(p, nullptr), cudaErrorInvalidValue);
  p.m = 0;  // no-op
  EXPECT_EQ(r.run(p, nullptr), cudaSuccess);
  EXPECT_EQ(r.cached_plans(), 0u);
}

}  // namespace
}  // namespace spade::kernels
