// Helpers shared by all tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spade::test {

/// The shared data directory: $SPADE_DATA_DIR, else ../shared/data beside the source tree. Fails the calling test
/// (fatal, not skipped) when the directory does not exist — CI must never pass without the real data.
std::string data_dir();

/// data_dir() + "/" + rel, failing the test when the path does not exist.
std::string data_path(const std::string& rel);

/// A fresh temporary directory under $TMPDIR (removed by the caller or left for inspection).
std::string make_temp_dir(const std::string& prefix);

/// Reads a whole file; fails the test when it cannot.
std::string read_file(const std::string& path);

/// Reads raw little-endian float32 values.
std::vector<float> read_f32(const std::string& path);

/// The build directory (where executables live).
std::string binary_dir();

}  // namespace spade::test

#include <chrono>
#include <map>
#include <sys/types.h>

namespace spade::test {

/// A child process (fork/exec) with stdout+stderr captured in a log file; killed (SIGKILL) on destruction if still
/// running. Every wait has a timeout.
class ChildProcess {
 public:
  ChildProcess(const std::string& exe, const std::vector<std::string>& args,
               const std::map<std::string, std::string>& env = {}, const std::string& name = "");
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  /// Exit code once exited (128 + signal for a signal), or -1 when still running after `timeout`.
  int wait_exit(std::chrono::milliseconds timeout);
  bool running();
  void signal(int sig);
  std::string log() const;
  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_, log_file_;
  pid_t pid_ = -1;
  bool exited_ = false;
  int code_ = -1;
};

/// How a process run to its end finished: its exit code (-1: still running at the timeout, then killed) and its
/// stdout + stderr.
struct ProcessExit {
  int rc = -1;
  std::string log;
};
/// Runs `exe args` (named `name` in the logs) until it exits or `timeout` passes.
ProcessExit run_to_exit(const std::string& exe, const std::vector<std::string>& args, const std::string& name,
                        std::chrono::milliseconds timeout);

/// A free TCP port on 127.0.0.1 in 20000-31999, below the ephemeral range (bound and released: another explicit
/// bind may still take it before its user does, but no outgoing connection will).
int free_port();
/// The first of `n` consecutive such ports (1 <= n <= 64), for a launcher that gives rank r port base + r. No port is
/// handed out twice by one process, by either function. Throws std::runtime_error when none is found.
int free_port_run(int n);

}  // namespace spade::test

namespace spade::test {

/// A raw TCP client of 127.0.0.1:port for HTTP tests that need byte-level control: pipelined or malformed requests,
/// streams read incrementally, and hanging up mid-response. Reads time out every 100 ms; every wait has a deadline.
class RawClient {
 public:
  explicit RawClient(int port);  // throws std::runtime_error when it cannot connect
  ~RawClient();
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;
  void close();
  /// Writes all of `bytes` (fails the test otherwise).
  void send(const std::string& bytes);
  /// Sends a POST with a JSON body.
  void post(const std::string& path, const std::string& json_body);
  /// Reads until `marker` occurs `times` times in everything read so far, EOF, or the deadline; returns it all.
  const std::string& read_until(const std::string& marker, int times = 1,
                                std::chrono::milliseconds timeout = std::chrono::milliseconds(30000));
  /// True when the server closes the connection before the deadline.
  bool eof(std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

 private:
  int fd_ = -1;
  std::string data_;
};

}  // namespace spade::test
