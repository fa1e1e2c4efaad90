// `coordinator`: the Spade control-plane process (global rank 0 by default). See coordinator/server.h.
//
//   coordinator --num-inference 1 --num-cache 1 --port 29500
//   torchrun-style: MASTER_PORT=29500 WORLD_SIZE=3 RANK=0 coordinator
//
// Exit codes: 0 clean shutdown (Shutdown request or SIGINT/SIGTERM), 1 rendezvous deadline missed (the
// message names the missing rank(s)), 2 bad flags / environment / cannot listen.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "common/logging.h"
#include "coordinator/launch_env.h"
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
      "Spade coordinator: rendezvous, pairing (inference #i <-> cache #i), heartbeats, request routing"};
  spade::coord::LaunchFlags flags;
  std::string bind_host = "0.0.0.0";
  std::string port_file;
  std::string log_level = "info";
  int64_t hb_interval_ms = 1000, hb_timeout_ms = 5000, rendezvous_ms = 60000;
  app.add_option("--host", bind_host, "Address to listen on")->capture_default_str();
  app.add_option("--port", flags.master_port,
                 "TCP port to listen on (0 = ephemeral; default MASTER_PORT or 29500)");
  app.add_option("--num-inference", flags.num_inference, "Number of inference ranks (N)");
  app.add_option("--num-cache", flags.num_cache, "Number of cache ranks (M, must equal N)");
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

    spade::coord::ServerOptions so;
    so.bind_host = bind_host;
    so.port = ephemeral ? 0 : le.master_port;
    so.role_map = le.role_map;
    so.heartbeat_interval = std::chrono::milliseconds(hb_interval_ms);
    so.heartbeat_timeout = std::chrono::milliseconds(hb_timeout_ms);
    so.rendezvous_timeout = std::chrono::milliseconds(rendezvous_ms);
    so.handle_signals = true;
    spade::coord::CoordinatorServer server(so);
    spdlog::info(
        "coordinator: listening on {}:{} for {} inference + {} cache ranks (role map {}), rendezvous "
        "timeout {} ms, heartbeat {} ms / timeout {} ms",
        bind_host, server.port(), le.num_inference, le.num_cache, le.role_map_string(), rendezvous_ms,
        hb_interval_ms, hb_timeout_ms);
    if (!port_file.empty()) write_port_file(port_file, server.port());
    auto st = server.run();
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
