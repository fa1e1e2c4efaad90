#include "coordinator/launch_env.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/file_read.h"

namespace spade::coord {
namespace {

struct Candidate {
  std::optional<std::string> raw;  // textual value
  std::string source;              // "flag --rank" / "env RANK"
};

uint32_t parse_u32(const std::string& text, const std::string& source) {
  uint64_t v = 0;
  const char* b = text.data();
  const char* e = b + text.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (text.empty() || ec != std::errc() || p != e || v > UINT32_MAX) {
    fail("{}='{}' is not a non-negative 32-bit integer", source, text);
  }
  return static_cast<uint32_t>(v);
}

// Picks the first present candidate (highest precedence first); records disagreeing lower ones in notes.
template <typename T, typename Parse>
std::optional<T> pick(const std::string& field, const std::vector<Candidate>& cands, Parse parse,
                      LaunchEnv* le) {
  std::optional<T> chosen;
  std::string chosen_src;
  std::string chosen_raw;
  for (const auto& c : cands) {
    if (!c.raw) continue;
    T v = parse(*c.raw, c.source);
    if (!chosen) {
      chosen = v;
      chosen_src = c.source;
      chosen_raw = *c.raw;
    } else if (!(v == *chosen)) {
      le->notes.push_back(fmt::format("{}: using {}={} over {}={} (precedence flags > torchrun > Open MPI)",
                                      field, chosen_src, chosen_raw, c.source, *c.raw));
    }
  }
  if (chosen) le->sources[field] = chosen_src;
  return chosen;
}

std::optional<std::string> flag_str(const std::optional<uint32_t>& v) {
  if (!v) return std::nullopt;
  return std::to_string(*v);
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

// Removes trailing whitespace (a newline written by `echo`, `base64`, a Kubernetes literal).
std::string trim_right(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

// The secret held in `path` (`source` names where the path came from, for messages).
std::string read_secret_file(const std::string& path, const std::string& source) {
  SPADE_CHECK(!path.empty(), "{}: the cluster secret file path is empty", source);
  auto f = RegularFile::open(path, "the cluster secret file");
  struct stat st {};
  SPADE_CHECK(::fstat(f.fd(), &st) == 0, "{} ({}): cannot stat the cluster secret file: {}", path, source,
              std::strerror(errno));
  if ((st.st_mode & (S_IROTH | S_IWOTH)) != 0) {
    fail(
        "{} ({}): the cluster secret file has mode {:04o}, readable or writable by every user; restrict it "
        "(chmod 600; in Kubernetes a secret volume's defaultMode 0400 or 0440)",
        path, source, static_cast<unsigned>(st.st_mode & 07777));
  }
  SPADE_CHECK(
      f.size() <= kMaxClusterSecretBytes,
      "{} ({}): the cluster secret file is {} bytes, more than the {}-byte limit (is it the right file?)",
      path, source, f.size(), kMaxClusterSecretBytes);
  std::string out(kMaxClusterSecretBytes + 1, '\0');
  size_t got = 0;
  for (;;) {
    const ssize_t n = ::read(f.fd(), out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    SPADE_CHECK(n >= 0, "{} ({}): cannot read the cluster secret file: {}", path, source,
                std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
    SPADE_CHECK(got <= kMaxClusterSecretBytes, "{} ({}): the cluster secret file grew past the {}-byte limit",
                path, source, kMaxClusterSecretBytes);
  }
  out.resize(got);
  return out;
}

}  // namespace

ClusterSecret resolve_cluster_secret(const std::optional<std::string>& file_flag, const EnvLookup& env) {
  ClusterSecret s;
  if (file_flag) {
    s.source = "flag --cluster-secret-file " + *file_flag;
    s.value = read_secret_file(*file_flag, "flag --cluster-secret-file");
  } else if (auto path = env("SPADE_CLUSTER_SECRET_FILE")) {
    s.source = "env SPADE_CLUSTER_SECRET_FILE " + *path;
    s.value = read_secret_file(*path, "env SPADE_CLUSTER_SECRET_FILE");
  } else if (auto value = env("SPADE_CLUSTER_SECRET")) {
    s.source = "env SPADE_CLUSTER_SECRET";
    s.value = *value;
  } else {
    s.source = "none";
    return s;
  }
  s.value = trim_right(std::move(s.value));
  SPADE_CHECK(
      s.value.size() >= kMinClusterSecretBytes,
      "the cluster secret from {} is {} bytes; at least {} are required (e.g. head -c 32 /dev/urandom | "
      "base64 > FILE)",
      s.source, s.value.size(), kMinClusterSecretBytes);
  SPADE_CHECK(s.value.size() <= kMaxClusterSecretBytes, "the cluster secret from {} is longer than {} bytes",
              s.source, kMaxClusterSecretBytes);
  return s;
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
}

std::string role_name(proto::Role role) {
  switch (role) {
    case proto::COORDINATOR:
      return "coordinator";
    case proto::INFERENCE:
      return "inference";
    case proto::CACHE:
      return "cache";
    case proto::CLIENT:
      return "client";
    default:
      return "unspecified";
  }
}

uint32_t cache_ranks_per_inference(uint32_t num_inference, uint32_t num_cache) {
  if (num_cache == 0) return 0;
  SPADE_CHECK(num_inference > 0, "a world of {} cache rank(s) and no inference rank: every cache rank serves one",
              num_cache);
  if (num_cache % num_inference != 0)
    fail(
        "cannot pair {} inference rank(s) with {} cache rank(s): each inference rank takes the same number N of cache "
        "ranks (its layer shards), so --num-cache must be a multiple of --num-inference (N = --num-cache / "
        "--num-inference)",
        num_inference, num_cache);
  return num_cache / num_inference;
}

std::string pairing_rule(uint32_t cache_per_inference) {
  if (cache_per_inference <= 1) return "inference #i <-> cache #i";
  return fmt::format("inference #i <-> cache #(i*{} + s), s = 0..{} (layer shards)", cache_per_inference,
                     cache_per_inference - 1);
}

std::vector<proto::Role> parse_role_map(std::string_view text) {
  std::vector<proto::Role> out;
  size_t start = 0;
  SPADE_CHECK(!trim(text).empty(), "role map is empty (expected e.g. \"c,i,k\")");
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string_view::npos) comma = text.size();
    std::string tok = trim(text.substr(start, comma - start));
    std::transform(tok.begin(), tok.end(), tok.begin(), [](unsigned char c) { return std::tolower(c); });
    proto::Role r;
    if (tok == "c" || tok == "coordinator") {
      r = proto::COORDINATOR;
    } else if (tok == "i" || tok == "inference") {
      r = proto::INFERENCE;
    } else if (tok == "k" || tok == "cache") {
      r = proto::CACHE;
    } else {
      fail("role map \"{}\": entry {} is '{}' (expected c|coordinator, i|inference or k|cache)", text,
           out.size(), tok);
    }
    out.push_back(r);
    start = comma + 1;
  }
  auto ncoord = std::count(out.begin(), out.end(), proto::COORDINATOR);
  SPADE_CHECK(ncoord == 1, "role map \"{}\" has {} coordinators (exactly one required)", text, ncoord);
  return out;
}

std::vector<proto::Role> default_role_map(uint32_t num_inference, uint32_t num_cache) {
  std::vector<proto::Role> out;
  out.reserve(1 + num_inference + num_cache);
  out.push_back(proto::COORDINATOR);
  out.insert(out.end(), num_inference, proto::INFERENCE);
  out.insert(out.end(), num_cache, proto::CACHE);
  return out;
}

LaunchEnv LaunchEnv::resolve(const LaunchFlags& flags, const EnvLookup& env) {
  LaunchEnv le;
  auto u32 = [](const std::string& t, const std::string& s) { return parse_u32(t, s); };
  auto str = [](const std::string& t, const std::string&) { return t; };

  auto rank = pick<uint32_t>("rank",
                             {{flag_str(flags.rank), "flag --rank"},
                              {env("RANK"), "env RANK"},
                              {env("OMPI_COMM_WORLD_RANK"), "env OMPI_COMM_WORLD_RANK"}},
                             u32, &le);
  auto world = pick<uint32_t>("world_size",
                              {{flag_str(flags.world_size), "flag --world-size"},
                               {env("WORLD_SIZE"), "env WORLD_SIZE"},
                               {env("OMPI_COMM_WORLD_SIZE"), "env OMPI_COMM_WORLD_SIZE"}},
                              u32, &le);
  auto local = pick<uint32_t>("local_rank",
                              {{flag_str(flags.local_rank), "flag --local-rank"},
                               {env("LOCAL_RANK"), "env LOCAL_RANK"},
                               {env("OMPI_COMM_WORLD_LOCAL_RANK"), "env OMPI_COMM_WORLD_LOCAL_RANK"}},
                              u32, &le);
  auto addr = pick<std::string>(
      "master_addr", {{flags.master_addr, "flag --master-addr"}, {env("MASTER_ADDR"), "env MASTER_ADDR"}},
      str, &le);
  auto port = pick<uint32_t>(
      "master_port",
      {{flag_str(flags.master_port), "flag --master-port"}, {env("MASTER_PORT"), "env MASTER_PORT"}}, u32,
      &le);
  auto map_text = pick<std::string>(
      "role_map", {{flags.role_map, "flag --role-map"}, {env("SPADE_ROLE_MAP"), "env SPADE_ROLE_MAP"}}, str,
      &le);
  le.cluster_secret = resolve_cluster_secret(flags.cluster_secret_file, env);
  le.sources["cluster_secret"] = le.cluster_secret.source;
  if (flags.num_inference) le.sources["num_inference"] = "flag --num-inference";
  if (flags.num_cache) le.sources["num_cache"] = "flag --num-cache";

  if (addr) {
    SPADE_CHECK(!addr->empty(), "master address from {} is empty", le.sources["master_addr"]);
    le.master_addr = *addr;
  } else {
    le.sources["master_addr"] = "default";
  }
  if (port) {
    SPADE_CHECK(*port >= 1 && *port <= 65535, "master port {} ({}) is out of range 1..65535", *port,
                le.sources["master_port"]);
    le.master_port = static_cast<uint16_t>(*port);
  } else {
    le.sources["master_port"] = "default";
  }

  // ---- role map and world size
  if (map_text) {
    le.role_map = parse_role_map(*map_text);
    auto n_inf = static_cast<uint32_t>(std::count(le.role_map.begin(), le.role_map.end(), proto::INFERENCE));
    auto n_cache = static_cast<uint32_t>(std::count(le.role_map.begin(), le.role_map.end(), proto::CACHE));
    if (flags.num_inference && *flags.num_inference != n_inf) {
      fail("--num-inference {} contradicts role map \"{}\" ({}), which has {} inference ranks",
           *flags.num_inference, *map_text, le.sources["role_map"], n_inf);
    }
    if (flags.num_cache && *flags.num_cache != n_cache) {
      fail("--num-cache {} contradicts role map \"{}\" ({}), which has {} cache ranks", *flags.num_cache,
           *map_text, le.sources["role_map"], n_cache);
    }
    if (world && *world != le.role_map.size()) {
      fail("world size {} ({}) contradicts role map \"{}\" ({}) with {} entries", *world,
           le.sources["world_size"], *map_text, le.sources["role_map"], le.role_map.size());
    }
    le.num_inference = n_inf;
    le.num_cache = n_cache;
    le.world_size = static_cast<uint32_t>(le.role_map.size());
    if (!world) le.sources["world_size"] = "role map";
  } else {
    std::optional<uint32_t> n_inf = flags.num_inference;
    std::optional<uint32_t> n_cache = flags.num_cache;
    if (n_inf && n_cache) {
      uint64_t derived = uint64_t{1} + *n_inf + *n_cache;
      if (world && *world != derived) {
        fail("world size {} ({}) contradicts --num-inference {} + --num-cache {} + 1 coordinator = {}",
             *world, le.sources["world_size"], *n_inf, *n_cache, derived);
      }
    } else if (world) {
      SPADE_CHECK(*world >= 1, "world size 0 ({}) is invalid", le.sources["world_size"]);
      uint32_t workers = *world - 1;
      if (n_inf || n_cache) {
        uint32_t given = n_inf ? *n_inf : *n_cache;
        SPADE_CHECK(given <= workers, "--num-{} {} does not fit in world size {} ({}) with 1 coordinator",
                    n_inf ? "inference" : "cache", given, *world, le.sources["world_size"]);
        if (n_inf) {
          n_cache = workers - given;
          le.sources["num_cache"] = "world size - 1 - num_inference";
        } else {
          n_inf = workers - given;
          le.sources["num_inference"] = "world size - 1 - num_cache";
        }
      } else {
        SPADE_CHECK(
            workers % 2 == 0,
            "world size {} ({}) cannot be split into 1 coordinator + equal inference and cache ranks; pass "
            "--num-inference/--num-cache or --role-map",
            *world, le.sources["world_size"]);
        n_inf = n_cache = workers / 2;
        le.sources["num_inference"] = le.sources["num_cache"] = "(world size - 1) / 2";
      }
    } else {
      fail(
          "world size unknown: pass --num-inference and --num-cache, --world-size or --role-map, or set "
          "WORLD_SIZE "
          "(torchrun) / OMPI_COMM_WORLD_SIZE (Open MPI)");
    }
    le.num_inference = *n_inf;
    le.num_cache = *n_cache;
    le.role_map = default_role_map(le.num_inference, le.num_cache);
    le.world_size = static_cast<uint32_t>(le.role_map.size());
    if (!world) le.sources["world_size"] = "1 + num_inference + num_cache";
  }

  if (rank) {
    le.rank = *rank;
  } else {
    le.sources["rank"] = "default";
  }
  if (le.rank >= le.world_size) {
    fail("rank {} ({}) is out of range for world size {} ({})", le.rank, le.sources["rank"], le.world_size,
         le.sources["world_size"]);
  }
  if (local) {
    le.local_rank = *local;
    SPADE_CHECK(le.local_rank < le.world_size, "local rank {} ({}) is out of range for world size {} ({})",
                le.local_rank, le.sources["local_rank"], le.world_size, le.sources["world_size"]);
  } else {
    le.sources["local_rank"] = "default";
  }
  le.cache_per_inference = cache_ranks_per_inference(le.num_inference, le.num_cache);
  le.role = le.role_map[le.rank];
  le.role_index = le.role_index_of(le.rank);
  return le;
}

uint32_t LaunchEnv::role_index_of(uint32_t r) const {
  SPADE_CHECK(r < role_map.size(), "rank {} is out of range for world size {}", r, role_map.size());
  return static_cast<uint32_t>(std::count(role_map.begin(), role_map.begin() + r, role_map[r]));
}

uint32_t LaunchEnv::rank_of(proto::Role role_, uint32_t idx) const {
  uint32_t seen = 0;
  for (uint32_t r = 0; r < role_map.size(); ++r) {
    if (role_map[r] != role_) continue;
    if (seen == idx) return r;
    ++seen;
  }
  fail("there is no {} #{} in role map \"{}\" ({} {} ranks)", role_name(role_), idx, role_map_string(), seen,
       role_name(role_));
}

std::string LaunchEnv::describe_rank(uint32_t r) const {
  if (r >= role_map.size()) return fmt::format("rank {} (out of range)", r);
  if (role_map[r] == proto::COORDINATOR) return fmt::format("rank {} (coordinator)", r);
  return fmt::format("rank {} ({} #{})", r, role_name(role_map[r]), role_index_of(r));
}

std::string LaunchEnv::role_map_string() const {
  std::string s;
  for (size_t i = 0; i < role_map.size(); ++i) {
    if (i) s += ',';
    s += role_map[i] == proto::COORDINATOR ? 'c' : role_map[i] == proto::INFERENCE ? 'i' : 'k';
  }
  return s;
}

void add_launch_flags(CLI::App& app, LaunchFlags& lf) {
  app.add_option("--master-addr", lf.master_addr, "coordinator host (else MASTER_ADDR)");
  app.add_option("--master-port", lf.master_port, "coordinator port (else MASTER_PORT)");
  app.add_option("--rank", lf.rank, "global rank (else RANK / OMPI_COMM_WORLD_RANK)");
  app.add_option("--world-size", lf.world_size, "world size (else WORLD_SIZE / OMPI_COMM_WORLD_SIZE)");
  app.add_option("--num-inference", lf.num_inference, "inference ranks in the world");
  app.add_option("--num-cache", lf.num_cache,
                 "cache ranks in the world (a multiple N of --num-inference: each inference rank takes N, its layer "
                 "shards)");
  app.add_option("--role-map", lf.role_map, "explicit role per rank, e.g. c,i,k");
  add_cluster_secret_flag(app, lf.cluster_secret_file);
}

void add_cluster_secret_flag(CLI::App& app, std::optional<std::string>& file) {
  app.add_option(
      "--cluster-secret-file", file,
      "file holding the cluster's shared secret, which authenticates every control connection (else "
      "SPADE_CLUSTER_SECRET_FILE, SPADE_CLUSTER_SECRET; mode 0600)");
}

}  // namespace spade::coord
