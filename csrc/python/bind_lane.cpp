// _C.Lane and _C.submit: thin wrappers; the Executor API is pydflash/lane.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "core/lane.h"
#include "cuda/device_api.h"
#include "python/bindings.h"
#include "python/future_object.h"
#include "python/lane_runtime.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

struct PyLane {
  std::shared_ptr<LaneRuntime> rt;
  std::shared_ptr<Lane> lane;
};

// Queues fn(*args, **kwargs) on a lane; args[0] is fn. Returns a new reference.
PyObject* submit_to(PyLane& l, PyObject* owner, PyObject* const* args, Py_ssize_t nargs,
                    PyObject* kwnames) {
  try {
    PyObject* fn = args[0];
    PYDFLASH_CHECK_TYPE(PyCallable_Check(fn), "expected a callable, got ", Py_TYPE(fn)->tp_name);
    auto call_args = py::reinterpret_steal<py::tuple>(PyTuple_New(nargs - 1));
    for (Py_ssize_t i = 1; i < nargs; ++i) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(call_args.ptr(), i - 1, args[i]);
    }
    py::object kwargs = py::none();
    if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0) {
      kwargs = py::dict();
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); ++i)
        PyDict_SetItem(kwargs.ptr(), PyTuple_GET_ITEM(kwnames, i), args[nargs + i]);
    }
    auto state = l.lane->new_future();
    py::object future = make_python_future(*l.rt, state, owner);
    l.lane->submit(std::move(state),
                   make_python_task(*l.rt, py::reinterpret_borrow<py::object>(fn), std::move(call_args),
                                    std::move(kwargs), future, l.lane->tracing()));
    return future.release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
  }
  return nullptr;
}

bool check_fn_given(Py_ssize_t nargs, Py_ssize_t fixed) {
  if (nargs > fixed) return true;
  PyErr_SetString(PyExc_TypeError, "submit() missing the callable to run");
  return false;
}

// The hot paths are METH_FASTCALL builtins, so a submit runs no Python frame and no
// pybind11 overload resolution; pydflash.Lane and Dispatcher bind them with
// functools.partial.
// _C.submit(native_lane, owner, fn, /, *args, **kwargs)
PyObject* submit(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (!check_fn_given(nargs, 2)) return nullptr;
  PyLane* lane;
  try {
    lane = &py::handle(args[0]).cast<PyLane&>();
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  return submit_to(*lane, args[1], args + 2, nargs - 2, kwnames);
}

// The index of the lane with the fewest tasks queued, running or on the device (ties go
// to the first), or -1 when there is none; `open_only` skips lanes already shut down.
Py_ssize_t least_busy(PyObject* native_lanes, bool open_only) {
  auto lanes = py::handle(native_lanes).cast<py::tuple>();
  Py_ssize_t best = -1;
  uint64_t best_load = UINT64_MAX;
  for (Py_ssize_t i = 0; i < static_cast<Py_ssize_t>(lanes.size()); ++i) {
    auto& l = lanes[i].cast<PyLane&>();
    if (open_only && l.lane->closed()) continue;
    const uint64_t load = l.lane->load();
    if (best < 0 || load < best_load) {
      best = i;
      best_load = load;
    }
  }
  return best;
}

// _C.submit_least_busy(native_lanes, owners, fn, /, *args, **kwargs): to the least busy lane.
PyObject* submit_least_busy(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (!check_fn_given(nargs, 2)) return nullptr;
  auto lane_at = [&](Py_ssize_t i) -> PyLane& {
    return py::handle(PyTuple_GET_ITEM(args[0], i)).cast<PyLane&>();
  };
  auto submit_at = [&](Py_ssize_t i) {
    return submit_to(lane_at(i), PyTuple_GET_ITEM(args[1], i), args + 2, nargs - 2, kwnames);
  };
  try {
    const Py_ssize_t best = least_busy(args[0], /*open_only=*/false);
    PYDFLASH_INTERNAL_ASSERT(best >= 0);
    PyObject* future = submit_at(best);
    if (future != nullptr || !lane_at(best).lane->closed()) return future;
    // A lane shut down on its own is idle, so it looks least busy: try the open ones.
    const Py_ssize_t open = least_busy(args[0], /*open_only=*/true);
    if (open < 0) return nullptr;
    PyErr_Clear();
    return submit_at(open);
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyMethodDef submit_defs[] = {
    {"submit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(submit)),
     METH_FASTCALL | METH_KEYWORDS, "submit(native_lane, owner, fn, /, *args, **kwargs) -> Future"},
    {"submit_least_busy",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(submit_least_busy)),
     METH_FASTCALL | METH_KEYWORDS,
     "submit_least_busy(native_lanes, owners, fn, /, *args, **kwargs) -> Future"}};

// Returns how many tasks this shutdown cancelled (those that still have a future).
size_t finish_cancelled(std::vector<Task>& tasks) {
  size_t count = 0;
  for (auto& task : tasks) {
    if (!task.future) continue;
    ++count;
    if (task.future->observed()) task.body->notify(*task.future);
  }
  tasks.clear();  // bodies die here, under the GIL
  return count;
}

}  // namespace

void init_lane(py::module_& m) {
  add_future_type(m.ptr());
  for (auto& def : submit_defs)
    m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));

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
          "submit_graph",
          [](PyLane& l, uintptr_t graph_exec, py::object keepalive, py::handle owner) {
            PYDFLASH_CHECK_VALUE(l.lane->is_gpu(), "graphs run on GPU lanes; ", l.rt->label,
                                 " is a CPU lane");
            PYDFLASH_CHECK_VALUE(graph_exec != 0, "expected a captured graph, got a null handle");
            auto state = l.lane->new_future();
            py::object future = make_python_future(*l.rt, state, owner);
            l.lane->submit(state, make_graph_task(*l.rt, graph_exec, std::move(keepalive), future));
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
            return finish_cancelled(cancelled);
          },
          py::arg("cancel"))
      .def(
          "join",
          [](PyLane& l, py::object timeout) {
            const double t = parse_timeout(timeout.ptr());
            if (t == -2.0) throw py::error_already_set();
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
