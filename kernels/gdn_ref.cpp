#include "kernels/gdn_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"

namespace spade::kernels {
namespace {

// ---- validation ----------------------------------------------------------------------------------------------------

void check_dims(const GdnDims& d, const char* fn) {
  SPADE_CHECK(d.num_k_heads >= 1, "{}: dims.num_k_heads must be >= 1, got {}", fn, d.num_k_heads);
  SPADE_CHECK(d.num_v_heads >= 1 && d.num_v_heads % d.num_k_heads == 0,
              "{}: dims.num_v_heads {} must be a positive multiple of dims.num_k_heads {}", fn, d.num_v_heads,
              d.num_k_heads);
  SPADE_CHECK(d.head_k_dim >= 1, "{}: dims.head_k_dim must be >= 1, got {}", fn, d.head_k_dim);
  SPADE_CHECK(d.head_v_dim >= 1, "{}: dims.head_v_dim must be >= 1, got {}", fn, d.head_v_dim);
}

float resolve_scale(const GdnOptions& o, const GdnDims& d, const char* fn) {
  SPADE_CHECK(o.scale >= 0.f && std::isfinite(o.scale), "{}: opt.scale must be finite and >= 0, got {}", fn, o.scale);
  SPADE_CHECK(o.l2norm_eps >= 0.f && std::isfinite(o.l2norm_eps), "{}: opt.l2norm_eps must be finite and >= 0, got {}",
              fn, o.l2norm_eps);
  return o.scale > 0.f ? o.scale : 1.f / std::sqrt(static_cast<float>(d.head_k_dim));
}

// Returns total_tokens.
int check_tokens(const GdnTokens& t, const float* out, const char* fn) {
  SPADE_CHECK(t.batch >= 0, "{}: tok.batch must be >= 0, got {}", fn, t.batch);
  if (t.batch == 0) return 0;
  SPADE_CHECK(t.cu_tokens != nullptr, "{}: tok.cu_tokens is null", fn);
  SPADE_CHECK(t.cu_tokens[0] == 0, "{}: tok.cu_tokens[0] must be 0, got {}", fn, t.cu_tokens[0]);
  for (int b = 0; b < t.batch; ++b)
    SPADE_CHECK(t.cu_tokens[b + 1] >= t.cu_tokens[b], "{}: tok.cu_tokens decreases at sequence {} ({} -> {})", fn, b,
                t.cu_tokens[b], t.cu_tokens[b + 1]);
  const int total = t.cu_tokens[t.batch];
  if (total > 0) {
    SPADE_CHECK(t.q && t.k && t.v && t.g && t.beta, "{}: tok.q/k/v/g/beta must be non-null for {} tokens", fn, total);
    SPADE_CHECK(out != nullptr, "{}: out is null for {} tokens", fn, total);
  }
  return total;
}

// ---- q/k preprocessing ([HF] l2norm + scale) ------------------------------------------------------------------------

void l2norm_scale(const float* x, int n, bool l2, float eps, float mul, float* y) {
  float f = mul;
  if (l2) {
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    f = mul / std::sqrt(ss + eps);
  }
  for (int i = 0; i < n; ++i) y[i] = x[i] * f;
}

// qn, kn: [total_tokens, num_k_heads, head_k_dim] normalised (q also scaled).
void normalise_qk(const GdnDims& d, const GdnOptions& o, float scale, const GdnTokens& t, int total,
                  std::vector<float>& qn, std::vector<float>& kn) {
  const size_t rows = static_cast<size_t>(total) * d.num_k_heads;
  qn.resize(rows * d.head_k_dim);
  kn.resize(rows * d.head_k_dim);
  for (size_t r = 0; r < rows; ++r) {
    const size_t off = r * d.head_k_dim;
    l2norm_scale(t.q + off, d.head_k_dim, o.qk_l2norm, o.l2norm_eps, scale, qn.data() + off);
    l2norm_scale(t.k + off, d.head_k_dim, o.qk_l2norm, o.l2norm_eps, 1.f, kn.data() + off);
  }
}

// ---- buffer element access ------------------------------------------------------------------------------------------

void load_row(const void* base, DType t, size_t off, int n, float* dst) {
  switch (t) {
    case DType::F32: {
      const float* s = static_cast<const float*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
  }
}

void store_row(void* base, DType t, size_t off, int n, const float* src) {
  switch (t) {
    case DType::F32: {
      float* dst = static_cast<float*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = src[i];
      return;
    }
    case DType::BF16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::F16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + off;
      for (int i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
      return;
    }
  }
}

float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[0..dv) = S^T x for S: [dk, dv] row-major.
void state_read(const float* S, const float* x, int dk, int dv, float* y) {
  for (int j = 0; j < dv; ++j) y[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    const float xi = x[i];
    const float* row = S + static_cast<size_t>(i) * dv;
    for (int j = 0; j < dv; ++j) y[j] += xi * row[j];
  }
}

// S += x y^T.
void state_rank1(float* S, const float* x, const float* y, int dk, int dv) {
  for (int i = 0; i < dk; ++i) {
    const float xi = x[i];
    float* row = S + static_cast<size_t>(i) * dv;
    for (int j = 0; j < dv; ++j) row[j] += xi * y[j];
  }
}

// ---- buffered forms: shared validation and addressing ---------------------------------------------------------------

struct Geometry {
  GdnDims d;
  int group = 1;
  size_t state_floats = 0;  // one slot
  size_t head_state = 0;    // one value head of one slot
};

Geometry geometry(const GdnDims& d) {
  Geometry g;
  g.d = d;
  g.group = d.num_v_heads / d.num_k_heads;
  g.head_state = static_cast<size_t>(d.head_k_dim) * d.head_v_dim;
  g.state_floats = g.head_state * d.num_v_heads;
  return g;
}

// One sequence's ring as seen by a step.
struct Ring {
  int seq_slot = 0;
  int start = 0, len = 0, cap = 0;
  const int32_t* table = nullptr;
  int state_slot = -1;
  bool valid = false;
  // Token index (block * block_size + offset) of logical entry i.
  size_t token(int i, int block_size) const {
    const int r = (start + i) % cap;
    return static_cast<size_t>(table[r / block_size]) * block_size + r % block_size;
  }
};

void check_table(const GdnSeqTable& s, const char* fn) {
  SPADE_CHECK(s.max_seqs >= 1, "{}: seqs.max_seqs must be >= 1, got {}", fn, s.max_seqs);
  SPADE_CHECK(s.max_blocks_per_seq >= 1, "{}: seqs.max_blocks_per_seq must be >= 1, got {}", fn,
              s.max_blocks_per_seq);
  SPADE_CHECK(s.ring_start && s.ring_len && s.ring_capacity && s.block_tables && s.state_slots && s.state_valid,
              "{}: every GdnSeqTable array must be non-null", fn);
}

// Entry checks of the per-sequence table updates (flush flags, verify commit): batch >= 0, the table, and seq_slots,
// cu_tokens and the output `out` (named out_name) set. Returns false for an empty batch (nothing to do).
bool check_seq_batch(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens, const void* out,
                     const char* out_name, int batch, const char* fn) {
  SPADE_CHECK(batch >= 0, "{}: batch must be >= 0, got {}", fn, batch);
  if (batch == 0) return false;
  check_table(seqs, fn);
  SPADE_CHECK(seq_slots && cu_tokens && out, "{}: seq_slots, cu_tokens and {} must be non-null", fn, out_name);
  return true;
}

// seq_slots[b], checked to lie in the table.
int checked_slot(const GdnSeqTable& seqs, const int32_t* seq_slots, int b, const char* fn) {
  const int slot = seq_slots[b];
  SPADE_CHECK(slot >= 0 && slot < seqs.max_seqs, "{}: seq_slots[{}] = {} outside 0..{}", fn, b, slot,
              seqs.max_seqs - 1);
  return slot;
}

// Validates the metadata of sequence slot `slot` (batch row b) and returns its ring. Does not look at blocks.
Ring ring_of(const GdnSeqTable& s, int b, int slot, int block_size, const char* fn) {
  SPADE_CHECK(slot >= 0 && slot < s.max_seqs, "{}: seq_slots[{}] = {} outside 0..{}", fn, b, slot, s.max_seqs - 1);
  Ring r;
  r.seq_slot = slot;
  r.cap = s.ring_capacity[slot];
  SPADE_CHECK(r.cap >= 1 && r.cap % block_size == 0,
              "{}: ring_capacity[{}] = {} is not a positive multiple of block_size {}", fn, slot, r.cap, block_size);
  SPADE_CHECK(r.cap / block_size <= s.max_blocks_per_seq,
              "{}: ring_capacity[{}] = {} needs {} blocks > max_blocks_per_seq {}", fn, slot, r.cap, r.cap / block_size,
              s.max_blocks_per_seq);
  r.start = s.ring_start[slot];
  r.len = s.ring_len[slot];
  SPADE_CHECK(r.start >= 0 && r.start < r.cap, "{}: ring_start[{}] = {} outside 0..{}", fn, slot, r.start, r.cap - 1);
  SPADE_CHECK(r.len >= 0 && r.len <= r.cap, "{}: ring_len[{}] = {} outside 0..{}", fn, slot, r.len, r.cap);
  r.table = s.block_tables + static_cast<size_t>(slot) * s.max_blocks_per_seq;
  r.state_slot = s.state_slots[slot];
  r.valid = s.state_valid[slot] != 0;
  return r;
}

enum class Mode { kDecode, kVerify };

// The core of gdn_chunkwise_decode_ref (kDecode) and gdn_parallel_verify_ref (kVerify).
void buffered_step(const GdnBufferedParams& p, Mode mode, const char* fn) {
  check_dims(p.dims, fn);
  const float scale = resolve_scale(p.opt, p.dims, fn);
  const int total = check_tokens(p.tok, p.out, fn);
  const int batch = p.tok.batch;
  if (batch == 0) return;
  const Geometry geo = geometry(p.dims);
  const GdnDims& d = p.dims;
  const int dk = d.head_k_dim, dv = d.head_v_dim, Hk = d.num_k_heads, Hv = d.num_v_heads;
  const GdnBufferPool& buf = p.buf;
  SPADE_CHECK(buf.k && buf.u && buf.g, "{}: buf.k/u/g must be non-null", fn);
  SPADE_CHECK(buf.block_size >= 1, "{}: buf.block_size must be >= 1, got {}", fn, buf.block_size);
  SPADE_CHECK(buf.num_blocks >= 1, "{}: buf.num_blocks must be >= 1, got {}", fn, buf.num_blocks);
  SPADE_CHECK(buf.dtype == DType::F32 || buf.dtype == DType::BF16 || buf.dtype == DType::F16,
              "{}: buf.dtype is not F32/BF16/F16", fn);
  SPADE_CHECK(p.num_state_slots >= 1 && p.state_pool != nullptr, "{}: state_pool is null or num_state_slots {} < 1", fn,
              p.num_state_slots);
  SPADE_CHECK(p.seq_slots && p.flags, "{}: seq_slots and flags must be non-null", fn);
  check_table(p.seqs, fn);
  const int bs = buf.block_size;

  // ---- validate every sequence before touching anything ----
  std::vector<Ring> rings(batch);
  std::vector<uint8_t> seen_seq(p.seqs.max_seqs, 0), seen_block(buf.num_blocks, 0), seen_state(p.num_state_slots, 0);
  for (int b = 0; b < batch; ++b) {
    const int slot = p.seq_slots[b];
    Ring& r = rings[b] = ring_of(p.seqs, b, slot, bs, fn);
    SPADE_CHECK(!seen_seq[slot], "{}: sequence slot {} appears twice in seq_slots", fn, slot);
    seen_seq[slot] = 1;
    SPADE_CHECK((p.flags[b] & ~kGdnFlush) == 0, "{}: flags[{}] = {} has unknown bits", fn, b, p.flags[b]);
    const int n = p.tok.cu_tokens[b + 1] - p.tok.cu_tokens[b];
    SPADE_CHECK(r.len + n <= r.cap,
                "{}: sequence slot {} holds {} buffered tokens + {} new > ring_capacity {} (the flush rule was not "
                "applied{})",
                fn, slot, r.len, n, r.cap, mode == Mode::kVerify ? ": flush when h + 2T > L" : "");
    for (int i = 0; i < r.cap / bs; ++i) {
      const int blk = r.table[i];
      SPADE_CHECK(blk >= 0 && blk < buf.num_blocks, "{}: block_tables[{}][{}] = {} outside 0..{}", fn, slot, i, blk,
                  buf.num_blocks - 1);
      SPADE_CHECK(!seen_block[blk], "{}: block {} is used twice (sequence slot {} block-table entry {})", fn, blk, slot,
                  i);
      seen_block[blk] = 1;
    }
    const bool flush = (p.flags[b] & kGdnFlush) != 0;
    if (r.valid || flush) {
      SPADE_CHECK(r.state_slot >= 0 && r.state_slot < p.num_state_slots,
                  "{}: sequence slot {} {} but its state slot is {} (valid: 0..{}){}", fn, slot,
                  r.valid ? "has a valid checkpoint" : "flushes (compresses its KV-only buffer)", r.state_slot,
                  p.num_state_slots - 1, r.valid ? "" : "; assign a state slot before the compressing step");
      SPADE_CHECK(!seen_state[r.state_slot], "{}: state slot {} is used by two sequences in one step", fn,
                  r.state_slot);
      seen_state[r.state_slot] = 1;
    }
  }

  // ---- q^/k^ once per token and key head; new keys written to the buffer before the per-head work ----
  std::vector<float> qn, kn;
  normalise_qk(d, p.opt, scale, p.tok, total, qn, kn);
  for (int b = 0; b < batch; ++b) {
    const Ring& r = rings[b];
    const int t0 = p.tok.cu_tokens[b], n = p.tok.cu_tokens[b + 1] - t0;
    for (int s = 0; s < n; ++s) {
      const size_t tok = r.token(r.len + s, bs);
      for (int hk = 0; hk < Hk; ++hk)
        store_row(buf.k, buf.dtype, (tok * Hk + hk) * dk, dk,
                  kn.data() + (static_cast<size_t>(t0 + s) * Hk + hk) * dk);
    }
  }

  // ---- per (sequence, value head): outputs, U, flush ----
  const long work = static_cast<long>(batch) * Hv;
#pragma omp parallel for schedule(dynamic) if (static_cast<long>(total + batch) * Hv * dk * dv > (1L << 20))
  for (long w = 0; w < work; ++w) {
    const int b = static_cast<int>(w / Hv), hv = static_cast<int>(w % Hv), hk = hv / geo.group;
    const Ring& r = rings[b];
    const int t0 = p.tok.cu_tokens[b], n = p.tok.cu_tokens[b + 1] - t0, h = r.len;
    const bool flush = (p.flags[b] & kGdnFlush) != 0;

    // Buffered entries 0..h-1 of this head (stored precision) and the cumulative log decay since the checkpoint.
    std::vector<float> kb(static_cast<size_t>(h) * dk), ub(static_cast<size_t>(h) * dv), Gb(h);
    float G = 0.f;
    for (int j = 0; j < h; ++j) {
      const size_t tok = r.token(j, bs);
      load_row(buf.k, buf.dtype, (tok * Hk + hk) * dk, dk, kb.data() + static_cast<size_t>(j) * dk);
      load_row(buf.u, buf.dtype, (tok * Hv + hv) * dv, dv, ub.data() + static_cast<size_t>(j) * dv);
      G += buf.g[tok * Hv + hv];
      Gb[j] = G;
    }
    const float Gh = G;
    std::vector<float> Gs(n);
    for (int s = 0; s < n; ++s) {
      G += p.tok.g[static_cast<size_t>(t0 + s) * Hv + hv];
      Gs[s] = G;
    }
    float* S0 = r.valid ? p.state_pool + static_cast<size_t>(r.state_slot) * geo.state_floats + hv * geo.head_state
                        : nullptr;

    if (n > 0) {
      auto q_of = [&](int s) { return qn.data() + (static_cast<size_t>(t0 + s) * Hk + hk) * dk; };
      auto k_of = [&](int s) { return kn.data() + (static_cast<size_t>(t0 + s) * Hk + hk) * dk; };
      std::vector<float> R(static_cast<size_t>(n) * dv), C(static_cast<size_t>(n) * dv, 0.f), a(dv);
      for (int s = 0; s < n; ++s) {
        const float* ks = k_of(s);
        const float* vs = p.tok.v + (static_cast<size_t>(t0 + s) * Hv + hv) * dv;
        const float beta = p.tok.beta[static_cast<size_t>(t0 + s) * Hv + hv];
        float* Rs = R.data() + static_cast<size_t>(s) * dv;
        float* Cs = C.data() + static_cast<size_t>(s) * dv;
        // History readout at k^_s (-> R) and q^_s (-> C, the output's history part).
        for (int j = 0; j < dv; ++j) Rs[j] = 0.f;
        if (S0) {
          const float e = std::exp(Gs[s]);
          state_read(S0, ks, dk, dv, a.data());
          for (int j = 0; j < dv; ++j) Rs[j] = e * a[j];
          state_read(S0, q_of(s), dk, dv, a.data());
          for (int j = 0; j < dv; ++j) Cs[j] = e * a[j];
        }
        for (int j = 0; j < h; ++j) {
          const float e = std::exp(Gs[s] - Gb[j]);
          const float wk = e * dot(ks, kb.data() + static_cast<size_t>(j) * dk, dk);
          const float wq = e * dot(q_of(s), kb.data() + static_cast<size_t>(j) * dk, dk);
          const float* uj = ub.data() + static_cast<size_t>(j) * dv;
          for (int i = 0; i < dv; ++i) {
            Rs[i] += wk * uj[i];
            Cs[i] += wq * uj[i];
          }
        }
        for (int j = 0; j < dv; ++j) Rs[j] = beta * (vs[j] - Rs[j]);
      }
      // W = (I + A)^{-1}, A_{s,s'} = beta_s e^{G_s - G_s'} (k^_s . k^_s') for s' < s (UT transform, [RS] Alg. 8 l.3-5).
      std::vector<float> A(static_cast<size_t>(n) * n, 0.f), W(static_cast<size_t>(n) * n, 0.f);
      for (int s = 0; s < n; ++s) {
        const float beta = p.tok.beta[static_cast<size_t>(t0 + s) * Hv + hv];
        for (int t = 0; t < s; ++t)
          A[static_cast<size_t>(s) * n + t] = beta * std::exp(Gs[s] - Gs[t]) * dot(k_of(s), k_of(t), dk);
      }
      for (int s = 0; s < n; ++s) {
        W[static_cast<size_t>(s) * n + s] = 1.f;
        for (int t = 0; t < s; ++t) {
          float acc = 0.f;
          for (int m = t; m < s; ++m) acc += A[static_cast<size_t>(s) * n + m] * W[static_cast<size_t>(m) * n + t];
          W[static_cast<size_t>(s) * n + t] = -acc;
        }
      }
      // U = W R; outputs; U and g appended to the buffer.
      std::vector<float> U(static_cast<size_t>(n) * dv, 0.f);
      for (int s = 0; s < n; ++s) {
        float* Us = U.data() + static_cast<size_t>(s) * dv;
        for (int t = 0; t <= s; ++t) {
          const float wst = W[static_cast<size_t>(s) * n + t];
          const float* Rt = R.data() + static_cast<size_t>(t) * dv;
          for (int j = 0; j < dv; ++j) Us[j] += wst * Rt[j];
        }
      }
      for (int s = 0; s < n; ++s) {
        float* o = p.out + (static_cast<size_t>(t0 + s) * Hv + hv) * dv;
        const float* Cs = C.data() + static_cast<size_t>(s) * dv;
        for (int j = 0; j < dv; ++j) o[j] = Cs[j];
        for (int t = 0; t <= s; ++t) {
          const float wq = std::exp(Gs[s] - Gs[t]) * dot(q_of(s), k_of(t), dk);
          const float* Ut = U.data() + static_cast<size_t>(t) * dv;
          for (int j = 0; j < dv; ++j) o[j] += wq * Ut[j];
        }
        const size_t tok = r.token(h + s, bs);
        store_row(buf.u, buf.dtype, (tok * Hv + hv) * dv, dv, U.data() + static_cast<size_t>(s) * dv);
        buf.g[tok * Hv + hv] = p.tok.g[static_cast<size_t>(t0 + s) * Hv + hv];
      }
    }

    // Flush: S <- e^{G_n} S_0 + sum_{j<n} e^{G_n - G_j} k_j u_j^T over the folded entries, read back in stored
    // precision (decode: all h + n; verify: the h committed ones only).
    if (flush) {
      const int nf = mode == Mode::kDecode ? h + n : h;
      float* S = p.state_pool + static_cast<size_t>(r.state_slot) * geo.state_floats + hv * geo.head_state;
      const float Gf = mode == Mode::kDecode ? G : Gh;
      if (S0) {
        const float e = std::exp(Gf);
        for (size_t i = 0; i < geo.head_state; ++i) S[i] *= e;
      } else {
        std::fill(S, S + geo.head_state, 0.f);
      }
      std::vector<float> kj(dk), uj(dv);
      float Gj = 0.f;
      for (int j = 0; j < nf; ++j) {
        const size_t tok = r.token(j, bs);
        load_row(buf.k, buf.dtype, (tok * Hk + hk) * dk, dk, kj.data());
        load_row(buf.u, buf.dtype, (tok * Hv + hv) * dv, dv, uj.data());
        Gj += buf.g[tok * Hv + hv];
        const float e = std::exp(Gf - Gj);
        for (int i = 0; i < dv; ++i) uj[i] *= e;
        state_rank1(S, kj.data(), uj.data(), dk, dv);
      }
    }
  }

  // ---- metadata: commit (decode), flush pointer moves ----
  for (int b = 0; b < batch; ++b) {
    const Ring& r = rings[b];
    const int n = p.tok.cu_tokens[b + 1] - p.tok.cu_tokens[b];
    const bool flush = (p.flags[b] & kGdnFlush) != 0;
    if (mode == Mode::kDecode) {
      if (flush) {
        p.seqs.ring_start[r.seq_slot] = (r.start + r.len + n) % r.cap;
        p.seqs.ring_len[r.seq_slot] = 0;
      } else {
        p.seqs.ring_len[r.seq_slot] = r.len + n;
      }
    } else if (flush) {
      p.seqs.ring_start[r.seq_slot] = (r.start + r.len) % r.cap;
      p.seqs.ring_len[r.seq_slot] = 0;
    }
    if (flush) p.seqs.state_valid[r.seq_slot] = 1;
  }
}

void flush_flags(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens, int batch,
                 uint8_t* flags, Mode mode, int next_tokens, const char* fn) {
  if (!check_seq_batch(seqs, seq_slots, cu_tokens, flags, "flags", batch, fn)) return;
  for (int b = 0; b < batch; ++b) {
    const int slot = checked_slot(seqs, seq_slots, b, fn);
    const int n = cu_tokens[b + 1] - cu_tokens[b];
    SPADE_CHECK(n >= 0, "{}: cu_tokens decreases at sequence {}", fn, b);
    const int h = seqs.ring_len[slot], cap = seqs.ring_capacity[slot];
    SPADE_CHECK(cap >= 1, "{}: ring_capacity[{}] = {} must be >= 1", fn, slot, cap);
    SPADE_CHECK(h >= 0 && h + n <= cap, "{}: sequence slot {} holds {} buffered tokens + {} new > ring_capacity {}",
                fn, slot, h, n, cap);
    if (mode == Mode::kDecode) {
      SPADE_CHECK(next_tokens >= 1 && next_tokens <= cap,
                  "{}: next_tokens {} outside 1..ring_capacity {} of sequence slot {}", fn, next_tokens, cap, slot);
      flags[b] = h + n + next_tokens > cap ? kGdnFlush : 0;
    } else {
      SPADE_CHECK(2 * n <= cap,
                  "{}: ring_capacity {} of sequence slot {} < 2T = {}: flushing one window early (h + 2T > L) needs "
                  "L >= 2T",
                  fn, cap, slot, 2 * n);
      flags[b] = h + 2 * n > cap ? kGdnFlush : 0;
    }
  }
}

}  // namespace

// =====================================================================================================================
// Recurrent form
// =====================================================================================================================

void gdn_recurrent_ref(const GdnRecurrentParams& p) {
  const char* fn = "gdn_recurrent_ref";
  check_dims(p.dims, fn);
  const float scale = resolve_scale(p.opt, p.dims, fn);
  const int total = check_tokens(p.tok, p.out, fn);
  const int batch = p.tok.batch;
  if (batch == 0) return;
  SPADE_CHECK(p.state_pool != nullptr && p.num_state_slots >= 1, "{}: state_pool is null or num_state_slots {} < 1",
              fn, p.num_state_slots);
  SPADE_CHECK(p.state_slots != nullptr, "{}: state_slots is null", fn);
  const Geometry geo = geometry(p.dims);
  const GdnDims& d = p.dims;
  const int dk = d.head_k_dim, dv = d.head_v_dim, Hk = d.num_k_heads, Hv = d.num_v_heads;

  // Slots: reads in range; every written slot distinct and never also read in this call.
  std::vector<int> role(p.num_state_slots, 0);  // 1 = read, 2 = written
  for (int b = 0; b < batch; ++b) {
    const int s = p.state_slots[b];
    SPADE_CHECK(s >= 0 && s < p.num_state_slots, "{}: state_slots[{}] = {} outside 0..{}", fn, b, s,
                p.num_state_slots - 1);
    SPADE_CHECK(role[s] == 0, "{}: state slot {} is used by two sequences (state_slots[{}])", fn, s, b);
    role[s] = 1;
  }
  if (p.draft_state_slots) {
    for (int i = 0; i < total; ++i) {
      const int s = p.draft_state_slots[i];
      if (s < 0) continue;
      SPADE_CHECK(s < p.num_state_slots, "{}: draft_state_slots[{}] = {} outside 0..{}", fn, i, s,
                  p.num_state_slots - 1);
      SPADE_CHECK(role[s] == 0, "{}: draft_state_slots[{}] = {} is already {} in this call", fn, i, s,
                  role[s] == 1 ? "a sequence's state slot" : "another draft's snapshot slot");
      role[s] = 2;
    }
  }

  std::vector<float> qn, kn;
  normalise_qk(d, p.opt, scale, p.tok, total, qn, kn);

  const long work = static_cast<long>(batch) * Hv;
#pragma omp parallel for schedule(dynamic) if (static_cast<long>(total) * Hv * dk * dv > (1L << 20))
  for (long w = 0; w < work; ++w) {
    const int b = static_cast<int>(w / Hv), hv = static_cast<int>(w % Hv), hk = hv / geo.group;
    const int t0 = p.tok.cu_tokens[b], t1 = p.tok.cu_tokens[b + 1];
    float* slot_state = p.state_pool + static_cast<size_t>(p.state_slots[b]) * geo.state_floats + hv * geo.head_state;
    std::vector<float> S(slot_state, slot_state + geo.head_state), kv(dv), delta(dv);
    for (int t = t0; t < t1; ++t) {
      const float* q = qn.data() + (static_cast<size_t>(t) * Hk + hk) * dk;
      const float* k = kn.data() + (static_cast<size_t>(t) * Hk + hk) * dk;
      const float* v = p.tok.v + (static_cast<size_t>(t) * Hv + hv) * dv;
      const float alpha = std::exp(p.tok.g[static_cast<size_t>(t) * Hv + hv]);
      const float beta = p.tok.beta[static_cast<size_t>(t) * Hv + hv];
      for (float& x : S) x *= alpha;                  // S <- exp(g) S
      state_read(S.data(), k, dk, dv, kv.data());     // kv_mem = S^T k^
      for (int j = 0; j < dv; ++j) delta[j] = (v[j] - kv[j]) * beta;  // u = beta (v - kv_mem)
      state_rank1(S.data(), k, delta.data(), dk, dv);  // S <- S + k^ u^T
      state_read(S.data(), q, dk, dv, p.out + (static_cast<size_t>(t) * Hv + hv) * dv);  // o = S^T q^
      if (p.draft_state_slots && p.draft_state_slots[t] >= 0) {
        float* snap = p.state_pool + static_cast<size_t>(p.draft_state_slots[t]) * geo.state_floats +
                      hv * geo.head_state;
        std::copy(S.begin(), S.end(), snap);
      }
    }
    if (!p.draft_state_slots) std::copy(S.begin(), S.end(), slot_state);
  }
}

void gdn_recurrent_verify_commit_ref(int32_t* spec_state_slots, const int32_t* accepted, int batch, int num_drafts) {
  const char* fn = "gdn_recurrent_verify_commit_ref";
  SPADE_CHECK(batch >= 0 && num_drafts >= 1, "{}: batch {} must be >= 0 and num_drafts {} >= 1", fn, batch,
              num_drafts);
  if (batch == 0) return;
  SPADE_CHECK(spec_state_slots && accepted, "{}: spec_state_slots and accepted must be non-null", fn);
  for (int b = 0; b < batch; ++b)
    SPADE_CHECK(accepted[b] >= 0 && accepted[b] <= num_drafts, "{}: accepted[{}] = {} outside 0..{}", fn, b,
                accepted[b], num_drafts);
  for (int b = 0; b < batch; ++b) {
    const int a = accepted[b];
    if (a > 0) std::swap(spec_state_slots[static_cast<size_t>(b) * (num_drafts + 1)],
                         spec_state_slots[static_cast<size_t>(b) * (num_drafts + 1) + a]);
  }
}

// =====================================================================================================================
// Buffered forms
// =====================================================================================================================

void gdn_chunkwise_decode_ref(const GdnBufferedParams& p) { buffered_step(p, Mode::kDecode, "gdn_chunkwise_decode_ref"); }

void gdn_parallel_verify_ref(const GdnBufferedParams& p) { buffered_step(p, Mode::kVerify, "gdn_parallel_verify_ref"); }

void gdn_verify_commit_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens,
                           const int32_t* accepted, int batch) {
  const char* fn = "gdn_verify_commit_ref";
  if (!check_seq_batch(seqs, seq_slots, cu_tokens, accepted, "accepted", batch, fn)) return;
  for (int b = 0; b < batch; ++b) {
    const int slot = checked_slot(seqs, seq_slots, b, fn);
    const int T = cu_tokens[b + 1] - cu_tokens[b];
    SPADE_CHECK(accepted[b] >= 0 && accepted[b] <= T, "{}: accepted[{}] = {} outside 0..{} (drafts verified)", fn, b,
                accepted[b], T);
    SPADE_CHECK(seqs.ring_len[slot] + accepted[b] <= seqs.ring_capacity[slot],
                "{}: sequence slot {}: ring_len {} + accepted {} > ring_capacity {}", fn, slot, seqs.ring_len[slot],
                accepted[b], seqs.ring_capacity[slot]);
  }
  for (int b = 0; b < batch; ++b) seqs.ring_len[seq_slots[b]] += accepted[b];
}

void gdn_decode_flush_flags_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens, int batch,
                                uint8_t* flags, int next_tokens) {
  flush_flags(seqs, seq_slots, cu_tokens, batch, flags, Mode::kDecode, next_tokens, "gdn_decode_flush_flags_ref");
}

void gdn_verify_flush_flags_ref(const GdnSeqTable& seqs, const int32_t* seq_slots, const int32_t* cu_tokens,
                                int batch, uint8_t* flags) {
  flush_flags(seqs, seq_slots, cu_tokens, batch, flags, Mode::kVerify, 0, "gdn_verify_flush_flags_ref");
}

// =====================================================================================================================
// Memory formulas
// =====================================================================================================================

size_t gdn_state_bytes(const GdnDims& d) {
  check_dims(d, "gdn_state_bytes");
  return static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim * 4;
}

size_t gdn_buffer_token_bytes(const GdnDims& d, DType dtype) {
  check_dims(d, "gdn_buffer_token_bytes");
  const size_t s = dtype_size(dtype);
  return static_cast<size_t>(d.num_k_heads) * d.head_k_dim * s + static_cast<size_t>(d.num_v_heads) * d.head_v_dim * s +
         static_cast<size_t>(d.num_v_heads) * 4;
}

size_t gdn_spec_bytes_snapshots(const GdnDims& d, int num_drafts) {
  SPADE_CHECK(num_drafts >= 1, "gdn_spec_bytes_snapshots: num_drafts must be >= 1, got {}", num_drafts);
  return static_cast<size_t>(num_drafts + 1) * gdn_state_bytes(d);
}

size_t gdn_spec_bytes_buffered(const GdnDims& d, int num_drafts, int buffer_size, int block_size, DType dtype) {
  const char* fn = "gdn_spec_bytes_buffered";
  SPADE_CHECK(num_drafts >= 1, "{}: num_drafts must be >= 1, got {}", fn, num_drafts);
  SPADE_CHECK(block_size >= 1, "{}: block_size must be >= 1, got {}", fn, block_size);
  SPADE_CHECK(buffer_size >= 2 * num_drafts, "{}: buffer_size {} < 2 * num_drafts {} (flush rule h + 2T > L)", fn,
              buffer_size, 2 * num_drafts);
  const size_t tokens = static_cast<size_t>((buffer_size + block_size - 1) / block_size) * block_size;
  return gdn_state_bytes(d) + tokens * gdn_buffer_token_bytes(d, dtype);
}

// =====================================================================================================================
// GdnCache
// =====================================================================================================================

namespace {

const GdnCacheConfig& validated(const GdnCacheConfig& c) {
  const char* fn = "GdnCache";
  check_dims(c.dims, fn);
  SPADE_CHECK(c.max_seqs >= 1, "{}: max_seqs must be >= 1, got {}", fn, c.max_seqs);
  SPADE_CHECK(c.num_state_slots >= 1, "{}: num_state_slots must be >= 1, got {}", fn, c.num_state_slots);
  SPADE_CHECK(c.num_blocks >= 1, "{}: num_blocks must be >= 1, got {}", fn, c.num_blocks);
  SPADE_CHECK(c.block_size >= 1, "{}: block_size must be >= 1, got {}", fn, c.block_size);
  SPADE_CHECK(c.buffer_size >= 1 && c.buffer_size % c.block_size == 0,
              "{}: buffer_size {} is not a positive multiple of block_size {}", fn, c.buffer_size, c.block_size);
  SPADE_CHECK(c.kv_only_limit >= 0 && c.kv_only_limit % c.block_size == 0,
              "{}: kv_only_limit {} is not a multiple of block_size {} (0 disables the KV-only form)", fn,
              c.kv_only_limit, c.block_size);
  SPADE_CHECK(c.buffer_dtype == DType::F32 || c.buffer_dtype == DType::BF16 || c.buffer_dtype == DType::F16,
              "{}: buffer_dtype is not F32/BF16/F16", fn);
  return c;
}

uint16_t nan16(DType t) { return t == DType::BF16 ? 0x7fc0 : 0x7e00; }

void fill_nan(std::vector<float>& v, DType t) {
  if (t == DType::F32) {
    std::fill(v.begin(), v.end(), std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const uint32_t pat = static_cast<uint32_t>(nan16(t)) * 0x10001u;
  float f;
  std::memcpy(&f, &pat, 4);
  std::fill(v.begin(), v.end(), f);
}

}  // namespace

GdnCache::GdnCache(const GdnCacheConfig& cfg) : cfg_(validated(cfg)), blocks_(cfg.num_blocks, cfg.block_size) {
  const GdnDims& d = cfg_.dims;
  max_blocks_per_seq_ = std::max(cfg_.buffer_size, cfg_.kv_only_limit) / cfg_.block_size;
  state_floats_ = static_cast<size_t>(d.num_v_heads) * d.head_k_dim * d.head_v_dim;
  states_.assign(state_floats_ * cfg_.num_state_slots, std::numeric_limits<float>::quiet_NaN());
  const size_t es = dtype_size(cfg_.buffer_dtype);
  const size_t tokens = static_cast<size_t>(cfg_.num_blocks) * cfg_.block_size;
  k_store_.resize((tokens * d.num_k_heads * d.head_k_dim * es + 3) / 4);
  u_store_.resize((tokens * d.num_v_heads * d.head_v_dim * es + 3) / 4);
  fill_nan(k_store_, cfg_.buffer_dtype);
  fill_nan(u_store_, cfg_.buffer_dtype);
  g_store_.assign(tokens * d.num_v_heads, std::numeric_limits<float>::quiet_NaN());
  const int m = cfg_.max_seqs;
  ring_start_.assign(m, 0);
  ring_len_.assign(m, 0);
  ring_cap_.assign(m, cfg_.buffer_size);
  block_tables_.assign(static_cast<size_t>(m) * max_blocks_per_seq_, -1);
  state_slot_.assign(m, -1);
  state_valid_.assign(m, 0);
  slot_seq_.assign(m, 0);
  slot_used_.assign(m, 0);
  for (int i = m - 1; i >= 0; --i) free_seq_slots_.push_back(i);
  for (int i = cfg_.num_state_slots - 1; i >= 0; --i) free_states_.push_back(i);
}

void GdnCache::write_table_row(int seq_slot, uint64_t seq) {
  int32_t* row = block_tables_.data() + static_cast<size_t>(seq_slot) * max_blocks_per_seq_;
  std::fill(row, row + max_blocks_per_seq_, -1);
  const std::vector<int32_t>& t = blocks_.block_table(seq);
  const int used = ring_cap_[seq_slot] / cfg_.block_size;
  for (int i = 0; i < used; ++i) row[i] = t.at(i);
}

int GdnCache::take_state_slot(uint64_t seq) {
  SPADE_CHECK(!free_states_.empty(), "GdnCache: state pool exhausted: all {} state slots are in use (sequence {})",
              cfg_.num_state_slots, seq);
  const int s = free_states_.back();
  free_states_.pop_back();
  return s;
}

int GdnCache::admit(uint64_t seq, bool kv_only) {
  SPADE_CHECK(!seq_slot_.count(seq), "GdnCache: sequence {} is already admitted", seq);
  SPADE_CHECK(!kv_only || cfg_.kv_only_limit > 0,
              "GdnCache: sequence {} asks for the KV-only form but kv_only_limit is 0 (disabled)", seq);
  SPADE_CHECK(!free_seq_slots_.empty(), "GdnCache: no free sequence slot: all {} are in use (sequence {})",
              cfg_.max_seqs, seq);
  const int cap = kv_only ? cfg_.kv_only_limit : cfg_.buffer_size;
  blocks_.admit(seq);
  if (!blocks_.append(seq, cap)) {
    const int need = blocks_.pages_for(cap), have = blocks_.num_free_pages();
    blocks_.release(seq);
    spade::fail("GdnCache: buffer pool exhausted: sequence {} needs {} blocks of {} tokens, {} of {} free", seq, need,
                cfg_.block_size, have, cfg_.num_blocks);
  }
  int state = -1;
  if (!kv_only) {
    if (free_states_.empty()) {
      blocks_.release(seq);
      spade::fail("GdnCache: state pool exhausted: all {} state slots are in use (sequence {})", cfg_.num_state_slots,
                  seq);
    }
    state = take_state_slot(seq);
    std::fill(states_.begin() + state * state_floats_, states_.begin() + (state + 1) * state_floats_, 0.f);
  }
  const int slot = free_seq_slots_.back();
  free_seq_slots_.pop_back();
  seq_slot_[seq] = slot;
  slot_seq_[slot] = seq;
  slot_used_[slot] = 1;
  ring_start_[slot] = 0;
  ring_len_[slot] = 0;
  ring_cap_[slot] = cap;
  state_slot_[slot] = state;
  state_valid_[slot] = kv_only ? 0 : 1;
  write_table_row(slot, seq);
  return slot;
}

void GdnCache::release(uint64_t seq) {
  auto it = seq_slot_.find(seq);
  if (it == seq_slot_.end()) return;
  const int slot = it->second;
  blocks_.release(seq);
  if (state_slot_[slot] >= 0) {
    const int s = state_slot_[slot];
    std::fill(states_.begin() + s * state_floats_, states_.begin() + (s + 1) * state_floats_,
              std::numeric_limits<float>::quiet_NaN());
    free_states_.push_back(s);
  }
  state_slot_[slot] = -1;
  state_valid_[slot] = 0;
  ring_len_[slot] = ring_start_[slot] = 0;
  std::fill(block_tables_.begin() + static_cast<size_t>(slot) * max_blocks_per_seq_,
            block_tables_.begin() + static_cast<size_t>(slot + 1) * max_blocks_per_seq_, -1);
  slot_used_[slot] = 0;
  pending_slots_.erase(std::remove(pending_slots_.begin(), pending_slots_.end(), slot), pending_slots_.end());
  free_seq_slots_.push_back(slot);
  seq_slot_.erase(it);
}

int GdnCache::slot(uint64_t seq) const {
  auto it = seq_slot_.find(seq);
  SPADE_CHECK(it != seq_slot_.end(), "GdnCache: unknown sequence {}", seq);
  return it->second;
}

float* GdnCache::state(uint64_t seq) {
  const int s = state_slot_[slot(seq)];
  SPADE_CHECK(s >= 0, "GdnCache: sequence {} has no state slot (KV-only form, not yet compressed)", seq);
  return states_.data() + s * state_floats_;
}

GdnBufferPool GdnCache::pool() {
  GdnBufferPool p;
  p.k = k_store_.data();
  p.u = u_store_.data();
  p.g = g_store_.data();
  p.dtype = cfg_.buffer_dtype;
  p.num_blocks = cfg_.num_blocks;
  p.block_size = cfg_.block_size;
  return p;
}

GdnSeqTable GdnCache::table() {
  GdnSeqTable t;
  t.ring_start = ring_start_.data();
  t.ring_len = ring_len_.data();
  t.ring_capacity = ring_cap_.data();
  t.block_tables = block_tables_.data();
  t.state_slots = state_slot_.data();
  t.state_valid = state_valid_.data();
  t.max_seqs = cfg_.max_seqs;
  t.max_blocks_per_seq = max_blocks_per_seq_;
  return t;
}

void GdnCache::assign_states_for_flush(const std::vector<int32_t>& seq_slots, const std::vector<uint8_t>& flags) {
  for (size_t b = 0; b < seq_slots.size(); ++b) {
    const int slot = seq_slots[b];
    if ((flags[b] & kGdnFlush) && state_slot_[slot] < 0) state_slot_[slot] = take_state_slot(slot_seq_[slot]);
  }
}

std::vector<uint8_t> GdnCache::plan(const char* fn, const std::vector<int32_t>& seq_slots,
                                    const std::vector<int32_t>& cu_tokens, bool decode, int next_tokens) {
  SPADE_CHECK(cu_tokens.size() == seq_slots.size() + 1, "{}: cu_tokens has {} entries, expected {}", fn,
              cu_tokens.size(), seq_slots.size() + 1);
  SPADE_CHECK(pending_slots_.empty(), "{}: drafts of the last verification are not committed", fn);
  for (int32_t s : seq_slots)
    SPADE_CHECK(s >= 0 && s < cfg_.max_seqs && slot_used_[s], "{}: sequence slot {} is not admitted", fn, s);
  std::vector<uint8_t> flags(seq_slots.size());
  const GdnSeqTable t = table();
  const int batch = static_cast<int>(seq_slots.size());
  if (decode)
    gdn_decode_flush_flags_ref(t, seq_slots.data(), cu_tokens.data(), batch, flags.data(), next_tokens);
  else
    gdn_verify_flush_flags_ref(t, seq_slots.data(), cu_tokens.data(), batch, flags.data());
  assign_states_for_flush(seq_slots, flags);
  return flags;
}

std::vector<uint8_t> GdnCache::plan_decode(const std::vector<int32_t>& seq_slots, const std::vector<int32_t>& cu_tokens,
                                           int next_tokens) {
  return plan("GdnCache::plan_decode", seq_slots, cu_tokens, true, next_tokens);
}

std::vector<uint8_t> GdnCache::plan_verify(const std::vector<int32_t>& seq_slots,
                                           const std::vector<int32_t>& cu_tokens) {
  std::vector<uint8_t> flags = plan("GdnCache::plan_verify", seq_slots, cu_tokens, false, 0);
  pending_slots_ = seq_slots;
  return flags;
}

void GdnCache::commit(const std::vector<int32_t>& seq_slots, const std::vector<int32_t>& cu_tokens,
                      const std::vector<int32_t>& accepted) {
  SPADE_CHECK(seq_slots == pending_slots_,
              "GdnCache::commit: the batch ({} sequences) is not the one of the last plan_verify ({} sequences)",
              seq_slots.size(), pending_slots_.size());
  SPADE_CHECK(cu_tokens.size() == seq_slots.size() + 1 && accepted.size() == seq_slots.size(),
              "GdnCache::commit: cu_tokens has {} entries and accepted {}, expected {} and {}", cu_tokens.size(),
              accepted.size(), seq_slots.size() + 1, seq_slots.size());
  const GdnSeqTable t = table();
  gdn_verify_commit_ref(t, seq_slots.data(), cu_tokens.data(), accepted.data(), static_cast<int>(seq_slots.size()));
  pending_slots_.clear();
}

void GdnCache::finish_step() {
  SPADE_CHECK(pending_slots_.empty(), "GdnCache::finish_step: drafts of the last verification are not committed");
  const GdnDims& d = cfg_.dims;
  const int bs = cfg_.block_size, dk = d.head_k_dim, dv = d.head_v_dim, Hk = d.num_k_heads, Hv = d.num_v_heads;
  const DType dt = cfg_.buffer_dtype;
  for (int slot = 0; slot < cfg_.max_seqs; ++slot) {
    if (!slot_used_[slot] || !state_valid_[slot] || ring_cap_[slot] == cfg_.buffer_size) continue;
    const uint64_t seq = slot_seq_[slot];
    const int len = ring_len_[slot], old_cap = ring_cap_[slot];
    SPADE_CHECK(len <= cfg_.buffer_size,
                "GdnCache::finish_step: sequence {} holds {} buffered tokens, more than buffer_size {}", seq, len,
                cfg_.buffer_size);
    // Gather the committed entries (stored precision, no rounding change).
    Ring r;
    r.start = ring_start_[slot];
    r.cap = old_cap;
    r.table = block_tables_.data() + static_cast<size_t>(slot) * max_blocks_per_seq_;
    const size_t es = dtype_size(dt);
    const size_t krow = static_cast<size_t>(Hk) * dk * es, urow = static_cast<size_t>(Hv) * dv * es;
    std::vector<unsigned char> ks(len * krow), us(len * urow);
    std::vector<float> gs(static_cast<size_t>(len) * Hv);
    const unsigned char* kbase = static_cast<const unsigned char*>(static_cast<const void*>(k_store_.data()));
    const unsigned char* ubase = static_cast<const unsigned char*>(static_cast<const void*>(u_store_.data()));
    for (int i = 0; i < len; ++i) {
      const size_t tok = r.token(i, bs);
      std::memcpy(ks.data() + i * krow, kbase + tok * krow, krow);
      std::memcpy(us.data() + i * urow, ubase + tok * urow, urow);
      std::memcpy(gs.data() + static_cast<size_t>(i) * Hv, g_store_.data() + tok * Hv, Hv * sizeof(float));
    }
    // Resize the ring: keep the first buffer_size / block_size blocks (or grow), then scatter to positions 0..len-1.
    if (cfg_.buffer_size < old_cap) {
      blocks_.drop_range(seq, cfg_.buffer_size, old_cap);
    } else if (!blocks_.append(seq, cfg_.buffer_size - old_cap)) {
      spade::fail("GdnCache: buffer pool exhausted: sequence {} needs {} more blocks to switch to the chunkwise form",
                  seq, (cfg_.buffer_size - old_cap) / bs);
    }
    ring_cap_[slot] = cfg_.buffer_size;
    ring_start_[slot] = 0;
    write_table_row(slot, seq);
    r.start = 0;
    r.cap = cfg_.buffer_size;
    unsigned char* kw = static_cast<unsigned char*>(static_cast<void*>(k_store_.data()));
    unsigned char* uw = static_cast<unsigned char*>(static_cast<void*>(u_store_.data()));
    for (int i = 0; i < len; ++i) {
      const size_t tok = r.token(i, bs);
      std::memcpy(kw + tok * krow, ks.data() + i * krow, krow);
      std::memcpy(uw + tok * urow, us.data() + i * urow, urow);
      std::memcpy(g_store_.data() + tok * Hv, gs.data() + static_cast<size_t>(i) * Hv, Hv * sizeof(float));
    }
  }
}

}  // namespace spade::kernels
