// The GPU data plane's per-step plan (see gpu_plan.h).
#include "pair/gpu_plan.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "kernels/selection_delta_ref.h"

namespace spade::pair {

namespace {

constexpr uint32_t kPlanMagic = 0x4e4c5047;  // "GPLN"
constexpr uint32_t kPlanVersion = 2;
// magic, version, step, rows, released, forks, retains, drops
constexpr size_t kHeaderBytes = 4 + 4 + 8 + 4 + 4 + 4 + 4 + 4;
constexpr size_t kRowBytes = 16;
constexpr size_t kForkBytes = 16;
constexpr size_t kRetainBytes = 12;

template <typename T>
void put(std::vector<uint8_t>& b, size_t& off, T v) {
  std::memcpy(b.data() + off, &v, sizeof(T));
  off += sizeof(T);
}
template <typename T>
T get(const uint8_t* d, size_t& off) {
  T v;
  std::memcpy(&v, d + off, sizeof(T));
  off += sizeof(T);
  return v;
}

size_t up(size_t x) { return (x + 255) / 256 * 256; }

}  // namespace

int GpuStepPlan::total_tokens() const {
  int n = 0;
  for (const GpuPlanRow& r : rows) n += r.q_len;
  return n;
}

std::vector<int> GpuStepPlan::steady_rows() const {
  std::vector<int> out;
  for (size_t i = 0; i < rows.size(); ++i)
    if ((rows[i].flags & kRowSelect) != 0 && (rows[i].flags & kRowFirstSelect) == 0) out.push_back(static_cast<int>(i));
  return out;
}

std::vector<int> GpuStepPlan::first_rows() const {
  std::vector<int> out;
  for (size_t i = 0; i < rows.size(); ++i)
    if ((rows[i].flags & kRowFirstSelect) != 0) out.push_back(static_cast<int>(i));
  return out;
}

namespace {
constexpr uint32_t kHelloMagic = 0x4c454847;  // "GHEL"
constexpr uint32_t kHelloVersion = 1;
// The hello's fields in wire order: encode and decode both walk this table.
constexpr int32_t GpuPairHello::*kHelloFields[] = {
    &GpuPairHello::num_layers,      &GpuPairHello::num_q_heads,     &GpuPairHello::num_kv_heads,
    &GpuPairHello::head_dim,        &GpuPairHello::layers_per_pack, &GpuPairHello::token_budget,
    &GpuPairHello::local_window,    &GpuPairHello::delta_capacity,  &GpuPairHello::max_slots,
    &GpuPairHello::max_step_tokens, &GpuPairHello::num_pages,       &GpuPairHello::page_size,
    &GpuPairHello::max_pages_per_seq};
static_assert(8 + sizeof(kHelloFields) / sizeof(kHelloFields[0]) * sizeof(int32_t) <= kGpuHelloBytes);
}  // namespace

std::vector<uint8_t> encode_gpu_hello(const GpuPairHello& h) {
  std::vector<uint8_t> b(kGpuHelloBytes, 0);
  size_t off = 0;
  put(b, off, kHelloMagic);
  put(b, off, kHelloVersion);
  for (int32_t GpuPairHello::*field : kHelloFields) put(b, off, h.*field);
  return b;
}

GpuPairHello decode_gpu_hello(const uint8_t* data, size_t len, const ModelConfig& attn_cfg, const std::string& peer) {
  SPADE_CHECK(data != nullptr && len == kGpuHelloBytes, "{}: GPU pair hello of {} bytes, expected {}", peer, len,
              kGpuHelloBytes);
  size_t off = 0;
  const uint32_t magic = get<uint32_t>(data, off), version = get<uint32_t>(data, off);
  SPADE_CHECK(magic == kHelloMagic && version == kHelloVersion,
              "{}: not a GPU pair hello (magic {:#x}, version {}; expected version {})", peer, magic, version,
              kHelloVersion);
  GpuPairHello h;
  for (int32_t GpuPairHello::*field : kHelloFields) h.*field = get<int32_t>(data, off);
  const auto same = [&](const char* what, int32_t theirs, int ours) {
    SPADE_CHECK(theirs == ours,
                "{} serves a model with {} {}, this cache rank's model has {} (give both ranks the same --model)",
                peer, theirs, what, ours);
  };
  same("full-attention layers", h.num_layers, attn_cfg.num_layers);
  same("query heads", h.num_q_heads, attn_cfg.num_q_heads);
  same("KV heads", h.num_kv_heads, attn_cfg.num_kv_heads);
  same("head_dim", h.head_dim, attn_cfg.head_dim);
  SPADE_CHECK(h.layers_per_pack >= 1 && h.token_budget >= 1 && h.local_window >= 1 && h.delta_capacity >= 1 &&
                  h.delta_capacity <= h.token_budget && h.max_slots >= 1 && h.max_slots <= gpu_plan_max_rows() &&
                  h.max_step_tokens >= 1 && h.num_pages >= 1 && h.page_size >= 1 && h.max_pages_per_seq >= 1,
              "{}: GPU pair hello out of range (layers per pack {}, budget {}, local window {}, delta capacity {}, "
              "slots {} of at most {}, step tokens {}, pages {}, page size {}, pages per sequence {})",
              peer, h.layers_per_pack, h.token_budget, h.local_window, h.delta_capacity, h.max_slots,
              gpu_plan_max_rows(), h.max_step_tokens, h.num_pages, h.page_size, h.max_pages_per_seq);
  return h;
}

int gpu_plan_max_rows() {
  return static_cast<int>((kGpuPlanBytes - kHeaderBytes) / (kRowBytes + 4 + kForkBytes + kRetainBytes + 4));
}

std::vector<uint8_t> encode_gpu_plan(const GpuStepPlan& p) {
  SPADE_CHECK(static_cast<int>(p.rows.size()) <= gpu_plan_max_rows() &&
                  static_cast<int>(p.released.size()) <= gpu_plan_max_rows() &&
                  static_cast<int>(p.forks.size()) <= gpu_plan_max_rows() &&
                  static_cast<int>(p.retains.size()) <= gpu_plan_max_rows() &&
                  static_cast<int>(p.drops.size()) <= gpu_plan_max_rows(),
              "GPU plan: {} rows / {} released slots / {} forks / {} retains / {} drops exceed the {} a plan carries",
              p.rows.size(), p.released.size(), p.forks.size(), p.retains.size(), p.drops.size(), gpu_plan_max_rows());
  std::vector<uint8_t> b(kGpuPlanBytes, 0);
  size_t off = 0;
  put(b, off, kPlanMagic);
  put(b, off, kPlanVersion);
  put(b, off, p.step);
  put(b, off, static_cast<uint32_t>(p.rows.size()));
  put(b, off, static_cast<uint32_t>(p.released.size()));
  put(b, off, static_cast<uint32_t>(p.forks.size()));
  put(b, off, static_cast<uint32_t>(p.retains.size()));
  put(b, off, static_cast<uint32_t>(p.drops.size()));
  for (const GpuPlanRow& r : p.rows) {
    put(b, off, r.slot);
    put(b, off, r.q_len);
    put(b, off, r.ctx_len);
    put(b, off, r.flags);
  }
  for (int32_t s : p.released) put(b, off, s);
  for (const GpuPlanFork& f : p.forks) {
    put(b, off, f.child);
    put(b, off, f.parent);
    put(b, off, f.tokens);
    put(b, off, f.flags);
  }
  for (const GpuPlanRetain& r : p.retains) {
    put(b, off, r.slot);
    put(b, off, r.id);
    put(b, off, r.tokens);
  }
  for (int32_t d : p.drops) put(b, off, d);
  return b;
}

GpuStepPlan decode_gpu_plan(const uint8_t* data, size_t len, int max_slots, const std::string& peer) {
  SPADE_CHECK(data != nullptr && len == kGpuPlanBytes, "{}: GPU plan of {} bytes, expected {}", peer, len,
              kGpuPlanBytes);
  size_t off = 0;
  const uint32_t magic = get<uint32_t>(data, off), version = get<uint32_t>(data, off);
  SPADE_CHECK(magic == kPlanMagic && version == kPlanVersion, "{}: not a GPU plan (magic {:#x}, version {})", peer,
              magic, version);
  GpuStepPlan p;
  p.step = get<int64_t>(data, off);
  const uint32_t nrows = get<uint32_t>(data, off), nrel = get<uint32_t>(data, off), nfork = get<uint32_t>(data, off);
  const uint32_t nret = get<uint32_t>(data, off), ndrop = get<uint32_t>(data, off);
  const auto most = static_cast<uint32_t>(gpu_plan_max_rows());
  SPADE_CHECK(nrows <= most && nrel <= most && nfork <= most && nret <= most && ndrop <= most &&
                  kHeaderBytes + nrows * kRowBytes + nrel * 4 + nfork * kForkBytes + nret * kRetainBytes + ndrop * 4 <=
                      len,
              "{}: GPU plan of step {} claims {} rows, {} released slots, {} forks, {} retains and {} drops", peer,
              p.step, nrows, nrel, nfork, nret, ndrop);
  const bool close = p.step == GpuStepPlan::kCloseStep && nrows == 0 && nrel == 0 && nfork == 0 && nret == 0 &&
                     ndrop == 0;
  const bool flush = p.step == GpuStepPlan::kFlushStep && nrows == 0 && nfork == 0;
  SPADE_CHECK(p.step >= 0 || close || flush,
              "{}: GPU plan with step {} ({} rows, {} released slots, {} forks, {} retains, {} drops): only the close "
              "plan (step -1, empty) and a flush (step -2, no rows, no forks) may have a negative step",
              peer, p.step, nrows, nrel, nfork, nret, ndrop);
  std::vector<char> used(static_cast<size_t>(std::max(max_slots, 0)), 0);
  for (uint32_t i = 0; i < nrows; ++i) {
    GpuPlanRow r;
    r.slot = get<int32_t>(data, off);
    r.q_len = get<int32_t>(data, off);
    r.ctx_len = get<int32_t>(data, off);
    r.flags = get<uint32_t>(data, off);
    SPADE_CHECK(r.slot >= 0 && r.slot < max_slots && !used[static_cast<size_t>(r.slot)],
                "{}: GPU plan of step {} row {}: slot {} outside 0..{} or used twice", peer, p.step, i, r.slot,
                max_slots - 1);
    used[static_cast<size_t>(r.slot)] = 1;
    SPADE_CHECK(r.q_len >= 1 && r.ctx_len >= r.q_len, "{}: GPU plan of step {} row {}: {} tokens for context {}",
                peer, p.step, i, r.q_len, r.ctx_len);
    SPADE_CHECK((r.flags & ~(kRowFresh | kRowSelect | kRowFirstSelect)) == 0 &&
                    ((r.flags & kRowFirstSelect) == 0 || (r.flags & kRowSelect) != 0),
                "{}: GPU plan of step {} row {}: bad flags {:#x}", peer, p.step, i, r.flags);
    SPADE_CHECK((r.flags & kRowFresh) == 0 || r.ctx_len == r.q_len,
                "{}: GPU plan of step {} row {}: a fresh sequence with context {} after {} tokens", peer, p.step, i,
                r.ctx_len, r.q_len);
    p.rows.push_back(r);
  }
  for (uint32_t i = 0; i < nrel; ++i) {
    const int32_t s = get<int32_t>(data, off);
    SPADE_CHECK(s >= 0 && s < max_slots, "{}: GPU plan of step {}: released slot {} outside 0..{}", peer, p.step, s,
                max_slots - 1);
    p.released.push_back(s);
  }
  std::vector<char> child(used.size(), 0);
  for (uint32_t i = 0; i < nfork; ++i) {
    GpuPlanFork f;
    f.child = get<int32_t>(data, off);
    f.parent = get<int32_t>(data, off);
    f.tokens = get<int32_t>(data, off);
    f.flags = get<uint32_t>(data, off);
    const bool retained = (f.flags & kForkFromRetained) != 0;
    SPADE_CHECK(f.child >= 0 && f.child < max_slots && f.parent >= 0 && (retained || f.parent < max_slots) &&
                    (retained || f.child != f.parent) && !child[static_cast<size_t>(f.child)] && f.tokens >= 1 &&
                    (f.flags & ~kForkFromRetained) == 0,
                "{}: GPU plan of step {} fork {}: child slot {} from parent {} {} ({} tokens, flags {:#x}): slots "
                "outside 0..{}, equal, a child twice, no tokens or bad flags",
                peer, p.step, i, f.child, retained ? "retained prefix" : "slot", f.parent, f.tokens, f.flags,
                max_slots - 1);
    child[static_cast<size_t>(f.child)] = 1;
    p.forks.push_back(f);
  }
  for (uint32_t i = 0; i < nret; ++i) {
    GpuPlanRetain r;
    r.slot = get<int32_t>(data, off);
    r.id = get<int32_t>(data, off);
    r.tokens = get<int32_t>(data, off);
    SPADE_CHECK(r.slot >= 0 && r.slot < max_slots && r.id >= 0 && r.tokens >= 1,
                "{}: GPU plan of step {} retain {}: slot {} as retained prefix {} ({} tokens): slot outside 0..{}, a "
                "negative id or no tokens",
                peer, p.step, i, r.slot, r.id, r.tokens, max_slots - 1);
    p.retains.push_back(r);
  }
  for (uint32_t i = 0; i < ndrop; ++i) {
    const int32_t d = get<int32_t>(data, off);
    SPADE_CHECK(d >= 0, "{}: GPU plan of step {}: dropped retained prefix {}", peer, p.step, d);
    p.drops.push_back(d);
  }
  for (const GpuPlanRow& r : p.rows)
    SPADE_CHECK((r.flags & kRowFresh) == 0 || !child[static_cast<size_t>(r.slot)],
                "{}: GPU plan of step {}: slot {} is a fork's child and a fresh row", peer, p.step, r.slot);
  return p;
}

DeltaLayout::DeltaLayout(size_t n_rows, int capacity, int head_dim) : rows(n_rows), cap(capacity) {
  const size_t e = rows * static_cast<size_t>(cap);
  positions = up(slots + e * 4);
  info = up(positions + e * 4);
  k = up(info + rows * kernels::kDeltaInfoFields * 4);
  v = up(k + e * head_dim * 2);
  bytes = up(v + e * head_dim * 2);
}

GpuPackSizes gpu_pack_sizes(const GpuStepPlan& p, int pack_layers, const ModelConfig& attn_cfg, int budget,
                            int capacity) {
  GpuPackSizes s;
  const size_t row_elems = static_cast<size_t>(attn_cfg.num_q_heads + 2 * attn_cfg.num_kv_heads) * attn_cfg.head_dim;
  s.up_bytes = static_cast<size_t>(pack_layers) * p.total_tokens() * row_elems * 2;
  const size_t per_seq = static_cast<size_t>(pack_layers) * attn_cfg.num_kv_heads;
  s.steady = DeltaLayout(per_seq * p.steady_rows().size(), capacity, attn_cfg.head_dim);
  s.first = DeltaLayout(per_seq * p.first_rows().size(), budget, attn_cfg.head_dim);
  return s;
}

}  // namespace spade::pair
