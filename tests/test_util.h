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
