#include "python/future_object.h"

#include <pybind11/pybind11.h>
#include <structmember.h>
#include <unistd.h>

#include <new>
#include <string>

#include "python/bindings.h"
#include "python/entry_points.h"
#include "python/future_lock.h"
#include "python/gil.h"
#include "python/lane_runtime.h"
#include "python/stdlib_waiters.h"
#include "python/timeout.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

constexpr int64_t kWaitSpinNs = 100'000;      // poll this long before sleeping
constexpr int64_t kWaitSliceNs = 20'000'000;  // check for Ctrl-C this often

PyTypeObject FutureBaseType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// concurrent.futures' state names, read once: by FutureStatus, then what a done future
// shows until its observers were told (Note [Observed futures]).
PyObject* state_names[4];
PyObject* unsettled_names[4];

PyObject* str_invoke;
PyObject* str_invoke_on_lane;

FutureObject* self_of(PyObject* self) { return reinterpret_cast<FutureObject*>(self); }

int traverse(PyObject* self, visitproc visit, void* arg) {
  auto* f = self_of(self);
  Py_VISIT(f->result);
  Py_VISIT(f->exception);
  Py_VISIT(f->lane);
  Py_VISIT(f->cond);
  Py_VISIT(f->waiters);
  Py_VISIT(f->callbacks);
  return 0;
}

int clear(PyObject* self) {
  auto* f = self_of(self);
  if (f->cond != nullptr) detach_future_lock(f->cond);  // the lock may outlive the future
  Py_CLEAR(f->result);
  Py_CLEAR(f->exception);
  Py_CLEAR(f->lane);
  Py_CLEAR(f->cond);
  Py_CLEAR(f->waiters);
  Py_CLEAR(f->callbacks);
  return 0;
}

void dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  clear(self);
  self_of(self)->state().~FutureState();
  Py_TYPE(self)->tp_free(self);
}

PyObject* no_new(PyTypeObject*, PyObject*, PyObject*) {
  PyErr_SetString(PyExc_TypeError, "pydflash futures are made by lanes (Lane.submit)");
  return nullptr;
}

// Note [Futures across fork]: a child forked while a task was queued has no worker to
// run it, so waiting for it would never end. Sets RuntimeError and returns true when
// `f` waits for a lane of the parent process.
bool orphaned_by_fork(FutureObject* f) {
  if (!f->state().made_before_fork()) return false;
  try {
    py::handle lane = PyWeakref_GetObject(f->lane);  // borrowed; None once it is gone
    const std::string message =
        "this future's task was queued on pydflash " +
        (lane.is_none() ? std::string("a lane")
                        : lane.attr(entry::kLaneLabel.attr()).cast<std::string>()) +
        " before a fork and cannot finish in the forked child (pid " + std::to_string(getpid()) +
        "); create a new Dispatcher in the child";
    PyErr_SetString(PyExc_RuntimeError, message.c_str());
  } catch (...) {
    set_python_error(std::current_exception());
  }
  return true;
}

// Waits; sets TimeoutError/KeyboardInterrupt and returns false when it ends undone.
bool wait_or_raise(FutureObject* f, PyObject* timeout_arg) {
  const double timeout = parse_timeout(timeout_arg);
  if (timeout == -2.0) return false;
  if (orphaned_by_fork(f)) return false;
  try {
    if (wait_interruptibly(f->state(), timeout)) return true;
  } catch (py::error_already_set& e) {
    e.restore();
    return false;
  }
  PyErr_SetNone(PyExc_TimeoutError);
  return false;
}

PyObject* call_python(PyObject* self, const char* method, PyObject* arg) {
  return PyObject_CallMethod(self, method, arg ? "O" : nullptr, arg);
}

PyObject* result(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  auto* f = self_of(self);
  PyObject* timeout = nargs > 0 ? args[0] : nullptr;
  if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0) timeout = args[nargs];
  if (!f->state().done() && !wait_or_raise(f, timeout)) return nullptr;
  if (f->state().status() == FutureStatus::Finished && f->exception == nullptr &&
      !f->state().error()) {
    PyObject* r = f->result ? f->result : Py_None;
    Py_INCREF(r);
    return r;
  }
  // Cancelled or failed: rare.
  return call_python(self, entry::kFutureRaiseFailure.attr(), nullptr);
}

PyObject* wait(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* f = self_of(self);
  if (!f->state().done() && !wait_or_raise(f, nargs > 0 ? args[0] : nullptr)) {
    if (!PyErr_ExceptionMatches(PyExc_TimeoutError)) return nullptr;
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* done(PyObject* self, PyObject*) { return PyBool_FromLong(self_of(self)->state().done()); }

PyObject* cancelled(PyObject* self, PyObject*) {
  return PyBool_FromLong(self_of(self)->state().status() == FutureStatus::Cancelled);
}

PyObject* running(PyObject* self, PyObject*) {
  return PyBool_FromLong(self_of(self)->state().status() == FutureStatus::Running);
}

PyObject* cancel(PyObject* self, PyObject*) {
  auto* f = self_of(self);
  if (f->state().try_cancel()) {
    notify_future(self);  // by the call that cancels
    Py_RETURN_TRUE;
  }
  return PyBool_FromLong(f->state().status() == FutureStatus::Cancelled);
}

// What the stdlib's wait() and as_completed() lock, made when first asked for: from then
// on the worker notifies this future (Note [Observed futures]).
PyObject* get_condition(PyObject* self, void*) {
  auto* f = self_of(self);
  // A forked child must not wait on the parent's lanes: wait() and as_completed() take
  // `_condition` first, and would otherwise wait forever.
  if (!f->state().done() && orphaned_by_fork(f)) return nullptr;
  if (f->cond == nullptr) {
    PyObject* lock = new_future_lock(self);
    if (lock == nullptr) return nullptr;
    f->cond = lock;
    f->state().mark_observed();
  }
  Py_INCREF(f->cond);
  return f->cond;
}

// Future.add_done_callback's locked part: appends `fn` to a future not yet done and
// returns True; returns False for a done one, whose caller runs `fn` itself, as the
// stdlib's does. The condition is taken without a hand-over to a waiting worker (Note
// [Handing the GIL to a waiting worker], future_lock.cpp): a callback added to a
// pending future runs on the thread that completes it.
PyObject* add_callback(PyObject* self, PyObject* fn) {
  auto* f = self_of(self);
  PyObject* cond = get_condition(self, nullptr);  // marks the future observed
  if (cond == nullptr) return nullptr;
  if (lock_future_lock(cond, -1.0) != 1) {
    Py_DECREF(cond);
    return nullptr;
  }
  bool added = false, failed = false;
  if (!f->state().done()) {
    failed = (f->callbacks == nullptr && (f->callbacks = PyList_New(0)) == nullptr) ||
             PyList_Append(f->callbacks, fn) < 0;
    added = !failed;
  }
  const bool unlocked = unlock_future_lock(cond);
  Py_DECREF(cond);
  if (failed || !unlocked) return nullptr;
  return PyBool_FromLong(added);
}

PyObject* get_state(PyObject* self, void*) {
  const FutureState& state = self_of(self)->state();
  // Settled first: a status read after it is at least as new.
  PyObject** names = state.settled() ? state_names : unsettled_names;
  PyObject* name = names[static_cast<int>(state.status())];
  Py_INCREF(name);
  return name;
}

PyObject* get_status(PyObject* self, void*) {
  return PyLong_FromLong(static_cast<int>(self_of(self)->state().status()));
}

PyObject* get_id(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(self_of(self)->state().id());
}

PyObject* get_event(PyObject* self, void*) {
  void* event = nullptr;
  try {
    event = self_of(self)->state().event_recorded_now();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(reinterpret_cast<uintptr_t>(event));
}

// The failure a task that ran without the interpreter left, as a new Python exception.
PyObject* get_native_failure(PyObject* self, void*) {
  const std::exception_ptr& error = self_of(self)->state().error();
  if (!error) Py_RETURN_NONE;
  return python_error(error);
}

PyObject* get_waiters(PyObject* self, void*) {
  auto* f = self_of(self);
  if (f->waiters == nullptr && (f->waiters = PyList_New(0)) == nullptr) return nullptr;
  Py_INCREF(f->waiters);
  return f->waiters;
}

PyMethodDef methods[] = {
    {"result", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(result)),
     METH_FASTCALL | METH_KEYWORDS, "result(timeout=None): the task's return value."},
    {"_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(wait)), METH_FASTCALL,
     "Waits (GIL released) until done; False on timeout."},
    {"done", done, METH_NOARGS, nullptr},
    {"cancelled", cancelled, METH_NOARGS, nullptr},
    {"running", running, METH_NOARGS, nullptr},
    {"cancel", cancel, METH_NOARGS,
     "Cancels the task if it has not started; True when it is cancelled."},
    {"_add_callback", add_callback, METH_O,
     "Adds a done callback to a future not yet done (True); False when it is done."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef getset[] = {
    {"_state", get_state, nullptr, "concurrent.futures' name for the state", nullptr},
    {"_condition", get_condition, nullptr, "what concurrent.futures.wait() locks", nullptr},
    {"_status", get_status, nullptr, nullptr, nullptr},
    {"_waiters", get_waiters, nullptr, nullptr, nullptr},
    {"_id", get_id, nullptr, nullptr, nullptr},
    {"event", get_event, nullptr,
     "The cudaEvent_t (as an int) recorded on the lane stream after the task; 0 on CPU lanes "
     "and while pending. A result that cannot hold a tensor gets its event when this is "
     "first read (Note [Deferred result events]).",
     nullptr},
    {"_native_failure", get_native_failure, nullptr,
     "The failure a task that ran without the interpreter left (a graph launch), as the "
     "exception bind_errors.cpp maps it to; None otherwise.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMemberDef members[] = {{"_result", T_OBJECT, offsetof(FutureObject, result), 0, nullptr},
                         {"_exception", T_OBJECT, offsetof(FutureObject, exception), 0, nullptr},
                         {"_lane", T_OBJECT, offsetof(FutureObject, lane), READONLY, nullptr},
                         {"_callbacks", T_OBJECT, offsetof(FutureObject, callbacks), 0, nullptr},
                         {nullptr, 0, 0, 0, nullptr}};

}  // namespace

void notify_future(PyObject* obj) {
  auto* f = self_of(obj);
  if (f->cond == nullptr) return;  // never observed: no waiter, no callback
  PyObject* cond = Py_NewRef(f->cond);
  // The stdlib's order: waiters are told under the condition, callbacks run after it.
  if (lock_future_lock(cond, -1.0) != 1) {  // lets the GIL go while it blocks
    PyErr_WriteUnraisable(obj);
    Py_DECREF(cond);
    return;
  }
  PyObject* callbacks = nullptr;
  if (!f->state().settled()) {
    Outcome outcome = Outcome::Result;
    if (f->state().status() == FutureStatus::Cancelled) {
      outcome = Outcome::Cancelled;
    } else if (f->exception != nullptr || f->state().error()) {
      outcome = Outcome::Exception;
    }
    // Waiters come and go only under the condition, which this thread holds.
    for (Py_ssize_t i = 0; f->waiters != nullptr && i < PyList_GET_SIZE(f->waiters); ++i) {
      PyObject* waiter = Py_NewRef(PyList_GET_ITEM(f->waiters, i));
      if (!tell_waiter(waiter, obj, outcome)) PyErr_WriteUnraisable(waiter);
      Py_DECREF(waiter);
    }
    f->state().mark_notified();
    callbacks = f->callbacks;
    f->callbacks = nullptr;
  }
  if (!unlock_future_lock(cond)) PyErr_WriteUnraisable(obj);
  Py_DECREF(cond);
  // On a lane's worker a callback's every exception is logged (_invoke_on_lane), as a
  // ThreadPoolExecutor worker logs what escapes it; elsewhere (a cancel) as the stdlib's.
  PyObject* invoke = Lane::on_a_worker() ? str_invoke_on_lane : str_invoke;
  for (Py_ssize_t i = 0; callbacks != nullptr && i < PyList_GET_SIZE(callbacks); ++i) {
    PyObject* r = PyObject_CallMethodOneArg(obj, invoke, PyList_GET_ITEM(callbacks, i));
    if (r == nullptr) PyErr_WriteUnraisable(obj);
    Py_XDECREF(r);
  }
  Py_XDECREF(callbacks);
}

bool wait_interruptibly(FutureState& state, double timeout_s) {
  if (state.done()) return true;
  bool interrupted = false;
  std::function<bool()> check_signals;
  if (on_main_thread()) {  // only the main thread runs signal handlers
    check_signals = [&] {
      GilHeld gil;
      // An exception raised by a handler stays set until re-raised below.
      interrupted = PyErr_CheckSignals() != 0;
      return interrupted;
    };
  }
  // Note [Adaptive polling]; asked here, while this lane is not yet paused for a quiet.
  const int64_t spin_ns = Lane::calling_worker_stream_busy() ? 0 : kWaitSpinNs;
  // Note [Never retaking the GIL at exit].
  const bool finished = without_gil([&] {
    WaitingWithoutGil waiting;  // Note [Entering when the GIL is free]
    return state.wait(timeout_s, spin_ns, kWaitSliceNs, check_signals);
  });
  if (interrupted) throw py::error_already_set();
  return finished;
}

std::shared_ptr<FutureState> state_of(PyObject* future) {
  // Aliasing an empty owner: no reference count to update on either thread.
  return std::shared_ptr<FutureState>(std::shared_ptr<FutureState>{}, &self_of(future)->state());
}

FutureObject* as_future(PyObject* obj) {
  return PyObject_TypeCheck(obj, &FutureBaseType) ? self_of(obj) : nullptr;
}

PyObject* new_future(PyObject* type, uint64_t id, PyObject* lane) {
  auto* tp = reinterpret_cast<PyTypeObject*>(type);
  PyObject* obj = tp->tp_alloc(tp, 0);  // zeroed
  if (obj == nullptr) return nullptr;
  auto* f = self_of(obj);
  new (f->state_storage) FutureState(id);
  // A weak reference (the lane's shared one: no allocation once it exists), so that a
  // future does not keep its lanes open (Note [Lanes open while held], pydflash/lanes/lane.py).
  f->lane = PyWeakref_CheckRef(lane) ? Py_NewRef(lane) : PyWeakref_NewRef(lane, nullptr);
  if (f->lane == nullptr) {
    Py_DECREF(obj);
    return nullptr;
  }
  return obj;
}

void add_future_type(PyObject* module) {
  PyObject* base = PyImport_ImportModule("concurrent.futures._base");
  if (base == nullptr) throw py::error_already_set();
  const char* names[4] = {"PENDING", "RUNNING", "CANCELLED_AND_NOTIFIED", "FINISHED"};
  // Done, observers not yet told: a stdlib future cancelled but not yet notified shows
  // CANCELLED; one finishing is still RUNNING until its waiters were told.
  const char* unsettled[4] = {"PENDING", "RUNNING", "CANCELLED", "RUNNING"};
  for (int i = 0; i < 4; ++i) {
    state_names[i] = PyObject_GetAttrString(base, names[i]);
    unsettled_names[i] = PyObject_GetAttrString(base, unsettled[i]);
  }
  Py_DECREF(base);
  add_future_lock_type(module);
  str_invoke = PyUnicode_InternFromString(entry::kFutureInvoke.attr());
  str_invoke_on_lane = PyUnicode_InternFromString(entry::kFutureInvokeOnLane.attr());
  init_stdlib_waiters();

  FutureBaseType.tp_name = "pydflash._C.FutureBase";
  FutureBaseType.tp_basicsize = sizeof(FutureObject);
  FutureBaseType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC;
  FutureBaseType.tp_doc = "Native half of pydflash.Future.";
  FutureBaseType.tp_new = no_new;
  FutureBaseType.tp_dealloc = dealloc;
  FutureBaseType.tp_traverse = traverse;
  FutureBaseType.tp_clear = clear;
  FutureBaseType.tp_methods = methods;
  FutureBaseType.tp_getset = getset;
  FutureBaseType.tp_members = members;
  if (PyType_Ready(&FutureBaseType) < 0) throw py::error_already_set();
  Py_INCREF(&FutureBaseType);
  if (PyModule_AddObject(module, "FutureBase", reinterpret_cast<PyObject*>(&FutureBaseType)) < 0)
    throw py::error_already_set();
}

}  // namespace pydflash::python
