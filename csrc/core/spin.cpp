#include "core/spin.h"

#include <algorithm>
#include <atomic>
#include <thread>

namespace pydflash {
namespace {

// Note [Polling only on a free core] (spin.h).
constexpr int64_t kLateYieldNs = 500'000;
constexpr int64_t kMinBackOffNs = 1'000'000;
constexpr int64_t kMaxBackOffNs = 256'000'000;
constexpr uint32_t kPromptStreak = 64;

std::atomic<int64_t> sleep_until_ns{0};  // polls sleep at once until then
std::atomic<int64_t> back_off_ns{kMinBackOffNs};
std::atomic<uint32_t> prompt_streak{0};  // prompt yields since the last late one
std::atomic<uint64_t> late{0};

}  // namespace

bool cores_free() { return now_ns() >= sleep_until_ns.load(std::memory_order_relaxed); }

bool yield_core() {
  const int64_t before = now_ns();
  std::this_thread::yield();
  const int64_t after = now_ns();
  if (after - before <= kLateYieldNs) {
    if (prompt_streak.fetch_add(1, std::memory_order_relaxed) + 1 == kPromptStreak)
      back_off_ns.store(kMinBackOffNs, std::memory_order_relaxed);
    return true;
  }
  // Another thread had this core: sleep instead of polling for a while, longer each time
  // in a row. Races between pollers only pick one of their back-offs.
  late.fetch_add(1, std::memory_order_relaxed);
  prompt_streak.store(0, std::memory_order_relaxed);
  const int64_t back_off = back_off_ns.load(std::memory_order_relaxed);
  sleep_until_ns.store(after + back_off, std::memory_order_relaxed);
  back_off_ns.store(std::min(back_off * 2, kMaxBackOffNs), std::memory_order_relaxed);
  return false;
}

uint64_t late_yields() { return late.load(std::memory_order_relaxed); }

}  // namespace pydflash
