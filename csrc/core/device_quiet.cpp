#include "core/device_quiet.h"

#include <pthread.h>

#include <chrono>

#include "core/clock.h"
#include "core/error.h"

namespace pydflash {
namespace {

// The devices of one process. Never destroyed: lanes' workers may still use theirs
// while static destructors run.
struct Registry {
  std::mutex mutex;
  std::vector<QuietDevice*> devices;
};

std::atomic<Registry*> current_registry{nullptr};

// The quiet device and membership of the lane whose worker this thread is (QuietWait).
thread_local QuietDevice* bound_device = nullptr;
thread_local QuietMember* bound_member = nullptr;

// Longer timeouts (infinity included) wait forever: a deadline this far overflows the clock.
constexpr double kForeverS = 1e9;

Registry& registry() {
  static const bool made = [] {
    current_registry.store(new Registry, std::memory_order_release);
    // A forked child has one thread: the parent's registry may be locked by a thread that
    // does not exist there, and its quiets belong to lanes that do not run there. The
    // child starts afresh and leaks the parent's.
    // The forking thread, the child's one, is no lane's worker there either.
    pthread_atfork(nullptr, nullptr, [] {
      current_registry.store(new Registry, std::memory_order_release);
      bound_device = nullptr;
      bound_member = nullptr;
    });
    return true;
  }();
  (void)made;
  return *current_registry.load(std::memory_order_acquire);
}

}  // namespace

QuietDevice& QuietDevice::of(int device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (QuietDevice* d : r.devices)
    if (d->device() == device) return *d;
  r.devices.push_back(new QuietDevice(device));
  return *r.devices.back();
}

void QuietDevice::join(QuietMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  members_.push_back(&member);
}

void QuietDevice::leave(QuietMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (holder_ == &member) end_locked();
  for (auto it = members_.begin(); it != members_.end(); ++it) {
    if (*it == &member) {
      members_.erase(it);
      break;
    }
  }
  cv_.notify_all();  // a holder may be waiting for this member
}

void QuietDevice::pause(QuietMember& member) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (holder_ == &member) {
    // The task that took the quiet has ended without ending it: a quiet never outlives
    // its task.
    depth_ = 0;
    end_locked();
    return;
  }
  if (holder_ == nullptr) return;
  const int64_t start = now_ns();
  member.paused = true;
  ++member.pauses;
  cv_.notify_all();  // the holder may be waiting for this member
  // Through a handover from one holder to a waiting one, too: still paused.
  cv_.wait(lock, [&] { return holder_ == nullptr; });
  member.paused = false;
  member.paused_ns += now_ns() - start;
}

bool QuietDevice::others_paused(const QuietMember& holder) const {
  for (const QuietMember* m : members_) {
    if (m != &holder && !m->paused && !m->waiting && !m->blocked.load(std::memory_order_seq_cst))
      return false;
  }
  return true;
}

bool QuietDevice::quiesce(QuietMember& member, double timeout_s) {
  const int64_t start = now_ns();
  std::unique_lock<std::mutex> lock(mutex_);
  if (holder_ == &member) {
    ++depth_;
    return true;
  }
  if (holder_ != nullptr) {
    // Counts as paused meanwhile: this lane runs nothing while it waits.
    member.waiting = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return holder_ == nullptr; });
    member.waiting = false;
  }
  holder_ = &member;
  depth_ = 0;
  // seq_cst, then others_paused() loads `blocked`: see QuietDevice::begin_wait.
  requested_.store(true, std::memory_order_seq_cst);
  for (QuietMember* m : members_) {
    if (m != &member && !m->paused && !m->waiting && m->poke) m->poke();
  }
  auto all_paused = [&] { return others_paused(member); };
  bool quiet = true;
  if (timeout_s < 0 || timeout_s > kForeverS) {
    cv_.wait(lock, all_paused);
  } else {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout_s));
    quiet = cv_.wait_until(lock, deadline, all_paused);
  }
  member.quiet_wait_ns += now_ns() - start;
  if (quiet) {
    ++member.quiets;
  } else {
    ++member.quiet_timeouts;
    end_locked();
  }
  return quiet;
}

bool QuietDevice::resume(QuietMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (holder_ != &member) return false;
  if (depth_ > 0) {
    --depth_;
    return true;
  }
  end_locked();
  return true;
}

void QuietDevice::end_locked() {
  holder_ = nullptr;
  depth_ = 0;
  requested_.store(false, std::memory_order_relaxed);
  cv_.notify_all();
}

void QuietDevice::bind_thread(QuietDevice* device, QuietMember* member) {
  bound_device = device;
  bound_member = member;
}

// A waiter stores `blocked`, then loads requested_; a holder stores requested_, then
// loads `blocked` (others_paused()), all seq_cst: at least one sees the other's store.
// The holder that sees the waiter blocked counts it paused; the waiter that sees a quiet
// requested wakes the holder through the mutex (which the holder holds while it checks).
void QuietDevice::begin_wait(QuietMember& member) {
  member.blocked.store(true, std::memory_order_seq_cst);
  if (requested_.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> lock(mutex_);
    cv_.notify_all();  // the holder may be waiting for this member
  }
}

// The same pairing: a holder that saw the waiter still blocked took the quiet before
// this load, which then sees it requested, and the waiter pauses; a waiter that sees none
// requested was not blocked for any holder that comes later, which waits for it (and
// pokes it) as for any lane inside a task.
void QuietDevice::end_wait(QuietMember& member) {
  member.blocked.store(false, std::memory_order_seq_cst);
  if (!requested_.load(std::memory_order_seq_cst)) return;
  std::unique_lock<std::mutex> lock(mutex_);
  // A holder's own waits go on: its quiet is its task's.
  if (holder_ == nullptr || holder_ == &member) return;
  const int64_t start = now_ns();
  member.paused = true;
  ++member.pauses;
  cv_.notify_all();
  cv_.wait(lock, [&] { return holder_ == nullptr; });
  member.paused = false;
  member.paused_ns += now_ns() - start;
}

QuietWait::QuietWait() : device_(bound_device), member_(bound_member) {
  if (member_ != nullptr) device_->begin_wait(*member_);
}

QuietWait::~QuietWait() {
  if (member_ != nullptr) device_->end_wait(*member_);
}

QuietStats QuietDevice::stats(const QuietMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  QuietStats s;
  s.pauses = member.pauses;
  s.paused_ns = member.paused_ns;
  s.quiets = member.quiets;
  s.quiet_timeouts = member.quiet_timeouts;
  s.quiet_wait_ns = member.quiet_wait_ns;
  return s;
}

bool QuietDevice::held_by(const QuietMember& member) {
  std::lock_guard<std::mutex> lock(mutex_);
  return holder_ == &member;
}

}  // namespace pydflash
