#include "python/stdlib_waiters.h"

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace pydflash::python {
namespace {

// Note [The stdlib's waiters]: concurrent.futures.wait() and as_completed() install one
// of three waiter classes of concurrent.futures._base on every future they wait for.
// Their add_* methods are a few lines of Python, yet about 1 µs per future on the
// worker, more than the task itself. For exactly those classes the worker does what
// the methods do without running them, in their order: append to finished_futures,
// then count down or set the event, under the waiter's lock as the methods take it
// (the count-down leaves it out where no thread could tell, count_down_without_lock).
// Any other waiter (a
// subclass, another library's) has its method called; so do all of them when the
// classes no longer have the shape read here (checked at import) or were changed since
// (a patched method changes the class's version tag). tests/test_future.py compares
// both paths on the running Python.
// One liberty: an as_completed waiter's event that is already set is not set again.
// Setting a set Event wakes nobody, and it is cleared only under the waiter's lock,
// which is held here.
enum class Kind { Other, AllCompleted, FirstCompleted, AsCompleted };

PyObject* method_names[3];  // add_result, add_exception, add_cancelled, by Outcome
struct Known {
  PyTypeObject* type = nullptr;
  unsigned int version = 0;  // the class as read at import; changes when it is modified
};
Known all_completed, first_completed, as_completed;
bool shape_known = false;

PyObject* str_finished_futures;
PyObject* str_lock;
PyObject* str_event;
PyObject* str_num_pending_calls;
PyObject* str_stop_on_exception;
PyObject* str_acquire;
PyObject* str_release;
PyObject* str_locked;
PyObject* str_set;
PyObject* str_is_set;
PyObject* one;

bool matches(PyTypeObject* type, const Known& known) {
  return type == known.type && type->tp_version_tag == known.version &&
         PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
}

Kind kind_of(PyObject* waiter) {
  if (!shape_known) return Kind::Other;
  PyTypeObject* type = Py_TYPE(waiter);
  if (matches(type, all_completed)) return Kind::AllCompleted;
  if (matches(type, first_completed)) return Kind::FirstCompleted;
  if (matches(type, as_completed)) return Kind::AsCompleted;
  return Kind::Other;
}

bool call_method(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, name);
  Py_XDECREF(r);
  return r != nullptr;
}

// obj.name.method(), as `self.event.set()` reads.
bool call_attr_method(PyObject* obj, PyObject* name, PyObject* method) {
  PyObject* attr = PyObject_GetAttr(obj, name);
  if (attr == nullptr) return false;
  const bool ok = call_method(attr, method);
  Py_DECREF(attr);
  return ok;
}

// self.finished_futures.append(future)
bool append_finished(PyObject* waiter, PyObject* future) {
  PyObject* finished = PyObject_GetAttr(waiter, str_finished_futures);
  if (finished == nullptr) return false;
  const int rc = PyList_Append(finished, future);
  Py_DECREF(finished);
  return rc == 0;
}

// `with self.lock: body()`; the lock's acquire lets the GIL go while it blocks.
template <typename Body>
bool with_lock(PyObject* waiter, Body body) {
  PyObject* lock = PyObject_GetAttr(waiter, str_lock);
  if (lock == nullptr) return false;
  if (!call_method(lock, str_acquire)) {
    Py_DECREF(lock);
    return false;
  }
  bool ok = body();
  // An error from the body stays set across release, as `with` re-raises it after __exit__.
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  const bool released = call_method(lock, str_release);
  Py_DECREF(lock);
  if (type != nullptr) {
    if (released) {
      PyErr_Restore(type, value, tb);
    } else {
      Py_DECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
    }
  }
  return ok && released;
}

// The count-down below without the waiter's lock: 1 when done, 0 when the lock is
// needed, -1 with a Python error set. Under the GIL, a section that cannot let the GIL
// go (attribute reads and writes of the known class, int arithmetic) excludes every
// other Python thread by itself. The lock is needed when a thread holds it (it may
// have let the GIL go inside its section), and when the count reaches zero: setting the
// event runs Python code.
int count_down_without_lock(PyObject* waiter) {
#ifdef Py_GIL_DISABLED
  return 0;
#endif
  PyObject* lock = PyObject_GetAttr(waiter, str_lock);
  if (lock == nullptr) return -1;
  PyObject* held = PyObject_CallMethodNoArgs(lock, str_locked);
  Py_DECREF(lock);
  if (held == nullptr) {
    PyErr_Clear();  // a lock that cannot say: take it
    return 0;
  }
  const bool free = held == Py_False;
  Py_DECREF(held);
  if (!free) return 0;
  PyObject* n = PyObject_GetAttr(waiter, str_num_pending_calls);
  if (n == nullptr) return -1;
  const long value = PyLong_CheckExact(n) ? PyLong_AsLong(n) : 0;
  Py_DECREF(n);
  if (value <= 1) {
    PyErr_Clear();  // an int beyond a long: the general path
    return 0;
  }
  PyObject* less = PyLong_FromLong(value - 1);
  const int rc = less == nullptr ? -1 : PyObject_SetAttr(waiter, str_num_pending_calls, less);
  Py_XDECREF(less);
  return rc < 0 ? -1 : 1;
}

// _AllCompletedWaiter._decrement_pending_calls
bool decrement_pending_calls(PyObject* waiter) {
  const int without_lock = count_down_without_lock(waiter);
  if (without_lock != 0) return without_lock == 1;
  return with_lock(waiter, [&] {
    PyObject* n = PyObject_GetAttr(waiter, str_num_pending_calls);
    if (n == nullptr) return false;
    PyObject* less = PyNumber_InPlaceSubtract(n, one);
    Py_DECREF(n);
    if (less == nullptr || PyObject_SetAttr(waiter, str_num_pending_calls, less) < 0) {
      Py_XDECREF(less);
      return false;
    }
    const int remaining = PyObject_IsTrue(less);
    Py_DECREF(less);
    if (remaining < 0) return false;
    return remaining == 1 || call_attr_method(waiter, str_event, str_set);
  });
}

bool tell_all_completed(PyObject* waiter, PyObject* future, Outcome outcome) {
  if (!append_finished(waiter, future)) return false;
  if (outcome == Outcome::Exception) {
    PyObject* stop = PyObject_GetAttr(waiter, str_stop_on_exception);
    if (stop == nullptr) return false;
    const int stop_now = PyObject_IsTrue(stop);
    Py_DECREF(stop);
    if (stop_now < 0) return false;
    if (stop_now == 1) return call_attr_method(waiter, str_event, str_set);
  }
  return decrement_pending_calls(waiter);
}

bool tell_as_completed(PyObject* waiter, PyObject* future) {
  return with_lock(waiter, [&] {
    if (!append_finished(waiter, future)) return false;
    PyObject* event = PyObject_GetAttr(waiter, str_event);
    if (event == nullptr) return false;
    PyObject* is_set = PyObject_CallMethodNoArgs(event, str_is_set);
    bool ok = is_set != nullptr;
    if (ok && is_set != Py_True) ok = call_method(event, str_set);
    Py_XDECREF(is_set);
    Py_DECREF(event);
    return ok;
  });
}

// Reads the class `name` of concurrent.futures._base, and whether a waiter made by
// `make` has the attributes the functions above use.
bool read_class(PyObject* base, const char* name, const char* make,
                std::initializer_list<PyObject*> attrs, Known& known) {
  PyObject* type = PyObject_GetAttrString(base, name);
  if (type == nullptr) return false;
  if (!PyType_Check(type)) {
    Py_DECREF(type);
    return false;
  }
  known.type = reinterpret_cast<PyTypeObject*>(type);  // kept for the process
  PyObject* waiter = PyRun_String(make, Py_eval_input, PyModule_GetDict(base), nullptr);
  if (waiter == nullptr) return false;
  bool ok = true;
  for (PyObject* name : attrs) ok = ok && PyObject_HasAttr(waiter, name);
  PyObject* finished = PyObject_GetAttr(waiter, str_finished_futures);
  ok = ok && finished != nullptr && PyList_CheckExact(finished);
  Py_XDECREF(finished);
  Py_DECREF(waiter);
  // The attribute lookups above gave the class a version tag.
  known.version = known.type->tp_version_tag;
  return ok && PyType_HasFeature(known.type, Py_TPFLAGS_VALID_VERSION_TAG);
}

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

}  // namespace

bool tell_waiter(PyObject* waiter, PyObject* future, Outcome outcome) {
  switch (kind_of(waiter)) {
    case Kind::AllCompleted:
      return tell_all_completed(waiter, future, outcome);
    case Kind::FirstCompleted:
      return append_finished(waiter, future) && call_attr_method(waiter, str_event, str_set);
    case Kind::AsCompleted:
      return tell_as_completed(waiter, future);
    case Kind::Other:
      break;
  }
  PyObject* r = PyObject_CallMethodOneArg(waiter, method_names[static_cast<int>(outcome)], future);
  Py_XDECREF(r);
  return r != nullptr;
}

void init_stdlib_waiters() {
  const char* names[3] = {"add_result", "add_exception", "add_cancelled"};
  for (int i = 0; i < 3; ++i) method_names[i] = intern(names[i]);
  str_finished_futures = intern("finished_futures");
  str_lock = intern("lock");
  str_event = intern("event");
  str_num_pending_calls = intern("num_pending_calls");
  str_stop_on_exception = intern("stop_on_exception");
  str_acquire = intern("acquire");
  str_release = intern("release");
  str_locked = intern("locked");
  str_set = intern("set");
  str_is_set = intern("is_set");
  one = PyLong_FromLong(1);

  PyObject* base = PyImport_ImportModule("concurrent.futures._base");
  if (base == nullptr) throw py::error_already_set();
  shape_known = read_class(base, "_AllCompletedWaiter", "_AllCompletedWaiter(1, False)",
                           {str_lock, str_event, str_num_pending_calls, str_stop_on_exception},
                           all_completed) &&
                read_class(base, "_FirstCompletedWaiter", "_FirstCompletedWaiter()", {str_event},
                           first_completed) &&
                read_class(base, "_AsCompletedWaiter", "_AsCompletedWaiter()",
                           {str_lock, str_event}, as_completed);
  Py_DECREF(base);
  PyErr_Clear();  // a stdlib that moved: call the methods
}

bool stdlib_waiters_native() { return shape_known; }

}  // namespace pydflash::python
