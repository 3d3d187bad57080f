// _C.FutureBase: the C half of pydflash.Future (pydflash/lanes/_future.py subclasses it
// together with concurrent.futures.Future). Creation, result() and done() run here
// without Python frames: they sit on the dispatch hot path.
#pragma once

#include <Python.h>

#include <memory>
#include <new>

#include "core/future.h"

namespace pydflash::python {

struct FutureObject {
  PyObject_HEAD
  PyObject* result;     // set by the worker
  PyObject* exception;  // set by the worker (with a note naming the lane)
  PyObject* lane;       // a weak reference to the pydflash.Lane that runs it
  PyObject* cond;       // `_condition`: a _thread.RLock, made when first observed
  PyObject* waiters;    // list, made on first use (concurrent.futures.wait)
  PyObject* callbacks;  // list of done callbacks
  // The native state lives in the object, not beside it: one allocation per task, from
  // Python's allocator. A queued task refers to it without owning it; its body owns the
  // object. Raw storage keeps this struct standard-layout for the member table.
  alignas(FutureState) unsigned char state_storage[sizeof(FutureState)];

  FutureState& state() { return *std::launder(reinterpret_cast<FutureState*>(state_storage)); }
};

/// Readies the type and adds it to the module as FutureBase.
void add_future_type(PyObject* module);

/// A new instance of `type` (a Python subclass of FutureBase) for the task `id` of `lane`
/// (a pydflash.Lane or a weak reference to one).
PyObject* new_future(PyObject* type, uint64_t id, PyObject* lane);

/// The native state of a Python future, for a task that does not own it.
std::shared_ptr<FutureState> state_of(PyObject* future);

FutureObject* as_future(PyObject* obj);

/// Tells the future's concurrent.futures waiters that it is done and runs its done
/// callbacks, once: a future already settled is left alone (Note [Observed futures]).
/// Entered; errors raised by waiters or callbacks are reported as unraisable.
void notify_future(PyObject* future);

/// Releases the GIL while waiting, checking for signals between slices; true when done.
/// Throws pybind11::error_already_set when a signal handler raised.
bool wait_interruptibly(FutureState& state, double timeout_s);

}  // namespace pydflash::python
