// The GPU data plane of inference_rank --serve (serve_pairing.h make_gpu_data_plane): the forward pass on one GPU
// (GpuEngineForward) and, with cache ranks, the GpuSparseController over one NcclLink or CudaIpcLink per cache rank
// (N = --num-cache / --num-inference layer shards, pair/gpu_shard.h; one NCCL communicator pair per link). CUDA
// builds only.
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <cstring>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "common/error.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#include "inference_rank/serve_pairing.h"
#include "kernels/device.h"
#include "pair/gpu_shard.h"

namespace spade {
namespace {

// The pair's N shard links as one GpuLink for PairHealth, which aborts the pair's link on a PeerDown: aborting it
// aborts every shard's link (one shard lost fails the pair: gpu_sparse.h, layer shards). Nothing is sent through it.
class ShardLinks final : public transport::GpuLink {
 public:
  explicit ShardLinks(std::vector<transport::GpuLink*> links) : links_(std::move(links)) {
    for (const transport::GpuLink* l : links_) names_ += (names_.empty() ? "" : ", ") + l->peer_name();
  }
  void send(const void*, size_t, cudaStream_t, const char*, std::chrono::milliseconds) override {
    fail("the layer shards' links of {} take no send of their own", names_);
  }
  void recv(void*, size_t, cudaStream_t, const char*, std::chrono::milliseconds) override {
    fail("the layer shards' links of {} take no receive of their own", names_);
  }
  void abort(const std::string& reason) override {
    for (transport::GpuLink* l : links_) l->abort(reason);
  }
  bool failed() const override {
    for (const transport::GpuLink* l : links_)
      if (l->failed()) return true;
    return false;
  }
  std::string failure() const override {
    for (const transport::GpuLink* l : links_)
      if (l->failed()) return l->failure();
    return "";
  }
  void on_failure(std::function<void(const std::string&)>) override {
    fail("the layer shards' links of {} take no failure callback", names_);
  }
  transport::GpuLinkCounters counters() const override {
    transport::GpuLinkCounters c;
    for (const transport::GpuLink* l : links_) {
      const transport::GpuLinkCounters x = l->counters();
      c.sends += x.sends;
      c.recvs += x.recvs;
      c.bytes_sent += x.bytes_sent;
      c.bytes_received += x.bytes_received;
    }
    return c;
  }
  size_t in_flight() const override {
    size_t n = 0;
    for (const transport::GpuLink* l : links_) n += l->in_flight();
    return n;
  }
  transport::PairRole role() const override { return transport::PairRole::kInference; }
  int device() const override { return links_.front()->device(); }
  const std::string& peer_name() const override { return names_; }

 private:
  std::vector<transport::GpuLink*> links_;
  std::string names_;
};

class GpuDataPlane final : public DataPlane {
 public:
  GpuDataPlane(DataPlaneSetup setup, coord::ClientOptions& co) : DataPlane(std::move(setup)), lo_(link_options()) {
    // The link's inference-side end exists before registering: its address is what the coordinator forwards.
    co.device = fmt::format("cuda:{}", opt_.gpu);
    if (env_.num_cache == 0 || opt_.sparse.mode != SelectionMode::Predicted) return;
    SPADE_CHECK(opt_.gpu_link == "nccl" || opt_.gpu_link == "ipc", "{}: --gpu-link must be nccl or ipc, got '{}'",
                self_, opt_.gpu_link);
    // N cache ranks: one link each (layer shards, pair/gpu_shard.h); every shard must serve a pack.
    const int n = static_cast<int>(std::max<uint32_t>(1, env_.cache_per_inference));
    const int layers = model_cfg_.attention_view().num_layers;
    const int packs = (layers + opt_.sparse.layers_per_pack - 1) / opt_.sparse.layers_per_pack;
    SPADE_CHECK(packs >= n,
                "{}: {} cache ranks but only {} layer packs ({} attention layers, --layers-per-pack {}): a cache rank "
                "would hold no layer; pass a smaller --layers-per-pack or start fewer cache ranks",
                self_, n, packs, layers, opt_.sparse.layers_per_pack);
    lo_.kind = opt_.gpu_link == "nccl" ? transport::LinkKind::kNccl : transport::LinkKind::kCudaIpc;
    std::vector<std::string> addresses;
    for (int s = 0; s < n; ++s) {
      offers_.push_back(transport::offer_gpu_link(lo_));
      addresses.push_back(offers_.back()->address());
    }
    co.transport_kind = transport_kind(lo_.kind);
    co.transport_address = pair::join_shard_addresses(addresses);  // one address: unchanged
    co.layers_per_pack = static_cast<uint32_t>(opt_.sparse.layers_per_pack);  // its cache ranks' layer shards follow
  }
  ~GpuDataPlane() override { teardown(); }

  void connect(const proto::ClusterView& view, Clock::time_point deadline) override {
    if (!offers_.empty() && view.peers_size() > 0) {
      // The view lists this rank's cache ranks in shard order: link s to shard s.
      SPADE_CHECK(view.peers_size() == static_cast<int>(offers_.size()),
                  "{}: the coordinator paired {} cache ranks with this rank, the world gives it {}", self_,
                  view.peers_size(), offers_.size());
      for (int s = 0; s < view.peers_size(); ++s) {
        const proto::RankInfo& peer = view.peers(s);
        const std::string name = cache_rank_name(peer);
        set_stage_("connecting the GPU data plane to " + name);
        // CUDA IPC waits for its peer up to the rendezvous timeout (as the link was offered); NCCL up to what is
        // left of the rendezvous deadline (at least 1 s).
        const auto left = std::max(std::chrono::milliseconds(1000),
                                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
        transport::GpuLinkOffer& offer = *offers_[static_cast<size_t>(s)];
        links_.push_back(offer.connect(name, offer.kind() == transport::LinkKind::kNccl ? left : lo_.connect_timeout));
        shard_ranks_.push_back(peer.rank());
        shard_names_.push_back(name);
        shard_incarnations_.push_back(peer.incarnation());
        cache_name_ += (cache_name_.empty() ? "" : ", ") + name;
      }
      has_link_ = true;
      shard_repairs_.resize(links_.size());
      spdlog::info("{}: GPU data plane to {} over {}{}", self_, cache_name_, transport::link_kind_name(lo_.kind),
                   links_.size() > 1 ? fmt::format(" ({} layer shards, pack p to shard p mod {})", links_.size(),
                                                   links_.size())
                                     : std::string());
    } else {
      no_cache_rank();
    }
    SPADE_CHECK(sparse_.mode != SelectionMode::Oracle && sparse_.mode != SelectionMode::Quest,
                "{}: --selection {} on the GPU is a one-process fidelity reference (inference_rank --device cuda "
                "without --serve)",
                self_, selection_mode_name(sparse_.mode));
  }

  Engine& build_engine(std::unique_ptr<Model>& model) override {
    cuda_check(cudaSetDevice(opt_.gpu), "inference rank: cudaSetDevice");
    engine_ = std::make_unique<Engine>(
        model_cfg_, opt_.engine,
        ForwardSampleFn([this](const ForwardBatch& b, const std::vector<RowSampling>& r, std::vector<int32_t>& t,
                               std::vector<TokenLogprobs>& l) { gpu_->sample(b, r, t, l); }));
    const GpuEngineOptions go = gpu_engine_options(engine_->options(), opt_.cuda_graphs);
    gpu_ = std::make_unique<GpuEngineForward>(
        GpuModel::upload(model_cfg_, model->weights(), GpuEngineForward::model_options(go)), go);
    model.reset();  // the host fp32 copy is no longer needed
    {
      const auto t_warm = std::chrono::steady_clock::now();
      const int n = gpu_->warm_up();  // before the pair hello (gpu_engine.h)
      spdlog::info("{}: GPU warm-up: {} steps in {:.1f} ms", self_, n,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_warm).count());
    }
    spdlog::info("{}: GPU {}: {:.2f} GB weights, {:.2f} GB KV pool ({} pages)", self_, opt_.gpu,
                 gpu_->model().weight_bytes() / 1e9, gpu_->kv_bytes() / 1e9, go.engine.num_pages);
    if (!links_.empty()) {
      const EngineOptions& en = engine_->options();
      gpu_attn_cfg_ = std::make_unique<ModelConfig>(model_cfg_.attention_view());
      const GpuSparseOptions gso =
          gpu_sparse_options(sparse_, en, cache_name_, sparse_.max_retained_prefix_tokens);
      std::vector<transport::GpuLink*> raw;
      for (const auto& l : links_) raw.push_back(l.get());
      gpu_sparse_ = std::make_unique<GpuSparseController>(*gpu_attn_cfg_, gso, std::move(raw), en.page_size,
                                                          gpu_->max_batch());
      gpu_sparse_->set_shard_names(shard_names_);
      gpu_sparse_->send_hello(make_gpu_pair_hello(*gpu_attn_cfg_, gso, en));
      gpu_->set_sparse(gpu_sparse_.get());
      engine_->set_attention_hooks(gpu_sparse_.get());
      spdlog::info("{}: GPU sparse decoding: threshold {}, budget {}, local window {}, delta capacity {}, {} layers "
                   "per pack", self_, sparse_.sparse_threshold, sparse_.selection.token_budget,
                   sparse_.selection.local_window, sparse_.effective_delta_capacity(), sparse_.layers_per_pack);
    }
    return *engine_;
  }

  std::string transport_name() const override {
    return cache_name_.empty() ? std::string("none") : std::string(opt_.gpu_link == "ipc" ? "cuda_ipc" : "nccl");
  }

  void set_request_options(uint64_t engine_id, const IntakeRequest& r) override {
    if (gpu_sparse_ && (r.force_dense || r.sparse_threshold > 0))
      gpu_sparse_->set_request_options(engine_id, r.force_dense, r.sparse_threshold);
  }

 protected:
  void arm_health() override { health_->arm(std::vector<transport::Endpoint*>{}, health_link()); }

  // Layer shards (N > 1): one lost shard aborts every shard's link (no cache rank is left in the middle of a step:
  // ShardLinks), and a GPU cache rank exits when a sibling shard is lost (the coordinator sends it the sibling's
  // PeerDown), so every shard comes back as a new incarnation of its index. Each replacement is offered a fresh link
  // (the address list carries it at its shard's entry) and connected on a thread of its own; once all N shards'
  // replacements are connected, finish_shard_repairs() makes a controller over them and swaps it in.
  bool replace_shard(const proto::PeerReplaced& pr, const std::string& name, coord::CoordinatorClient& cc) override {
    if (shard_ranks_.size() <= 1) return false;
    const proto::RankInfo& peer = pr.peer();
    const int shard = shard_of_rank(peer.rank());
    const size_t si = static_cast<size_t>(shard);
    const int n = static_cast<int>(shard_ranks_.size());
    if (peer.incarnation() <= shard_incarnations_[si]) {
      spdlog::warn("{}: ignoring a replacement of {} with incarnation {} (layer shard {}'s is {})", self_, name,
                   peer.incarnation(), shard, shard_incarnations_[si]);
      return true;
    }
    health_->degrade(fmt::format("{} (layer shard {} of {}) was replaced (previous incarnation: {}); the {} layer "
                                 "shards re-pair together, once each one's replacement is connected",
                                 name, shard, n, pr.previous_reason(), n),
                     true, true, shard);
    spdlog::warn("{}: {}", self_, health_->degraded());
    if (!gpu_sparse_) return true;
    transport::LinkOptions glo = lo_;
    glo.peer_name = name;
    std::shared_ptr<transport::GpuLinkOffer> fresh = transport::offer_gpu_link(glo);
    proto::PairOffer po;
    po.set_peer_rank(peer.rank());
    po.set_peer_incarnation(peer.incarnation());
    po.mutable_transport()->set_kind(transport_kind(glo.kind));
    std::vector<std::string> addresses(static_cast<size_t>(n));  // the replacement reads entry `shard` of N
    addresses[si] = fresh->address();
    po.mutable_transport()->set_address(pair::join_shard_addresses(addresses));
    try {
      cc.send_pair_offer(po);
    } catch (const std::exception& e) {
      health_->degrade(fmt::format("re-pairing {} as layer shard {} of {} failed: {}", name, shard, n, e.what()),
                       false, true);
      spdlog::error("{}: {}; decoding densely", self_, health_->degraded());
      return true;
    }
    const int device = opt_.gpu;
    const auto timeout = opt_.rendezvous_timeout;
    if (shard_repairs_[si] && !shard_repairs_[si]->connected)
      parked_.push_back(std::move(shard_repairs_[si]->link));  // superseded while connecting
    shard_repairs_[si] = ShardRepair{peer, name,
                                     std::async(std::launch::async,
                                                [fresh, name, device, timeout] {
                                                  cuda_check(cudaSetDevice(device),
                                                             "inference rank: cudaSetDevice (re-pairing)");
                                                  return fresh->connect(name, timeout);
                                                }),
                                     nullptr};
    spdlog::info("{}: {} replaced layer shard {} of {} (incarnation {}); offered the data plane, connecting", self_,
                 name, shard, n, peer.incarnation());
    return true;
  }

  // Once every shard's replacement is connected: a new controller over the N links, its pair hellos, and the swap
  // (the samples admitted before stay dense to their end, as with one replaced cache rank). A replacement whose connect
  // failed, or that was declared dead meanwhile, is dropped alone: the others stay connected, waiting for their hello,
  // until its own replacement connects. A failure once the hellos are being sent drops them all (a cache rank that has
  // its hello cannot take another) and leaves the pair degraded, saying why.
  void finish_shard_repairs(const RequestTable& requests) override {
    std::erase_if(parked_, [](const std::future<std::unique_ptr<transport::GpuLink>>& f) {
      return f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;  // its link goes
    });
    if (shard_repairs_.size() <= 1 || !gpu_sparse_) return;
    const int n = static_cast<int>(shard_repairs_.size());
    bool all = true;
    for (int s = 0; s < n; ++s) {
      std::optional<ShardRepair>& r = shard_repairs_[static_cast<size_t>(s)];
      if (!r) {
        all = false;
        continue;
      }
      try {
        if (!r->connected) {
          if (r->link.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
            all = false;
            continue;
          }
          r->connected = r->link.get();  // the connect's error
        }
        check_not_declared_dead(r->peer.incarnation(), s);
      } catch (const std::exception& e) {
        health_->degrade(fmt::format("re-pairing {} as layer shard {} of {} failed: {}; waiting for its replacement",
                                     r->name, s, n, e.what()),
                         false, true);
        spdlog::error("{}: {}", self_, health_->degraded());
        r.reset();
        all = false;
      }
    }
    if (!all) return;
    std::vector<ShardRepair> got;
    for (std::optional<ShardRepair>& r : shard_repairs_) {
      got.push_back(std::move(*r));
      r.reset();
    }
    std::vector<std::unique_ptr<transport::GpuLink>> fresh;
    std::vector<std::string> names;
    std::string names_joined;
    for (ShardRepair& r : got) {
      fresh.push_back(std::move(r.connected));
      names.push_back(r.name);
      names_joined += (names_joined.empty() ? "" : ", ") + r.name;
    }
    std::unique_ptr<GpuSparseController> controller;
    try {
      cuda_check(cudaSetDevice(opt_.gpu), "inference rank: cudaSetDevice (re-pairing)");
      const EngineOptions& en = engine_->options();
      const GpuSparseOptions gso =
          gpu_sparse_options(sparse_, en, names_joined, sparse_.max_retained_prefix_tokens);
      std::vector<transport::GpuLink*> raw;
      for (const auto& l : fresh) raw.push_back(l.get());
      controller = std::make_unique<GpuSparseController>(*gpu_attn_cfg_, gso, std::move(raw), en.page_size,
                                                         gpu_->max_batch());
      controller->set_shard_names(names);
      controller->send_hello(make_gpu_pair_hello(*gpu_attn_cfg_, gso, en));
    } catch (const std::exception& e) {
      controller.reset();  // before its links
      health_->degrade(fmt::format("re-pairing the {} layer shards failed: {}", n, e.what()), false, true);
      spdlog::error("{}: {}; decoding densely", self_, health_->degraded());
      return;
    }
    // The samples admitted before the swap have tokens the new cache ranks never received: dense to their end.
    requests.for_each_sample([&controller](uint64_t eid, int, int) { controller->detach(eid); });
    add(retired_stats_, gpu_sparse_->stats());  // the old controller's counters keep counting
    health_->rearm(nullptr, nullptr);           // the old links go below
    gpu_->set_sparse(controller.get());
    engine_->set_attention_hooks(controller.get());
    gpu_sparse_ = std::move(controller);  // the old controller goes before its links
    health_links_.reset();
    links_ = std::move(fresh);
    for (int s = 0; s < n; ++s)
      shard_incarnations_[static_cast<size_t>(s)] = got[static_cast<size_t>(s)].peer.incarnation();
    shard_names_ = names;
    cache_name_ = names_joined;
    health_->restore(nullptr, health_link());
    spdlog::info("{}: the pair is whole again: re-paired its {} layer shards ({}); new requests decode sparsely over "
                 "all of them",
                 self_, n, cache_name_);
  }

  bool predicted() const override { return true; }

  void start_repair(const proto::RankInfo& /*peer*/, const std::string& name, proto::PairOffer& offer,
                    Clock::time_point /*deadline: the link waits up to the rendezvous timeout*/,
                    coord::CoordinatorClient& cc) override {
    // NCCL ids are single-use: a fresh offer (CUDA IPC: fresh memory), brokered like the first pairing.
    transport::LinkOptions glo = lo_;
    glo.peer_name = name;
    std::shared_ptr<transport::GpuLinkOffer> fresh = transport::offer_gpu_link(glo);
    offer.mutable_transport()->set_kind(transport_kind(glo.kind));
    offer.mutable_transport()->set_address(fresh->address());
    cc.send_pair_offer(offer);
    const EngineOptions en = engine_->options();
    const GpuSparseOptions gso = gpu_sparse_options(sparse_, en, name, sparse_.max_retained_prefix_tokens);
    const ModelConfig* attn = gpu_attn_cfg_.get();
    const int max_batch = gpu_->max_batch();
    const int device = opt_.gpu;
    const auto timeout = opt_.rendezvous_timeout;
    repair_gpu_ = std::async(std::launch::async, [fresh, name, en, gso, attn, max_batch, device, timeout] {
      cuda_check(cudaSetDevice(device), "inference rank: cudaSetDevice (re-pairing)");
      Repaired g;
      g.link = fresh->connect(name, timeout);
      g.controller = std::make_unique<GpuSparseController>(*attn, gso, *g.link, en.page_size, max_batch);
      g.controller->send_hello(make_gpu_pair_hello(*attn, gso, en));
      return g;  // one cache rank: layer shards re-pair together (replace_shard, finish_shard_repairs)
    });
  }

  bool repair_ready() override {
    return repair_gpu_.valid() && repair_gpu_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  void swap_in(const proto::RankInfo& peer, const RequestTable& requests) override {
    Repaired g = repair_gpu_.get();
    check_not_declared_dead(peer.incarnation());
    // The samples admitted before the swap have tokens the new cache rank never received: dense to their end.
    requests.for_each_sample([&g](uint64_t eid, int /*threshold*/, int /*token_budget*/) { g.controller->detach(eid); });
    if (gpu_sparse_) add(retired_stats_, gpu_sparse_->stats());  // the old controller's counters keep counting
    health_->rearm(nullptr, nullptr);  // the old link goes below
    gpu_->set_sparse(g.controller.get());
    engine_->set_attention_hooks(g.controller.get());
    gpu_sparse_ = std::move(g.controller);  // the old controller goes before its link
    links_.clear();
    links_.push_back(std::move(g.link));
    health_->restore(nullptr, links_.front().get());
  }

  void drop_repair() override { repair_gpu_ = {}; }

  void path_limits(IntakeLimits& limits) const override {
    limits.on_gpu = true;
    limits.rank_token_budget = sparse_.selection.token_budget;
    limits.cpu_backend = false;
  }

  // Between steps: the releases, retains and drops the finished requests left go to the cache rank now (a flush plan),
  // so its pool and KV gauges do not wait for the next request.
  void idle_flush() override {
    if (gpu_sparse_ && engine_ && engine_->idle()) gpu_sparse_->idle_flush();
  }

  std::optional<std::string> link_failure() override {
    if (!gpu_sparse_ || !gpu_sparse_->link_failed()) return std::nullopt;
    return gpu_sparse_->link_failure();
  }

  void publish_stats(coord::CoordinatorClient& cc, InferenceMetrics& metrics) override {
    SparseStats s;
    pair::LinkStats l;
    if (!stats(s, l)) {
      metrics.update(engine_->stats(), nullptr, nullptr);
      return;
    }
    cc.set_stat("sparse_seq_steps", static_cast<double>(s.sparse_seq_steps));
    metrics.update(engine_->stats(), &s, &l);
  }

  void close_sessions() override {
    SparseStats s;
    pair::LinkStats l;
    const uint64_t link_graph_replays = gpu_ != nullptr ? gpu_->link_graph_steps() : 0;
    if (stats(s, l))
      spdlog::info("{}: {} steps, {} sparse sequence-steps, {} switches, {} failed, {:.1f} MB up, {:.1f} MB down, "
                   "{} KV pages dropped, {} link-step graph replays",
                   self_, s.steps, s.sparse_seq_steps, s.switches, s.failed_seqs, l.bytes_sent / 1e6,
                   l.bytes_received / 1e6, engine_->stats().dropped_pages, link_graph_replays);
    if (gpu_sparse_) gpu_sparse_->close();  // the close plan: the cache rank posts nothing more
  }

  void release() override {
    // The controller before the forward pass, both before the engine; the links last.
    shard_repairs_.clear();  // waits for their connects (each ends at its deadline)
    parked_.clear();
    gpu_sparse_.reset();
    gpu_attn_cfg_.reset();
    gpu_.reset();
    engine_.reset();
    health_links_.reset();
    links_.clear();
  }

 private:
  struct Repaired {
    std::unique_ptr<transport::GpuLink> link;
    std::unique_ptr<GpuSparseController> controller;
  };
  // A replaced layer shard's fresh link: connecting (replace_shard), then connected and waiting for the others.
  struct ShardRepair {
    proto::RankInfo peer;
    std::string name;
    std::future<std::unique_ptr<transport::GpuLink>> link;
    std::unique_ptr<transport::GpuLink> connected;  // link's result, once taken
  };

  static proto::TransportKind transport_kind(transport::LinkKind kind) {
    return kind == transport::LinkKind::kNccl ? proto::TRANSPORT_NCCL : proto::TRANSPORT_CUDA_IPC;
  }
  static void add(GpuSparseStats& into, const GpuSparseStats& s) {
    into.steps += s.steps;
    into.sparse_seq_steps += s.sparse_seq_steps;
    into.switches += s.switches;
    into.failed_seqs += s.failed_seqs;
    into.bytes_sent += s.bytes_sent;
    into.bytes_received += s.bytes_received;
    into.retained_reused_tokens += s.retained_reused_tokens;
  }
  // The counters in the CPU path's shapes (metrics and coordinator stats), over every controller a re-pairing
  // replaced too; false without a controller.
  bool stats(SparseStats& s, pair::LinkStats& l) const {
    if (!gpu_sparse_) return false;
    const GpuSparseStats& g = gpu_sparse_->stats();
    const GpuSparseStats& r = retired_stats_;
    s.steps = g.steps + r.steps;
    s.sparse_seq_steps = g.sparse_seq_steps + r.sparse_seq_steps;
    s.switches = g.switches + r.switches;
    s.failed_seqs = g.failed_seqs + r.failed_seqs;
    s.retained_reused_tokens = g.retained_reused_tokens + r.retained_reused_tokens;
    l.bytes_sent = g.bytes_sent + r.bytes_sent;
    l.bytes_received = g.bytes_received + r.bytes_received;
    l.updates = s.steps;
    return true;
  }

  // What PairHealth aborts on a PeerDown: the link itself with one cache rank, else every shard's (ShardLinks).
  transport::GpuLink* health_link() {
    if (links_.empty()) return nullptr;
    if (links_.size() == 1) return links_.front().get();
    std::vector<transport::GpuLink*> raw;
    for (const auto& l : links_) raw.push_back(l.get());
    health_links_ = std::make_unique<ShardLinks>(std::move(raw));
    return health_links_.get();
  }

  transport::LinkOptions lo_;
  std::vector<std::unique_ptr<transport::GpuLinkOffer>> offers_;  // one per cache rank; none without a cache rank
                                                                  // or with dense selection
  std::vector<std::unique_ptr<transport::GpuLink>> links_;        // one per cache rank, shard order
  std::vector<std::string> shard_names_;                          // the cache ranks, shard order
  std::unique_ptr<ShardLinks> health_links_;                      // layer shards: links_ as one, for PairHealth
  std::vector<uint32_t> shard_incarnations_;                      // the incarnation each link is to, shard order
  std::vector<std::optional<ShardRepair>> shard_repairs_;         // layer shards: each one's replacement, connecting
  std::vector<std::future<std::unique_ptr<transport::GpuLink>>> parked_;  // superseded replacements' connects
  std::unique_ptr<GpuEngineForward> gpu_;
  std::unique_ptr<ModelConfig> gpu_attn_cfg_;
  std::unique_ptr<GpuSparseController> gpu_sparse_;
  GpuSparseStats retired_stats_;  // of the controllers a re-pairing replaced
  std::future<Repaired> repair_gpu_;
};

}  // namespace

std::unique_ptr<DataPlane> make_gpu_data_plane(DataPlaneSetup setup, coord::ClientOptions& co) {
  return std::make_unique<GpuDataPlane>(std::move(setup), co);
}

}  // namespace spade
