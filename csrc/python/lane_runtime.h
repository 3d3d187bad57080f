// What a lane needs from Python: the GIL as its Interpreter, task bodies that call
// Python callables (or launch captured graphs without the GIL), and the caller's
// torch state carried into the task.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <string>

#include "core/lane.h"

namespace pydflash::python {

/// Note [Entering when the GIL is free]: a worker woken by a submit would otherwise
/// block in CPython's take_gil while the submitter still holds the GIL, and then pay a
/// futex wake-up when it lets go. Threads waiting on a pydflash future count
/// themselves here once they have released the GIL; a worker about to enter polls
/// this briefly first, so it usually finds the GIL free. It polls only while the GIL's
/// holder is busy with pydflash: submitting, or taking futures' `_condition`s as
/// concurrent.futures.wait does before it blocks in a threading.Event, a wait that does
/// not count itself. A holder quiet for a moment may have let the GIL go that way, and
/// polling on would leave the GIL idle.
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

/// c10::cuda::CUDAStream as returned by value: {Device{type, index}, StreamId}. Trivially
/// copyable, so it comes back in two registers; LaneRuntime checks a reading against the
/// stream it has just set before trusting the getter.
struct CudaStreamAbi {
  int8_t device_type;
  int8_t device_index;
  int64_t id;
};

/// The caller's thread-local torch state at submit, applied on the worker.
struct TorchSnapshot {
  bool captured = false;  // torch was imported at submit
  bool grad = true;
  // Inference mode or autocast on: rare, so carried as a Python tuple and applied by
  // pydflash._torch_state.call_in_state.
  pybind11::object special;

  static TorchSnapshot capture();
};

/// Per-lane Python-side state; also the lane's Interpreter (the GIL). Touched only
/// on the worker thread once the lane runs, except `label`.
class LaneRuntime : public Interpreter {
 public:
  LaneRuntime(std::string label, pybind11::object future_type);
  ~LaneRuntime() override;

  void thread_started(Lane& lane) override;
  void enter() override;
  void leave() override;
  void thread_exiting() override;

  /// Makes the lane's device and stream current for torch (once torch is imported)
  /// before each task. Entered.
  void prepare_task(Lane& lane);

  const std::string label;  // "lane 0 (cuda:1)", for errors and traces
  PyObject* future_type() const { return future_type_; }

 private:
  PyInterpreterState* interp_;
  PyThreadState* tstate_ = nullptr;
  const Lane* lane_ = nullptr;  // set when the worker starts
  PyObject* future_type_;          // owned; released entered
  PyObject* set_stream_ = nullptr;  // owned: torch._C._cuda_setStream
  PyObject* set_stream_args_ = nullptr;
  bool torch_ready_ = false;
  // Torch's current-stream getter, once a reading has matched (trust_stream_reading),
  // and the lane stream's torch id.
  CudaStreamAbi (*current_cuda_stream_)(int8_t) = nullptr;
  int64_t lane_stream_id_ = 0;

  void trust_stream_reading(const Lane& lane);
  bool lane_stream_is_current(const Lane& lane) const;
};

/// Creates the Python future for task `id` of `lane` (the future type's constructor).
pybind11::object make_python_future(LaneRuntime& rt, uint64_t id, pybind11::handle lane);

// Task bodies refer to their lane's runtime without owning it: the lane owns it and
// outlives every task it queues, and an atomic reference count per task is a cache
// line shared by the submitting thread and the worker.
std::unique_ptr<TaskBody> make_python_task(LaneRuntime& rt, pybind11::object fn,
                                           pybind11::tuple args, pybind11::object kwargs,
                                           pybind11::object future, bool tracing);

std::unique_ptr<TaskBody> make_graph_task(LaneRuntime& rt, uintptr_t graph_exec,
                                          pybind11::object keepalive, pybind11::object future);

/// How the caller's torch state is read and set: "native" (Note [Torch state without
/// Python calls]), "python", or null before torch is imported. Entered.
const char* torch_state_reader();

}  // namespace pydflash::python
