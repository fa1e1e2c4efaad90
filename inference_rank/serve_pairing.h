// inference_rank --serve, the pair side (inference_rank/serve.h): the pair's health (PairHealth) and the data plane to
// this rank's cache rank(s) (DataPlane): the link offered before registering and connected after the rendezvous
// (UCX to one or N cache ranks, N layer shards through pair::ShardedLink; on the GPU an NcclLink or CudaIpcLink),
// the engine with its sparse backend over that link, the handling of a dead cache rank (PeerDown) and the re-pairing
// with its replacement (PeerReplaced; with N layer shards, of the replaced shard alone), the pair's statistics and
// the end of its sessions. The CPU and the GPU data plane are two implementations chosen at run time by
// make_data_plane(); the GPU one exists only in CUDA builds.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/client.h"
#include "inference_rank/engine.h"
#include "inference_rank/model.h"
#include "inference_rank/rank_metrics.h"
#include "inference_rank/serve.h"
#include "inference_rank/serve_requests.h"
#include "inference_rank/sparse_attention.h"
#include "transport/gpu_link.h"
#include "transport/link_factory.h"
#include "transport/transport.h"

namespace spade {

/// The pair's health, as the status endpoint, the metrics and the control plane see it. degrade() may come from any
/// thread: the coordinator client's I/O thread calls it on a PeerDown for the paired cache rank, with `abort_link`, so
/// that the link is aborted at once even while the main loop is blocked inside a step waiting on it (the abort runs
/// on a thread of its own: the I/O thread must not block, and an NCCL abort may take a while).
class PairHealth {
 public:
  ~PairHealth() { disarm(); }
  /// The link to abort (not owned; either may be null). Main thread, once the link's owner (the engine) exists.
  void arm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link);
  /// Layer shards: one endpoint per cache rank, in shard order (degrade's `shard` indexes them).
  void arm(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link);
  /// Marks the pair degraded (the first reason stays unless `replace_reason`) and, with `abort_link`, aborts the armed
  /// link once: of the endpoints only shard `shard`'s (the dead cache rank's; -1: all). Returns at once.
  void degrade(const std::string& why, bool abort_link, bool replace_reason = false, int shard = -1);
  /// Forgets the link (before its owner destroys it) and waits for an abort in progress. Main thread; idempotent.
  void disarm();
  /// Waits for an abort in progress, then arms these links (null: none) without touching the reason: before the armed
  /// link's owner destroys it. Main thread.
  void rearm(transport::Endpoint* endpoint, transport::GpuLink* gpu_link);
  /// Layer shards: the endpoints of every cache rank, in shard order.
  void rearm(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link);
  /// The pair is whole again (a replacement cache rank re-paired): waits for the old link's abort, arms the new link
  /// (not owned; its owner must disarm or restore before destroying it) and clears the reason. Main thread.
  void restore(transport::Endpoint* endpoint, transport::GpuLink* gpu_link);
  /// Layer shards: the endpoints of every cache rank, in shard order (a replaced shard's new one included).
  void restore(std::vector<transport::Endpoint*> endpoints, transport::GpuLink* gpu_link);
  /// "" while the pair is whole, else why it is not.
  std::string degraded() const;

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

/// What a data plane is made from (make_data_plane).
struct DataPlaneSetup {
  std::string self;              // "inference rank R (#i)": the prefix of its log lines and errors
  const ServeOptions& opt;       // outlives the data plane
  const coord::LaunchEnv& env;   // outlives the data plane
  ModelConfig model_cfg;         // the model's configuration (layer packs, the GPU upload)
  std::shared_ptr<PairHealth> health;            // shared with the status endpoint
  std::function<void(std::string)> set_stage;    // tells /ready what the rank is waiting for ("" once ready)
};

/// The data plane of one inference rank, from before it registers to its shutdown. Main thread only, except the
/// PeerDown callback watch() installs. The order of use: make_data_plane() (before the coordinator client exists: it
/// fills the client's transport fields), connect() after the rendezvous, build_engine(), watch(); then each loop turn
/// on_peer_down() / on_peer_replaced() for the control plane's events, finish_repair(), set_request_options() for
/// each new sample, after_step() and publish(); at the end shutdown(), and teardown() before the coordinator client
/// is destroyed (the destructor tears down too).
class DataPlane {
 public:
  using Clock = std::chrono::steady_clock;

  virtual ~DataPlane() = default;
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  /// After the rendezvous: connects the link(s) to this rank's cache rank(s) in `view` (the peers of the view, in
  /// shard order) by `deadline`; with none, predicted selection falls back to dense (a warning). Throws spade::Error
  /// naming the cache rank (connect failures, a layer-pack count below the cache-rank count, a CPU-only --selection
  /// on the GPU).
  virtual void connect(const proto::ClusterView& view, Clock::time_point deadline) = 0;
  /// Builds the engine over `model` with the rank's EngineOptions and the sparse backend over the connected link
  /// (the GPU path uploads the weights, warms up and releases `model`; the CPU path keeps a reference to it, so
  /// `model` must outlive teardown()). Once.
  virtual Engine& build_engine(std::unique_ptr<Model>& model) = 0;
  /// The rank's sparse options in effect (predicted selection becomes dense when the world has no cache rank).
  const SparseOptions& sparse() const { return sparse_; }
  /// The metrics' transport label: the host transport's kind(), "nccl" or "cuda_ipc"; "none" without a cache rank.
  virtual std::string transport_name() const = 0;
  /// What a request is checked against (parse_request), from the model, the engine and the sparse backend.
  IntakeLimits intake_limits() const;
  /// Arms the pair's health with the connected link and, when there is one, has the I/O thread of `cc` abort it on a
  /// PeerDown for one of this rank's cache ranks (only that shard's endpoint with layer shards).
  void watch(coord::CoordinatorClient& cc);
  /// A PeerDown, on the main thread: for one of this rank's cache ranks the pair is degraded (the callback of watch()
  /// has aborted the link already); sparse requests in flight fail, every other one decodes densely.
  void on_peer_down(const proto::PeerDown& pd);
  /// A PeerReplaced for one of this rank's cache ranks: offers the replacement the data plane through `cc`
  /// (PairOffer) and connects to it on a thread of its own, within the rendezvous timeout; finish_repair() swaps it
  /// in. With N layer shards only the replaced shard s is re-paired: the replacement must be the cache rank of shard
  /// s (RankInfo role, role_index and shard; else it is refused, naming it, and gets no offer), and once connected it
  /// is probed (pair::probe_shard: it must hold shard s's layers; else it is refused, naming it and the layers, and
  /// its session is ended). A replacement of another rank or of an older incarnation is ignored (a warning); a
  /// refused replacement or a failed offer leaves the pair degraded, saying why.
  void on_peer_replaced(const proto::PeerReplaced& pr, coord::CoordinatorClient& cc);
  /// Swaps the replacement's link in once it is up, between two steps: the samples of `requests` stay dense to their
  /// end, new requests decode sparsely and the pair is whole again (with N layer shards: once no shard is down or
  /// re-pairing; the other shards keep their links and release what they held, pair::ShardedLink::replaced). A
  /// failed connect or probe, or a replacement declared dead while connecting, leaves the pair degraded, saying why.
  /// Returns at once while the connect is under way.
  void finish_repair(const RequestTable& requests);
  /// Applies a request's own sparse options (force_dense, sparse_threshold, token_budget) to one of its samples.
  /// Throws spade::Error when the sparse backend refuses them.
  virtual void set_request_options(uint64_t engine_id, const IntakeRequest& r) = 0;
  /// After each loop turn's step: flushes the cache rank's pending releases when idle, and marks the pair degraded
  /// when its link failed without a PeerDown (a transport error, a late selection).
  void after_step();
  /// Publishes spade_pair_degraded, the engine's and the pair's counters (every link a re-pairing replaced
  /// included) to `metrics` and the pair's statistics to the coordinator (cc.set_stat).
  void publish(coord::CoordinatorClient& cc, InferenceMetrics& metrics);
  /// The end of the serving loop: logs the pair's totals and ends the session of each cache rank; detaches the
  /// sparse hooks from the engine.
  void shutdown();
  /// Drops a re-pairing under way, disarms the pair's health and destroys the engine with its links (the host
  /// transport or GPU offer stays until destruction). Before the coordinator client is destroyed; idempotent.
  void teardown();

 protected:
  explicit DataPlane(DataPlaneSetup setup);

  /// "cache rank R (#i) on HOST".
  static std::string cache_rank_name(const proto::RankInfo& peer);
  /// The link options of this rank's end (name, GPU, timeouts; the kind is the caller's).
  transport::LinkOptions link_options() const;
  /// No cache rank in the world: predicted selection becomes dense (a warning).
  void no_cache_rank();
  /// The shard of global rank `r` among this rank's cache ranks, -1 for another rank.
  int shard_of_rank(uint32_t r) const;
  /// Throws spade::Error when the cache rank of `incarnation` (of layer shard `shard`; 0 without shards) was declared
  /// dead while it was being connected.
  void check_not_declared_dead(uint32_t incarnation, int shard = 0) const;

  // The implementation's part of each step above.
  virtual void arm_health() = 0;
  virtual bool predicted() const = 0;
  /// Layer shards: handles a replaced shard and returns true; false when there are no shards.
  virtual bool replace_shard(const proto::PeerReplaced& pr, const std::string& name, coord::CoordinatorClient& cc);
  /// Layer shards: swaps in the replaced shards whose connect (and probe) ended (finish_repair).
  virtual void finish_shard_repairs(const RequestTable& requests);
  /// Sends `offer` (peer rank and incarnation set) with this rank's fresh address and starts connecting to `peer`.
  virtual void start_repair(const proto::RankInfo& peer, const std::string& name, proto::PairOffer& offer,
                            Clock::time_point deadline, coord::CoordinatorClient& cc) = 0;
  virtual bool repair_ready() = 0;
  /// Takes the connected replacement (rethrowing its connect error) and swaps it in; throws spade::Error.
  virtual void swap_in(const proto::RankInfo& peer, const RequestTable& requests) = 0;
  virtual void drop_repair() = 0;
  virtual void path_limits(IntakeLimits& limits) const = 0;
  virtual void idle_flush() = 0;
  /// nullopt while the link works, else why it failed ("" when it does not say).
  virtual std::optional<std::string> link_failure() = 0;
  virtual void publish_stats(coord::CoordinatorClient& cc, InferenceMetrics& metrics) = 0;
  virtual void close_sessions() = 0;
  /// Destroys the engine and the links in their order (teardown(), after the health is disarmed).
  virtual void release() = 0;

  const std::string self_;
  const ServeOptions& opt_;
  const coord::LaunchEnv& env_;
  const ModelConfig model_cfg_;
  std::shared_ptr<PairHealth> health_;  // shared with the coordinator client's event callback
  std::function<void(std::string)> set_stage_;
  SparseOptions sparse_;
  std::unique_ptr<Engine> engine_;
  bool has_link_ = false;            // connect() connected a link
  std::vector<uint32_t> shard_ranks_;  // the global ranks of this rank's cache ranks, in shard order
  std::string cache_name_;             // the cache rank(s), as the logs name them
  uint32_t cache_incarnation_ = 0;

 private:
  struct PendingRepair {
    proto::RankInfo peer;
    std::string name;
  };
  std::optional<PendingRepair> repair_;
  // Per cache rank (shard order), the newest incarnation declared dead (-1: none): a replacement that dies while it is
  // being connected is not swapped in. Shared with the coordinator client's event callback (sized by watch()).
  std::shared_ptr<std::vector<std::atomic<int64_t>>> cache_down_incarnation_ = down_incarnations(1);
  static std::shared_ptr<std::vector<std::atomic<int64_t>>> down_incarnations(size_t n);
};

/// The data plane for `setup.opt.device` ("cpu": UCX to the cache rank(s) when the world has any; "cuda": an NCCL /
/// CUDA IPC link offered now when the world has a cache rank and the selection is predicted). Fills the transport
/// fields (and the device) of `co`, the coordinator client's options. Throws spade::Error naming `setup.self` and the
/// flag: a CUDA device in a build without CUDA, a --gpu-link other than nccl / ipc, a GPU link with several cache
/// ranks per inference rank.
std::unique_ptr<DataPlane> make_data_plane(DataPlaneSetup setup, coord::ClientOptions& co);

/// The GPU data plane (make_data_plane with device "cuda"); defined only in CUDA builds (serve_pairing_gpu.cpp).
std::unique_ptr<DataPlane> make_gpu_data_plane(DataPlaneSetup setup, coord::ClientOptions& co);

}  // namespace spade
