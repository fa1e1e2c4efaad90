#include "inference_rank/serve.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <csignal>
#include <future>
#include <map>
#include <optional>
#include <mutex>
#include <thread>
#include <unistd.h>

#include "common/config.h"
#include "common/error.h"
#include "common/status_endpoint.h"
#include "common/tokenizer.h"
#include "coordinator/client.h"
#include "inference_rank/rank_metrics.h"
#include "pair/sharded_link.h"
#include "transport/link_factory.h"
#include "transport/transport.h"
#ifdef SPADE_HAVE_GPU_PATH
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#endif

namespace spade {
namespace {

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal = sig; }

using Clock = std::chrono::steady_clock;

proto::FinishReason to_proto(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return proto::FINISH_STOP;
    case FinishReason::Length: return proto::FINISH_LENGTH;
    case FinishReason::Abort: return proto::FINISH_CANCELLED;
    case FinishReason::Error: return proto::FINISH_ERROR;
    case FinishReason::None: break;
  }
  return proto::FINISH_NONE;
}

struct Active {
  uint64_t request_id = 0;  // the coordinator's id
  uint32_t index = 0;       // the sample of that request (GenerateChunk.index)
  StreamingDecoder decoder;
  bool silent = false;      // withdrawn before its first step (its rejection is the answer): no chunk of its own
  int sparse_threshold = 0;  // the request's own sparse options (0: the rank's), kept for a re-pairing
  int token_budget = 0;
};

// What a GenerateRequest is checked against before it reaches the engine.
struct IntakeLimits {
  int vocab_size = 0;
  int max_model_len = 0;
  bool on_gpu = false;
  int rank_token_budget = 0;  // the rank's --token-budget
  bool cpu_backend = false;   // the CPU SparseAttention takes per-request budgets up to rank_token_budget
};

// A GenerateRequest as the engine and the sparse backend take it.
struct IntakeRequest {
  GenerateRequest engine;
  bool force_dense = false;
  int sparse_threshold = 0;  // 0: the rank's
  int token_budget = 0;      // 0: the rank's
  int samples = 1;           // GenerateRequest.n (0 and 1: one)
  bool has_sparse_options() const { return force_dense || sparse_threshold > 0 || token_budget > 0; }
};

// Checks every field of `req` (in the proto's unsigned types, before any narrowing) and builds the engine request.
// Throws spade::Error naming the field. What Engine::submit checks itself (empty prompt, sampling ranges, prompt +
// max_tokens over the context, the KV pool) it still checks, before queuing.
IntakeRequest parse_request(const proto::GenerateRequest& req, const IntakeLimits& lim, const Tokenizer& tok,
                            const GenerationConfig& gen) {
  IntakeRequest out;
  GenerateRequest& g = out.engine;
  const auto vocab = static_cast<uint32_t>(lim.vocab_size);
  if (req.has_prompt_ids()) {
    SPADE_CHECK(static_cast<int64_t>(req.prompt_ids().ids_size()) <= lim.max_model_len,
                "This model's maximum context length is {} tokens and your request has {} prompt tokens",
                lim.max_model_len, req.prompt_ids().ids_size());
    for (uint32_t id : req.prompt_ids().ids()) {
      SPADE_CHECK(id < vocab, "prompt token id {} is outside the vocabulary [0, {})", id, vocab);
      g.prompt_ids.push_back(static_cast<int32_t>(id));
    }
  } else if (req.text().empty()) {
    SPADE_CHECK(gen.bos_token_id >= 0 || tok.bos_id(), "empty prompt and the model defines no BOS token");
    g.prompt_ids = {tok.bos_id() ? *tok.bos_id() : gen.bos_token_id};
  } else {
    g.prompt_ids = tok.encode(req.text(), true);
  }
  SPADE_CHECK(req.max_tokens() > 0, "max_tokens must be positive, got {}", req.max_tokens());
  const int64_t total = static_cast<int64_t>(g.prompt_ids.size()) + req.max_tokens();
  if (total > lim.max_model_len)
    fail("This model's maximum context length is {} tokens and your request has {} tokens ({} in the prompt, {} to "
         "generate)",
         lim.max_model_len, total, g.prompt_ids.size(), req.max_tokens());
  g.max_tokens = static_cast<int>(req.max_tokens());
  g.ignore_eos = req.ignore_eos();
  const proto::SamplingParams& sp = req.sampling();
  g.sampling.temperature = sp.temperature();
  g.sampling.top_p = sp.top_p() == 0.f ? 1.f : sp.top_p();  // 0 = disabled; negatives and NaN fail validate()
  SPADE_CHECK(sp.top_k() <= vocab, "top_k {} is above the vocabulary size {} (0 = disabled)", sp.top_k(), vocab);
  g.sampling.top_k = static_cast<int>(sp.top_k());
  g.sampling.seed = sp.seed();
  validate(g.sampling);
  SPADE_CHECK(req.top_logprobs() <= static_cast<uint32_t>(kMaxTopLogprobs), "top_logprobs must be in [0, {}], got {}",
              kMaxTopLogprobs, req.top_logprobs());
  SPADE_CHECK(req.logprobs() || req.top_logprobs() == 0, "top_logprobs {} needs logprobs set", req.top_logprobs());
  g.logprobs = req.logprobs() ? static_cast<int>(req.top_logprobs()) : -1;
  g.stop_token_ids = gen.eos_token_ids;
  for (uint32_t s : sp.stop_token_ids()) {
    SPADE_CHECK(s < vocab, "stop token id {} is outside the vocabulary [0, {})", s, vocab);
    g.stop_token_ids.push_back(static_cast<int>(s));
  }
  // Samples: the engine also refuses n above its max_num_seqs (Engine::submit_samples).
  SPADE_CHECK(req.n() <= coord::kMaxSamplesPerRequest, "n = {} samples is above the limit of {} per request", req.n(),
              coord::kMaxSamplesPerRequest);
  out.samples = std::max<int>(1, static_cast<int>(req.n()));
  // Sparse fields: the per-request ones are bounded; the rank-level ones are refused by name, not ignored.
  const proto::SparseParams& p = req.sparse();
  const std::pair<const char*, bool> rank_level[] = {
      {"enabled", p.enabled()},
      {"sink_tokens (--sink-tokens)", p.sink_tokens() != 0},
      {"local_window (--local-window)", p.local_window() != 0},
      {"layers_per_pack (--layers-per-pack)", p.layers_per_pack() != 0},
      {"sparse_start_step", p.sparse_start_step() != 0},
      {"query_window (--query-window)", p.query_window() != 0},
      {"ridge_lambda (--ridge-eps)", p.ridge_lambda() != 0.f}};
  for (const auto& [name, set] : rank_level)
    SPADE_CHECK(!set, "sparse.{} is a setting of the rank, not of a request (leave it unset)", name);
  SPADE_CHECK(p.sparse_threshold() <= static_cast<uint32_t>(lim.max_model_len),
              "spade.sparse_threshold {} is above this model's maximum context length {}", p.sparse_threshold(),
              lim.max_model_len);
  const uint32_t budget = p.token_budget();
  const auto rank_budget = static_cast<uint32_t>(lim.rank_token_budget);
  if (lim.on_gpu && budget > 0 && budget != rank_budget)
    fail("spade.token_budget {}: on the GPU path the budget is the rank's ({})", budget, rank_budget);
  if (lim.cpu_backend && budget > rank_budget)
    fail("spade.token_budget {} is above this rank's --token-budget {}", budget, rank_budget);
  out.force_dense = p.force_dense();
  out.sparse_threshold = static_cast<int>(p.sparse_threshold());
  out.token_budget = static_cast<int>(budget);
  return out;
}

// The pair's health, as the status endpoint, the metrics and the control plane see it. degrade() may come from any
// thread: the coordinator client's I/O thread calls it on a PeerDown for the paired cache rank, with `abort_link`, so
// that the link is aborted at once even while the main loop is blocked inside a step waiting on it (the abort runs
// on a thread of its own: the I/O thread must not block, and an NCCL abort may take a while).
class PairHealth {
 public:
  ~PairHealth() { disarm(); }
  /// The link to abort (not owned; either may be null). Main thread, once the link's owner (the engine) exists.
  void arm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
    arm(endpoint != nullptr ? std::vector<transport::Endpoint*>{endpoint} : std::vector<transport::Endpoint*>{},
        gpu_link);
  }
  /// Layer shards: one endpoint per cache rank, in shard order (degrade's `shard` indexes them).
  void arm(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link) {
    std::lock_guard<std::mutex> lk(link_mu_);
    endpoints_ = std::move(endpoints);
    gpu_link_ = gpu_link;
  }
  /// Marks the pair degraded (the first reason stays unless `replace_reason`) and, with `abort_link`, aborts the armed
  /// link once: of the endpoints only shard `shard`'s (the dead cache rank's; -1: all). Returns at once.
  void degrade(const std::string& why, bool abort_link, bool replace_reason = false, int shard = -1) {
    std::lock_guard<std::mutex> lk(mu_);
    if (why_.empty() || replace_reason) why_ = why;
    if (!abort_link || abort_started_ || disarmed_) return;
    abort_started_ = true;
    aborter_ = std::thread([this, why, shard] {
      std::lock_guard<std::mutex> l(link_mu_);
      for (size_t i = 0; i < endpoints_.size(); ++i)
        if (endpoints_[i] != nullptr && (shard < 0 || static_cast<size_t>(shard) == i)) endpoints_[i]->abort(why);
      if (gpu_link_ != nullptr) gpu_link_->abort(why);
    });
  }
  /// Forgets the link (before its owner destroys it) and waits for an abort in progress. Main thread; idempotent.
  void disarm() {
    std::thread t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      disarmed_ = true;
      t = std::move(aborter_);
    }
    if (t.joinable()) t.join();
    arm(nullptr, nullptr);
  }
  /// Waits for an abort in progress, then arms these links (null: none) without touching the reason: before the armed
  /// link's owner destroys it. Main thread.
  void rearm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
    std::thread t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      t = std::move(aborter_);
    }
    if (t.joinable()) t.join();
    arm(endpoint, gpu_link);
  }
  /// The pair is whole again (a replacement cache rank re-paired): waits for the old link's abort, arms the new link
  /// (not owned; its owner must disarm or restore before destroying it) and clears the reason. Main thread.
  void restore(transport::Endpoint* endpoint, transport::GpuLink* gpu_link) {
    rearm(endpoint, gpu_link);
    std::lock_guard<std::mutex> lk(mu_);
    why_.clear();
    abort_started_ = false;
  }
  /// "" while the pair is whole, else why it is not.
  std::string degraded() const {
    std::lock_guard<std::mutex> lk(mu_);
    return why_;
  }

 private:
  mutable std::mutex mu_;  // why_, abort_started_, disarmed_, aborter_
  std::string why_;
  bool abort_started_ = false;
  bool disarmed_ = false;
  std::thread aborter_;
  std::mutex link_mu_;  // endpoints_, gpu_link_ (held during the abort)
  std::vector<transport::Endpoint*> endpoints_;  // one per cache rank, shard order
  transport::GpuLink* gpu_link_ = nullptr;
};

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
  const bool on_gpu = opt.device == "cuda";
  auto model = Model::load(opt.model_dir);
  auto tok = Tokenizer::from_dir(opt.model_dir);
  const GenerationConfig gen = load_generation_config(opt.model_dir, model->config());
  const ModelConfig model_cfg = model->config();

  std::unique_ptr<transport::Transport> net;
  coord::ClientOptions co = coord::client_options_for(env);
  co.device = "cpu";
#ifndef SPADE_HAVE_GPU_PATH
  SPADE_CHECK(!on_gpu, "{}: --device cuda: this build has no CUDA", self);
#endif
  // The data plane's link is chosen at run time (transport/link_factory.h): on the GPU --gpu-link nccl | ipc, whose
  // inference-side end exists before registering (its address is what the coordinator forwards); on the CPU UCX.
  transport::LinkOptions lo;
  lo.name = self;
  lo.device = opt.gpu;
  lo.peer_name = "its cache rank";
  lo.op_timeout = opt.sparse.selection_deadline;
  lo.connect_timeout = opt.rendezvous_timeout;
  std::unique_ptr<transport::GpuLinkOffer> offer;
  if (on_gpu) co.device = fmt::format("cuda:{}", opt.gpu);
  if (env.num_cache > 0 && on_gpu && opt.sparse.mode == SelectionMode::Predicted) {
    SPADE_CHECK(opt.gpu_link == "nccl" || opt.gpu_link == "ipc", "{}: --gpu-link must be nccl or ipc, got '{}'", self,
                opt.gpu_link);
    if (env.cache_per_inference > 1)
      fail("{}: --gpu-link {} pairs one cache rank with one inference rank, but this world gives each inference rank "
           "{} cache ranks (--num-cache {} / --num-inference {}); shard over several cache ranks with --device cpu "
           "(UCX), or start as many cache ranks as inference ranks",
           self, opt.gpu_link, env.cache_per_inference, env.num_cache, env.num_inference);
    lo.kind = opt.gpu_link == "nccl" ? transport::LinkKind::kNccl : transport::LinkKind::kCudaIpc;
    offer = transport::offer_gpu_link(lo);
    co.transport_kind = lo.kind == transport::LinkKind::kNccl ? proto::TRANSPORT_NCCL : proto::TRANSPORT_CUDA_IPC;
    co.transport_address = offer->address();
  } else if (env.num_cache > 0 && !on_gpu) {
    lo.kind = transport::LinkKind::kUcx;
    net = transport::make_host_transport(lo);
    co.transport_kind = proto::TRANSPORT_UCX;
    co.transport_address = net->local_address();
    co.layers_per_pack = static_cast<uint32_t>(opt.sparse.layers_per_pack);  // its cache ranks' layer shards follow
  }
  coord::CoordinatorClient cc(co);
  set_stage("waiting for the world to register with " + cc.coordinator_name());
  const auto deadline = Clock::now() + opt.rendezvous_timeout;
  const proto::ClusterView view = cc.rendezvous(deadline);
  spdlog::info("{}: world of {} ({})", self, view.world_size(), view.pairing_rule());

  transport::Endpoint* endpoint = nullptr;
  std::vector<transport::Endpoint*> shard_endpoints;  // CPU: one per cache rank, in shard order
  std::vector<uint32_t> shard_ranks;                  // their global ranks (the GPU link's one cache rank)
  std::unique_ptr<pair::CacheRankLink> link;
  std::string cache_name;
  uint32_t cache_rank = 0;
  SparseOptions sparse = opt.sparse;
  std::unique_ptr<transport::GpuLink> gpu_link_owner;
  transport::GpuLink* gpu_link = nullptr;
  if (offer && view.peers_size() > 0) {
    const proto::RankInfo& peer = view.peers(0);
    cache_rank = peer.rank();
    shard_ranks = {cache_rank};
    cache_name = fmt::format("cache rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
    set_stage("connecting the GPU data plane to " + cache_name);
    // CUDA IPC waits for its peer up to the rendezvous timeout (as the link was offered); NCCL up to what is left of
    // the rendezvous deadline (at least 1 s).
    const auto left = std::max(std::chrono::milliseconds(1000),
                               std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    gpu_link_owner = offer->connect(cache_name, offer->kind() == transport::LinkKind::kNccl ? left : lo.connect_timeout);
    gpu_link = gpu_link_owner.get();
    spdlog::info("{}: GPU data plane to {} over {}", self, cache_name, transport::link_kind_name(offer->kind()));
  } else if (on_gpu && sparse.mode == SelectionMode::Predicted) {
    spdlog::warn("{}: no cache rank in the world: predicted selection unavailable, decoding densely", self);
    sparse.mode = SelectionMode::Dense;
  }
  SPADE_CHECK(!on_gpu || (sparse.mode != SelectionMode::Oracle && sparse.mode != SelectionMode::Quest),
              "{}: --selection {} is CPU only", self, selection_mode_name(sparse.mode));
  if (!on_gpu && net && view.peers_size() > 0) {
    // One link per cache rank; with N > 1 the layer packs are sharded over them (pack p to shard p mod N,
    // pair/sharded_link.h), each cache rank holding its shard's layers.
    const int packs = (model_cfg.attention_view().num_layers + sparse.layers_per_pack - 1) / sparse.layers_per_pack;
    SPADE_CHECK(packs >= view.peers_size(),
                "{}: {} cache ranks but only {} layer packs ({} attention layers, --layers-per-pack {}): a cache rank "
                "would hold no layer; pass a smaller --layers-per-pack or start fewer cache ranks",
                self, view.peers_size(), packs, model_cfg.attention_view().num_layers, sparse.layers_per_pack);
    std::vector<std::unique_ptr<pair::CacheRankLink>> shards;
    for (const proto::RankInfo& peer : view.peers()) {
      const std::string name = fmt::format("cache rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
      set_stage("connecting the data plane to " + name);
      auto ep = net->connect(peer.transport().address(), name, deadline);
      shard_endpoints.push_back(ep.get());
      shard_ranks.push_back(peer.rank());
      shards.push_back(
          std::make_unique<pair::TransportLink>(std::move(ep), pair::pack_shape(model->config(), sparse.selection)));
      cache_name += (cache_name.empty() ? "" : ", ") + name;
    }
    cache_rank = shard_ranks.front();
    endpoint = shard_endpoints.front();
    if (shards.size() == 1) {
      link = std::move(shards.front());
    } else {
      link = std::make_unique<pair::ShardedLink>(std::move(shards));
    }
    spdlog::info("{}: data plane to {} over {}{}", self, cache_name, net->kind(),
                 shard_ranks.size() > 1 ? fmt::format(" ({} layer shards, pack p to shard p mod {})",
                                                      shard_ranks.size(), shard_ranks.size())
                                        : std::string());
  } else if (!on_gpu && sparse.mode == SelectionMode::Predicted) {
    spdlog::warn("{}: no cache rank in the world: predicted selection unavailable, decoding densely", self);
    sparse.mode = SelectionMode::Dense;
  }
  SparseAttention* backend = nullptr;
  std::unique_ptr<Engine> engine_ptr;
#ifdef SPADE_HAVE_GPU_PATH
  // Destroyed in reverse order: the controller before the forward pass, both after the engine stops stepping.
  std::unique_ptr<GpuEngineForward> gpu;
  std::unique_ptr<ModelConfig> gpu_attn_cfg;
  std::unique_ptr<GpuSparseController> gpu_sparse;
#endif
  if (on_gpu) {
#ifdef SPADE_HAVE_GPU_PATH
    cuda_check(cudaSetDevice(opt.gpu), "inference rank: cudaSetDevice");
    engine_ptr = std::make_unique<Engine>(
        model_cfg, opt.engine,
        ForwardSampleFn([&](const ForwardBatch& b, const std::vector<RowSampling>& r, std::vector<int32_t>& t,
                            std::vector<TokenLogprobs>& l) { gpu->sample(b, r, t, l); }));
    const GpuEngineOptions go = gpu_engine_options(engine_ptr->options(), opt.cuda_graphs);
    gpu = std::make_unique<GpuEngineForward>(
        GpuModel::upload(model_cfg, model->weights(), GpuEngineForward::model_options(go)), go);
    model.reset();  // the host fp32 copy is no longer needed
    {
      const auto t_warm = std::chrono::steady_clock::now();
      const int n = gpu->warm_up();  // before the pair hello (gpu_engine.h)
      spdlog::info("{}: GPU warm-up: {} steps in {:.1f} ms", self, n,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_warm).count());
    }
    spdlog::info("{}: GPU {}: {:.2f} GB weights, {:.2f} GB KV pool ({} pages)", self, opt.gpu,
                 gpu->model().weight_bytes() / 1e9, gpu->kv_bytes() / 1e9, go.engine.num_pages);
    if (gpu_link != nullptr) {
      const EngineOptions& en = engine_ptr->options();
      gpu_attn_cfg = std::make_unique<ModelConfig>(model_cfg.attention_view());
      const GpuSparseOptions gso = gpu_sparse_options(sparse, en, cache_name);
      gpu_sparse = std::make_unique<GpuSparseController>(*gpu_attn_cfg, gso, *gpu_link, en.page_size, gpu->max_batch());
      gpu_sparse->send_hello(make_gpu_pair_hello(*gpu_attn_cfg, gso, en));
      gpu->set_sparse(gpu_sparse.get());
      engine_ptr->set_attention_hooks(gpu_sparse.get());
      spdlog::info("{}: GPU sparse decoding: threshold {}, budget {}, local window {}, delta capacity {}, {} layers per "
                   "pack", self, sparse.sparse_threshold, sparse.selection.token_budget, sparse.selection.local_window,
                   sparse.effective_delta_capacity(), sparse.layers_per_pack);
    }
#endif
  } else {
    engine_ptr = std::make_unique<Engine>(*model, opt.engine,
                                          [&](const ModelConfig& cfg, KvCache& kv) -> std::unique_ptr<AttentionBackend> {
                                            auto b = std::make_unique<SparseAttention>(cfg, kv, sparse, std::move(link));
                                            backend = b.get();
                                            return b;
                                          });
  }
  Engine& engine = *engine_ptr;
  // The GPU path's counters in the CPU path's shapes (metrics and coordinator stats), over every controller a
  // re-pairing replaced too.
#ifdef SPADE_HAVE_GPU_PATH
  GpuSparseStats retired_gpu_stats;
#endif
  auto gpu_stats = [&](SparseStats& s, pair::LinkStats& l) -> bool {
#ifdef SPADE_HAVE_GPU_PATH
    if (!gpu_sparse) return false;
    const GpuSparseStats& g = gpu_sparse->stats();
    const GpuSparseStats& r = retired_gpu_stats;
    s.steps = g.steps + r.steps;
    s.sparse_seq_steps = g.sparse_seq_steps + r.sparse_seq_steps;
    s.switches = g.switches + r.switches;
    s.failed_seqs = g.failed_seqs + r.failed_seqs;
    l.bytes_sent = g.bytes_sent + r.bytes_sent;
    l.bytes_received = g.bytes_received + r.bytes_received;
    l.updates = s.steps;
    return true;
#else
    (void)s;
    (void)l;
    return false;
#endif
  };

  const std::string transport_name =
      on_gpu ? (cache_name.empty() ? std::string("none") : std::string(opt.gpu_link == "ipc" ? "cuda_ipc" : "nccl"))
             : (net ? net->kind() : std::string("none"));
  InferenceMetrics rank_metrics(registry, sparse, transport_name.c_str(),
                                metrics_model_name(view.served_model_name(), opt.model_dir));
  engine.set_observer(&rank_metrics);
  // From here a PeerDown for the cache rank aborts the link at once (the coordinator client's I/O thread); the guard
  // detaches the link before the engine (its owner) is destroyed.
  pair_health->arm(shard_endpoints, gpu_link);
  struct DisarmAtExit {
    PairHealth& health;
    ~DisarmAtExit() { health.disarm(); }
  } disarm_at_exit{*pair_health};
  const bool has_link = endpoint != nullptr || gpu_link != nullptr;
  // The newest incarnation of the cache rank declared dead (-1: none): a replacement that dies while it is being
  // connected is not swapped in.
  auto cache_down_incarnation = std::make_shared<std::atomic<int64_t>>(-1);
  auto cache_down_reason = [](const proto::PeerDown& pd) {
    return fmt::format("cache rank {} (#{}) on {} is down: {}", pd.rank(), pd.role_index(), pd.host(), pd.reason());
  };
  // The shard of global rank `r` among this rank's cache ranks, -1 for another rank.
  auto shard_of_rank = [shard_ranks](uint32_t r) {
    const auto it = std::find(shard_ranks.begin(), shard_ranks.end(), r);
    return it == shard_ranks.end() ? -1 : static_cast<int>(it - shard_ranks.begin());
  };
  if (has_link)
    cc.set_event_callback([pair_health, shard_of_rank, cache_down_incarnation,
                           cache_down_reason](const coord::ClientEvent& ev) {
      if (ev.kind != coord::ClientEvent::Kind::kPeerDown) return;
      const int shard = shard_of_rank(ev.peer_down.rank());
      if (shard < 0) return;
      int64_t seen = cache_down_incarnation->load();
      while (seen < ev.peer_down.incarnation() &&
             !cache_down_incarnation->compare_exchange_weak(seen, ev.peer_down.incarnation())) {
      }
      pair_health->degrade(cache_down_reason(ev.peer_down), true, false, shard);
    });
  // Rejoin: a replacement of the cache rank (PeerReplaced) is connected on a thread of its own, so that the dense
  // requests keep decoding meanwhile, within the rendezvous timeout; the loop swaps the new link in once it is up.
  // Requests admitted before the swap stay dense to their end; new ones decode sparsely again.
  std::map<uint64_t, Active> active;    // engine id -> request
  std::map<uint64_t, std::vector<uint64_t>> by_rid;  // coordinator request id -> its samples' engine ids, by index
  uint32_t cache_incarnation = 0;
  pair::LinkStats retired_link_stats;  // of the links a re-pairing replaced (CPU)
  struct Repair {
    proto::RankInfo peer;
    std::string name;
    std::future<std::unique_ptr<transport::Endpoint>> endpoint;  // CPU
#ifdef SPADE_HAVE_GPU_PATH
    struct Gpu {
      std::unique_ptr<transport::GpuLink> link;
      std::unique_ptr<GpuSparseController> controller;
    };
    std::future<Gpu> gpu;
#endif
  };
  std::optional<Repair> repair;
  // Layer shards (N > 1): a replaced cache rank is connected (so that it leaves its rendezvous) but not used: the
  // other shards still hold the KV of the sequences the failure ended, so the pair stays dense until this rank
  // restarts.
  std::vector<std::future<std::unique_ptr<transport::Endpoint>>> parked_shards;
  auto on_peer_replaced = [&](const proto::PeerReplaced& pr) {
    const proto::RankInfo& peer = pr.peer();
    const std::string name = fmt::format("cache rank {} (#{}) on {}", peer.rank(), peer.role_index(), peer.host());
    if (!has_link || shard_of_rank(peer.rank()) < 0) {
      spdlog::warn("{}: ignoring a replacement of rank {}: not this rank's cache rank", self, peer.rank());
      return;
    }
    if (shard_ranks.size() > 1) {
      const int shard = shard_of_rank(peer.rank());
      pair_health->degrade(fmt::format("{} (layer shard {} of {}) was replaced (previous incarnation: {}); a replaced "
                                       "shard is not re-paired, this rank decodes densely until it restarts",
                                       name, shard, shard_ranks.size(), pr.previous_reason()),
                           true, true, shard);
      proto::PairOffer po;
      po.set_peer_rank(peer.rank());
      po.set_peer_incarnation(peer.incarnation());
      po.mutable_transport()->set_kind(proto::TRANSPORT_UCX);
      po.mutable_transport()->set_address(net->local_address());
      cc.send_pair_offer(po);
      transport::Transport* t = net.get();
      const std::string addr = peer.transport().address();
      const auto connect_deadline = Clock::now() + opt.rendezvous_timeout;
      parked_shards.push_back(std::async(std::launch::async, [t, addr, name, connect_deadline] {
        return t->connect(addr, name, connect_deadline);
      }));
      spdlog::warn("{}: {}", self, pair_health->degraded());
      return;
    }
    if (peer.incarnation() <= cache_incarnation) {
      spdlog::warn("{}: ignoring a replacement of {} with incarnation {} (the pair's is {})", self, name,
                   peer.incarnation(), cache_incarnation);
      return;
    }
    const bool predicted = on_gpu || (backend != nullptr && backend->options().mode == SelectionMode::Predicted);
    pair_health->degrade(fmt::format("{} was replaced (previous incarnation: {})", cache_name, pr.previous_reason()),
                         true);
    if (!predicted) {
      spdlog::info("{}: {} replaced; this rank decodes densely (--selection {}), nothing to re-pair", self, name,
                   selection_mode_name(sparse.mode));
      return;
    }
    repair.reset();  // a newer replacement supersedes one still connecting (its connect ends at its deadline)
    Repair rp;
    rp.peer = peer;
    rp.name = name;
    proto::PairOffer po;
    po.set_peer_rank(peer.rank());
    po.set_peer_incarnation(peer.incarnation());
    const auto connect_deadline = Clock::now() + opt.rendezvous_timeout;
    try {
      if (!on_gpu) {
        po.mutable_transport()->set_kind(proto::TRANSPORT_UCX);
        po.mutable_transport()->set_address(net->local_address());
        cc.send_pair_offer(po);
        transport::Transport* t = net.get();
        const std::string addr = peer.transport().address();
        rp.endpoint = std::async(std::launch::async, [t, addr, name, connect_deadline] {
          return t->connect(addr, name, connect_deadline);
        });
      } else {
#ifdef SPADE_HAVE_GPU_PATH
        // NCCL ids are single-use: a fresh offer (CUDA IPC: fresh memory), brokered like the first pairing.
        transport::LinkOptions glo = lo;
        glo.peer_name = name;
        std::shared_ptr<transport::GpuLinkOffer> fresh = transport::offer_gpu_link(glo);
        po.mutable_transport()->set_kind(glo.kind == transport::LinkKind::kNccl ? proto::TRANSPORT_NCCL
                                                                                  : proto::TRANSPORT_CUDA_IPC);
        po.mutable_transport()->set_address(fresh->address());
        cc.send_pair_offer(po);
        const EngineOptions en = engine.options();
        const GpuSparseOptions gso = gpu_sparse_options(sparse, en, name);
        const ModelConfig* attn = gpu_attn_cfg.get();
        const int max_batch = gpu->max_batch();
        const int device = opt.gpu;
        const auto timeout = opt.rendezvous_timeout;
        rp.gpu = std::async(std::launch::async, [fresh, name, en, gso, attn, max_batch, device, timeout] {
          cuda_check(cudaSetDevice(device), "inference rank: cudaSetDevice (re-pairing)");
          Repair::Gpu g;
          g.link = fresh->connect(name, timeout);
          g.controller = std::make_unique<GpuSparseController>(*attn, gso, *g.link, en.page_size, max_batch);
          g.controller->send_hello(make_gpu_pair_hello(*attn, gso, en));
          return g;
        });
#endif
      }
    } catch (const std::exception& e) {
      pair_health->degrade(fmt::format("re-pairing with {} failed: {}", name, e.what()), false, true);
      spdlog::error("{}: re-pairing with {} failed: {}; decoding densely", self, name, e.what());
      return;
    }
    spdlog::info("{}: {} replaced {} (incarnation {}); offered the data plane, connecting", self, name, cache_name,
                 peer.incarnation());
    repair = std::move(rp);
  };
  // Swaps the replacement's link in once it is up (main thread, between steps).
  auto finish_repair = [&] {
    if (!repair) return;
    const bool cpu_ready =
        repair->endpoint.valid() && repair->endpoint.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    bool gpu_ready = false;
#ifdef SPADE_HAVE_GPU_PATH
    gpu_ready = repair->gpu.valid() && repair->gpu.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
#endif
    if (!cpu_ready && !gpu_ready) return;
    Repair rp = std::move(*repair);
    repair.reset();
    try {
      if (cpu_ready) {
        std::unique_ptr<transport::Endpoint> ep = rp.endpoint.get();
        SPADE_CHECK(cache_down_incarnation->load() < static_cast<int64_t>(rp.peer.incarnation()),
                    "it was declared dead while connecting");
        transport::Endpoint* raw = ep.get();
        pair_health->rearm(nullptr, nullptr);  // the old link goes with replace_link
        if (const pair::CacheRankLink* old = backend->link()) {  // its counters keep counting in the metrics
          retired_link_stats.bytes_sent += old->stats().bytes_sent;
          retired_link_stats.bytes_received += old->stats().bytes_received;
          retired_link_stats.updates += old->stats().updates;
          retired_link_stats.cache_select_ms += old->stats().cache_select_ms;
        }
        backend->replace_link(std::make_unique<pair::TransportLink>(std::move(ep),
                                                                    pair::pack_shape(model_cfg, sparse.selection)));
        for (const auto& [eid, a] : active) backend->set_request_options(eid, true, a.sparse_threshold, a.token_budget);
        endpoint = raw;
        pair_health->restore(endpoint, nullptr);
      }
#ifdef SPADE_HAVE_GPU_PATH
      if (gpu_ready) {
        Repair::Gpu g = rp.gpu.get();
        SPADE_CHECK(cache_down_incarnation->load() < static_cast<int64_t>(rp.peer.incarnation()),
                    "it was declared dead while connecting");
        for (const auto& [eid, a] : active) g.controller->set_request_options(eid, true, a.sparse_threshold);
        if (gpu_sparse) {  // the old controller's counters keep counting
          const GpuSparseStats& o = gpu_sparse->stats();
          retired_gpu_stats.steps += o.steps;
          retired_gpu_stats.sparse_seq_steps += o.sparse_seq_steps;
          retired_gpu_stats.switches += o.switches;
          retired_gpu_stats.failed_seqs += o.failed_seqs;
          retired_gpu_stats.bytes_sent += o.bytes_sent;
          retired_gpu_stats.bytes_received += o.bytes_received;
        }
        pair_health->rearm(nullptr, nullptr);  // the old link goes below
        gpu->set_sparse(g.controller.get());
        engine.set_attention_hooks(g.controller.get());
        gpu_sparse = std::move(g.controller);  // the old controller goes before its link
        gpu_link_owner = std::move(g.link);
        gpu_link = gpu_link_owner.get();
        pair_health->restore(nullptr, gpu_link);
      }
#endif
    } catch (const std::exception& e) {
      pair_health->degrade(fmt::format("re-pairing with {} failed: {}", rp.name, e.what()), false, true);
      spdlog::error("{}: re-pairing with {} failed: {}; decoding densely", self, rp.name, e.what());
      return;
    }
    cache_name = rp.name;
    cache_incarnation = rp.peer.incarnation();
    spdlog::info("{}: the pair is whole again: {} (incarnation {}) connected; new requests decode sparsely", self,
                 cache_name, cache_incarnation);
  };
  IntakeLimits limits;
  limits.vocab_size = model_cfg.vocab_size;
  limits.max_model_len = engine.options().max_model_len;
  limits.on_gpu = on_gpu;
  limits.rank_token_budget = backend ? backend->options().selection.token_budget : sparse.selection.token_budget;
  limits.cpu_backend = backend != nullptr;
  set_stage("");  // ready: weights loaded, world complete, data plane connected

  int exit_code = 0;
  bool running = true;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  while (running) {
    heartbeat.tick();
    if (int sig = g_signal.load()) {  // SIGTERM / SIGINT: end the in-flight requests and leave the world
      spdlog::warn("{}: signal {} received: aborting {} request(s) and exiting", self, sig, active.size());
      std::vector<uint64_t> ids;
      for (const auto& [eid, a] : active) ids.push_back(eid);
      for (uint64_t eid : ids) engine.abort(eid);
      break;
    }
    // Control plane events.
    while (auto ev = cc.next_event(Clock::now())) {
      if (ev->kind == coord::ClientEvent::Kind::kPeerDown) {
        spdlog::error("{}: {}", self, ev->message);
        if (has_link && shard_of_rank(ev->peer_down.rank()) >= 0) {  // the callback has aborted the link already
          pair_health->degrade(cache_down_reason(ev->peer_down), true, false, shard_of_rank(ev->peer_down.rank()));
          spdlog::warn("{}: cache rank {} of {} is down: sparse requests in flight fail, every other and every new "
                       "request decodes densely", self, ev->peer_down.rank(), cache_name);
        }
      } else if (ev->kind == coord::ClientEvent::Kind::kPeerReplaced) {
        spdlog::info("{}: {}", self, ev->message);
        on_peer_replaced(ev->peer_replaced);
      } else {
        spdlog::info("{}: {}", self, ev->message);
        exit_code = ev->kind == coord::ClientEvent::Kind::kShutdown && !ev->shutdown.is_error() ? 0 : 1;
        running = false;
      }
    }
    if (!running) break;
    finish_repair();
    // Cancellations (client gone): each sample of the request (or the one named) ends with FINISH_CANCELLED and its
    // KV is freed (here at once, on the cache rank with the next update or the idle flush below).
    while (auto c = cc.next_cancel(Clock::now())) {
      auto it = by_rid.find(c->request_id());
      if (it == by_rid.end()) continue;
      if (c->has_index()) {
        if (c->index() >= it->second.size()) continue;
        spdlog::info("{}: cancelling sample {} of request {}: {}", self, c->index(), c->request_id(), c->reason());
        engine.abort(it->second[c->index()]);  // a sample that finished already: ignored
        continue;
      }
      spdlog::info("{}: cancelling request {}: {}", self, c->request_id(), c->reason());
      const std::vector<uint64_t> samples = it->second;  // each abort may end the request's entry
      for (uint64_t eid : samples) engine.abort(eid);
    }
    // New requests: wait briefly only when idle, and only for the first one (take_requests).
    const auto first_deadline = engine.idle() ? Clock::now() + std::chrono::milliseconds(50) : Clock::now();
    take_requests([&](coord::Deadline d) { return cc.next_request(d); }, first_deadline,
                  [&](const proto::GenerateRequest& req) {
      const uint64_t rid = req.request_id();
      auto reject = [&](const std::string& why) {  // one final chunk per sample (coord::refusal_chunks)
        for (uint32_t i = 0; i < coord::refusal_chunks(req); ++i) {
          proto::GenerateChunk c;
          c.set_request_id(rid);
          c.set_index(i);
          c.set_finished(true);
          c.set_finish_reason(proto::FINISH_ERROR);
          c.set_error(fmt::format("{}: {}", self, why));
          c.set_served_by_rank(env.rank);
          cc.send_chunk(c);
        }
      };
      IntakeRequest r;
      try {
        r = parse_request(req, limits, tok, gen);  // every field, before the engine sees the request
      } catch (const Error& e) {
        reject(fmt::format("invalid request: {}", e.what()));  // the API answers these with 400
        return;
      }
      // n samples (engine ids in index order) share the prompt's KV; each streams its own chunks, with its own
      // decoder, and ends on its own (an error in one ends that sample alone).
      std::vector<uint64_t> eids;
      try {
        eids = engine.submit_samples(std::move(r.engine), r.samples, [&, rid](const TokenEvent& ev) {
          auto it = active.find(ev.request_id);
          const bool silent = it != active.end() && it->second.silent;
          if (!silent) {
            proto::GenerateChunk c;
            c.set_request_id(rid);
            c.set_served_by_rank(env.rank);
            if (it != active.end()) c.set_index(it->second.index);
            if (ev.token >= 0 && ev.reason != FinishReason::Stop) {
              c.add_token_ids(static_cast<uint32_t>(ev.token));
              if (it != active.end()) c.set_text(it->second.decoder.push(ev.token));
              if (ev.logprobs) {  // aligned with token_ids
                proto::TokenLogprobs* lp = c.add_logprobs();
                lp->set_logprob(ev.logprobs->logprob);
                for (int32_t id : ev.logprobs->top_ids) lp->add_top_ids(static_cast<uint32_t>(id));
                for (float v : ev.logprobs->top_logprobs) lp->add_top_logprobs(v);
              }
            }
            if (ev.finished) {
              if (it != active.end()) c.set_text(c.text() + it->second.decoder.finish());
              c.set_finished(true);
              c.set_finish_reason(to_proto(ev.reason));
              if (!ev.error.empty()) c.set_error(fmt::format("{}: {}", self, ev.error));
            }
            cc.send_chunk(c);
          }
          if (ev.finished && it != active.end()) {
            const uint64_t req_id = it->second.request_id;
            active.erase(it);
            auto r_it = by_rid.find(req_id);
            if (r_it != by_rid.end() && std::none_of(r_it->second.begin(), r_it->second.end(),
                                                     [&](uint64_t e) { return active.count(e) > 0; }))
              by_rid.erase(r_it);  // its last sample ended
          }
        });
      } catch (const Error& e) {
        reject(fmt::format("invalid request: {}", e.what()));  // nothing was queued
        return;
      }
      for (size_t i = 0; i < eids.size(); ++i) {
        Active a{rid, static_cast<uint32_t>(i), StreamingDecoder(tok, true)};
        a.sparse_threshold = r.sparse_threshold;
        a.token_budget = r.token_budget;
        active.emplace(eids[i], std::move(a));
      }
      by_rid[rid] = eids;
      // The options were checked by parse_request and apply to every sample; should a backend still refuse them, the
      // request is withdrawn before its first step (engine.abort of each sample, silently) and only the rejection
      // answers it.
      try {
        for (uint64_t eid : eids) {
          if (backend && r.has_sparse_options())
            backend->set_request_options(eid, r.force_dense, r.sparse_threshold, r.token_budget);
#ifdef SPADE_HAVE_GPU_PATH
          if (gpu_sparse && (r.force_dense || r.sparse_threshold > 0))
            gpu_sparse->set_request_options(eid, r.force_dense, r.sparse_threshold);
#endif
        }
      } catch (const Error& e) {
        for (uint64_t eid : eids) active.at(eid).silent = true;
        for (uint64_t eid : eids) engine.abort(eid);
        reject(fmt::format("invalid request: {}", e.what()));
      }
    });
    if (!engine.idle()) engine.step();
    if (backend && engine.idle() && backend->pending_releases() > 0) backend->idle_flush();
    // A link that failed without a PeerDown (transport error, late selection): the pair is degraded all the same.
    if (has_link && pair_health->degraded().empty()) {
      bool failed = backend != nullptr &&
                    (backend->link_failed() || (backend->link() != nullptr && !backend->link()->failure().empty()));
#ifdef SPADE_HAVE_GPU_PATH
      failed = failed || (gpu_sparse && gpu_sparse->link_failed());
#endif
      if (failed) {
        std::string why = backend != nullptr && backend->link() != nullptr ? backend->link()->failure() : "";
        if (why.empty()) why = endpoint != nullptr ? endpoint->failure() : gpu_link->failure();
        pair_health->degrade(fmt::format("the data plane to {} failed{}{}", cache_name, why.empty() ? "" : ": ", why),
                             false);
        spdlog::warn("{}: {}; decoding densely", self, pair_health->degraded());
      }
    }
    rank_metrics.set_pair_degraded(!pair_health->degraded().empty());
    if (backend) {
      const SparseStats& s = backend->stats();
      cc.set_stat("sparse_seq_steps", static_cast<double>(s.sparse_seq_steps));
      cc.set_stat("selection_stalls", static_cast<double>(s.stalls));
      cc.set_stat("dense_fallbacks", static_cast<double>(s.dense_fallbacks));
    }
    SparseStats gs;
    pair::LinkStats gl;
    if (gpu_stats(gs, gl)) {
      cc.set_stat("sparse_seq_steps", static_cast<double>(gs.sparse_seq_steps));
      rank_metrics.update(engine.stats(), &gs, &gl);
    } else {
      pair::LinkStats ls = retired_link_stats;  // every link of the pair so far
      if (backend && backend->link()) {
        const pair::LinkStats& now = backend->link()->stats();
        ls.bytes_sent += now.bytes_sent;
        ls.bytes_received += now.bytes_received;
        ls.updates += now.updates;
        ls.cache_select_ms += now.cache_select_ms;
      }
      rank_metrics.update(engine.stats(), backend ? &backend->stats() : nullptr,
                          backend && backend->link() ? &ls : nullptr);
    }
  }
  {
    SparseStats gs;
    pair::LinkStats gl;
    uint64_t link_graph_replays = 0;
#ifdef SPADE_HAVE_GPU_PATH
    if (gpu != nullptr) link_graph_replays = gpu->link_graph_steps();
#endif
    if (gpu_stats(gs, gl))
      spdlog::info("{}: {} steps, {} sparse sequence-steps, {} switches, {} failed, {:.1f} MB up, {:.1f} MB down, "
                   "{} KV pages dropped, {} link-step graph replays",
                   self, gs.steps, gs.sparse_seq_steps, gs.switches, gs.failed_seqs, gl.bytes_sent / 1e6,
                   gl.bytes_received / 1e6, engine.stats().dropped_pages, link_graph_replays);
  }
  if (backend) {
    const SparseStats& s = backend->stats();
    spdlog::info("{}: {} steps, {} sparse sequence-steps, {} stalls ({:.1f} ms), {} failed, {} dense fallbacks", self,
                 s.steps, s.sparse_seq_steps, s.stalls, s.stall_ms, s.failed_seqs, s.dense_fallbacks);
    if (auto* l = dynamic_cast<pair::TransportLink*>(backend->link())) l->shutdown();
    if (auto* sl = dynamic_cast<pair::ShardedLink*>(backend->link()))  // every shard's cache rank ends its session
      for (int i = 0; i < sl->num_shards(); ++i)
        if (auto* l = dynamic_cast<pair::TransportLink*>(&sl->shard(i))) l->shutdown();
  }
#ifdef SPADE_HAVE_GPU_PATH
  if (gpu_sparse) gpu_sparse->close();  // the close plan: the cache rank posts nothing more
#endif
  engine.set_attention_hooks(nullptr);  // the GPU controller goes before the engine
  return exit_code;
}

}  // namespace spade
