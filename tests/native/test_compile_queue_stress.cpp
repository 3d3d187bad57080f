// Stress tests of the compile queue (csrc/core/compile_queue.h): single-flight keys
// whose holders fail, exclusive slots, timeouts, interrupts and re-entry racing.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/compile_queue.h"
#include "harness.h"
#include "stress.h"

using namespace pydflash;
using namespace pydflash::testing;

namespace {

constexpr int kCallers = 8;
constexpr int kKeys = 6;
constexpr int kSlots = 2;  // keys 0..3 need slot key % 2; keys 4 and 5 need none

std::string key_name(int k) { return "key" + std::to_string(k); }
int slot_of(int k) { return k < 4 ? k % kSlots : -1; }

/// What a failing holder throws: says which run failed, so waiters can be matched to it.
struct RunFailed : std::runtime_error {
  RunFailed(int run, const std::string& key)
      : std::runtime_error("run " + std::to_string(run) + " of " + key + " failed"), run(run) {}
  int run;
};

// One execution of a key's work, written by the thread that ran it.
struct Run {
  int key = -1;
  std::thread::id runner;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t returned_ns = 0;  // when the runner's own run() returned: the flight was done
  bool failed = false;
  std::exception_ptr error;
};

// Throws `error`, keeping a reference to it. Every waiter catches the same exception
// object; libstdc++ counts its references with atomics that ThreadSanitizer does not
// see (the library is not instrumented), so the last waiter freeing it would be reported
// as racing the others' reads. Held here, it is freed by the test's own thread.
[[noreturn]] void throw_kept(std::exception_ptr& keep, std::exception_ptr error) {
  keep = std::move(error);
  std::rethrow_exception(keep);
}

enum class Outcome { Result, Error, Timeout, Interrupted };

struct Call {
  int key = -1;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  Outcome outcome = Outcome::Result;
  int run = -1;      // the run whose result or error this call received
  bool ran = false;  // this call's own thread ran it
};

}  // namespace

TEST_CASE("compile queue stress: single flight with failing holders, slots, timeouts") {
  const uint64_t calls_per_caller = scaled(20'000, 200);
  const uint64_t seed = stress_seed();
  CompileQueue queue;
  std::vector<Run> runs(kCallers * calls_per_caller);
  std::atomic<int> next_run{0};
  std::atomic<int> running_key[kKeys] = {};
  std::atomic<int> running_slot[kSlots] = {};
  std::atomic<int> overlaps{0}, reentry_wrong{0}, unexpected{0};
  std::vector<std::vector<Call>> calls(kCallers);
  StartBarrier barrier(kCallers);

  std::vector<std::thread> threads;
  for (int c = 0; c < kCallers; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(seed * 31 + c);
      const std::string label = "caller " + std::to_string(c);
      barrier.arrive_and_wait();
      for (uint64_t n = 0; n < calls_per_caller; ++n) {
        const int k = static_cast<int>(rng() % kKeys);
        const std::string key = key_name(k);
        CompileOptions options;
        options.label = label;
        if (slot_of(k) >= 0) options.slot = "cuda:" + std::to_string(slot_of(k));
        const auto dice = rng() % 32;
        options.timeout_s = dice == 0 ? 1e-4 : -1.0;
        int polls_left = dice == 1 ? static_cast<int>(rng() % 3) : -1;
        std::function<bool()> interrupted;
        if (polls_left >= 0) interrupted = [&polls_left] { return polls_left-- == 0; };
        const bool fail = rng() % 3 == 0;
        const bool reenter = rng() % 8 == 0;
        const int spin = static_cast<int>(rng() % 50);

        auto work = [&, k, fail, reenter, spin]() -> CompileResult {
          const int r = next_run.fetch_add(1);
          Run& run = runs[r];
          run.key = k;
          run.runner = std::this_thread::get_id();
          run.start_ns = now_ns();
          if (running_key[k].fetch_add(1) != 0) overlaps.fetch_add(1);
          if (slot_of(k) >= 0 && running_slot[slot_of(k)].fetch_add(1) != 0) overlaps.fetch_add(1);
          if (reenter) {
            // The holder asking for its own key again runs the inner work inline.
            const auto me = std::this_thread::get_id();
            CompileResult inner = queue.run(key_name(k), [me] {
              return std::make_shared<int>(std::this_thread::get_id() == me ? -7 : -8);
            });
            if (*static_cast<int*>(inner.get()) != -7) reentry_wrong.fetch_add(1);
          }
          for (int i = 0; i < spin; ++i) std::this_thread::yield();
          if (slot_of(k) >= 0) running_slot[slot_of(k)].fetch_sub(1);
          running_key[k].fetch_sub(1);
          run.failed = fail;
          run.end_ns = now_ns();
          if (fail) throw_kept(run.error, std::make_exception_ptr(RunFailed(r, key_name(k))));
          return std::make_shared<int>(r);
        };

        Call call;
        call.key = k;
        call.start_ns = now_ns();
        try {
          CompileResult result = queue.run(key, work, options, interrupted);
          call.outcome = Outcome::Result;
          call.run = *static_cast<int*>(result.get());
        } catch (const RunFailed& e) {
          call.outcome = Outcome::Error;
          call.run = e.run;
        } catch (const CompileQueueTimeout&) {
          call.outcome = Outcome::Timeout;
        } catch (const CompileQueueInterrupted&) {
          call.outcome = Outcome::Interrupted;
        } catch (...) {
          unexpected.fetch_add(1);
          continue;
        }
        call.end_ns = now_ns();
        if (call.run >= 0) call.ran = runs[call.run].runner == std::this_thread::get_id();
        if (call.ran) runs[call.run].returned_ns = call.end_ns;
        calls[c].push_back(call);
      }
    });
  }
  for (auto& t : threads) t.join();

  CHECK(overlaps.load() == 0);
  CHECK(reentry_wrong.load() == 0);
  CHECK(unexpected.load() == 0);
  CHECK(queue.in_flight().empty());

  const int total_runs = next_run.load();
  std::vector<uint64_t> delivered(total_runs, 0);
  uint64_t shared[kKeys] = {}, timeouts = 0, interrupts = 0, errors = 0, results = 0;
  int bad = 0;
  for (const auto& per_caller : calls) {
    for (const Call& call : per_caller) {
      if (call.outcome == Outcome::Timeout || call.outcome == Outcome::Interrupted) {
        (call.outcome == Outcome::Timeout ? timeouts : interrupts)++;
        continue;
      }
      (call.outcome == Outcome::Error ? errors : results)++;
      const bool in_range = call.run >= 0 && call.run < total_runs;
      const Run* run = in_range ? &runs[call.run] : nullptr;
      // The outcome is its key's, of the matching kind, and of a flight still open when
      // the call began (its runner had not returned yet): never a stale earlier one.
      const bool ok = run != nullptr && run->key == call.key &&
                      run->failed == (call.outcome == Outcome::Error) &&
                      call.start_ns <= run->returned_ns && run->start_ns <= call.end_ns;
      if (!ok && ++bad <= 10)
        std::fprintf(stderr, "  call on key%d got run %d, which does not match\n", call.key,
                     call.run);
      if (!ok) continue;
      ++delivered[call.run];
      if (!call.ran) ++shared[call.key];
    }
  }
  CHECK(bad == 0);
  // Every run's outcome reached at least the caller that ran it, and the queue's stats
  // agree with what the callers saw.
  uint64_t failed_runs = 0, fanned_out = 0;
  for (int r = 0; r < total_runs; ++r) {
    CHECK(delivered[r] >= 1);
    if (runs[r].failed) {
      ++failed_runs;
      fanned_out += delivered[r] - 1;
    }
  }
  const auto stats = queue.stats();
  for (int k = 0; k < kKeys; ++k) {
    uint64_t runs_of_key = 0, failures_of_key = 0;
    for (int r = 0; r < total_runs; ++r) {
      if (runs[r].key != k) continue;
      ++runs_of_key;
      failures_of_key += runs[r].failed;
    }
    auto it = stats.find(key_name(k));
    CHECK(it != stats.end());
    if (it == stats.end()) continue;
    CHECK(it->second.runs == runs_of_key);
    CHECK(it->second.failures == failures_of_key);
    CHECK(it->second.shared == shared[k]);
  }
  std::printf("  COMPILE_QUEUE_STRESS calls=%llu runs=%d failed_runs=%llu errors_fanned_out=%llu "
              "results=%llu errors=%llu timeouts=%llu interrupts=%llu\n",
              (unsigned long long)(kCallers * calls_per_caller), total_runs,
              (unsigned long long)failed_runs, (unsigned long long)fanned_out,
              (unsigned long long)results, (unsigned long long)errors, (unsigned long long)timeouts,
              (unsigned long long)interrupts);
}

TEST_CASE("compile queue stress: a failing holder's error reaches every waiter on its key") {
  constexpr int kWaiters = 6;
  const uint64_t iterations = scaled(500, 20);
  int bad = 0;
  for (uint64_t it = 0; it < iterations; ++it) {
    CompileQueue queue;
    const std::string key = "kernel";
    CompileOptions options;
    options.slot = it % 2 ? "cuda:0" : "";
    std::atomic<bool> holder_running{false};
    std::atomic<int> waiter_runs{0}, waiter_errors{0};
    std::exception_ptr error;
    std::thread holder([&] {
      try {
        queue.run(
            key,
            [&]() -> CompileResult {
              holder_running.store(true);
              // Fail only once every waiter is queued on this flight.
              for (;;) {
                auto flights = queue.in_flight();
                if (!flights.empty() && flights[0].waiters == kWaiters) break;
                std::this_thread::yield();
              }
              throw_kept(error, std::make_exception_ptr(RunFailed(static_cast<int>(it), key)));
            },
            options);
        ++bad;  // the holder must see its own failure
      } catch (const RunFailed& e) {
        bad += e.run != static_cast<int>(it);
      }
    });
    while (!holder_running.load()) std::this_thread::yield();
    StartBarrier barrier(kWaiters);
    std::vector<std::thread> waiters;
    for (int w = 0; w < kWaiters; ++w) {
      waiters.emplace_back([&] {
        barrier.arrive_and_wait();
        try {
          queue.run(
              key,
              [&]() -> CompileResult {
                waiter_runs.fetch_add(1);
                return nullptr;
              },
              options);
        } catch (const RunFailed& e) {
          if (e.run == static_cast<int>(it)) waiter_errors.fetch_add(1);
        }
      });
    }
    holder.join();
    for (auto& t : waiters) t.join();
    bad += waiter_runs.load() != 0 || waiter_errors.load() != kWaiters;
    const auto stats = queue.stats().at(key);
    bad += stats.runs != 1 || stats.failures != 1 || stats.shared != kWaiters;
    // A failure is not cached: the next call runs the work again.
    CompileResult again = queue.run(key, [] { return std::make_shared<int>(42); }, options);
    bad += *static_cast<int*>(again.get()) != 42;
  }
  CHECK(bad == 0);
}
