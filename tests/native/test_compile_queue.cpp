#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/compile_queue.h"
#include "harness.h"

using namespace pydflash;

namespace {

CompileResult boxed(int value) { return std::make_shared<int>(value); }
int unboxed(const CompileResult& r) { return r ? *static_cast<int*>(r.get()) : -1; }

CompileOptions on(std::string slot, std::string label = "", double timeout_s = -1) {
  CompileOptions o;
  o.slot = std::move(slot);
  o.label = std::move(label);
  o.timeout_s = timeout_s;
  return o;
}

// Polls until `pred` holds. The bound only turns a hang into a failed CHECK.
template <typename Pred>
bool eventually(Pred pred) {
  for (int i = 0; i < 10000; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return pred();
}

const CompileFlightInfo* find_flight(const std::vector<CompileFlightInfo>& flights,
                                     const std::string& key) {
  for (const auto& f : flights) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

bool waiters_are(CompileQueue& q, const std::string& key, int n) {
  auto flights = q.in_flight();
  auto* f = find_flight(flights, key);
  return f != nullptr && f->waiters == n;
}

bool is_queued(CompileQueue& q, const std::string& key) {
  auto flights = q.in_flight();
  auto* f = find_flight(flights, key);
  return f != nullptr && !f->running;
}

bool is_running(CompileQueue& q, const std::string& key) {
  auto flights = q.in_flight();
  auto* f = find_flight(flights, key);
  return f != nullptr && f->running;
}

// Releases every thread at once so the calls really overlap.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void arrive_and_wait() {
    arrived_.fetch_add(1);
    while (arrived_.load() < n_) std::this_thread::yield();
  }

 private:
  const int n_;
  std::atomic<int> arrived_{0};
};

}  // namespace

TEST_CASE("compile queue: one holder per key, every caller gets its result") {
  constexpr int kThreads = 8;
  CompileQueue q;
  for (int round = 0; round < 100; ++round) {
    const std::string key = "k" + std::to_string(round);
    std::atomic<int> runs{0};
    std::vector<int> got(kThreads, 0);
    SpinBarrier barrier(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        barrier.arrive_and_wait();
        got[t] = unboxed(q.run(key, [&] {
          runs.fetch_add(1);
          // Hold the key until every other caller waits for it.
          CHECK(eventually([&] { return waiters_are(q, key, kThreads - 1); }));
          return boxed(round);
        }));
      });
    }
    for (auto& t : threads) t.join();
    CHECK(runs.load() == 1);
    CHECK(std::all_of(got.begin(), got.end(), [&](int v) { return v == round; }));
    auto s = q.stats()[key];
    CHECK(s.runs == 1);
    CHECK(s.shared == kThreads - 1);
    CHECK(s.waits == kThreads - 1);
    CHECK(s.max_wait_ns > 0 && s.wait_ns >= s.max_wait_ns);
    if (::pydflash::testing::failures_in_case() > 0) break;
  }
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: the holder's exception reaches every waiter") {
  constexpr int kThreads = 6;
  CompileQueue q;
  std::atomic<int> caught{0};
  SpinBarrier barrier(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      barrier.arrive_and_wait();
      try {
        q.run("bad", [&]() -> CompileResult {
          CHECK(eventually([&] { return waiters_are(q, "bad", kThreads - 1); }));
          throw std::runtime_error("boom");
        });
      } catch (const std::runtime_error& e) {
        if (std::string(e.what()) == "boom") caught.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(caught.load() == kThreads);
  CHECK(q.stats()["bad"].failures == 1);
  // A failed key is not cached: the next caller runs it again.
  CHECK(unboxed(q.run("bad", [] { return boxed(7); })) == 7);
}

TEST_CASE("compile queue: a slot serves its callers first come, first served") {
  CompileQueue q;
  std::atomic<bool> release{false};
  std::mutex order_mutex;
  std::vector<int> order;
  std::thread holder([&] {
    q.run(
        "first",
        [&] {
          while (!release.load()) std::this_thread::yield();
          return boxed(0);
        },
        on("cuda:0", "holder"));
  });
  CHECK(eventually([&] { return is_running(q, "first"); }));
  std::vector<std::thread> queued;
  for (int i = 1; i <= 5; ++i) {
    const std::string key = "next" + std::to_string(i);
    queued.emplace_back([&, i, key] {
      q.run(
          key,
          [&, i] {
            std::lock_guard<std::mutex> lock(order_mutex);
            order.push_back(i);
            return boxed(i);
          },
          on("cuda:0"));
    });
    // The next thread starts only once this one is in the slot's queue.
    CHECK(eventually([&] { return is_queued(q, key); }));
  }
  release = true;
  holder.join();
  for (auto& t : queued) t.join();
  CHECK((order == std::vector<int>{1, 2, 3, 4, 5}));
}

TEST_CASE("compile queue: other slots and slot-less keys do not wait for a held slot") {
  CompileQueue q;
  std::atomic<bool> release{false};
  std::thread holder([&] {
    q.run(
        "bench0",
        [&] {
          while (!release.load()) std::this_thread::yield();
          return boxed(0);
        },
        on("cuda:0"));
  });
  CHECK(eventually([&] { return is_running(q, "bench0"); }));
  // Both finish while cuda:0 is still held; a wrong wait would time out instead.
  CHECK(unboxed(q.run("bench1", [] { return boxed(1); }, on("cuda:1", "", 30))) == 1);
  CHECK(unboxed(q.run("jit", [] { return boxed(2); }, on("", "", 30))) == 2);
  CHECK(is_running(q, "bench0"));
  release = true;
  holder.join();
}

TEST_CASE("compile queue: the holder re-enters its key and its slot") {
  CompileQueue q;
  int depth = 0;
  int result = unboxed(q.run(
      "outer",
      [&] {
        ++depth;
        int same = unboxed(q.run("outer", [&] { return boxed(10); }, on("cuda:0")));
        int inner = unboxed(q.run(
            "inner",
            [&] {
              int innermost = unboxed(q.run("innermost", [&] { return boxed(1); }, on("cuda:0")));
              return boxed(100 + innermost);
            },
            on("cuda:0")));
        return boxed(same + inner);
      },
      on("cuda:0", "", 30)));
  CHECK(depth == 1);
  CHECK(result == 111);
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: the slot's owner takes over a key queued for its slot") {
  CompileQueue q;
  std::thread::id ran_on;
  int queued_got = 0;
  std::thread queued;
  const int outer = unboxed(q.run(
      "outer",
      [&] {
        queued = std::thread([&] {
          queued_got = unboxed(q.run(
              "shared",
              [&] {
                ran_on = std::this_thread::get_id();
                return boxed(5);
              },
              on("cuda:0", "queued")));
        });
        CHECK(eventually([&] { return is_queued(q, "shared"); }));
        // Without the take-over this would wait for the queued thread, which waits for us.
        return q.run(
            "shared",
            [&] {
              ran_on = std::this_thread::get_id();
              return boxed(6);
            },
            on("cuda:0", "owner", 30));
      },
      on("cuda:0", "owner")));
  queued.join();
  CHECK(outer == 6);
  CHECK(ran_on == std::this_thread::get_id());
  CHECK(queued_got == 6);
  CHECK(q.stats()["shared"].shared == 1);
}

TEST_CASE("compile queue: a timeout names the key, its holder and for how long") {
  CompileQueue q;
  std::atomic<bool> release{false};
  std::thread holder([&] {
    q.run(
        "slow-key",
        [&] {
          while (!release.load()) std::this_thread::yield();
          return boxed(0);
        },
        on("cuda:3", "lane 2 (cuda:3)"));
  });
  CHECK(eventually([&] { return is_running(q, "slow-key"); }));
  std::string message;
  try {
    q.run("slow-key", [] { return boxed(1); }, on("cuda:3", "main", 0.05));
  } catch (const CompileQueueTimeout& e) {
    message = e.what();
  }
  CHECK(message.find("'slow-key'") != std::string::npos);
  CHECK(message.find("held by lane 2 (cuda:3) for ") != std::string::npos);
  CHECK(message.find("waited 0.") != std::string::npos);
  std::string slot_message;
  try {
    q.run("other-key", [] { return boxed(1); }, on("cuda:3", "main", 0.05));
  } catch (const CompileQueueTimeout& e) {
    slot_message = e.what();
  }
  CHECK(slot_message.find("cuda:3 slot to run 'other-key'") != std::string::npos);
  CHECK(slot_message.find("held by lane 2 (cuda:3) running 'slow-key'") != std::string::npos);
  // The default timeout applies when the call sets none.
  q.set_default_timeout(0.05);
  CHECK_THROWS_AS(q.run("slow-key", [] { return boxed(1); }), CompileQueueTimeout);
  q.set_default_timeout(-1);
  release = true;
  holder.join();
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: an interrupted waiter leaves; the holder is unaffected") {
  CompileQueue q;
  std::atomic<bool> release{false};
  std::thread holder([&] {
    q.run("k", [&] {
      while (!release.load()) std::this_thread::yield();
      return boxed(3);
    });
  });
  CHECK(eventually([&] { return is_running(q, "k"); }));
  int polls = 0;
  CHECK_THROWS_AS(q.run(
                      "k", [] { return boxed(1); }, {}, [&] { return ++polls == 3; }),
                  CompileQueueInterrupted);
  CHECK(polls == 3);
  CHECK(waiters_are(q, "k", 0));
  release = true;
  holder.join();
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: a holder that gives up hands its key to a waiter") {
  CompileQueue q;
  std::atomic<bool> release{false};
  std::atomic<bool> give_up{false};
  std::thread owner([&] {
    q.run(
        "busy",
        [&] {
          while (!release.load()) std::this_thread::yield();
          return boxed(0);
        },
        on("cuda:0", "owner"));
  });
  CHECK(eventually([&] { return is_running(q, "busy"); }));
  bool first_interrupted = false;
  std::thread first([&] {
    try {
      q.run("k", [] { return boxed(1); }, on("cuda:0", "first"), [&] { return give_up.load(); });
    } catch (const CompileQueueInterrupted&) {
      first_interrupted = true;
    }
  });
  CHECK(eventually([&] { return is_queued(q, "k"); }));
  int second_got = 0;
  std::thread second(
      [&] { second_got = unboxed(q.run("k", [] { return boxed(2); }, on("cuda:0", "second"))); });
  CHECK(eventually([&] { return waiters_are(q, "k", 1); }));
  give_up = true;
  first.join();
  CHECK(first_interrupted);
  release = true;
  owner.join();
  second.join();
  CHECK(second_got == 2);

  // Interrupted while running: the waiter runs the work itself instead of failing.
  std::atomic<bool> interrupt_holder{false};
  int waiter_got = 0;
  std::thread holder([&] {
    try {
      q.run("k2", [&]() -> CompileResult {
        CHECK(eventually([&] { return interrupt_holder.load(); }));
        throw CompileQueueInterrupted();
      });
    } catch (const CompileQueueInterrupted&) {
    }
  });
  CHECK(eventually([&] { return is_running(q, "k2"); }));
  std::thread waiter([&] { waiter_got = unboxed(q.run("k2", [] { return boxed(9); })); });
  CHECK(eventually([&] { return waiters_are(q, "k2", 1); }));
  interrupt_holder = true;
  holder.join();
  waiter.join();
  CHECK(waiter_got == 9);
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: a wait that closes a cycle raises instead of hanging") {
  CompileQueue q;
  std::string deadlock;
  std::atomic<bool> b_running{false};
  std::thread b;
  // A owns the cuda:0 slot and waits for key "b"; B runs "b" and then needs cuda:0.
  std::string a_error;
  try {
    q.run(
        "a",
        [&]() -> CompileResult {
          b = std::thread([&] {
            try {
              q.run(
                  "b",
                  [&] {
                    b_running = true;
                    CHECK(eventually([&] { return waiters_are(q, "b", 1); }));
                    return q.run("c", [] { return boxed(1); }, on("cuda:0", "thread B"));
                  },
                  on("", "thread B"));
            } catch (const CompileQueueDeadlock& e) {
              deadlock = e.what();
            }
          });
          CHECK(eventually([&] { return b_running.load(); }));
          return q.run("b", [] { return boxed(2); }, on("", "thread A"));
        },
        on("cuda:0", "thread A"));
  } catch (const CompileQueueDeadlock& e) {
    a_error = e.what();
    // B holds the same exception object: let it finish with it before this one is
    // dropped (ThreadSanitizer cannot see libstdc++'s exception reference count).
    b.join();
  }
  if (b.joinable()) b.join();
  CHECK(deadlock.find("thread B waiting for the cuda:0 slot to run 'c' would deadlock") !=
        std::string::npos);
  CHECK(a_error == deadlock);  // B's failure fans out to its waiter, A
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: keys stay single-flight and slots exclusive under load") {
  constexpr int kThreads = 8;
  constexpr int kCalls = 400;
  const std::vector<std::string> slots{"", "cuda:0", "cuda:1"};
  CompileQueue q;
  std::atomic<int> running_per_key[6] = {};
  std::atomic<int> running_per_slot[3] = {};
  std::atomic<int> violations{0};
  std::atomic<int> bad_results{0};
  SpinBarrier barrier(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      barrier.arrive_and_wait();
      for (int i = 0; i < kCalls; ++i) {
        const int k = static_cast<int>(rng() % 6);
        const int s = k % 3;  // a key always asks for the same slot
        CompileResult r = q.run(
            "key" + std::to_string(k),
            [&] {
              if (running_per_key[k].fetch_add(1) != 0) violations.fetch_add(1);
              if (s != 0 && running_per_slot[s].fetch_add(1) != 0) violations.fetch_add(1);
              std::this_thread::yield();
              if (s != 0) running_per_slot[s].fetch_sub(1);
              running_per_key[k].fetch_sub(1);
              return boxed(k);
            },
            on(slots[s]));
        if (unboxed(r) != k) bad_results.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(violations.load() == 0);
  CHECK(bad_results.load() == 0);
  uint64_t calls = 0;
  for (const auto& [key, s] : q.stats()) calls += s.runs + s.shared;
  CHECK(calls == static_cast<uint64_t>(kThreads) * kCalls);
  CHECK(q.in_flight().empty());
}

TEST_CASE("compile queue: bad arguments are value errors") {
  CompileQueue q;
  CHECK_THROWS_AS(q.run("", [] { return boxed(1); }), ValueError);
  CHECK_THROWS_AS(q.run("k", std::function<CompileResult()>()), ValueError);
}
