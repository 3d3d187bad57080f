#include "core/compile_queue.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

#include "core/clock.h"

namespace pydflash {

struct CompileQueue::Flight {
  std::string key;
  std::string slot;
  std::thread::id holder;  // default id: unclaimed, a waiter will take it
  std::string holder_label;
  bool running = false;
  bool done = false;
  int64_t since_ns = 0;
  int waiters = 0;
  CompileResult result;
  std::exception_ptr error;
};

namespace {

std::string seconds(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ns) * 1e-9);
  return buf;
}

std::string thread_name(const std::string& label) {
  return label.empty() ? "an unnamed thread" : label;
}

}  // namespace

CompileQueue& CompileQueue::instance() {
  // Leaked on purpose: threads may still use it during static destruction.
  static CompileQueue* queue = new CompileQueue();
  return *queue;
}

void CompileQueue::set_default_timeout(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  default_timeout_s_ = seconds;
}

double CompileQueue::default_timeout() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return default_timeout_s_;
}

std::map<std::string, CompileKeyStats> CompileQueue::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void CompileQueue::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.clear();
}

std::vector<CompileFlightInfo> CompileQueue::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<CompileFlightInfo> out;
  out.reserve(flights_.size());
  for (const auto& [key, f] : flights_) {
    out.push_back({key, f->slot, f->holder == std::thread::id() ? "" : f->holder_label, f->running,
                   f->since_ns, f->waiters});
  }
  return out;
}

CompileResult CompileQueue::run(const std::string& key, const std::function<CompileResult()>& work,
                                const CompileOptions& options,
                                const std::function<bool()>& interrupted) {
  PYDFLASH_CHECK_VALUE(!key.empty(), "expected a non-empty compile-queue key, got ''");
  PYDFLASH_CHECK_VALUE(static_cast<bool>(work), "expected work to run for key '", key,
                       "', got an empty function");
  const int64_t start = now_ns();
  Lock lock(mutex_);
  const double timeout = options.timeout_s >= 0 ? options.timeout_s : default_timeout_s_;
  const int64_t deadline = timeout < 0 ? INT64_MAX : deadline_after(start, timeout);
  Call call{key, work, options, interrupted, start, deadline};
  auto it = flights_.find(key);
  if (it == flights_.end()) {
    auto flight = std::make_shared<Flight>();
    flight->key = key;
    flight->slot = options.slot;
    flight->holder = std::this_thread::get_id();
    flight->holder_label = options.label;
    flight->since_ns = start;
    flights_.emplace(key, flight);
    return run_as_holder(lock, flight, call);
  }
  std::shared_ptr<Flight> flight = it->second;
  if (flight->holder == std::this_thread::get_id()) {
    // Re-entry: this thread is running `key` further up its stack.
    lock.unlock();
    return work();
  }
  return wait_for_outcome(lock, flight, call);
}

CompileResult CompileQueue::run_as_holder(Lock& lock, const std::shared_ptr<Flight>& flight,
                                          Call& call) {
  if (!flight->slot.empty() && !acquire_slot(lock, flight, call)) {
    return wait_for_outcome(lock, flight, call);  // taken over by the slot's owner
  }
  const int64_t began = now_ns();
  if (call.blocked) record_wait_locked(call, began);
  flight->running = true;
  flight->since_ns = began;
  lock.unlock();

  CompileResult result;
  std::exception_ptr error;
  bool interrupted = false;
  try {
    result = call.work();
  } catch (const CompileQueueInterrupted&) {
    // The holder was interrupted, not the work's outcome: a waiter runs it instead.
    error = std::current_exception();
    interrupted = true;
#if defined(__GLIBCXX__)
  } catch (abi::__forced_unwind&) {
    throw;  // the thread is being ended (pthread_exit): never swallowed
#endif
  } catch (...) {
    error = std::current_exception();
  }
  const int64_t ended = now_ns();

  lock.lock();
  if (!flight->slot.empty()) release_slot_locked(flight->slot);
  auto& stats = stats_[flight->key];
  ++stats.runs;
  stats.run_ns += ended - began;
  if (interrupted) {
    abandon_locked(flight, /*keep_turn=*/true);
  } else {
    if (error) ++stats.failures;
    flight->done = true;
    flight->result = result;
    flight->error = error;
    auto it = flights_.find(flight->key);
    if (it != flights_.end() && it->second == flight) flights_.erase(it);
  }
  lock.unlock();
  cv_.notify_all();
  if (error) std::rethrow_exception(error);
  return result;
}

bool CompileQueue::acquire_slot(Lock& lock, const std::shared_ptr<Flight>& flight, Call& call) {
  const auto me = std::this_thread::get_id();
  Slot& slot = slots_[flight->slot];  // node-based map: the reference stays valid
  auto& queue = slot.queue;
  auto take = [&] {
    auto pos = std::find(queue.begin(), queue.end(), flight);
    if (pos != queue.end()) queue.erase(pos);
    if (slot.depth++ == 0) {
      slot.owner = me;
      slot.owner_label = call.options.label;
      slot.owner_key = flight->key;
      slot.since_ns = now_ns();
    }
  };
  if (slot.depth > 0 && slot.owner == me) {  // re-entry: the owner never queues
    take();
    return true;
  }
  if (std::find(queue.begin(), queue.end(), flight) == queue.end()) queue.push_back(flight);
  if (slot.depth == 0 && queue.front() == flight) {
    take();
    return true;
  }
  blocked_[me] = Blocked{flight, flight->slot};
  call.blocked = true;
  try {
    check_deadlock_locked(slot.owner, call, "the " + flight->slot + " slot");
    for (;;) {
      if (flight->holder != me) {  // the slot's owner took the flight over
        blocked_.erase(me);
        return false;
      }
      if (slot.depth == 0 && queue.front() == flight) {
        blocked_.erase(me);
        take();
        return true;
      }
      if (!wait_slice(lock, call)) {
        const int64_t now = now_ns();
        throw CompileQueueTimeout(detail::str(
            "compile queue: waited ", seconds(now - call.start_ns), " for the ", flight->slot,
            " slot to run '", flight->key, "'; the slot is held by ", thread_name(slot.owner_label),
            " running '", slot.owner_key, "' for ", seconds(now - slot.since_ns), ", with ",
            queue.size() - 1,
            " other flight(s) queued (pydflash.compile_queue.set_timeout changes the limit)"));
      }
    }
  } catch (...) {
    blocked_.erase(me);
    if (flight->holder == me) abandon_locked(flight, /*keep_turn=*/true);
    throw;
  }
}

void CompileQueue::release_slot_locked(const std::string& name) {
  Slot& slot = slots_[name];
  PYDFLASH_INTERNAL_ASSERT(slot.depth > 0 && slot.owner == std::this_thread::get_id());
  if (--slot.depth == 0) {
    slot.owner = std::thread::id();
    slot.owner_label.clear();
    slot.owner_key.clear();
  }
}

void CompileQueue::abandon_locked(const std::shared_ptr<Flight>& flight, bool keep_turn) {
  flight->holder = std::thread::id();
  flight->holder_label.clear();
  flight->running = false;
  if (flight->waiters == 0) {
    drop_if_orphaned_locked(flight);
  } else if (!flight->slot.empty()) {
    auto& queue = slots_[flight->slot].queue;
    if (keep_turn && std::find(queue.begin(), queue.end(), flight) == queue.end()) {
      queue.push_front(flight);  // it had its turn already
    }
  }
  cv_.notify_all();
}

void CompileQueue::drop_if_orphaned_locked(const std::shared_ptr<Flight>& flight) {
  if (flight->done || flight->waiters > 0 || flight->holder != std::thread::id()) return;
  if (!flight->slot.empty()) {
    auto& queue = slots_[flight->slot].queue;
    auto pos = std::find(queue.begin(), queue.end(), flight);
    if (pos != queue.end()) queue.erase(pos);
  }
  auto it = flights_.find(flight->key);
  if (it != flights_.end() && it->second == flight) flights_.erase(it);
  cv_.notify_all();
}

CompileResult CompileQueue::wait_for_outcome(Lock& lock, const std::shared_ptr<Flight>& flight,
                                             Call& call) {
  const auto me = std::this_thread::get_id();
  if (!flight->running && !flight->slot.empty()) {
    auto owned = slots_.find(flight->slot);
    if (owned != slots_.end() && owned->second.depth > 0 && owned->second.owner == me) {
      // Queued for the slot this thread owns: it would wait for us. Run it here.
      flight->holder = me;
      flight->holder_label = call.options.label;
      cv_.notify_all();  // its first caller becomes a waiter
      return run_as_holder(lock, flight, call);
    }
  }
  ++flight->waiters;
  blocked_[me] = Blocked{flight, ""};
  auto leave = [&] {
    --flight->waiters;
    blocked_.erase(me);
  };
  bool take_over = false;
  try {
    check_deadlock_locked(flight->holder, call, "'" + flight->key + "'");
    while (!flight->done) {
      if (flight->holder == std::thread::id()) {  // its holder left: take it
        take_over = true;
        break;
      }
      call.blocked = true;
      if (!wait_slice(lock, call)) {
        throw CompileQueueTimeout(
            detail::str("compile queue: waited ", seconds(now_ns() - call.start_ns), " for '",
                        flight->key, "', ", describe_locked(*flight, now_ns()),
                        " (pydflash.compile_queue.set_timeout changes the limit)"));
      }
    }
  } catch (...) {
    leave();
    drop_if_orphaned_locked(flight);
    throw;
  }
  leave();
  if (take_over) {
    // Outside the try: when the work throws, run_as_holder rethrows with the lock
    // released, and the handler above would leave() a second time, unlocked.
    flight->holder = me;
    flight->holder_label = call.options.label;
    return run_as_holder(lock, flight, call);
  }
  auto& stats = stats_[flight->key];
  ++stats.shared;
  if (call.blocked) record_wait_locked(call, now_ns());
  CompileResult result = flight->result;
  std::exception_ptr error = flight->error;
  lock.unlock();
  if (error) std::rethrow_exception(error);
  return result;
}

bool CompileQueue::wait_slice(Lock& lock, Call& call) {
  const int64_t now = now_ns();
  if (now >= call.deadline_ns) return false;
  const int64_t slice = std::min(kPollSliceNs, call.deadline_ns - now);
  cv_.wait_for(lock, std::chrono::nanoseconds(slice));
  if (call.interrupted) {
    // Unlocked: the callback may take the GIL, whose holder may be waiting for our lock.
    lock.unlock();
    const bool stop = call.interrupted();
    lock.lock();
    if (stop) throw CompileQueueInterrupted();
  }
  return true;
}

void CompileQueue::check_deadlock_locked(std::thread::id waited_for, const Call& call,
                                         const std::string& what) const {
  const auto me = std::this_thread::get_id();
  std::thread::id t = waited_for;
  // Each thread blocks on one thing at a time, so the wait-for graph is a chain.
  for (std::size_t step = 0; step <= blocked_.size() && t != std::thread::id(); ++step) {
    if (t == me) {
      throw CompileQueueDeadlock(
          detail::str("compile queue: ", thread_name(call.options.label), " waiting for ", what,
                      " to run '", call.key,
                      "' would deadlock: its holder waits, directly or through other threads, for "
                      "a key or slot that ",
                      thread_name(call.options.label), " holds"));
    }
    auto b = blocked_.find(t);
    if (b == blocked_.end()) return;
    if (!b->second.slot.empty()) {
      auto s = slots_.find(b->second.slot);
      t = (s != slots_.end() && s->second.depth > 0) ? s->second.owner : std::thread::id();
    } else {
      t = b->second.flight->holder;
    }
  }
}

std::string CompileQueue::describe_locked(const Flight& flight, int64_t now) const {
  if (flight.holder == std::thread::id()) return "which has no holder yet (its first caller left)";
  if (flight.running) {
    return detail::str("held by ", thread_name(flight.holder_label), " for ",
                       seconds(now - flight.since_ns));
  }
  auto s = slots_.find(flight.slot);
  const bool owned = s != slots_.end() && s->second.depth > 0;
  return detail::str("queued by ", thread_name(flight.holder_label), " ",
                     seconds(now - flight.since_ns), " ago for the ", flight.slot, " slot",
                     owned ? detail::str(", which ", thread_name(s->second.owner_label),
                                         " holds running '", s->second.owner_key, "' for ",
                                         seconds(now - s->second.since_ns))
                           : std::string());
}

void CompileQueue::record_wait_locked(Call& call, int64_t until_ns) {
  auto& stats = stats_[call.key];
  const int64_t waited = until_ns - call.start_ns;
  ++stats.waits;
  stats.wait_ns += waited;
  stats.max_wait_ns = std::max(stats.max_wait_ns, waited);
  call.blocked = false;  // counted once per call
}

}  // namespace pydflash
