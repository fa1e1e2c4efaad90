// Sparse decoding on the GPU inference rank (see gpu_sparse.h).
#include "inference_rank/gpu_sparse.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "pair/gpu_shard.h"
#include "kernels/attention.cuh"
#include "kernels/selection.cuh"
#include "inference_rank/sparse_planner.h"

namespace spade {

namespace {

using Event = CudaEvent;

}  // namespace

struct GpuSparseController::State {
  ModelConfig cfg;
  GpuSparseOptions o;
  // One link per layer shard (pair/gpu_shard.h): model pack p's rows go to, and its selections come from,
  // links[p mod N]; every link gets every plan. All on one up and one down stream, in pack order.
  std::vector<transport::GpuLink*> links;
  std::vector<std::string> names;  // per shard, in failure messages: the links' peer names, or set_shard_names
  int L = 0, Hq = 0, Hkv = 0, D = 0, P = 0, packs = 0, k = 0;
  int C = 0;  // delta capacity (o.sparse.effective_delta_capacity())
  int R = 0;  // local window
  int page_size = 0, max_batch = 0;
  size_t row_elems = 0;
  cudaStream_t up = nullptr, down = nullptr;
  GpuDenseAttention dense;
  DeviceBuffer held;        // K then V: [max_sparse][L][Hkv][k][D] bf16 each
  DeviceBuffer send;        // [packs][P * max_step_tokens * row_elems] bf16
  DeviceBuffer stage;       // graph steps: one pack's rows compacted to the step's tokens, [P * max_batch * row_elems]
  DeviceBuffer recv[2][2];  // [group][parity]: all packs' messages of a step, pack p at p * per_pack[g]
  size_t recv_per_pack[2] = {0, 0};
  DeviceBuffer plan_dev;
  uint8_t* plan_pinned = nullptr;
  Event plan_copied;
  bool plan_pending = false;
  // Per-row arrays + held-row maps, per step parity:
  // [num_packed B][windows B][packed_rows B][q_rows B][skip B][maps g0][maps g1]
  DeviceBuffer arrays[2];
  int32_t* arrays_pinned = nullptr;
  size_t array_words = 0;
  Event arrays_copied;
  bool arrays_pending = false;
  size_t off_maps[2] = {0, 0};
  DeviceBuffer ws;
  // Per step parity and pack ([parity * packs + p]): a step of parity X records pack_end[X] and sent[X] and waits on
  // sent[1 - X] (the previous step's send of the same buffer) and applied[X] (recorded by the previous step's
  // end_step into the next step's parity). So no event a step waits on is recorded again before that step has
  // ended: a CUDA graph's event wait node acts on the event's latest record when the node runs, and the host
  // enqueues the next records right after the launch.
  std::vector<std::unique_ptr<Event>> pack_end, sent, applied;
  Event arrays_free[2];  // the receive stream's last read of arrays[parity] (the held-row maps of its applies)
  bool hello_sent = false, closed = false;

  SparseStepPlanner planner;
  std::vector<std::pair<uint64_t, std::string>> failures;
  bool failed_handled = false;
  bool active = false;   // this step has a plan on the link (cleared when the link fails mid-step)
  bool planned = false;  // this step's plan was sent: its sparse rows read the held tables
  int64_t step = 0;
  int parity = 0;
  int T = 0;
  int rows_layout = 0;     // rows per layer in the send buffers (T, or the padded graph rows)
  bool capturing = false;  // the engine is capturing this step's graph
  StepDecision dec;  // this step's

  State(const ModelConfig& c, const GpuSparseOptions& opts, std::vector<transport::GpuLink*> l, int ps, int mb)
      : cfg(c), o(opts), links(std::move(l)), L(c.num_layers), Hq(c.num_q_heads), Hkv(c.num_kv_heads), D(c.head_dim),
        P(opts.sparse.layers_per_pack),
        packs((c.num_layers + opts.sparse.layers_per_pack - 1) / opts.sparse.layers_per_pack),
        k(opts.sparse.selection.token_budget), C(opts.sparse.effective_delta_capacity()),
        R(opts.sparse.selection.local_window), page_size(ps), max_batch(mb),
        row_elems(static_cast<size_t>(c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim), dense(c, ps, mb),
        planner(opts) {}
  ~State() {
    for (cudaStream_t s : {up, down})
      if (s != nullptr) cudaStreamDestroy(s);
    if (plan_pinned != nullptr) cudaFreeHost(plan_pinned);
    if (arrays_pinned != nullptr) cudaFreeHost(arrays_pinned);
  }
  int pack_layers(int p) const { return std::min(P, L - p * P); }
  int N() const { return static_cast<int>(links.size()); }
  transport::GpuLink& link_of(int p) const { return *links[static_cast<size_t>(p % N())]; }
  int device() const { return links.front()->device(); }
  bool any_failed() const {
    for (const transport::GpuLink* l : links)
      if (l->failed()) return true;
    return false;
  }
  /// The first failed link's failure(), "" while all are healthy; with layer shards prefixed with the shard and
  /// its cache rank.
  std::string failure() const {
    for (size_t i = 0; i < links.size(); ++i)
      if (links[i]->failed())
        return N() == 1 ? links[i]->failure()
                        : fmt::format("layer shard {} of {} ({}): {}", i, N(), names[i], links[i]->failure());
    return "";
  }
  size_t table_elems() const { return static_cast<size_t>(L) * Hkv * k * D; }
  char* held_k() const { return held.as<char>(); }
  char* held_v() const { return held.as<char>() + static_cast<size_t>(o.max_sparse_seqs) * table_elems() * 2; }
  uint16_t* send_buf(int p) const {
    return send.as<uint16_t>() + static_cast<size_t>(p) * P * std::max(o.max_step_tokens, max_batch) * row_elems;
  }
  const int32_t* arr(size_t off) const { return arrays[parity].as<int32_t>() + off; }
  cudaEvent_t pack_end_ev(int p) const { return pack_end[static_cast<size_t>(parity * packs + p)]->e; }
  cudaEvent_t sent_ev(int p) const { return sent[static_cast<size_t>(parity * packs + p)]->e; }
  cudaEvent_t prev_sent_ev(int p) const { return sent[static_cast<size_t>((1 - parity) * packs + p)]->e; }
  cudaEvent_t applied_ev(int p) const { return applied[static_cast<size_t>(parity * packs + p)]->e; }
  cudaEvent_t next_applied_ev(int p) const { return applied[static_cast<size_t>((1 - parity) * packs + p)]->e; }
};

GpuSparseController::GpuSparseController(const ModelConfig& attn_cfg, const GpuSparseOptions& o,
                                         transport::GpuLink& link, int page_size, int max_batch)
    : GpuSparseController(attn_cfg, o, std::vector<transport::GpuLink*>{&link}, page_size, max_batch) {}

GpuSparseController::GpuSparseController(const ModelConfig& attn_cfg, const GpuSparseOptions& o,
                                         std::vector<transport::GpuLink*> links, int page_size, int max_batch) {
  SPADE_CHECK(!attn_cfg.is_hybrid(), "GPU sparse: pass the model's attention view");
  const pair::SparseConfig& c = o.sparse;
  pair::validate(c);  // names the setting
  SPADE_CHECK(c.selection.sink_tokens == 0,
              "GPU sparse: sink tokens {}: the GPU path attends no sink tokens of its own (they compete in the top-k)",
              c.selection.sink_tokens);
  SPADE_CHECK(c.selection.token_budget <= kernels::kMaxDeltaBudget && o.max_sparse_seqs >= 1 && o.max_slots >= 1 &&
                  o.max_slots <= pair::gpu_plan_max_rows() && o.max_step_tokens >= 1,
              "GPU sparse: options out of range (budget {} <= {}, capacity {}, sparse {}, slots {} <= {}, step "
              "tokens {})",
              c.selection.token_budget, kernels::kMaxDeltaBudget, c.effective_delta_capacity(), o.max_sparse_seqs,
              o.max_slots, pair::gpu_plan_max_rows(), o.max_step_tokens);
  SPADE_CHECK(!links.empty(), "GPU sparse: no link to a cache rank");
  for (size_t i = 0; i < links.size(); ++i)
    SPADE_CHECK(links[i] != nullptr && links[i]->device() == links.front()->device(),
                "GPU sparse: the link of layer shard {} is null or on another GPU than shard 0's", i);
  // Every shard serves at least one pack, with the local view its server cuts (names --layers-per-pack).
  for (int s = 0; s < static_cast<int>(links.size()); ++s)
    pair::gpu_shard_view(s, static_cast<int>(links.size()), attn_cfg.num_layers, c.layers_per_pack);
  cuda_check(cudaSetDevice(links.front()->device()), "GPU sparse: cudaSetDevice");
  st_ = std::make_unique<State>(attn_cfg, o, std::move(links), page_size, max_batch);
  State& s = *st_;
  for (const transport::GpuLink* l : s.links) s.names.push_back(l->peer_name());
  for (cudaStream_t* x : {&s.up, &s.down})
    cuda_check(cudaStreamCreateWithFlags(x, cudaStreamNonBlocking), "GPU sparse: stream");
  s.held = DeviceBuffer(2 * static_cast<size_t>(o.max_sparse_seqs) * s.table_elems() * 2, "GPU sparse: held tables");
  s.send = DeviceBuffer(static_cast<size_t>(s.packs) * s.P * std::max(o.max_step_tokens, max_batch) * s.row_elems * 2,
                        "GPU sparse: send buffers");
  s.stage = DeviceBuffer(static_cast<size_t>(s.P) * max_batch * s.row_elems * 2, "GPU sparse: graph-step staging");
  const size_t rows_steady = static_cast<size_t>(s.P) * o.max_sparse_seqs * s.Hkv;
  const size_t rows_first = static_cast<size_t>(s.P) * std::min(c.max_first_per_step, o.max_sparse_seqs) * s.Hkv;
  s.recv_per_pack[0] = pair::DeltaLayout(rows_steady, s.C, s.D).bytes;
  s.recv_per_pack[1] = pair::DeltaLayout(rows_first, s.k, s.D).bytes;
  for (int g = 0; g < 2; ++g)
    for (auto& b : s.recv[g]) b = DeviceBuffer(static_cast<size_t>(s.packs) * s.recv_per_pack[g], "GPU sparse: receive");
  s.plan_dev = DeviceBuffer(pair::kGpuPlanBytes, "GPU sparse: plan");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.plan_pinned), pair::kGpuPlanBytes), "GPU sparse: pinned");
  const size_t B = static_cast<size_t>(max_batch);
  s.off_maps[0] = 5 * B;
  s.off_maps[1] = s.off_maps[0] + static_cast<size_t>(s.L) * o.max_sparse_seqs * s.Hkv;
  s.array_words = s.off_maps[1] + static_cast<size_t>(s.L) * std::min(c.max_first_per_step, o.max_sparse_seqs) * s.Hkv;
  for (auto& a : s.arrays) a = DeviceBuffer(s.array_words * 4, "GPU sparse: per-row arrays");
  cuda_check(cudaMallocHost(reinterpret_cast<void**>(&s.arrays_pinned), s.array_words * 4), "GPU sparse: pinned");
  s.ws = DeviceBuffer(kernels::decode_workspace_bytes(max_batch, s.Hq, s.Hkv, s.D), "GPU sparse: workspace");
  cuda_check(kernels::decode_workspace_init({s.ws.get(), s.ws.bytes()}, s.up), "GPU sparse: workspace init");
  for (int p = 0; p < 2 * s.packs; ++p) {
    s.pack_end.push_back(std::make_unique<Event>());
    s.sent.push_back(std::make_unique<Event>());
    s.applied.push_back(std::make_unique<Event>());
  }
  cuda_check(cudaStreamSynchronize(s.up), "GPU sparse: init");  // not the device: see send_hello
}

void GpuSparseController::send_hello(const pair::GpuPairHello& hello) {
  State& st = *st_;
  SPADE_CHECK(!st.hello_sent, "GPU sparse: the pair hello was already sent");
  cuda_check(cudaSetDevice(st.device()), "GPU sparse: cudaSetDevice");
  // Shard by shard, each with its layer count (pair/gpu_shard.h); each send is waited for (at most op_timeout)
  // before the staging buffer takes the next one.
  for (int s = 0; s < st.N(); ++s) {
    transport::GpuLink& link = *st.links[static_cast<size_t>(s)];
    const std::vector<uint8_t> bytes = pair::encode_gpu_hello(pair::shard_gpu_hello(hello, s, st.N()));
    std::string err;
    try {
      std::memcpy(st.plan_pinned, bytes.data(), bytes.size());
      cuda_check(cudaMemcpyAsync(st.plan_dev.get(), st.plan_pinned, bytes.size(), cudaMemcpyHostToDevice, st.up),
                 "GPU sparse: hello upload");
      link.send(st.plan_dev.get(), pair::kGpuHelloBytes, st.up, "the pair hello");
      cuda_check(cudaStreamSynchronize(st.up), "GPU sparse: hello");  // the watchdog releases it by op_timeout
    } catch (const std::exception& e) {
      err = e.what();
    }
    if (err.empty() && link.failed()) err = link.failure();
    if (!err.empty()) {
      // The shards already greeted wait for plans that will not come: release them too.
      for (transport::GpuLink* l : st.links) l->abort("the pair hello to " + link.peer_name() + " failed: " + err);
      fail("sending the pair hello to {}{}: {}", link.peer_name(),
           st.N() > 1 ? fmt::format(" (layer shard {} of {})", s, st.N()) : std::string(), err);
    }
  }
  st.hello_sent = true;
}

void GpuSparseController::close() {
  State& st = *st_;
  if (st.closed) return;
  st.closed = true;
  if (!st.hello_sent) return;
  if (st.any_failed()) {  // nothing more on any link: a failed shard aborts the others
    link_failure_seen(st.failure());
    return;
  }
  // No selection will come any more: the sparse sequences cannot go on (their dropped pages are gone).
  fail_link("the link to it was closed");
  try {
    cuda_check(cudaSetDevice(st.device()), "GPU sparse: cudaSetDevice");
    upload_plan(pair::GpuStepPlan::close_plan());
    // Every shard is at a message boundary here (a step either completed on every link or failed them all).
    for (transport::GpuLink* l : st.links) l->send(st.plan_dev.get(), pair::kGpuPlanBytes, st.up, "the close plan");
    for (cudaStream_t x : {st.up, st.down}) cuda_check(cudaStreamSynchronize(x), "GPU sparse: close");
  } catch (const std::exception& e) {
    for (transport::GpuLink* l : st.links) l->abort(std::string("closing the link: ") + e.what());
    fail_link(std::string("closing the link: ") + e.what());
  }
}

void GpuSparseController::upload_plan(const pair::GpuStepPlan& plan) {
  State& st = *st_;
  const std::vector<uint8_t> bytes = pair::encode_gpu_plan(plan);
  // The pinned buffer is free once the previous plan's copy ran.
  if (st.plan_pending) cuda_check(cudaEventSynchronize(st.plan_copied.e), "GPU sparse: previous plan copy");
  std::memcpy(st.plan_pinned, bytes.data(), bytes.size());
  cuda_check(cudaMemcpyAsync(st.plan_dev.get(), st.plan_pinned, bytes.size(), cudaMemcpyHostToDevice, st.up),
             "GPU sparse: plan upload");
  cuda_check(cudaEventRecord(st.plan_copied.e, st.up), "GPU sparse: plan event");
  st.plan_pending = true;
}

void GpuSparseController::idle_flush() {
  State& st = *st_;
  if (st.closed || !st.hello_sent || st.failed_handled || !st.planner.has_news() || st.planner.pending_forks() > 0)
    return;
  if (st.any_failed()) {
    link_failure_seen(st.failure());
    return;
  }
  cuda_check(cudaSetDevice(st.device()), "GPU sparse: cudaSetDevice");
  upload_plan(st.planner.flush_plan());
  ++stats_.idle_flushes;
  try {
    // Every shard gets every plan; the previous step's messages are all ahead of it on the up stream.
    for (transport::GpuLink* l : st.links) {
      l->send(st.plan_dev.get(), pair::kGpuPlanBytes, st.up, "an idle flush plan");
      stats_.bytes_sent += pair::kGpuPlanBytes;
    }
  } catch (const Error& e) {
    link_failure_seen(e.what());
  }
}

GpuSparseController::~GpuSparseController() {
  if (st_ == nullptr) return;
  close();
  if (!st_->any_failed())
    for (cudaStream_t x : {st_->up, st_->down}) cudaStreamSynchronize(x);
}

void GpuSparseController::attend(int, const ForwardBatch&, const float*, const float*, const float*, float*) {
  fail("GPU sparse: the CPU attention hook is not used on the GPU path");
}

bool GpuSparseController::link_failed() const { return st_->any_failed(); }

std::string GpuSparseController::link_failure() const { return st_->failure(); }

int GpuSparseController::num_shards() const { return st_->N(); }

void GpuSparseController::set_request_options(uint64_t seq_id, bool force_dense, int sparse_threshold) {
  st_->planner.set_request_options(seq_id, force_dense, sparse_threshold);
}

void GpuSparseController::detach(uint64_t seq_id) { st_->planner.detach(seq_id); }

void GpuSparseController::on_release(uint64_t seq_id) { st_->planner.on_release(seq_id); }

void GpuSparseController::on_fork(uint64_t parent, uint64_t child) { st_->planner.on_fork(parent, child); }

void GpuSparseController::set_page_allocator(const PageAllocator* pages) { st_->planner.set_page_allocator(pages); }

int GpuSparseController::reusable_prefix_tokens(uint64_t seq_id, const std::vector<int32_t>& pages) {
  return st_->planner.reusable_prefix_tokens(seq_id, pages);
}

const SparseStepPlanner::RetentionStats& GpuSparseController::retention_stats() const {
  return st_->planner.retention_stats();
}

int GpuSparseController::retained_pages() const { return st_->planner.retained_pages(); }

std::pair<int, int> GpuSparseController::droppable_range(uint64_t seq_id, int seq_len) {
  const std::pair<int, int> r = st_->planner.droppable_range(seq_id, seq_len);
  stats_.dropped_seqs = st_->planner.dropped_seqs();
  return r;
}

bool GpuSparseController::graph_safe(const ForwardBatch& fb) const {
  return st_->any_failed() && !st_->planner.any_dropped(fb);
}

void GpuSparseController::link_failure_seen(const std::string& why) {
  // One shard lost fails the pair: every sparse sequence has KV on every shard. The other shards' links are aborted
  // with it, so that none is left in the middle of a step (a plan sent, its rows or answers not): nothing more is
  // posted on any link, and the transfers in flight on the shared streams are released.
  State& st = *st_;
  if (st.N() == 1) return fail_link(why);
  // The failed shard's own failure, named, before the aborts below fail the others.
  const std::string w = st.any_failed() ? st.failure() : why;
  for (transport::GpuLink* l : st.links) l->abort(w);
  fail_link(w);
}

void GpuSparseController::set_shard_names(std::vector<std::string> names) {
  SPADE_CHECK(names.size() == st_->links.size(), "GPU sparse: {} shard names for {} links", names.size(),
              st_->links.size());
  st_->names = std::move(names);
}

void GpuSparseController::fail_link(const std::string& why) {
  State& st = *st_;
  if (st.failed_handled) return;
  st.failed_handled = true;
  for (uint64_t id : st.planner.fail_all()) {
    st.failures.emplace_back(id, st.o.cache_name + " failed: " + why);
    ++stats_.failed_seqs;
  }
}

std::vector<std::pair<uint64_t, std::string>> GpuSparseController::take_failures() {
  if (st_->any_failed()) link_failure_seen(st_->failure());
  std::vector<std::pair<uint64_t, std::string>> out;
  out.swap(st_->failures);
  return out;
}

void GpuSparseController::begin_step(const ForwardBatch& fb, cudaStream_t stream) {
  State& st = *st_;
  sparse_now_ = false;
  st.active = false;
  st.planned = false;
  ++stats_.steps;
  const int B = fb.batch();
  SPADE_CHECK(B <= st.max_batch, "GPU sparse: batch {} exceeds {}", B, st.max_batch);
  st.T = fb.total_tokens();
  st.rows_layout = st.T;
  if (st.any_failed()) link_failure_seen(st.failure());
  if (st.failed_handled || st.closed) {
    // No link (failed or closed): dense, except the rows of sequences whose pages were dropped (they are failed
    // and end after this step): those attend only their local window, never a dropped page.
    st.dec = st.planner.local_step(fb);
  } else {
    SPADE_CHECK(st.hello_sent, "GPU sparse: send_hello() before the first step");
    SPADE_CHECK(st.T <= st.o.max_step_tokens, "GPU sparse: step of {} tokens exceeds {}", st.T, st.o.max_step_tokens);
    st.dec = st.planner.plan_step(fb, st.step++);
    const StepDecision& d = st.dec;
    for (int32_t t : d.tables) stats_.sparse_seq_steps += t >= 0 ? 1 : 0;
    stats_.switches += static_cast<uint64_t>(d.switches);
    if (d.sparse_now) ++stats_.sparse_steps;
    stats_.retained_reused_tokens = st.planner.retention_stats().reused_tokens;
    // The plan, on the up stream (before this step's packs).
    upload_plan(d.plan);
    try {
      // The same plan to every shard (each derives its packs' message sizes from it).
      for (transport::GpuLink* l : st.links) {
        l->send(st.plan_dev.get(), pair::kGpuPlanBytes, st.up, "a step's plan");
        stats_.bytes_sent += pair::kGpuPlanBytes;
      }
      st.planned = true;
    } catch (const Error& e) {
      // This step's sparse rows fail (take_failures). The step still attends them through the packed kernel (their
      // tables hold the last selection), as a dropped sequence must never be attended densely.
      link_failure_seen(e.what());
    }
  }
  const StepDecision& d = st.dec;
  sparse_now_ = d.sparse_now;
  if (!st.planned && !sparse_now_) return;  // dense throughout, nothing to upload (graph-capturable)
  st.parity ^= 1;
  // Per-row arrays and the held-row maps of the two groups ([L][S][Hkv] -> (table * L + l) * Hkv + h).
  const size_t MB = static_cast<size_t>(st.max_batch);
  std::vector<int32_t> w(st.array_words, 0);
  std::copy(d.num_packed.begin(), d.num_packed.end(), w.begin());
  std::copy(d.windows.begin(), d.windows.end(), w.begin() + static_cast<long>(MB));
  for (int r = 0; r < B; ++r) {
    const size_t i = static_cast<size_t>(r);
    // packed row of sequence r: its table's layer-0 row (dense and window-only rows read none)
    w[2 * MB + i] = std::max(0, d.tables[i]) * st.L;
    w[3 * MB + i] = d.q_rows[i];                // mixed steps: the packed kernel's rows
    w[4 * MB + i] = d.q_rows[i] >= 0 ? 1 : 0;   // mixed steps: the rows the prefill kernel skips
  }
  for (int g = 0; g < 2; ++g) {
    const int S = static_cast<int>(d.group_tables[g].size());
    for (int l = 0; l < st.L; ++l)
      for (int si = 0; si < S; ++si)
        for (int h = 0; h < st.Hkv; ++h)
          w[st.off_maps[g] + (static_cast<size_t>(l) * S + si) * st.Hkv + h] =
              (d.group_tables[g][static_cast<size_t>(si)] * st.L + l) * st.Hkv + h;
  }
  if (st.arrays_pending) cuda_check(cudaEventSynchronize(st.arrays_copied.e), "GPU sparse: previous arrays copy");
  // arrays[parity] was last read by the applies of two steps ago on the receive stream.
  cuda_check(cudaStreamWaitEvent(stream, st.arrays_free[st.parity].e, 0), "GPU sparse: wait arrays free");
  std::memcpy(st.arrays_pinned, w.data(), w.size() * 4);
  cuda_check(cudaMemcpyAsync(st.arrays[st.parity].get(), st.arrays_pinned, w.size() * 4, cudaMemcpyHostToDevice,
                             stream),
             "GPU sparse: arrays upload");
  cuda_check(cudaEventRecord(st.arrays_copied.e, stream), "GPU sparse: arrays event");
  st.arrays_pending = true;
  st.active = st.planned;
}

bool GpuSparseController::link_graph_ok(const ForwardBatch& fb) const {
  return st_->active && fb.total_tokens() == fb.batch() && static_cast<int>(fb.logit_rows.size()) == fb.batch();
}

int GpuSparseController::graph_variant() const { return st_->parity * 2 + (sparse_now_ ? 1 : 0); }

void GpuSparseController::set_layout_rows(int rows) {
  State& st = *st_;
  SPADE_CHECK(rows >= st.T && rows <= std::max(st.o.max_step_tokens, st.max_batch),
              "GPU sparse: {} layout rows for a step of {} tokens", rows, st.T);
  st.rows_layout = rows;
}

void GpuSparseController::set_capturing(bool on) { st_->capturing = on; }

void* GpuSparseController::rows_out(int layer, cudaStream_t stream, int* stride) {
  State& st = *st_;
  *stride = 0;
  if (!st.active) return nullptr;
  const int p = layer / st.P, j = layer % st.P;
  if (j == 0)
    cuda_check(cudaStreamWaitEvent(stream, st.prev_sent_ev(p),
                                   st.capturing ? cudaEventWaitExternal : 0),
               "wait send");
  return st.send_buf(p) + static_cast<size_t>(j) * st.rows_layout * st.row_elems;
}

void GpuSparseController::ship_graph_step() {
  State& st = *st_;
  for (int p = 0; p < st.packs && st.active; ++p) ship_pack(p);
}

void GpuSparseController::ship_pack(int p) {
  State& st = *st_;
  const size_t row_bytes = st.row_elems * 2;
  const int n = st.pack_layers(p);
  const size_t bytes = static_cast<size_t>(n) * st.T * row_bytes;
  cuda_check(cudaStreamWaitEvent(st.up, st.pack_end_ev(p), 0), "wait pack");
  const void* src = st.send_buf(p);
  if (st.rows_layout != st.T) {  // graph steps: drop the padding rows of each layer, [n][rows_layout] -> [n][T]
    cuda_check(cudaMemcpy2DAsync(st.stage.get(), st.T * row_bytes, st.send_buf(p), st.rows_layout * row_bytes,
                                 st.T * row_bytes, n, cudaMemcpyDeviceToDevice, st.up),
               "GPU sparse: compact a pack");
    src = st.stage.get();
  }
  try {
    st.link_of(p).send(src, bytes, st.up, "q|k|v rows of a pack");
  } catch (const Error& e) {
    link_failure_seen(e.what());
    st.active = false;  // no more link operations this step
    return;
  }
  cuda_check(cudaEventRecord(st.sent_ev(p), st.up), "sent");
  stats_.bytes_sent += bytes;
}

void GpuSparseController::attend(const GpuLayerStep& s, const GpuBatch& b, cudaStream_t stream) {
  State& st = *st_;
  const int p = s.layer / st.P, j = s.layer % st.P;
  if (sparse_now_) {
    if (j == 0 && st.planned)
      cuda_check(cudaStreamWaitEvent(stream, st.applied_ev(p),
                                     st.capturing ? cudaEventWaitExternal : 0),
                 "wait selection");
    const size_t MB = static_cast<size_t>(st.max_batch);
    kernels::SparsePackedDecodeParams a;
    const size_t layer_off = static_cast<size_t>(s.layer) * st.Hkv * st.k * st.D * 2;
    a.packed_k = st.held_k() + layer_off;
    a.packed_v = st.held_v() + layer_off;
    a.num_packed = st.arr(0);
    a.local_windows = st.arr(MB);
    a.packed_rows = st.arr(2 * MB);
    a.packed_capacity = st.k;
    a.workspace = {st.ws.get(), st.ws.bytes()};
    // Mixed steps: the sparse rows' pages outside the window may be dropped, so the prefill kernel skips them.
    attend_packed_rows(a, st.cfg, s, b, st.page_size, st.R, st.arr(3 * MB), st.arr(4 * MB), stream, "GPU sparse");
  } else {
    st.dense.attend(s, b, stream);
  }
  if (st.active && (j == st.P - 1 || s.layer == st.L - 1) && st.capturing) {
    // Graph step: the replay records the pack's end; ship_graph_step() enqueues the send after the launch.
    cuda_check(cudaEventRecordWithFlags(st.pack_end_ev(p), stream, cudaEventRecordExternal),
               "pack end");
  } else if (st.active && (j == st.P - 1 || s.layer == st.L - 1)) {
    cuda_check(cudaEventRecord(st.pack_end_ev(p), stream), "pack end");
    ship_pack(p);
  }
}

void GpuSparseController::end_step(cudaStream_t stream) {
  State& st = *st_;
  (void)stream;
  if (!st.active) return;
  for (int p = 0; p < st.packs; ++p) {
    const int n = st.pack_layers(p);
    const pair::GpuPackSizes sizes = pair::gpu_pack_sizes(st.dec.plan, n, st.cfg, st.k, st.C);
    const pair::DeltaLayout* lay[2] = {&sizes.steady, &sizes.first};
    char* bufs[2] = {nullptr, nullptr};
    for (int g = 0; g < 2; ++g) {
      if (lay[g]->rows == 0) continue;
      SPADE_CHECK(lay[g]->bytes <= st.recv_per_pack[g], "GPU sparse: a selection message of {} bytes exceeds {}",
                  lay[g]->bytes, st.recv_per_pack[g]);
      bufs[g] = st.recv[g][st.parity].as<char>() + static_cast<size_t>(p) * st.recv_per_pack[g];
      try {
        st.link_of(p).recv(bufs[g], lay[g]->bytes, st.down,
                           g == 0 ? "steady selections of a pack" : "first selections");
      } catch (const Error& e) {
        link_failure_seen(e.what());
        st.active = false;
        return;
      }
      stats_.bytes_received += lay[g]->bytes;
    }
    // This step's pack p has read the tables: apply the next step's deltas.
    cuda_check(cudaStreamWaitEvent(st.down, st.pack_end_ev(p), 0), "wait pack end");
    for (int g = 0; g < 2; ++g) {
      if (bufs[g] == nullptr) continue;
      const int S = static_cast<int>(st.dec.group_tables[g].size());
      kernels::ApplySelectionDeltaParams a;
      a.delta_slots = reinterpret_cast<const int32_t*>(bufs[g] + lay[g]->slots);
      a.delta_k = bufs[g] + lay[g]->k;
      a.delta_v = bufs[g] + lay[g]->v;
      a.held_k = st.held_k();
      a.held_v = st.held_v();
      a.held_rows = st.arr(st.off_maps[g] + static_cast<size_t>(p) * st.P * S * st.Hkv);
      a.rows = n * S * st.Hkv;
      a.k = st.k;
      a.capacity = lay[g]->cap;
      a.head_dim = st.D;
      cuda_check(kernels::apply_selection_delta(a, st.down), "GPU sparse: apply");
    }
    cuda_check(cudaEventRecord(st.next_applied_ev(p), st.down), "applied");
  }
  cuda_check(cudaEventRecord(st.arrays_free[st.parity].e, st.down), "arrays free");
}

}  // namespace spade
