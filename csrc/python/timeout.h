// Note [One timeout rule]: every timeout pydflash takes (Future.result and exception,
// concurrent.futures.wait on our futures, Lane.join, compile_queue.run and set_timeout,
// wait_all) reads as concurrent.futures reads it: None waits forever, a number is
// seconds, and zero, a negative number or NaN does not wait (threading.Condition.wait
// polls once for anything not > 0). Anything else is a TypeError. Past the stdlib:
// infinity waits forever, as None does (threading refuses it); a finite timeout longer
// than threading.TIMEOUT_MAX is an OverflowError, as threading's is, rather than a
// deadline that wraps to the past.
#pragma once

#include <Python.h>

#include <cmath>

#include "core/clock.h"

namespace pydflash::python {

/// Seconds to wait: -1 for forever (null, None or inf), else in [0, kMaxTimeoutS].
/// Returns -2 with a TypeError or OverflowError set when `timeout` is not a number or
/// too long.
inline double parse_timeout(PyObject* timeout) {
  if (timeout == nullptr || timeout == Py_None) return -1.0;
  const double t = PyFloat_AsDouble(timeout);
  const bool overflow =
      t == -1.0 && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_OverflowError);
  if (overflow || (std::isfinite(t) && t > kMaxTimeoutS)) {
    PyErr_Clear();
    static_assert(kMaxTimeoutS == 9223372036.0, "the message below names it");
    constexpr const char* kExpected =
        "expected a timeout of at most threading.TIMEOUT_MAX (9223372036 s), or None or "
        "float('inf') to wait forever, got ";
    if (overflow) {  // an int too large for a float: its digits would fill the screen
      PyErr_Format(PyExc_OverflowError, "%san int too large to convert to float", kExpected);
    } else {
      PyErr_Format(PyExc_OverflowError, "%s%R", kExpected, timeout);
    }
    return -2.0;
  }
  if (t == -1.0 && PyErr_Occurred()) {
    PyErr_Format(PyExc_TypeError, "expected a timeout in seconds or None, got %s",
                 Py_TYPE(timeout)->tp_name);
    return -2.0;
  }
  if (std::isinf(t) && t > 0) return -1.0;
  return t > 0 ? t : 0.0;
}

}  // namespace pydflash::python
