#include "inference_rank/serve.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <memory>
#include <mutex>
#include <string>

#include "common/config.h"
#include "common/error.h"
#include "common/status_endpoint.h"
#include "common/tokenizer.h"
#include "coordinator/client.h"
#include "inference_rank/rank_metrics.h"
#include "inference_rank/serve_pairing.h"
#include "inference_rank/serve_requests.h"

namespace spade {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

using Clock = std::chrono::steady_clock;

}  // namespace

int run_serve(const ServeOptions& opt) {
  const coord::LaunchEnv env = coord::LaunchEnv::resolve(opt.launch);
  SPADE_CHECK(env.role == proto::INFERENCE, "inference_rank --serve: {} is not an inference rank (role map {})",
              env.describe_rank(env.rank), env.role_map_string());
  const std::string self = fmt::format("inference rank {} (#{})", env.rank, env.role_index);
  // Status endpoint first, so /ready can say what the rank is waiting for while it loads and rendezvouses.
  metrics::Registry registry;
  LoopHeartbeat heartbeat(opt.health_timeout);
  std::mutex stage_mu;
  std::string not_ready = "loading weights from " + opt.model_dir;
  auto set_stage = [&](std::string why) {
    std::lock_guard<std::mutex> lk(stage_mu);
    not_ready = std::move(why);
  };
  // Shared with the coordinator client's event callback (its I/O thread may outlive this scope's locals).
  auto pair_health = std::make_shared<PairHealth>();
  std::unique_ptr<http::HttpServer> status_server;
  if (opt.metrics_port > 0) {
    status_server = serve_status_endpoint(
        opt.metrics_host, static_cast<uint16_t>(opt.metrics_port), self, registry,
        StatusChecks{[&] { return heartbeat.check(); },
                     [&] {
                       std::lock_guard<std::mutex> lk(stage_mu);
                       return not_ready;
                     },
                     [pair_health] {
                       const std::string why = pair_health->degraded();
                       return why.empty() ? why : "sparse decoding unavailable, decoding densely: " + why;
                     }});
    spdlog::info("{}: metrics on {}:{}/metrics", self, opt.metrics_host, status_server->port());
  }
  SPADE_CHECK(opt.device == "cpu" || opt.device == "cuda", "{}: --device must be cpu or cuda, got '{}'", self,
              opt.device);
  auto model = Model::load(opt.model_dir);
  auto tok = Tokenizer::from_dir(opt.model_dir);
  const GenerationConfig gen = load_generation_config(opt.model_dir, model->config());

  // The data plane's link is chosen at run time (serve_pairing.h, transport/link_factory.h): on the GPU --gpu-link
  // nccl | ipc, whose inference-side end exists before registering (its address is what the coordinator forwards);
  // on the CPU UCX.
  coord::ClientOptions co = coord::client_options_for(env);
  const std::unique_ptr<DataPlane> plane =
      make_data_plane(DataPlaneSetup{self, opt, env, model->config(), pair_health, set_stage}, co);
  coord::CoordinatorClient cc(co);
  // The engine and its links go before the coordinator client (the sessions' ends before the rank leaves the world).
  struct TeardownAtExit {
    DataPlane& plane;
    ~TeardownAtExit() { plane.teardown(); }
  } teardown_at_exit{*plane};
  set_stage("waiting for the world to register with " + cc.coordinator_name());
  const auto deadline = Clock::now() + opt.rendezvous_timeout;
  const proto::ClusterView view = cc.rendezvous(deadline);
  spdlog::info("{}: world of {} ({})", self, view.world_size(), view.pairing_rule());
  plane->connect(view, deadline);
  Engine& engine = plane->build_engine(model);
  InferenceMetrics rank_metrics(registry, plane->sparse(), plane->transport_name().c_str(),
                                metrics_model_name(view.served_model_name(), opt.model_dir));
  engine.set_observer(&rank_metrics);
  // From here a PeerDown for the cache rank aborts the link at once (the coordinator client's I/O thread). Rejoin: a
  // replacement of the cache rank (PeerReplaced) is connected on a thread of its own, so that the dense requests keep
  // decoding meanwhile; the loop swaps the new link in once it is up (finish_repair).
  plane->watch(cc);
  RequestTable requests(
      self, env.rank, engine, tok, gen, plane->intake_limits(),
      [&](uint64_t eid, const IntakeRequest& r) { plane->set_request_options(eid, r); },
      [&](const proto::GenerateChunk& c) { cc.send_chunk(c); });
  set_stage("");  // ready: weights loaded, world complete, data plane connected

  int exit_code = 0;
  bool running = true;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  while (running) {
    heartbeat.tick();
    if (int sig = g_signal.load()) {  // SIGTERM / SIGINT: end the in-flight requests and leave the world
      spdlog::warn("{}: signal {} received: aborting {} request(s) and exiting", self, sig, requests.size());
      requests.abort_all();
      break;
    }
    // Control plane events.
    while (auto ev = cc.next_event(Clock::now())) {
      if (ev->kind == coord::ClientEvent::Kind::kPeerDown) {
        spdlog::error("{}: {}", self, ev->message);
        plane->on_peer_down(ev->peer_down);
      } else if (ev->kind == coord::ClientEvent::Kind::kPeerReplaced) {
        spdlog::info("{}: {}", self, ev->message);
        plane->on_peer_replaced(ev->peer_replaced, cc);
      } else {
        spdlog::info("{}: {}", self, ev->message);
        exit_code = ev->kind == coord::ClientEvent::Kind::kShutdown && !ev->shutdown.is_error() ? 0 : 1;
        running = false;
      }
    }
    if (!running) break;
    plane->finish_repair(requests);
    // Cancellations (client gone): each sample of the request (or the one named) ends with FINISH_CANCELLED and its
    // KV is freed (here at once, on the cache rank with the next update or the idle flush).
    while (auto c = cc.next_cancel(Clock::now())) requests.cancel(*c);
    // New requests: wait briefly only when idle, and only for the first one (take_requests).
    const auto first_deadline = engine.idle() ? Clock::now() + std::chrono::milliseconds(50) : Clock::now();
    take_requests([&](coord::Deadline d) { return cc.next_request(d); }, first_deadline,
                  [&](const proto::GenerateRequest& req) { requests.take(req); });
    if (!engine.idle()) engine.step();
    plane->after_step();
    plane->publish(cc, rank_metrics);
  }
  plane->shutdown();
  return exit_code;
}

}  // namespace spade
