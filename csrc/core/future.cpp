#include "core/future.h"

#include <chrono>

#include "core/clock.h"
#include "core/device_quiet.h"
#include "core/error.h"
#include "core/event_pool.h"
#include "core/fork.h"
#include "core/spin.h"

namespace pydflash {

FutureState::FutureState(uint64_t id) : id_(id), fork_generation_(fork_generation()) {}

bool FutureState::made_before_fork() const { return fork_generation() != fork_generation_; }

FutureState::~FutureState() {
  if (event_ != nullptr) event_pool::give(event_device_, event_);
}

// Note [Deferred result events] (future.h): recorded on demand, after the task's end.
void* FutureState::event_recorded_now() {
  if (status() != FutureStatus::Finished) return nullptr;  // the worker may still set it
  if (event_ == nullptr && deferred_stream_ != nullptr) {
    void* event = event_pool::take(event_device_);
    event_pool::record(event_device_, event, deferred_stream_);
    event_ = event;
    deferred_stream_ = nullptr;
  }
  return event_;
}

bool FutureState::transition(FutureStatus from, FutureStatus to, uint32_t* before) {
  uint32_t word = word_.load(std::memory_order_seq_cst);
  while (status_of(word) == from) {
    const uint32_t next = (word & ~kStatusMask) | static_cast<uint32_t>(to);
    if (word_.compare_exchange_weak(word, next, std::memory_order_seq_cst)) {
      if (before != nullptr) *before = word;
      return true;
    }
  }
  return false;
}

bool FutureState::try_start() { return transition(FutureStatus::Pending, FutureStatus::Running); }

bool FutureState::try_cancel() {
  if (!transition(FutureStatus::Pending, FutureStatus::Cancelled)) return false;
  publish();
  return true;
}

bool FutureState::finish() {
  uint32_t before = 0;
  PYDFLASH_INTERNAL_ASSERT(transition(FutureStatus::Running, FutureStatus::Finished, &before));
  return (before & kObserved) != 0;
}

void FutureState::mark_observed() {
  // Observed after it completed: nobody will notify, so it is settled now.
  uint32_t word = word_.load(std::memory_order_seq_cst);
  while (!word_.compare_exchange_weak(word, word | kObserved | (is_done(word) ? kNotified : 0),
                                      std::memory_order_seq_cst)) {
  }
}

void FutureState::publish() {
  published_.store(true, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    // Taking the mutex orders this notify after a sleeper's check.
    std::lock_guard<std::mutex> lock(mutex_);
    cv_.notify_all();
  }
}

bool FutureState::wait(double timeout_s, int64_t spin_ns, int64_t slice_ns,
                       const std::function<bool()>& interrupted) {
  if (done()) return true;
  // Note [Quiet device for capture]: a lane waiting here counts as paused, and pauses
  // before it returns while another lane holds its device quiet.
  QuietWait quiet_wait;
  const int64_t start = now_ns();
  const bool forever = timeout_s < 0;
  const int64_t deadline = forever ? INT64_MAX : deadline_after(start, timeout_s);
  // Note [Polling only on a free core] (core/spin.h).
  bool got =
      poll_while_cores_free(std::min(deadline, start + spin_ns), [&] { return published(); });
  while (!got) {
    const int64_t now = now_ns();
    if (now >= deadline) return false;
    const int64_t slice = std::min(slice_ns, deadline - now);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait_for(lock, std::chrono::nanoseconds(slice), [&] { return published(); });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
    got = published();
    if (!got && interrupted && interrupted()) return false;
  }
  // Note [Finish, then publish]: give the producer a moment to let the interpreter go.
  if (producer_in_interpreter_ != nullptr && spin_ns > 0) {
    poll_while_cores_free(now_ns() + spin_ns, [&] {
      return !producer_in_interpreter_->load(std::memory_order_acquire);
    });
  }
  return true;
}

}  // namespace pydflash
