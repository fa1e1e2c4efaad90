// The cache_rank binary's --device cpu serving loop (rank_serve.h serve_cpu): the CPU selector over UCX, its metrics,
// and the wait for a replacement of a dead inference rank.
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "cache_rank/pack_server.h"
#include "cache_rank/rank_serve.h"
#include "pair/link.h"
#include "transport/link_factory.h"

namespace spade::cache_rank_cli {
namespace {

// The paired inference rank as the control plane reports it, shared with the coordinator client's callback (its I/O
// thread may outlive the serving scope): down (PeerDown: the session ends), replaced (PeerReplaced: a new incarnation
// to serve, its address in the RankInfo), or the world over (Shutdown, coordinator lost: *stop and the exit code).
struct PeerWatch {
  uint32_t peer_rank = 0;
  std::string self;
  std::atomic<bool>* stop = nullptr;  // the process's stop (Rank::stop)
  std::atomic<bool> down{false};
  std::atomic<int> exit_code{0};
  std::mutex mu;
  std::optional<spade::proto::RankInfo> replacement;

  /// From the callback. Returns true for a PeerDown of the paired inference rank.
  bool on_event(const spade::coord::ClientEvent& ev) {
    using Kind = spade::coord::ClientEvent::Kind;
    if (ev.kind == Kind::kPeerDown && ev.peer_down.rank() != peer_rank) return false;
    if (ev.kind == Kind::kPeerReplaced && ev.peer_replaced.peer().rank() != peer_rank) return false;
    spdlog::info("{}: {}", self, ev.message);
    if (ev.kind == Kind::kPeerReplaced) {
      std::lock_guard<std::mutex> lk(mu);
      replacement = ev.peer_replaced.peer();
      down = true;  // a replacement also ends a session still open with the previous incarnation
      return false;
    }
    if (ev.kind == Kind::kPeerDown) {
      down = true;
      return true;
    }
    exit_code = ev.kind == Kind::kShutdown && !ev.shutdown.is_error() ? 0 : 1;
    *stop = true;
    return false;
  }
  /// Waits up to `timeout` for the inference rank's replacement, ticking `heartbeat`; nullopt at the timeout or on a
  /// stop. Clears `down` when one came.
  std::optional<spade::proto::RankInfo> wait_replacement(std::chrono::milliseconds timeout,
                                                         spade::LoopHeartbeat& heartbeat) {
    for (auto until = spade::coord::Clock::now() + timeout; !*stop && spade::coord::Clock::now() < until;) {
      heartbeat.tick();
      {
        std::lock_guard<std::mutex> lk(mu);
        if (replacement) {
          std::optional<spade::proto::RankInfo> r = std::move(replacement);
          replacement.reset();
          down = false;
          return r;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::nullopt;
  }
};

}  // namespace

int serve_cpu(const Flags& f, const Rank& r) {
  const spade::ModelConfig& cfg = r.cfg;
  const std::string& self = r.self;
  spade::metrics::Registry& registry = r.registry;
  spade::LoopHeartbeat& heartbeat = r.heartbeat;
  std::atomic<bool>& connected = r.connected;
  std::atomic<bool>& stop = r.stop;
  spade::transport::LinkOptions lo;
  lo.kind = spade::transport::LinkKind::kUcx;
  lo.name = self;
  auto net = spade::transport::make_host_transport(lo);  // throws, naming UCX, in a build without it
  spade::coord::ClientOptions co = spade::coord::client_options_for(r.env);
  co.device = "cpu";
  co.transport_kind = spade::proto::TRANSPORT_UCX;
  co.transport_address = net->local_address();
  spade::coord::CoordinatorClient cc(co);
  const auto deadline = spade::coord::Clock::now() + std::chrono::milliseconds(f.rendezvous_ms);
  const Paired paired = rendezvous_with_inference(cc, deadline, self);
  spade::proto::RankInfo peer = paired.view.peers(0);
  std::string peer_name = paired.peer_name;
  Shard shard = shard_for(paired.view, peer, cfg, f.kv_pages, self, peer_name);
  // Control-plane events: a PeerDown ends the session with the inference rank (the rank then waits for its
  // replacement), a Shutdown or the coordinator's loss stops the rank. Shared: the callback may still run on the
  // client's I/O thread while this scope unwinds.
  auto watch = std::make_shared<PeerWatch>();
  watch->peer_rank = peer.rank();
  watch->self = self;
  watch->stop = &stop;
  cc.set_event_callback([watch](const spade::coord::ClientEvent& ev) { (void)watch->on_event(ev); });
  std::unique_ptr<spade::transport::Endpoint> ep = net->connect(peer.transport().address(), peer_name, deadline);
  auto& select_time = registry
                          .histogram("spade_selection_time_seconds",
                                     "Cache-rank time per layer-pack update (append, predict, score, top-k, gather).",
                                     spade::metrics::exponential_buckets(0.0001, 2, 18))
                          .with();
  auto& overlap = overlap_ratio_histogram(registry);
  auto& bytes = registry.counter("spade_transfer_bytes_total", "Data-plane bytes moved, by direction and transport.",
                                 {"direction", "transport"});
  auto& bytes_in = bytes.with({"recv", net->kind()});
  auto& bytes_out = bytes.with({"send", net->kind()});
  auto& updates = registry.counter("spade_cache_pack_updates_total", "Layer-pack updates answered.").with();
  auto& errors = registry.counter("spade_cache_selection_errors_total",
                                  "Updates answered with an error (e.g. KV pool exhausted).")
                     .with();
  auto& selected = registry.counter("spade_selected_tokens_total",
                                    "Tokens selected (summed over sequences, layers and KV heads).")
                       .with();
  auto& sent = registry.counter("spade_sent_tokens_total",
                                "Selected tokens whose K/V were sent: only those that entered the selection with "
                                "delta transfer, all of them without.")
                   .with();
  std::unique_ptr<spade::cache::Selector> sel;  // one per session: a replacement starts with a fresh pool
  std::unique_ptr<spade::pair::SelectionMirror> mirror;
  spade::pair::DeltaStats seen;
  CachePoolGauges pool = cache_pool_gauges(registry);
  auto& shard_gauge = registry
                          .gauge("spade_cache_shard_layers",
                                  "Layers whose KV this cache rank holds, labelled with its shard among the num_shards "
                                  "cache ranks of its inference rank.",
                                  {"shard", "num_shards"})
                           .with({std::to_string(shard.index), std::to_string(shard.count)});
  std::unique_ptr<spade::cache::OverlapSampler> sampler;
  if (f.sparse.overlap_sample_every > 0)
    sampler = std::make_unique<spade::cache::OverlapSampler>(f.sparse.overlap_sample_every);
  spade::cache::ServeHooks hooks;
  hooks.sampler = sampler.get();
  std::atomic<bool> session_stop{false};  // serve_cache_rank's stop: the world's stop, or the peer is down
  hooks.on_poll = [&] {
    heartbeat.tick();
    if (stop || watch->down) session_stop = true;
  };
  hooks.on_pack = [&](const spade::pair::PackUpdate&, const spade::pair::PackSelection& p, size_t in, size_t out) {
    select_time.observe(p.select_ms / 1e3);
    bytes_in.inc(static_cast<double>(in));
    bytes_out.inc(static_cast<double>(out));
    updates.inc();
    if (!p.error.empty()) errors.inc();
    if (mirror) {
      const spade::pair::DeltaStats& now = mirror->stats();
      selected.inc(static_cast<double>(now.selected_rows - seen.selected_rows));
      sent.inc(static_cast<double>(now.sent_rows - seen.sent_rows));
      seen = now;
    } else {
      for (const auto& s : p.seqs)
        for (const auto& l : s.layers) {
          const double rows = static_cast<double>(l.count) * cfg.num_kv_heads;  // count per KV head x KV heads
          selected.inc(rows);
          sent.inc(rows);
        }
    }
    pool.set(static_cast<double>(sel->num_sequences() - sel->num_retained()), static_cast<double>(sel->num_retained()),
             static_cast<double>(sel->num_used_pages()), static_cast<double>(sel->num_pages()));
    if (sampler)
      for (double ratio : sampler->take()) overlap.observe(ratio);
  };
  // One session per incarnation of the inference rank: when it dies, its sequences' KV is dropped with the
  // session's Selector and the rank waits (--rejoin-timeout-ms) for a replacement to register.
  for (;;) {
    sel = std::make_unique<spade::cache::Selector>(cfg, f.sparse.selection, shard.pages, f.page_size, shard.layers);
    shard_gauge.set(static_cast<double>(shard.layers.empty() ? static_cast<size_t>(cfg.num_layers)
                                                             : shard.layers.size()));
    mirror.reset();
    if (f.sparse.delta_transfer)
      mirror = std::make_unique<spade::pair::SelectionMirror>(cfg.num_kv_heads, f.sparse.selection.token_budget,
                                                              cfg.head_dim);
    seen = {};
    hooks.mirror = mirror.get();
    spdlog::info("{}: serving {} ({} pages x {} tokens, budget {}, window W={}, eps={}){}", self, peer_name,
                 shard.pages, f.page_size, f.sparse.selection.token_budget, f.sparse.selection.query_window,
                 f.sparse.selection.ridge_eps,
                 shard.count == 1 ? std::string()
                                  : fmt::format(", shard {} of {}: {} of {} layers", shard.index, shard.count,
                                                shard.layers.size(), cfg.num_layers));
    pool.clear();
    session_stop = stop || watch->down;
    connected = true;
    spade::pair::LinkStats stats;
    const std::string err =
        spade::cache::serve_cache_rank(*ep, *sel, spade::pair::pack_shape(cfg, f.sparse.selection), session_stop,
                                       &stats, std::chrono::milliseconds(100), hooks);
    connected = false;
    spdlog::info("{}: {} updates, {:.1f} MB in, {:.1f} MB out, {:.1f} ms selecting", self, stats.updates,
                 stats.bytes_received / 1e6, stats.bytes_sent / 1e6, stats.cache_select_ms);
    if (mirror && mirror->stats().selected_rows > 0)
      spdlog::info("{}: delta transfer sent {} of {} selected rows ({:.1f} % of a full transfer)", self,
                   mirror->stats().sent_rows, mirror->stats().selected_rows,
                   100.0 * static_cast<double>(mirror->stats().sent_rows) / mirror->stats().selected_rows);
    if (stop) return watch->exit_code.load();
    if (!err.empty()) {
      spdlog::error("{}: data plane to {} failed: {}", self, peer_name, err);
    } else if (!watch->down) {
      // A clean end of the link (the inference rank said shutdown): wait for the world's shutdown briefly, or for
      // the coordinator to report the inference rank gone (then wait for its replacement).
      for (int i = 0; i < 50 && !stop && !watch->down; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (stop || !watch->down) return watch->exit_code.load();
    }
    // The inference rank is gone: its sequences' KV goes with this session; serve its replacement.
    ep->abort(fmt::format("{} is gone", peer_name));
    ep.reset();
    sel.reset();
    pool.clear();
    spdlog::warn("{}: {} is gone; its KV is dropped; waiting up to {} ms for its replacement", self, peer_name,
                 f.rejoin_timeout_ms);
    std::optional<spade::proto::RankInfo> next;
    while (!ep) {
      next = watch->wait_replacement(std::chrono::milliseconds(f.rejoin_timeout_ms), heartbeat);
      if (stop) return watch->exit_code.load();
      if (!next) {
        spdlog::error("{}: no replacement of {} registered within {} ms (--rejoin-timeout-ms); exiting", self,
                      peer_name, f.rejoin_timeout_ms);
        return 1;
      }
      peer = *next;
      peer_name = inference_name(peer);
      try {  // the replacement's --layers-per-pack decides the shard's layers
        shard = shard_for(paired.view, peer, cfg, f.kv_pages, self, peer_name);
      } catch (const std::exception& e) {
        spdlog::error("{}: {}; exiting", self, e.what());
        return 1;
      }
      try {
        ep = net->connect(peer.transport().address(), peer_name,
                          spade::coord::Clock::now() + std::chrono::milliseconds(f.rendezvous_ms));
        spdlog::info("{}: re-paired with {} (incarnation {})", self, peer_name, peer.incarnation());
      } catch (const std::exception& e) {
        spdlog::error("{}: connecting to the replacement {} failed: {}; waiting for another", self, peer_name,
                      e.what());
      }
    }
  }
}

}  // namespace spade::cache_rank_cli
