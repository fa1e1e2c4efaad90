// Helpers of the multi-process cluster tests (test_cluster.cpp: CPU over UCX; test_gpu_cluster.cu: GPU over a
// GpuLink): a client of the coordinator once the world is complete, and one greedy request streamed to its end.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client.h"
#include "tests/test_util.h"

namespace spade::test {

/// A program of this build, e.g. "cache_rank/cache_rank".
inline std::string bin(const std::string& rel) { return binary_dir() + "/" + rel; }

/// A CLIENT of the coordinator on 127.0.0.1:`port`, returned once the world is complete (registration within
/// `rendezvous`, completion within `complete`); throws std::runtime_error otherwise. `cluster_secret`: the
/// coordinator's (empty when it runs without one).
inline std::unique_ptr<coord::CoordinatorClient> cluster_client(int port,
                                                                std::chrono::milliseconds rendezvous = std::chrono::seconds(20),
                                                                std::chrono::milliseconds complete = std::chrono::seconds(30),
                                                                const std::string& cluster_secret = "") {
  using Clock = std::chrono::steady_clock;
  coord::ClientOptions o;
  o.coordinator_port = static_cast<uint16_t>(port);
  o.role = proto::CLIENT;
  o.cluster_secret = cluster_secret;
  auto c = std::make_unique<coord::CoordinatorClient>(o);
  c->rendezvous(Clock::now() + rendezvous);
  for (auto until = Clock::now() + complete; Clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(50)))
    if (c->query_status(Clock::now() + std::chrono::seconds(5)).world_complete()) return c;
  throw std::runtime_error("world never complete");
}

struct Outcome {
  std::vector<uint32_t> ids;
  std::string text;
  proto::FinishReason reason = proto::FINISH_NONE;
  std::string error;
};

struct GenerateOptions {
  bool ignore_eos = false;
  std::chrono::milliseconds timeout = std::chrono::seconds(60);  // for the final chunk
};

/// One greedy request of `max_tokens` for `prompt`, its chunks gathered until the final one; `on_tokens` sees the
/// token count after every chunk. On a timeout, `error` says so and `reason` stays FINISH_NONE.
inline Outcome generate(coord::CoordinatorClient& c, const std::string& prompt, int max_tokens,
                        const std::function<void(size_t)>& on_tokens = nullptr, GenerateOptions opt = {}) {
  using Clock = std::chrono::steady_clock;
  proto::GenerateRequest r;
  r.set_text(prompt);
  r.set_max_tokens(static_cast<uint32_t>(max_tokens));
  r.set_ignore_eos(opt.ignore_eos);
  r.mutable_sampling()->set_temperature(0);
  const uint64_t id = c.submit(r);
  Outcome o;
  for (auto until = Clock::now() + opt.timeout; Clock::now() < until;) {
    auto ch = c.next_chunk(until);
    if (!ch) break;
    if (ch->request_id() != id) continue;
    for (auto t : ch->token_ids()) o.ids.push_back(t);
    o.text += ch->text();
    if (on_tokens) on_tokens(o.ids.size());
    if (ch->finished()) {
      o.reason = ch->finish_reason();
      o.error = ch->error();
      return o;
    }
  }
  o.error = "no final chunk within " + std::to_string(opt.timeout.count() / 1000) + " s";
  return o;
}

/// A greedy request of `max_tokens` for `prompt` ("" = BOS alone); `force_dense` opts it out of sparse decoding.
inline proto::GenerateRequest greedy_request(const std::string& prompt, int max_tokens, bool ignore_eos = false,
                                             bool force_dense = false) {
  proto::GenerateRequest r;
  r.set_text(prompt);
  r.set_max_tokens(static_cast<uint32_t>(max_tokens));
  r.set_ignore_eos(ignore_eos);
  r.mutable_sampling()->set_temperature(0);
  if (force_dense) r.mutable_sparse()->set_force_dense(true);
  return r;
}

/// One request of several streamed together (stream()): its outcome and when its final chunk arrived.
struct StreamOutcome {
  Outcome outcome;
  std::chrono::steady_clock::time_point ended{};
  bool finished() const { return outcome.reason != proto::FINISH_NONE; }
};

/// Submits every request at once and gathers their chunks until all have finished or `timeout` passes (then the
/// unfinished ones keep FINISH_NONE). `on_chunk(i, s)` runs after each chunk of request i.
inline std::vector<StreamOutcome> stream(coord::CoordinatorClient& c, const std::vector<proto::GenerateRequest>& reqs,
                                         const std::function<void(size_t, const StreamOutcome&)>& on_chunk = nullptr,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  using Clock = std::chrono::steady_clock;
  std::vector<uint64_t> ids;
  for (const auto& r : reqs) ids.push_back(c.submit(r));
  std::vector<StreamOutcome> out(reqs.size());
  size_t open = reqs.size();
  for (auto until = Clock::now() + timeout; open > 0 && Clock::now() < until;) {
    auto ch = c.next_chunk(until);
    if (!ch) break;
    size_t i = 0;
    while (i < ids.size() && ids[i] != ch->request_id()) ++i;
    if (i == ids.size() || out[i].finished()) continue;
    Outcome& o = out[i].outcome;
    for (auto t : ch->token_ids()) o.ids.push_back(t);
    o.text += ch->text();
    if (ch->finished()) {
      o.reason = ch->finish_reason();
      o.error = ch->error();
      out[i].ended = Clock::now();
      --open;
    }
    if (on_chunk) on_chunk(i, out[i]);
  }
  return out;
}

}  // namespace spade::test
