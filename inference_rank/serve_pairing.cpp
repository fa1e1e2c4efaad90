#include "inference_rank/serve_pairing.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>
#include <utility>

#include "common/error.h"
#include "pair/sharded_link.h"

namespace spade {

// ---- PairHealth ----

void PairHealth::arm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
  arm(endpoint != nullptr ? std::vector<transport::Endpoint*>{endpoint} : std::vector<transport::Endpoint*>{},
      gpu_link);
}

void PairHealth::arm(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link) {
  std::lock_guard<std::mutex> lk(link_mu_);
  endpoints_ = std::move(endpoints);
  gpu_link_ = gpu_link;
}

void PairHealth::degrade(const std::string& why, bool abort_link, bool replace_reason, int shard) {
  std::lock_guard<std::mutex> lk(mu_);
  if (why_.empty() || replace_reason) why_ = why;
  if (!abort_link || abort_started_ || disarmed_) return;
  abort_started_ = true;
  aborter_ = std::thread([this, why, shard] {
    std::lock_guard<std::mutex> l(link_mu_);
    for (size_t i = 0; i < endpoints_.size(); ++i)
      if (endpoints_[i] != nullptr && (shard < 0 || static_cast<size_t>(shard) == i)) endpoints_[i]->abort(why);
    if (gpu_link_ != nullptr) gpu_link_->abort(why);
  });
}

void PairHealth::disarm() {
  std::thread t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    disarmed_ = true;
    t = std::move(aborter_);
  }
  if (t.joinable()) t.join();
  arm(nullptr, nullptr);
}

void PairHealth::rearm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
  rearm(endpoint != nullptr ? std::vector<transport::Endpoint*>{endpoint} : std::vector<transport::Endpoint*>{},
        gpu_link);
}

void PairHealth::rearm(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link) {
  std::thread t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    t = std::move(aborter_);
  }
  if (t.joinable()) t.join();
  arm(std::move(endpoints), gpu_link);
}

void PairHealth::restore(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
  restore(endpoint != nullptr ? std::vector<transport::Endpoint*>{endpoint} : std::vector<transport::Endpoint*>{},
          gpu_link);
}

void PairHealth::restore(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link) {
  rearm(std::move(endpoints), gpu_link);
  std::lock_guard<std::mutex> lk(mu_);
  why_.clear();
  abort_started_ = false;
}

std::string PairHealth::degraded() const {
  std::lock_guard<std::mutex> lk(mu_);
  return why_;
}

// ---- DataPlane: what the CPU and the GPU data plane share ----

namespace {

std::string cache_down_reason(const proto::PeerDown& pd) {
  return fmt::format("cache rank {} (#{}) on {} is down: {}", pd.rank(), pd.role_index(), pd.host(), pd.reason());
}

}  // namespace

DataPlane::DataPlane(DataPlaneSetup setup)
    : self_(std::move(setup.self)),
      opt_(setup.opt),
      env_(setup.env),
      model_cfg_(std::move(setup.model_cfg)),
      health_(std::move(setup.health)),
      set_stage_(std::move(setup.set_stage)),
      sparse_(setup.opt.sparse) {}

std::string DataPlane::cache_rank_name(const proto::RankInfo& peer) {
  return fmt::format("cache rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
}

transport::LinkOptions DataPlane::link_options() const {
  transport::LinkOptions lo;
  lo.name = self_;
  lo.device = opt_.gpu;
  lo.peer_name = "its cache rank";
  lo.op_timeout = opt_.sparse.selection_deadline;
  lo.connect_timeout = opt_.rendezvous_timeout;
  return lo;
}

void DataPlane::no_cache_rank() {
  if (sparse_.mode != SelectionMode::Predicted) return;
  spdlog::warn("{}: no cache rank in the world: predicted selection unavailable, decoding densely", self_);
  sparse_.mode = SelectionMode::Dense;
}

int DataPlane::shard_of_rank(uint32_t r) const {
  const auto it = std::find(shard_ranks_.begin(), shard_ranks_.end(), r);
  return it == shard_ranks_.end() ? -1 : static_cast<int>(it - shard_ranks_.begin());
}

std::shared_ptr<std::vector<std::atomic<int64_t>>> DataPlane::down_incarnations(size_t n) {
  auto v = std::make_shared<std::vector<std::atomic<int64_t>>>(std::max<size_t>(1, n));
  for (auto& a : *v) a.store(-1);
  return v;
}

void DataPlane::check_not_declared_dead(uint32_t incarnation, int shard) const {
  SPADE_CHECK((*cache_down_incarnation_).at(static_cast<size_t>(shard)).load() < static_cast<int64_t>(incarnation),
              "it was declared dead while connecting");
}

IntakeLimits DataPlane::intake_limits() const {
  IntakeLimits limits;
  limits.vocab_size = model_cfg_.vocab_size;
  limits.max_model_len = engine_->options().max_model_len;
  path_limits(limits);
  return limits;
}

void DataPlane::watch(coord::CoordinatorClient& cc) {
  // From here a PeerDown for the cache rank aborts the link at once (the coordinator client's I/O thread);
  // teardown() detaches the link before the engine (its owner) is destroyed.
  arm_health();
  if (!has_link_) return;
  cache_down_incarnation_ = down_incarnations(shard_ranks_.size());
  cc.set_event_callback([health = health_, shard_ranks = shard_ranks_,
                         down = cache_down_incarnation_](const coord::ClientEvent& ev) {
    if (ev.kind != coord::ClientEvent::Kind::kPeerDown) return;
    const auto it = std::find(shard_ranks.begin(), shard_ranks.end(), ev.peer_down.rank());
    if (it == shard_ranks.end()) return;
    const int shard = static_cast<int>(it - shard_ranks.begin());
    std::atomic<int64_t>& d = (*down)[static_cast<size_t>(shard)];
    int64_t seen = d.load();
    while (seen < ev.peer_down.incarnation() && !d.compare_exchange_weak(seen, ev.peer_down.incarnation())) {
    }
    health->degrade(cache_down_reason(ev.peer_down), true, false, shard);
  });
}

void DataPlane::on_peer_down(const proto::PeerDown& pd) {
  const int shard = shard_of_rank(pd.rank());
  if (!has_link_ || shard < 0) return;
  health_->degrade(cache_down_reason(pd), true, false, shard);  // the callback has aborted the link already
  spdlog::warn("{}: {}; sparse requests in flight fail, every other and every new request decodes densely", self_,
               cache_down_reason(pd));
}

bool DataPlane::replace_shard(const proto::PeerReplaced&, const std::string&, coord::CoordinatorClient&) {
  return false;
}

void DataPlane::finish_shard_repairs(const RequestTable&) {}

void DataPlane::on_peer_replaced(const proto::PeerReplaced& pr, coord::CoordinatorClient& cc) {
  const proto::RankInfo& peer = pr.peer();
  const std::string name = cache_rank_name(peer);
  if (!has_link_ || shard_of_rank(peer.rank()) < 0) {
    spdlog::warn("{}: ignoring a replacement of rank {}: not this rank's cache rank", self_, peer.rank());
    return;
  }
  if (replace_shard(pr, name, cc)) return;
  if (peer.incarnation() <= cache_incarnation_) {
    spdlog::warn("{}: ignoring a replacement of {} with incarnation {} (the pair's is {})", self_, name,
                 peer.incarnation(), cache_incarnation_);
    return;
  }
  health_->degrade(fmt::format("{} was replaced (previous incarnation: {})", cache_name_, pr.previous_reason()), true);
  if (!predicted()) {
    spdlog::info("{}: {} replaced; this rank decodes densely (--selection {}), nothing to re-pair", self_, name,
                 selection_mode_name(sparse_.mode));
    return;
  }
  repair_.reset();  // a newer replacement supersedes one still connecting (its connect ends at its deadline)
  drop_repair();
  proto::PairOffer po;
  po.set_peer_rank(peer.rank());
  po.set_peer_incarnation(peer.incarnation());
  try {
    start_repair(peer, name, po, Clock::now() + opt_.rendezvous_timeout, cc);
  } catch (const std::exception& e) {
    health_->degrade(fmt::format("re-pairing with {} failed: {}", name, e.what()), false, true);
    spdlog::error("{}: re-pairing with {} failed: {}; decoding densely", self_, name, e.what());
    return;
  }
  spdlog::info("{}: {} replaced {} (incarnation {}); offered the data plane, connecting", self_, name, cache_name_,
               peer.incarnation());
  repair_ = PendingRepair{peer, name};
}

void DataPlane::finish_repair(const RequestTable& requests) {
  finish_shard_repairs(requests);
  if (!repair_ || !repair_ready()) return;
  PendingRepair rp = std::move(*repair_);
  repair_.reset();
  try {
    swap_in(rp.peer, requests);
  } catch (const std::exception& e) {
    health_->degrade(fmt::format("re-pairing with {} failed: {}", rp.name, e.what()), false, true);
    spdlog::error("{}: re-pairing with {} failed: {}; decoding densely", self_, rp.name, e.what());
    return;
  }
  cache_name_ = rp.name;
  cache_incarnation_ = rp.peer.incarnation();
  spdlog::info("{}: the pair is whole again: {} (incarnation {}) connected; new requests decode sparsely", self_,
               cache_name_, cache_incarnation_);
}

void DataPlane::after_step() {
  idle_flush();
  // A link that failed without a PeerDown (transport error, late selection): the pair is degraded all the same.
  if (!has_link_ || !health_->degraded().empty()) return;
  if (const std::optional<std::string> why = link_failure()) {
    health_->degrade(fmt::format("the data plane to {} failed{}{}", cache_name_, why->empty() ? "" : ": ", *why),
                     false);
    spdlog::warn("{}: {}; decoding densely", self_, health_->degraded());
  }
}

void DataPlane::publish(coord::CoordinatorClient& cc, InferenceMetrics& metrics) {
  metrics.set_pair_degraded(!health_->degraded().empty());
  publish_stats(cc, metrics);
}

void DataPlane::shutdown() {
  close_sessions();
  if (engine_) engine_->set_attention_hooks(nullptr);  // the GPU controller goes before the engine
}

void DataPlane::teardown() {
  repair_.reset();
  drop_repair();
  health_->disarm();
  release();
}

// ---- The CPU data plane: UCX (or the host transport the build has) to one or N cache ranks ----

namespace {

class CpuDataPlane final : public DataPlane {
 public:
  CpuDataPlane(DataPlaneSetup setup, coord::ClientOptions& co) : DataPlane(std::move(setup)) {
    if (env_.num_cache == 0) return;
    transport::LinkOptions lo = link_options();
    lo.kind = transport::LinkKind::kUcx;
    net_ = transport::make_host_transport(lo);
    co.transport_kind = proto::TRANSPORT_UCX;
    co.transport_address = net_->local_address();
    co.layers_per_pack = static_cast<uint32_t>(opt_.sparse.layers_per_pack);  // its cache ranks' layer shards follow
  }
  ~CpuDataPlane() override { teardown(); }

  void connect(const proto::ClusterView& view, Clock::time_point deadline) override {
    if (!net_ || view.peers_size() == 0) {
      no_cache_rank();
      return;
    }
    // One link per cache rank; with N > 1 the layer packs are sharded over them (pack p to shard p mod N,
    // pair/sharded_link.h), each cache rank holding its shard's layers.
    const int layers = model_cfg_.attention_view().num_layers;
    const int packs = (layers + sparse_.layers_per_pack - 1) / sparse_.layers_per_pack;
    SPADE_CHECK(packs >= view.peers_size(),
                "{}: {} cache ranks but only {} layer packs ({} attention layers, --layers-per-pack {}): a cache rank "
                "would hold no layer; pass a smaller --layers-per-pack or start fewer cache ranks",
                self_, view.peers_size(), packs, layers, sparse_.layers_per_pack);
    std::vector<std::unique_ptr<pair::CacheRankLink>> shards;
    for (const proto::RankInfo& peer : view.peers()) {
      const std::string name = cache_rank_name(peer);
      set_stage_("connecting the data plane to " + name);
      auto ep = net_->connect(peer.transport().address(), name, deadline);
      shard_endpoints_.push_back(ep.get());
      shard_ranks_.push_back(peer.rank());
      shard_role_index_.push_back(peer.role_index());
      shard_incarnations_.push_back(peer.incarnation());
      shard_names_.push_back(name);
      shards.push_back(
          std::make_unique<pair::TransportLink>(std::move(ep), pair::pack_shape(model_cfg_, sparse_.selection)));
      cache_name_ += (cache_name_.empty() ? "" : ", ") + name;
    }
    shard_repairs_.resize(shard_ranks_.size());
    endpoint_ = shard_endpoints_.front();
    has_link_ = true;
    if (shards.size() == 1) {
      link_ = std::move(shards.front());
    } else {
      link_ = std::make_unique<pair::ShardedLink>(std::move(shards));
    }
    spdlog::info("{}: data plane to {} over {}{}", self_, cache_name_, net_->kind(),
                 shard_ranks_.size() > 1 ? fmt::format(" ({} layer shards, pack p to shard p mod {})",
                                                       shard_ranks_.size(), shard_ranks_.size())
                                         : std::string());
  }

  Engine& build_engine(std::unique_ptr<Model>& model) override {
    engine_ = std::make_unique<Engine>(
        *model, opt_.engine, [this](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
          auto b = std::make_unique<SparseAttention>(cfg, kv, sparse_, std::move(link_));
          backend_ = b.get();
          return b;
        });
    return *engine_;
  }

  std::string transport_name() const override { return net_ ? net_->kind() : std::string("none"); }

  void set_request_options(uint64_t engine_id, const IntakeRequest& r) override {
    if (backend_ && r.has_sparse_options())
      backend_->set_request_options(engine_id, r.force_dense, r.sparse_threshold, r.token_budget);
  }

 protected:
  void arm_health() override { health_->arm(shard_endpoints_, nullptr); }
  bool predicted() const override {
    return backend_ != nullptr && backend_->options().mode == SelectionMode::Predicted;
  }

  // Layer shards (N > 1): only the replaced shard s is re-paired. The replacement must be shard s's cache rank (its
  // RankInfo's role, role index and shard; the coordinator routes cache #c to inference #(c / N) as shard c mod N);
  // it is offered the data plane, connected and probed (pair::probe_shard) on a thread of its own, and
  // finish_shard_repairs() swaps it into the sharded link between two steps.
  bool replace_shard(const proto::PeerReplaced& pr, const std::string& name, coord::CoordinatorClient& cc) override {
    if (shard_ranks_.size() <= 1) return false;
    const proto::RankInfo& peer = pr.peer();
    const int s = shard_of_rank(peer.rank());
    const int n = static_cast<int>(shard_ranks_.size());
    const size_t si = static_cast<size_t>(s);
    if (peer.incarnation() <= shard_incarnations_[si]) {
      spdlog::warn("{}: ignoring a replacement of {} with incarnation {} (layer shard {}'s is {})", self_, name,
                   peer.incarnation(), s, shard_incarnations_[si]);
      return true;
    }
    const ModelConfig attn = model_cfg_.attention_view();
    const pair::ShardClaim claim{peer.role() == proto::CACHE, peer.rank(), peer.role_index(), peer.shard()};
    if (std::string why = pair::shard_claim_error(claim, name, s, n, shard_role_index_[si], attn.num_layers,
                                                  sparse_.layers_per_pack);
        !why.empty()) {
      health_->degrade(why, true, true, s);
      spdlog::error("{}: {}", self_, why);
      return true;
    }
    health_->degrade(fmt::format("{} (layer shard {} of {}) was replaced (previous incarnation: {}); re-pairing the "
                                 "shard",
                                 name, s, n, pr.previous_reason()),
                     true, true, s);
    if (!predicted()) {
      spdlog::info("{}: {} replaced; this rank decodes densely (--selection {}), nothing to re-pair", self_, name,
                   selection_mode_name(sparse_.mode));
      return true;
    }
    if (shard_repairs_[si]) parked_shards_.push_back(std::move(shard_repairs_[si]->link));  // superseded
    shard_repairs_[si].reset();
    proto::PairOffer po;
    po.set_peer_rank(peer.rank());
    po.set_peer_incarnation(peer.incarnation());
    po.mutable_transport()->set_kind(proto::TRANSPORT_UCX);
    po.mutable_transport()->set_address(net_->local_address());
    try {
      cc.send_pair_offer(po);
    } catch (const std::exception& e) {
      health_->degrade(fmt::format("re-pairing {} as layer shard {} of {} failed: {}", name, s, n, e.what()), false,
                       true);
      spdlog::error("{}: {}; decoding densely", self_, health_->degraded());
      return true;
    }
    // Connect, then probe: the replacement must answer for shard s's layers before it is swapped in; a refused one
    // is told to end its session.
    transport::Transport* t = net_.get();
    const std::string addr = peer.transport().address();
    const auto deadline = Clock::now() + opt_.rendezvous_timeout;
    const pair::PackShape shape = pair::pack_shape(model_cfg_, sparse_.selection);
    const int lpp = sparse_.layers_per_pack;
    shard_repairs_[si] = ShardRepair{
        peer, name, std::async(std::launch::async, [t, addr, name, deadline, shape, attn, s, n, lpp] {
          std::unique_ptr<transport::Endpoint> ep = t->connect(addr, name, deadline);
          ShardLink r;
          r.endpoint = ep.get();
          auto link = std::make_unique<pair::TransportLink>(std::move(ep), shape);
          try {
            pair::probe_shard(*link, s, n, attn, lpp, deadline);
          } catch (...) {
            link->shutdown();
            throw;
          }
          r.link = std::move(link);
          return r;
        })};
    spdlog::info("{}: {} replaced layer shard {} of {} (incarnation {}); offered the data plane, connecting", self_,
                 name, s, n, peer.incarnation());
    return true;
  }

  void finish_shard_repairs(const RequestTable& requests) override {
    for (size_t si = 0; si < shard_repairs_.size(); ++si) {
      std::optional<ShardRepair>& rp = shard_repairs_[si];
      if (!rp || rp->link.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
      ShardRepair r = std::move(*rp);
      rp.reset();
      swap_in_shard(static_cast<int>(si), r, requests);
    }
  }

  void start_repair(const proto::RankInfo& peer, const std::string& name, proto::PairOffer& offer,
                    Clock::time_point deadline, coord::CoordinatorClient& cc) override {
    repair_endpoint_ = offer_and_connect(peer, name, offer, deadline, cc);
  }

  bool repair_ready() override {
    return repair_endpoint_.valid() && repair_endpoint_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  void swap_in(const proto::RankInfo& peer, const RequestTable& requests) override {
    std::unique_ptr<transport::Endpoint> ep = repair_endpoint_.get();
    check_not_declared_dead(peer.incarnation());
    transport::Endpoint* raw = ep.get();
    health_->rearm(nullptr, nullptr);  // the old link goes with replace_link
    if (const pair::CacheRankLink* old = backend_->link()) add_link_stats(retired_link_stats_, old->stats());
    backend_->replace_link(
        std::make_unique<pair::TransportLink>(std::move(ep), pair::pack_shape(model_cfg_, sparse_.selection)));
    requests.for_each_sample([this](uint64_t eid, int threshold, int budget) {
      backend_->set_request_options(eid, true, threshold, budget);
    });
    endpoint_ = raw;
    health_->restore(endpoint_, nullptr);
  }

  void drop_repair() override { repair_endpoint_ = {}; }

  void path_limits(IntakeLimits& limits) const override {
    limits.on_gpu = false;
    limits.rank_token_budget = backend_ ? backend_->options().selection.token_budget : sparse_.selection.token_budget;
    limits.cpu_backend = backend_ != nullptr;
  }

  void idle_flush() override {
    if (backend_ && engine_->idle() && backend_->pending_releases() > 0) backend_->idle_flush();
  }

  std::optional<std::string> link_failure() override {
    if (backend_ == nullptr) return std::nullopt;
    const pair::CacheRankLink* link = backend_->link();
    if (!backend_->link_failed() && (link == nullptr || link->failure().empty())) return std::nullopt;
    std::string why = link != nullptr ? link->failure() : "";
    if (why.empty()) why = endpoint_->failure();
    return why;
  }

  void publish_stats(coord::CoordinatorClient& cc, InferenceMetrics& metrics) override {
    if (!backend_) {
      metrics.update(engine_->stats(), nullptr, nullptr);
      return;
    }
    const SparseStats& s = backend_->stats();
    cc.set_stat("sparse_seq_steps", static_cast<double>(s.sparse_seq_steps));
    cc.set_stat("selection_stalls", static_cast<double>(s.stalls));
    cc.set_stat("dense_fallbacks", static_cast<double>(s.dense_fallbacks));
    pair::LinkStats ls = retired_link_stats_;  // every link of the pair so far
    if (backend_->link()) add_link_stats(ls, backend_->link()->stats());
    metrics.update(engine_->stats(), &backend_->stats(), backend_->link() ? &ls : nullptr);
  }

  void close_sessions() override {
    if (!backend_) return;
    const SparseStats& s = backend_->stats();
    spdlog::info("{}: {} steps, {} sparse sequence-steps, {} stalls ({:.1f} ms), {} failed, {} dense fallbacks", self_,
                 s.steps, s.sparse_seq_steps, s.stalls, s.stall_ms, s.failed_seqs, s.dense_fallbacks);
    if (auto* l = dynamic_cast<pair::TransportLink*>(backend_->link())) l->shutdown();
    if (auto* sl = dynamic_cast<pair::ShardedLink*>(backend_->link()))  // every shard's cache rank ends its session
      for (int i = 0; i < sl->num_shards(); ++i)
        if (auto* l = dynamic_cast<pair::TransportLink*>(&sl->shard(i))) l->shutdown();
  }

  void release() override {
    shard_repairs_.clear();  // waits for their connects (each ends at its deadline)
    parked_shards_.clear();
    backend_ = nullptr;
    engine_.reset();  // the backend and its link(s) with it
    link_.reset();
    shard_endpoints_.clear();
    endpoint_ = nullptr;
  }

 private:
  // A replacement shard's link, connected and probed (its endpoint is owned by the link).
  struct ShardLink {
    std::unique_ptr<pair::CacheRankLink> link;
    transport::Endpoint* endpoint = nullptr;
  };
  struct ShardRepair {
    proto::RankInfo peer;
    std::string name;
    std::future<ShardLink> link;
  };

  // Swaps the connected replacement of shard `s` into the sharded link (pair::ShardedLink::replaced); the samples of
  // `requests` stay dense to their end. The pair is whole again unless another shard is down or re-pairing.
  void swap_in_shard(int s, ShardRepair& r, const RequestTable& requests) {
    const size_t si = static_cast<size_t>(s);
    const int n = static_cast<int>(shard_ranks_.size());
    try {
      ShardLink got = r.link.get();  // the connect's or the probe's error
      check_not_declared_dead(r.peer.incarnation(), s);
      auto* old = dynamic_cast<pair::ShardedLink*>(backend_->link());
      SPADE_CHECK(old != nullptr, "the link to the layer shards is gone");
      std::vector<transport::Endpoint*> eps = shard_endpoints_;
      eps[si] = nullptr;
      health_->rearm(eps, nullptr);  // shard s's old endpoint goes with replaced()
      shard_endpoints_[si] = nullptr;
      const pair::LinkStats retired = old->shard(s).stats();
      std::unique_ptr<pair::ShardedLink> next =
          old->replaced(s, std::move(got.link), Clock::now() + opt_.sparse.selection_deadline);
      add_link_stats(retired_link_stats_, retired);
      pair::ShardedLink* now = next.get();
      backend_->replace_link(std::move(next));
      requests.for_each_sample([this](uint64_t eid, int threshold, int budget) {
        backend_->set_request_options(eid, true, threshold, budget);
      });
      shard_endpoints_[si] = got.endpoint;
      endpoint_ = shard_endpoints_.front();
      shard_incarnations_[si] = r.peer.incarnation();
      shard_names_[si] = r.name;
      cache_name_.clear();
      for (const std::string& nm : shard_names_) cache_name_ += (cache_name_.empty() ? "" : ", ") + nm;
      std::string other;  // a shard still down or re-pairing keeps the pair dense
      for (int t = 0; t < n && other.empty(); ++t) {
        if (t == s) continue;
        if (shard_repairs_[static_cast<size_t>(t)])
          other = fmt::format("layer shard {} ({}) is re-pairing", t, shard_repairs_[static_cast<size_t>(t)]->name);
        else if (std::string f = now->shard(t).failure(); !f.empty())
          other = fmt::format("layer shard {} is down: {}", t, f);
      }
      if (other.empty()) {
        health_->restore(shard_endpoints_, nullptr);
        spdlog::info("{}: the pair is whole again: {} (incarnation {}) re-paired as layer shard {} of {} (layers {}); "
                     "new requests decode sparsely over all {} shards",
                     self_, r.name, r.peer.incarnation(), s, n,
                     pair::layer_list(pair::shard_layers(s, n, model_cfg_.attention_view().num_layers,
                                                         sparse_.layers_per_pack)),
                     n);
      } else {
        health_->rearm(shard_endpoints_, nullptr);
        health_->degrade(fmt::format("{} re-paired as layer shard {} of {}, but {}", r.name, s, n, other), false, true);
        spdlog::warn("{}: {}; decoding densely", self_, health_->degraded());
      }
    } catch (const std::exception& e) {
      health_->rearm(shard_endpoints_, nullptr);
      health_->degrade(fmt::format("re-pairing {} as layer shard {} of {} failed: {}", r.name, s, n, e.what()), false,
                       true);
      spdlog::error("{}: {}; decoding densely", self_, health_->degraded());
    }
  }

  static void add_link_stats(pair::LinkStats& into, const pair::LinkStats& s) {
    into.bytes_sent += s.bytes_sent;
    into.bytes_received += s.bytes_received;
    into.updates += s.updates;
    into.cache_select_ms += s.cache_select_ms;
  }

  // Offers `peer` this rank's host address (`po` with the peer's rank and incarnation set) and connects to it on a
  // thread of its own, by `deadline`.
  std::future<std::unique_ptr<transport::Endpoint>> offer_and_connect(const proto::RankInfo& peer,
                                                                      const std::string& name, proto::PairOffer& po,
                                                                      Clock::time_point deadline,
                                                                      coord::CoordinatorClient& cc) {
    po.mutable_transport()->set_kind(proto::TRANSPORT_UCX);
    po.mutable_transport()->set_address(net_->local_address());
    cc.send_pair_offer(po);
    transport::Transport* t = net_.get();
    const std::string addr = peer.transport().address();
    return std::async(std::launch::async, [t, addr, name, deadline] { return t->connect(addr, name, deadline); });
  }

  std::unique_ptr<transport::Transport> net_;          // null without a cache rank
  std::unique_ptr<pair::CacheRankLink> link_;          // until the engine's backend takes it
  SparseAttention* backend_ = nullptr;                 // owned by the engine
  transport::Endpoint* endpoint_ = nullptr;            // shard 0's, or the re-paired link's (owned by the link)
  std::vector<transport::Endpoint*> shard_endpoints_;  // one per cache rank, in shard order
  pair::LinkStats retired_link_stats_;                 // of the links a re-pairing replaced
  std::future<std::unique_ptr<transport::Endpoint>> repair_endpoint_;
  // Layer shards, per shard: the cache rank's role index, incarnation and name; a re-pairing under way.
  std::vector<uint32_t> shard_role_index_;
  std::vector<uint32_t> shard_incarnations_;
  std::vector<std::string> shard_names_;
  std::vector<std::optional<ShardRepair>> shard_repairs_;
  std::vector<std::future<ShardLink>> parked_shards_;  // superseded re-pairings (each ends at its deadline)
};

}  // namespace

std::unique_ptr<DataPlane> make_data_plane(DataPlaneSetup setup, coord::ClientOptions& co) {
  co.device = "cpu";
  if (setup.opt.device != "cuda") return std::make_unique<CpuDataPlane>(std::move(setup), co);
#ifdef SPADE_HAVE_GPU_PATH
  return make_gpu_data_plane(std::move(setup), co);
#else
  fail("{}: --device cuda: this build has no CUDA", setup.self);
#endif
}

}  // namespace spade
