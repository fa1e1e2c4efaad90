// Opening and reading checkpoint files (config.json, safetensors shards and index, tokenizer files, chat
// templates) without ever blocking on something that is not a regular file.
//
// A FIFO, socket or device named like a checkpoint file would block open(2) or read(2) forever (a FIFO with
// no writer) or return endless data (/dev/zero). Every loader therefore opens with O_RDONLY | O_NONBLOCK |
// O_CLOEXEC (O_NONBLOCK makes open(2) of a FIFO return at once; it has no effect on a regular file), checks
// the descriptor with fstat(2), and refuses anything but a regular file, naming the path and what it is.
// Symbolic links are followed (the Hugging Face cache links snapshot files to blobs): the check applies to
// the file they point at.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace spade {

/// Upper bound for the JSON side files of a checkpoint (config.json, generation_config.json,
/// tokenizer_config.json, model.safetensors.index.json) and chat templates, in bytes. Real ones are kilobytes
/// to a few megabytes.
inline constexpr uint64_t kMaxCheckpointJsonBytes = uint64_t{64} << 20;

/// Upper bound for tokenizer.json, in bytes (real ones are 1-40 MB: a vocabulary and its merges).
inline constexpr uint64_t kMaxTokenizerJsonBytes = uint64_t{1} << 30;

/// "a FIFO", "a directory", "a socket", "a character device", "a block device", "a symbolic link", "a regular
/// file" or "an unknown file type" for a stat(2) st_mode.
const char* file_type_name(unsigned mode);

/// A read-only descriptor of a regular file; closed on destruction. Move-only.
class RegularFile {
 public:
  /// Opens `path` (O_RDONLY | O_NONBLOCK | O_CLOEXEC) and fstat(2)s the descriptor. `what` names the role of
  /// the file in messages ("config.json", "safetensors file", ...). Never blocks. Throws spade::Error:
  ///   "<path>: cannot open <what>: <strerror>" when open(2) fails;
  ///   "<path>: not a regular file (a FIFO); <what> must be a regular file" for anything but a regular file.
  static RegularFile open(const std::string& path, std::string_view what);

  RegularFile(RegularFile&& o) noexcept : fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }
  RegularFile& operator=(RegularFile&& o) noexcept;
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  ~RegularFile();

  int fd() const { return fd_; }
  /// st_size at open time, in bytes.
  uint64_t size() const { return size_; }

 private:
  RegularFile(int fd, uint64_t size) : fd_(fd), size_(size) {}
  int fd_ = -1;
  uint64_t size_ = 0;
};

/// The whole content of the regular file `path` (opened as RegularFile::open). Throws spade::Error naming the
/// path when it cannot be opened, is not a regular file, holds more than `max_bytes` bytes ("<path>: <what>
/// is N bytes, more than the M-byte limit"), or a read fails.
std::string read_regular_file(const std::string& path, std::string_view what, uint64_t max_bytes);

}  // namespace spade
