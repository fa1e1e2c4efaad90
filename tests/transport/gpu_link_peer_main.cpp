// transport_gpu_link_peer: the cache-rank process of the cross-process GpuLink tests (tests/transport/gpu_link_cases.h:
// NcclLink on two GPUs, CudaIpcLink on one).
//
//   transport_gpu_link_peer nccl|ipc <device> echo <N>             echo N messages, print DONE, exit 0
//   transport_gpu_link_peer nccl|ipc <device> echo-then-hang <N>   echo N messages, print HANG, sleep (the test
//                                                                  SIGKILLs us)
//
// Protocol on stdio: read the link address (hex, one line; the parent is the inference side and made it), join the
// link as the cache side on <device>, print CONNECTED. Message i has echo_bytes(i) bytes; we receive it on the up
// direction, XOR every byte with 0xA5 and send it back down, then print "ECHOED i". On any error we print
// "ERROR <message>" and exit 1.
#include <cuda_runtime_api.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/transport/hex.h"
#include "transport/cuda_ipc/cuda_ipc_link.h"
#include "transport/nccl/nccl_link.h"

using namespace spade::transport;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: transport_gpu_link_peer nccl|ipc <device> echo|echo-then-hang <N>\n";
    return 2;
  }
  const std::string kind = argv[1];
  const int device = std::stoi(argv[2]);
  const std::string mode = argv[3];
  const int n = std::stoi(argv[4]);
  // Declared outside the try: on an error, ERROR is printed before the link's teardown (which may wait).
  std::unique_ptr<GpuLink> link;
  try {
    spdlog::set_default_logger(spdlog::stderr_logger_mt("gpu_link_peer"));  // stdout carries the protocol
    std::string line;
    if (!std::getline(std::cin, line)) throw std::runtime_error("no link address on stdin");
    const std::string parent = "test parent (inference side)";
    if (kind == "nccl") {
      NcclLinkOptions o;
      o.device = device;
      o.connect_timeout = std::chrono::milliseconds(20000);
      o.op_timeout = std::chrono::milliseconds(20000);
      link = std::make_unique<NcclLink>(test::from_hex(line), NcclRole::kCache, parent, o);
    } else if (kind == "ipc") {
      CudaIpcLinkOptions o;
      o.device = device;
      o.op_timeout = std::chrono::milliseconds(20000);
      link = CudaIpcLink::open(test::from_hex(line), parent, o);
    } else {
      throw std::runtime_error("unknown link kind " + kind);
    }
    std::cout << "CONNECTED" << std::endl;
    cudaStream_t stream;
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) throw std::runtime_error("stream");
    void* buf = nullptr;
    if (cudaMalloc(&buf, size_t{1} << 21) != cudaSuccess) throw std::runtime_error("cudaMalloc");
    std::vector<unsigned char> host;
    for (int i = 0; i < n; ++i) {
      const size_t bytes = test::echo_bytes(i);
      link->recv(buf, bytes, stream, "echo request");
      host.resize(bytes);
      if (cudaMemcpyAsync(host.data(), buf, bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
          cudaStreamSynchronize(stream) != cudaSuccess)
        throw std::runtime_error("copy out: " + link->failure());
      for (auto& b : host) b ^= 0xA5;
      if (cudaMemcpyAsync(buf, host.data(), bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess)
        throw std::runtime_error("copy in");
      link->send(buf, bytes, stream, "echo reply");
      if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("send: " + link->failure());
      std::cout << "ECHOED " << i << std::endl;
    }
    if (mode == "echo-then-hang") {
      std::cout << "HANG" << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(120));
      return 3;
    }
    link.reset();
    cudaFree(buf);
    cudaStreamDestroy(stream);
    std::cout << "DONE" << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cout << "ERROR " << e.what() << std::endl;
    return 1;
  }
}
