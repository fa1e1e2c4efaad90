// Page placements of the paged decode benchmark (bench_kernels.cu; docs/KERNELS.md section 6): block tables of
// `batch` sequences of `len` tokens over a pool of pages, shuffled / ascending / as common/page_allocator hands them
// out under a simulated serving workload, and statistics of their locality. Host code only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <numeric>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/page_allocator.h"

namespace spade::bench {

using nlohmann::json;

// Page placement of the paged benchmark caches (header comment; docs/KERNELS.md section 6).
// kRegionShuffled (diagnostic): sequence b owns the contiguous pages [b * max_pages, (b + 1) * max_pages), permuted
// at random within each aligned group of 2 MiB of K (or V) cache: no page order, but the fewest 2 MiB regions.
enum class Placement { kShuffled, kAscending, kAllocator, kRegionShuffled };

inline const char* placement_name(Placement p) {
  switch (p) {
    case Placement::kShuffled:
      return "shuffled";
    case Placement::kAscending:
      return "ascending";
    case Placement::kAllocator:
      return "allocator";
    case Placement::kRegionShuffled:
      return "region-shuffled";
  }
  return "?";
}

// Locality of block tables [batch, max_pages] over a pool of `pool_pages` pages of `page_bytes` bytes (per K or V
// cache): fraction of neighbouring entries that are the next page (contiguous) / a higher page (ascending), mean
// contiguous run length in pages, and 2 MiB regions of the cache touched per sequence against the fewest possible.
inline json placement_stats(const std::vector<int32_t>& bt, int batch, int max_pages, int pool_pages,
                            double page_bytes) {
  long long pairs = 0, contiguous = 0, ascending = 0, runs = 0;
  double regions = 0;
  for (int b = 0; b < batch; ++b) {
    const int32_t* row = bt.data() + static_cast<size_t>(b) * max_pages;
    std::vector<long long> reg;
    for (int i = 0; i < max_pages; ++i) {
      const long long first = static_cast<long long>(row[i] * page_bytes) >> 21;
      const long long last = static_cast<long long>((row[i] + 1) * page_bytes - 1) >> 21;
      for (long long g = first; g <= last; ++g) reg.push_back(g);
      if (i == 0) {
        ++runs;
        continue;
      }
      ++pairs;
      contiguous += row[i] == row[i - 1] + 1;
      ascending += row[i] > row[i - 1];
      runs += row[i] != row[i - 1] + 1;
    }
    std::sort(reg.begin(), reg.end());
    regions += static_cast<double>(std::unique(reg.begin(), reg.end()) - reg.begin());
  }
  json j;
  j["pool_pages"] = pool_pages;
  j["contiguous_pairs"] = pairs > 0 ? static_cast<double>(contiguous) / pairs : 1.0;
  j["ascending_pairs"] = pairs > 0 ? static_cast<double>(ascending) / pairs : 1.0;
  j["mean_run_pages"] = static_cast<double>(batch) * max_pages / static_cast<double>(runs);
  j["regions_2mib_per_seq"] = regions / batch;
  j["regions_2mib_per_seq_min"] = std::ceil(max_pages * page_bytes / static_cast<double>(1 << 21));
  return j;
}

// Block tables of `batch` sequences of `len` tokens as common/page_allocator hands them out under a simulated
// serving workload (the scheduling rules of inference_rank/engine.cpp):
//  * pool: twice the measured sequences' pages; <= 256 running sequences; FIFO admission that reserves the pages of
//    prompt + max_tokens; each step appends one decode token to every decoding sequence first, then prefill chunks
//    in arrival order within a 2048-token budget; a finished sequence releases its pages;
//  * background requests (always one waiting: a saturated server, the pool is the binding limit): prompts
//    log-uniform in [32, len] tokens, outputs uniform in [16, 2048] tokens; one in four is sparse and, once
//    prefilled, keeps only 4 sink tokens and a 32-token window (drop_range of the pages in between, every step,
//    like the engine);
//  * warm-up until 4 pools' worth of pages were handed out; then the `batch` measured requests (prompt `len`,
//    max_tokens 1024; they never finish, so all are resident at the end) arrive one per step behind the
//    background requests, and the tables of their first `len` tokens are read when every measured sequence has its
//    `len` prompt tokens.
struct SimResult {
  std::vector<int32_t> tables;  // [batch, max_pages]
  int pool_pages = 0;
  json info;
};

inline SimResult allocator_placement(int batch, int len, int ps, uint64_t seed) {
  const int max_pages = (len + ps - 1) / ps;
  const int pool = 2 * batch * max_pages;
  constexpr int kMaxSeqs = 256, kBudget = 2048, kSink = 4, kWindow = 32, kMeasuredMaxTokens = 1024;
  spade::PageAllocator alloc(pool, ps);
  std::mt19937_64 rng(seed);
  struct Req {
    uint64_t id;
    int prompt, max_tokens;
    bool sparse, measured;
    int reserved = 0;
  };
  std::deque<Req> waiting;
  std::vector<Req> running;  // admission (= arrival) order
  uint64_t next_id = 1;
  int reserved = 0;
  long long handed_out = 0, finished = 0, admitted = 0;
  auto new_background = [&] {
    std::uniform_real_distribution<double> u(std::log(32.0), std::log(std::max(64.0, static_cast<double>(len))));
    Req r{next_id++, static_cast<int>(std::exp(u(rng))), 16 + static_cast<int>(rng() % 2033), rng() % 4 == 0, false};
    r.prompt = std::min(r.prompt, pool * ps / 4);  // a request that could never fit would block the FIFO
    return r;
  };
  auto append = [&](Req& r, int n) {
    const int before = static_cast<int>(alloc.block_table(r.id).size());
    if (!alloc.append(r.id, n)) {
      std::fprintf(stderr, "allocator_placement: pool exhausted despite reservation\n");
      std::exit(1);
    }
    const int got = static_cast<int>(alloc.block_table(r.id).size()) - before;
    handed_out += got;
    reserved -= got;
    r.reserved -= got;
  };
  int measured_arrived = 0;
  bool measuring = false;
  for (long long step = 0;; ++step) {
    if (step > 10000000) {
      std::fprintf(stderr, "allocator_placement: simulation did not converge\n");
      std::exit(1);
    }
    if (!measuring && handed_out >= 4LL * pool) measuring = true;
    if (measuring && measured_arrived < batch) {
      waiting.push_back(Req{next_id++, len, kMeasuredMaxTokens, false, true});
      ++measured_arrived;
    }
    while (waiting.size() < 2) waiting.push_back(new_background());
    // FIFO admission with full reservation.
    while (!waiting.empty() && static_cast<int>(running.size()) < kMaxSeqs) {
      Req& r = waiting.front();
      const int need = alloc.pages_for(r.prompt + r.max_tokens);
      if (alloc.num_free_pages() - reserved < need) break;
      alloc.admit(r.id);
      r.reserved = need;
      reserved += need;
      running.push_back(r);
      waiting.pop_front();
      ++admitted;
    }
    // One engine step: decode tokens first, then prefill chunks in arrival order.
    int budget = kBudget;
    for (Req& r : running) {
      const int have = alloc.seq_len(r.id);
      // A measured sequence that reached max_tokens stays resident, idle, until the others are prefilled.
      if (have >= r.prompt && budget > 0 && !(r.measured && have >= r.prompt + r.max_tokens)) {
        append(r, 1);
        --budget;
      }
    }
    for (Req& r : running) {
      const int have = alloc.seq_len(r.id);
      if (have < r.prompt && budget > 0) {
        const int n = std::min(r.prompt - have, budget);
        append(r, n);
        budget -= n;
      }
    }
    // Finished sequences release their pages (and unused reservation); sparse ones drop their middle pages.
    for (size_t i = 0; i < running.size();) {
      Req& r = running[i];
      const int have = alloc.seq_len(r.id);
      if (!r.measured && have >= r.prompt + r.max_tokens) {
        reserved -= r.reserved;
        alloc.release(r.id);
        ++finished;
        running.erase(running.begin() + static_cast<long>(i));
        continue;
      }
      if (r.sparse && have >= r.prompt && have + 1 - kWindow > kSink) alloc.drop_range(r.id, kSink, have + 1 - kWindow);
      ++i;
    }
    if (measured_arrived == batch) {
      int done = 0;
      for (const Req& r : running) done += r.measured && alloc.seq_len(r.id) >= len;
      if (done == batch) break;
    }
  }
  SimResult res;
  res.pool_pages = pool;
  for (const Req& r : running) {
    if (!r.measured) continue;
    const auto& bt = alloc.block_table(r.id);
    res.tables.insert(res.tables.end(), bt.begin(), bt.begin() + max_pages);
  }
  if (static_cast<int>(res.tables.size()) != batch * max_pages) {
    std::fprintf(stderr, "allocator_placement: expected %d measured sequences\n", batch);
    std::exit(1);
  }
  res.info = {{"pool_pages", pool},
              {"pages_handed_out", handed_out},
              {"sequences_admitted", admitted},
              {"sequences_finished", finished},
              {"pool_usage_at_end", alloc.usage()}};
  return res;
}

// Block tables [batch, max_pages] of the placement, the pool's page count and the placement statistics.
struct Tables {
  std::vector<int32_t> table;
  int num_pages = 0;
  json stats;
};

inline Tables plan_tables(int batch, int len, int ps, int hkv, int D, uint64_t seed, Placement pl) {
  const int max_pages = (len + ps - 1) / ps;
  Tables t;
  t.num_pages = batch * max_pages;
  t.table.resize(t.num_pages);
  std::iota(t.table.begin(), t.table.end(), 0);
  json info;
  if (max_pages > 1) {
    if (pl == Placement::kAllocator) {
      SimResult sim = allocator_placement(batch, len, ps, seed);
      t.table = std::move(sim.tables);
      t.num_pages = sim.pool_pages;
      info = sim.info;
    } else if (pl == Placement::kRegionShuffled) {
      std::mt19937_64 rng(seed);
      const int group = std::max(1, static_cast<int>((1 << 21) / (2.0 * ps * hkv * D)));  // pages per 2 MiB
      for (int p0 = 0; p0 < t.num_pages; p0 += group) {
        std::shuffle(t.table.begin() + p0, t.table.begin() + std::min(t.num_pages, p0 + group), rng);
      }
    } else {
      std::mt19937_64 rng(seed);
      std::shuffle(t.table.begin(), t.table.end(), rng);
      if (pl == Placement::kAscending) {
        for (int b = 0; b < batch; ++b) {
          std::sort(t.table.begin() + static_cast<size_t>(b) * max_pages,
                    t.table.begin() + static_cast<size_t>(b + 1) * max_pages);
        }
      }
    }
  }
  t.stats = placement_stats(t.table, batch, max_pages, t.num_pages, 2.0 * ps * hkv * D);
  if (!info.is_null()) t.stats["simulation"] = info;
  return t;
}

}  // namespace spade::bench
