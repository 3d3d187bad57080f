// The native half of a pydflash future: its state machine, the wait, and the error a
// task that ran without the interpreter left behind. Results of Python tasks live
// in the Python object (pydflash/lanes/_future.py); see Note [Observed futures].
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace pydflash {

enum class FutureStatus : int { Pending = 0, Running = 1, Cancelled = 2, Finished = 3 };

class FutureState {
 public:
  explicit FutureState(uint64_t id);
  ~FutureState();
  FutureState(const FutureState&) = delete;
  FutureState& operator=(const FutureState&) = delete;

  uint64_t id() const { return id_; }
  FutureStatus status() const { return status_of(word_.load(std::memory_order_seq_cst)); }
  bool done() const { return is_done(word_.load(std::memory_order_seq_cst)); }

  /// Pending -> Running. False when the task was cancelled first.
  bool try_start();
  /// Pending -> Cancelled by this call: true for exactly one caller, which is the one
  /// that notifies observers (a second notification would count a waiter down twice).
  bool try_cancel();
  /// Running -> Finished. Returns whether an observer must be notified afterwards.
  /// See Note [Finish, then publish].
  bool finish();
  /// Records the failure of a task that ran without the interpreter, as one of the
  /// typed errors of core/error.h (the binding layer maps it, as it maps every other);
  /// the task still finishes normally. Set before finish(), read after done().
  void set_error(std::exception_ptr error) { error_ = std::move(error); }
  const std::exception_ptr& error() const { return error_; }

  /// Made before a fork, in the parent: no worker of this process will finish it.
  bool made_before_fork() const;
  /// Wakes wait(). Called after finish() or cancel().
  void publish();

  /// Note [Finish, then publish]: a worker finishes a Python task while it holds the
  /// GIL (so observers, who also hold it, see a consistent state) and publishes it at
  /// once, waking wait(); it lets the GIL go right after when nothing else is queued.
  /// A woken waiter polls (bounded) until the producing worker has let go, so that it
  /// takes a free GIL instead of going to sleep on a held one. Publication is never
  /// deferred past the task: a later task on the same lane may itself wait for
  /// whoever waits on this one. Observers are notified after publication: a thread
  /// holding the future's condition while it waits for result() must not keep the
  /// worker from waking it.
  bool published() const { return published_.load(std::memory_order_acquire); }

  /// The producing worker's "holds the interpreter" flag (see the Note above). It lives
  /// for the process; a stale reading only makes a waiter poll a little less or more.
  void set_producer_in_interpreter(const std::atomic<bool>* flag) {
    producer_in_interpreter_ = flag;
  }

  /// Returns at once when done (the caller holds what the finisher held, so the
  /// outcome is visible); otherwise waits until published: spin_ns of polling first
  /// (cheap when the result is close), then blocks in slices of slice_ns, calling `interrupted`
  /// between slices; a true return from it abandons the wait. Returns whether the future is done.
  bool wait(double timeout_s, int64_t spin_ns, int64_t slice_ns,
            const std::function<bool()>& interrupted);

  /// Note [Observed futures]: a future is "observed" once something other than its
  /// own result() may need a wake-up (a done callback, concurrent.futures.wait,
  /// as_completed). Status and `observed` share one atomic word, so the finisher's
  /// transition says whether an observer came first (finish() returns it: the finisher
  /// notifies), and an observer coming later sees the outcome (nobody will notify: it
  /// is settled at once). Unobserved futures complete without touching the interpreter.
  /// An observed future is "settled" once its observers were told; until then
  /// concurrent.futures must see it as not yet done, as it sees a stdlib future whose
  /// state and waiters change together under its condition.
  void mark_observed();
  bool observed() const { return (word_.load(std::memory_order_seq_cst) & kObserved) != 0; }
  /// Done, and its observers (if any) told. The notifier calls mark_notified().
  bool settled() const { return is_settled(word_.load(std::memory_order_seq_cst)); }
  void mark_notified() { word_.fetch_or(kNotified, std::memory_order_seq_cst); }

  /// CUDA event recorded on the lane's stream after the task (null on CPU lanes, and
  /// while deferred); it goes back to its device's pool with the future.
  void* event() const { return event_; }
  void set_event(int device, void* event) {
    event_device_ = device;
    event_ = event;
  }
  /// Note [Deferred result events]: a result event orders a consumer stream after the
  /// task's GPU work, so the event may be recorded later than the task's end, never
  /// earlier. A task whose result holds no GPU memory (None, a number, a string, an
  /// exception) gets its event only when someone asks, recorded on `stream` then: it
  /// lands after whatever the lane has queued since, so a consumer may wait longer than
  /// it needs, never less. Results that hold tensors, the ones handed between lanes,
  /// still get theirs when the task ends. Set by the worker before the task finishes.
  void defer_event(int device, void* stream) {
    event_device_ = device;
    deferred_stream_ = stream;
  }
  /// The event once the task has finished (null before), recording a deferred one now.
  /// Callers serialize (the Python getter holds the GIL).
  void* event_recorded_now();

  /// When the task was queued and started, for stats and traces. Plain fields: the
  /// submitter writes submit_ns before the queue hands the task over, and only the
  /// worker touches them afterwards.
  int64_t submit_ns = 0;
  int64_t start_ns = 0;

 private:
  // The word: the status in the low bits, then the observed and notified flags.
  static constexpr uint32_t kStatusMask = 3;
  static constexpr uint32_t kObserved = 4;
  static constexpr uint32_t kNotified = 8;
  static FutureStatus status_of(uint32_t word) {
    return static_cast<FutureStatus>(word & kStatusMask);
  }
  static bool is_done(uint32_t word) {
    const FutureStatus s = status_of(word);
    return s == FutureStatus::Cancelled || s == FutureStatus::Finished;
  }
  static bool is_settled(uint32_t word) {
    return is_done(word) && ((word & kObserved) == 0 || (word & kNotified) != 0);
  }
  /// from -> to, keeping the flags. False when the status was not `from`; `before`
  /// gets the word the transition replaced.
  bool transition(FutureStatus from, FutureStatus to, uint32_t* before = nullptr);

  const uint64_t id_;
  const int fork_generation_;
  std::atomic<uint32_t> word_{static_cast<uint32_t>(FutureStatus::Pending)};
  std::atomic<bool> published_{false};
  const std::atomic<bool>* producer_in_interpreter_ = nullptr;
  std::atomic<int> sleepers_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  std::exception_ptr error_;
  void* event_ = nullptr;
  int event_device_ = -1;
  void* deferred_stream_ = nullptr;
};

}  // namespace pydflash
