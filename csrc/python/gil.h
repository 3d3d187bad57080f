// Taking the GIL back on a pydflash thread, safely at interpreter exit.
//
// Note [Never retaking the GIL at exit]: Python 3.11 to 3.13 end any thread that asks
// for the GIL once the interpreter is finalizing (PyThread_exit_thread), by unwinding
// its stack. Through pydflash's C++ frames that unwind calls std::terminate when it
// starts in a destructor or passes a noexcept frame (pybind11's gil_scoped_release
// takes the GIL back in its destructor), and any destructor it runs drops objects
// without the GIL. So a thread that let the GIL go in pydflash never asks for it again
// once finalization has begun: it parks for good instead, holding nothing, as CPython
// 3.14 parks its own threads (PyThread_hang_thread); the process ends around it. A
// thread already blocked on the GIL when finalization begins is still ended by CPython:
// every take below is therefore plain code, never in a destructor, and the worker's
// frames let go of their task (Note [Threads ended at exit], core/lane.cpp). The thread
// that finalizes, the main one, is never parked.
#pragma once

#include <Python.h>
#include <pthread.h>
#include <pythread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <type_traits>

namespace pydflash::python {

/// The main thread's ident: it finalizes the interpreter and runs signal handlers.
inline std::atomic<unsigned long>& main_thread_ident() {
  static std::atomic<unsigned long> ident{0};
  return ident;
}

/// Called at import with threading.main_thread()'s ident (module.cpp). In a forked
/// child the forking thread becomes the main one, as CPython makes it.
inline void remember_main_thread(unsigned long ident) {
  main_thread_ident().store(ident);
  static std::once_flag registered;
  std::call_once(registered, [] {
    pthread_atfork(nullptr, nullptr,
                   [] { main_thread_ident().store(PyThread_get_thread_ident()); });
  });
}

inline bool on_main_thread() {
  return PyThread_get_thread_ident() == main_thread_ident().load(std::memory_order_relaxed);
}

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// Never returns: what a thread does instead of asking a finalizing interpreter for
/// the GIL.
[[noreturn]] inline void park_for_good() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

/// PyEval_RestoreThread, or parks for good once the interpreter finalizes.
inline void restore_gil(PyThreadState* saved) {
  if (interpreter_finalizing() && !on_main_thread()) park_for_good();
  PyEval_RestoreThread(saved);
}

/// Runs `fn` with the GIL let go and takes it back with restore_gil, also when `fn`
/// throws. In place of pybind11's gil_scoped_release, whose destructor takes it back.
template <typename Fn>
auto without_gil(Fn&& fn) -> decltype(fn()) {
  PyThreadState* saved = PyEval_SaveThread();
  // The take stays outside the try: CPython may end this thread inside it.
  auto run = [&]() -> decltype(fn()) {
    try {
      return fn();
    } catch (...) {
      restore_gil(saved);
      throw;
    }
  };
  if constexpr (std::is_void_v<decltype(fn())>) {
    run();
    restore_gil(saved);
  } else {
    auto result = run();
    restore_gil(saved);
    return result;
  }
}

/// Holds the GIL on a thread that may not have it (PyGILState_Ensure), parking for good
/// rather than asking a finalizing interpreter for it. In place of pybind11's
/// gil_scoped_acquire.
class GilHeld {
 public:
  GilHeld() {
    if (!PyGILState_Check() && interpreter_finalizing() && !on_main_thread()) park_for_good();
    state_ = PyGILState_Ensure();
  }
  ~GilHeld() { PyGILState_Release(state_); }
  GilHeld(const GilHeld&) = delete;
  GilHeld& operator=(const GilHeld&) = delete;

 private:
  PyGILState_STATE state_;
};

}  // namespace pydflash::python
