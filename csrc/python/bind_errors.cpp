// Maps the core's typed C++ errors onto Python exceptions (one test each in
// tests/test_errors.py). pydflash-specific types live in pydflash/errors.py.
#include <pybind11/pybind11.h>

#include "core/compile_queue.h"
#include "core/error.h"
#include "python/bindings.h"
#include "python/entry_points.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

void set_error_from_module(const EntryPoint& error, const char* what) {
  try {
    py::object type = py::module_::import(error.module).attr(error.name);
    PyErr_SetString(type.ptr(), what);
  } catch (py::error_already_set& e) {
    e.restore();  // the import failed: report that instead
  }
}

}  // namespace

void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const InputError& e) {
    set_error_from_module(entry::kInputFailedError, e.what());
  } catch (const StateError& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const CompileQueueTimeout& e) {
    set_error_from_module(entry::kCompileQueueTimeout, e.what());
  } catch (const TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (const CudaError& e) {
    set_error_from_module(entry::kCudaError, e.what());
  } catch (const InternalError& e) {
    set_error_from_module(entry::kInternalError, e.what());
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

PyObject* python_error(std::exception_ptr p) {
  set_python_error(std::move(p));
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

void init_errors(py::module_&) {
  // Module-local: global translators are shared with every extension built against the
  // same pybind11 internals (torch among them), and are tried in an order we don't own.
  // Only pydflash's own errors; anything else falls through to pybind11's defaults.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      std::rethrow_exception(p);
    } catch (const Error&) {
      set_python_error(p);
    }
  });
}

}  // namespace pydflash::python
