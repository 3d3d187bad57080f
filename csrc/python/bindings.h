// One init_<part> per binding file; module.cpp calls them in order.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>

namespace pydflash::python {

void init_errors(pybind11::module_& m);
/// Sets the Python error matching a caught C++ exception (typed core errors map to
/// ValueError, TypeError, RuntimeError, TimeoutError, CancelledError, CudaError...).
void set_python_error(std::exception_ptr p);
void init_device(pybind11::module_& m);
void init_lane(pybind11::module_& m);
void init_compile_queue(pybind11::module_& m);

}  // namespace pydflash::python
