// Logging: spdlog, one process-wide logger. Logs go to stderr so stdout stays for generated text.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace spade {

/// Sets up the default spdlog logger for a process: stderr sink, pattern "[time] [level] [component] msg".
/// `level` is one of trace|debug|info|warn|error|off (throws spade::Error on anything else).
void init_logging(std::string_view component, std::string_view level = "info");

}  // namespace spade
