#include "python/future_lock.h"

#include <pybind11/pybind11.h>
#include <pythread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/clock.h"
#include "core/spin.h"
#include "python/future_object.h"
#include "python/gil.h"
#include "python/lane_runtime.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

constexpr int64_t kSliceNs = 20'000'000;  // check for Ctrl-C this often while blocked

struct FutureLock {
  PyObject_HEAD
  std::atomic<unsigned long> owner;  // thread ident, 0 when free
  unsigned long count;               // how often the owner took it; the owner's only
  std::atomic<int> sleepers;         // threads blocked on it
  PyObject* future;                  // whose `_condition` it is; cleared when that goes
};

// Contention is rare (a waiter installing itself while the worker tells the waiters):
// one mutex and condition for every lock, for the threads that must block.
std::mutex contended_mutex;
std::condition_variable contended_cv;

// Note [Handing the GIL to a waiting worker]: concurrent.futures.wait() and
// as_completed() take every future's `_condition` before they block in a
// threading.Event, and a worker that has tasks queued gets the GIL only then, after a
// waiter has been installed on every future; each then costs a notification and a
// removal. A thread taking its first FutureLock (it holds none) while a worker waits to
// enter, or while the lock's future has not started (its worker may be waking for it),
// therefore lets the GIL go until the worker has it and the future has started (at most
// kHandOverNs), then asks for it back. The worker runs its queue first and lets the GIL
// go once the queue is empty, or earlier when CPython's switch interval says so, as
// with any call that lets the GIL go; the wait then finds those futures done and
// returns without waiters.
//
// A pending future's worker may be busy with a long task instead: then the hand-over
// gains nothing, and it cost every take of such a future's condition 20 µs, a wait over
// a million pending futures 20 s past its timeout (issue 35). So once a hand-over for a
// pending future ends with the future still pending, this thread hands over for pending
// futures no more for kFruitlessNs (a worker that wants the GIL still gets it).
// Future.add_done_callback takes the lock without a hand-over (lock_future_lock, from
// future_object.cpp): handing over there let the task finish first, and the callback ran
// on the caller instead of on the thread that completes the future.
constexpr int64_t kHandOverNs = 20'000;
constexpr int64_t kFruitlessNs = 10'000'000;
thread_local int held_from_python = 0;  // FutureLocks this thread took from Python
thread_local int64_t pending_hand_overs_after_ns = 0;

bool not_started(PyObject* future) {
  return future != nullptr && as_future(future)->state().status() == FutureStatus::Pending;
}

void hand_over_to_waiting_worker(FutureLock* l) {
  if (held_from_python != 0) return;
  const bool for_pending = now_ns() >= pending_hand_overs_after_ns && not_started(l->future);
  if (!for_pending && !WaitingWithoutGil::workers_entering()) return;
  PyObject* future = Py_XNewRef(l->future);  // kept while the GIL is let go
  const bool fruitless = without_gil([&] {
    WaitingWithoutGil waiting;  // the worker's poll ends at once
    // Yielding even when no core is free (Note [Polling only on a free core]): the
    // yield is what lets a worker that shares this core take the GIL, and it comes at
    // most once per wait and kFruitlessNs, not once per future.
    const int64_t until = now_ns() + kHandOverNs;
    while ((WaitingWithoutGil::workers_entering() || (for_pending && not_started(future))) &&
           now_ns() < until)
      yield_core();
    return for_pending && not_started(future);
  });
  if (fruitless) pending_hand_overs_after_ns = now_ns() + kFruitlessNs;
  Py_XDECREF(future);
}

PyTypeObject FutureLockType = {PyVarObject_HEAD_INIT(nullptr, 0)};

FutureLock* lock_of(PyObject* obj) { return reinterpret_cast<FutureLock*>(obj); }

bool try_take(FutureLock* l, unsigned long me) {
  unsigned long free = 0;
  return l->owner.compare_exchange_strong(free, me, std::memory_order_acquire);
}

// Blocks until taken, the deadline passes (0) or a signal handler raises (-1).
int take_contended(FutureLock* l, unsigned long me, double timeout_s) {
  const int64_t deadline = timeout_s < 0 ? INT64_MAX : deadline_after(now_ns(), timeout_s);
  l->sleepers.fetch_add(1, std::memory_order_seq_cst);
  int outcome = 0;
  for (;;) {
    const int64_t now = now_ns();
    if (now >= deadline) break;
    // Taken while the GIL is let go, the lock would be held by a thread that parks
    // instead of taking the GIL back at exit (Note [Never retaking the GIL at exit]):
    // wait until it is free, then take it holding the GIL.
    without_gil([&] {
      // Let go before taking the GIL back: its holder may be releasing this lock.
      std::unique_lock<std::mutex> lock(contended_mutex);
      const auto slice = std::chrono::nanoseconds(std::min(kSliceNs, deadline - now));
      contended_cv.wait_for(lock, slice,
                            [&] { return l->owner.load(std::memory_order_relaxed) == 0; });
    });
    if (try_take(l, me)) {
      outcome = 1;
      break;
    }
    if (on_main_thread() && PyErr_CheckSignals() < 0) {
      outcome = -1;
      break;
    }
  }
  l->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return outcome;
}

PyObject* acquire(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  // acquire(blocking=True, timeout=-1), as _thread.RLock's.
  PyObject* blocking = nargs > 0 ? args[0] : nullptr;
  PyObject* timeout = nargs > 1 ? args[1] : nullptr;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, i);
    if (PyUnicode_CompareWithASCIIString(name, "blocking") == 0 && blocking == nullptr) {
      blocking = args[nargs + i];
    } else if (PyUnicode_CompareWithASCIIString(name, "timeout") == 0 && timeout == nullptr) {
      timeout = args[nargs + i];
    } else {
      PyErr_Format(PyExc_TypeError, "acquire() got an unexpected keyword argument %R", name);
      return nullptr;
    }
  }
  if (nargs > 2) {
    PyErr_Format(PyExc_TypeError, "acquire() takes at most 2 arguments (%zd given)", nargs);
    return nullptr;
  }
  double t = -1.0;
  if (timeout != nullptr) {
    t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) return nullptr;
  }
  const int block = blocking == nullptr ? 1 : PyObject_IsTrue(blocking);
  if (block < 0) return nullptr;
  if (!block && t != -1.0) {
    PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
    return nullptr;
  }
  if (t < 0 && t != -1.0) {
    PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
    return nullptr;
  }
  WaitingWithoutGil::preparing();
  hand_over_to_waiting_worker(lock_of(self));
  const int got = lock_future_lock(self, block ? t : 0.0);
  if (got < 0) return nullptr;
  held_from_python += got;
  return PyBool_FromLong(got);
}

PyObject* release(PyObject* self, PyObject*) {
  if (!unlock_future_lock(self)) return nullptr;
  --held_from_python;
  Py_RETURN_NONE;
}

PyObject* enter_method(PyObject* self, PyObject*) {
  WaitingWithoutGil::preparing();
  hand_over_to_waiting_worker(lock_of(self));
  if (lock_future_lock(self, -1.0) < 0) return nullptr;
  ++held_from_python;
  Py_RETURN_TRUE;
}

PyObject* exit_method(PyObject* self, PyObject* const*, Py_ssize_t) {
  return release(self, nullptr);
}

PyObject* repr(PyObject* self) {
  const unsigned long owner = lock_of(self)->owner.load();
  return PyUnicode_FromFormat("<pydflash._C.FutureLock %s owner=%lu count=%lu at %p>",
                              owner ? "locked" : "unlocked", owner,
                              owner ? lock_of(self)->count : 0UL, self);
}

PyMethodDef methods[] = {
    {"acquire", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(acquire)),
     METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): takes the lock, again if this thread holds it."},
    {"release", release, METH_NOARGS, "Lets go once; the lock is free when every take is undone."},
    {"__enter__", enter_method, METH_NOARGS, nullptr},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(exit_method)),
     METH_FASTCALL, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyObject* no_new(PyTypeObject*, PyObject*, PyObject*) {
  PyErr_SetString(PyExc_TypeError, "a FutureLock is made by its future (Future._condition)");
  return nullptr;
}

}  // namespace

int lock_future_lock(PyObject* lock, double timeout_s) {
  FutureLock* l = lock_of(lock);
  const unsigned long me = PyThread_get_thread_ident();
  if (l->owner.load(std::memory_order_relaxed) == me) {
    ++l->count;
    return 1;
  }
  if (!try_take(l, me)) {
    const int got = timeout_s == 0 ? 0 : take_contended(l, me, timeout_s);
    if (got != 1) return got;
  }
  l->count = 1;
  return 1;
}

bool unlock_future_lock(PyObject* lock) {
  FutureLock* l = lock_of(lock);
  if (l->owner.load(std::memory_order_relaxed) != PyThread_get_thread_ident()) {
    PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
    return false;
  }
  if (--l->count > 0) return true;
  l->owner.store(0, std::memory_order_seq_cst);
  // After the store: a sleeper that counted itself before it sees the lock free under
  // the mutex, or is woken here.
  if (l->sleepers.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> guard(contended_mutex);
    contended_cv.notify_all();
  }
  return true;
}

void detach_future_lock(PyObject* lock) { lock_of(lock)->future = nullptr; }

PyObject* new_future_lock(PyObject* future) {
  PyObject* obj = FutureLockType.tp_alloc(&FutureLockType, 0);
  if (obj == nullptr) return nullptr;
  FutureLock* l = lock_of(obj);
  new (&l->owner) std::atomic<unsigned long>(0);
  l->count = 0;
  new (&l->sleepers) std::atomic<int>(0);
  l->future = future;
  return obj;
}

void add_future_lock_type(PyObject* module) {
  FutureLockType.tp_name = "pydflash._C.FutureLock";
  FutureLockType.tp_basicsize = sizeof(FutureLock);
  FutureLockType.tp_flags = Py_TPFLAGS_DEFAULT;
  FutureLockType.tp_doc =
      "A future's _condition: the reentrant lock concurrent.futures.wait() takes.";
  FutureLockType.tp_new = no_new;
  FutureLockType.tp_methods = methods;
  FutureLockType.tp_repr = repr;
  if (PyType_Ready(&FutureLockType) < 0) throw py::error_already_set();
  Py_INCREF(&FutureLockType);
  if (PyModule_AddObject(module, "FutureLock", reinterpret_cast<PyObject*>(&FutureLockType)) < 0)
    throw py::error_already_set();
}

}  // namespace pydflash::python
