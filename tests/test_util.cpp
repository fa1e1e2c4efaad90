#include "tests/test_util.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <cstring>
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
