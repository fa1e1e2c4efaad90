// The soak test of the serving cluster, shared by its CPU entry (test_soak.cpp: stories260K, UCX) and its GPU entries
// (test_soak.cu: GPU ranks over CUDA IPC on one GPU or NCCL on two): a real coordinator (with the OpenAI API),
// inference rank and cache rank (ApiCluster) with sparse decoding, under a bounded mixed load from several client
// threads —
// over the control port: requests past the sparse threshold, forced dense ones, short ones, ones cancelled
// mid-stream (CancelRequest) or abandoned (the client disconnects), malformed ones (a field out of range); over HTTP:
// streams, streams hung up on, malformed bodies, plain completions — with the cache rank SIGKILLed part-way through
// and a replacement started a few seconds later (rejoin: the pair re-handshakes and decodes sparsely again).
// At the end: every request ended (tokens and a finish reason, or an error naming its cause), none got stuck, the
// inference rank's KV pages are all free again and so are the replacement cache rank's, its and the coordinator's RSS
// stayed bounded, and the cluster still answers a greedy request exactly as before the load.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "tests/coordinator/api_cluster.h"
#include "tests/inference_rank/cluster_client.h"

namespace spade::soak {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// ---- the load's shape
/// What differs between the CPU and the GPU soak: the model, the ranks' flags and the load's timeline.
struct SoakSetup {
  std::string model;        // checkpoint directory
  std::string served_name;  // the OpenAI API's model name (the coordinator's --model basename)
  std::vector<std::string> inference_flags;  // sparse decoding from sparse_threshold tokens on
  std::vector<std::string> cache_flags;
  std::map<std::string, std::string> env;    // extra environment of every process
  std::chrono::seconds duration{24};         // wall time of the mixed load
  std::chrono::seconds kill_at{8};           // SIGKILL of the cache rank, counted from the start of the load
  std::chrono::seconds rejoin_at{12};        // its replacement starts (same index), counted from the start
  std::chrono::seconds stream_deadline{20};  // every request ends within this of its submission
  int short_max_tokens = 16;                 // "short" requests: prompt + this stays below the sparse threshold
  bool dense_batch_invariant = true;         // dense greedy output equals the reference whatever the batch
};

constexpr int kControlThreads = 4;      // clients of the control port
constexpr int kHttpThreads = 2;         // clients of the OpenAI API
constexpr uint32_t kSeed = 20;          // of every thread's random choices (thread i: kSeed + i)
constexpr int kReferenceTokens = 200;   // dense greedy references per prompt, computed before the load
constexpr auto kCancelGrace = 5s;       // a cancelled request's final chunk comes within this
constexpr long kRssSlackKiB = 64 * 1024;  // RSS after the load <= baseline * 1.5 + this
const std::vector<std::string> kPrompts = {"Once upon a time", "The little dog", "Lily wanted to", "One day, a bird"};

/// VmRSS of process `pid` in KiB (-1 when unreadable).
inline long vm_rss_kib(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

/// What one request was and how it ended, as its client saw it (classified after the load).
struct Record {
  std::string kind;              // "sparse", "dense", "short", "cancel", "disconnect", "malformed", "http-*"
  bool may_go_sparse = false;    // context can pass the sparse threshold and the request is not forced dense
  std::string prompt;
  int max_tokens = 0;
  bool ignore_eos = false;
  std::string bad_field;         // malformed: the field the error must name
  Clock::time_point submitted{}, ended{};
  bool finished = false;         // a final chunk / a complete HTTP reply arrived
  bool abandoned = false;        // the client went away on purpose (disconnect, hang-up)
  bool cancelled = false;        // the client sent a CancelRequest
  proto::FinishReason reason = proto::FINISH_NONE;
  std::string error;
  std::vector<uint32_t> ids;     // control port
  int tokens = 0;                // HTTP: usage.completion_tokens
  int chunks = 0;                // control port: chunks received
  int http_status = 0;
};

struct Soak {
  explicit Soak(const SoakSetup& s) : setup(s) {
    cl.model = s.model;
    cl.extra_env = s.env;
  }
  const SoakSetup& setup;
  test::ApiCluster cl;
  Clock::time_point start{}, end{};
  std::map<std::string, std::vector<uint32_t>> reference;  // prompt -> dense greedy ids (ignore_eos)
  std::mutex mu;
  std::vector<Record> records;
  std::vector<std::string> late_chunks;  // chunks that arrived after their request's final one
  std::vector<std::string> worker_errors;  // a client thread that could not go on

  /// Runs `body` and records what it threw.
  void guarded(const std::string& who, const std::function<void()>& body) {
    try {
      body();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(mu);
      worker_errors.push_back(who + ": " + e.what());
    }
  }

  void add(Record r) {
    std::lock_guard<std::mutex> lk(mu);
    records.push_back(std::move(r));
  }
};

// ---- control-port clients

/// Reads chunks of request `id` (others must not arrive: one request at a time per client) until its final one, or
/// `on_tokens` asks to stop reading (returns true), or the stream deadline.
inline void read_stream(coord::CoordinatorClient& c, uint64_t id, Record& r, Soak& s, const std::set<uint64_t>& cancelled,
                 const std::function<bool(size_t)>& on_tokens) {
  for (const auto until = r.submitted + s.setup.stream_deadline; Clock::now() < until;) {
    auto ch = c.next_chunk(until);
    if (!ch) break;
    if (ch->request_id() != id) {
      if (cancelled.count(ch->request_id())) continue;  // under way when it was cancelled
      std::lock_guard<std::mutex> lk(s.mu);
      s.late_chunks.push_back("request " + std::to_string(ch->request_id()) + " (while reading " + std::to_string(id) +
                              ")");
      continue;
    }
    ++r.chunks;
    for (auto t : ch->token_ids()) r.ids.push_back(t);
    if (ch->finished()) {
      r.finished = true;
      r.reason = ch->finish_reason();
      r.error = ch->error();
      r.ended = Clock::now();
      return;
    }
    if (on_tokens && on_tokens(r.ids.size())) return;
  }
}

inline void control_worker(Soak& s, int t) {
  std::mt19937 rng(kSeed + static_cast<uint32_t>(t));
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::unique_ptr<coord::CoordinatorClient> c = s.cl.control_client();
  std::set<uint64_t> cancelled_ids;  // of this client
  using Edit = std::function<void(proto::GenerateRequest&)>;
  const std::vector<std::pair<std::string, Edit>> bad = {
      {"spade.sparse_threshold", [](auto& r) { r.mutable_sparse()->set_sparse_threshold(3000000000u); }},
      {"spade.token_budget", [](auto& r) { r.mutable_sparse()->set_token_budget(4000000000u); }},
      {"maximum context length", [](auto& r) { r.set_max_tokens(4294967295u); }},
      {"stop token id 100000", [](auto& r) { r.mutable_sampling()->add_stop_token_ids(100000); }},
      {"top_p", [](auto& r) { r.mutable_sampling()->set_top_p(-0.5f); }},
  };
  while (Clock::now() < s.end) {
    Record r;
    r.prompt = kPrompts[static_cast<size_t>(pick(0, static_cast<int>(kPrompts.size()) - 1))];
    const int roll = pick(0, 99);
    proto::GenerateRequest g;
    int stop_after = 0;  // cancel / disconnect after this many tokens
    if (roll < 25) {
      r.kind = "sparse";
      r.max_tokens = pick(40, 220);
      r.ignore_eos = pick(0, 1) == 1;
      r.may_go_sparse = true;
    } else if (roll < 45) {
      r.kind = "dense";
      r.max_tokens = pick(20, kReferenceTokens);
      r.ignore_eos = true;  // compared with the reference
    } else if (roll < 60) {
      r.kind = "short";
      r.max_tokens = pick(1, s.setup.short_max_tokens);  // prompt + max_tokens stays below the sparse threshold
      r.ignore_eos = pick(0, 1) == 1;
    } else if (roll < 72) {
      r.kind = "cancel";
      r.max_tokens = 300;
      r.ignore_eos = true;
      r.may_go_sparse = true;
      stop_after = pick(2, 60);
    } else if (roll < 82) {
      r.kind = "disconnect";
      r.max_tokens = 300;
      r.ignore_eos = true;
      r.may_go_sparse = true;
      stop_after = pick(2, 60);
    } else {
      r.kind = "malformed";
      r.max_tokens = 40;
    }
    g = test::greedy_request(r.prompt, r.max_tokens, r.ignore_eos, r.kind == "dense");
    if (r.kind == "malformed") {
      const auto& [field, edit] = bad[static_cast<size_t>(pick(0, static_cast<int>(bad.size()) - 1))];
      r.bad_field = field;
      edit(g);
    }
    r.submitted = Clock::now();
    const uint64_t id = c->submit(g);
    if (r.kind == "cancel") {
      read_stream(*c, id, r, s, cancelled_ids, [&](size_t n) { return n >= static_cast<size_t>(stop_after); });
      if (!r.finished) {
        // The coordinator ends the request at the cancel with a FINISH_CANCELLED chunk (CoordinatorClient::cancel).
        // Chunks already under way still arrive before it; none may follow a final one.
        c->cancel(id, "soak: client cancels");
        r.cancelled = true;
        const Clock::time_point sent = Clock::now();
        for (const auto until = sent + kCancelGrace; Clock::now() < until;) {
          auto ch = c->next_chunk(until);
          if (!ch) break;
          if (ch->request_id() != id) continue;
          ++r.chunks;
          for (auto tok : ch->token_ids()) r.ids.push_back(tok);
          if (ch->finished()) {
            r.finished = true;
            r.reason = ch->finish_reason();
            r.error = ch->error();
            break;
          }
        }
        r.ended = r.finished ? Clock::now() : sent;
        cancelled_ids.insert(id);
      }
    } else if (r.kind == "disconnect") {
      read_stream(*c, id, r, s, cancelled_ids, [&](size_t n) { return n >= static_cast<size_t>(stop_after); });
      if (!r.finished) {  // hang up with the request in flight; the coordinator cancels it on the rank
        r.abandoned = true;
        r.ended = Clock::now();
        c.reset();
        c = s.cl.control_client();
        cancelled_ids.clear();
      }
    } else {
      read_stream(*c, id, r, s, cancelled_ids, nullptr);
    }
    s.add(std::move(r));
  }
  // Nothing may follow a request's final chunk.
  for (auto until = Clock::now() + 300ms; auto ch = c->next_chunk(until);) {
    if (cancelled_ids.count(ch->request_id())) continue;
    std::lock_guard<std::mutex> lk(s.mu);
    s.late_chunks.push_back("request " + std::to_string(ch->request_id()) + " after the load");
  }
}

// ---- HTTP clients (HTTP/1.0: the reply, streamed or not, ends where the connection does)

/// Parses an HTTP/1.0 reply to a completion (plain or SSE) into `r`.
inline void parse_http_reply(const std::string& raw, Record& r) {
  const size_t sp = raw.find(' ');
  if (raw.rfind("HTTP/1.", 0) != 0 || sp == std::string::npos) return;
  r.http_status = std::atoi(raw.c_str() + sp + 1);
  const size_t hdr_end = raw.find("\r\n\r\n");
  if (hdr_end == std::string::npos) return;
  const std::string body = raw.substr(hdr_end + 4);
  auto take = [&](const json& j) {
    if (j.contains("error") && j["error"].is_object()) {
      r.reason = proto::FINISH_ERROR;
      r.error = j["error"].value("message", std::string("(no message)"));
    }
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const json& fr = j["choices"][0]["finish_reason"];
      if (fr.is_string()) {
        const std::string f = fr.get<std::string>();
        r.reason = f == "length" ? proto::FINISH_LENGTH : f == "stop" ? proto::FINISH_STOP : proto::FINISH_ERROR;
        if (r.reason == proto::FINISH_ERROR) r.error = "finish_reason " + f;
      }
    }
    if (j.contains("usage") && j["usage"].is_object()) r.tokens = j["usage"].value("completion_tokens", 0);
  };
  if (body.rfind("data: ", 0) == 0) {  // SSE: complete only with its [DONE]
    std::istringstream in(body);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("data: ", 0) != 0) continue;
      const std::string d = line.substr(6);
      if (d == "[DONE]") {
        r.finished = true;
        continue;
      }
      take(json::parse(d, nullptr, false));
    }
  } else {
    const json j = json::parse(body, nullptr, false);
    r.finished = !j.is_discarded();
    if (r.finished) take(j);
  }
}

inline void http_worker(Soak& s, int t) {
  std::mt19937 rng(kSeed + static_cast<uint32_t>(t));
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const std::string m = s.setup.served_name;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":1e999})", "1e999"},
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":)", "JSON"},
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":-3})", "max_tokens"},
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":9223372036854775807})", "max_tokens"},
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":8,"spade":{"token_budget":0}})", "spade.token_budget"},
      {R"({"model":")" + m + R"(","prompt":"Hi","max_tokens":8,"temperature":"hot"})", "temperature"},
  };
  while (Clock::now() < s.end) {
    Record r;
    r.prompt = kPrompts[static_cast<size_t>(pick(0, static_cast<int>(kPrompts.size()) - 1))];
    const int roll = pick(0, 99);
    const bool dense = pick(0, 1) == 1;
    r.max_tokens = pick(8, 200);
    r.ignore_eos = pick(0, 1) == 1;
    r.may_go_sparse = !dense;
    json req = {{"model", s.setup.served_name}, {"prompt", r.prompt},    {"max_tokens", r.max_tokens},
                {"temperature", 0},       {"ignore_eos", r.ignore_eos}, {"spade", {{"selection", dense ? "dense" : "auto"}}}};
    std::string body;
    if (roll < 40) {
      r.kind = "http-stream";
      req["stream"] = true;
      req["stream_options"] = {{"include_usage", true}};
    } else if (roll < 60) {
      r.kind = "http-hangup";
      req["stream"] = true;
      req["stream_options"] = {{"include_usage", true}};
      req["max_tokens"] = r.max_tokens = 300;
      req["ignore_eos"] = r.ignore_eos = true;
    } else if (roll < 80) {
      r.kind = "http-malformed";
      const auto& b = bad[static_cast<size_t>(pick(0, static_cast<int>(bad.size()) - 1))];
      body = b.first;
      r.bad_field = b.second;
      r.may_go_sparse = false;
    } else {
      r.kind = "http-plain";
    }
    if (body.empty()) body = req.dump();
    r.submitted = Clock::now();
    test::RawClient rc(s.cl.http_port);
    rc.send("POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
            std::to_string(body.size()) + "\r\n\r\n" + body);
    if (r.kind == "http-hangup") {
      const std::string& got = rc.read_until("data: ", pick(2, 8), s.setup.stream_deadline);
      if (got.rfind("HTTP/1.1 200 ", 0) == 0 && got.find("data: [DONE]") == std::string::npos) {
        r.abandoned = true;
        r.ended = Clock::now();
        rc.close();
        s.add(std::move(r));
        continue;
      }
    }
    const std::string raw = rc.read_until("\x01never\x01", 1, s.setup.stream_deadline);  // to EOF
    r.ended = Clock::now();
    parse_http_reply(raw, r);
    if (r.ended - r.submitted >= s.setup.stream_deadline) r.finished = false;  // not closed in time
    if (!r.finished && r.error.empty()) r.error = "incomplete reply: " + raw.substr(0, 300);
    s.add(std::move(r));
  }
}

/// Runs the soak with `setup` and checks everything the file comment lists (gtest assertions).
inline void run_soak(const SoakSetup& setup) {
  Soak s(setup);
  s.cl.start_coordinator({});
  s.cl.start_ranks({{}, setup.inference_flags, setup.cache_flags});
  ASSERT_TRUE(s.cl.wait_ready(s.cl.http_port)) << s.cl.logs();
  ASSERT_TRUE(s.cl.wait_ready(s.cl.inference_metrics_port)) << s.cl.logs();
  auto c = s.cl.control_client();
  auto inf_metric = [&](const std::string& name) {
    const auto m = s.cl.metrics(s.cl.inference_metrics_port);
    const auto it = m.find(name);
    return it == m.end() ? -1.0 : it->second;
  };

  // References: each prompt's dense greedy continuation (also warms every code path before the baselines).
  for (const auto& p : kPrompts) {
    const auto st = test::stream(*c, {test::greedy_request(p, kReferenceTokens, true, true)});
    ASSERT_EQ(st[0].outcome.reason, proto::FINISH_LENGTH) << st[0].outcome.error << s.cl.logs();
    s.reference[p] = st[0].outcome.ids;
  }
  test::GenerateOptions past_eos;
  past_eos.ignore_eos = true;  // random weights (the GPU checkpoint) may emit EOS before the sparse threshold
  const test::Outcome before_sparse = test::generate(*c, "Once upon a time", 120, nullptr, past_eos);
  ASSERT_EQ(before_sparse.reason, proto::FINISH_LENGTH) << before_sparse.error << s.cl.logs();
  std::this_thread::sleep_for(300ms);  // the rank's metrics follow its loop
  ASSERT_GT(inf_metric("spade_sparse_sequence_steps_total"), 0) << "the load must exercise sparse decoding";
  const double kv_idle = inf_metric("spade_kv_cache_usage_perc");
  const long inf_rss0 = vm_rss_kib(s.cl.inf->pid()), coord_rss0 = vm_rss_kib(s.cl.coord->pid());
  ASSERT_GE(kv_idle, 0);
  ASSERT_GT(inf_rss0, 0);
  ASSERT_GT(coord_rss0, 0);

  // The load.
  s.start = Clock::now();
  s.end = s.start + setup.duration;
  std::vector<std::thread> threads;
  for (int t = 0; t < kControlThreads; ++t)
    threads.emplace_back([&s, t] { s.guarded("control client " + std::to_string(t), [&] { control_worker(s, t); }); });
  for (int t = kControlThreads; t < kControlThreads + kHttpThreads; ++t)
    threads.emplace_back([&s, t] { s.guarded("HTTP client " + std::to_string(t), [&] { http_worker(s, t); }); });
  // Part-way: the cache rank dies. Requests in flight on the sparse path fail with an error naming the cache rank,
  // later ones are served densely until the replacement has rejoined, then sparsely again.
  std::this_thread::sleep_until(s.start + setup.kill_at);
  const Clock::time_point killed_at = Clock::now();
  s.cl.cache->signal(SIGKILL);
  Clock::time_point degraded_at{};
  for (auto until = Clock::now() + 10s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
    if (http::http_request("127.0.0.1", static_cast<uint16_t>(s.cl.inference_metrics_port), "GET", "/ready", "", {},
                           2s)
            .body.find("degraded") != std::string::npos) {
      degraded_at = Clock::now();
      break;
    }
  }
  // The replacement: same rank and index, a fresh process (a restarted pod); the pair is whole once it re-paired.
  std::this_thread::sleep_until(s.start + setup.rejoin_at);
  s.cl.start_cache(setup.cache_flags);
  Clock::time_point whole_at{};
  for (auto until = Clock::now() + 20s; Clock::now() < until; std::this_thread::sleep_for(50ms)) {
    if (inf_metric("spade_pair_degraded") == 0) {
      whole_at = Clock::now();
      break;
    }
  }
  const double sparse_at_rejoin = inf_metric("spade_sparse_sequence_steps_total");
  for (auto& th : threads) th.join();
  const auto load_end = Clock::now();
  ASSERT_NE(degraded_at, Clock::time_point{}) << "the inference rank never said it is degraded\n" << s.cl.logs();
  ASSERT_NE(whole_at, Clock::time_point{}) << "the pair never became whole after the rejoin\n" << s.cl.logs();
  ASSERT_LT(whole_at, s.end) << "the rejoin came after the load";

  // Classify every request.
  std::map<std::string, int> table;  // "kind: outcome" -> count
  std::vector<std::string> problems;
  auto problem = [&](const Record& r, const std::string& what) {
    problems.push_back(r.kind + " (prompt \"" + r.prompt + "\", max_tokens " + std::to_string(r.max_tokens) + ", at " +
                       std::to_string(std::chrono::duration<double>(r.submitted - s.start).count()) + " s): " + what);
  };
  int after_degraded = 0;
  for (const Record& r : s.records) {
    const bool http = r.kind.rfind("http-", 0) == 0;
    const int n = http ? r.tokens : static_cast<int>(r.ids.size());
    if (r.submitted > degraded_at) ++after_degraded;
    std::string outcome;
    if (r.abandoned) {
      outcome = "client went away";
    } else if (r.cancelled && !r.finished) {
      outcome = "cancelled, no final chunk";
      problem(r, "cancelled over the control port, but no final chunk within " +
                     std::to_string(std::chrono::duration<double>(kCancelGrace).count()) + " s");
    } else if (!r.finished) {
      outcome = "STUCK";
      problem(r, "no end within " + std::to_string(setup.stream_deadline.count()) + " s: " + r.error);
    } else if (r.kind == "malformed" || r.kind == "http-malformed") {
      outcome = "rejected";
      if (r.reason != proto::FINISH_ERROR || n != 0) problem(r, "a malformed request ran: " + r.error);
      if (r.error.find(r.bad_field) == std::string::npos) problem(r, "error does not name " + r.bad_field + ": " + r.error);
      if (!http && (r.chunks != 1 || r.error.find("invalid request") == std::string::npos))
        problem(r, std::to_string(r.chunks) + " chunks, error: " + r.error);
      if (http && r.http_status != 400) problem(r, "HTTP " + std::to_string(r.http_status) + ": " + r.error);
    } else if (r.reason == proto::FINISH_ERROR) {
      outcome = "error: cache rank lost";
      // Only a request that may have been on the sparse path when the cache rank died may fail, and it says why.
      if (!r.may_go_sparse || r.submitted > degraded_at || r.ended < killed_at)
        problem(r, "unexpected error: " + r.error);
      if (r.error.find("cache rank 2") == std::string::npos) problem(r, "error does not name the cache rank: " + r.error);
    } else if (r.reason == proto::FINISH_CANCELLED) {
      outcome = "cancelled";
      if (r.kind != "cancel") problem(r, "cancelled without a cancel: " + r.error);
    } else if (r.reason == proto::FINISH_LENGTH || r.reason == proto::FINISH_STOP) {
      outcome = r.reason == proto::FINISH_LENGTH ? "length" : "stop";
      if (r.reason == proto::FINISH_LENGTH && n != r.max_tokens)
        problem(r, std::to_string(n) + " tokens for finish_reason length");
      if (r.reason == proto::FINISH_STOP && (r.ignore_eos || n > r.max_tokens))
        problem(r, "finish_reason stop with ignore_eos or too many tokens (" + std::to_string(n) + ")");
      if (r.kind == "dense" && setup.dense_batch_invariant) {
        const auto& ref = s.reference[r.prompt];
        if (!std::equal(r.ids.begin(), r.ids.end(), ref.begin()))
          problem(r, "dense greedy output differs from the reference (batch invariance)");
      }
      if (r.kind == "cancel" && r.reason != proto::FINISH_LENGTH) problem(r, "a cancelled request ended 'stop'");
    } else {
      outcome = "finish reason " + std::to_string(r.reason);
      problem(r, "unexpected finish reason " + std::to_string(r.reason) + ": " + r.error);
    }
    if (!r.abandoned && r.finished && r.ended - r.submitted > setup.stream_deadline) problem(r, "ended past the deadline");
    ++table[r.kind + ": " + outcome];
  }
  std::string summary;
  for (const auto& [k, v] : table) summary += "  " + k + std::string(k.size() < 36 ? 36 - k.size() : 1, ' ') +
                                               std::to_string(v) + "\n";
  std::printf("soak outcomes (%zu requests, %d submitted after the pair was degraded):\n%s", s.records.size(),
              after_degraded, summary.c_str());
  EXPECT_TRUE(problems.empty()) << problems.size() << " problems, first: " << problems.front() << "\n"
                                << (problems.size() > 1 ? problems[1] : "") << "\n" << s.cl.logs();
  EXPECT_TRUE(s.worker_errors.empty()) << s.worker_errors.front();
  EXPECT_TRUE(s.late_chunks.empty()) << s.late_chunks.size() << " chunks after a final one, first: "
                                     << s.late_chunks.front();
  EXPECT_GE(s.records.size(), 40u) << "the load was too thin to mean anything";
  EXPECT_GT(after_degraded, 0) << "no request was served after the kill";
  EXPECT_GT(table["sparse: error: cache rank lost"] + table["sparse: length"] + table["sparse: stop"], 0);

  // No leak: every page back, nothing running or waiting, RSS bounded.
  bool idle = false;
  double kv = -1;
  for (auto until = Clock::now() + 10s; !idle && Clock::now() < until; std::this_thread::sleep_for(100ms)) {
    kv = inf_metric("spade_kv_cache_usage_perc");
    idle = inf_metric("spade_num_requests_running") == 0 && inf_metric("spade_num_requests_waiting") == 0 &&
           kv == kv_idle;
  }
  EXPECT_TRUE(idle) << "KV usage " << kv << " (idle " << kv_idle << "), running "
                    << inf_metric("spade_num_requests_running") << ", waiting "
                    << inf_metric("spade_num_requests_waiting") << "\n" << s.cl.logs();
  const long inf_rss1 = vm_rss_kib(s.cl.inf->pid()), coord_rss1 = vm_rss_kib(s.cl.coord->pid());
  EXPECT_LE(inf_rss1, inf_rss0 * 3 / 2 + kRssSlackKiB) << "inference rank RSS before " << inf_rss0 << " KiB";
  EXPECT_LE(coord_rss1, coord_rss0 * 3 / 2 + kRssSlackKiB) << "coordinator RSS before " << coord_rss0 << " KiB";

  // The cluster still serves: the same dense greedy request gives the same tokens as before the load, over the
  // control port and over HTTP.
  const auto after = test::stream(*c, {test::greedy_request(kPrompts[0], kReferenceTokens, true, true)});
  EXPECT_EQ(after[0].outcome.reason, proto::FINISH_LENGTH) << after[0].outcome.error << s.cl.logs();
  EXPECT_EQ(after[0].outcome.ids, s.reference[kPrompts[0]]);
  const json req = {{"model", setup.served_name}, {"prompt", kPrompts[0]}, {"max_tokens", kReferenceTokens},
                    {"temperature", 0},       {"ignore_eos", true},     {"spade", {{"selection", "dense"}}}};
  const http::HttpResponse h = s.cl.post("/v1/completions", req.dump());
  ASSERT_EQ(h.status, 200) << h.body;
  EXPECT_EQ(json::parse(h.body)["choices"][0]["text"].get<std::string>(), after[0].outcome.text);
  EXPECT_TRUE(s.cl.inf->running());
  EXPECT_TRUE(s.cl.coord->running());
  EXPECT_EQ(inf_metric("spade_pair_degraded"), 0) << "the pair is whole again after the rejoin";
  EXPECT_GT(inf_metric("spade_sparse_sequence_steps_total"), sparse_at_rejoin)
      << "no request decoded sparsely after the rejoin";
  // The replacement cache rank holds no sequence once the load is over (every release reached it: on the GPU pair
  // by the idle flush).
  {
    double cache_seqs = -1;
    for (auto until = Clock::now() + 10s; Clock::now() < until; std::this_thread::sleep_for(100ms)) {
      const auto m = s.cl.metrics(s.cl.cache_metrics_port);
      const auto it = m.find("spade_cache_sequences");
      cache_seqs = it == m.end() ? -1 : it->second;
      if (cache_seqs == 0) break;
    }
    EXPECT_EQ(cache_seqs, 0) << "the replacement cache rank leaked sequences\n" << s.cl.logs();
  }
  EXPECT_TRUE(s.cl.cache->running());

  std::printf("soak summary: %zu requests in %.1f s, %zu problems; cache rank killed at %.1f s, pair degraded %.2f s "
              "later, whole again at %.1f s (replacement started at %.1f s); KV usage %.3f (idle %.3f); RSS KiB "
              "inference %ld -> %ld, coordinator %ld -> %ld\n",
              s.records.size(), std::chrono::duration<double>(load_end - s.start).count(), problems.size(),
              std::chrono::duration<double>(killed_at - s.start).count(),
              std::chrono::duration<double>(degraded_at - killed_at).count(),
              std::chrono::duration<double>(whole_at - s.start).count(),
              std::chrono::duration<double>(setup.rejoin_at).count(), kv, kv_idle, inf_rss0, inf_rss1, coord_rss0,
              coord_rss1);
  c->request_shutdown("soak done");
  EXPECT_EQ(s.cl.inf->wait_exit(10s), 0) << s.cl.logs();
  EXPECT_EQ(s.cl.cache->wait_exit(10s), 0) << s.cl.logs();
  EXPECT_EQ(s.cl.coord->wait_exit(10s), 0) << s.cl.logs();
}

}  // namespace spade::soak
