// Error type and checks used across Spade.
//
// Every error message names the file, peer or field involved (the developers' guide: "every error names the peer or
// file involved"). Errors are exceptions of type spade::Error; callers that must not throw catch at their boundary.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace spade {

/// The one exception type Spade throws for bad input, bad state and failed I/O.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Throws spade::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace spade

/// Throws spade::Error(fmt::format(...)) when `cond` is false.
#define SPADE_CHECK(cond, ...)        \
  do {                                \
    if (!(cond)) {                    \
      ::spade::fail(__VA_ARGS__);     \
    }                                 \
  } while (0)
