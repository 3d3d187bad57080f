// A lane's side of the GIL: the worker's Python thread state, entering and leaving the
// interpreter (core/lane.h's Interpreter), and when to take the GIL so that the thread
// that holds it is not made to wait. Task bodies are in python/tasks.h; torch's state
// in python/torch_abi.h.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/lane.h"
#include "python/torch_abi.h"

namespace pydflash::python {

/// Note [Entering when the GIL is free]: a worker woken by a submit would otherwise
/// block in CPython's take_gil while the submitter still holds the GIL, and then pay a
/// futex wake-up when it lets go. Threads waiting on a pydflash future count
/// themselves here once they have released the GIL; a worker about to enter polls
/// this briefly first, so it usually finds the GIL free. It polls only while the GIL's
/// holder is busy with pydflash: submitting, or taking futures' `_condition`s as
/// concurrent.futures.wait does before it blocks in a threading.Event, a wait that does
/// not count itself. A holder quiet for a moment may have let the GIL go that way, and
/// polling on would leave the GIL idle: the worker polls at most kEnterPollNs, and stops
/// once the GIL's holder has been quiet (no submit, no `_condition` taken) for kQuietNs
/// (lane_runtime.cpp), and only while a core is free for it (Note [Polling only on a free
/// core], core/spin.h): otherwise it blocks on the GIL at once, to be woken when it is
/// let go.
class WaitingWithoutGil {
 public:
  WaitingWithoutGil() { count().fetch_add(1, std::memory_order_relaxed); }
  ~WaitingWithoutGil() { count().fetch_sub(1, std::memory_order_relaxed); }
  WaitingWithoutGil(const WaitingWithoutGil&) = delete;
  WaitingWithoutGil& operator=(const WaitingWithoutGil&) = delete;
  static bool any() { return count().load(std::memory_order_relaxed) > 0; }
  /// A thread holding the GIL takes a future's `_condition`: a wait may follow.
  static void preparing() { prepared().fetch_add(1, std::memory_order_relaxed); }
  static uint64_t preparations() { return prepared().load(std::memory_order_relaxed); }
  /// Workers that want the GIL, polling or blocked on it, count themselves here until
  /// they have it (Note [Handing the GIL to a waiting worker], python/future_lock.cpp).
  static void worker_entering(int delta) { entering().fetch_add(delta, std::memory_order_relaxed); }
  static bool workers_entering() { return entering().load(std::memory_order_relaxed) > 0; }

 private:
  static std::atomic<int>& count() {
    static std::atomic<int> waiting{0};
    return waiting;
  }
  static std::atomic<uint64_t>& prepared() {
    static std::atomic<uint64_t> taken{0};
    return taken;
  }
  static std::atomic<int>& entering() {
    static std::atomic<int> workers{0};
    return workers;
  }
};

/// Per-lane Python-side state; also the lane's Interpreter (the GIL). Touched only
/// on the worker thread once the lane runs, except `label`.
class LaneRuntime : public Interpreter {
 public:
  LaneRuntime(std::string label, pybind11::object future_type);
  ~LaneRuntime() override;

  void thread_started(Lane& lane) override;
  void enter() override;
  void enter_unhurried() override;
  void leave() override;
  void thread_exiting() override;

  /// Makes the lane's device and stream current for torch (once torch is imported)
  /// before each task (Note [Lane stream selection]). Entered.
  void prepare_task(const Lane& lane) { streams_.select(lane); }

  const std::string label;  // "lane 0 (cuda:1)", for errors and traces
  PyObject* future_type() const { return future_type_; }

  /// Note [Deferred decrefs]: a task that ran without the GIL drops its Python
  /// references here, on the worker, without taking the GIL: they are released the next
  /// time the worker leaves the interpreter, or by an internal task once kBuriedMax have
  /// gathered, or when the worker exits. A program launched per microbatch would
  /// otherwise wake its worker into the GIL for every release. Null entries are skipped.
  /// The graveyard is the worker's alone: buried and drained on its thread, unlocked.
  void bury(std::initializer_list<PyObject*> refs);

 private:
  friend class GraveyardDrain;
  void drain_graveyard();  // entered

  std::vector<PyObject*> graveyard_;
  bool drain_posted_ = false;

  PyInterpreterState* interp_;
  PyThreadState* tstate_ = nullptr;
  Lane* lane_ = nullptr;   // set when the worker starts
  PyObject* future_type_;  // owned; released entered
  LaneStreamSelection streams_;
};

}  // namespace pydflash::python
