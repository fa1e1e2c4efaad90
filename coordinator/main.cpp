// `coordinator`: the Spade control-plane process (global rank 0 by default). See coordinator/server.h.
//
//   coordinator --num-inference 1 --num-cache 1 --port 29500 --model DIR --http-port 8000
//   torchrun-style: MASTER_PORT=29500 WORLD_SIZE=3 RANK=0 coordinator --model DIR
//
// HTTP (--http-port, default 8000; 0 = off): the OpenAI-compatible API under /v1 (coordinator/openai_api.h;
// needs
// --model for the tokenizer, chat template and context length), GET /health (200 while the control loop runs,
// else 503), GET /ready (200 once every rank registered and an inference rank is alive, else 503), GET
// /metrics:
//   spade_rank_up{role,rank,role_index}   gauge    1 alive, 0 missing or dead (cache-rank up/down and the
//   others) spade_world_complete                  gauge    1 once every rank has registered
//   spade_http_requests_total{endpoint,code}  counter  API requests by endpoint and status (499 = client went
//   away) spade_api_requests_in_flight          gauge    generation requests in flight through the API
//   spade_api_client_disconnects_total    counter  requests cancelled because their client disconnected
//   spade_api_e2e_request_latency_seconds histogram  end-to-end latency as the API client sees it
//   spade_api_request_params_n            histogram  the n parameter (samples) of API requests, at their end
//   spade_control_unauthenticated_connections  gauge  control connections not yet authenticated
//   spade_control_rejected_connections_total   counter  control connections closed before authenticating
//
// Security (docs/DEPLOY.md, "Security model"): the control port (--host, default 127.0.0.1) and the HTTP API
// (--http-host, default 127.0.0.1) listen on loopback unless told otherwise. With a cluster secret
// (--cluster-secret-file, SPADE_CLUSTER_SECRET_FILE or SPADE_CLUSTER_SECRET) every control connection must
// prove it knows the secret; without one the coordinator refuses a non-loopback --host. The bounds on
// strangers:
// --max-unauthenticated-connections, --auth-timeout-ms, --max-unauthenticated-frame-bytes; on everyone:
// --max-frame-bytes, --idle-timeout-ms.
//
// Exit codes: 0 clean shutdown (Shutdown request or SIGINT/SIGTERM), 1 rendezvous deadline missed (the
// message names the missing rank(s)), 2 bad flags / environment / cannot listen.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "common/error.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status_endpoint.h"
#include "coordinator/launch_env.h"
#include "coordinator/openai_api.h"
#include "coordinator/server.h"

namespace {

void write_port_file(const std::string& path, uint16_t port) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    SPADE_CHECK(static_cast<bool>(f), "cannot write port file '{}'", tmp);
    f << port << "\n";
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  SPADE_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp, path, ec.message());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Spade coordinator: rendezvous, pairing (inference #i <-> cache #(i*K + s), s < K = M / N), heartbeats, "
      "request routing"};
  spade::coord::LaunchFlags flags;
  spade::coord::ServerOptions so;  // the defaults of the control port's settings
  std::string port_file;
  std::string log_level = "info";
  int64_t hb_interval_ms = 1000, hb_timeout_ms = 5000, rendezvous_ms = 60000;
  int64_t auth_timeout_ms = so.auth_timeout.count(), idle_timeout_ms = so.idle_timeout.count();
  app.add_option(
         "--host", so.bind_host,
         "Address of the control port (ranks and spade_submit connect here); a non-loopback address needs a "
         "cluster secret")
      ->capture_default_str();
  spade::coord::add_cluster_secret_flag(app, flags.cluster_secret_file);
  app.add_option(
         "--max-unauthenticated-connections", so.max_unauthenticated_connections,
         "control connections that have not authenticated yet, open at once; more are closed on accept")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--auth-timeout-ms", auth_timeout_ms,
                 "a control connection must authenticate (or, without a secret, register) within this time")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-unauthenticated-frame-bytes", so.max_unauthenticated_frame_bytes,
                 "largest frame read from a control connection before it authenticates")
      ->capture_default_str();
  app.add_option("--max-frame-bytes", so.max_frame_bytes,
                 "largest frame read from an authenticated control connection")
      ->capture_default_str();
  app.add_option(
         "--idle-timeout-ms", idle_timeout_ms,
         "close a control connection that sends nothing for this long (>= 2 x --heartbeat-interval-ms)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--port", flags.master_port,
                 "TCP port to listen on (0 = ephemeral; default MASTER_PORT or 29500)");
  app.add_option("--num-inference", flags.num_inference, "Number of inference ranks (N)");
  app.add_option("--num-cache", flags.num_cache,
                 "Number of cache ranks (M, a multiple of N: each inference rank takes K = M / N, its layer shards)");
  app.add_option("--world-size", flags.world_size,
                 "World size 1 + N + M (default WORLD_SIZE / OMPI_COMM_WORLD_SIZE)");
  app.add_option("--rank", flags.rank,
                 "This process's global rank (default RANK / OMPI_COMM_WORLD_RANK / 0)");
  app.add_option("--role-map", flags.role_map, "Explicit role of every rank, e.g. c,i,i,k,k");
  app.add_option("--heartbeat-interval-ms", hb_interval_ms, "Heartbeat period the ranks use")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout-ms", hb_timeout_ms, "Silence after which a rank is declared dead")
      ->capture_default_str();
  app.add_option("--rendezvous-timeout-ms", rendezvous_ms, "Deadline for the whole world to register")
      ->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound port to this file once listening");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  int http_port = 8000;
  std::string http_host = "127.0.0.1";
  spade::coord::ApiOptions api_opt;
  size_t max_body = 4u << 20;
  app.add_option("--http-port", http_port, "OpenAI API, /health, /ready, /metrics port (0 = off)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option(
         "--http-host", http_host,
         "address the HTTP API listens on (it has no authentication: expose it deliberately, e.g. 0.0.0.0 "
         "behind a gateway)")
      ->capture_default_str();
  app.add_option("--model", api_opt.model_dir,
                 "checkpoint directory (tokenizer, chat template, config) for the OpenAI API");
  app.add_option("--served-model-name", api_opt.served_model_name,
                 "model name of the API (default: the model directory's name)");
  app.add_option("--chat-template", api_opt.chat_template_file,
                 "Jinja chat template file replacing the checkpoint's (a recognised family, see chat_template.h)");
  app.add_option("--max-model-len", api_opt.max_model_len, "context length (default: max_position_embeddings)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-num-requests", api_opt.max_num_requests,
                 "generation requests in flight through the API; more get 429")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-request-bytes", max_body, "largest request body; larger ones get 413")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    spade::init_logging("coordinator", log_level);
    // --port 0 means ephemeral: keep it out of LaunchEnv's 1..65535 check.
    bool ephemeral = flags.master_port && *flags.master_port == 0;
    if (ephemeral) flags.master_port.reset();
    auto le = spade::coord::LaunchEnv::resolve(flags);
    for (const auto& n : le.notes) spdlog::warn("coordinator: {}", n);
    SPADE_CHECK(
        le.role == spade::proto::COORDINATOR,
        "this process is {} per role map {} (rank from {}); run the coordinator as the coordinator rank",
        le.describe_rank(le.rank), le.role_map_string(), le.sources["rank"]);
    SPADE_CHECK(hb_interval_ms > 0 && hb_timeout_ms > 0 && rendezvous_ms > 0,
                "--heartbeat-interval-ms, --heartbeat-timeout-ms and --rendezvous-timeout-ms must be > 0");

    so.cluster_secret = le.cluster_secret.value;
    so.auth_timeout = std::chrono::milliseconds(auth_timeout_ms);
    so.idle_timeout = std::chrono::milliseconds(idle_timeout_ms);
    so.port = ephemeral ? 0 : le.master_port;
    so.role_map = le.role_map;
    so.heartbeat_interval = std::chrono::milliseconds(hb_interval_ms);
    so.heartbeat_timeout = std::chrono::milliseconds(hb_timeout_ms);
    so.rendezvous_timeout = std::chrono::milliseconds(rendezvous_ms);
    so.handle_signals = true;
    if (!api_opt.model_dir.empty()) so.served_model_name = spade::coord::served_model_name(api_opt);
    spade::coord::CoordinatorServer server(so);
    spdlog::info(
        "coordinator: listening on {}:{} for {} inference + {} cache ranks (role map {}), rendezvous "
        "timeout {} ms, heartbeat {} ms / timeout {} ms",
        so.bind_host, server.port(), le.num_inference, le.num_cache, le.role_map_string(), rendezvous_ms,
        hb_interval_ms, hb_timeout_ms);
    if (le.cluster_secret.empty()) {
      spdlog::warn(
          "coordinator: no cluster secret: control connections are not authenticated (allowed on "
          "loopback only; every local user can reach {}:{})",
          so.bind_host, server.port());
    } else {
      spdlog::info("coordinator: control connections authenticate with the cluster secret from {}",
                   le.cluster_secret.source);
    }
    if (!port_file.empty()) write_port_file(port_file, server.port());

    // HTTP: the OpenAI API + status endpoints, on their own io thread.
    spade::metrics::Registry registry;
    auto& rank_up = registry.gauge("spade_rank_up", "1 while a rank is registered and alive, else 0.",
                                   {"role", "rank", "role_index"});
    auto& world_complete = registry.gauge("spade_world_complete", "1 once every rank has registered.").with();
    auto& unauthenticated = registry
                                .gauge("spade_control_unauthenticated_connections",
                                       "Control connections open that have not authenticated yet.")
                                .with();
    auto& rejected =
        registry
            .counter("spade_control_rejected_connections_total",
                     "Control connections closed before authenticating (over the limit, wrong or no "
                     "proof, deadline, oversized or forbidden frame).")
            .with();
    std::mutex rejected_mu;  // /metrics may be served on several threads
    uint64_t rejected_seen = 0;
    std::unique_ptr<spade::coord::OpenAiApi> api;
    if (!api_opt.model_dir.empty()) api = std::make_unique<spade::coord::OpenAiApi>(api_opt, server, registry);
    auto refresh = [&] {
      const auto h = server.health();
      world_complete.set(h.world_complete ? 1 : 0);
      unauthenticated.set(h.unauthenticated_connections);
      {
        std::lock_guard<std::mutex> lk(rejected_mu);
        if (h.rejected_connections > rejected_seen) {
          rejected.inc(static_cast<double>(h.rejected_connections - rejected_seen));
          rejected_seen = h.rejected_connections;
        }
      }
      try {
        const auto st = server.status(std::chrono::steady_clock::now() + std::chrono::seconds(2));
        for (const auto& r : st.ranks()) {
          const char* role = r.info().role() == spade::proto::INFERENCE ? "inference"
                             : r.info().role() == spade::proto::CACHE   ? "cache"
                                                                         : "other";
          rank_up.with({role, std::to_string(r.info().rank()), std::to_string(r.info().role_index())})
              .set(r.state() == spade::proto::ALIVE ? 1 : 0);
        }
      } catch (const spade::Error& e) {
        spdlog::warn("coordinator: /metrics: {}", e.what());
      }
    };
    spade::StatusChecks checks;
    checks.health = [&]() -> std::string {
      const auto h = server.health();
      if (!h.running) return "control loop not running";
      if (h.shutting_down) return "shutting down";
      if (h.since_loop_tick > std::chrono::milliseconds(5000))
        return fmt::format("control loop stalled for {} ms", h.since_loop_tick.count());
      return "";
    };
    checks.ready = [&]() -> std::string {
      const auto h = server.health();
      if (!h.running || h.shutting_down) return "coordinator not serving";
      if (!h.world_complete)
        return fmt::format("waiting for the world: {} of {} inference and {} of {} cache ranks alive",
                           h.live_inference, h.num_inference, h.live_cache, h.num_cache);
      if (h.live_inference == 0) return "no live inference rank";
      return "";
    };
    // A dead rank (until its replacement has re-paired) leaves the world serving, degraded: /ready 200
    // {"status":"degraded"} naming it; back to "ok" once the pair is whole again.
    checks.degraded = [&]() -> std::string { return server.health().degraded; };
    std::unique_ptr<spade::http::HttpServer> http;
    if (http_port > 0) {
      spade::http::HttpServerOptions ho;
      ho.bind_host = http_host;
      ho.port = static_cast<uint16_t>(http_port);
      ho.name = "coordinator HTTP API";
      ho.max_body_bytes = max_body;
      ho.error_body = [](int status, const std::string& msg) {
        return std::make_pair(std::string("application/json"), spade::coord::openai_error_json(status, msg));
      };
      http = std::make_unique<spade::http::HttpServer>(
          ho, [&](const spade::http::HttpRequest& req, std::shared_ptr<spade::http::HttpResponder> res) {
            if (req.path == "/metrics") refresh();
            if (spade::answer_status_request(req, *res, registry, checks)) return;
            if (!api) {
              res->send(404, "application/json",
                        spade::coord::openai_error_json(
                            404, "the coordinator was started without --model: the OpenAI API is off", "", "not_found"));
              return;
            }
            api->handle(req, std::move(res));
          });
      spdlog::info("coordinator: HTTP API on {}:{} (model {}, max_model_len {})", http_host, http->port(),
                   api ? api->model_name() : std::string("none: start with --model DIR"),
                   api ? api->max_model_len() : 0);
    }
    auto st = server.run();
    if (http) http->stop();
    if (st.code != 0) {
      spdlog::error("coordinator: exiting with code {}: {}", st.code, st.message);
      std::fprintf(stderr, "coordinator: error: %s\n", st.message.c_str());
    } else {
      spdlog::info("coordinator: clean shutdown: {}", st.message);
    }
    return st.code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "coordinator: error: %s\n", e.what());
    return 2;
  }
}
