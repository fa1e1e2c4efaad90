// The inference rank's Prometheus metrics (served on --metrics-port /metrics). vLLM's names with a spade_ prefix
// where vLLM has them, Spade's own otherwise. Every series is documented in docs/ARCHITECTURE.md ("Metrics").
//
//   spade_num_requests_running / _waiting          gauge    requests in the running batch / queued
//   spade_kv_cache_usage_perc                      gauge    0..1, used fraction of the local KV pages
//   spade_prompt_tokens_total                      counter  prefilled prompt tokens
//   spade_generation_tokens_total                  counter  generated tokens
//   spade_request_success_total{finished_reason}   counter  finished requests: stop | length | abort
//   spade_request_failure_total                    counter  requests ended by an error
//   spade_time_to_first_token_seconds              histogram  submit -> first token (TTFT)
//   spade_inter_token_latency_seconds              histogram  between consecutive tokens of a request (TPOT)
//   spade_e2e_request_latency_seconds              histogram  submit -> last event
//   spade_request_queue_time_seconds               histogram  submit -> entering the running batch
//   spade_selection_stalls_total                   counter  layer packs whose selection was late (sparse decode)
//   spade_selection_stall_seconds_total            counter  time spent waiting for late selections
//   spade_dense_fallbacks_total                    counter  sequences past the threshold decoded densely (no cache rank)
//   spade_sparse_switches_total                    counter  sequences switched to sparse decoding (INIT bulk ships)
//   spade_sparse_sequence_steps_total              counter  (sequence, step) pairs decoded sparsely
//   spade_sparse_failed_sequences_total            counter  sequences failed because their cache rank failed
//   spade_kv_pages_dropped_total                   counter  local KV pages freed early (page dropping of sparse sequences)
//   spade_prefix_cache_queries_total               counter  prompt tokens looked up in the prefix cache
//   spade_prefix_cache_hits_total                  counter  of those, tokens whose KV was reused (not recomputed)
//   spade_retained_prefix_reused_tokens_total      counter  prefix tokens not shipped: the cache rank retained them
//   spade_transfer_bytes_total{direction,transport} counter  data-plane bytes, direction send|recv
//   spade_cache_select_seconds_total               counter  cache-rank selection time reported with the selections
//   spade_sparse_config_info{...}                  gauge    1, labels = the rank's sparse settings
//   spade_pair_degraded                            gauge    1 while the paired cache rank is down or its link failed
//                                                           (every request decodes densely), else 0
//
// vLLM's exact names, alongside (same values as their spade_ twins; vLLM's buckets; label model_name = the served
// model name, which the coordinator sends in the ClusterView):
//   vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)          gauge
//   vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total{finished_reason}  counter
//   vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens)                          counter
//   vllm:inter_token_latency_seconds, vllm:request_queue_time_seconds                               histogram
// (vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds are the coordinator's: its API sees the
// whole request, and each vllm: name lives on one kind of process so that sums over targets count each once.)
#pragma once

#include <cstdint>
#include <string>

#include "pair/link.h"
#include "common/metrics.h"
#include "inference_rank/engine.h"
#include "inference_rank/sparse_attention.h"

namespace spade {

/// The model_name label of the vllm: series: the served model name the coordinator announced (ClusterView), else
/// (a coordinator without an API) the checkpoint directory's name, the coordinator's default.
std::string metrics_model_name(const std::string& served_model_name, const std::string& model_dir);

class InferenceMetrics : public EngineObserver {
 public:
  /// `model_name`: the value of the vllm: series' model_name label (metrics_model_name()).
  InferenceMetrics(metrics::Registry& registry, const SparseOptions& sparse, const char* transport,
                   const std::string& model_name);

  void on_scheduled(double queue_time) override;
  void on_prompt_tokens(int n) override;
  void on_token(bool first, double latency) override;
  void on_finished(FinishReason reason, double e2e, int prompt_tokens, int generated) override;

  /// Gauges from the engine, counters from the cumulative sparse / link statistics (by difference).
  void update(const EngineStats& engine, const SparseStats* sparse, const pair::LinkStats* link);
  /// spade_pair_degraded: 1 while the pair has no usable cache rank (it was lost), else 0.
  void set_pair_degraded(bool degraded) { pair_degraded_.set(degraded ? 1 : 0); }

 private:
  metrics::Gauge &running_, &waiting_, &kv_usage_;
  metrics::Counter &prompt_tokens_, &generation_tokens_, &failures_;
  metrics::Family<metrics::Counter>& success_;
  metrics::Histogram &ttft_, &itl_, &e2e_, &queue_;
  metrics::Counter &stalls_, &stall_seconds_, &fallbacks_, &switches_, &sparse_steps_, &failed_seqs_;
  metrics::Counter &bytes_sent_, &bytes_recv_, &select_seconds_, &pages_dropped_;
  metrics::Counter &prefix_queries_, &prefix_hits_, &v_prefix_queries_, &v_prefix_hits_, &retained_reused_;
  metrics::Gauge& pair_degraded_;
  // vLLM's names (model_name label)
  metrics::Gauge &v_running_, &v_waiting_, &v_kv_usage_;
  metrics::Counter &v_prompt_tokens_, &v_generation_tokens_;
  metrics::Family<metrics::Counter>& v_success_;
  metrics::Histogram &v_itl_, &v_queue_;
  std::string model_name_;
  uint64_t last_pages_dropped_ = 0;
  uint64_t last_prefix_queries_ = 0, last_prefix_hits_ = 0;
  SparseStats last_sparse_;
  pair::LinkStats last_link_;
};

}  // namespace spade
