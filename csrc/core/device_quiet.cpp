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

Registry& registry() {
  static const bool made = [] {
    current_registry.store(new Registry, std::memory_order_release);
    // A forked child has one thread: the parent's registry may be locked by a thread that
    // does not exist there, and its quiets belong to lanes that do not run there. The
    // child starts afresh and leaks the parent's.
    pthread_atfork(nullptr, nullptr,
                   [] { current_registry.store(new Registry, std::memory_order_release); });
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
    if (m != &holder && !m->paused && !m->waiting) return false;
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
  requested_.store(true, std::memory_order_relaxed);
  for (QuietMember* m : members_) {
    if (m != &member && !m->paused && !m->waiting && m->poke) m->poke();
  }
  auto all_paused = [&] { return others_paused(member); };
  bool quiet = true;
  if (timeout_s < 0) {
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
