// The compile queue: process-wide, keyed single-flight for work that must not run twice
// at once (an autotune benchmark, a JIT compile, the first call of a compiled module),
// with exclusive FIFO slots (one autotune benchmark per GPU at a time). Knows nothing
// about Python: results are opaque, and the caller says how to check for an interrupt.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace pydflash {

/// A wait ran past its timeout; the message names the key, its holder and for how long.
struct CompileQueueTimeout : TimeoutError {
  using TimeoutError::TimeoutError;
};

/// Waiting would never end: the thread being waited for waits, directly or through
/// others, for something the caller holds. Becomes RuntimeError.
struct CompileQueueDeadlock : StateError {
  using StateError::StateError;
};

/// The `interrupted` callback returned true; the caller reports its own pending error.
struct CompileQueueInterrupted : std::exception {
  const char* what() const noexcept override { return "compile queue wait interrupted"; }
};

/// What a holder hands to every caller of its key. Opaque to the queue; its deleter must
/// be safe to run on any thread that called `run`.
using CompileResult = std::shared_ptr<void>;

struct CompileOptions {
  /// Exclusive resource the work needs (e.g. "cuda:0"); empty for none.
  std::string slot;
  /// The calling thread as people know it, for error messages.
  std::string label;
  /// Seconds to wait before giving up; negative means the queue's default.
  double timeout_s = -1.0;
};

struct CompileKeyStats {
  uint64_t runs = 0;      // times the work ran (this thread was the holder)
  uint64_t shared = 0;    // calls that received another thread's outcome
  uint64_t waits = 0;     // calls that blocked, for an outcome or for the slot
  uint64_t failures = 0;  // runs that threw
  int64_t wait_ns = 0;
  int64_t max_wait_ns = 0;
  int64_t run_ns = 0;
};

/// One key in flight, as `in_flight()` reports it.
struct CompileFlightInfo {
  std::string key;
  std::string slot;
  std::string holder;  // label of the thread that runs (or will run) it; "" when unclaimed
  bool running = false;
  int64_t since_ns = 0;  // queued, or started once running
  int waiters = 0;
};

// Note [Compile queue fairness]
// A call with key K either joins the flight of K already in the queue (and receives its
// result or exception) or starts one. A flight that needs a slot waits in that slot's
// FIFO: slots are served strictly in arrival order, so no key starves, and work for
// other slots (other GPUs) or for no slot (JIT compiles) does not wait at all.
// Re-entry never blocks: the thread running K that asks for K again runs it inline, and
// a thread that owns a slot takes it again at once; if the key it asks for is queued for
// the slot it owns, it takes that flight over and runs it (the queued caller then waits
// for the outcome like any other). A caller that gives up (timeout, interrupt) hands its
// queued flight to one of that flight's waiters, keeping its place in the FIFO.
// Waits that close a cycle (A waits for B, which waits for a slot A owns) raise
// CompileQueueDeadlock instead of hanging.
class CompileQueue {
 public:
  CompileQueue() = default;
  CompileQueue(const CompileQueue&) = delete;
  CompileQueue& operator=(const CompileQueue&) = delete;

  /// The process-wide queue; never destroyed (it may outlive static destruction order).
  static CompileQueue& instance();

  /// Runs `work` as the holder of `key`, or waits for the current holder's outcome and
  /// returns (or rethrows) it. `interrupted` is polled about every 20 ms while blocked,
  /// without the queue's lock; when it returns true the call leaves with
  /// CompileQueueInterrupted. Throws CompileQueueTimeout past the timeout.
  CompileResult run(const std::string& key, const std::function<CompileResult()>& work,
                    const CompileOptions& options = {},
                    const std::function<bool()>& interrupted = {});

  /// Default timeout in seconds for `run`; negative waits forever.
  void set_default_timeout(double seconds);
  double default_timeout() const;

  std::map<std::string, CompileKeyStats> stats() const;
  void reset_stats();
  std::vector<CompileFlightInfo> in_flight() const;

  static constexpr int64_t kPollSliceNs = 20'000'000;

 private:
  struct Flight;
  struct Slot {
    std::thread::id owner;
    int depth = 0;  // re-entries by the owner
    std::string owner_label;
    std::string owner_key;
    int64_t since_ns = 0;
    std::deque<std::shared_ptr<Flight>> queue;  // flights waiting for the slot, in order
  };
  // What a blocked thread waits for, to find cycles.
  struct Blocked {
    std::shared_ptr<Flight> flight;  // its outcome, or
    std::string slot;                // the slot, for `flight`
  };
  using Lock = std::unique_lock<std::mutex>;
  // One call of `run`: what it asked for and how long it may block.
  struct Call {
    const std::string& key;
    const std::function<CompileResult()>& work;
    const CompileOptions& options;
    const std::function<bool()>& interrupted;
    int64_t start_ns;
    int64_t deadline_ns;
    bool blocked = false;
  };

  CompileResult run_as_holder(Lock& lock, const std::shared_ptr<Flight>& flight, Call& call);
  CompileResult wait_for_outcome(Lock& lock, const std::shared_ptr<Flight>& flight, Call& call);
  // Takes the flight's slot, in FIFO order. Returns false when another thread took the
  // flight over meanwhile (the caller then waits for its outcome).
  bool acquire_slot(Lock& lock, const std::shared_ptr<Flight>& flight, Call& call);
  void release_slot_locked(const std::string& slot);
  // The holder leaves before running: a waiter takes the flight, or it is dropped.
  void abandon_locked(const std::shared_ptr<Flight>& flight, bool keep_turn);
  void drop_if_orphaned_locked(const std::shared_ptr<Flight>& flight);
  // Sleeps one slice (or to the deadline), polls `interrupted` unlocked. Throws
  // CompileQueueInterrupted; returns false once past the deadline.
  bool wait_slice(Lock& lock, Call& call);
  void check_deadlock_locked(std::thread::id waited_for, const Call& call,
                             const std::string& what) const;
  std::string describe_locked(const Flight& flight, int64_t now) const;
  void record_wait_locked(Call& call, int64_t until_ns);

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::unordered_map<std::string, std::shared_ptr<Flight>> flights_;
  std::unordered_map<std::string, Slot> slots_;
  std::unordered_map<std::thread::id, Blocked> blocked_;
  std::map<std::string, CompileKeyStats> stats_;
  double default_timeout_s_ = -1.0;
};

}  // namespace pydflash
