#include "tests/test_util.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <vector>

namespace fs = std::filesystem;

namespace spade::test {

std::string data_dir() {
  const char* env = std::getenv("SPADE_DATA_DIR");
  std::string dir = (env && *env) ? std::string(env) : std::string(SPADE_DEFAULT_DATA_DIR);
  if (!fs::is_directory(dir)) {
    ADD_FAILURE() << "shared test data not found at '" << dir
                  << "' (set SPADE_DATA_DIR; CI uses ../shared/data). Refusing to skip.";
    throw std::runtime_error("missing SPADE_DATA_DIR: " + dir);
  }
  return dir;
}

std::string data_path(const std::string& rel) {
  std::string p = data_dir() + "/" + rel;
  if (!fs::exists(p)) {
    ADD_FAILURE() << "missing shared data file '" << p << "'";
    throw std::runtime_error("missing shared data file: " + p);
  }
  return p;
}

std::string make_temp_dir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed for " + templ);
  return std::string(buf.data());
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    ADD_FAILURE() << "cannot read '" << path << "'";
    throw std::runtime_error("cannot read " + path);
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<float> read_f32(const std::string& path) {
  std::string bytes = read_file(path);
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

std::string binary_dir() { return SPADE_BINARY_DIR; }

}  // namespace spade::test

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

namespace spade::test {

ChildProcess::ChildProcess(const std::string& exe, const std::vector<std::string>& args,
                           const std::map<std::string, std::string>& env, const std::string& name)
    : name_(name.empty() ? exe : name) {
  if (!fs::exists(exe)) throw std::runtime_error("executable not built: " + exe);
  log_file_ = make_temp_dir("spade_child_") + "/output.log";
  std::vector<std::string> argv_s = {exe};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    int fd = ::open(log_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    ::_exit(127);
  }
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && !exited_) {
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
}

bool ChildProcess::running() {
  if (exited_) return false;
  int st = 0;
  if (::waitpid(pid_, &st, WNOHANG) == pid_) {
    exited_ = true;
    code_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  return !exited_;
}

int ChildProcess::wait_exit(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (!running()) return code_;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return running() ? -1 : code_;
}

void ChildProcess::signal(int sig) {
  if (!exited_) ::kill(pid_, sig);
}

std::string ChildProcess::log() const {
  std::ifstream f(log_file_);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ProcessExit run_to_exit(const std::string& exe, const std::vector<std::string>& args, const std::string& name,
                        std::chrono::milliseconds timeout) {
  ChildProcess p(exe, args, {}, name);
  ProcessExit r;
  r.rc = p.wait_exit(timeout);
  r.log = p.log();
  return r;
}

namespace {
bool bindable(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw std::runtime_error("free_port: cannot create a socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(s);
  return ok;
}
}  // namespace

int free_port_run(int n) {
  // Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default): a port from bind(0)
  // lies in that range, where any outgoing connection of a parallel test (a cluster opens thousands) may take it as
  // its source port before the process meant to listen on it has started. Here only another explicit bind can, and
  // a random start per process (pid, time) spreads parallel tests apart. Each port is checked bindable, and none is
  // handed out twice by one process (a test asking for several ports gets distinct ones).
  if (n < 1 || n > 64) throw std::invalid_argument("free_port_run: n must be in [1, 64], got " + std::to_string(n));
  static std::mt19937 rng(static_cast<uint32_t>(::getpid()) * 2654435761u ^
                          static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  static std::mutex mu;
  static std::set<int> handed_out;
  std::lock_guard<std::mutex> lk(mu);
  for (int attempt = 0; attempt < 2000; ++attempt) {
    const int base = 20000 + static_cast<int>(rng() % static_cast<uint32_t>(12000 - n + 1));
    bool ok = true;
    for (int p = base; ok && p < base + n; ++p) ok = !handed_out.count(p) && bindable(p);
    if (!ok) continue;
    for (int p = base; p < base + n; ++p) handed_out.insert(p);
    return base;
  }
  throw std::runtime_error("free_port: no run of " + std::to_string(n) +
                           " bindable ports in 20000-31999 after 2000 tries");
}

int free_port() { return free_port_run(1); }

}  // namespace spade::test

namespace spade::test {

RawClient::RawClient(int port) {
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd_ < 0 || ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close();
    throw std::runtime_error("RawClient: cannot connect to 127.0.0.1:" + std::to_string(port));
  }
  timeval tv{0, 100000};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

RawClient::~RawClient() { close(); }

void RawClient::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void RawClient::send(const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + off, bytes.size() - off);
    ASSERT_GT(n, 0) << "RawClient: write failed";
    off += static_cast<size_t>(n);
  }
}

void RawClient::post(const std::string& path, const std::string& json_body) {
  send("POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: " +
       std::to_string(json_body.size()) + "\r\n\r\n" + json_body);
}

const std::string& RawClient::read_until(const std::string& marker, int times, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  auto count = [&] {
    int n = 0;
    for (size_t p = data_.find(marker); p != std::string::npos; p = data_.find(marker, p + 1)) ++n;
    return n;
  };
  while (count() < times && std::chrono::steady_clock::now() < until) {
    char buf[4096];
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n == 0) break;
    if (n > 0) data_.append(buf, static_cast<size_t>(n));
  }
  return data_;
}

bool RawClient::eof(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    char buf[256];
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n == 0) return true;
    if (n > 0) data_.append(buf, static_cast<size_t>(n));
  }
  return false;
}

}  // namespace spade::test
