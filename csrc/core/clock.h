#pragma once

#include <chrono>
#include <cstdint>

namespace pydflash {

/// Monotonic nanoseconds, the one clock used for stats and traces.
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace pydflash
