// CPU tests of kernels/gdn_ref.h: every buffered form (chunkwise decode, KV-only parallel form, parallel speculative
// verification + commit) against the recurrent form on the same random inputs, the recurrent form against an
// independent double-precision implementation of KVBuffer Eq. 11-12, and bad input.
//
// Error bounds (relative: max |x - ref| / max |ref| over a step's outputs, or over a whole state), with the worst
// values measured on these seeds when the bounds were set:
//   * recurrent fp32 vs double Householder form (Eq. 12):   kTolRecurrent = 2e-6   (measured 3.7e-7)
//   * buffered forms, fp32 buffer vs fp32 recurrent:         kTolF32 = 1e-5         (measured 1.0e-6: a different
//     summation order, exp(G_s - G_j) instead of a running product of exp(g), buffer sums of up to 64 terms)
//   * fp16 buffer (k^ and u rounded to 11 significant bits): kTolF16 = 2e-3 = 4 u  (u = 2^-11 = 4.9e-4; measured 5.4e-4)
//   * bf16 buffer (k^ and u rounded to 8 significant bits):  kTolBF16 = 1.6e-2 = 4 u (u = 2^-8 = 3.9e-3; measured 4.6e-3)
// The buffered forms keep the state and every in-step value in fp32; only the vectors held in the buffer are rounded,
// so the 16-bit errors stay near one unit round-off whatever the number of steps (the decay bounds the memory).
#include "kernels/gdn_ref.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"

namespace spade::kernels {
namespace {

using ::testing::HasSubstr;

constexpr double kTolRecurrent = 2e-6;
constexpr double kTolF32 = 1e-5;
constexpr double kTolF16 = 2e-3;
constexpr double kTolBF16 = 1.6e-2;

double tol_for(DType t) { return t == DType::F32 ? kTolF32 : t == DType::F16 ? kTolF16 : kTolBF16; }

const char* dtype_str(DType t) { return t == DType::F32 ? "f32" : t == DType::F16 ? "f16" : "bf16"; }

// ---- random tokens ---------------------------------------------------------------------------------------------------

struct Tok {
  std::vector<float> q, k, v, g, beta;
};

class Gen {
 public:
  Gen(const GdnDims& d, uint64_t seed) : d_(d), rng_(seed) {}
  Tok next() {
    Tok t;
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> gd(-0.06f, -0.002f);  // log decay: alpha in [0.94, 0.998]
    const size_t nk = static_cast<size_t>(d_.num_k_heads) * d_.head_k_dim;
    const size_t nv = static_cast<size_t>(d_.num_v_heads) * d_.head_v_dim;
    t.q.resize(nk);
    t.k.resize(nk);
    t.v.resize(nv);
    t.g.resize(d_.num_v_heads);
    t.beta.resize(d_.num_v_heads);
    for (float& x : t.q) x = nd(rng_);
    for (float& x : t.k) x = nd(rng_);
    for (float& x : t.v) x = nd(rng_);
    for (float& x : t.g) x = gd(rng_);
    for (float& x : t.beta) x = 1.f / (1.f + std::exp(-1.5f * nd(rng_)));  // sigmoid, in (0, 1)
    return t;
  }
  std::vector<float> state() {  // a non-zero checkpoint (a prefilled state)
    std::normal_distribution<float> nd(0.f, 0.3f);
    std::vector<float> s(static_cast<size_t>(d_.num_v_heads) * d_.head_k_dim * d_.head_v_dim);
    for (float& x : s) x = nd(rng_);
    return s;
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  GdnDims d_;
  std::mt19937_64 rng_;
};

// A step's tokens, ragged over the batch.
struct Step {
  std::vector<float> q, k, v, g, beta;
  std::vector<int32_t> cu{0};
  void add(const std::vector<Tok>& toks) {
    for (const Tok& t : toks) {
      q.insert(q.end(), t.q.begin(), t.q.end());
      k.insert(k.end(), t.k.begin(), t.k.end());
      v.insert(v.end(), t.v.begin(), t.v.end());
      g.insert(g.end(), t.g.begin(), t.g.end());
      beta.insert(beta.end(), t.beta.begin(), t.beta.end());
    }
    cu.push_back(cu.back() + static_cast<int32_t>(toks.size()));
  }
  int batch() const { return static_cast<int>(cu.size()) - 1; }
  int total() const { return cu.back(); }
  GdnTokens view() const {
    GdnTokens t;
    t.q = q.data();
    t.k = k.data();
    t.v = v.data();
    t.g = g.data();
    t.beta = beta.data();
    t.cu_tokens = cu.data();
    t.batch = batch();
    return t;
  }
};

double rel_err(const std::vector<float>& x, const std::vector<float>& ref, size_t begin = 0,
               size_t end = std::numeric_limits<size_t>::max()) {
  end = std::min(end, ref.size());
  double num = 0, den = 0;
  for (size_t i = begin; i < end; ++i) {
    if (!std::isfinite(x[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::fabs(static_cast<double>(x[i]) - ref[i]));
    den = std::max(den, std::fabs(static_cast<double>(ref[i])));
  }
  return den > 0 ? num / den : num;
}

// ---- the recurrent oracle: one state slot per sequence id --------------------------------------------------------------

class Recurrent {
 public:
  Recurrent(const GdnDims& d, int nseq) : d_(d), nseq_(nseq) {
    state_floats_ = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
    pool_.assign(state_floats_ * nseq, 0.f);
  }
  float* state(int id) { return pool_.data() + state_floats_ * id; }
  std::vector<float> state_copy(int id) { return std::vector<float>(state(id), state(id) + state_floats_); }
  std::vector<float> run(const std::vector<int32_t>& ids, const Step& s) {
    std::vector<float> out(static_cast<size_t>(s.total()) * d_.num_v_heads * d_.head_v_dim, std::nanf(""));
    GdnRecurrentParams p;
    p.dims = d_;
    p.tok = s.view();
    p.out = out.data();
    p.state_pool = pool_.data();
    p.num_state_slots = nseq_;
    p.state_slots = ids.data();
    gdn_recurrent_ref(p);
    return out;
  }

 private:
  GdnDims d_;
  int nseq_;
  size_t state_floats_;
  std::vector<float> pool_;
};

// ---- buffered steps through GdnCache ---------------------------------------------------------------------------------

GdnBufferedParams buffered_params(GdnCache& c, const Step& s, const std::vector<int32_t>& slots,
                                  const std::vector<uint8_t>& flags, std::vector<float>& out) {
  out.assign(static_cast<size_t>(s.total()) * c.config().dims.num_v_heads * c.config().dims.head_v_dim, std::nanf(""));
  GdnBufferedParams p;
  p.dims = c.config().dims;
  p.tok = s.view();
  p.out = out.data();
  p.state_pool = c.state_pool();
  p.num_state_slots = c.num_state_slots();
  p.buf = c.pool();
  p.seqs = c.table();
  p.seq_slots = slots.data();
  p.flags = flags.data();
  return p;
}

std::vector<float> decode(GdnCache& c, const std::vector<int32_t>& slots, const Step& s,
                          std::vector<uint8_t>* flags_out = nullptr, int next_tokens = 1) {
  const std::vector<uint8_t> flags = c.plan_decode(slots, s.cu, next_tokens);
  std::vector<float> out;
  gdn_chunkwise_decode_ref(buffered_params(c, s, slots, flags, out));
  c.finish_step();
  if (flags_out) *flags_out = flags;
  return out;
}

std::vector<float> verify(GdnCache& c, const std::vector<int32_t>& slots, const Step& s,
                          std::vector<uint8_t>* flags_out = nullptr) {
  const std::vector<uint8_t> flags = c.plan_verify(slots, s.cu);
  std::vector<float> out;
  gdn_parallel_verify_ref(buffered_params(c, s, slots, flags, out));
  if (flags_out) *flags_out = flags;
  return out;
}

bool mixed(const std::vector<uint8_t>& f) {
  bool any0 = false, any1 = false;
  for (uint8_t x : f) (x ? any1 : any0) = true;
  return any0 && any1;
}

// Expects `fn` to throw spade::Error whose message contains every substring.
template <typename F>
void expect_error(F fn, std::initializer_list<const char*> parts) {
  try {
    fn();
    ADD_FAILURE() << "no spade::Error thrown (expected: " << *parts.begin() << ")";
  } catch (const Error& e) {
    for (const char* part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

GdnDims dims(int hk, int hv, int dk, int dv) { return GdnDims{hk, hv, dk, dv}; }

// =====================================================================================================================
// Recurrent form
// =====================================================================================================================

// Independent implementation in double of KVBuffer Eq. 11-12 (Householder form S_t = (I - b k k^T) a S_{t-1} +
// b k v^T, o = S^T q), with transformers' repeat_interleave head mapping, l2norm (eps 1e-6) and scale d_k^-1/2.
TEST(GdnRecurrent, MatchesDoublePrecisionHouseholderForm) {
  for (const GdnDims d : {dims(2, 4, 64, 32), dims(3, 3, 16, 24), dims(1, 4, 32, 64)}) {
    Gen gen(d, 11);
    const int nseq = 2, steps = 12;
    Recurrent rec(d, nseq);
    std::vector<std::vector<double>> ref(nseq);
    for (int i = 0; i < nseq; ++i) {
      const std::vector<float> s0 = gen.state();
      std::copy(s0.begin(), s0.end(), rec.state(i));
      ref[i].assign(s0.begin(), s0.end());
    }
    const int group = d.num_v_heads / d.num_k_heads, dk = d.head_k_dim, dv = d.head_v_dim;
    double worst = 0;
    for (int t = 0; t < steps; ++t) {
      Step s;
      std::vector<Tok> toks;
      for (int i = 0; i < nseq; ++i) {
        toks.push_back(gen.next());
        s.add({toks.back()});
      }
      const std::vector<float> out = rec.run({0, 1}, s);
      std::vector<float> expect(out.size());
      for (int i = 0; i < nseq; ++i) {
        const Tok& tk = toks[i];
        for (int hv = 0; hv < d.num_v_heads; ++hv) {
          const int hk = hv / group;
          std::vector<double> q(dk), k(dk);
          double nq = 0, nk = 0;
          for (int j = 0; j < dk; ++j) {
            nq += double(tk.q[hk * dk + j]) * tk.q[hk * dk + j];
            nk += double(tk.k[hk * dk + j]) * tk.k[hk * dk + j];
          }
          for (int j = 0; j < dk; ++j) {
            q[j] = tk.q[hk * dk + j] / std::sqrt(nq + 1e-6) / std::sqrt(double(dk));
            k[j] = tk.k[hk * dk + j] / std::sqrt(nk + 1e-6);
          }
          const double a = std::exp(double(tk.g[hv])), b = tk.beta[hv];
          double* S = ref[i].data() + static_cast<size_t>(hv) * dk * dv;
          // kS = k^T (a S); S <- a S - b k (kS) + b k v^T
          std::vector<double> kS(dv, 0.0);
          for (int r = 0; r < dk; ++r)
            for (int c = 0; c < dv; ++c) kS[c] += k[r] * a * S[r * dv + c];
          for (int r = 0; r < dk; ++r)
            for (int c = 0; c < dv; ++c)
              S[r * dv + c] = a * S[r * dv + c] - b * k[r] * kS[c] + b * k[r] * tk.v[hv * dv + c];
          for (int c = 0; c < dv; ++c) {
            double o = 0;
            for (int r = 0; r < dk; ++r) o += q[r] * S[r * dv + c];
            expect[(static_cast<size_t>(i) * d.num_v_heads + hv) * dv + c] = static_cast<float>(o);
          }
        }
      }
      worst = std::max(worst, rel_err(out, expect));
    }
    EXPECT_LT(worst, kTolRecurrent) << d.num_k_heads << "/" << d.num_v_heads;
    for (int i = 0; i < nseq; ++i) {
      std::vector<float> fs(ref[i].begin(), ref[i].end());
      EXPECT_LT(rel_err(rec.state_copy(i), fs), kTolRecurrent);
    }
  }
}

TEST(GdnRecurrent, OptionsNormalisationAndScale) {
  // Without l2norm and with an explicit scale, a zero state gives o = scale * beta (q . k) v for the first token.
  const GdnDims d = dims(1, 2, 4, 3);
  std::vector<float> pool(2 * 4 * 3, 0.f), out(2 * 3);
  const std::vector<float> q = {1, 2, 0, -1}, k = {0.5f, 1, -1, 2}, v = {1, -2, 3, 4, 5, -6}, g = {-0.1f, -0.2f},
                           beta = {0.5f, 0.25f};
  const std::vector<int32_t> cu = {0, 1}, slots = {0};
  GdnRecurrentParams p;
  p.dims = d;
  p.opt.qk_l2norm = false;
  p.opt.scale = 0.5f;
  p.tok = GdnTokens{q.data(), k.data(), v.data(), g.data(), beta.data(), cu.data(), 1};
  p.out = out.data();
  p.state_pool = pool.data();
  p.num_state_slots = 1;
  p.state_slots = slots.data();
  gdn_recurrent_ref(p);
  const float qk = 1 * 0.5f + 2 * 1 + 0 * -1 + -1 * 2;  // 0.5
  for (int hv = 0; hv < 2; ++hv)
    for (int j = 0; j < 3; ++j) EXPECT_FLOAT_EQ(out[hv * 3 + j], 0.5f * beta[hv] * qk * v[hv * 3 + j]);
  // With l2norm: |q^| = 1/sqrt(d_k) by default -> o = beta (q^.k^) v with unit vectors.
  std::fill(pool.begin(), pool.end(), 0.f);
  p.opt = GdnOptions{};
  gdn_recurrent_ref(p);
  const float nq = std::sqrt(1 + 4 + 0 + 1 + 1e-6f), nk = std::sqrt(0.25f + 1 + 1 + 4 + 1e-6f);
  for (int hv = 0; hv < 2; ++hv)
    for (int j = 0; j < 3; ++j)
      EXPECT_NEAR(out[hv * 3 + j], beta[hv] * qk / (nq * nk) / 2.f * v[hv * 3 + j], 1e-6);
}

// Recurrent verification baseline ([RS] Algorithm 7): snapshots equal the states of a sequential run, the committed
// state slot is only read, and the swap commit makes the snapshot after the last accepted draft the state.
TEST(GdnRecurrent, DraftSnapshotsAndSwapCommit) {
  const GdnDims d = dims(2, 4, 16, 8);
  const int T = 3, batch = 2;
  Gen gen(d, 3);
  const size_t sf = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
  // Pool: per sequence T + 1 slots (column 0 committed, 1..T snapshots).
  std::vector<float> pool(sf * batch * (T + 1), std::nanf(""));
  std::vector<int32_t> spec(batch * (T + 1));
  for (int i = 0; i < batch * (T + 1); ++i) spec[i] = i;
  Recurrent seq(d, batch);
  for (int b = 0; b < batch; ++b) {
    const std::vector<float> s0 = gen.state();
    std::copy(s0.begin(), s0.end(), pool.begin() + sf * spec[b * (T + 1)]);
    std::copy(s0.begin(), s0.end(), seq.state(b));
  }
  std::vector<std::vector<Tok>> drafts(batch);
  Step s;
  for (int b = 0; b < batch; ++b) {
    for (int t = 0; t < T; ++t) drafts[b].push_back(gen.next());
    s.add(drafts[b]);
  }
  std::vector<int32_t> read(batch), snaps(batch * T);
  for (int b = 0; b < batch; ++b) {
    read[b] = spec[b * (T + 1)];
    for (int t = 0; t < T; ++t) snaps[b * T + t] = spec[b * (T + 1) + 1 + t];
  }
  const std::vector<float> before(pool.begin() + sf * read[0], pool.begin() + sf * (read[0] + 1));
  std::vector<float> out(static_cast<size_t>(batch) * T * d.num_v_heads * d.head_v_dim);
  GdnRecurrentParams p;
  p.dims = d;
  p.tok = s.view();
  p.out = out.data();
  p.state_pool = pool.data();
  p.num_state_slots = batch * (T + 1);
  p.state_slots = read.data();
  p.draft_state_slots = snaps.data();
  gdn_recurrent_ref(p);
  EXPECT_EQ(std::vector<float>(pool.begin() + sf * read[0], pool.begin() + sf * (read[0] + 1)), before);
  const size_t orow = static_cast<size_t>(d.num_v_heads) * d.head_v_dim;
  for (int t = 0; t < T; ++t) {
    Step one;
    for (int b = 0; b < batch; ++b) one.add({drafts[b][t]});
    const std::vector<float> o = seq.run({0, 1}, one);
    for (int b = 0; b < batch; ++b) {
      EXPECT_EQ(std::vector<float>(o.begin() + b * orow, o.begin() + (b + 1) * orow),
                std::vector<float>(out.begin() + (b * T + t) * orow, out.begin() + (b * T + t + 1) * orow));
      EXPECT_EQ(seq.state_copy(b), std::vector<float>(pool.begin() + sf * snaps[b * T + t],
                                                      pool.begin() + sf * (snaps[b * T + t] + 1)));
    }
  }
  const std::vector<int32_t> accepted = {2, 0};
  std::vector<int32_t> spec_before = spec;
  gdn_recurrent_verify_commit_ref(spec.data(), accepted.data(), batch, T);
  EXPECT_EQ(spec[0], spec_before[2]);  // sequence 0: snapshot after draft 2 is now its state
  EXPECT_EQ(spec[2], spec_before[0]);
  EXPECT_EQ(std::vector<int32_t>(spec.begin() + T + 1, spec.end()),
            std::vector<int32_t>(spec_before.begin() + T + 1, spec_before.end()));  // a = 0: unchanged
}

// =====================================================================================================================
// Chunkwise buffered decode
// =====================================================================================================================

struct ChunkCase {
  int L, bs, d;
  DType dtype;
};

// Three sequences with non-zero checkpoints, staggered by a first multi-token (buffered prefill) step so that flushes
// fall on different steps, then single-token decode for > 3 buffer cycles. Outputs and final checkpoints vs recurrent.
void run_chunkwise(const ChunkCase& cc, const GdnDims& d, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "L=" << cc.L << " bs=" << cc.bs << " d=" << cc.d << " " << dtype_str(cc.dtype)
                                  << " heads " << d.num_k_heads << "/" << d.num_v_heads);
  const int nseq = 3;
  GdnCacheConfig cfg;
  cfg.dims = d;
  cfg.max_seqs = 4;
  cfg.num_state_slots = 4;
  cfg.num_blocks = nseq * cc.L / cc.bs + 2;
  cfg.block_size = cc.bs;
  cfg.buffer_size = cc.L;
  cfg.buffer_dtype = cc.dtype;
  GdnCache cache(cfg);
  Gen gen(d, seed);
  Recurrent rec(d, nseq);
  std::vector<int32_t> slots;
  for (int i = 0; i < nseq; ++i) {
    slots.push_back(cache.admit(100 + i, false));
    const std::vector<float> s0 = gen.state();
    std::copy(s0.begin(), s0.end(), cache.state(100 + i));
    std::copy(s0.begin(), s0.end(), rec.state(i));
  }
  const std::vector<int32_t> ids = {0, 1, 2};
  const double tol = tol_for(cc.dtype);
  double worst = 0;
  std::vector<int> flushes(nseq, 0);
  bool saw_mixed = false;
  // Step 0: 1, L/2 and L-1 tokens (an L-token prefill would flush; L = 4 gives 1, 2, 3).
  {
    Step s;
    for (int n : {1, cc.L / 2, cc.L - 1}) {
      std::vector<Tok> toks;
      for (int t = 0; t < n; ++t) toks.push_back(gen.next());
      s.add(toks);
    }
    std::vector<uint8_t> flags;
    const std::vector<float> out = decode(cache, slots, s, &flags);
    worst = std::max(worst, rel_err(out, rec.run(ids, s)));
    for (int i = 0; i < nseq; ++i) flushes[i] += flags[i];
  }
  const int steps = 3 * cc.L + 3;
  for (int step = 0; step < steps; ++step) {
    Step s;
    for (int i = 0; i < nseq; ++i) s.add({gen.next()});
    std::vector<uint8_t> flags;
    const std::vector<float> out = decode(cache, slots, s, &flags);
    const std::vector<float> ref = rec.run(ids, s);
    worst = std::max(worst, rel_err(out, ref));
    saw_mixed |= mixed(flags);
    for (int i = 0; i < nseq; ++i) flushes[i] += flags[i];
  }
  EXPECT_LT(worst, tol);
  EXPECT_TRUE(saw_mixed) << "no step mixed flushing and non-flushing sequences";
  for (int i = 0; i < nseq; ++i) EXPECT_GE(flushes[i], 3) << "sequence " << i;
  // A pure flush (0 tokens, flag set) folds the rest of the buffer; the checkpoint equals the recurrent state.
  {
    Step s;
    for (int i = 0; i < nseq; ++i) s.add({});
    std::vector<uint8_t> all(nseq, kGdnFlush);
    std::vector<float> out;
    gdn_chunkwise_decode_ref(buffered_params(cache, s, slots, all, out));
    for (int i = 0; i < nseq; ++i) {
      EXPECT_EQ(cache.ring_len(slots[i]), 0);
      const float* st = cache.state(100 + i);
      const std::vector<float> got(st, st + rec.state_copy(i).size());
      EXPECT_LT(rel_err(got, rec.state_copy(i)), tol) << "checkpoint of sequence " << i;
    }
  }
}

TEST(GdnChunkwise, MatchesRecurrentFp32AllBufferAndBlockSizes) {
  const std::vector<std::pair<int, int>> lb = {{4, 4}, {8, 8}, {16, 8}, {16, 16}, {64, 8}, {64, 16}};
  for (int dk : {64, 128})
    for (auto [L, bs] : lb) run_chunkwise({L, bs, dk, DType::F32}, dims(2, 4, dk, dk), 1000 + L * 7 + bs + dk);
}

TEST(GdnChunkwise, MatchesRecurrent16BitBuffers) {
  const std::vector<std::pair<int, int>> lb = {{4, 4}, {16, 8}, {16, 16}, {64, 16}};
  for (DType t : {DType::BF16, DType::F16})
    for (auto [L, bs] : lb) run_chunkwise({L, bs, 128, t}, dims(2, 4, 128, 128), 2000 + L + bs);
  run_chunkwise({8, 8, 64, DType::BF16}, dims(2, 4, 64, 64), 2100);
}

TEST(GdnChunkwise, HeadMappings) {
  run_chunkwise({8, 8, 64, DType::F32}, dims(3, 3, 64, 64), 3001);    // no GQA
  run_chunkwise({16, 8, 64, DType::F32}, dims(1, 4, 64, 32), 3002);   // one key head for four value heads, d_v != d_k
  run_chunkwise({16, 16, 64, DType::F32}, dims(4, 8, 64, 64), 3003);  // groups of 2
}

// Qwen3-Next / Qwen3.5 GDN shapes: 16 key heads, 32 value heads, d = 128, bf16 buffer of 16.
TEST(GdnChunkwise, QwenShapes) { run_chunkwise({16, 16, 128, DType::BF16}, dims(16, 32, 128, 128), 4001); }

// =====================================================================================================================
// KV-only parallel form -> chunkwise
// =====================================================================================================================

void run_kv_only(int d_head, int L, int bs, DType dtype, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "d=" << d_head << " L=" << L << " bs=" << bs << " " << dtype_str(dtype));
  const GdnDims d = dims(2, 4, d_head, d_head);
  GdnCacheConfig cfg;
  cfg.dims = d;
  cfg.max_seqs = 3;
  cfg.num_state_slots = 3;
  cfg.num_blocks = 2 * d_head / bs + L / bs;
  cfg.block_size = bs;
  cfg.buffer_size = L;
  cfg.kv_only_limit = d_head;
  cfg.buffer_dtype = dtype;
  GdnCache cache(cfg);
  Gen gen(d, seed);
  // Sequences 0 and 1 start KV-only (new requests: zero state, never materialised); sequence 2 is chunkwise with a
  // prefilled checkpoint, in the same batches.
  Recurrent rec(d, 3);
  std::vector<int32_t> slots = {cache.admit(7, true), cache.admit(8, true), cache.admit(9, false)};
  const std::vector<float> s2 = gen.state();
  std::copy(s2.begin(), s2.end(), cache.state(9));
  std::copy(s2.begin(), s2.end(), rec.state(2));
  EXPECT_EQ(cache.state_slot(slots[0]), -1);
  EXPECT_EQ(cache.free_state_slots(), 2);
  const std::vector<int32_t> ids = {0, 1, 2};
  std::vector<int> ctx = {5, 1, 3};  // first step: buffered prefill of different lengths
  {
    Step s;
    for (int n : ctx) {
      std::vector<Tok> toks;
      for (int t = 0; t < n; ++t) toks.push_back(gen.next());
      s.add(toks);
    }
    EXPECT_LT(rel_err(decode(cache, slots, s), rec.run(ids, s)), tol_for(dtype));
  }
  double worst = 0;
  std::vector<int> compressed_at = {-1, -1};
  const int steps = d_head + 3 * L;
  for (int step = 0; step < steps; ++step) {
    Step s;
    for (int i = 0; i < 3; ++i) s.add({gen.next()});
    std::vector<uint8_t> flags;
    const std::vector<float> out = decode(cache, slots, s, &flags);
    worst = std::max(worst, rel_err(out, rec.run(ids, s)));
    for (int i = 0; i < 2; ++i) {
      ++ctx[i];
      if (compressed_at[i] < 0) {
        if (cache.state_valid(slots[i])) {
          compressed_at[i] = ctx[i];
          EXPECT_EQ(flags[i], kGdnFlush);
          // Switched to the chunkwise ring of L tokens; the other blocks went back to the pool.
          EXPECT_EQ(cache.ring_capacity(slots[i]), L);
          EXPECT_EQ(cache.held_blocks(7 + i), L / bs);
          EXPECT_EQ(cache.ring_len(slots[i]), 0);
          EXPECT_EQ(cache.ring_start(slots[i]), 0);
          // The compressed checkpoint is the recurrent state at context d.
          const std::vector<float> ref = rec.state_copy(i);
          const std::vector<float> got(cache.state(7 + i), cache.state(7 + i) + ref.size());
          EXPECT_LT(rel_err(got, ref), tol_for(dtype));
        } else {
          // Still KV-only: no state slot, the whole context is in the buffer.
          EXPECT_EQ(cache.state_slot(slots[i]), -1);
          EXPECT_EQ(cache.ring_len(slots[i]), ctx[i]);
        }
      }
    }
  }
  EXPECT_LT(worst, tol_for(dtype));
  // [KVB] Sec. 3.4: compressed once the context reaches d, not before.
  EXPECT_EQ(compressed_at[0], d_head);
  EXPECT_EQ(compressed_at[1], d_head);
  EXPECT_EQ(cache.free_state_slots(), 0);
}

TEST(GdnKvOnly, SwitchesToChunkwiseAtHeadDim) {
  run_kv_only(64, 16, 8, DType::F32, 51);
  run_kv_only(64, 8, 8, DType::BF16, 52);
  run_kv_only(128, 16, 16, DType::F32, 53);
  run_kv_only(128, 32, 16, DType::F16, 54);
}

// =====================================================================================================================
// Parallel speculative verification
// =====================================================================================================================

// For T = 1..8, one sequence per accepted count a = 0..T in one batch (mixed commits), each with a different number of
// buffered tokens before the window, and a different decode phase. Every draft's output equals the recurrent
// verification baseline's (per-draft snapshots); after commit, decoding continues and matches a recurrent run over the
// accepted tokens only; the baseline with its swap commit stays in step too.
TEST(GdnParallelVerify, EveryDraftCountAndAcceptedCount) {
  const GdnDims d = dims(2, 4, 64, 64);
  const int L = 16, bs = 8;
  for (int T = 1; T <= 8; ++T) {
    SCOPED_TRACE(testing::Message() << "T=" << T);
    const int nseq = T + 1;
    GdnCacheConfig cfg;
    cfg.dims = d;
    cfg.max_seqs = nseq;
    cfg.num_state_slots = nseq;
    cfg.num_blocks = nseq * L / bs;
    cfg.block_size = bs;
    cfg.buffer_size = L;
    cfg.buffer_dtype = DType::F32;
    GdnCache cache(cfg);
    Gen gen(d, 7000 + T);
    Recurrent truth(d, nseq);                // accepted tokens only
    Recurrent base(d, nseq * (T + 1));       // the snapshot baseline: T + 1 slots per sequence
    std::vector<int32_t> spec(nseq * (T + 1));
    for (int i = 0; i < nseq * (T + 1); ++i) spec[i] = i;
    std::vector<int32_t> slots, ids;
    for (int i = 0; i < nseq; ++i) {
      slots.push_back(cache.admit(i, false));
      ids.push_back(i);
      const std::vector<float> s0 = gen.state();
      std::copy(s0.begin(), s0.end(), cache.state(i));
      std::copy(s0.begin(), s0.end(), truth.state(i));
      std::copy(s0.begin(), s0.end(), base.state(spec[i * (T + 1)]));
    }
    auto base_slots = [&]() {
      std::vector<int32_t> r(nseq);
      for (int i = 0; i < nseq; ++i) r[i] = spec[i * (T + 1)];
      return r;
    };
    // Prefix: buffered tokens h0 = i % (L - 2T + 1) so some windows start right at the flush threshold.
    double worst = 0;
    {
      Step s;
      for (int i = 0; i < nseq; ++i) {
        std::vector<Tok> toks;
        for (int t = 0; t < i % (L - 2 * T + 1); ++t) toks.push_back(gen.next());
        s.add(toks);
      }
      const std::vector<float> out = decode(cache, slots, s, nullptr, T);
      worst = std::max(worst, rel_err(out, truth.run(ids, s)));
      base.run(base_slots(), s);
    }
    // Two verification rounds: round 0 accepts a = i (every count 0..T), round 1 a = T - i.
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<Tok>> drafts(nseq);
      Step s;
      for (int i = 0; i < nseq; ++i) {
        for (int t = 0; t < T; ++t) drafts[i].push_back(gen.next());
        s.add(drafts[i]);
      }
      std::vector<uint8_t> flags;
      const std::vector<float> out = verify(cache, slots, s, &flags);
      // Baseline verification with snapshots.
      std::vector<float> bout(out.size());
      std::vector<int32_t> read = base_slots(), snaps(nseq * T);
      for (int i = 0; i < nseq; ++i)
        for (int t = 0; t < T; ++t) snaps[i * T + t] = spec[i * (T + 1) + 1 + t];
      {
        GdnRecurrentParams p;
        p.dims = d;
        p.tok = s.view();
        p.out = bout.data();
        p.state_pool = base.state(0);
        p.num_state_slots = nseq * (T + 1);
        p.state_slots = read.data();
        p.draft_state_slots = snaps.data();
        gdn_recurrent_ref(p);
      }
      EXPECT_LT(rel_err(out, bout), kTolF32) << "round " << round;
      std::vector<int32_t> acc(nseq);
      for (int i = 0; i < nseq; ++i) acc[i] = round == 0 ? i : T - i;
      // Commit: only ring_len moves; the buffer storage is untouched (a pointer move, no data).
      std::vector<int32_t> len_before(nseq), start_before(nseq);
      for (int i = 0; i < nseq; ++i) {
        len_before[i] = cache.ring_len(slots[i]);
        start_before[i] = cache.ring_start(slots[i]);
      }
      const GdnBufferPool pool = cache.pool();
      const size_t kbytes = static_cast<size_t>(cfg.num_blocks) * bs * d.num_k_heads * d.head_k_dim * 4;
      const std::vector<char> kcopy(static_cast<const char*>(pool.k), static_cast<const char*>(pool.k) + kbytes);
      cache.commit(slots, s.cu, acc);
      EXPECT_TRUE(std::equal(kcopy.begin(), kcopy.end(), static_cast<const char*>(pool.k)));
      for (int i = 0; i < nseq; ++i) {
        EXPECT_EQ(cache.ring_len(slots[i]), len_before[i] + acc[i]);
        EXPECT_EQ(cache.ring_start(slots[i]), start_before[i]);
      }
      cache.finish_step();
      gdn_recurrent_verify_commit_ref(spec.data(), acc.data(), nseq, T);
      // The truth sees the accepted tokens only.
      Step accepted;
      for (int i = 0; i < nseq; ++i)
        accepted.add(std::vector<Tok>(drafts[i].begin(), drafts[i].begin() + acc[i]));
      const std::vector<float> tout = truth.run(ids, accepted);
      // The accepted drafts' outputs are the truth's outputs.
      const size_t orow = static_cast<size_t>(d.num_v_heads) * d.head_v_dim;
      for (int i = 0; i < nseq; ++i) {
        const std::vector<float> o(out.begin() + s.cu[i] * orow, out.begin() + (s.cu[i] + acc[i]) * orow);
        const std::vector<float> r(tout.begin() + accepted.cu[i] * orow, tout.begin() + accepted.cu[i + 1] * orow);
        if (acc[i] > 0) worst = std::max(worst, rel_err(o, r));
      }
      // Standard decode afterwards (crossing at least one flush), vs truth and vs the baseline from its committed slot.
      for (int step = 0; step < L / 2 + 1; ++step) {
        Step one;
        for (int i = 0; i < nseq; ++i) one.add({gen.next()});
        const std::vector<float> o = decode(cache, slots, one, nullptr, T);  // keep T slots free for round 1
        const std::vector<float> r = truth.run(ids, one);
        worst = std::max(worst, rel_err(o, r));
        worst = std::max(worst, rel_err(base.run(base_slots(), one), r));
      }
    }
    EXPECT_LT(worst, kTolF32);
  }
}

// Many rounds of verification with random accepted counts per sequence, interleaved with plain decode steps, with a
// buffer small enough that the speculative flush (h + 2T > L) fires often and in mixed batches; 16-bit buffers too.
void run_spec_rounds(int T, int L, int bs, DType dtype, const GdnDims& d, uint64_t seed) {
  SCOPED_TRACE(testing::Message() << "T=" << T << " L=" << L << " bs=" << bs << " " << dtype_str(dtype));
  const int nseq = 4;
  GdnCacheConfig cfg;
  cfg.dims = d;
  cfg.max_seqs = nseq;
  cfg.num_state_slots = nseq;
  cfg.num_blocks = nseq * L / bs;
  cfg.block_size = bs;
  cfg.buffer_size = L;
  cfg.buffer_dtype = dtype;
  GdnCache cache(cfg);
  Gen gen(d, seed);
  Recurrent truth(d, nseq);
  std::vector<int32_t> slots, ids;
  for (int i = 0; i < nseq; ++i) {
    slots.push_back(cache.admit(i, false));
    ids.push_back(i);
    const std::vector<float> s0 = gen.state();
    std::copy(s0.begin(), s0.end(), cache.state(i));
    std::copy(s0.begin(), s0.end(), truth.state(i));
  }
  std::uniform_int_distribution<int> acc_dist(0, T);
  double worst = 0;
  int spec_flushes = 0;
  bool saw_mixed = false;
  const size_t orow = static_cast<size_t>(d.num_v_heads) * d.head_v_dim;
  for (int round = 0; round < 24; ++round) {
    if (round % 5 == 4) {  // a plain decode step between verifications
      Step one;
      for (int i = 0; i < nseq; ++i) one.add({gen.next()});
      worst = std::max(worst, rel_err(decode(cache, slots, one, nullptr, T), truth.run(ids, one)));
      continue;
    }
    std::vector<std::vector<Tok>> drafts(nseq);
    Step s;
    for (int i = 0; i < nseq; ++i) {
      for (int t = 0; t < T; ++t) drafts[i].push_back(gen.next());
      s.add(drafts[i]);
    }
    std::vector<uint8_t> flags;
    for (int i = 0; i < nseq; ++i) EXPECT_LE(cache.ring_len(slots[i]) + T, L) << "fewer than T free slots";
    const std::vector<float> out = verify(cache, slots, s, &flags);
    for (uint8_t f : flags) spec_flushes += f;
    saw_mixed |= mixed(flags);
    std::vector<int32_t> acc(nseq);
    for (int i = 0; i < nseq; ++i) acc[i] = acc_dist(gen.rng());
    cache.commit(slots, s.cu, acc);
    cache.finish_step();
    Step accepted;
    for (int i = 0; i < nseq; ++i) accepted.add(std::vector<Tok>(drafts[i].begin(), drafts[i].begin() + acc[i]));
    const std::vector<float> tout = truth.run(ids, accepted);
    for (int i = 0; i < nseq; ++i) {
      if (acc[i] == 0) continue;
      const std::vector<float> o(out.begin() + s.cu[i] * orow, out.begin() + (s.cu[i] + acc[i]) * orow);
      const std::vector<float> r(tout.begin() + accepted.cu[i] * orow, tout.begin() + accepted.cu[i + 1] * orow);
      worst = std::max(worst, rel_err(o, r));
    }
  }
  EXPECT_LT(worst, tol_for(dtype));
  EXPECT_GE(spec_flushes, 4);
  EXPECT_TRUE(saw_mixed);
}

TEST(GdnParallelVerify, RandomRoundsWithEarlyFlush) {
  run_spec_rounds(4, 8, 8, DType::F32, dims(2, 4, 64, 64), 81);
  run_spec_rounds(3, 8, 4, DType::F32, dims(1, 2, 32, 48), 82);
  run_spec_rounds(8, 16, 16, DType::BF16, dims(2, 4, 128, 128), 83);
  run_spec_rounds(4, 16, 8, DType::F16, dims(2, 4, 64, 64), 84);
  run_spec_rounds(4, 16, 16, DType::BF16, dims(16, 32, 128, 128), 85);  // Qwen3-Next shapes
}

// Speculative decoding while still in the KV-only form: the compression happens in a verification step (only the
// committed entries), the accepted drafts stay buffered and are moved to the chunkwise ring by finish_step().
TEST(GdnParallelVerify, KvOnlyCompressionDuringSpeculation) {
  const GdnDims d = dims(2, 4, 32, 32);
  const int T = 4, L = 8, bs = 4;
  GdnCacheConfig cfg;
  cfg.dims = d;
  cfg.max_seqs = 2;
  cfg.num_state_slots = 2;
  cfg.num_blocks = 2 * 32 / bs;
  cfg.block_size = bs;
  cfg.buffer_size = L;
  cfg.kv_only_limit = 32;
  cfg.buffer_dtype = DType::F32;
  GdnCache cache(cfg);
  Gen gen(d, 91);
  Recurrent truth(d, 2);
  const std::vector<int32_t> slots = {cache.admit(1, true), cache.admit(2, true)}, ids = {0, 1};
  std::mt19937_64 rng(92);
  std::uniform_int_distribution<int> acc_dist(1, T);
  double worst = 0;
  bool switched = false;
  const size_t orow = static_cast<size_t>(d.num_v_heads) * d.head_v_dim;
  for (int round = 0; round < 30; ++round) {
    std::vector<std::vector<Tok>> drafts(2);
    Step s;
    for (int i = 0; i < 2; ++i) {
      for (int t = 0; t < T; ++t) drafts[i].push_back(gen.next());
      s.add(drafts[i]);
    }
    const std::vector<float> out = verify(cache, slots, s);
    const std::vector<int32_t> acc = {acc_dist(rng), acc_dist(rng)};
    cache.commit(slots, s.cu, acc);
    cache.finish_step();
    switched |= cache.state_valid(slots[0]) && cache.ring_capacity(slots[0]) == L && cache.ring_len(slots[0]) > 0;
    Step accepted;
    for (int i = 0; i < 2; ++i) accepted.add(std::vector<Tok>(drafts[i].begin(), drafts[i].begin() + acc[i]));
    const std::vector<float> tout = truth.run(ids, accepted);
    for (int i = 0; i < 2; ++i) {
      const std::vector<float> o(out.begin() + s.cu[i] * orow, out.begin() + (s.cu[i] + acc[i]) * orow);
      const std::vector<float> r(tout.begin() + accepted.cu[i] * orow, tout.begin() + accepted.cu[i + 1] * orow);
      worst = std::max(worst, rel_err(o, r));
    }
  }
  EXPECT_LT(worst, kTolF32);
  EXPECT_TRUE(switched) << "no sequence moved accepted drafts into the chunkwise ring";
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(cache.state_valid(slots[i]));
    EXPECT_EQ(cache.held_blocks(1 + i), L / bs);
  }
}

// =====================================================================================================================
// Flush rules, memory formulas
// =====================================================================================================================

TEST(GdnFlushRules, DecodeWhenFullVerifyOneWindowEarly) {
  const int L = 16;
  std::vector<int32_t> start(1, 0), len(1, 0), cap(1, L), table(2, 0), state(1, 0);
  std::vector<uint8_t> valid(1, 1);
  GdnSeqTable t{start.data(), len.data(), cap.data(), table.data(), state.data(), valid.data(), 1, 2};
  const int32_t slot = 0;
  uint8_t f = 9;
  for (int h = 0; h <= L; ++h) {
    len[0] = h;
    for (int n = 0; h + n <= L; ++n) {
      const std::vector<int32_t> cu = {0, n};
      gdn_decode_flush_flags_ref(t, &slot, cu.data(), 1, &f);
      EXPECT_EQ(f, h + n >= L ? kGdnFlush : 0) << h << " " << n;  // [RS] Alg. 6: flush when full
      gdn_decode_flush_flags_ref(t, &slot, cu.data(), 1, &f, 4);
      EXPECT_EQ(f, h + n + 4 > L ? kGdnFlush : 0) << h << " " << n;  // room for 4 drafts next
      if (n >= 1 && 2 * n <= L) {
        gdn_verify_flush_flags_ref(t, &slot, cu.data(), 1, &f);
        EXPECT_EQ(f, h + 2 * n > L ? kGdnFlush : 0) << h << " " << n;
      }
    }
  }
  // [RS] Sec. 5.3's example: h + T = L - 1 does not flush under h + T > L, but does under h + 2T > L.
  len[0] = 9;
  const std::vector<int32_t> cu = {0, 6};
  gdn_verify_flush_flags_ref(t, &slot, cu.data(), 1, &f);
  EXPECT_EQ(f, kGdnFlush);
}

TEST(GdnMemory, SpeculativeDecodingPerRequest) {
  const GdnDims q = dims(16, 32, 128, 128);  // Qwen3-Next / Qwen3.5 GDN layer
  EXPECT_EQ(gdn_state_bytes(q), 32u * 128 * 128 * 4);                     // 2 MiB
  EXPECT_EQ(gdn_buffer_token_bytes(q, DType::BF16), 16u * 128 * 2 + 32u * 128 * 2 + 32u * 4);  // 12416
  EXPECT_EQ(gdn_buffer_token_bytes(q, DType::F32), 16u * 128 * 4 + 32u * 128 * 4 + 32u * 4);
  EXPECT_EQ(gdn_spec_bytes_snapshots(q, 4), 5u * 2097152);
  EXPECT_EQ(gdn_spec_bytes_buffered(q, 4, 16, 16, DType::BF16), 2097152u + 16u * 12416);
  EXPECT_EQ(gdn_spec_bytes_buffered(q, 4, 12, 8, DType::BF16), 2097152u + 16u * 12416);  // rounded to whole blocks
  // Ours stays ~1 state while the snapshots grow by one state per draft.
  for (int T = 1; T <= 8; ++T)
    EXPECT_LT(gdn_spec_bytes_buffered(q, T, 16, 16, DType::BF16), gdn_spec_bytes_snapshots(q, T));
  expect_error([&] { gdn_spec_bytes_buffered(q, 8, 8, 8, DType::BF16); }, {"buffer_size 8 < 2 * num_drafts 16"});
}

// =====================================================================================================================
// Bad input
// =====================================================================================================================

TEST(GdnErrors, CacheConfigAndPools) {
  GdnCacheConfig c;
  c.dims = dims(2, 4, 16, 16);
  c.max_seqs = 2;
  c.num_state_slots = 1;
  c.num_blocks = 3;
  c.block_size = 8;
  c.buffer_size = 12;
  expect_error([&] { GdnCache x(c); }, {"GdnCache", "buffer_size 12 is not a positive multiple of block_size 8"});
  c.buffer_size = 16;
  c.kv_only_limit = 20;
  expect_error([&] { GdnCache x(c); }, {"kv_only_limit 20 is not a multiple of block_size 8"});
  c.kv_only_limit = 0;
  c.dims = dims(2, 5, 16, 16);
  expect_error([&] { GdnCache x(c); }, {"num_v_heads 5 must be a positive multiple of dims.num_k_heads 2"});
  c.dims = dims(2, 4, 16, 16);
  GdnCache cache(c);
  expect_error([&] { cache.admit(1, true); }, {"KV-only", "kv_only_limit is 0"});
  cache.admit(1, false);  // 2 of 3 blocks, the only state slot
  expect_error([&] { cache.admit(2, false); }, {"buffer pool exhausted", "sequence 2", "needs 2 blocks", "1 of 3 free"});
  EXPECT_EQ(cache.free_blocks(), 1);  // the failed admission returned what it took
  expect_error([&] { cache.admit(1, false); }, {"sequence 1 is already admitted"});
  c.num_blocks = 8;
  GdnCache c2(c);
  c2.admit(1, false);
  expect_error([&] { c2.admit(2, false); }, {"state pool exhausted", "1 state slots"});
  EXPECT_EQ(c2.free_blocks(), 6);
  c.max_seqs = 1;
  GdnCache c3(c);
  c3.admit(1, false);
  expect_error([&] { c3.admit(2, false); }, {"no free sequence slot"});
  expect_error([&] { c3.slot(99); }, {"unknown sequence 99"});
  c3.release(1);
  EXPECT_NO_THROW(c3.admit(2, false));
}

TEST(GdnErrors, KvOnlyCompressionNeedsAStateSlot) {
  GdnCacheConfig c;
  c.dims = dims(1, 1, 8, 8);
  c.max_seqs = 2;
  c.num_state_slots = 1;
  c.num_blocks = 4;
  c.block_size = 8;
  c.buffer_size = 8;
  c.kv_only_limit = 8;
  GdnCache cache(c);
  Gen gen(c.dims, 1);
  const std::vector<int32_t> slots = {cache.admit(1, false), cache.admit(2, true)};
  Step s;
  for (int i = 0; i < 2; ++i) {
    std::vector<Tok> toks;
    for (int t = 0; t < 8; ++t) toks.push_back(gen.next());
    s.add(toks);
  }
  expect_error([&] { cache.plan_decode(slots, s.cu); }, {"state pool exhausted", "sequence 2"});
  // Bypassing the planner: the kernel refuses to compress without a destination.
  std::vector<uint8_t> flags = {kGdnFlush, kGdnFlush};
  std::vector<float> out;
  expect_error([&] { gdn_chunkwise_decode_ref(buffered_params(cache, s, slots, flags, out)); },
               {"gdn_chunkwise_decode_ref", "flushes (compresses its KV-only buffer)", "assign a state slot"});
}

TEST(GdnErrors, BufferedStepInputs) {
  const GdnDims d = dims(2, 4, 8, 8);
  GdnCacheConfig c;
  c.dims = d;
  c.max_seqs = 2;
  c.num_state_slots = 2;
  c.num_blocks = 4;
  c.block_size = 4;
  c.buffer_size = 8;
  c.buffer_dtype = DType::F32;
  GdnCache cache(c);
  Gen gen(d, 2);
  const std::vector<int32_t> slots = {cache.admit(1, false)};
  auto tokens = [&](int n) {
    Step s;
    std::vector<Tok> toks;
    for (int t = 0; t < n; ++t) toks.push_back(gen.next());
    s.add(toks);
    return s;
  };
  std::vector<float> out;
  std::vector<uint8_t> none = {0};
  // Ring overflow: 9 tokens into a ring of 8.
  Step s9 = tokens(9);
  expect_error([&] { cache.plan_decode(slots, s9.cu); }, {"holds 0 buffered tokens + 9 new > ring_capacity 8"});
  expect_error([&] { gdn_chunkwise_decode_ref(buffered_params(cache, s9, slots, none, out)); },
               {"gdn_chunkwise_decode_ref", "ring_capacity 8", "flush rule"});
  // Verification window too large for the early-flush rule.
  Step s5 = tokens(5);
  expect_error([&] { cache.plan_verify(slots, s5.cu); }, {"ring_capacity 8", "< 2T = 10", "h + 2T > L"});
  // Shapes and slots.
  Step s1 = tokens(1);
  {
    GdnBufferedParams p = buffered_params(cache, s1, slots, none, out);
    p.dims.num_v_heads = 3;
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"num_v_heads 3 must be a positive multiple"});
    p = buffered_params(cache, s1, slots, none, out);
    const std::vector<int32_t> bad = {5};
    p.seq_slots = bad.data();
    expect_error([&] { gdn_parallel_verify_ref(p); }, {"gdn_parallel_verify_ref", "seq_slots[0] = 5 outside 0..1"});
    p = buffered_params(cache, s1, slots, none, out);
    const std::vector<uint8_t> weird = {4};
    p.flags = weird.data();
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"flags[0] = 4 has unknown bits"});
    p = buffered_params(cache, s1, slots, none, out);
    const std::vector<int32_t> cu_bad = {0, -1};
    p.tok.cu_tokens = cu_bad.data();
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"cu_tokens decreases at sequence 0"});
    p = buffered_params(cache, s1, slots, none, out);
    p.buf.block_size = 3;
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"ring_capacity[0] = 8 is not a positive multiple of block_size 3"});
    p = buffered_params(cache, s1, slots, none, out);
    std::vector<int32_t> table(p.seqs.block_tables, p.seqs.block_tables + 2 * p.seqs.max_blocks_per_seq);
    table[1] = -1;
    p.seqs.block_tables = table.data();
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"block_tables[0][1] = -1 outside 0..3"});
    table[1] = table[0];
    expect_error([&] { gdn_chunkwise_decode_ref(p); }, {"block", "used twice"});
  }
  // Commit of more drafts than were verified; commit without a pending verification batch.
  Step s3 = tokens(3);
  verify(cache, slots, s3);
  expect_error([&] { cache.finish_step(); }, {"not committed"});
  expect_error([&] { cache.commit(slots, s3.cu, {4}); }, {"accepted[0] = 4 outside 0..3"});
  cache.commit(slots, s3.cu, {2});
  EXPECT_EQ(cache.ring_len(slots[0]), 2);
  expect_error([&] { cache.commit(slots, s3.cu, {1}); }, {"not the one of the last plan_verify"});
}

TEST(GdnErrors, RecurrentInputs) {
  const GdnDims d = dims(1, 2, 4, 4);
  Gen gen(d, 3);
  Step s;
  s.add({gen.next()});
  s.add({gen.next()});
  std::vector<float> pool(3 * 2 * 4 * 4, 0.f), out(2 * 2 * 4);
  std::vector<int32_t> slots = {0, 1};
  GdnRecurrentParams p;
  p.dims = d;
  p.tok = s.view();
  p.out = out.data();
  p.state_pool = pool.data();
  p.num_state_slots = 3;
  p.state_slots = slots.data();
  EXPECT_NO_THROW(gdn_recurrent_ref(p));
  slots = {0, 3};
  expect_error([&] { gdn_recurrent_ref(p); }, {"gdn_recurrent_ref", "state_slots[1] = 3 outside 0..2"});
  slots = {1, 1};
  expect_error([&] { gdn_recurrent_ref(p); }, {"state slot 1 is used by two sequences"});
  slots = {0, 1};
  std::vector<int32_t> drafts = {2, 0};
  p.draft_state_slots = drafts.data();
  expect_error([&] { gdn_recurrent_ref(p); }, {"draft_state_slots[1] = 0", "a sequence's state slot"});
  p.draft_state_slots = nullptr;
  p.tok.q = nullptr;
  expect_error([&] { gdn_recurrent_ref(p); }, {"tok.q/k/v/g/beta must be non-null"});
  p.tok = s.view();
  p.dims.head_k_dim = 0;
  expect_error([&] { gdn_recurrent_ref(p); }, {"dims.head_k_dim must be >= 1"});
  p.dims = d;
  p.opt.scale = -1.f;
  expect_error([&] { gdn_recurrent_ref(p); }, {"opt.scale must be finite and >= 0"});
  std::vector<int32_t> spec = {0, 1, 2};
  const std::vector<int32_t> acc = {3};
  expect_error([&] { gdn_recurrent_verify_commit_ref(spec.data(), acc.data(), 1, 2); }, {"accepted[0] = 3 outside 0..2"});
}

}  // namespace
}  // namespace spade::kernels
