// cache_rank: the daemon that holds the full KV cache of its paired inference rank's sparse sequences and sends
// back, one step ahead, the tokens each layer and KV head should attend to (AsyncSpade Sec. 4.1-4.2).
//
//   cache_rank --model DIR [--token-budget K --local-window R --sink-tokens S --query-window W --ridge-eps E
//               --gqa-rule max|mean --predictor P --successor-expand B --kv-pages N --page-size 16
//               --overlap-sample-every N --delta-transfer true|false]
//              [--metrics-port P] [launch flags | RANK/WORLD_SIZE/MASTER_* | OMPI_*]
//   cache_rank --model DIR --device cuda [--gpu N --query-window W --ridge-eps E --gqa-rule R --predictor P
//              --successor-expand B --overlap-sample-every N --hello-timeout-ms T --selection-streams 1|3]
//              [launch flags]
//              (the GPU cache rank, cache_rank/gpu_server.h: the budget, local window, pack size, delta capacity and
//              pool size come from the paired inference rank's hello; metrics: transfer bytes, steps, selections,
//              the sampled overlap ratio and the KV-pool gauges)
// A flag that the device would ignore (--token-budget with --device cuda, --gpu with --device cpu, ...) is refused
// by name at start-up (refuse_unused_flags, cache_rank/rank_flags.h); the selection flags are the pair's
// (pair/selection_flags.h). The --device cpu loop is serve_cpu (cache_rank/serve_cpu.cpp), the --device cuda loop
// serve_gpu below.
//
// Metrics (--metrics-port, GET /metrics; /health = serving loop alive, /ready = paired inference rank connected):
//   spade_selection_time_seconds          histogram  cache-rank time per layer-pack update (append+predict+score+top-k+gather)
//   spade_selection_overlap_ratio         histogram  sampled |predicted top-k ∩ oracle top-k| / k (AsyncSpade Eq. 1;
//                                                    both devices, every --overlap-sample-every steps)
//   spade_transfer_bytes_total{direction,transport}  counter  data-plane bytes, direction send|recv
//   spade_cache_pack_updates_total        counter    updates answered
//   spade_selected_tokens_total           counter    tokens selected (over sequences, layers, KV heads)
//   spade_sent_tokens_total               counter    selected tokens whose K/V were sent: all of them with
//                                                    --delta-transfer off, only those that entered the selection with on
//   spade_cache_selection_errors_total    counter    updates answered with an error (e.g. pool exhausted)
//   spade_cache_sequences                 gauge      live sequences whose KV this rank holds (both devices; on the GPU
//                                                    cache rank an ended sequence counts until the next plan: a
//                                                    step's, or the idle flush)
//   spade_cache_retained_prefixes         gauge      prompt prefixes of ended sequences kept (prefix caching)
//   spade_cache_kv_usage_perc             gauge      0..1, used fraction of the KV pool
//   spade_cache_kv_pages_used             gauge      KV pages held (a page that sequences share counts once)
//   spade_cache_shard_layers{shard,num_shards}  gauge  layers held: all of them, or its shard's when the inference
//                                                    rank has N > 1 cache ranks (docs/ARCHITECTURE.md, "Sharding")
//
// The model directory is read for config.json only (shapes); the selection flags must match the inference rank's.
// Exits 0 when the coordinator shuts the world down, 1 when the coordinator is lost. When its inference rank dies, the
// CPU cache rank drops that rank's sequences (a fresh Selector per incarnation) and serves its replacement (same index,
// PeerReplaced from the coordinator), or exits 1 after --rejoin-timeout-ms without one; the GPU cache rank exits 1
// (its own restart re-pairs with the replacement), and so does it when a sibling layer shard (another cache rank of its
// inference rank) is lost: its inference rank re-pairs its N shards together.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <thread>

#include "cache_rank/rank_flags.h"
#include "cache_rank/rank_serve.h"
#include "pair/gpu_shard.h"
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
using namespace spade::cache_rank_cli;

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }

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
    std::atomic<bool> has_hello{false};  // paired: the inference rank's hello arrived
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
  // Layer shards (pair/gpu_shard.h): this rank's link of the N the inference rank offered, and the attention view of
  // its shard's layers (the server sees its packs as packs 0..n-1; the shard's hello carries that layer count).
  const Shard shard = shard_for(paired.view, peer, cfg, f.kv_pages, self, peer_name);
  spade::ModelConfig shard_cfg = cfg;
  if (shard.count > 1) shard_cfg.num_layers = static_cast<int>(shard.layers.size());
  shared->link = spade::transport::join_gpu_link(
      spade::pair::shard_address(peer.transport().address(), static_cast<int>(shard.index),
                                 static_cast<int>(shard.count), peer_name),
      lo);
  spade::transport::GpuLink& link = *shared->link;
  // Control-plane events, from before the hello wait on: a dead inference rank ends it (the link is aborted).
  const uint32_t peer_rank = peer.rank();
  // The GPU cache rank serves one incarnation of its inference rank: a replacement (PeerReplaced) ends it with exit
  // code 1, and its own restart (a new incarnation) re-pairs with the replacement.
  // A sibling layer shard lost (the coordinator sends the PeerDown of every cache rank of this rank's inference rank
  // to the others): the inference rank aborted every shard's link with it and re-pairs the N shards together once each
  // is replaced, so this incarnation ends (exit 1) and its restart is one of them. A replacement still waiting for its
  // hello is one of the new N already: it keeps waiting.
  cc.set_event_callback([shared, peer_rank, peer_name, self](const spade::coord::ClientEvent& ev) {
    if (ev.kind == spade::coord::ClientEvent::Kind::kPeerDown && ev.peer_down.rank() != peer_rank) {
      if (ev.peer_down.role() != spade::proto::CACHE || !shared->has_hello.load()) return;
      spdlog::warn("{}: cache #{} (another layer shard of {}) is down ({}); {} re-pairs its layer shards together, "
                   "so this incarnation ends and its restart is one of them",
                   self, ev.peer_down.role_index(), peer_name, ev.peer_down.reason(), peer_name);
      shared->exit_code = 1;
      // The dead shard by name: the inference rank may see this link fail before its own view of that shard.
      shared->link->abort(fmt::format("another layer shard of {}, cache rank {} (#{}), is down: {}", peer_name,
                                      ev.peer_down.rank(), ev.peer_down.role_index(), ev.peer_down.reason()));
      g_stop = true;
      return;
    }
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
      spade::cache::recv_gpu_hello(link, shard_cfg, peer_name, std::chrono::milliseconds(f.hello_timeout_ms));
  shared->has_hello = true;
  SPADE_CHECK(shard.count == 1 || hello.layers_per_pack == static_cast<int32_t>(peer.layers_per_pack()),
              "{}: {} registered --layers-per-pack {} but its pair hello says {}", self, peer_name,
              peer.layers_per_pack(), hello.layers_per_pack);
  spade::cache::GpuCacheOptions gopts = spade::cache::gpu_cache_options(hello, f.sparse, f.gpu_index);
  gopts.pipeline = f.selection_streams == 3;
  spade::cache::GpuCacheServer server(shard_cfg, gopts, link, peer_name);
  if (shard.count > 1)
    spdlog::info("{}: layer shard {} of {}: {} of {} layers", self, shard.index, shard.count, shard.layers.size(),
                 cfg.num_layers);
  registry
      .gauge("spade_cache_shard_layers",
             "Layers whose KV this cache rank holds, labelled with its shard among the num_shards cache ranks of its "
             "inference rank.",
             {"shard", "num_shards"})
      .with({std::to_string(shard.index), std::to_string(shard.count)})
      .set(static_cast<double>(shard_cfg.num_layers));
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
  auto& overlap = overlap_ratio_histogram(registry);
  CachePoolGauges pool = cache_pool_gauges(registry);
  pool.set(0, 0, 0, static_cast<double>(server.stats().pool_pages));
  connected = true;
  spade::cache::GpuCacheStats seen;
  auto count = [&] {
    for (double ratio : server.take_overlap_ratios()) overlap.observe(ratio);
    const spade::cache::GpuCacheStats& now = server.stats();
    bytes_in.inc(static_cast<double>(now.bytes_received - seen.bytes_received));
    bytes_out.inc(static_cast<double>(now.bytes_sent - seen.bytes_sent));
    steps.inc(static_cast<double>(now.steps - seen.steps));
    selections.inc(static_cast<double>(now.selections - seen.selections));
    pool.set(static_cast<double>(now.sequences), static_cast<double>(now.retained_prefixes),
             static_cast<double>(now.pages_held), static_cast<double>(now.pool_pages));
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
  if (err.empty() && server.closed()) {  // nothing is pending: the last samples' copies can be waited for
    try {
      server.synchronize();
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  const spade::cache::GpuCacheStats& st = server.stats();
  spdlog::info("{}: {} steps, {} selections ({} first), {:.1f} MB in, {:.1f} MB out", self, st.steps,
               st.selections, st.first_selections, st.bytes_received / 1e6, st.bytes_sent / 1e6);
  if (st.sampled_steps > 0) {
    spade::cache::SelectionSampleStats all;
    for (const auto& h : st.head_samples) all += h;
    spdlog::info("{}: {} sampled steps: overlap ratio {:.3f} (AsyncSpade Eq. 1), selection churn {:.3f} per step",
                 self, st.sampled_steps, all.overlap(), all.churn());
  }
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
    const Rank rank{cfg, env, self, registry, heartbeat, connected, g_stop};
    return f.device == "cuda" ? serve_gpu(f, rank) : serve_cpu(f, rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cache_rank: error: %s\n", e.what());
    return 2;
  }
}
