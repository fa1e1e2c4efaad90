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
// cache #0..#M-1 (world size = 1 + N + M). An explicit role map lists the role of every global rank,
// comma-separated: "c,i,i,k,k" (c = coordinator, i = inference, k = cache; full names "coordinator",
// "inference", "cache" work too). It must contain exactly one coordinator. role_index = position among the
// ranks of the same role.
//
// Errors (spade::Error) name the value and where it came from, e.g.
//   "rank 5 (env RANK) is out of range for world size 3 (flag --world-size)".
#pragma once

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
};

/// Registers the ranks' launch flags on `app`, writing into `lf` (the one place they are declared): --master-addr,
/// --master-port, --rank, --world-size, --num-inference, --num-cache, --role-map. Unset flags stay nullopt, so
/// LaunchEnv::resolve falls back to the environment (MASTER_ADDR, RANK, OMPI_COMM_WORLD_RANK, ...).
void add_launch_flags(CLI::App& app, LaunchFlags& lf);

/// Environment lookup (injectable for tests). Returns nullopt when the variable is unset; empty values count
/// as unset.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// Looks variables up in the process environment (getenv).
EnvLookup process_env();

/// Lower-case role name: "coordinator", "inference", "cache", "client", "unspecified".
std::string role_name(proto::Role role);

/// Parses "c,i,i,k,k" (or full role names). Throws spade::Error naming the bad entry and its position.
std::vector<proto::Role> parse_role_map(std::string_view text);

/// The default rule: [coordinator, inference x num_inference, cache x num_cache].
std::vector<proto::Role> default_role_map(uint32_t num_inference, uint32_t num_cache);

/// The resolved launch configuration of this process.
struct LaunchEnv {
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  uint32_t rank = 0;        // global rank
  uint32_t world_size = 0;  // 1 + num_inference + num_cache
  uint32_t local_rank = 0;
  uint32_t num_inference = 0;
  uint32_t num_cache = 0;
  std::vector<proto::Role> role_map;           // role of every global rank; size == world_size
  proto::Role role = proto::ROLE_UNSPECIFIED;  // role_map[rank]
  uint32_t role_index = 0;                     // index of `rank` among ranks of its role
  std::map<std::string, std::string> sources;  // field -> where it came from, e.g. "rank" -> "env RANK"
  std::vector<std::string> notes;              // lower-precedence values that were overridden

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
