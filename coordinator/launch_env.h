// Launcher environment: who am I (rank, role) and where is the coordinator, from flags, torchrun or Open MPI.
//
// Precedence, per field: explicit flag > torchrun variable > Open MPI variable > default.
//   rank        : --rank        > RANK        > OMPI_COMM_WORLD_RANK       > 0
//   world size  : --world-size  > WORLD_SIZE  > OMPI_COMM_WORLD_SIZE       > derived from the role counts
//   local rank  : --local-rank  > LOCAL_RANK  > OMPI_COMM_WORLD_LOCAL_RANK > 0
//   master addr : --master-addr > MASTER_ADDR                              > 127.0.0.1
//   master port : --master-port > MASTER_PORT                              > 29500
//   role map    : --role-map    > SPADE_ROLE_MAP                           > default rule
// Lower-precedence values that disagree with the chosen one are recorded in LaunchEnv::notes (not an error:
// the precedence rule decides).
//
// Role map rule: global rank 0 is the coordinator, ranks 1..N are inference #0..#N-1, ranks N+1..N+M are
// cache #0..#M-1 (world size = 1 + N + M). M must be a multiple of N: each inference rank pairs with M / N cache
// ranks (cache_ranks_per_inference). An explicit role map lists the role of every global rank,
// comma-separated: "c,i,i,k,k" (c = coordinator, i = inference, k = cache; full names "coordinator",
// "inference", "cache" work too). It must contain exactly one coordinator. role_index = position among the
// ranks of the same role.
//
// Cluster secret (authenticates every control connection; docs/DEPLOY.md, "Security model"):
//   --cluster-secret-file PATH > SPADE_CLUSTER_SECRET_FILE (a path) > SPADE_CLUSTER_SECRET (the secret
//   itself) > none
// The file is read once, here: a regular file of at most kMaxClusterSecretBytes that no "other" user may read
// or write (mode 0600/0640/0400/0440), trailing whitespace removed, at least kMinClusterSecretBytes left.
//
// Errors (spade::Error) name the value and where it came from, e.g.
//   "rank 5 (env RANK) is out of range for world size 3 (flag --world-size)".
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/proto/coordinator.pb.h"

namespace CLI {
class App;
}  // namespace CLI

namespace spade::coord {

/// Values given on the command line; std::nullopt = flag not given.
struct LaunchFlags {
  std::optional<std::string> master_addr;
  std::optional<uint32_t> master_port;
  std::optional<uint32_t> rank;
  std::optional<uint32_t> world_size;
  std::optional<uint32_t> local_rank;
  std::optional<uint32_t> num_inference;
  std::optional<uint32_t> num_cache;
  std::optional<std::string> role_map;
  std::optional<std::string> cluster_secret_file;
};

/// Bounds of a cluster secret, in bytes (after trailing whitespace is removed).
inline constexpr size_t kMinClusterSecretBytes = 16;
inline constexpr size_t kMaxClusterSecretBytes = 4096;

/// The shared secret of a Spade world and where it came from. `value` is secret: never log it.
struct ClusterSecret {
  std::string value;   // empty = none configured
  std::string source;  // "flag --cluster-secret-file /run/s", "env SPADE_CLUSTER_SECRET_FILE /run/s",
                       // "env SPADE_CLUSTER_SECRET", or "none"
  bool empty() const { return value.empty(); }
};

/// Registers the ranks' launch flags on `app`, writing into `lf` (the one place they are declared):
/// --master-addr,
/// --master-port, --rank, --world-size, --num-inference, --num-cache, --role-map, --cluster-secret-file.
/// Unset flags stay nullopt, so LaunchEnv::resolve falls back to the environment (MASTER_ADDR, RANK,
/// OMPI_COMM_WORLD_RANK, ...).
void add_launch_flags(CLI::App& app, LaunchFlags& lf);

/// Registers --cluster-secret-file on `app` (add_launch_flags does; the coordinator and spade_submit, which
/// declare their other flags themselves, call this one).
void add_cluster_secret_flag(CLI::App& app, std::optional<std::string>& file);

/// Environment lookup (injectable for tests). Returns nullopt when the variable is unset; empty values count
/// as unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// Looks variables up in the process environment (getenv).
EnvLookup process_env();

/// Lower-case role name: "coordinator", "inference", "cache", "client", "unspecified".
std::string role_name(proto::Role role);

/// N, the cache ranks of each inference rank: num_cache / num_inference, or 0 when the world has no cache rank.
/// Inference #i pairs with cache #(i*N + s), s = 0..N-1, each holding the layers of one shard (pair/sharded_link.h).
/// Derived from the world's role counts, its one home (no flag of its own): every rank computes the same N.
/// Throws spade::Error naming both counts when num_cache is not a multiple of num_inference (or there are cache
/// ranks but no inference rank).
uint32_t cache_ranks_per_inference(uint32_t num_inference, uint32_t num_cache);

/// "inference #i <-> cache #i" (N = 1) or "inference #i <-> cache #(i*N + s), s = 0..N-1" with N's value: the
/// pairing rule, as ClusterView.pairing_rule and the logs state it.
std::string pairing_rule(uint32_t cache_per_inference);

/// Parses "c,i,i,k,k" (or full role names). Throws spade::Error naming the bad entry and its position.
std::vector<proto::Role> parse_role_map(std::string_view text);

/// The default rule: [coordinator, inference x num_inference, cache x num_cache].
std::vector<proto::Role> default_role_map(uint32_t num_inference, uint32_t num_cache);

/// Resolves the cluster secret: `file_flag` (--cluster-secret-file) > env SPADE_CLUSTER_SECRET_FILE > env
/// SPADE_CLUSTER_SECRET > none (empty value, source "none"). Throws spade::Error naming the file or variable
/// when the file cannot be opened, is not a regular file, is larger than kMaxClusterSecretBytes, is readable
/// or writable by other users, or the secret is shorter than kMinClusterSecretBytes. Never includes the
/// secret in a message.
ClusterSecret resolve_cluster_secret(const std::optional<std::string>& file_flag,
                                     const EnvLookup& env = process_env());

/// The resolved launch configuration of this process.
struct LaunchEnv {
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  uint32_t rank = 0;        // global rank
  uint32_t world_size = 0;  // 1 + num_inference + num_cache
  uint32_t local_rank = 0;
  uint32_t num_inference = 0;
  uint32_t num_cache = 0;
  uint32_t cache_per_inference = 0;            // cache_ranks_per_inference(num_inference, num_cache)
  std::vector<proto::Role> role_map;           // role of every global rank; size == world_size
  proto::Role role = proto::ROLE_UNSPECIFIED;  // role_map[rank]
  uint32_t role_index = 0;                     // index of `rank` among ranks of its role
  std::map<std::string, std::string> sources;  // field -> where it came from, e.g. "rank" -> "env RANK"
  std::vector<std::string> notes;              // lower-precedence values that were overridden
  ClusterSecret cluster_secret;                // resolve_cluster_secret(flags.cluster_secret_file, env)

  /// Resolves flags + environment with the precedence above. Throws spade::Error on unparsable or
  /// inconsistent values.
  static LaunchEnv resolve(const LaunchFlags& flags, const EnvLookup& env = process_env());

  /// Role index of global rank `r` (throws when out of range).
  uint32_t role_index_of(uint32_t r) const;
  /// Global rank of (role, role_index); throws when there is no such rank.
  uint32_t rank_of(proto::Role r, uint32_t role_index) const;
  /// "rank 3 (cache #0)".
  std::string describe_rank(uint32_t r) const;
  /// "c,i,k" form of role_map.
  std::string role_map_string() const;
};

}  // namespace spade::coord
