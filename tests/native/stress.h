// Shared pieces of the native stress tests: the run's scale and seed (from the
// environment, so sanitizer builds can shrink the run), a start barrier, and a
// stand-in for the GIL.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>

#include "core/lane.h"

namespace pydflash::testing {

/// PYDFLASH_STRESS_SCALE: 1 (the default) is the full run; 0.02 is what CI runs under
/// a sanitizer. Exits on a malformed value rather than running a different test.
inline double stress_scale() {
  const char* text = std::getenv("PYDFLASH_STRESS_SCALE");
  if (text == nullptr || *text == '\0') return 1.0;
  char* end = nullptr;
  const double scale = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(scale > 0)) {
    std::fprintf(stderr, "expected PYDFLASH_STRESS_SCALE to be a positive number, got '%s'\n",
                 text);
    std::exit(2);
  }
  return scale;
}

/// `full` scaled by PYDFLASH_STRESS_SCALE, at least `floor`.
inline uint64_t scaled(uint64_t full, uint64_t floor = 1) {
  const auto n = static_cast<uint64_t>(static_cast<double>(full) * stress_scale());
  return n < floor ? floor : n;
}

/// PYDFLASH_STRESS_SEED, or a fresh one; printed so a failing run can be repeated.
inline uint64_t stress_seed() {
  static const uint64_t seed = [] {
    const char* text = std::getenv("PYDFLASH_STRESS_SEED");
    const uint64_t s = text != nullptr && *text != '\0'
                           ? std::strtoull(text, nullptr, 10)
                           : static_cast<uint64_t>(std::random_device{}());
    std::printf("  PYDFLASH_STRESS_SEED=%llu PYDFLASH_STRESS_SCALE=%g\n",
                static_cast<unsigned long long>(s), stress_scale());
    return s;
  }();
  return seed;
}

/// Threads call arrive_and_wait() and all leave together, so their work overlaps.
class StartBarrier {
 public:
  explicit StartBarrier(int count) : remaining_(count) {}
  void arrive_and_wait() {
    remaining_.fetch_sub(1);
    while (remaining_.load() > 0) std::this_thread::yield();
  }

 private:
  std::atomic<int> remaining_;
};

/// The GIL as the core sees it: one mutex for every lane, with its owner recorded so
/// tasks can check whether they run entered.
class TestInterpreter final : public Interpreter {
 public:
  void thread_started(Lane&) override {
    if (held()) misuse.fetch_add(1);
    started.fetch_add(1);
  }
  void enter() override { lock(); }
  void leave() override { unlock(); }
  void thread_exiting() override {
    if (held()) misuse.fetch_add(1);
    exited.fetch_add(1);
  }

  /// What a Python thread does around calls into the core that need the GIL.
  void lock() {
    if (held()) misuse.fetch_add(1);  // not re-entrant, like the GIL
    mutex_.lock();
    owner_.store(std::this_thread::get_id());
  }
  void unlock() {
    if (!held()) misuse.fetch_add(1);
    owner_.store(std::thread::id());
    mutex_.unlock();
  }
  bool held() const { return owner_.load() == std::this_thread::get_id(); }

  std::atomic<int> started{0};
  std::atomic<int> exited{0};
  /// Entered twice, left without entering, or a worker starting/exiting entered.
  std::atomic<int> misuse{0};

 private:
  std::mutex mutex_;
  std::atomic<std::thread::id> owner_{};
};

class Entered {
 public:
  explicit Entered(TestInterpreter& gil) : gil_(gil) { gil_.lock(); }
  ~Entered() { gil_.unlock(); }
  Entered(const Entered&) = delete;
  Entered& operator=(const Entered&) = delete;

 private:
  TestInterpreter& gil_;
};

}  // namespace pydflash::testing
