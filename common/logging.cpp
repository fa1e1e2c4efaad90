#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/error.h"

namespace spade {

void init_logging(std::string_view component, std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") fail("unknown log level '{}' (trace|debug|info|warn|error|off)", level);
  auto logger = spdlog::stderr_color_mt(std::string(component));
  logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] [%n] %v");
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
}

}  // namespace spade
