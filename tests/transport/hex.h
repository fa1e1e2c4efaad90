// Shared by the cross-process transport tests and their peer executables: hex encoding of transport addresses
// passed over pipes (one line each), and the message sizes of the echo tests.
#pragma once

#include <cstddef>
#include <string>

namespace spade::transport::test {

inline std::string to_hex(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

inline std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

/// Size of echo message i of the cross-process link tests (1 byte .. 1 MiB, irregular).
inline size_t echo_bytes(int i) { return static_cast<size_t>(1 + (i * 37813) % (1 << 20)); }

}  // namespace spade::transport::test
