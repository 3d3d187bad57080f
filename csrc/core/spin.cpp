#include "core/spin.h"

#include <fcntl.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#endif

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace pydflash {
namespace {

// Note [Polling only on a free core] (spin.h).
constexpr int64_t kLoadReadNs = 1'000'000;
constexpr int64_t kLateYieldNs = 50'000;

std::atomic<int64_t> next_read_ns{0};
std::atomic<bool> free_now{true};

int usable_cores() {
  static const int cores = [] {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
    const unsigned n = std::thread::hardware_concurrency();
    return n == 0 ? 1 : static_cast<int>(n);
  }();
  return cores;
}

// Threads runnable on the machine now, from "0.50 0.40 0.30 3/123 4567"; -1 when it
// cannot be read. One descriptor for the process, read with pread: no open per read.
int runnable_threads() {
  static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[128];
  const ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return -1;
  text[n] = '\0';
  const char* field = text;
  for (int spaces = 0; spaces < 3; ++spaces) {
    field = std::strchr(field, ' ');
    if (field == nullptr) return -1;
    ++field;
  }
  char* end = nullptr;
  const long runnable = std::strtol(field, &end, 10);
  return end == field || *end != '/' ? -1 : static_cast<int>(runnable);
}

}  // namespace

bool cores_free() {
  const int64_t now = now_ns();
  int64_t next = next_read_ns.load(std::memory_order_relaxed);
  // One thread reads per period; the others keep the last answer.
  if (now >= next &&
      next_read_ns.compare_exchange_strong(next, now + kLoadReadNs, std::memory_order_relaxed)) {
    const int runnable = runnable_threads();
    free_now.store(runnable < 0 || runnable <= usable_cores(), std::memory_order_relaxed);
  }
  return free_now.load(std::memory_order_relaxed);
}

void yield_core() {
  const int64_t before = now_ns();
  std::this_thread::yield();
  if (now_ns() - before > kLateYieldNs) free_now.store(false, std::memory_order_relaxed);
}

}  // namespace pydflash
