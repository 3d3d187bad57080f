// _C.FutureBase: the C half of pydflash.Future (pydflash/_future.py subclasses it
// together with concurrent.futures.Future). Creation, result() and done() run here
// without Python frames: they sit on the dispatch hot path.
#pragma once

#include <Python.h>

#include <memory>

#include "core/future.h"

namespace pydflash::python {

struct FutureObject {
  PyObject_HEAD
  std::shared_ptr<FutureState> state;
  PyObject* result;     // set by the worker
  PyObject* exception;  // set by the worker (with a note naming the lane)
  PyObject* lane;       // the pydflash.Lane that runs it
  PyObject* cond;       // threading.Condition, made when first observed
  PyObject* waiters;    // list, made on first use (concurrent.futures.wait)
  PyObject* callbacks;  // list of done callbacks
};

/// Readies the type and adds it to the module as FutureBase.
void add_future_type(PyObject* module);

/// A new instance of `type` (a Python subclass of FutureBase) owning `state`.
PyObject* new_future(PyObject* type, std::shared_ptr<FutureState> state, PyObject* lane);

FutureObject* as_future(PyObject* obj);

/// Seconds from a Python timeout: null or None is -1 (wait forever), a negative number
/// is 0. Returns -2 with a Python error set when it is not a number.
double parse_timeout(PyObject* timeout);

/// Releases the GIL while waiting, checking for signals between slices; true when done.
/// Throws pybind11::error_already_set when a signal handler raised.
bool wait_interruptibly(FutureState& state, double timeout_s);

}  // namespace pydflash::python
