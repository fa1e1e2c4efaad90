// spade_submit: submits one generation request to a running Spade cluster through its coordinator and streams
// the text to stdout (the launchers' front end until the HTTP API lands). TTFT, TPOT and tokens/s go to
// stderr.
//
//   spade_submit --master-addr H --master-port P --prompt TEXT
//                [--max-tokens N --temperature T --top-p P --top-k K --seed S] [--shutdown-after]
//                [--timeout-ms 600000] [--cluster-secret-file FILE]
// The cluster secret (--cluster-secret-file, else SPADE_CLUSTER_SECRET_FILE / SPADE_CLUSTER_SECRET) must be
// the coordinator's when it has one (docs/DEPLOY.md, "Security model"). Exit status: 0 when the request
// finished (stop or length), 1 when it failed (the error names the failing rank), 2 on a usage or connection
// error.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <thread>

#include "common/logging.h"
#include "coordinator/client.h"
#include "coordinator/launch_env.h"

int main(int argc, char** argv) {
  CLI::App app{"Submit a prompt to a Spade cluster and stream the generated text"};
  std::string addr = "127.0.0.1", prompt, log_level = "warn";
  uint32_t port = 29500, max_tokens = 128, top_k = 0;
  float temperature = 0.f, top_p = 1.f;
  uint64_t seed = 0;
  int64_t timeout_ms = 600000;
  bool shutdown_after = false;
  app.add_option("--master-addr", addr, "coordinator host");
  app.add_option("--master-port", port, "coordinator port");
  app.add_option("--prompt", prompt, "prompt text; \"\" = the BOS token alone")->required();
  app.add_option("--max-tokens", max_tokens, "tokens to generate at most")->check(CLI::PositiveNumber);
  app.add_option("--temperature", temperature, "0 = greedy");
  app.add_option("--top-p", top_p, "nucleus mass in (0, 1]");
  app.add_option("--top-k", top_k, "0 = off");
  app.add_option("--seed", seed, "sampler seed");
  app.add_option("--timeout-ms", timeout_ms, "give up after this long")->check(CLI::PositiveNumber);
  app.add_flag("--shutdown-after", shutdown_after, "ask the coordinator to shut the cluster down when done");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off");
  std::optional<std::string> secret_file;
  spade::coord::add_cluster_secret_flag(app, secret_file);
  CLI11_PARSE(app, argc, argv);
  using Clock = std::chrono::steady_clock;
  try {
    spade::init_logging("spade_submit", log_level);
    spade::coord::ClientOptions co;
    co.coordinator_host = addr;
    co.coordinator_port = static_cast<uint16_t>(port);
    co.role = spade::proto::CLIENT;
    co.cluster_secret = spade::coord::resolve_cluster_secret(secret_file).value;
    spade::coord::CoordinatorClient cc(co);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    cc.rendezvous(std::min(deadline, Clock::now() + std::chrono::seconds(60)));
    // Wait until every rank has registered (the coordinator routes only in a complete world).
    for (;;) {
      const auto st = cc.query_status(deadline);
      if (st.world_complete()) break;
      if (st.shutting_down()) {
        std::fprintf(stderr, "spade_submit: %s is shutting down\n", cc.coordinator_name().c_str());
        return 1;
      }
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "spade_submit: the world never became complete\n");
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    spade::proto::GenerateRequest req;
    req.set_text(prompt);
    req.set_max_tokens(max_tokens);
    req.mutable_sampling()->set_temperature(temperature);
    req.mutable_sampling()->set_top_p(top_p);
    req.mutable_sampling()->set_top_k(top_k);
    req.mutable_sampling()->set_seed(seed);
    const auto t0 = Clock::now();
    const uint64_t id = cc.submit(req);
    size_t tokens = 0;
    Clock::time_point first, last;
    int rc = 0;
    for (;;) {
      auto chunk = cc.next_chunk(deadline);
      if (!chunk) {
        std::fprintf(stderr, "spade_submit: no answer from %s within %lld ms\n",
                     cc.coordinator_name().c_str(), static_cast<long long>(timeout_ms));
        rc = 1;
        break;
      }
      if (chunk->request_id() != id) continue;
      if (chunk->token_ids_size() > 0) {
        if (tokens == 0) first = Clock::now();
        last = Clock::now();
        tokens += chunk->token_ids_size();
      }
      std::fwrite(chunk->text().data(), 1, chunk->text().size(), stdout);
      std::fflush(stdout);
      if (chunk->finished()) {
        std::fputc('\n', stdout);
        if (chunk->finish_reason() == spade::proto::FINISH_ERROR ||
            chunk->finish_reason() == spade::proto::FINISH_CANCELLED) {
          std::fprintf(stderr, "spade_submit: request failed: %s\n", chunk->error().c_str());
          rc = 1;
        }
        break;
      }
    }
    auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
    std::fprintf(stderr, "[spade] generated_tokens=%zu ttft_ms=%.3f tpot_ms=%.3f tokens_per_s=%.1f\n", tokens,
                 tokens ? ms(first - t0) : 0.0,
                 tokens > 1 ? ms(last - first) / static_cast<double>(tokens - 1) : 0.0,
                 tokens ? tokens / std::chrono::duration<double>(last - t0).count() : 0.0);
    if (shutdown_after) cc.request_shutdown(rc == 0 ? "spade_submit: done" : "spade_submit: request failed");
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spade_submit: error: %s\n", e.what());
    return 2;
  }
}
