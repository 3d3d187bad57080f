// One init_<part> per binding file; module.cpp calls them in order.
#pragma once

#include <pybind11/pybind11.h>

namespace pydflash::python {

void init_errors(pybind11::module_& m);
void init_device(pybind11::module_& m);
void init_lane(pybind11::module_& m);
void init_compile_queue(pybind11::module_& m);

}  // namespace pydflash::python
