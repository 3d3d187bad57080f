// Note [One timeout rule]: every timeout pydflash takes (Future.result and exception,
// concurrent.futures.wait on our futures, Lane.join, compile_queue.run and set_timeout,
// wait_all) reads as concurrent.futures reads it: None waits forever, a number is
// seconds, and zero, a negative number or NaN does not wait (threading.Condition.wait
// polls once for anything not > 0). Anything else is a TypeError.
#pragma once

#include <Python.h>

namespace pydflash::python {

/// Seconds to wait: -1 for forever (null or None), else >= 0. Returns -2 with a
/// TypeError set when `timeout` is not a number.
inline double parse_timeout(PyObject* timeout) {
  if (timeout == nullptr || timeout == Py_None) return -1.0;
  const double t = PyFloat_AsDouble(timeout);
  if (t == -1.0 && PyErr_Occurred()) {
    PyErr_Format(PyExc_TypeError, "expected a timeout in seconds or None, got %s",
                 Py_TYPE(timeout)->tp_name);
    return -2.0;
  }
  return t > 0 ? t : 0.0;
}

}  // namespace pydflash::python
