// _C.FutureLock: a future's `_condition`, the reentrant lock concurrent.futures.wait()
// and as_completed() take around checking a future and installing their waiter, and
// the worker takes around telling those waiters. A Python object for the stdlib's code
// (acquire, release, `with`), and plain C calls for the worker.
#pragma once

#include <Python.h>

namespace pydflash::python {

/// Readies the type and adds it to the module as FutureLock.
void add_future_lock_type(PyObject* module);

/// A new, unlocked FutureLock for `future` (borrowed: the future outlives its use here,
/// and calls detach_future_lock when it goes).
PyObject* new_future_lock(PyObject* future);
void detach_future_lock(PyObject* lock);

/// Takes the lock for this thread, again if it holds it; blocks without the GIL while
/// another thread holds it. Entered. timeout_s < 0 waits forever. Returns 1 when taken,
/// 0 on timeout, -1 with a Python error set (a signal handler raised).
int lock_future_lock(PyObject* lock, double timeout_s);

/// Lets go once. Entered. False with RuntimeError set when this thread does not hold it.
bool unlock_future_lock(PyObject* lock);

}  // namespace pydflash::python
