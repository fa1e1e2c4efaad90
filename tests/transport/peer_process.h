// Helpers of the cross-process transport tests: hex encoding of addresses passed over pipes, and a child process
// with its stdin/stdout on pipes (tests/transport/test_ucx.cpp, test_nccl_link.cu and their peer executables).
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"
#include "tests/transport/hex.h"

namespace spade::transport::test {

// The helper process with pipes on stdin/stdout; SIGKILLed on destruction if still alive.
class PeerProcess {
 public:
  /// Starts `rel_exe` (relative to the build directory) with `args`.
  PeerProcess(const std::string& rel_exe, std::vector<std::string> args) {
    std::string exe = spade::test::binary_dir() + "/" + rel_exe;
    if (!std::filesystem::exists(exe)) throw std::runtime_error("helper not built: " + exe);
    int in_pipe[2], out_pipe[2];
    if (::pipe(in_pipe) != 0 || ::pipe(out_pipe) != 0) throw std::runtime_error("pipe failed");
    args.insert(args.begin(), exe);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
      ::close(in_pipe[1]);
      ::close(out_pipe[0]);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    to_child_ = in_pipe[1];
    from_child_ = out_pipe[0];
  }

  ~PeerProcess() {
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
  }

  pid_t pid() const { return pid_; }

  std::string read_line(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
      if (left <= 0) throw std::runtime_error("timed out reading from the peer process; got: " + buf_);
      pollfd p{from_child_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      char tmp[4096];
      ssize_t n = ::read(from_child_, tmp, sizeof(tmp));
      if (n <= 0) throw std::runtime_error("peer process closed its output; got: " + buf_);
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }

  void write_line(const std::string& s) {
    std::string l = s + "\n";
    if (::write(to_child_, l.data(), l.size()) != static_cast<ssize_t>(l.size()))
      throw std::runtime_error("write");
  }

  void close_stdin() {
    ::close(to_child_);
    to_child_ = -1;
  }

  void kill9() { ::kill(pid_, SIGKILL); }

  int wait_exit(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        reaped_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1, from_child_ = -1;
  bool reaped_ = false;
  std::string buf_;
};

}  // namespace spade::transport::test
