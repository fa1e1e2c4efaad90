// safetensors reader (POSIX mmap + nlohmann-json header, validated), writer, and Hugging Face checkpoint
// directories. See common/safetensors.h for the format and the list of checks.
#include "common/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>

#include "common/error.h"
#include "common/file_read.h"

namespace spade {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; Spade maps it in place and needs a little-endian host");

using json = nlohmann::json;

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

// A short, bounded rendering of a JSON value for error messages: `number 3.5`, `string "x"`, `array [...]`.
std::string describe(const json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return fmt::format("{} {}", j.type_name(), s);
}

// Parses JSON text, rejecting duplicate keys inside any object (nlohmann silently keeps the last one, which
// would hide e.g. one tensor name listed twice). `where` prefixes every message. A duplicate key at the top
// level is reported as `top_level_dup` (e.g. "duplicate tensor name") with the key.
json parse_json_no_dup_keys(const char* begin, const char* end, const std::string& where, const char* what,
                            const char* top_level_dup) {
  std::vector<std::set<std::string>> keys;  // one key set per open object
  std::string dup;
  size_t dup_level = 0;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && dup.empty() && !keys.back().insert(parsed.get<std::string>()).second) {
          dup = parsed.get<std::string>();
          dup_level = keys.size();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(begin, end, cb);
  } catch (const json::exception& e) {
    fail("{}: {} is not valid JSON: {}", where, what, e.what());
  }
  if (!dup.empty()) {
    if (dup_level == 1) fail("{}: {} '{}' appears twice in the {}", where, top_level_dup, dup, what);
    fail("{}: key '{}' appears twice in one object of the {}", where, dup, what);
  }
  return j;
}

// Writes `bytes` to `path` atomically: a temporary file beside it, then rename(2). Readers that mmapped the
// old file keep their (unlinked) inode.
void write_file_atomic(const std::string& path, const std::string& header_prefix, const std::string& header,
                       const std::vector<const std::vector<uint8_t>*>& chunks) {
  static std::atomic<uint64_t> counter{0};  // distinct temporaries for concurrent writers in one process
  const std::string tmp = fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), counter++);
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("{}: cannot open '{}' for writing: {}", path, tmp, std::strerror(errno));
  auto put = [&](const void* p, size_t n) {
    if (n != 0 && std::fwrite(p, 1, n, f) != n) {
      const int err = errno;
      std::fclose(f);
      std::remove(tmp.c_str());
      fail("{}: write failed: {}", path, std::strerror(err));
    }
  };
  put(header_prefix.data(), header_prefix.size());
  put(header.data(), header.size());
  for (const auto* c : chunks) put(c->data(), c->size());
  if (std::fflush(f) != 0 || ::fsync(::fileno(f)) != 0) {
    const int err = errno;
    std::fclose(f);
    std::remove(tmp.c_str());
    fail("{}: write failed: {}", path, std::strerror(err));
  }
  if (std::fclose(f) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    fail("{}: close failed: {}", path, std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    fail("{}: cannot rename '{}' into place: {}", path, tmp, std::strerror(err));
  }
}

// numel and byte size of `shape` of `dtype`, or an error message prefix-less reason when they overflow.
bool checked_sizes(const std::vector<int64_t>& shape, DType dtype, int64_t* numel, uint64_t* nbytes,
                   std::string* why) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      *why = fmt::format("shape {} has more than 2^63-1 elements (numel overflow)", format_shape(shape));
      return false;
    }
  }
  uint64_t b = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(n), static_cast<uint64_t>(dtype_size(dtype)), &b)) {
    *why = fmt::format("shape {} of {} needs more than 2^64-1 bytes (size overflow)", format_shape(shape),
                       dtype_name(dtype));
    return false;
  }
  *numel = n;
  *nbytes = b;
  return true;
}

struct Extent {
  uint64_t begin, end;
  std::string name;
};

// Validates one header entry and returns its view. `data`/`data_size` describe the data section.
TensorView parse_entry(const std::string& path, const std::string& name, const json& e, const uint8_t* data,
                       uint64_t data_size, Extent* extent) {
  const std::string where = fmt::format("{}: tensor '{}'", path, name);
  if (!e.is_object())
    fail("{}: entry is {}, expected an object with dtype, shape and data_offsets", where, describe(e));

  TensorView v;
  v.name = name;
  v.file = path;

  // dtype
  auto it = e.find("dtype");
  if (it == e.end()) fail("{}: missing \"dtype\"", where);
  if (!it->is_string()) fail("{}: \"dtype\" is {}, expected a string", where, describe(*it));
  const std::string dt = it->get<std::string>();
  if (!parse_dtype(dt, &v.dtype)) fail("{}: unsupported dtype '{}' (accepted: F32, F16, BF16)", where, dt);

  // shape
  it = e.find("shape");
  if (it == e.end()) fail("{}: missing \"shape\"", where);
  if (!it->is_array()) fail("{}: \"shape\" is {}, expected an array of integers", where, describe(*it));
  for (size_t i = 0; i < it->size(); ++i) {
    const json& d = (*it)[i];
    if (!d.is_number_integer()) fail("{}: shape[{}] is {}, expected an integer", where, i, describe(d));
    if (d.is_number_unsigned()) {
      const uint64_t u = d.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail("{}: shape[{}] = {} exceeds 2^63-1 (numel overflow)", where, i, u);
      }
      v.shape.push_back(static_cast<int64_t>(u));
    } else {
      const int64_t s = d.get<int64_t>();
      if (s < 0) fail("{}: shape[{}] = {} is a negative dimension", where, i, s);
      v.shape.push_back(s);
    }
  }
  int64_t numel = 0;
  uint64_t need = 0;
  std::string why;
  if (!checked_sizes(v.shape, v.dtype, &numel, &need, &why)) fail("{}: {}", where, why);

  // data_offsets
  it = e.find("data_offsets");
  if (it == e.end()) fail("{}: missing \"data_offsets\"", where);
  if (!it->is_array() || it->size() != 2) {
    fail("{}: \"data_offsets\" is {}, expected [begin, end]", where, describe(*it));
  }
  uint64_t off[2];
  for (size_t i = 0; i < 2; ++i) {
    const json& o = (*it)[i];
    if (!o.is_number_unsigned())
      fail("{}: data_offsets[{}] is {}, expected a non-negative integer", where, i, describe(o));
    off[i] = o.get<uint64_t>();
  }
  const uint64_t begin = off[0], end = off[1];
  if (begin > end) fail("{}: data_offsets [{}, {}] have begin > end", where, begin, end);
  if (end > data_size) {
    fail("{}: data_offsets [{}, {}] end past the data section, which holds {} bytes", where, begin, end,
         data_size);
  }
  if (end - begin != need) {
    fail("{}: data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", where, begin, end,
         end - begin, format_shape(v.shape), dtype_name(v.dtype), need);
  }
  v.data = data + begin;
  v.nbytes = static_cast<size_t>(need);
  *extent = Extent{begin, end, name};
  return v;
}

// ---- non-finite scan: exponent bits all ones, per dtype

struct FloatBits {
  uint32_t exponent;  // exponent mask of the lane type
  uint32_t mantissa;  // mantissa mask
};

FloatBits float_bits(DType t) {
  switch (t) {
    case DType::F32: return {0x7f800000u, 0x007fffffu};
    case DType::F16: return {0x7c00u, 0x03ffu};
    case DType::BF16: return {0x7f80u, 0x007fu};
  }
  return {0, 0};
}

// Whether any U lane of the `nbytes` bytes at `p` has all exponent bits set. `p` needs no alignment (the format
// only aligns offsets to bytes); `nbytes` is a multiple of sizeof(U). GCC/Clang vector extensions on 16-byte vectors
// (one SSE2 / NEON register: pand + pcmpeq + por per vector), four independent accumulators per 64-byte step, OR-
// reduced at the end: vectorised at any optimisation level, about memory bandwidth per core. (Wider generic vectors
// are split by the compiler into per-lane scalar compares without AVX; 16 bytes is native everywhere.)
template <typename U>
bool any_exponent_all_ones(const uint8_t* p, size_t nbytes, U exponent) {
  typedef U V __attribute__((vector_size(16)));
  constexpr size_t kLanes = 16 / sizeof(U);
  V m;
  for (size_t l = 0; l < kLanes; ++l) m[l] = exponent;
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  size_t i = 0;
  for (; i + 64 <= nbytes; i += 64) {
    V x0, x1, x2, x3;
    std::memcpy(&x0, p + i, 16);
    std::memcpy(&x1, p + i + 16, 16);
    std::memcpy(&x2, p + i + 32, 16);
    std::memcpy(&x3, p + i + 48, 16);
    a0 |= reinterpret_cast<V>((x0 & m) == m);
    a1 |= reinterpret_cast<V>((x1 & m) == m);
    a2 |= reinterpret_cast<V>((x2 & m) == m);
    a3 |= reinterpret_cast<V>((x3 & m) == m);
  }
  const V acc = a0 | a1 | a2 | a3;
  for (size_t l = 0; l < kLanes; ++l)
    if (acc[l] != 0) return true;
  for (; i < nbytes; i += sizeof(U)) {
    U x;
    std::memcpy(&x, p + i, sizeof(U));
    if ((x & exponent) == exponent) return true;
  }
  return false;
}

// has_nonfinite over the byte range [begin, end) of `t` (both multiples of the element size).
bool range_has_nonfinite(const TensorView& t, size_t begin, size_t end) {
  const auto* p = static_cast<const uint8_t*>(t.data) + begin;
  const FloatBits b = float_bits(t.dtype);
  if (t.dtype == DType::F32) return any_exponent_all_ones<uint32_t>(p, end - begin, b.exponent);
  return any_exponent_all_ones<uint16_t>(p, end - begin, static_cast<uint16_t>(b.exponent));
}

}  // namespace

NonFiniteCount count_nonfinite(const TensorView& t) {
  NonFiniteCount c;
  const FloatBits b = float_bits(t.dtype);
  const size_t es = dtype_size(t.dtype);
  const auto* p = static_cast<const uint8_t*>(t.data);
  const size_t n = t.nbytes / es;
  for (size_t i = 0; i < n; ++i) {
    uint32_t x = 0;
    if (es == 4) {
      std::memcpy(&x, p + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      x = h;
    }
    if ((x & b.exponent) != b.exponent) continue;
    if (x & b.mantissa) {
      ++c.nan;
    } else {
      ++c.inf;
    }
    if (c.first < 0) c.first = static_cast<int64_t>(i);
  }
  return c;
}

bool has_nonfinite(const TensorView& t) { return range_has_nonfinite(t, 0, t.nbytes); }

std::string format_shape(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated on open: no overflow, no negative dimension
  return n;
}

// ---- SafetensorsFile
// -----------------------------------------------------------------------------------------------

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  // Non-blocking open + fstat first: a FIFO in place of the file is refused here instead of blocking open(2).
  const RegularFile file = RegularFile::open(path, "a safetensors file");
  const uint64_t size = file.size();
  if (size < 8) fail("{}: file is {} bytes, shorter than the 8-byte header length prefix", path, size);
  if (size > std::numeric_limits<size_t>::max()) fail("{}: file of {} bytes cannot be mapped", path, size);
  void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, file.fd(), 0);
  if (m == MAP_FAILED) fail("{}: mmap of {} bytes failed: {}", path, size, std::strerror(errno));

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = m;  // owned from here: the destructor unmaps, also when validation below throws
  f->map_size_ = static_cast<size_t>(size);
  const auto* bytes = static_cast<const uint8_t*>(m);

  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);
  if (header_len == 0) fail("{}: header length is 0", path);
  if (header_len > kSafetensorsMaxHeaderBytes) {
    fail("{}: header length {} exceeds the {}-byte limit", path, header_len, kSafetensorsMaxHeaderBytes);
  }
  if (header_len > size - 8) {
    fail("{}: header length {} runs past the end of the file ({} bytes follow the 8-byte prefix)", path,
         header_len, size - 8);
  }
  const auto* hbegin = reinterpret_cast<const char*>(bytes + 8);
  const json header = parse_json_no_dup_keys(hbegin, hbegin + header_len, path, "header", "tensor name");
  if (!header.is_object()) fail("{}: header is a JSON {}, expected an object", path, header.type_name());

  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) {
        fail("{}: \"__metadata__\" is {}, expected an object of strings", path, describe(entry));
      }
      for (const auto& [k, val] : entry.items()) {
        if (!val.is_string()) {
          fail("{}: \"__metadata__\" key '{}' is {}, expected a string", path, k, describe(val));
        }
        f->metadata_[k] = val.get<std::string>();
      }
      continue;
    }
    Extent ext{};
    TensorView v = parse_entry(path, name, entry, data, data_size, &ext);
    if (ext.end > ext.begin) extents.push_back(std::move(ext));  // empty tensors cannot overlap anything
    f->tensors_.emplace(name, std::move(v));
  }

  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (size_t i = 1; i < extents.size(); ++i) {
    const Extent& a = extents[i - 1];
    const Extent& b = extents[i];
    if (b.begin < a.end) {
      fail("{}: tensors '{}' (data_offsets [{}, {}]) and '{}' (data_offsets [{}, {}]) overlap", path, a.name,
           a.begin, a.end, b.name, b.begin, b.end);
    }
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

// ---- Checkpoint
// ----------------------------------------------------------------------------------------------------

Checkpoint Checkpoint::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("{}: not a directory (looking for a safetensors checkpoint)", dir);

  Checkpoint c;
  c.dir_ = dir;
  const std::string single = dir + "/" + kSingleName;
  const std::string index_path = dir + "/" + kIndexName;

  // transformers prefers model.safetensors over the index when both exist; so do we.
  if (fs::exists(single, ec)) {
    std::shared_ptr<SafetensorsFile> f = SafetensorsFile::open(single);
    for (const auto& [name, view] : f->tensors()) c.index_.emplace(name, &view);
    c.files_.push_back(std::move(f));
    return c;
  }
  if (!fs::exists(index_path, ec)) {
    fail("{}: neither {} nor {} exists in this directory", dir, kSingleName, kIndexName);
  }

  const std::string text = read_regular_file(index_path, "the shard index", kMaxCheckpointJsonBytes);
  const json idx =
      parse_json_no_dup_keys(text.data(), text.data() + text.size(), index_path, "index", "top-level key");
  if (!idx.is_object()) fail("{}: index is a JSON {}, expected an object", index_path, idx.type_name());
  auto mit = idx.find("metadata");
  if (mit != idx.end() && !mit->is_object() && !mit->is_null()) {
    fail("{}: \"metadata\" is {}, expected an object", index_path, describe(*mit));
  }
  auto wit = idx.find("weight_map");
  if (wit == idx.end()) fail("{}: missing \"weight_map\"", index_path);
  if (!wit->is_object()) {
    fail("{}: \"weight_map\" is {}, expected an object {{tensor name: shard file}}", index_path,
         describe(*wit));
  }
  if (wit->empty()) fail("{}: \"weight_map\" is empty", index_path);

  std::map<std::string, std::vector<std::string>> by_shard;  // shard file -> tensors listed for it
  for (const auto& [name, shard] : wit->items()) {
    if (!shard.is_string()) {
      fail("{}: weight_map entry for tensor '{}' is {}, expected a shard file name", index_path, name,
           describe(shard));
    }
    const std::string s = shard.get<std::string>();
    if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..") {
      fail("{}: weight_map entry for tensor '{}' is '{}', expected a file name inside {}", index_path, name,
           s, dir);
    }
    by_shard[s].push_back(name);
  }

  for (const auto& [shard, names] : by_shard) {
    const std::string shard_path = dir + "/" + shard;
    if (!fs::exists(shard_path, ec)) {  // anything else that is not a regular file: SafetensorsFile::open says what
      fail("{}: shard '{}' (listed for tensor '{}'{}) does not exist: {}", index_path, shard, names.front(),
           names.size() > 1 ? fmt::format(" and {} more", names.size() - 1) : std::string(), shard_path);
    }
    std::shared_ptr<SafetensorsFile> f = SafetensorsFile::open(shard_path);
    for (const std::string& name : names) {
      auto t = f->tensors().find(name);
      if (t == f->tensors().end()) {
        fail("{}: tensor '{}' is listed in \"weight_map\" for shard '{}', but {} has no such tensor",
             index_path, name, shard, shard_path);
      }
      c.index_.emplace(name, &t->second);
    }
    size_t unlisted = 0;
    for (const auto& [name, view] : f->tensors()) {
      if (wit->find(name) == wit->end()) ++unlisted;
    }
    if (unlisted != 0) {
      spdlog::warn("{}: {} tensor(s) in shard '{}' are not listed in \"weight_map\" and are ignored",
                   index_path, unlisted, shard);
    }
    c.files_.push_back(std::move(f));
  }
  return c;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail("{}: tensor '{}' not found", dir_, name);
  return *it->second;
}

std::vector<float> Checkpoint::load_f32(const std::string& name,
                                        const std::vector<int64_t>& expected_shape) const {
  const TensorView& t = get(name);
  if (!expected_shape.empty() && t.shape != expected_shape) {
    fail("{}: tensor '{}' (in {}): expected shape {}, got {}", dir_, name, t.file,
         format_shape(expected_shape), format_shape(t.shape));
  }
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<float> out(n);
  if (n == 0) return out;  // convert_to_f32 would memcpy to out.data() == nullptr
  if (t.dtype != DType::F32 && reinterpret_cast<uintptr_t>(t.data) % alignof(uint16_t) != 0) {
    // Offsets are only byte-aligned by the format; convert from an aligned copy rather than read misaligned.
    std::vector<uint16_t> tmp(n);
    std::memcpy(tmp.data(), t.data, t.nbytes);
    convert_to_f32(tmp.data(), t.dtype, out.data(), n);
  } else {
    convert_to_f32(t.data, t.dtype, out.data(), n);
  }
  return out;
}

void Checkpoint::check_finite(const std::vector<std::string>& names, unsigned threads) const {
  std::vector<const TensorView*> views;
  views.reserve(names.size());
  for (const std::string& n : names) views.push_back(&get(n));

  // Work items: chunks of at most 8 MiB (a multiple of 64 bytes), so one large embedding spreads over all threads.
  constexpr size_t kChunk = size_t{8} << 20;
  struct Item {
    size_t tensor, begin, end;
  };
  std::vector<Item> items;
  for (size_t t = 0; t < views.size(); ++t)
    for (size_t b = 0; b < views[t]->nbytes; b += kChunk)
      items.push_back({t, b, std::min(views[t]->nbytes, b + kChunk)});

  std::unique_ptr<std::atomic<bool>[]> bad(new std::atomic<bool>[views.size()]);
  for (size_t t = 0; t < views.size(); ++t) bad[t].store(false, std::memory_order_relaxed);
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
      const Item& it = items[i];
      if (bad[it.tensor].load(std::memory_order_relaxed)) continue;  // already known; the message recounts it
      if (range_has_nonfinite(*views[it.tensor], it.begin, it.end))
        bad[it.tensor].store(true, std::memory_order_relaxed);
    }
  };
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const size_t n_threads = std::min<size_t>(threads, std::max<size_t>(items.size(), 1));
  std::vector<std::thread> pool;
  try {
    for (size_t k = 1; k < n_threads; ++k) pool.emplace_back(worker);
  } catch (const std::system_error&) {
    // Fewer threads than asked for (a thread limit): the ones started and this one share the work.
  }
  worker();
  for (std::thread& th : pool) th.join();

  size_t first = views.size(), n_bad = 0;
  for (size_t t = 0; t < views.size(); ++t) {
    if (!bad[t].load(std::memory_order_relaxed)) continue;
    if (n_bad++ == 0) first = t;
  }
  if (n_bad == 0) return;
  const TensorView& v = *views[first];
  const NonFiniteCount c = count_nonfinite(v);
  const std::string others =
      n_bad > 1 ? fmt::format(", and {} more {} NaN or Inf", n_bad - 1, n_bad > 2 ? "tensors hold" : "tensor holds")
                : "";
  if (c.nan == v.numel()) {
    fail("{}: tensor '{}' (in {}) holds non-finite values: all {} elements are NaN{}", dir_, v.name, v.file,
         v.numel(), others);
  }
  fail("{}: tensor '{}' (in {}) holds non-finite values: {} NaN and {} Inf among {} elements (first at flat index "
       "{}){}",
       dir_, v.name, v.file, c.nan, c.inf, v.numel(), c.first, others);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, view] : index_) out.push_back(name);
  return out;
}

// ---- writers
// -------------------------------------------------------------------------------------------------------

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> order;
  order.reserve(tensors.size());
  for (const auto& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) { return a->name < b->name; });

  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<const std::vector<uint8_t>*> chunks;
  for (size_t i = 0; i < order.size(); ++i) {
    const TensorToWrite& t = *order[i];
    if (t.name.empty()) fail("{}: a tensor has an empty name", path);
    if (t.name == "__metadata__") fail("{}: '__metadata__' is reserved and cannot name a tensor", path);
    if (i > 0 && order[i - 1]->name == t.name) fail("{}: tensor '{}' is given twice", path, t.name);
    for (size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] < 0)
        fail("{}: tensor '{}': shape[{}] = {} is a negative dimension", path, t.name, d, t.shape[d]);
    }
    int64_t numel = 0;
    uint64_t need = 0;
    std::string why;
    if (!checked_sizes(t.shape, t.dtype, &numel, &need, &why)) fail("{}: tensor '{}': {}", path, t.name, why);
    if (t.data.size() != need) {
      fail("{}: tensor '{}': data holds {} bytes but shape {} of {} needs {}", path, t.name, t.data.size(),
           format_shape(t.shape), dtype_name(t.dtype), need);
    }
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + need}}};
    offset += need;
    chunks.push_back(&t.data);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // 8-byte aligned data section, as the reference pads
  std::string prefix(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(prefix.data(), &n, 8);
  write_file_atomic(path, prefix, text, chunks);
}

void write_safetensors_index(const std::string& path, const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  const json idx = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  write_file_atomic(path, std::string(), idx.dump(2) + "\n", {});
}

}  // namespace spade
