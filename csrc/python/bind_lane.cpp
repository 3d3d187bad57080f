// _C.Lane and _C.FutureState: thin wrappers; the Executor API is pydflash/lane.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "core/lane.h"
#include "cuda/device_api.h"
#include "python/bindings.h"
#include "python/lane_runtime.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

constexpr int64_t kWaitSpinNs = 30'000;     // poll this long before sleeping
constexpr int64_t kWaitSliceNs = 20'000'000;  // check for Ctrl-C this often

struct PyLane {
  std::shared_ptr<LaneRuntime> rt;
  std::shared_ptr<Lane> lane;
};

double timeout_seconds(const py::object& timeout) {
  if (timeout.is_none()) return -1.0;
  const double t = timeout.cast<double>();
  return t < 0 ? 0.0 : t;
}

// Releases the GIL while waiting; between slices takes it back to run signal
// handlers, so Ctrl-C interrupts the wait with KeyboardInterrupt.
bool wait_interruptibly(FutureState& state, double timeout_s) {
  if (state.published()) return true;
  bool interrupted = false;
  bool done;
  {
    py::gil_scoped_release nogil;
    done = state.wait(timeout_s, kWaitSpinNs, kWaitSliceNs, [&] {
      py::gil_scoped_acquire gil;
      // The exception a handler raises stays set on this thread until re-raised below.
      interrupted = PyErr_CheckSignals() != 0;
      return interrupted;
    });
  }
  if (interrupted) throw py::error_already_set();
  return done;
}

void finish_cancelled(std::vector<Task>& tasks) {
  for (auto& task : tasks) {
    if (task.future->observed()) task.body->notify(*task.future);
  }
  tasks.clear();  // bodies die here, under the GIL
}

}  // namespace

void init_lane(py::module_& m) {
  py::class_<FutureState, std::shared_ptr<FutureState>>(m, "FutureState")
      .def_property_readonly("id", &FutureState::id)
      .def_property_readonly("status", [](const FutureState& s) { return static_cast<int>(s.status()); })
      .def("done", &FutureState::done)
      .def("published", &FutureState::published)
      .def("cancel", &FutureState::cancel)
      .def("mark_observed", &FutureState::mark_observed)
      .def(
          "wait",
          [](FutureState& s, py::object timeout) { return wait_interruptibly(s, timeout_seconds(timeout)); },
          py::arg("timeout") = py::none())
      .def_property_readonly("native_error",
                             [](const FutureState& s) -> py::object {
                               if (s.native_error() == NativeError::None) return py::none();
                               return py::make_tuple(static_cast<int>(s.native_error()),
                                                     s.native_error_message());
                             })
      .def_property_readonly("event",
                             [](const FutureState& s) { return reinterpret_cast<uintptr_t>(s.event()); })
      .def(
          "stream_wait",
          [](const FutureState& s, uintptr_t stream) {
            PYDFLASH_CHECK_STATE(s.event() != nullptr,
                                 "this future has no CUDA event (a CPU lane, or not finished)");
            device::stream_wait_event(reinterpret_cast<void*>(stream), s.event());
          },
          py::arg("stream"))
      .def_property_readonly("times", [](const FutureState& s) {
        return py::make_tuple(s.submit_ns.load(), s.start_ns.load(), s.end_ns.load());
      });

  py::class_<PyLane>(m, "Lane")
      .def(py::init([](int index, int device, std::string label, py::object future_type,
                       double spin_us) {
             PYDFLASH_CHECK_VALUE(spin_us >= 0, "expected spin_us >= 0, got ", spin_us);
             LaneOptions options;
             options.spin_ns = static_cast<int64_t>(spin_us * 1000);
             auto rt = std::make_shared<LaneRuntime>(std::move(label), std::move(future_type));
             auto lane = std::make_shared<Lane>(index, device, rt, options);
             lane->start();
             return PyLane{rt, lane};
           }),
           py::arg("index"), py::arg("device"), py::arg("label"), py::arg("future_type"),
           py::arg("spin_us"))
      .def_property_readonly("index", [](const PyLane& l) { return l.lane->index(); })
      .def_property_readonly("device", [](const PyLane& l) { return l.lane->device(); })
      .def_property_readonly("label", [](const PyLane& l) { return l.rt->label; })
      .def_property_readonly("stream",
                             [](const PyLane& l) { return reinterpret_cast<uintptr_t>(l.lane->stream()); })
      .def_property_readonly("copy_stream", [](const PyLane& l) {
        return reinterpret_cast<uintptr_t>(l.lane->copy_stream());
      })
      .def(
          "submit",
          [](PyLane& l, py::object fn, py::tuple args, py::object kwargs, py::handle owner) {
            PYDFLASH_CHECK_TYPE(PyCallable_Check(fn.ptr()), "expected a callable, got ",
                                std::string(py::str(py::type::of(fn).attr("__name__"))));
            auto state = l.lane->new_future();
            py::object future = make_python_future(*l.rt, state, owner);
            l.lane->submit(state, make_python_task(l.rt, std::move(fn), std::move(args),
                                                   std::move(kwargs), future, l.lane->tracing()));
            return future;
          },
          py::arg("fn"), py::arg("args"), py::arg("kwargs"), py::arg("owner"))
      .def(
          "submit_graph",
          [](PyLane& l, uintptr_t graph_exec, py::object keepalive, py::handle owner) {
            PYDFLASH_CHECK_VALUE(l.lane->is_gpu(), "graphs run on GPU lanes; ", l.rt->label,
                                 " is a CPU lane");
            PYDFLASH_CHECK_VALUE(graph_exec != 0, "expected a captured graph, got a null handle");
            auto state = l.lane->new_future();
            py::object future = make_python_future(*l.rt, state, owner);
            l.lane->submit(state, make_graph_task(l.rt, graph_exec, std::move(keepalive), future));
            return future;
          },
          py::arg("graph_exec"), py::arg("keepalive"), py::arg("owner"))
      .def("load", [](const PyLane& l) { return l.lane->load(); })
      .def("stats",
           [](const PyLane& l) {
             LaneStats s = l.lane->stats();
             py::dict d;
             d["submitted"] = s.submitted;
             d["completed"] = s.completed;
             d["cancelled"] = s.cancelled;
             d["queued"] = s.queued;
             d["running"] = s.running;
             d["on_device"] = s.on_device;
             d["busy_s"] = s.busy_ns * 1e-9;
             d["queue_wait_s"] = s.queue_wait_ns * 1e-9;
             return d;
           })
      .def(
          "shutdown",
          [](PyLane& l, bool cancel) {
            auto cancelled = l.lane->shutdown(cancel);
            const auto count = cancelled.size();
            finish_cancelled(cancelled);
            return count;
          },
          py::arg("cancel"))
      .def(
          "join",
          [](PyLane& l, py::object timeout) {
            const double t = timeout_seconds(timeout);
            py::gil_scoped_release nogil;
            return l.lane->join(t);
          },
          py::arg("timeout") = py::none())
      .def_property_readonly("closed", [](const PyLane& l) { return l.lane->closed(); })
      .def_property_readonly("forked", [](const PyLane& l) { return l.lane->forked(); })
      .def("set_tracing", [](PyLane& l, bool on) { l.lane->set_tracing(on); })
      .def("take_trace", [](PyLane& l) {
        // Off the hot path: waits for the GPU spans' events and converts them to
        // nanoseconds on the host clock, relative to the epoch taken at set_tracing.
        auto records = l.lane->take_trace();
        py::list out;
        const int64_t epoch_ns = l.lane->trace_epoch_ns();
        void* epoch = l.lane->trace_epoch_event();
        for (auto& r : records) {
          py::object gpu = py::none();
          if (r.gpu_begin != nullptr && r.gpu_end != nullptr) {
            {
              py::gil_scoped_release nogil;
              device::synchronize_event(r.gpu_end);
            }
            const double begin_ms = device::elapsed_ms(epoch, r.gpu_begin);
            const double end_ms = device::elapsed_ms(epoch, r.gpu_end);
            gpu = py::make_tuple(epoch_ns + static_cast<int64_t>(begin_ms * 1e6),
                                 epoch_ns + static_cast<int64_t>(end_ms * 1e6));
          }
          if (r.gpu_begin) device::destroy_event(r.gpu_begin);
          if (r.gpu_end) device::destroy_event(r.gpu_end);
          out.append(py::make_tuple(r.id, r.label, r.submit_ns, r.start_ns, r.end_ns, gpu));
        }
        return out;
      });
}

}  // namespace pydflash::python
