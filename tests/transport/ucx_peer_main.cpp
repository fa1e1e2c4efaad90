// transport_ucx_peer: the other process of the UCX cross-process tests (tests/transport/test_ucx.cpp).
//
//   transport_ucx_peer <name> sleep        connect, print CONNECTED, then wait (the test SIGKILLs us)
//   transport_ucx_peer <name> echo <N>     connect, echo N messages: recv (kQkvPack, i, 0) -> send
//   (kSelectedKv, i, 0)
//
// Protocol on stdio: we print our UCX address as hex on one line, read the parent's address (hex line) from
// stdin, connect, print CONNECTED. Every wait has a deadline; on any error we print "ERROR <message>" and
// exit 1.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "tests/transport/hex.h"
#include "transport/tags.h"
#include "transport/ucx.h"

using namespace spade::transport;
using spade::transport::test::from_hex;
using spade::transport::test::to_hex;
using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: transport_ucx_peer <name> sleep | echo <N>\n");
    return 2;
  }
  std::string name = argv[1];
  std::string mode = argv[2];
  try {
    UcxOptions o;
    o.name = name;
    auto t = make_ucx_transport(o);
    std::cout << to_hex(t->local_address()) << std::endl;
    std::string line;
    if (!std::getline(std::cin, line)) throw std::runtime_error("no parent address on stdin");
    auto ep = t->connect(from_hex(line), "test parent", Clock::now() + 10s);
    std::cout << "CONNECTED" << std::endl;
    if (mode == "sleep") {
      std::this_thread::sleep_for(60s);  // the parent kills us long before
      return 0;
    }
    if (mode == "echo") {
      int n = argc > 3 ? std::atoi(argv[3]) : 10;
      std::vector<char> buf(size_t{1} << 20);
      for (int i = 0; i < n; ++i) {
        auto r = ep->post_recv(make_tag(MsgKind::kQkvPack, i, 0), buf.data(), buf.size());
        if (r.wait(Clock::now() + 10s) != Status::OK)
          throw std::runtime_error("recv " + std::to_string(i) + ": " + r.error());
        auto s = ep->post_send(make_tag(MsgKind::kSelectedKv, i, 0), buf.data(), r.length());
        if (s.wait(Clock::now() + 10s) != Status::OK)
          throw std::runtime_error("send " + std::to_string(i) + ": " + s.error());
      }
      std::cout << "DONE" << std::endl;
      // Wait for the parent to close its side (EOF on stdin) so our last send is not cut off.
      std::getline(std::cin, line);
      return 0;
    }
    throw std::runtime_error("unknown mode " + mode);
  } catch (const std::exception& e) {
    std::cout << "ERROR " << e.what() << std::endl;
    return 1;
  }
}
