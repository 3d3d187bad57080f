// Stress tests of the lane core without Python. A mutex stands in for the GIL; task
// bodies are C++ and record every run, notification and destruction in a slot per
// task. Producers, cancellers, waiters, a simulated device and racing shutdowns start
// on a barrier; afterwards every task is checked: resolved exactly once, nothing lost,
// nothing run after a successful cancel, results visible to waiters. The full run
// (PYDFLASH_STRESS_SCALE=1) submits a million tasks.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/future.h"
#include "core/lane.h"
#include "core/task_queue.h"
#include "harness.h"
#include "stress.h"

using namespace pydflash;
using namespace pydflash::testing;

namespace {

constexpr int kLanes = 4;
constexpr int kProducers = 4;
constexpr int kMeddlers = 2;
constexpr int kRacers = 2;
constexpr int64_t kWaitSliceNs = 1'000'000;

enum class Kind : int {
  Interp,  // needs the interpreter, like a Python task
  Native,  // runs without it, like a graph launch that fails before reaching the GPU
  Device,  // finishes later, from the simulated device, like a graph launch
};

int64_t expected_result(uint32_t slot) { return static_cast<int64_t>(slot) * 7 + 3; }
std::string task_failure(uint32_t slot) { return "task " + std::to_string(slot); }

// The message of the error a failing task left on its future ("" for none).
std::string failure_of(const FutureState& future) {
  if (!future.error()) return "";
  try {
    std::rethrow_exception(future.error());
  } catch (const Error& e) {
    return e.what();
  }
}

// Contract breaches seen on threads where CHECK cannot be used (the harness counts
// failures in a plain int); checked on the main thread at the end of each round.
enum Breach : int {
  kInterpTaskNotEntered,
  kNativeTaskEntered,
  kRanAfterCancel,
  kRanWhileNotRunning,
  kDestroyedNotEntered,
  kNotifiedNotEntered,
  kInternalWorkNotEntered,
  kWaiterSawWrongOutcome,
  kForeverWaitReturnedFalse,
  kShutdownReturnedUncancelled,
  kJoinFailed,
  kBreachCount
};
constexpr const char* kBreachNames[kBreachCount] = {
    "interpreter task ran without the interpreter",
    "native task ran entered",
    "task ran after a successful cancel",
    "task ran while its future was not Running",
    "body holding interpreter objects destroyed without the interpreter",
    "observer notified without the interpreter",
    "internal work ran without the interpreter",
    "waiter saw a done future without its outcome",
    "wait(forever) returned false",
    "shutdown returned a task with a live, uncancelled future",
    "join(-1) returned false",
};

struct Slot {
  // Written by the producer before the task is shared, read after.
  Kind kind = Kind::Interp;
  bool fails = false;
  bool accepted = false;
  bool has_body = false;
  int lane = -1;
  std::shared_ptr<FutureState> future;
  // Outcome of the task: plain, so the sanitizer checks that whoever reads it after
  // the future is done is ordered after the write.
  int64_t result = 0;
  std::atomic<int> runs{0};
  std::atomic<int> cancel_wins{0};
  std::atomic<int> notifies{0};
  std::atomic<int> destroyed{0};
  std::atomic<bool> observer_saw_pending{false};
};

struct Completion {
  Lane* lane;  // alive: its worker waits for device work before it exits
  FutureState* future;
  uint32_t slot;
};

struct Round {
  explicit Round(size_t capacity) : slots(capacity) {}

  std::vector<Slot> slots;
  std::atomic<uint32_t> next_slot{0};
  std::shared_ptr<TestInterpreter> gil = std::make_shared<TestInterpreter>();
  TaskQueue<Completion> device;
  std::atomic<int> breaches[kBreachCount] = {};
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> releases_pending{0};

  void breach(Breach b) { breaches[b].fetch_add(1); }
  Slot& slot(uint32_t i) { return slots[i]; }
  uint32_t new_slot() {
    const uint32_t i = next_slot.fetch_add(1);
    PYDFLASH_INTERNAL_ASSERT(i < slots.size());
    return i;
  }
  /// What notify_future (csrc/python/future_object.cpp) stands for.
  void notify(uint32_t i) {
    if (!gil->held()) breach(kNotifiedNotEntered);
    slots[i].notifies.fetch_add(1);
    slots[i].future->mark_notified();
  }
};

class StressTask final : public TaskBody {
 public:
  StressTask(Round& round, uint32_t slot) : round_(round), slot_(slot) {}
  ~StressTask() override {
    if (holds_interpreter_objects_ && !round_.gil->held()) round_.breach(kDestroyedNotEntered);
    round_.slot(slot_).destroyed.fetch_add(1);
  }

  uint32_t slot() const { return slot_; }
  Kind kind() const { return round_.slot(slot_).kind; }
  bool needs_interpreter() const override { return kind() == Kind::Interp; }
  bool needs_interpreter_to_destroy() const override { return holds_interpreter_objects_; }

  bool run(Lane& lane, FutureState* future) override {
    Slot& s = round_.slot(slot_);
    if (needs_interpreter() != round_.gil->held())
      round_.breach(needs_interpreter() ? kInterpTaskNotEntered : kNativeTaskEntered);
    if (s.cancel_wins.load() != 0) round_.breach(kRanAfterCancel);
    if (future == nullptr || future->status() != FutureStatus::Running) {
      round_.breach(kRanWhileNotRunning);
      return true;
    }
    s.runs.fetch_add(1);
    if (s.fails) future->set_error(std::make_exception_ptr(StateError(task_failure(slot_))));
    if (s.kind == Kind::Device) {
      holds_interpreter_objects_ = false;  // handed to the completion, as GraphTask does
      lane.device_work_started();
      round_.releases_pending.fetch_add(1);
      round_.device.push(Completion{&lane, future, slot_});
      return false;
    }
    s.result = expected_result(slot_);
    return true;
  }

  void notify(FutureState&) override { round_.notify(slot_); }

 private:
  Round& round_;
  const uint32_t slot_;
  bool holds_interpreter_objects_ = kind() != Kind::Native;
};

// Posted by the device once a Device task's future is finished: notifies and lets the
// lane know its device work is over, entered (GraphRelease in the Python layer).
class Release final : public TaskBody {
 public:
  Release(Round& round, uint32_t slot, bool observed)
      : round_(round), slot_(slot), observed_(observed) {}
  bool needs_interpreter() const override { return true; }
  bool run(Lane& lane, FutureState* future) override {
    if (!round_.gil->held() || future != nullptr) round_.breach(kInternalWorkNotEntered);
    if (observed_) round_.notify(slot_);
    lane.device_work_finished();
    round_.releases_pending.fetch_sub(1);
    return true;
  }

 private:
  Round& round_;
  const uint32_t slot_;
  const bool observed_;
};

void device_main(Round& round, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Completion c{};
  while (round.device.pop_wait(c, 0, [] { return true; })) {
    if (rng() % 4 == 0) std::this_thread::yield();  // let the worker move on first
    round.slot(c.slot).result = expected_result(c.slot);
    const bool observed = c.future->finish();
    c.future->publish();
    c.lane->post_internal(std::make_unique<Release>(round, c.slot, observed));
  }
}

// A Python thread calling Future.cancel(): only the caller that cancels notifies.
void cancel(Round& round, uint32_t i) {
  Entered entered(*round.gil);
  Slot& s = round.slot(i);
  if (s.future->try_cancel()) {
    s.cancel_wins.fetch_add(1);
    if (s.future->observed()) round.notify(i);
  }
}

// Adding a done callback or a concurrent.futures waiter (Note [Observed futures]).
void observe(Round& round, uint32_t i) {
  Entered entered(*round.gil);
  Slot& s = round.slot(i);
  s.future->mark_observed();
  if (!s.future->done()) s.observer_saw_pending.store(true);
}

// result(): waits without the interpreter; once done the outcome must be visible.
void await(Round& round, uint32_t i, double timeout_s) {
  Slot& s = round.slot(i);
  const bool done = s.future->wait(timeout_s, 2'000, kWaitSliceNs, nullptr);
  if (!done) {
    if (timeout_s < 0) round.breach(kForeverWaitReturnedFalse);
    return;
  }
  const FutureStatus status = s.future->status();
  if (status == FutureStatus::Finished) {
    const bool ok =
        s.fails ? failure_of(*s.future) == task_failure(i) : s.result == expected_result(i);
    if (!ok) round.breach(kWaiterSawWrongOutcome);
  } else if (status != FutureStatus::Cancelled) {
    round.breach(kWaiterSawWrongOutcome);
  }
}

// What Lane.shutdown does from Python: close, and notify what this call cancelled.
void shutdown_lane(Round& round, Lane& lane, bool cancel_queued) {
  Entered entered(*round.gil);
  std::vector<Task> taken = lane.shutdown(cancel_queued);
  for (auto& task : taken) {
    if (!task.future) continue;  // cancelled earlier; its canceller notified
    const uint32_t i = static_cast<StressTask*>(task.body.get())->slot();
    if (task.future->status() != FutureStatus::Cancelled) {
      round.breach(kShutdownReturnedUncancelled);
      continue;
    }
    round.slot(i).cancel_wins.fetch_add(1);
    if (task.future->observed()) round.notify(i);
  }
  taken.clear();  // bodies die entered
}

// Recently accepted tasks, shared between producers and meddlers.
class Recent {
 public:
  void add(uint32_t i) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (items_.size() < kSize) {
      items_.push_back(i);
    } else {
      items_[next_++ % kSize] = i;
    }
  }
  std::optional<uint32_t> pick(std::mt19937_64& rng) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (items_.empty()) return std::nullopt;
    return items_[rng() % items_.size()];
  }

 private:
  static constexpr size_t kSize = 256;
  std::mutex mutex_;
  std::vector<uint32_t> items_;
  size_t next_ = 0;
};

struct RoundResult {
  uint64_t accepted = 0, rejected = 0, finished = 0, cancelled = 0, failed = 0, device = 0;
};

// One round: fresh lanes, everything racing, then every slot checked.
RoundResult run_round(int round_index, uint64_t quota) {
  const uint64_t seed = stress_seed() * 1'000'003 + static_cast<uint64_t>(round_index);
  std::mt19937_64 rng(seed);
  // Each producer is rejected at most once per lane before it stops choosing it.
  Round round(quota + kProducers * kLanes);
  std::vector<std::shared_ptr<Lane>> lanes;
  for (int l = 0; l < kLanes; ++l) {
    LaneOptions options;
    options.spin_ns = rng() % 2 ? 0 : 20'000;  // both the sleeping and the polling consumer
    lanes.push_back(std::make_shared<Lane>(l, -1, round.gil, options));
    lanes.back()->start();
  }
  std::thread device([&round, seed] { device_main(round, seed ^ 0xdef1ce5); });

  Recent recent;
  std::atomic<uint64_t> reserved{0};
  std::atomic<int> producers_left{kProducers};
  std::atomic<bool> stop_meddling{false};
  StartBarrier barrier(kProducers + kMeddlers + kRacers);
  std::vector<std::thread> threads;

  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937_64 prng(seed + 101 * (p + 1));
      unsigned closed_mask = 0;
      std::vector<uint32_t> mine;
      barrier.arrive_and_wait();
      while (reserved.fetch_add(1) < quota) {
        for (;;) {  // until a lane takes it; lane 0 stays open until the round ends
          int lane = static_cast<int>(prng() % kLanes);
          while (closed_mask & (1u << lane)) lane = (lane + 1) % kLanes;
          const uint32_t i = round.new_slot();
          Slot& s = round.slot(i);
          const auto dice = prng() % 10;
          s.kind = dice < 5 ? Kind::Interp : dice < 8 ? Kind::Native : Kind::Device;
          s.fails = prng() % 16 == 0;
          s.lane = lane;
          std::optional<Entered> entered;
          if (s.kind != Kind::Native) entered.emplace(*round.gil);  // a rejected body dies here
          try {
            s.future = lanes[lane]->new_future();
            s.has_body = true;
            lanes[lane]->submit(s.future, std::make_unique<StressTask>(round, i));
            s.accepted = true;
          } catch (const StateError&) {
            closed_mask |= 1u << lane;
            continue;
          }
          entered.reset();
          round.accepted.fetch_add(1);
          recent.add(i);
          mine.push_back(i);
          break;
        }
        const auto action = prng() % 64;
        const uint32_t target = mine[mine.size() - 1 - prng() % std::min<size_t>(mine.size(), 32)];
        if (action < 6) {
          cancel(round, target);
        } else if (action < 12) {
          observe(round, target);
        } else if (action == 12) {
          await(round, target, prng() % 2 ? 0.0 : 1e-4);
        }
      }
      producers_left.fetch_sub(1);
    });
  }

  for (int m = 0; m < kMeddlers; ++m) {
    threads.emplace_back([&, m] {
      std::mt19937_64 mrng(seed + 7919 * (m + 1));
      barrier.arrive_and_wait();
      while (!stop_meddling.load()) {
        const auto i = recent.pick(mrng);
        if (!i) {
          std::this_thread::yield();
          continue;
        }
        switch (mrng() % 8) {
          case 0:
          case 1:
            cancel(round, *i);
            break;
          case 2:
          case 3:
          case 4:
            observe(round, *i);
            break;
          case 5:
            await(round, *i, -1);
            break;
          default:
            await(round, *i, 0.0);
            break;
        }
      }
    });
  }

  // Racers close one of lanes 1..3 each mid-round (sometimes the same one), then join it
  // while producers, meddlers and the other racer carry on.
  for (int r = 0; r < kRacers; ++r) {
    const uint64_t trigger = quota / 8 + rng() % (quota * 3 / 4 + 1);
    std::shared_ptr<Lane> lane = lanes[1 + rng() % (kLanes - 1)];
    const bool cancel_queued = rng() % 2;
    threads.emplace_back([&, trigger, lane, cancel_queued] {
      barrier.arrive_and_wait();
      while (round.accepted.load() < trigger && producers_left.load() > 0)
        std::this_thread::yield();
      shutdown_lane(round, *lane, cancel_queued);
      if (!lane->join(-1)) round.breach(kJoinFailed);
    });
  }

  while (producers_left.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Round end, while meddlers still cancel and wait: close every lane; every third
  // round drops the lanes without joining, so the workers destroy them.
  const bool cancel_rest = rng() % 2;
  const bool drop_unjoined = round_index % 3 == 2;
  for (auto& lane : lanes) shutdown_lane(round, *lane, cancel_rest);
  RoundResult result;
  std::vector<LaneStats> stats;
  if (drop_unjoined) {
    lanes.clear();
  } else {
    for (auto& lane : lanes) {
      if (!lane->join(-1)) round.breach(kJoinFailed);
      stats.push_back(lane->stats());
    }
  }
  stop_meddling.store(true);
  for (auto& t : threads) t.join();

  const uint32_t used = round.next_slot.load();
  for (uint32_t i = 0; i < used; ++i) {
    Slot& s = round.slot(i);
    if (s.accepted && !s.future->wait(-1, 0, kWaitSliceNs, nullptr))
      round.breach(kForeverWaitReturnedFalse);
  }
  round.device.close();
  device.join();
  // Unjoined lanes: their workers finish what is left and exit on their own.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while ((round.releases_pending.load() > 0 || round.gil->exited.load() < kLanes) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));

  CHECK(round.gil->started.load() == kLanes);
  CHECK(round.gil->exited.load() == kLanes);
  CHECK(round.gil->misuse.load() == 0);
  CHECK(round.releases_pending.load() == 0);
  for (int b = 0; b < kBreachCount; ++b) {
    const int n = round.breaches[b].load();
    if (n != 0) std::fprintf(stderr, "  round %d: %d x %s\n", round_index, n, kBreachNames[b]);
    CHECK(n == 0);
  }

  std::vector<uint64_t> accepted_on(kLanes, 0);
  int bad = 0;
  auto expect = [&](bool ok, uint32_t i, const char* what) {
    if (ok) return;
    if (++bad <= 10) std::fprintf(stderr, "  round %d task %u: %s\n", round_index, i, what);
  };
  for (uint32_t i = 0; i < used; ++i) {
    Slot& s = round.slot(i);
    expect(s.destroyed.load() == (s.has_body ? 1 : 0), i, "body not destroyed exactly once");
    if (!s.accepted) {
      ++result.rejected;
      expect(s.runs.load() == 0, i, "rejected task ran");
      continue;
    }
    ++result.accepted;
    ++accepted_on[s.lane];
    expect(s.future->published(), i, "not published");
    expect(s.notifies.load() <= 1, i, "notified more than once");
    expect(!s.observer_saw_pending.load() || s.notifies.load() == 1, i,
           "observed while pending but never notified");
    expect(s.future->settled(), i, "never settled");
    const FutureStatus status = s.future->status();
    if (status == FutureStatus::Finished) {
      ++result.finished;
      if (s.kind == Kind::Device) ++result.device;
      expect(s.runs.load() == 1 && s.cancel_wins.load() == 0, i, "finished but ran != once");
      if (s.fails) {
        ++result.failed;
        expect(failure_of(*s.future) == task_failure(i), i, "failure lost");
      } else {
        expect(s.result == expected_result(i), i, "wrong result");
      }
    } else if (status == FutureStatus::Cancelled) {
      ++result.cancelled;
      expect(s.runs.load() == 0, i, "cancelled task ran");
      expect(s.cancel_wins.load() == 1, i, "cancelled, but not by exactly one canceller");
    } else {
      expect(false, i, "never resolved");
    }
  }
  CHECK(bad == 0);
  CHECK(result.accepted == quota);
  for (size_t l = 0; l < stats.size(); ++l) {
    // Every accepted task is accounted for once: completed or cancelled.
    CHECK(stats[l].submitted == accepted_on[l]);
    CHECK(stats[l].completed + stats[l].cancelled == stats[l].submitted);
    CHECK(stats[l].queued == 0 && stats[l].running == 0 && stats[l].on_device == 0);
  }
  return result;
}

}  // namespace

TEST_CASE("lane stress: producers, cancels, waits and shutdowns racing") {
  const uint64_t rounds = scaled(40, 8);
  const uint64_t quota = scaled(25'000, 200);
  RoundResult total;
  for (uint64_t r = 0; r < rounds; ++r) {
    const RoundResult got = run_round(static_cast<int>(r), quota);
    total.accepted += got.accepted;
    total.rejected += got.rejected;
    total.finished += got.finished;
    total.cancelled += got.cancelled;
    total.failed += got.failed;
    total.device += got.device;
  }
  std::printf("  STRESS tasks=%llu finished=%llu cancelled=%llu failed=%llu device=%llu "
              "rejected=%llu rounds=%llu\n",
              (unsigned long long)total.accepted, (unsigned long long)total.finished,
              (unsigned long long)total.cancelled, (unsigned long long)total.failed,
              (unsigned long long)total.device, (unsigned long long)total.rejected,
              (unsigned long long)rounds);
  CHECK(total.finished + total.cancelled == total.accepted);
}

TEST_CASE("lane stress: shutdown and join of one lane from many threads") {
  constexpr int kThreads = 4;
  const uint64_t iterations = scaled(2'000, 50);
  int failed_joins = 0;
  for (uint64_t it = 0; it < iterations; ++it) {
    Round round(8);
    auto lane = std::make_shared<Lane>(0, -1, round.gil, LaneOptions{0, 0});
    lane->start();
    for (int t = 0; t < 8; ++t) {
      const uint32_t i = round.new_slot();
      Slot& s = round.slot(i);
      s.kind = Kind::Native;
      s.future = lane->new_future();
      s.has_body = s.accepted = true;
      lane->submit(s.future, std::make_unique<StressTask>(round, i));
    }
    StartBarrier barrier(kThreads);
    std::atomic<int> joined{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        barrier.arrive_and_wait();
        shutdown_lane(round, *lane, (it + t) % 2 == 0);
        if (lane->join(t % 2 ? -1.0 : 30.0)) joined.fetch_add(1);
      });
    }
    for (auto& t : threads) t.join();
    failed_joins += kThreads - joined.load();
    for (uint32_t i = 0; i < 8; ++i) {
      Slot& s = round.slot(i);
      CHECK(s.future->published());
      CHECK(s.runs.load() + s.cancel_wins.load() == 1);
    }
    const LaneStats stats = lane->stats();
    CHECK(stats.completed + stats.cancelled == 8);
  }
  CHECK(failed_joins == 0);
}

TEST_CASE("future: concurrent cancels have exactly one winner") {
  // Only the canceller that made the transition notifies observers, so exactly one
  // try_cancel() may succeed; the status reads Cancelled for every caller afterwards.
  constexpr int kThreads = 4;
  const uint64_t iterations = scaled(20'000, 500);
  int bad = 0;
  for (uint64_t it = 0; it < iterations; ++it) {
    FutureState f(it);
    StartBarrier barrier(kThreads + 1);
    std::atomic<int> winners{0}, cancelled{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        barrier.arrive_and_wait();
        if (f.try_cancel()) winners.fetch_add(1);
        if (f.status() == FutureStatus::Cancelled) cancelled.fetch_add(1);
      });
    }
    barrier.arrive_and_wait();
    const bool started = it % 2 == 0 && f.try_start();
    for (auto& t : threads) t.join();
    if (started) {
      bad += winners.load() != 0 || cancelled.load() != 0;
    } else {
      bad += winners.load() != 1 || cancelled.load() != kThreads || !f.published();
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("lane stress: completions posted while the last owner lets go") {
  // The device posts a completion; the worker runs it, sees no more device work, exits
  // and destroys the lane, while the poster may still be inside post_internal.
  const uint64_t iterations = scaled(3'000, 100);
  for (uint64_t it = 0; it < iterations; ++it) {
    Round round(1);
    std::thread device([&round] { device_main(round, 1); });
    {
      auto lane = std::make_shared<Lane>(0, -1, round.gil, LaneOptions{0, 0});
      lane->start();
      Slot& s = round.slot(round.new_slot());
      s.kind = Kind::Device;
      s.future = lane->new_future();
      s.has_body = s.accepted = true;
      Entered entered(*round.gil);
      lane->submit(s.future, std::make_unique<StressTask>(round, 0));
      lane->shutdown(false);
    }  // the worker now owns the lane
    CHECK(round.slot(0).future->wait(-1, 0, kWaitSliceNs, nullptr));
    round.device.close();
    device.join();
    while (round.gil->exited.load() < 1) std::this_thread::yield();
    CHECK(round.releases_pending.load() == 0);
    CHECK(round.slot(0).result == expected_result(0));
  }
}
