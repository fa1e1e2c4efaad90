// cache_rank: the daemon that holds the full KV cache of its paired inference rank's sparse sequences and sends
// back, one step ahead, the tokens each layer and KV head should attend to (AsyncSpade Sec. 4.1-4.2).
//
//   cache_rank --model DIR [--token-budget K --local-window R --sink-tokens S --query-window W --ridge-eps E
//               --gqa-rule max|mean --predictor P --successor-expand B --kv-pages N --page-size 16
//               --overlap-sample-every N --delta-transfer true|false]
//              [--metrics-port P] [launch flags | RANK/WORLD_SIZE/MASTER_* | OMPI_*]
//   cache_rank --model DIR --device cuda [--gpu N --query-window W --ridge-eps E --gqa-rule R --predictor P
//              --successor-expand B --hello-timeout-ms T --selection-streams 1|3] [launch flags]
//              (the GPU cache rank, cache_rank/gpu_server.h: the budget, local window, pack size, delta capacity and
//              pool size come from the paired inference rank's hello; metrics: transfer bytes, steps, selections)
// A flag that the device would ignore (--token-budget with --device cuda, --gpu with --device cpu, ...) is refused
// by name at start-up (refuse_unused_flags below); the selection flags are the pair's (pair/selection_flags.h).
//
// Metrics (--metrics-port, GET /metrics; /health = serving loop alive, /ready = paired inference rank connected):
//   spade_selection_time_seconds          histogram  cache-rank time per layer-pack update (append+predict+score+top-k+gather)
//   spade_selection_overlap_ratio         histogram  sampled |predicted top-k ∩ oracle top-k| / k (AsyncSpade Eq. 1)
//   spade_transfer_bytes_total{direction,transport}  counter  data-plane bytes, direction send|recv
//   spade_cache_pack_updates_total        counter    updates answered
//   spade_selected_tokens_total           counter    tokens selected (over sequences, layers, KV heads)
//   spade_sent_tokens_total               counter    selected tokens whose K/V were sent: all of them with
//                                                    --delta-transfer off, only those that entered the selection with on
//   spade_cache_selection_errors_total    counter    updates answered with an error (e.g. pool exhausted)
//   spade_cache_sequences                 gauge      sequences whose KV this rank holds
//   spade_cache_kv_usage_perc             gauge      0..1, used fraction of the KV pool
//   spade_cache_kv_pages_used             gauge      KV pages held (a page that sequences share counts once)
//   spade_cache_shard_layers{shard,num_shards}  gauge  layers held: all of them, or its shard's when the inference
//                                                    rank has N > 1 cache ranks (docs/ARCHITECTURE.md, "Sharding")
//
// The model directory is read for config.json only (shapes); the selection flags must match the inference rank's.
// Exits 0 when the coordinator shuts the world down, 1 when the coordinator is lost. When its inference rank dies, the
// CPU cache rank drops that rank's sequences (a fresh Selector per incarnation) and serves its replacement (same index,
// PeerReplaced from the coordinator), or exits 1 after --rejoin-timeout-ms without one; the GPU cache rank exits 1
// (its own restart re-pairs with the replacement).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <mutex>
#include <optional>
#include <thread>

#include "cache_rank/pack_server.h"
#include "pair/link.h"
#include "pair/sharded_link.h"
#include "pair/selection_flags.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_endpoint.h"
#include "coordinator/client.h"
#include "transport/link_factory.h"
#ifdef SPADE_HAVE_GPU_CACHE
#include <cuda_runtime_api.h>

#include "cache_rank/gpu_server.h"
#include "kernels/device.h"
#endif

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

// The world after the rendezvous, and the inference rank this cache rank serves (named for errors and logs).
struct Paired {
  spade::proto::ClusterView view;
  std::string peer_name;
};
// Refuses, by name, every flag the user gave that `device` would ignore, before anything is loaded or connected
// (CPU-only builds refuse the GPU device's flags the same way: tests/cache_rank/test_rank_flags.cpp). Throws
// spade::Error naming each one.
void refuse_unused_flags(const CLI::App& app, const std::string& device) {
  if (device != "cpu" && device != "cuda") spade::fail("--device must be cpu or cuda, got '{}'", device);
  spade::pair::FlagRefusals r(app);
  if (device == "cpu") {
    r.refuse("--device cpu", {"--gpu", "--hello-timeout-ms", "--selection-streams", "--score-keys"},
             "it configures the GPU cache rank");
  } else {
    r.refuse("--device cuda", {"--token-budget", "--local-window", "--kv-pages", "--page-size"},
             "the GPU cache rank takes the budget, the local window, the page size and its pool from the inference "
             "rank's pair hello");
    r.refuse("--device cuda", {"--sink-tokens"},
             "the GPU pair attends no sink tokens of its own: they compete in the top-k");
    r.refuse("--device cuda", {"--anchor-queries", "--anchor-span"},
             "the GPU cache rank has no prompt anchors yet (the CPU cache rank's; docs/FIDELITY.md)");
    r.refuse("--device cuda", {"--delta-transfer"},
             "the GPU pair always sends deltas, of the inference rank's --delta-capacity");
    r.refuse("--device cuda", {"--overlap-sample-every"}, "the GPU cache rank does not sample the overlap ratio");
    r.refuse("--device cuda", {"--rejoin-timeout-ms"},
             "the GPU cache rank exits when its inference rank dies (its own restart re-pairs with the replacement)");
  }
  r.check();
}

// The paired inference rank as the control plane reports it, shared with the coordinator client's callback (its I/O
// thread may outlive the serving scope): down (PeerDown: the session ends), replaced (PeerReplaced: a new incarnation
// to serve, its address in the RankInfo), or the world over (Shutdown, coordinator lost: g_stop and the exit code).
struct PeerWatch {
  uint32_t peer_rank = 0;
  std::string self;
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
    g_stop = true;
    return false;
  }
  /// Waits up to `timeout` for the inference rank's replacement, ticking `heartbeat`; nullopt at the timeout or on a
  /// stop. Clears `down` when one came.
  std::optional<spade::proto::RankInfo> wait_replacement(std::chrono::milliseconds timeout,
                                                         spade::LoopHeartbeat& heartbeat) {
    for (auto until = spade::coord::Clock::now() + timeout; !g_stop && spade::coord::Clock::now() < until;) {
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

std::string inference_name(const spade::proto::RankInfo& peer) {
  return fmt::format("inference rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
}

// The layers (and pool pages) this cache rank holds for inference rank `peer`: all of them (and --kv-pages) when it
// is the only cache rank of its inference rank; else its shard's (pair/sharded_link.h: the layers of the packs
// p mod N == shard, with the inference rank's --layers-per-pack), in a pool of the same memory (more pages).
struct Shard {
  uint32_t index = 0, count = 1;
  std::vector<int> layers;  // empty: every layer
  int pages = 0;
};
Shard shard_for(const spade::proto::ClusterView& view, const spade::proto::RankInfo& peer,
                const spade::ModelConfig& cfg, int kv_pages, const std::string& self, const std::string& peer_name) {
  Shard s;
  s.index = view.self().shard();
  s.count = std::max<uint32_t>(1, view.cache_ranks_per_inference());
  s.pages = kv_pages;
  if (s.count == 1) return s;
  SPADE_CHECK(peer.layers_per_pack() >= 1,
              "{}: {} registered no --layers-per-pack, and this rank is shard {} of {} of its layer packs", self,
              peer_name, s.index, s.count);
  s.layers = spade::pair::shard_layers(static_cast<int>(s.index), static_cast<int>(s.count), cfg.num_layers,
                                       static_cast<int>(peer.layers_per_pack()));
  SPADE_CHECK(!s.layers.empty(),
              "{}: shard {} of {} holds no layer: the model has {} attention layers in packs of {} (--layers-per-pack "
              "of {}), fewer packs than cache ranks; start fewer cache ranks per inference rank or pass a smaller "
              "--layers-per-pack",
              self, s.index, s.count, cfg.num_layers, peer.layers_per_pack(), peer_name);
  s.pages = spade::pair::shard_pool_pages(kv_pages, cfg.num_layers, static_cast<int>(s.layers.size()));
  return s;
}

Paired rendezvous_with_inference(spade::coord::CoordinatorClient& cc, spade::coord::Deadline deadline,
                                 const std::string& self) {
  Paired p{cc.rendezvous(deadline), {}};
  SPADE_CHECK(p.view.peers_size() > 0, "{}: the coordinator paired no inference rank with us", self);
  const spade::proto::RankInfo& peer = p.view.peers(0);
  p.peer_name = fmt::format("inference rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
  return p;
}
// Every flag of the binary, in one place (registered by add_flags, checked by refuse_unused_flags).
struct Flags {
  std::string model_dir, log_level = "info";
  spade::pair::SparseConfig sparse;  // the pair's settings (pair/selection_flags.h)
  spade::pair::SparseFlagText sparse_text;
  int kv_pages = 16384, page_size = 16, rendezvous_ms = 30000;  // --device cpu: the KV pool
  spade::coord::LaunchFlags lf;
  int metrics_port = 0, overlap_every = 16;
  std::string metrics_host = "0.0.0.0";
  std::string device = "cpu";
  int gpu_index = 0;
  int hello_timeout_ms = 600000;
  int rejoin_timeout_ms = 600000;
  int selection_streams = 3;
};

// Registers every flag on `app`, writing into `f`.
void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--model", f.model_dir, "checkpoint directory (config.json is read for the shapes)")->required();
  spade::pair::add_sparse_flags(app, f.sparse, f.sparse_text,
                                spade::pair::kSelectionFlags | spade::pair::kDeltaTransferFlag |
                                    spade::pair::kScoreKeysFlag);
  app.add_option("--kv-pages", f.kv_pages,
                 "KV pool size in pages of every layer; a layer shard (N cache ranks per inference rank) holds "
                 "fewer layers and gets as many more pages in the same memory")
      ->check(CLI::PositiveNumber);
  app.add_option("--page-size", f.page_size, "tokens per page")->check(CLI::PositiveNumber);
  spade::coord::add_launch_flags(app, f.lf);
  app.add_option("--rendezvous-timeout-ms", f.rendezvous_ms, "deadline for the whole world to register");
  app.add_option("--log-level", f.log_level, "trace|debug|info|warn|error|off");
  app.add_option("--metrics-port", f.metrics_port, "serve /metrics, /health, /ready on this port (0 = off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-host", f.metrics_host, "address of the metrics endpoint")->capture_default_str();
  app.add_option("--overlap-sample-every", f.overlap_every,
                 "measure the predicted-vs-oracle overlap ratio every N steps (0 = off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--device", f.device,
                 "cpu (the CPU selector over UCX) | cuda (the GPU server over NCCL / CUDA IPC, paired with "
                 "inference_rank --serve --device cuda; its shapes and limits come from the inference rank's hello)");
  app.add_option("--gpu", f.gpu_index, "--device cuda: the CUDA device of this rank")->check(CLI::NonNegativeNumber);
  app.add_option("--hello-timeout-ms", f.hello_timeout_ms,
                 "--device cuda: longest wait for the inference rank's pair hello (it loads its weights first)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rejoin-timeout-ms", f.rejoin_timeout_ms,
                 "--device cpu, after the paired inference rank died: longest wait for its replacement (same index) "
                 "to register, then exit 1 naming it; the replacement is served with a fresh KV pool")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--selection-streams", f.selection_streams,
                 "--device cuda: 3 pipelines the packs' selections (scoring beside the previous pack's top-k and "
                 "gather; a second set of scores in device memory), 1 runs them in order on one stream")
      ->check(CLI::IsMember({1, 3}))
      ->capture_default_str();
}

// What both serving loops share: the attention view of the model, this rank's place in the world and its status.
struct Rank {
  spade::ModelConfig cfg;  // attention layers only (hybrid models: the full-attention layers)
  spade::coord::LaunchEnv env;
  std::string self;  // "cache rank R (#i)"
  spade::metrics::Registry& registry;
  spade::LoopHeartbeat& heartbeat;
  std::atomic<bool>& connected;  // /ready: paired and serving
};

// --device cuda: a GpuCacheServer over the GPU link the paired inference rank offered (NCCL or CUDA IPC), sized by
// its pair hello. Returns the exit code.
int serve_gpu(const Flags& f, const Rank& r) {
#ifdef SPADE_HAVE_GPU_CACHE
  const spade::ModelConfig& cfg = r.cfg;
  const std::string& self = r.self;
  spade::metrics::Registry& registry = r.registry;
  spade::LoopHeartbeat& heartbeat = r.heartbeat;
  std::atomic<bool>& connected = r.connected;
  // ---- the GPU cache rank: GpuCacheServer over the link the inference rank published ----
  spade::cuda_check(cudaSetDevice(f.gpu_index), "cache rank: cudaSetDevice");
  spade::coord::ClientOptions co = spade::coord::client_options_for(r.env);
  co.device = fmt::format("cuda:{}", f.gpu_index);
  spade::coord::CoordinatorClient cc(co);
  const auto deadline = spade::coord::Clock::now() + std::chrono::milliseconds(f.rendezvous_ms);
  const Paired paired = rendezvous_with_inference(cc, deadline, self);
  const spade::proto::RankInfo& peer = paired.view.peers(0);
  const std::string& peer_name = paired.peer_name;
  const auto left = [&] {
    return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - spade::coord::Clock::now()));
  };
  // The link lives as long as the control-plane callback that may abort it (the callback can still be running
  // on the client's I/O thread when this scope ends).
  struct Shared {
    std::shared_ptr<spade::transport::GpuLink> link;
    std::atomic<int> exit_code{0};
  };
  auto shared = std::make_shared<Shared>();
  const auto kind = peer.transport().kind();
  if (kind != spade::proto::TRANSPORT_CUDA_IPC && kind != spade::proto::TRANSPORT_NCCL)
    spade::fail("{}: {} offers no GPU link (transport kind {}); start it with --serve --device cuda "
                "--selection predicted, or run this cache rank with --device cpu",
                self, peer_name, spade::proto::TransportKind_Name(kind));
  // The link the inference rank offered, chosen at run time (transport/link_factory.h): CUDA IPC maps its memory
  // at once; NCCL waits for both communicators up to what is left of the rendezvous deadline (at least 1 s).
  spade::transport::LinkOptions lo;
  lo.kind = kind == spade::proto::TRANSPORT_NCCL ? spade::transport::LinkKind::kNccl
                                                 : spade::transport::LinkKind::kCudaIpc;
  lo.device = f.gpu_index;
  lo.peer_name = peer_name;
  lo.connect_timeout = std::max(std::chrono::milliseconds(1000), left());
  shared->link = spade::transport::join_gpu_link(peer.transport().address(), lo);
  spade::transport::GpuLink& link = *shared->link;
  // Control-plane events, from before the hello wait on: a dead inference rank ends it (the link is aborted).
  const uint32_t peer_rank = peer.rank();
  // The GPU cache rank serves one incarnation of its inference rank: a replacement (PeerReplaced) ends it with exit
  // code 1, and its own restart (a new incarnation) re-pairs with the replacement.
  cc.set_event_callback([shared, peer_rank, peer_name, self](const spade::coord::ClientEvent& ev) {
    if (ev.kind == spade::coord::ClientEvent::Kind::kPeerDown && ev.peer_down.rank() != peer_rank) return;
    if (ev.kind == spade::coord::ClientEvent::Kind::kPeerReplaced && ev.peer_replaced.peer().rank() != peer_rank)
      return;
    spdlog::info("{}: {}", self, ev.message);
    if (ev.kind == spade::coord::ClientEvent::Kind::kPeerDown)
      shared->link->abort(fmt::format("{} is down: {}", peer_name, ev.peer_down.reason()));
    shared->exit_code = ev.kind == spade::coord::ClientEvent::Kind::kShutdown && !ev.shutdown.is_error() ? 0 : 1;
    g_stop = true;
  });
  // The inference rank uploads its weights after the rendezvous, then sends the hello: wait that long.
  const spade::pair::GpuPairHello hello =
      spade::cache::recv_gpu_hello(link, cfg, peer_name, std::chrono::milliseconds(f.hello_timeout_ms));
  spade::cache::GpuCacheOptions gopts = spade::cache::gpu_cache_options(hello, f.sparse, f.gpu_index);
  gopts.pipeline = f.selection_streams == 3;
  spade::cache::GpuCacheServer server(cfg, gopts, link, peer_name);
  spdlog::info("{}: serving {} on GPU {} ({} MB of device memory: {} pages x {} tokens, budget {}, local window "
               "{}, delta capacity {}, {} layers per pack, {} selection stream{})",
               self, peer_name, f.gpu_index, server.device_bytes() >> 20, hello.num_pages, hello.page_size,
               hello.token_budget, hello.local_window, hello.delta_capacity, hello.layers_per_pack,
               f.selection_streams, f.selection_streams == 1 ? "" : "s");
  auto& bytes = registry.counter("spade_transfer_bytes_total",
                                 "Data-plane bytes moved, by direction and transport.", {"direction", "transport"});
  const char* tname = kind == spade::proto::TRANSPORT_NCCL ? "nccl" : "cuda_ipc";
  auto& bytes_in = bytes.with({"recv", tname});
  auto& bytes_out = bytes.with({"send", tname});
  auto& steps = registry.counter("spade_cache_steps_total", "Decode / prefill steps served (GPU cache rank).").with();
  auto& selections = registry.counter("spade_cache_selections_total",
                                      "(sequence, step) selections computed (GPU cache rank).")
                         .with();
  connected = true;
  spade::cache::GpuCacheStats seen;
  auto count = [&] {
    const spade::cache::GpuCacheStats& now = server.stats();
    bytes_in.inc(static_cast<double>(now.bytes_received - seen.bytes_received));
    bytes_out.inc(static_cast<double>(now.bytes_sent - seen.bytes_sent));
    steps.inc(static_cast<double>(now.steps - seen.steps));
    selections.inc(static_cast<double>(now.selections - seen.selections));
    seen = now;
  };
  std::string err;
  try {
    while (!g_stop) {
      heartbeat.tick();
      if (server.serve_step(std::chrono::milliseconds(100))) {
        count();
      } else if (server.closed()) {
        // The inference rank closed the stream (it is shutting down): wait for the coordinator's shutdown.
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    // Stopping: serve what the inference rank still sends until its close plan, for a bounded time.
    for (auto until = spade::coord::Clock::now() + std::chrono::seconds(2);
         !server.closed() && !link.failed() && spade::coord::Clock::now() < until;)
      if (server.serve_step(std::chrono::milliseconds(100))) count();
  } catch (const std::exception& e) {
    err = e.what();
  }
  // Nothing may stay pending when the server frees its memory (cudaFree would wait for the receive forever).
  if (!server.closed()) link.abort(fmt::format("{} is shutting down", self));
  const spade::cache::GpuCacheStats& st = server.stats();
  spdlog::info("{}: {} steps, {} selections ({} first), {:.1f} MB in, {:.1f} MB out", self, st.steps,
               st.selections, st.first_selections, st.bytes_received / 1e6, st.bytes_sent / 1e6);
  if (!err.empty()) {
    spdlog::error("{}: GPU data plane to {} failed: {}", self, peer_name, err);
    return g_stop ? shared->exit_code.load() : 1;
  }
  return shared->exit_code.load();
#else
  (void)f;
  spade::fail("{}: --device cuda: this build has no GPU cache rank (configure with CUDA)", r.self);
#endif
}

// --device cpu: the CPU selector (cache::Selector) serving the paired inference rank's layer packs over UCX.
// Returns the exit code.
int serve_cpu(const Flags& f, const Rank& r) {
  const spade::ModelConfig& cfg = r.cfg;
  const std::string& self = r.self;
  spade::metrics::Registry& registry = r.registry;
  spade::LoopHeartbeat& heartbeat = r.heartbeat;
  std::atomic<bool>& connected = r.connected;
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
  cc.set_event_callback([watch](const spade::coord::ClientEvent& ev) { (void)watch->on_event(ev); });
  std::unique_ptr<spade::transport::Endpoint> ep = net->connect(peer.transport().address(), peer_name, deadline);
  auto& select_time = registry
                          .histogram("spade_selection_time_seconds",
                                     "Cache-rank time per layer-pack update (append, predict, score, top-k, gather).",
                                     spade::metrics::exponential_buckets(0.0001, 2, 18))
                          .with();
  auto& overlap = registry
                      .histogram("spade_selection_overlap_ratio",
                                 "Sampled overlap of the predicted top-k with the true-query top-k (AsyncSpade Eq. 1).",
                                 spade::metrics::linear_buckets(0.1, 0.1, 10))
                      .with();
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
  auto& seqs = registry.gauge("spade_cache_sequences", "Sequences whose KV this cache rank holds.").with();
  auto& shard_gauge = registry
                          .gauge("spade_cache_shard_layers",
                                  "Layers whose KV this cache rank holds, labelled with its shard among the num_shards "
                                  "cache ranks of its inference rank.",
                                  {"shard", "num_shards"})
                           .with({std::to_string(shard.index), std::to_string(shard.count)});
  auto& kv_usage = registry.gauge("spade_cache_kv_usage_perc", "Used fraction of the cache rank's KV pool (0..1).").with();
  auto& kv_pages = registry
                       .gauge("spade_cache_kv_pages_used",
                              "KV pages this cache rank holds (a page its sequences share counts once).")
                       .with();
  std::unique_ptr<spade::cache::OverlapSampler> sampler;
  if (f.overlap_every > 0) sampler = std::make_unique<spade::cache::OverlapSampler>(f.overlap_every);
  spade::cache::ServeHooks hooks;
  hooks.sampler = sampler.get();
  std::atomic<bool> session_stop{false};  // serve_cache_rank's stop: the world's stop, or the peer is down
  hooks.on_poll = [&] {
    heartbeat.tick();
    if (g_stop || watch->down) session_stop = true;
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
    seqs.set(static_cast<double>(sel->num_sequences()));
    kv_usage.set(1.0 - static_cast<double>(sel->num_free_pages()) / sel->num_pages());
    kv_pages.set(static_cast<double>(sel->num_used_pages()));
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
    kv_usage.set(0);
    kv_pages.set(0);
    seqs.set(0);
    session_stop = g_stop || watch->down;
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
    if (g_stop) return watch->exit_code.load();
    if (!err.empty()) {
      spdlog::error("{}: data plane to {} failed: {}", self, peer_name, err);
    } else if (!watch->down) {
      // A clean end of the link (the inference rank said shutdown): wait for the world's shutdown briefly, or for
      // the coordinator to report the inference rank gone (then wait for its replacement).
      for (int i = 0; i < 50 && !g_stop && !watch->down; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (g_stop || !watch->down) return watch->exit_code.load();
    }
    // The inference rank is gone: its sequences' KV goes with this session; serve its replacement.
    ep->abort(fmt::format("{} is gone", peer_name));
    ep.reset();
    sel.reset();
    kv_usage.set(0);
    kv_pages.set(0);
    seqs.set(0);
    spdlog::warn("{}: {} is gone; its KV is dropped; waiting up to {} ms for its replacement", self, peer_name,
                 f.rejoin_timeout_ms);
    std::optional<spade::proto::RankInfo> next;
    while (!ep) {
      next = watch->wait_replacement(std::chrono::milliseconds(f.rejoin_timeout_ms), heartbeat);
      if (g_stop) return watch->exit_code.load();
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Spade cache rank: full paged KV cache, query windows, AsyncSpade token selection"};
  Flags f;
  add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  try {
    refuse_unused_flags(app, f.device);
    spade::init_logging("cache_rank", f.log_level);
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    spade::pair::resolve_sparse_flags(f.sparse_text, f.sparse);
    // Hybrid models (Qwen3.5): only the full-attention layers have KV, so only they are stored and selected here.
    const spade::ModelConfig cfg = spade::load_model_config(f.model_dir).attention_view();
    const auto env = spade::coord::LaunchEnv::resolve(f.lf);
    SPADE_CHECK(env.role == spade::proto::CACHE, "cache_rank: {} is not a cache rank (role map {})",
                env.describe_rank(env.rank), env.role_map_string());
    const std::string self = fmt::format("cache rank {} (#{})", env.rank, env.role_index);
    if (f.device == "cuda" && env.cache_per_inference > 1)
      spade::fail("{}: --device cuda pairs one cache rank with one inference rank (NCCL / CUDA IPC), but this world "
                  "gives each inference rank {} cache ranks (--num-cache {} / --num-inference {}); shard over several "
                  "cache ranks with --device cpu (UCX), or start as many cache ranks as inference ranks",
                  self, env.cache_per_inference, env.num_cache, env.num_inference);
    spade::metrics::Registry registry;
    spade::LoopHeartbeat heartbeat(std::chrono::milliseconds(30000));
    std::atomic<bool> connected{false};
    std::unique_ptr<spade::http::HttpServer> status_server;
    if (f.metrics_port > 0) {
      status_server = spade::serve_status_endpoint(
          f.metrics_host, static_cast<uint16_t>(f.metrics_port), self, registry,
          spade::StatusChecks{[&] { return heartbeat.check(); },
                              [&]() -> std::string {
                                return connected ? "" : "waiting for the world and the paired inference rank";
                              },
                              nullptr});  // never degraded: without its inference rank it has nothing to serve
      spdlog::info("{}: metrics on {}:{}/metrics", self, f.metrics_host, status_server->port());
    }
    const Rank rank{cfg, env, self, registry, heartbeat, connected};
    return f.device == "cuda" ? serve_gpu(f, rank) : serve_cpu(f, rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cache_rank: error: %s\n", e.what());
    return 2;
  }
}
