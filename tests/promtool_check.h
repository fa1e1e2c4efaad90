// `promtool check metrics` on a /metrics text, as the tests run it: parse errors and lint problems fail, except
// promtool's lint "metric names should not contain ':'" on vLLM's own names (vllm:...), which Spade serves exactly as
// vLLM does (the colon is legal in the exposition format; promtool reserves it by convention for recording rules).
// promtool comes with Debian's prometheus package (deploy/scripts/setup_deps.sh); without it the check fails.
#pragma once

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/wait.h>

#include "tests/test_util.h"

namespace spade::test {

/// "" when promtool accepts `text` (allowing only the vllm: colon lint), else promtool's exit status and output.
inline std::string promtool_check_metrics(const std::string& text) {
  const std::string dir = make_temp_dir("spade-promtool");
  std::ofstream(dir + "/metrics.txt") << text;
  const std::string cmd = "promtool check metrics < " + dir + "/metrics.txt > " + dir + "/promtool.log 2>&1";
  const int status = std::system(cmd.c_str());
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  const std::string log = read_file(dir + "/promtool.log");
  if (rc == 0) return "";
  bool only_vllm_colons = rc == 3;  // promtool: 3 = lint problems (listed one per line), 1 = a parse error
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const bool colon_lint = line.rfind("vllm:", 0) == 0 && line.find(' ') != std::string::npos &&
                            line.substr(line.find(' ')) == " metric names should not contain ':'";
    only_vllm_colons = only_vllm_colons && colon_lint;
  }
  if (only_vllm_colons) return "";
  return "promtool check metrics exited " + std::to_string(rc) +
         " (is Debian's prometheus package installed? deploy/scripts/setup_deps.sh installs it):\n" + log;
}

}  // namespace spade::test
