#include "python/bindings.h"

namespace pydflash::python {
void init_compile_queue(pybind11::module_&) {}
}  // namespace pydflash::python
