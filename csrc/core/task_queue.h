// A FIFO of tasks for one lane worker: many producers, one consumer. The consumer
// polls briefly before sleeping while a core is free for it, and producers skip the
// wake-up syscall while it polls.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "core/clock.h"
#include "core/spin.h"

namespace pydflash {

template <typename T>
class TaskQueue {
 public:
  /// False when the queue is closed; the item is not taken then.
  bool push(T item) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_.load(std::memory_order_relaxed)) return false;
      items_.push_back(std::move(item));
      size_.store(items_.size(), std::memory_order_relaxed);
    }
    // The consumer sets sleeping_ under the mutex before it waits, and this push took
    // the mutex after: it sees the flag.
    if (sleeping_.load(std::memory_order_relaxed)) cv_.notify_one();
    return true;
  }

  /// Pushes even when closed: completions of work already started must still arrive.
  void push_internal(T item) {
    // Notifies under the lock: the poster (a device callback) holds no reference to
    // the queue's owner, whose consumer may run this item, exit and destroy the queue
    // as soon as the lock is free.
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(std::move(item));
    size_.store(items_.size(), std::memory_order_relaxed);
    cv_.notify_one();
  }

  /// A hint first, without the lock: a stale zero only defers the item to the next poll
  /// or to pop_wait's check under the lock.
  bool try_pop(T& out) {
    if (size_.load(std::memory_order_relaxed) == 0) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    return pop_locked(out);
  }

  /// Blocks until an item arrives or `stop()` says the consumer may leave; polls for
  /// spin_ns first, or not at all once the queue is closed. Returns false when it left
  /// without an item. `slept`, if given, says whether the poll ran out.
  template <typename StopFn>
  bool pop_wait(T& out, int64_t spin_ns, StopFn stop, bool* slept = nullptr) {
    if (slept != nullptr) *slept = false;
    consumer_waiting_.store(true, std::memory_order_relaxed);
    // Note [Polling only on a free core] (core/spin.h).
    bool got = false;
    if (spin_ns > 0) {
      poll_while_cores_free(now_ns() + spin_ns, [&] {
        return (got = try_pop(out)) || closed_.load(std::memory_order_relaxed);
      });
    }
    if (got) return true;
    if (slept != nullptr) *slept = true;
    std::unique_lock<std::mutex> lock(mutex_);
    sleeping_.store(true, std::memory_order_relaxed);
    cv_.wait(lock, [&] { return !items_.empty() || stop_locked(stop); });
    sleeping_.store(false, std::memory_order_relaxed);
    return pop_locked(out);
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

  /// Wakes the consumer to re-check its stop condition.
  void wake() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
    }
    cv_.notify_all();
  }

  /// A hint for callers (push decides under the lock): no lock on the submit path.
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  std::size_t size() const { return size_.load(std::memory_order_relaxed); }

  /// Removes everything queued, in order. With `spare_awaited`, leaves the first item
  /// when the consumer holds none (it waits in pop_wait, or has not started): it takes
  /// that one next.
  std::vector<T> take_all(bool spare_awaited = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t kept =
        spare_awaited && consumer_waiting_.load(std::memory_order_relaxed) && !items_.empty();
    std::vector<T> out;
    out.reserve(items_.size() - kept);
    for (std::size_t i = kept; i < items_.size(); ++i) out.push_back(std::move(items_[i]));
    items_.resize(kept);
    size_.store(kept, std::memory_order_relaxed);
    return out;
  }

 private:
  bool pop_locked(T& out) {
    if (items_.empty()) return false;
    consumer_waiting_.store(false, std::memory_order_relaxed);  // read under the lock
    out = std::move(items_.front());
    items_.pop_front();
    size_.store(items_.size(), std::memory_order_relaxed);
    return true;
  }

  template <typename StopFn>
  bool stop_locked(StopFn& stop) {
    return closed_.load(std::memory_order_relaxed) && stop();
  }

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<T> items_;
  std::atomic<std::size_t> size_{0};
  std::atomic<bool> sleeping_{false};
  // In pop_wait without an item, or not started yet. Set by the consumer; cleared under
  // the lock as it pops.
  std::atomic<bool> consumer_waiting_{true};
  std::atomic<bool> closed_{false};  // written under mutex_
};

}  // namespace pydflash
