#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include <atomic>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/future.h"
#include "core/spin.h"
#include "core/task_queue.h"
#include "harness.h"

using namespace pydflash;

TEST_CASE("future: cancel only while pending") {
  FutureState f(1);
  CHECK(f.try_cancel());
  CHECK(!f.try_cancel());  // once: the second caller does not notify again
  CHECK(f.status() == FutureStatus::Cancelled);
  CHECK(!f.try_start());
  CHECK(f.published());
  FutureState g(2);
  CHECK(g.try_start());
  CHECK(!g.try_cancel());
  CHECK(!g.done());
}

TEST_CASE("future: wait times out, then sees the publish") {
  FutureState f(1);
  CHECK(f.try_start());
  CHECK(!f.wait(0.01, 1000, 1'000'000, nullptr));
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    f.finish();
    f.publish();
  });
  CHECK(f.wait(-1, 0, 1'000'000, nullptr));
  t.join();
  CHECK(f.status() == FutureStatus::Finished);
}

TEST_CASE("future: an observer and the finisher never both miss each other") {
  // Note [Observed futures]: either the finisher sees `observed`, or the observer sees
  // the finished status; run the race many times on a barrier.
  for (int i = 0; i < 20000; ++i) {
    FutureState f(i);
    f.try_start();
    std::atomic<int> go{0};
    bool finisher_saw = false, observer_saw = false;
    std::thread finisher([&] {
      go.fetch_add(1);
      while (go.load() < 2) {
      }
      finisher_saw = f.finish();
    });
    std::thread observer([&] {
      go.fetch_add(1);
      while (go.load() < 2) {
      }
      f.mark_observed();
      observer_saw = f.done();
    });
    finisher.join();
    observer.join();
    CHECK(finisher_saw || observer_saw);
    // Settled at once exactly when nobody is left to notify.
    CHECK(f.settled() == !finisher_saw);
  }
}

TEST_CASE("future: an observed future is settled once its observers were told") {
  FutureState watched(1);
  watched.mark_observed();
  CHECK(watched.try_start());
  CHECK(!watched.settled());
  CHECK(watched.finish());  // the finisher must notify
  CHECK(watched.done() && !watched.settled());
  watched.mark_notified();
  CHECK(watched.settled());

  FutureState unwatched(2);
  CHECK(unwatched.try_start());
  CHECK(!unwatched.finish());
  CHECK(unwatched.settled());
  unwatched.mark_observed();  // observed after it finished: nobody will notify
  CHECK(unwatched.settled() && unwatched.observed());

  FutureState cancelled(3);
  cancelled.mark_observed();
  CHECK(cancelled.try_cancel());
  CHECK(cancelled.status() == FutureStatus::Cancelled && !cancelled.settled());
  cancelled.mark_notified();
  CHECK(cancelled.settled());
}

TEST_CASE("queue: many producers, FIFO per producer, nothing lost") {
  TaskQueue<int> q;
  constexpr int kProducers = 8, kEach = 20000;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p)
    producers.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i) q.push(p * kEach + i);
    });
  std::vector<int> last(kProducers, -1);
  int got = 0;
  bool ordered = true;
  while (got < kProducers * kEach) {
    int v;
    if (!q.pop_wait(v, 1000, [] { return true; })) continue;
    const int p = v / kEach, i = v % kEach;
    ordered = ordered && i == last[p] + 1;
    last[p] = i;
    ++got;
  }
  for (auto& t : producers) t.join();
  CHECK(ordered);
  CHECK(got == kProducers * kEach);
  q.close();
  CHECK(!q.push(1));
}

TEST_CASE("spin: a poll whose core is taken stops at once, and polls sleep for a while") {
#ifdef __linux__
  // Note [Polling only on a free core]: this thread and a busy one share one core, so
  // the poll's first yield runs the busy thread for its time slice.
  cpu_set_t before, one;
  CHECK(pthread_getaffinity_np(pthread_self(), sizeof(before), &before) == 0);
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  std::atomic<bool> spinning{false}, stop{false};
  std::thread busy([&] {
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    spinning.store(true);
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof(one), &one) == 0);
  while (!spinning.load()) std::this_thread::yield();
  const int64_t start = now_ns();
  const bool ready = poll_while_cores_free(start + 10'000'000'000, [] { return false; });
  const int64_t polled = now_ns() - start;
  const bool sleeping = !cores_free();
  stop.store(true);
  busy.join();
  pthread_setaffinity_np(pthread_self(), sizeof(before), &before);
  CHECK(!ready);
  CHECK(polled < 5'000'000'000);  // at the first late yield, long before the deadline
  CHECK(sleeping);                // the polls that follow sleep at once
#endif
}
