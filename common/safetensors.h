// safetensors reading (mmap, validated) and writing, and Hugging Face checkpoint directories.
//
// Format (https://huggingface.co/docs/safetensors): 8-byte little-endian header length N, N bytes of UTF-8
// JSON {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}},
// then the data section. Offsets are relative to the start of the data section.
//
// Validation on open (each failure throws spade::Error naming the file and, where there is one, the tensor):
//   - anything but a regular file (a FIFO, socket, device or directory), refused without blocking
//     (common/file_read.h); the index likewise
//   - file shorter than 8 bytes; header length 0, larger than kSafetensorsMaxHeaderBytes (100 MB, the
//     reference implementation's limit) or past the file end
//   - header not JSON / not an object; an entry without dtype, shape or data_offsets, or wrong JSON types
//   - dtype other than F32 / F16 / BF16; negative dimension; numel overflow
//   - begin > end, end past the data section, end - begin != numel * dtype size, two tensors overlapping
//   - "__metadata__" not an object of strings; the same tensor name twice
// Gaps between tensors are accepted (the reference implementation rejects them; nothing here needs
// contiguity). Values are not checked on open; Checkpoint::check_finite refuses NaN / Inf weights.
// Sharded checkpoints: model.safetensors.index.json {"weight_map": {tensor: shard file}} next to the shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace spade {

/// Largest accepted JSON header, in bytes (safetensors' MAX_HEADER_SIZE).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// "[2, 3]" — the spelling used in every shape error message.
std::string format_shape(const std::vector<int64_t>& shape);

/// One tensor of an opened (mmapped) safetensors file. `data` points into the mapping and lives as long as
/// the file.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // dtype elements, row-major, `nbytes` long
  size_t nbytes = 0;
  std::string file;  // the file it came from (for error messages)

  int64_t numel() const;
};

/// Non-finite elements of a tensor, read from its bit patterns (exponent bits all ones: ±Inf when the mantissa is
/// zero, NaN otherwise) without converting them.
struct NonFiniteCount {
  int64_t nan = 0;
  int64_t inf = 0;
  int64_t first = -1;  // flat (row-major) index of the first non-finite element; -1 when there is none
};

/// Counts the NaN and ±Inf elements of `t` (F32 / F16 / BF16), element by element.
NonFiniteCount count_nonfinite(const TensorView& t);

/// Whether any element of `t` is NaN or ±Inf: a vectorised pass over the raw bits (16-byte vectors, an OR-reduced
/// "exponent all ones" mask per lane; no conversion to float).
bool has_nonfinite(const TensorView& t);

/// A memory-mapped, validated safetensors file. Not copyable; the mapping is released on destruction.
class SafetensorsFile {
 public:
  /// Opens and validates `path`. Throws spade::Error (message starts with the path) on any malformed input.
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// All tensors of a Hugging Face checkpoint directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json` (every shard it names must exist, and every tensor must be in the shard it
/// names). As in transformers, `model.safetensors` wins when both exist. Shard tensors missing from
/// "weight_map" are ignored with a warning. Copies share the mapped files; views stay valid while any copy
/// lives.
class Checkpoint {
 public:
  /// Throws spade::Error naming the directory when neither file exists, or naming the shard/tensor on
  /// inconsistency.
  static Checkpoint open_dir(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  /// Throws spade::Error "<dir>: tensor '<name>' not found" when absent.
  const TensorView& get(const std::string& name) const;
  /// Converts a tensor (F32/F16/BF16) to fp32, numel() floats, row-major. Throws when `expected_shape` is
  /// non-empty and differs ("<dir>: tensor '<name>' (in <file>): expected shape [..], got [..]").
  std::vector<float> load_f32(const std::string& name, const std::vector<int64_t>& expected_shape = {}) const;
  std::vector<std::string> names() const;

  /// Refuses non-finite weights. Scans the tensors `names` for NaN / ±Inf elements over their raw bits
  /// (has_nonfinite), split into chunks of at most 8 MiB spread over up to `threads` threads (0: one per hardware
  /// thread), and throws spade::Error naming the first offending tensor in `names` order: "<dir>: tensor '<name>'
  /// (in <file>) holds non-finite values: N NaN and M Inf among K elements (first at flat index i)" ("all K
  /// elements are NaN" when they all are), with ", and T more tensors hold NaN or Inf" when others do too. An
  /// unknown name throws as get().
  void check_finite(const std::vector<std::string>& names, unsigned threads = 0) const;

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

/// A tensor to write: `data` holds numel * dtype_size(dtype) bytes, row-major.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

/// Writes a safetensors file (tensors sorted by name, 8-byte aligned header padded with spaces, as the
/// reference implementation does). Throws spade::Error naming `path` on I/O failure or a size mismatch.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Writes a Hugging Face shard index (model.safetensors.index.json):
/// {"metadata": {"total_size": total_size}, "weight_map": {tensor: shard file name}}. `total_size` is the sum
/// of the tensors' byte sizes, as transformers writes it. Throws spade::Error naming `path` on I/O failure.
void write_safetensors_index(const std::string& path, const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace spade
