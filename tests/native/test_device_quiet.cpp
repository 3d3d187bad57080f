// Quiet devices (Note [Quiet device for capture]) without Python: CPU lanes given quiet
// devices 0 and 1 stand for lanes of two GPUs, a mutex for the GIL, C++ bodies for
// Python tasks (entered) and graph launches (not entered). The stress test runs work
// tasks and capturers on every lane from producers on a barrier, with a racer shutting
// lanes down, and checks that no task of a device ran while a capturer held it quiet.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"
#include "core/future.h"
#include "core/lane.h"
#include "harness.h"
#include "stress.h"

using namespace pydflash;
using namespace pydflash::testing;

namespace {

constexpr double kWaitS = 10;

// A task body from a function: entered, like a Python task, or not, like a graph launch.
class FnTask final : public TaskBody {
 public:
  FnTask(bool entered, std::function<void(Lane&)> fn) : entered_(entered), fn_(std::move(fn)) {}
  bool needs_interpreter() const override { return entered_; }
  bool run(Lane& lane, FutureState*) override {
    fn_(lane);
    return true;
  }

 private:
  const bool entered_;
  std::function<void(Lane&)> fn_;
};

std::shared_ptr<FutureState> submit(Lane& lane, bool entered, std::function<void(Lane&)> fn) {
  auto future = lane.new_future();
  lane.submit(future, std::make_unique<FnTask>(entered, std::move(fn)));
  return future;
}

bool wait(FutureState& future, double timeout_s = kWaitS) {
  return future.wait(timeout_s, 2'000, 1'000'000, nullptr);
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// What the binding does from a Python task: quiesce without the GIL.
bool quiesce_entered(TestInterpreter& gil, Lane& lane, double timeout_s) {
  gil.unlock();
  const bool quiet = lane.quiesce(timeout_s);
  gil.lock();
  return quiet;
}

// CPU lanes on the quiet devices given, shut down and joined at the end.
struct Lanes {
  explicit Lanes(std::vector<int> quiet_devices, int64_t spin_ns = 0) {
    for (size_t i = 0; i < quiet_devices.size(); ++i) {
      LaneOptions options;
      options.spin_ns = spin_ns;
      options.quiet_device = quiet_devices[i];
      all.push_back(std::make_shared<Lane>(static_cast<int>(i), -1, gil, options));
      all.back()->start();
    }
  }
  ~Lanes() {
    for (auto& lane : all) lane->shutdown(false);
    for (auto& lane : all) lane->join(-1);
  }
  Lane& operator[](size_t i) { return *all[i]; }

  std::shared_ptr<TestInterpreter> gil = std::make_shared<TestInterpreter>();
  std::vector<std::shared_ptr<Lane>> all;
};

TEST_CASE("quiet: the device's lanes pause, graph launches too; another device's run") {
  Lanes lanes({0, 0, 0, 1});
  std::shared_ptr<FutureState> python, graph, other_device;
  bool quiet = false, other_ran = false, held_back = false;
  auto capture = submit(lanes[0], true, [&](Lane& lane) {
    quiet = quiesce_entered(*lanes.gil, lane, kWaitS);
    python = submit(lanes[1], true, [](Lane&) {});
    graph = submit(lanes[2], false, [](Lane&) {});
    other_device = submit(lanes[3], true, [](Lane&) {});
    lanes.gil->unlock();  // as a Python wait lets the GIL go
    other_ran = wait(*other_device);
    sleep_ms(30);
    held_back =
        python->status() == FutureStatus::Pending && graph->status() == FutureStatus::Pending;
    lanes.gil->lock();
    lane.resume();
  });
  CHECK(wait(*capture));
  CHECK(quiet);
  CHECK(other_ran);
  CHECK(held_back);
  CHECK(wait(*python) && wait(*graph));
  CHECK(lanes[0].quiet_stats().quiets == 1);
  CHECK(lanes[1].quiet_stats().pauses >= 1 && lanes[1].quiet_stats().paused_ns > 20'000'000);
  CHECK(lanes[2].quiet_stats().pauses >= 1);
  CHECK(lanes[3].quiet_stats().pauses == 0);
  CHECK(lanes.gil->misuse.load() == 0);
}

TEST_CASE("quiet: two lanes quiesce at once; one goes first, the other waits as paused") {
  Lanes lanes({0, 0, 0}, 20'000);
  std::atomic<int> holders{0}, overlaps{0}, refused{0};
  const int rounds = static_cast<int>(scaled(200, 20));
  for (int r = 0; r < rounds; ++r) {
    StartBarrier barrier(2);
    auto capture = [&](Lane& lane) {
      barrier.arrive_and_wait();
      if (!lane.quiesce(kWaitS)) {
        refused.fetch_add(1);
        return;
      }
      if (holders.fetch_add(1) != 0) overlaps.fetch_add(1);
      std::this_thread::yield();
      holders.fetch_sub(1);
      lane.resume();
    };
    auto a = submit(lanes[0], false, capture);
    auto b = submit(lanes[1], false, capture);
    auto work = submit(lanes[2], true, [](Lane&) {});
    CHECK(wait(*a) && wait(*b) && wait(*work));
  }
  CHECK(overlaps.load() == 0);
  CHECK(refused.load() == 0);
  CHECK(lanes[0].quiet_stats().quiets + lanes[1].quiet_stats().quiets ==
        static_cast<uint64_t>(2 * rounds));
}

TEST_CASE("quiet: a lane busy in its task makes the capturer time out, and nothing stays paused") {
  Lanes lanes({0, 0, 0});
  std::atomic<bool> go{false}, release{false};
  bool quiet = true, free_ran = false;
  auto capture = submit(lanes[0], false, [&](Lane& lane) {
    while (!go.load()) std::this_thread::yield();
    quiet = lane.quiesce(0.2);
    free_ran = wait(*submit(lanes[2], false, [](Lane&) {}));
    release.store(true);
  });
  // Busy, but not in a future wait (which would count as paused).
  auto busy = submit(lanes[1], false, [&](Lane&) {
    while (!release.load()) std::this_thread::yield();
  });
  while (busy->status() != FutureStatus::Running) std::this_thread::yield();
  go.store(true);
  CHECK(wait(*capture) && wait(*busy));
  CHECK(!quiet);
  CHECK(free_ran);
  CHECK(lanes[0].quiet_stats().quiet_timeouts == 1 && lanes[0].quiet_stats().quiets == 0);
}

void finish(FutureState& future) {
  CHECK(future.try_start());
  future.finish();
  future.publish();
}

TEST_CASE("quiet: a lane blocked in a future wait counts as paused, and wakes into a pause") {
  Lanes lanes({0, 0, 0});
  // Lane 1's task waits for what the capture produces (a drafter waiting for its target).
  FutureState produced(1'000'001), by_main(1'000'002), never(1'000'003);
  bool got = false, quiet = false, own_wait_timed_out = false;
  int64_t quiet_took_ns = -1, waiter_woke_ns = 0, quiet_ended_ns = 0;
  auto waiter = submit(lanes[1], false, [&](Lane&) {
    got = wait(produced);
    waiter_woke_ns = now_ns();
  });
  while (waiter->status() != FutureStatus::Running) std::this_thread::yield();
  auto capture = submit(lanes[0], false, [&](Lane& lane) {
    const int64_t start = now_ns();
    quiet = lane.quiesce(kWaitS);
    quiet_took_ns = now_ns() - start;
    // The holder's own waits do not pause.
    own_wait_timed_out = !never.wait(0.02, 2'000, 1'000'000, nullptr);
    // Woken inside the quiet: lane 1 pauses before it goes on; the main thread, no
    // lane's worker, goes on at once.
    finish(produced);
    finish(by_main);
    sleep_ms(100);
    quiet_ended_ns = now_ns();
    lane.resume();
  });
  CHECK(wait(by_main));
  const int64_t main_woke_ns = now_ns();
  CHECK(wait(*capture) && wait(*waiter));
  CHECK(quiet);
  CHECK(quiet_took_ns >= 0);
  CHECK(quiet_took_ns < 2'000'000'000);  // the timeout is kWaitS
  CHECK(own_wait_timed_out);
  CHECK(got);
  CHECK(waiter_woke_ns >= quiet_ended_ns);
  CHECK(main_woke_ns < quiet_ended_ns);
  CHECK(lanes[1].quiet_stats().pauses >= 1);
  CHECK(lanes[0].quiet_stats().quiets == 1 && lanes[0].quiet_stats().quiet_timeouts == 0);
}

TEST_CASE("quiet: a lane whose wait ends outside a quiet runs on, and pauses between tasks") {
  Lanes lanes({0, 0});
  FutureState produced(1'000'004);
  std::atomic<bool> woke{false}, release{false};
  bool got = false;
  auto waiter = submit(lanes[1], false, [&](Lane&) {
    got = wait(produced);
    woke.store(true);
    while (!release.load()) std::this_thread::yield();  // busy: not paused
  });
  while (waiter->status() != FutureStatus::Running) std::this_thread::yield();
  finish(produced);
  while (!woke.load()) std::this_thread::yield();
  bool quiet = true;
  auto capture = submit(lanes[0], false, [&](Lane& lane) {
    quiet = lane.quiesce(0.1);
    release.store(true);
  });
  CHECK(wait(*capture) && wait(*waiter));
  CHECK(got);
  CHECK(!quiet);  // lane 1 no longer counted as paused once its wait ended
}

TEST_CASE("quiet: a lane shut down while paused exits once the quiet ends") {
  Lanes lanes({0, 0});
  std::atomic<bool> held{false}, release{false};
  auto capture = submit(lanes[0], false, [&](Lane& lane) {
    if (!lane.quiesce(kWaitS)) return;
    held.store(true);
    while (!release.load()) std::this_thread::yield();
    lane.resume();
  });
  while (!held.load()) std::this_thread::yield();
  for (int i = 0; i < 5; ++i) submit(lanes[1], false, [](Lane&) {});
  std::vector<Task> cancelled = lanes[1].shutdown(true);
  CHECK(cancelled.size() >= 4);  // its worker may hold the first, paused before it
  CHECK(!lanes[1].join(0.05));
  release.store(true);
  CHECK(lanes[1].join(kWaitS));
  CHECK(wait(*capture));
}

TEST_CASE("quiet: a worker that exits leaves its device") {
  Lanes lanes({0, 0});
  lanes[1].shutdown(false);
  CHECK(lanes[1].join(kWaitS));
  bool quiet = false;
  auto capture = submit(lanes[0], false, [&](Lane& lane) {
    quiet = lane.quiesce(kWaitS);
    if (quiet) lane.resume();
  });
  CHECK(wait(*capture));
  CHECK(quiet);
  CHECK_THROWS_AS(lanes[0].quiesce(0), StateError);  // not from its worker
  CHECK_THROWS_AS(lanes[0].resume(), StateError);
}

// --- stress ------------------------------------------------------------------------

constexpr int kDevices = 2;
constexpr int kLanesPerDevice = 3;
constexpr int kProducers = 4;

struct Device {
  std::atomic<int> running{0};  // work tasks running now
  std::atomic<bool> quiet{false};
};

struct Totals {
  std::atomic<uint64_t> work{0}, quiets{0}, timeouts{0}, breaches{0}, rejected{0};
};

void spin_for(int64_t ns) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// A task of the device's ordinary work: counted while it runs, and a breach if it
// starts while the device is quiet (Dekker: the capturer sets `quiet` and then reads
// `running`, a task bumps `running` and then reads `quiet`; one of them sees the other).
void work(Device& device, Totals& totals, int64_t ns) {
  device.running.fetch_add(1);
  if (device.quiet.load()) totals.breaches.fetch_add(1);
  spin_for(ns);
  device.running.fetch_sub(1);
  totals.work.fetch_add(1);
}

void capture(Device& device, Totals& totals, Lane& lane, TestInterpreter* gil, double timeout_s) {
  const bool quiet =
      gil != nullptr ? quiesce_entered(*gil, lane, timeout_s) : lane.quiesce(timeout_s);
  if (!quiet) {
    totals.timeouts.fetch_add(1);
    return;
  }
  device.quiet.store(true);
  if (device.running.load() != 0) totals.breaches.fetch_add(1);
  spin_for(20'000);
  device.quiet.store(false);
  totals.quiets.fetch_add(1);
  lane.resume();
}

void stress_round(int round_index, uint64_t quota, Totals& totals) {
  const uint64_t seed = stress_seed() * 7'919 + static_cast<uint64_t>(round_index);
  std::mt19937_64 rng(seed);
  auto gil = std::make_shared<TestInterpreter>();
  Device devices[kDevices];
  std::vector<std::shared_ptr<Lane>> lanes;
  for (int l = 0; l < kDevices * kLanesPerDevice; ++l) {
    LaneOptions options;
    options.spin_ns = rng() % 2 ? 0 : 20'000;
    options.quiet_device = l % kDevices;
    lanes.push_back(std::make_shared<Lane>(l, -1, gil, options));
    lanes.back()->start();
  }
  std::atomic<uint64_t> reserved{0};
  std::vector<std::shared_ptr<FutureState>> futures[kProducers];
  StartBarrier barrier(kProducers + 1);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937_64 prng(seed + 31 * (p + 1));
      barrier.arrive_and_wait();
      while (reserved.fetch_add(1) < quota) {
        const int l = static_cast<int>(prng() % lanes.size());
        Lane& lane = *lanes[l];
        Device& device = devices[lane.quiet_device()];
        const bool entered = prng() % 2 == 0;
        const auto dice = prng() % 100;
        std::function<void(Lane&)> body;
        if (dice < 3) {
          // A capturer; one in six gives up almost at once.
          const double timeout_s = prng() % 6 == 0 ? 1e-5 : kWaitS;
          TestInterpreter* held = entered ? gil.get() : nullptr;
          body = [&device, &totals, held, timeout_s](Lane& on) {
            capture(device, totals, on, held, timeout_s);
          };
        } else {
          const int64_t ns = static_cast<int64_t>(prng() % 4) * 5'000;
          body = [&device, &totals, ns](Lane&) { work(device, totals, ns); };
        }
        try {
          futures[p].push_back(submit(lane, entered, std::move(body)));
        } catch (const StateError&) {
          totals.rejected.fetch_add(1);  // shut down by the racer
        }
      }
    });
  }
  // The racer: shuts one lane down mid-round, cancelling its queue or not.
  threads.emplace_back([&] {
    std::mt19937_64 rrng(seed ^ 0x5eed);
    barrier.arrive_and_wait();
    std::this_thread::sleep_for(std::chrono::microseconds(rrng() % 5'000));
    Lane& victim = *lanes[rrng() % lanes.size()];
    Entered entered(*gil);  // cancelled bodies die entered
    std::vector<Task> cancelled = victim.shutdown(rrng() % 2 == 0);
    cancelled.clear();
  });
  for (auto& t : threads) t.join();
  for (auto& lane : lanes) lane->shutdown(false);
  for (auto& lane : lanes) CHECK(lane->join(60));
  for (auto& list : futures) {
    for (auto& f : list) CHECK(f->done());
  }
  CHECK(gil->misuse.load() == 0);
  for (auto& d : devices) CHECK(d.running.load() == 0 && !d.quiet.load());
}

TEST_CASE("quiet stress: no task of a device starts while it is quiet") {
  Totals totals;
  const int rounds = 20;
  const uint64_t quota = scaled(200'000, 2'000) / rounds;
  for (int r = 0; r < rounds; ++r) stress_round(r, quota, totals);
  std::printf(
      "  QUIET tasks=%llu work=%llu quiets=%llu timeouts=%llu rejected=%llu breaches=%llu\n",
      static_cast<unsigned long long>(quota * rounds),
      static_cast<unsigned long long>(totals.work.load()),
      static_cast<unsigned long long>(totals.quiets.load()),
      static_cast<unsigned long long>(totals.timeouts.load()),
      static_cast<unsigned long long>(totals.rejected.load()),
      static_cast<unsigned long long>(totals.breaches.load()));
  CHECK(totals.breaches.load() == 0);
  CHECK(totals.quiets.load() > 0);
}

}  // namespace
