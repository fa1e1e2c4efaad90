// cache_rank: the daemon that holds the full KV cache of its paired inference rank's sparse sequences and sends
// back, one step ahead, the tokens each layer and KV head should attend to (AsyncSpade Sec. 4.1-4.2).
//
//   cache_rank --model DIR [--token-budget K --local-window R --sink-tokens S --query-window W --ridge-eps E
//               --gqa-rule max|mean --kv-pages N --page-size 16] [launch flags | RANK/WORLD_SIZE/MASTER_* | OMPI_*]
//
// The model directory is read for config.json only (shapes); the selection flags must match the inference rank's.
// Exits 0 when the coordinator shuts the world down, 1 when its inference rank or the coordinator is lost.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <thread>

#include "cache_rank/link.h"
#include "common/config.h"
#include "common/error.h"
#include "common/logging.h"
#include "coordinator/client.h"
#if SPADE_HAVE_UCX
#include "transport/ucx.h"
#endif

namespace {
std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop = true; }
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Spade cache rank: full paged KV cache, query windows, AsyncSpade token selection"};
  std::string model_dir, log_level = "info", gqa_rule = "max";
  spade::cache::SelectionConfig sc;
  int kv_pages = 16384, page_size = 16, rendezvous_ms = 30000;
  spade::coord::LaunchFlags lf;
  app.add_option("--model", model_dir, "checkpoint directory (config.json is read for the shapes)")->required();
  app.add_option("--token-budget", sc.token_budget, "selected tokens per layer and KV head")->check(CLI::PositiveNumber);
  app.add_option("--local-window", sc.local_window, "most recent tokens the inference rank attends itself");
  app.add_option("--sink-tokens", sc.sink_tokens, "first tokens the inference rank attends itself");
  app.add_option("--query-window", sc.query_window, "W: queries the predictor regresses on (1..32)");
  app.add_option("--ridge-eps", sc.ridge_eps, "ridge regularisation epsilon");
  app.add_option("--gqa-rule", gqa_rule, "max | mean");
  app.add_option("--kv-pages", kv_pages, "KV pool size in pages (all layers)")->check(CLI::PositiveNumber);
  app.add_option("--page-size", page_size, "tokens per page")->check(CLI::PositiveNumber);
  app.add_option("--master-addr", lf.master_addr, "coordinator host (else MASTER_ADDR)");
  app.add_option("--master-port", lf.master_port, "coordinator port (else MASTER_PORT)");
  app.add_option("--rank", lf.rank, "global rank (else RANK / OMPI_COMM_WORLD_RANK)");
  app.add_option("--world-size", lf.world_size, "world size (else WORLD_SIZE / OMPI_COMM_WORLD_SIZE)");
  app.add_option("--num-inference", lf.num_inference, "inference ranks in the world");
  app.add_option("--num-cache", lf.num_cache, "cache ranks in the world");
  app.add_option("--role-map", lf.role_map, "explicit role per rank, e.g. c,i,k");
  app.add_option("--rendezvous-timeout-ms", rendezvous_ms, "deadline for the whole world to register");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  CLI11_PARSE(app, argc, argv);
  try {
    spade::init_logging("cache_rank", log_level);
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    if (gqa_rule == "mean") {
      sc.gqa_rule = spade::kernels::GqaScoreRule::kMean;
    } else if (gqa_rule != "max") {
      spade::fail("--gqa-rule must be max or mean, got '{}'", gqa_rule);
    }
    const spade::ModelConfig cfg = spade::load_model_config(model_dir);
    const auto env = spade::coord::LaunchEnv::resolve(lf);
    SPADE_CHECK(env.role == spade::proto::CACHE, "cache_rank: {} is not a cache rank (role map {})",
                env.describe_rank(env.rank), env.role_map_string());
    const std::string self = fmt::format("cache rank {} (#{})", env.rank, env.role_index);
#if !SPADE_HAVE_UCX
    spade::fail("{}: this build has no UCX transport", self);
#else
    spade::transport::UcxOptions uo;
    uo.name = self;
    auto net = spade::transport::make_ucx_transport(uo);
    spade::coord::ClientOptions co = spade::coord::client_options_for(env);
    co.device = "cpu";
    co.transport_kind = spade::proto::TRANSPORT_UCX;
    co.transport_address = net->local_address();
    spade::coord::CoordinatorClient cc(co);
    const auto deadline = spade::coord::Clock::now() + std::chrono::milliseconds(rendezvous_ms);
    const spade::proto::ClusterView view = cc.rendezvous(deadline);
    SPADE_CHECK(view.peers_size() > 0, "{}: the coordinator paired no inference rank with us", self);
    const spade::proto::RankInfo& peer = view.peers(0);
    const std::string peer_name =
        fmt::format("inference rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
    auto ep = net->connect(peer.transport().address(), peer_name, deadline);
    spade::cache::Selector sel(cfg, sc, kv_pages, page_size);
    spdlog::info("{}: serving {} ({} pages x {} tokens, budget {}, window W={}, eps={})", self, peer_name, kv_pages,
                 page_size, sc.token_budget, sc.query_window, sc.ridge_eps);
    // Control-plane events stop the data-plane loop.
    std::atomic<int> exit_code{0};
    cc.set_event_callback([&](const spade::coord::ClientEvent& ev) {
      if (ev.kind == spade::coord::ClientEvent::Kind::kPeerDown && ev.peer_down.rank() != peer.rank()) return;
      spdlog::info("{}: {}", self, ev.message);
      exit_code = ev.kind == spade::coord::ClientEvent::Kind::kShutdown && !ev.shutdown.is_error() ? 0 : 1;
      g_stop = true;
    });
    spade::cache::LinkStats stats;
    const std::string err =
        spade::cache::serve_cache_rank(*ep, sel, spade::cache::pack_shape(cfg, sc), g_stop, &stats);
    spdlog::info("{}: {} updates, {:.1f} MB in, {:.1f} MB out, {:.1f} ms selecting", self, stats.updates,
                 stats.bytes_received / 1e6, stats.bytes_sent / 1e6, stats.cache_select_ms);
    if (!err.empty()) {
      spdlog::error("{}: data plane to {} failed: {}", self, peer_name, err);
      return 1;
    }
    // A clean end of the link (the inference rank said shutdown) or a stop: wait for the world's shutdown briefly.
    for (int i = 0; i < 50 && !g_stop; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return exit_code;
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cache_rank: error: %s\n", e.what());
    return 2;
  }
}
