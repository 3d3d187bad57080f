// CUDA device queries and the few stream/event operations Python needs. Pointers
// cross as integers (what torch.cuda.ExternalStream and Event.cuda_event take).
#include <pybind11/pybind11.h>

#include "core/device_api.h"
#include "python/bindings.h"
#include "python/gil.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

void* as_ptr(uintptr_t value) { return reinterpret_cast<void*>(value); }

}  // namespace

void init_device(py::module_& m) {
  m.def("compiled_with_cuda", &device::compiled_with_cuda);
  m.def("device_count", &device::device_count,
        "Visible CUDA devices; 0 without a driver or device (never raises).");
  m.def("unavailable_reason", &device::unavailable_reason);
  m.def("runtime_version", &device::runtime_version);
  m.def("driver_version", &device::driver_version);
  m.def(
      "busy_wait",
      [](uintptr_t stream, uint64_t ns, int blocks) {
        device::busy_wait(as_ptr(stream), ns, blocks);
      },
      py::arg("stream"), py::arg("ns"), py::arg("blocks") = 1,
      "Queues a kernel that keeps `blocks` thread blocks busy for `ns` nanoseconds.");
  m.def(
      "stream_wait_event",
      [](uintptr_t stream, uintptr_t event) {
        device::stream_wait_event(as_ptr(stream), as_ptr(event));
      },
      py::arg("stream"), py::arg("event"));
  m.def(
      "synchronize_stream",
      [](uintptr_t stream) { without_gil([&] { device::synchronize_stream(as_ptr(stream)); }); },
      py::arg("stream"));
  m.def(
      "query_event", [](uintptr_t event) { return device::query_event(as_ptr(event)); },
      py::arg("event"));
}

}  // namespace pydflash::python
