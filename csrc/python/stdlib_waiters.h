// Telling concurrent.futures' waiters that a future is done, as its Future.set_result,
// set_exception and cancel do, from the thread that completed the future.
#pragma once

#include <Python.h>

namespace pydflash::python {

enum class Outcome { Result, Exception, Cancelled };

/// Calls waiter.add_result(future), add_exception or add_cancelled (Note [The stdlib's
/// waiters]). Entered; false with a Python error set when the waiter raised.
bool tell_waiter(PyObject* waiter, PyObject* future, Outcome outcome);

/// Reads the stdlib's waiter classes once (module import).
void init_stdlib_waiters();

/// Whether the stdlib's own waiters are told without running their methods.
bool stdlib_waiters_native();

}  // namespace pydflash::python
