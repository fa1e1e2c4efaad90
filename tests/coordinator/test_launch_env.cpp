// LaunchEnv: flags > torchrun env > Open MPI env, role map rule, inconsistent values.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "common/error.h"
#include "coordinator/client.h"
#include "coordinator/launch_env.h"
#include "tests/test_util.h"

namespace spade::coord {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

std::string error_of(const LaunchFlags& f, std::map<std::string, std::string> env) {
  try {
    LaunchEnv::resolve(f, env_of(std::move(env)));
  } catch (const spade::Error& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchEnv, TorchrunVariables) {
  auto le = LaunchEnv::resolve({}, env_of({{"RANK", "3"},
                                           {"WORLD_SIZE", "5"},
                                           {"LOCAL_RANK", "1"},
                                           {"MASTER_ADDR", "10.0.0.7"},
                                           {"MASTER_PORT", "29555"}}));
  EXPECT_EQ(le.rank, 3u);
  EXPECT_EQ(le.world_size, 5u);
  EXPECT_EQ(le.local_rank, 1u);
  EXPECT_EQ(le.master_addr, "10.0.0.7");
  EXPECT_EQ(le.master_port, 29555);
  EXPECT_EQ(le.num_inference, 2u);
  EXPECT_EQ(le.num_cache, 2u);
  EXPECT_EQ(le.role_map_string(), "c,i,i,k,k");
  EXPECT_EQ(le.role, proto::CACHE);
  EXPECT_EQ(le.role_index, 0u);
  EXPECT_EQ(le.sources.at("rank"), "env RANK");
  EXPECT_EQ(le.describe_rank(3), "rank 3 (cache #0)");
  EXPECT_EQ(le.rank_of(proto::CACHE, 1), 4u);
  EXPECT_EQ(le.rank_of(proto::INFERENCE, 0), 1u);
}

TEST(LaunchEnv, OpenMpiVariables) {
  auto le = LaunchEnv::resolve({}, env_of({{"OMPI_COMM_WORLD_RANK", "2"},
                                           {"OMPI_COMM_WORLD_SIZE", "3"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}}));
  EXPECT_EQ(le.rank, 2u);
  EXPECT_EQ(le.world_size, 3u);
  EXPECT_EQ(le.local_rank, 2u);
  EXPECT_EQ(le.role, proto::CACHE);
  EXPECT_EQ(le.sources.at("rank"), "env OMPI_COMM_WORLD_RANK");
  EXPECT_EQ(le.sources.at("master_addr"), "default");
  EXPECT_EQ(le.master_port, 29500);
}

TEST(LaunchEnv, PrecedenceFlagsOverTorchrunOverOmpi) {
  std::map<std::string, std::string> env = {
      {"RANK", "1"}, {"OMPI_COMM_WORLD_RANK", "2"}, {"WORLD_SIZE", "3"}, {"OMPI_COMM_WORLD_SIZE", "3"}};
  auto le = LaunchEnv::resolve({}, env_of(env));
  EXPECT_EQ(le.rank, 1u);  // torchrun beats Open MPI
  EXPECT_EQ(le.role, proto::INFERENCE);
  ASSERT_EQ(le.notes.size(), 1u);  // the overridden OMPI value is noted
  EXPECT_NE(le.notes[0].find("OMPI_COMM_WORLD_RANK"), std::string::npos) << le.notes[0];

  LaunchFlags f;
  f.rank = 2;
  f.master_port = 31000;
  env["MASTER_PORT"] = "29501";
  auto le2 = LaunchEnv::resolve(f, env_of(env));
  EXPECT_EQ(le2.rank, 2u);  // flag beats both
  EXPECT_EQ(le2.sources.at("rank"), "flag --rank");
  EXPECT_EQ(le2.master_port, 31000);
  EXPECT_EQ(le2.role, proto::CACHE);
}

TEST(LaunchEnv, ExplicitRoleMap) {
  LaunchFlags f;
  f.role_map = "i, k, c, I, cache";
  f.rank = 3;
  auto le = LaunchEnv::resolve(f, env_of({}));
  EXPECT_EQ(le.world_size, 5u);
  EXPECT_EQ(le.num_inference, 2u);
  EXPECT_EQ(le.num_cache, 2u);
  EXPECT_EQ(le.role, proto::INFERENCE);
  EXPECT_EQ(le.role_index, 1u);
  EXPECT_EQ(le.role_map_string(), "i,k,c,i,k");
  EXPECT_EQ(le.rank_of(proto::COORDINATOR, 0), 2u);
  // Role map from the environment when no flag is given.
  auto le2 = LaunchEnv::resolve({}, env_of({{"SPADE_ROLE_MAP", "c,i,k"}, {"RANK", "2"}}));
  EXPECT_EQ(le2.role, proto::CACHE);
}

TEST(LaunchEnv, CountsFromFlags) {
  LaunchFlags f;
  f.num_inference = 3;
  f.num_cache = 3;
  auto le = LaunchEnv::resolve(f, env_of({}));
  EXPECT_EQ(le.world_size, 7u);
  EXPECT_EQ(le.rank, 0u);
  EXPECT_EQ(le.role, proto::COORDINATOR);
  EXPECT_EQ(le.role_map_string(), "c,i,i,i,k,k,k");
}

TEST(LaunchEnv, CacheRanksPerInferenceIsTheRatioOfTheCounts) {
  EXPECT_EQ(cache_ranks_per_inference(1, 1), 1u);
  EXPECT_EQ(cache_ranks_per_inference(2, 6), 3u);
  EXPECT_EQ(cache_ranks_per_inference(3, 0), 0u);  // no cache rank: nothing to pair
  LaunchFlags f;
  f.num_inference = 2;
  f.num_cache = 4;
  auto le = LaunchEnv::resolve(f, env_of({{"RANK", "6"}}));
  EXPECT_EQ(le.cache_per_inference, 2u);
  EXPECT_EQ(le.role, proto::CACHE);
  EXPECT_EQ(le.role_index, 3u);
  auto mapped = LaunchEnv::resolve({}, env_of({{"RANK", "1"}, {"SPADE_ROLE_MAP", "c,k,i,k,k"}}));
  EXPECT_EQ(mapped.cache_per_inference, 3u);
  EXPECT_EQ(pairing_rule(1), "inference #i <-> cache #i");
  EXPECT_EQ(pairing_rule(3), "inference #i <-> cache #(i*3 + s), s = 0..2 (layer shards)");
  // Not a multiple: refused by name with both counts, wherever the counts came from.
  f.num_inference = 2;
  f.num_cache = 3;
  EXPECT_NE(error_of(f, {{"RANK", "0"}}).find("cannot pair 2 inference rank(s) with 3 cache rank(s)"),
            std::string::npos)
      << error_of(f, {{"RANK", "0"}});
  EXPECT_NE(error_of({}, {{"RANK", "0"}, {"SPADE_ROLE_MAP", "c,i,i,k,k,k"}}).find("multiple of --num-inference"),
            std::string::npos);
  EXPECT_THROW(cache_ranks_per_inference(0, 2), spade::Error);
}

TEST(LaunchEnv, InconsistentValuesAreClearErrors) {
  LaunchFlags counts;
  counts.num_inference = 1;
  counts.num_cache = 1;
  auto e = error_of(counts, {{"WORLD_SIZE", "5"}});
  EXPECT_NE(e.find("world size 5 (env WORLD_SIZE) contradicts --num-inference 1 + --num-cache 1"),
            std::string::npos)
      << e;

  e = error_of({}, {{"RANK", "5"}, {"WORLD_SIZE", "3"}});
  EXPECT_NE(e.find("rank 5 (env RANK) is out of range for world size 3 (env WORLD_SIZE)"), std::string::npos)
      << e;

  e = error_of({}, {{"RANK", "abc"}, {"WORLD_SIZE", "3"}});
  EXPECT_NE(e.find("env RANK='abc' is not a non-negative 32-bit integer"), std::string::npos) << e;

  e = error_of({}, {{"RANK", "0"}, {"WORLD_SIZE", "4"}});
  EXPECT_NE(e.find("cannot be split"), std::string::npos) << e;

  e = error_of({}, {{"RANK", "0"}});
  EXPECT_NE(e.find("world size unknown"), std::string::npos) << e;

  LaunchFlags map;
  map.role_map = "c,i,k";
  e = error_of(map, {{"WORLD_SIZE", "5"}});
  EXPECT_NE(e.find("contradicts role map"), std::string::npos) << e;

  map.num_inference = 2;
  e = error_of(map, {});
  EXPECT_NE(e.find("--num-inference 2 contradicts role map"), std::string::npos) << e;

  LaunchFlags bad_map;
  bad_map.role_map = "c,i,x";
  e = error_of(bad_map, {});
  EXPECT_NE(e.find("entry 2 is 'x'"), std::string::npos) << e;
  bad_map.role_map = "c,i,c,k";
  e = error_of(bad_map, {});
  EXPECT_NE(e.find("2 coordinators"), std::string::npos) << e;

  e = error_of({}, {{"WORLD_SIZE", "3"}, {"MASTER_PORT", "70000"}});
  EXPECT_NE(e.find("master port 70000 (env MASTER_PORT) is out of range"), std::string::npos) << e;

  e = error_of({}, {{"WORLD_SIZE", "3"}, {"LOCAL_RANK", "9"}});
  EXPECT_NE(e.find("local rank 9 (env LOCAL_RANK)"), std::string::npos) << e;
}

TEST(LaunchEnv, ClientOptionsFollowTheLaunchEnv) {
  auto le = LaunchEnv::resolve({}, env_of({{"RANK", "4"},
                                           {"WORLD_SIZE", "5"},
                                           {"LOCAL_RANK", "0"},
                                           {"MASTER_ADDR", "node-0"},
                                           {"MASTER_PORT", "29600"}}));
  auto o = client_options_for(le);
  EXPECT_EQ(o.coordinator_host, "node-0");
  EXPECT_EQ(o.coordinator_port, 29600);
  EXPECT_EQ(o.role, proto::CACHE);
  EXPECT_EQ(o.rank, 4u);
  EXPECT_EQ(o.role_index, 1u);
  EXPECT_EQ(o.world_size, 5u);
}

// ---- cluster secret
// ----------------------------------------------------------------------------------------------

// Writes `content` to a fresh file in `dir` with permissions `mode`; returns its path.
std::string secret_file(const std::string& dir, const std::string& name, const std::string& content,
                        mode_t mode) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  ::chmod(path.c_str(), mode);
  return path;
}

std::string secret_error(const std::optional<std::string>& flag, std::map<std::string, std::string> env) {
  try {
    resolve_cluster_secret(flag, env_of(std::move(env)));
  } catch (const spade::Error& e) {
    return e.what();
  }
  return "";
}

TEST(ClusterSecret, FlagFileOverEnvFileOverEnvValueTrimmed) {
  const std::string dir = spade::test::make_temp_dir("spade_secret_");
  const std::string a = secret_file(dir, "a", "secret-from-the-flag-file\n", 0600);
  const std::string b = secret_file(dir, "b", "secret-from-the-env-file\r\n", 0400);
  auto s = resolve_cluster_secret(
      a, env_of({{"SPADE_CLUSTER_SECRET_FILE", b}, {"SPADE_CLUSTER_SECRET", "secret-from-the-env-value"}}));
  EXPECT_EQ(s.value, "secret-from-the-flag-file");
  EXPECT_EQ(s.source, "flag --cluster-secret-file " + a);
  s = resolve_cluster_secret(std::nullopt, env_of({{"SPADE_CLUSTER_SECRET_FILE", b},
                                                   {"SPADE_CLUSTER_SECRET", "secret-from-the-env-value"}}));
  EXPECT_EQ(s.value, "secret-from-the-env-file");
  EXPECT_EQ(s.source, "env SPADE_CLUSTER_SECRET_FILE " + b);
  s = resolve_cluster_secret(std::nullopt, env_of({{"SPADE_CLUSTER_SECRET", "secret-from-the-env-value"}}));
  EXPECT_EQ(s.value, "secret-from-the-env-value");
  EXPECT_EQ(s.source, "env SPADE_CLUSTER_SECRET");
  s = resolve_cluster_secret(std::nullopt, env_of({}));
  EXPECT_TRUE(s.empty());
  EXPECT_EQ(s.source, "none");

  // The launch environment resolves it once and hands it to the client options.
  auto le =
      LaunchEnv::resolve({}, env_of({{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"SPADE_CLUSTER_SECRET_FILE", b}}));
  EXPECT_EQ(le.cluster_secret.value, "secret-from-the-env-file");
  EXPECT_EQ(le.sources.at("cluster_secret"), "env SPADE_CLUSTER_SECRET_FILE " + b);
  EXPECT_EQ(client_options_for(le).cluster_secret, "secret-from-the-env-file");
  LaunchFlags f;
  f.cluster_secret_file = a;
  EXPECT_EQ(
      client_options_for(LaunchEnv::resolve(f, env_of({{"RANK", "2"}, {"WORLD_SIZE", "3"}}))).cluster_secret,
      "secret-from-the-flag-file");
  std::filesystem::remove_all(dir);
}

TEST(ClusterSecret, BadFilesAreRefusedByNameWithoutShowingTheSecret) {
  const std::string dir = spade::test::make_temp_dir("spade_secret_");
  const std::string value = "a-secret-that-must-never-be-printed";
  const std::string open_to_all = secret_file(dir, "world", value, 0644);
  std::string e = secret_error(open_to_all, {});
  EXPECT_NE(e.find(open_to_all + " (flag --cluster-secret-file): the cluster secret file has mode 0644"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find(value), std::string::npos) << e;
  e = secret_error(std::nullopt, {{"SPADE_CLUSTER_SECRET_FILE", open_to_all}});
  EXPECT_NE(e.find("(env SPADE_CLUSTER_SECRET_FILE)"), std::string::npos) << e;
  EXPECT_EQ(secret_error(secret_file(dir, "group", value, 0640), {}),
            "");  // group-readable: Kubernetes fsGroup

  const std::string short_one = secret_file(dir, "short", "tiny\n", 0600);
  e = secret_error(short_one, {});
  EXPECT_NE(e.find("is 4 bytes; at least 16 are required"), std::string::npos) << e;
  e = secret_error(std::nullopt, {{"SPADE_CLUSTER_SECRET", "tiny"}});
  EXPECT_NE(e.find("the cluster secret from env SPADE_CLUSTER_SECRET is 4 bytes"), std::string::npos) << e;

  const std::string big = secret_file(dir, "big", std::string(kMaxClusterSecretBytes + 1, 'x'), 0600);
  e = secret_error(big, {});
  EXPECT_NE(e.find("more than the 4096-byte limit"), std::string::npos) << e;

  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  e = secret_error(fifo, {});  // must not block on a FIFO with no writer
  EXPECT_NE(e.find(fifo + ": not a regular file (a FIFO)"), std::string::npos) << e;

  e = secret_error(dir + "/missing", {});
  EXPECT_NE(e.find(dir + "/missing: cannot open"), std::string::npos) << e;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spade::coord
