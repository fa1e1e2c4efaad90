// The GPU data plane of inference_rank --serve (serve_pairing.h make_gpu_data_plane): the forward pass on one GPU
// (GpuEngineForward) and, with a cache rank, the GpuSparseController over an NcclLink or CudaIpcLink. CUDA builds only.
#include <cuda_runtime_api.h>
#include <spdlog/spdlog.h>

#include <future>
#include <utility>

#include "common/error.h"
#include "inference_rank/gpu_engine.h"
#include "inference_rank/gpu_sparse.h"
#include "inference_rank/serve_pairing.h"
#include "kernels/device.h"

namespace spade {
namespace {

class GpuDataPlane final : public DataPlane {
 public:
  GpuDataPlane(DataPlaneSetup setup, coord::ClientOptions& co) : DataPlane(std::move(setup)), lo_(link_options()) {
    // The link's inference-side end exists before registering: its address is what the coordinator forwards.
    co.device = fmt::format("cuda:{}", opt_.gpu);
    if (env_.num_cache == 0 || opt_.sparse.mode != SelectionMode::Predicted) return;
    SPADE_CHECK(opt_.gpu_link == "nccl" || opt_.gpu_link == "ipc", "{}: --gpu-link must be nccl or ipc, got '{}'",
                self_, opt_.gpu_link);
    if (env_.cache_per_inference > 1)
      fail("{}: --gpu-link {} pairs one cache rank with one inference rank, but this world gives each inference rank "
           "{} cache ranks (--num-cache {} / --num-inference {}); shard over several cache ranks with --device cpu "
           "(UCX), or start as many cache ranks as inference ranks",
           self_, opt_.gpu_link, env_.cache_per_inference, env_.num_cache, env_.num_inference);
    lo_.kind = opt_.gpu_link == "nccl" ? transport::LinkKind::kNccl : transport::LinkKind::kCudaIpc;
    offer_ = transport::offer_gpu_link(lo_);
    co.transport_kind = transport_kind(lo_.kind);
    co.transport_address = offer_->address();
  }
  ~GpuDataPlane() override { teardown(); }

  void connect(const proto::ClusterView& view, Clock::time_point deadline) override {
    if (offer_ && view.peers_size() > 0) {
      const proto::RankInfo& peer = view.peers(0);
      shard_ranks_ = {peer.rank()};
      cache_name_ = cache_rank_name(peer);
      set_stage_("connecting the GPU data plane to " + cache_name_);
      // CUDA IPC waits for its peer up to the rendezvous timeout (as the link was offered); NCCL up to what is left
      // of the rendezvous deadline (at least 1 s).
      const auto left = std::max(std::chrono::milliseconds(1000),
                                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
      gpu_link_owner_ =
          offer_->connect(cache_name_, offer_->kind() == transport::LinkKind::kNccl ? left : lo_.connect_timeout);
      gpu_link_ = gpu_link_owner_.get();
      has_link_ = true;
      spdlog::info("{}: GPU data plane to {} over {}", self_, cache_name_,
                   transport::link_kind_name(offer_->kind()));
    } else {
      no_cache_rank();
    }
    SPADE_CHECK(sparse_.mode != SelectionMode::Oracle && sparse_.mode != SelectionMode::Quest,
                "{}: --selection {} is CPU only", self_, selection_mode_name(sparse_.mode));
  }

  Engine& build_engine(std::unique_ptr<Model>& model) override {
    cuda_check(cudaSetDevice(opt_.gpu), "inference rank: cudaSetDevice");
    engine_ = std::make_unique<Engine>(
        model_cfg_, opt_.engine,
        ForwardSampleFn([this](const ForwardBatch& b, const std::vector<RowSampling>& r, std::vector<int32_t>& t,
                               std::vector<TokenLogprobs>& l) { gpu_->sample(b, r, t, l); }));
    const GpuEngineOptions go = gpu_engine_options(engine_->options(), opt_.cuda_graphs);
    gpu_ = std::make_unique<GpuEngineForward>(
        GpuModel::upload(model_cfg_, model->weights(), GpuEngineForward::model_options(go)), go);
    model.reset();  // the host fp32 copy is no longer needed
    {
      const auto t_warm = std::chrono::steady_clock::now();
      const int n = gpu_->warm_up();  // before the pair hello (gpu_engine.h)
      spdlog::info("{}: GPU warm-up: {} steps in {:.1f} ms", self_, n,
                   std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_warm).count());
    }
    spdlog::info("{}: GPU {}: {:.2f} GB weights, {:.2f} GB KV pool ({} pages)", self_, opt_.gpu,
                 gpu_->model().weight_bytes() / 1e9, gpu_->kv_bytes() / 1e9, go.engine.num_pages);
    if (gpu_link_ != nullptr) {
      const EngineOptions& en = engine_->options();
      gpu_attn_cfg_ = std::make_unique<ModelConfig>(model_cfg_.attention_view());
      const GpuSparseOptions gso = gpu_sparse_options(sparse_, en, cache_name_);
      gpu_sparse_ =
          std::make_unique<GpuSparseController>(*gpu_attn_cfg_, gso, *gpu_link_, en.page_size, gpu_->max_batch());
      gpu_sparse_->send_hello(make_gpu_pair_hello(*gpu_attn_cfg_, gso, en));
      gpu_->set_sparse(gpu_sparse_.get());
      engine_->set_attention_hooks(gpu_sparse_.get());
      spdlog::info("{}: GPU sparse decoding: threshold {}, budget {}, local window {}, delta capacity {}, {} layers "
                   "per pack", self_, sparse_.sparse_threshold, sparse_.selection.token_budget,
                   sparse_.selection.local_window, sparse_.effective_delta_capacity(), sparse_.layers_per_pack);
    }
    return *engine_;
  }

  std::string transport_name() const override {
    return cache_name_.empty() ? std::string("none") : std::string(opt_.gpu_link == "ipc" ? "cuda_ipc" : "nccl");
  }

  void set_request_options(uint64_t engine_id, const IntakeRequest& r) override {
    if (gpu_sparse_ && (r.force_dense || r.sparse_threshold > 0))
      gpu_sparse_->set_request_options(engine_id, r.force_dense, r.sparse_threshold);
  }

 protected:
  void arm_health() override { health_->arm(std::vector<transport::Endpoint*>{}, gpu_link_); }
  bool predicted() const override { return true; }

  void start_repair(const proto::RankInfo& /*peer*/, const std::string& name, proto::PairOffer& offer,
                    Clock::time_point /*deadline: the link waits up to the rendezvous timeout*/,
                    coord::CoordinatorClient& cc) override {
    // NCCL ids are single-use: a fresh offer (CUDA IPC: fresh memory), brokered like the first pairing.
    transport::LinkOptions glo = lo_;
    glo.peer_name = name;
    std::shared_ptr<transport::GpuLinkOffer> fresh = transport::offer_gpu_link(glo);
    offer.mutable_transport()->set_kind(transport_kind(glo.kind));
    offer.mutable_transport()->set_address(fresh->address());
    cc.send_pair_offer(offer);
    const EngineOptions en = engine_->options();
    const GpuSparseOptions gso = gpu_sparse_options(sparse_, en, name);
    const ModelConfig* attn = gpu_attn_cfg_.get();
    const int max_batch = gpu_->max_batch();
    const int device = opt_.gpu;
    const auto timeout = opt_.rendezvous_timeout;
    repair_gpu_ = std::async(std::launch::async, [fresh, name, en, gso, attn, max_batch, device, timeout] {
      cuda_check(cudaSetDevice(device), "inference rank: cudaSetDevice (re-pairing)");
      Repaired g;
      g.link = fresh->connect(name, timeout);
      g.controller = std::make_unique<GpuSparseController>(*attn, gso, *g.link, en.page_size, max_batch);
      g.controller->send_hello(make_gpu_pair_hello(*attn, gso, en));
      return g;
    });
  }

  bool repair_ready() override {
    return repair_gpu_.valid() && repair_gpu_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  void swap_in(const proto::RankInfo& peer, const RequestTable& requests) override {
    Repaired g = repair_gpu_.get();
    check_not_declared_dead(peer.incarnation());
    // The samples admitted before the swap have tokens the new cache rank never received: dense to their end.
    requests.for_each_sample([&g](uint64_t eid, int /*threshold*/, int /*token_budget*/) { g.controller->detach(eid); });
    if (gpu_sparse_) add(retired_stats_, gpu_sparse_->stats());  // the old controller's counters keep counting
    health_->rearm(nullptr, nullptr);  // the old link goes below
    gpu_->set_sparse(g.controller.get());
    engine_->set_attention_hooks(g.controller.get());
    gpu_sparse_ = std::move(g.controller);  // the old controller goes before its link
    gpu_link_owner_ = std::move(g.link);
    gpu_link_ = gpu_link_owner_.get();
    health_->restore(nullptr, gpu_link_);
  }

  void drop_repair() override { repair_gpu_ = {}; }

  void path_limits(IntakeLimits& limits) const override {
    limits.on_gpu = true;
    limits.rank_token_budget = sparse_.selection.token_budget;
    limits.cpu_backend = false;
  }

  void idle_flush() override {}

  std::optional<std::string> link_failure() override {
    if (!gpu_sparse_ || !gpu_sparse_->link_failed()) return std::nullopt;
    return gpu_link_->failure();
  }

  void publish_stats(coord::CoordinatorClient& cc, InferenceMetrics& metrics) override {
    SparseStats s;
    pair::LinkStats l;
    if (!stats(s, l)) {
      metrics.update(engine_->stats(), nullptr, nullptr);
      return;
    }
    cc.set_stat("sparse_seq_steps", static_cast<double>(s.sparse_seq_steps));
    metrics.update(engine_->stats(), &s, &l);
  }

  void close_sessions() override {
    SparseStats s;
    pair::LinkStats l;
    const uint64_t link_graph_replays = gpu_ != nullptr ? gpu_->link_graph_steps() : 0;
    if (stats(s, l))
      spdlog::info("{}: {} steps, {} sparse sequence-steps, {} switches, {} failed, {:.1f} MB up, {:.1f} MB down, "
                   "{} KV pages dropped, {} link-step graph replays",
                   self_, s.steps, s.sparse_seq_steps, s.switches, s.failed_seqs, l.bytes_sent / 1e6,
                   l.bytes_received / 1e6, engine_->stats().dropped_pages, link_graph_replays);
    if (gpu_sparse_) gpu_sparse_->close();  // the close plan: the cache rank posts nothing more
  }

  void release() override {
    // The controller before the forward pass, both before the engine; the link last.
    gpu_sparse_.reset();
    gpu_attn_cfg_.reset();
    gpu_.reset();
    engine_.reset();
    gpu_link_owner_.reset();
    gpu_link_ = nullptr;
  }

 private:
  struct Repaired {
    std::unique_ptr<transport::GpuLink> link;
    std::unique_ptr<GpuSparseController> controller;
  };

  static proto::TransportKind transport_kind(transport::LinkKind kind) {
    return kind == transport::LinkKind::kNccl ? proto::TRANSPORT_NCCL : proto::TRANSPORT_CUDA_IPC;
  }
  static void add(GpuSparseStats& into, const GpuSparseStats& s) {
    into.steps += s.steps;
    into.sparse_seq_steps += s.sparse_seq_steps;
    into.switches += s.switches;
    into.failed_seqs += s.failed_seqs;
    into.bytes_sent += s.bytes_sent;
    into.bytes_received += s.bytes_received;
  }
  // The counters in the CPU path's shapes (metrics and coordinator stats), over every controller a re-pairing
  // replaced too; false without a controller.
  bool stats(SparseStats& s, pair::LinkStats& l) const {
    if (!gpu_sparse_) return false;
    const GpuSparseStats& g = gpu_sparse_->stats();
    const GpuSparseStats& r = retired_stats_;
    s.steps = g.steps + r.steps;
    s.sparse_seq_steps = g.sparse_seq_steps + r.sparse_seq_steps;
    s.switches = g.switches + r.switches;
    s.failed_seqs = g.failed_seqs + r.failed_seqs;
    l.bytes_sent = g.bytes_sent + r.bytes_sent;
    l.bytes_received = g.bytes_received + r.bytes_received;
    l.updates = s.steps;
    return true;
  }

  transport::LinkOptions lo_;
  std::unique_ptr<transport::GpuLinkOffer> offer_;  // null without a cache rank or with dense selection
  std::unique_ptr<transport::GpuLink> gpu_link_owner_;
  transport::GpuLink* gpu_link_ = nullptr;
  std::unique_ptr<GpuEngineForward> gpu_;
  std::unique_ptr<ModelConfig> gpu_attn_cfg_;
  std::unique_ptr<GpuSparseController> gpu_sparse_;
  GpuSparseStats retired_stats_;  // of the controllers a re-pairing replaced
  std::future<Repaired> repair_gpu_;
};

}  // namespace

std::unique_ptr<DataPlane> make_gpu_data_plane(DataPlaneSetup setup, coord::ClientOptions& co) {
  return std::make_unique<GpuDataPlane>(std::move(setup), co);
}

}  // namespace spade
