// Non-blocking, regular-file-only opening and reading of checkpoint files. See common/file_read.h.
#include "common/file_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace spade {

const char* file_type_name(unsigned mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "an unknown file type";
}

RegularFile RegularFile::open(const std::string& path, std::string_view what) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail("{}: cannot open {}: {}", path, what, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("{}: cannot stat {}: {}", path, what, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file ({}); {} must be a regular file", path, file_type_name(st.st_mode), what);
  }
  return RegularFile(fd, static_cast<uint64_t>(st.st_size));
}

RegularFile& RegularFile::operator=(RegularFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    size_ = o.size_;
    o.fd_ = -1;
  }
  return *this;
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string read_regular_file(const std::string& path, std::string_view what, uint64_t max_bytes) {
  const RegularFile f = RegularFile::open(path, what);
  if (f.size() > max_bytes)
    fail("{}: {} is {} bytes, more than the {}-byte limit", path, what, f.size(), max_bytes);
  std::string out(static_cast<size_t>(f.size()), '\0');
  size_t got = 0;
  for (;;) {
    if (got == out.size()) {
      // The file may have grown since fstat: read on, within the limit, until end of file.
      if (out.size() > max_bytes)
        fail("{}: {} grew past the {}-byte limit while being read", path, what, max_bytes);
      out.resize(out.size() + 4096);
    }
    const ssize_t n = ::read(f.fd(), out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("{}: cannot read {}: {}", path, what, std::strerror(errno));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  if (got > max_bytes) fail("{}: {} grew past the {}-byte limit while being read", path, what, max_bytes);
  return out;
}

}  // namespace spade
