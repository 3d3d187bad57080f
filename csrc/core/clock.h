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

/// The longest finite timeout, in seconds: what int64 nanoseconds hold, and what Python
/// allows (threading.TIMEOUT_MAX on Linux). Longer ones are refused where they come in
/// (Note [One timeout rule], csrc/python/timeout.h).
constexpr double kMaxTimeoutS = 9223372036.0;

/// The now_ns() deadline `timeout_s` after `start`, saturated at INT64_MAX so that no
/// timeout, however long, wraps to the past; `start` itself for zero, less or NaN.
inline int64_t deadline_after(int64_t start, double timeout_s) {
  if (!(timeout_s > 0)) return start;
  const double ns = timeout_s * 1e9;
  if (ns >= static_cast<double>(INT64_MAX - start)) return INT64_MAX;
  return start + static_cast<int64_t>(ns);
}

}  // namespace pydflash
