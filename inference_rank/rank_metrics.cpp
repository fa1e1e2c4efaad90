#include "inference_rank/rank_metrics.h"

#include <fmt/format.h>

#include <filesystem>

namespace spade {

using metrics::Registry;

std::string metrics_model_name(const std::string& served_model_name, const std::string& model_dir) {
  if (!served_model_name.empty()) return served_model_name;
  const std::filesystem::path dir = std::filesystem::path(model_dir).lexically_normal();
  return dir.has_filename() ? dir.filename().string() : dir.parent_path().filename().string();
}

InferenceMetrics::InferenceMetrics(Registry& r, const SparseOptions& sparse, const char* transport,
                                   const std::string& model_name)
    : running_(r.gauge("spade_num_requests_running", "Number of requests in the running batch.").with()),
      waiting_(r.gauge("spade_num_requests_waiting", "Number of requests waiting to be scheduled.").with()),
      kv_usage_(r.gauge("spade_kv_cache_usage_perc", "Fraction of the local KV-cache pages in use (0..1).").with()),
      prompt_tokens_(r.counter("spade_prompt_tokens_total", "Prefilled prompt tokens.").with()),
      generation_tokens_(r.counter("spade_generation_tokens_total", "Generated tokens.").with()),
      failures_(r.counter("spade_request_failure_total", "Requests ended by an error.").with()),
      success_(r.counter("spade_request_success_total", "Finished requests by finish reason (stop, length, abort).",
                         {"finished_reason"})),
      ttft_(r.histogram("spade_time_to_first_token_seconds", "Time to first token (submit to first token).",
                        metrics::latency_buckets_seconds())
                .with()),
      itl_(r.histogram("spade_inter_token_latency_seconds", "Time between consecutive tokens of a request (TPOT).",
                       metrics::token_latency_buckets_seconds())
               .with()),
      e2e_(r.histogram("spade_e2e_request_latency_seconds", "End-to-end request latency on the inference rank.",
                       metrics::latency_buckets_seconds())
               .with()),
      queue_(r.histogram("spade_request_queue_time_seconds", "Time a request waited before entering the batch.",
                         metrics::latency_buckets_seconds())
                 .with()),
      stalls_(r.counter("spade_selection_stalls_total",
                        "Layer packs whose selection had not arrived when the pack started (sparse decode).")
                  .with()),
      stall_seconds_(r.counter("spade_selection_stall_seconds_total", "Time spent waiting for late selections.").with()),
      fallbacks_(r.counter("spade_dense_fallbacks_total",
                           "Sequences past the sparse threshold decoded densely because no cache rank was usable.")
                     .with()),
      switches_(r.counter("spade_sparse_switches_total", "Sequences switched to sparse decoding (INIT bulk ships).")
                    .with()),
      sparse_steps_(r.counter("spade_sparse_sequence_steps_total", "(sequence, step) pairs decoded sparsely.").with()),
      failed_seqs_(r.counter("spade_sparse_failed_sequences_total",
                             "Sequences failed because their cache rank failed during sparse decoding.")
                       .with()),
      bytes_sent_(r.counter("spade_transfer_bytes_total", "Data-plane bytes moved, by direction and transport.",
                            {"direction", "transport"})
                      .with({"send", transport})),
      bytes_recv_(r.counter("spade_transfer_bytes_total", "Data-plane bytes moved, by direction and transport.",
                            {"direction", "transport"})
                      .with({"recv", transport})),
      select_seconds_(r.counter("spade_cache_select_seconds_total",
                                "Cache-rank selection time reported back with the selections.")
                          .with()),
      pages_dropped_(r.counter("spade_kv_pages_dropped_total",
                               "Local KV pages freed early: sparse sequences keep only what they still attend.")
                         .with()),
      prefix_queries_(r.counter("spade_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.").with()),
      prefix_hits_(r.counter("spade_prefix_cache_hits_total",
                             "Prompt tokens whose KV the prefix cache supplied (not recomputed).")
                       .with()),
      v_prefix_queries_(r.counter("vllm:prefix_cache_queries_total",
                                  "Prefix cache queries, in terms of number of queried tokens.", {"model_name"})
                            .with({model_name})),
      v_prefix_hits_(r.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
                               {"model_name"})
                         .with({model_name})),
      retained_reused_(r.counter("spade_retained_prefix_reused_tokens_total",
                                 "Context tokens of sparse switches not shipped to the cache rank because it retained "
                                 "that prefix of an ended request.")
                           .with()),
      pair_degraded_(r.gauge("spade_pair_degraded",
                             "1 while the paired cache rank is lost (down or its link failed): every request decodes "
                             "densely; else 0.")
                         .with()),
      v_running_(r.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                         {"model_name"})
                     .with({model_name})),
      v_waiting_(r.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", {"model_name"})
                     .with({model_name})),
      v_kv_usage_(r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", {"model_name"})
                      .with({model_name})),
      v_prompt_tokens_(r.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", {"model_name"})
                           .with({model_name})),
      v_generation_tokens_(
          r.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", {"model_name"})
              .with({model_name})),
      v_success_(r.counter("vllm:request_success_total", "Count of successfully processed requests.",
                           {"model_name", "finished_reason"})),
      v_itl_(r.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                         metrics::vllm_inter_token_latency_buckets(), {"model_name"})
                 .with({model_name})),
      v_queue_(r.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                           metrics::vllm_request_latency_buckets(), {"model_name"})
                   .with({model_name})),
      model_name_(model_name) {
  for (const char* reason : {"stop", "length", "abort"}) {  // zero series, so rate() works
    success_.with({reason});
    v_success_.with({model_name_, reason});
  }
  r.gauge("spade_sparse_config_info", "The rank's sparse-decoding settings (value 1).",
          {"selection", "sparse_threshold", "token_budget", "local_window", "sink_tokens", "query_window",
           "layers_per_pack"})
      .with({selection_mode_name(sparse.mode), std::to_string(sparse.sparse_threshold),
             std::to_string(sparse.selection.token_budget), std::to_string(sparse.selection.local_window),
             std::to_string(sparse.selection.sink_tokens), std::to_string(sparse.selection.query_window),
             std::to_string(sparse.layers_per_pack)})
      .set(1);
}

void InferenceMetrics::on_scheduled(double queue_time) {
  queue_.observe(queue_time);
  v_queue_.observe(queue_time);
}

void InferenceMetrics::on_prompt_tokens(int n) {
  prompt_tokens_.inc(n);
  v_prompt_tokens_.inc(n);
}

void InferenceMetrics::on_token(bool first, double latency) {
  generation_tokens_.inc();
  v_generation_tokens_.inc();
  if (first) {
    ttft_.observe(latency);
  } else {
    itl_.observe(latency);
    v_itl_.observe(latency);
  }
}

void InferenceMetrics::on_finished(FinishReason reason, double e2e, int, int) {
  e2e_.observe(e2e);
  if (reason == FinishReason::Error) {
    failures_.inc();
  } else {
    success_.with({finish_reason_name(reason)}).inc();
    v_success_.with({model_name_, finish_reason_name(reason)}).inc();
  }
}

void InferenceMetrics::update(const EngineStats& engine, const SparseStats* sparse, const pair::LinkStats* link) {
  running_.set(engine.num_running);
  waiting_.set(engine.num_waiting);
  kv_usage_.set(engine.kv_cache_usage);
  v_running_.set(engine.num_running);
  v_waiting_.set(engine.num_waiting);
  v_kv_usage_.set(engine.kv_cache_usage);
  pages_dropped_.inc(static_cast<double>(engine.dropped_pages - last_pages_dropped_));
  last_pages_dropped_ = engine.dropped_pages;
  const double queried = static_cast<double>(engine.prefix_queried_tokens - last_prefix_queries_);
  const double hits = static_cast<double>(engine.prefix_hit_tokens - last_prefix_hits_);
  prefix_queries_.inc(queried);
  v_prefix_queries_.inc(queried);
  prefix_hits_.inc(hits);
  v_prefix_hits_.inc(hits);
  last_prefix_queries_ = engine.prefix_queried_tokens;
  last_prefix_hits_ = engine.prefix_hit_tokens;
  if (sparse) {
    stalls_.inc(static_cast<double>(sparse->stalls - last_sparse_.stalls));
    stall_seconds_.inc((sparse->stall_ms - last_sparse_.stall_ms) / 1e3);
    fallbacks_.inc(static_cast<double>(sparse->dense_fallbacks - last_sparse_.dense_fallbacks));
    switches_.inc(static_cast<double>(sparse->switches - last_sparse_.switches));
    sparse_steps_.inc(static_cast<double>(sparse->sparse_seq_steps - last_sparse_.sparse_seq_steps));
    failed_seqs_.inc(static_cast<double>(sparse->failed_seqs - last_sparse_.failed_seqs));
    retained_reused_.inc(static_cast<double>(sparse->retained_reused_tokens - last_sparse_.retained_reused_tokens));
    last_sparse_.retained_reused_tokens = sparse->retained_reused_tokens;
    last_sparse_.stalls = sparse->stalls;
    last_sparse_.stall_ms = sparse->stall_ms;
    last_sparse_.dense_fallbacks = sparse->dense_fallbacks;
    last_sparse_.switches = sparse->switches;
    last_sparse_.sparse_seq_steps = sparse->sparse_seq_steps;
    last_sparse_.failed_seqs = sparse->failed_seqs;
  }
  if (link) {
    bytes_sent_.inc(static_cast<double>(link->bytes_sent - last_link_.bytes_sent));
    bytes_recv_.inc(static_cast<double>(link->bytes_received - last_link_.bytes_received));
    select_seconds_.inc((link->cache_select_ms - last_link_.cache_select_ms) / 1e3);
    last_link_ = *link;
  }
}

}  // namespace spade
