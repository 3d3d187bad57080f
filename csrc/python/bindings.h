// One init_<part> per binding file; module.cpp calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

#include "python/entry_points.h"

namespace pydflash::python {

void init_errors(pybind11::module_& m);
/// Sets the Python error matching a caught C++ exception (typed core errors map to
/// ValueError, TypeError, RuntimeError, TimeoutError, CudaError...).
void set_python_error(std::exception_ptr p);
/// The same mapping as a new exception object, for a failure stored to be raised later.
PyObject* python_error(std::exception_ptr p);
void init_device(pybind11::module_& m);

/// Note [No static locals that call Python]: a function-local static is guarded by a
/// C++ lock held during its initializer. If that initializer imports (and so lets the
/// GIL go), a second thread can block on the guard while holding the GIL: deadlock.
/// Python objects needed later are cached in plain globals set under the GIL instead,
/// through this: `slot` gets module.name on first use. A lost race only imports twice.
inline PyObject* cached_attr(PyObject*& slot, const EntryPoint& entry) {
  if (slot == nullptr)
    slot =
        pybind11::object(pybind11::module_::import(entry.module).attr(entry.name)).release().ptr();
  return slot;
}
void init_lane(pybind11::module_& m);
void init_compile_queue(pybind11::module_& m);

}  // namespace pydflash::python
