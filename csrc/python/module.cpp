#include <pybind11/pybind11.h>

#include <iterator>

#include "core/device_api.h"
#include "python/bindings.h"
#include "python/entry_points.h"
#include "python/gil.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "pydflash native core: lanes, futures, the compile queue and CUDA streams";
  m.attr("__version__") = PYDFLASH_VERSION;
  py::dict info;
  info["version"] = PYDFLASH_VERSION;
  info["with_cuda"] = static_cast<bool>(PYDFLASH_WITH_CUDA);
  info["sanitizer"] = PYDFLASH_SANITIZER;
  info["compiler"] = __VERSION__;
  info["cplusplus"] = __cplusplus;
  m.attr("BUILD") = info;
  // Note [Python entry points]: (module, name) of each, for the test that resolves them.
  py::tuple entry_points(std::size(pydflash::python::entry::kAll));
  for (size_t i = 0; i < entry_points.size(); ++i) {
    const auto& entry = pydflash::python::entry::kAll[i];
    entry_points[i] = py::make_tuple(entry.module, entry.name);
  }
  m.attr("PYTHON_ENTRY_POINTS") = entry_points;
  // Note [Never retaking the GIL at exit]: the thread that will finalize.
  pydflash::python::remember_main_thread(
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  pydflash::python::init_errors(m);
  pydflash::python::init_device(m);
  pydflash::python::init_lane(m);
  pydflash::python::init_compile_queue(m);
}
