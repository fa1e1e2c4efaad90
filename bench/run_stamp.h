// The run stamp every benchmark JSON carries: UTC date and commit ($SPADE_COMMIT, set by bench/run_gpu.sh; else
// "unknown"). Device, shapes and floors are each benchmark's own.
#pragma once

#include <cstdlib>
#include <ctime>
#include <nlohmann/json.hpp>

namespace spade::bench {

/// Sets doc["date"] (ISO 8601, UTC) and doc["commit"].
inline void stamp_run(nlohmann::json& doc) {
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  doc["date"] = date;
  const char* commit = std::getenv("SPADE_COMMIT");
  doc["commit"] = commit != nullptr && *commit != '\0' ? commit : "unknown";
}

}  // namespace spade::bench
