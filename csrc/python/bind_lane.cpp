// _C.Lane, _C.Submitter (the native submit) and _C.torch_state_reader: thin wrappers; the
// Executor API is pydflash/lanes/lane.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/device_api.h"
#include "core/error.h"
#include "core/lane.h"
#include "core/stream_program.h"
#include "python/bindings.h"
#include "python/entry_points.h"
#include "python/future_object.h"
#include "python/gil.h"
#include "python/lane_runtime.h"
#include "python/stdlib_waiters.h"
#include "python/tasks.h"
#include "python/timeout.h"
#include "python/torch_abi.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

struct PyLane {
  std::shared_ptr<LaneRuntime> rt;
  std::shared_ptr<Lane> lane;
};

// _C.StreamOp, the named tuple a stream op is in Python; set once by init_lane.
PyObject* stream_op_type = nullptr;

// A stream program from Python: a sequence of _C.StreamOp, whose fields are StreamOp's
// in kStreamOpFields order. Read with the C API: it runs once per microbatch.
std::vector<StreamOp> stream_ops(py::handle ops) {
  py::object seq = py::reinterpret_steal<py::object>(
      PySequence_Fast(ops.ptr(), "expected the stream ops as a sequence of _C.StreamOp"));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<StreamOp> program(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    PYDFLASH_CHECK_TYPE(Py_IS_TYPE(item, reinterpret_cast<PyTypeObject*>(stream_op_type)),
                        "expected each stream op as a pydflash._C.StreamOp, got ",
                        Py_TYPE(item)->tp_name);
    uint64_t f[kStreamOpFieldCount] = {};
    for (size_t j = 0; j < kStreamOpFieldCount; ++j) {
      PyObject* v = PyTuple_GET_ITEM(item, static_cast<Py_ssize_t>(j));
      PYDFLASH_CHECK_TYPE(PyLong_Check(v), "expected stream op ", i, "'s ", kStreamOpFields[j],
                          " to be an int, got ", Py_TYPE(v)->tp_name);
      // Addresses are unsigned; a fill's value and an int64 fill may be negative.
      f[j] = static_cast<uint64_t>(PyLong_AsUnsignedLongLongMask(v));
    }
    PYDFLASH_CHECK_VALUE(f[0] < kStreamOpKindCount, "expected a stream op kind from 0 to ",
                         kStreamOpKindCount - 1, ", got ", static_cast<int64_t>(f[0]));
    StreamOp& op = program[static_cast<size_t>(i)];
    op.kind = static_cast<StreamOp::Kind>(f[0]);
    op.dst = f[1], op.src = f[2], op.dpitch = f[3], op.spitch = f[4], op.width = f[5],
    op.height = f[6], op.value = static_cast<int64_t>(f[7]);
    check_op(op);
  }
  return program;
}

// _C.StreamOpKind (an IntEnum) and _C.StreamOp (a named tuple, every field but the kind
// 0 by default), both from the tables in core/stream_program.h.
void add_stream_op_types(py::module_& m) {
  py::list kinds;
  for (size_t i = 0; i < kStreamOpKindCount; ++i)
    kinds.append(py::make_tuple(kStreamOpKinds[i], i));
  py::object kind_type = py::module_::import("enum").attr("IntEnum")(
      "StreamOpKind", kinds, py::arg("module") = "pydflash._C");
  kind_type.attr("__doc__") = "The kinds of stream op (csrc/core/stream_program.h).";
  m.attr("StreamOpKind") = kind_type;
  py::tuple fields(kStreamOpFieldCount);
  for (size_t i = 0; i < kStreamOpFieldCount; ++i) fields[i] = py::str(kStreamOpFields[i]);
  py::list defaults;
  for (size_t i = 1; i < kStreamOpFieldCount; ++i) defaults.append(0);
  py::object op_type = py::module_::import("collections")
                           .attr("namedtuple")("StreamOp", fields, py::arg("defaults") = defaults,
                                               py::arg("module") = "pydflash._C");
  op_type.attr("__doc__") =
      "One op of a stream program (Lane.submit_program): a StreamOpKind and the fields it "
      "reads, the others 0 (csrc/core/stream_program.h says which).";
  m.attr("StreamOp") = op_type;
  stream_op_type = op_type.release().ptr();  // kept for the module's life
}

// Queues fn(*args, **kwargs) on a lane; args[0] is fn. `owner` is the future's lane (a
// weak reference to it), `hold` what the task keeps until it has run. Returns a new
// reference.
PyObject* submit_to(PyLane& l, PyObject* owner, PyObject* hold, PyObject* const* args,
                    Py_ssize_t nargs, PyObject* kwnames) {
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
    py::object future = make_python_future(*l.rt, l.lane->take_id(), owner);
    l.lane->submit(state_of(future.ptr()),
                   make_python_task(*l.rt, py::reinterpret_borrow<py::object>(fn),
                                    std::move(call_args), std::move(kwargs), future,
                                    py::reinterpret_borrow<py::object>(hold), l.lane->tracing()));
    return future.release().ptr();
  } catch (...) {
    set_python_error(std::current_exception());
  }
  return nullptr;
}

// The index of the lane with the fewest tasks queued, running or on the device (ties go
// to the first), or -1 when there is none; `open_only` skips lanes already shut down.
Py_ssize_t least_busy(const std::vector<PyLane*>& lanes, bool open_only) {
  Py_ssize_t best = -1;
  uint64_t best_load = UINT64_MAX;
  for (size_t i = 0; i < lanes.size(); ++i) {
    if (open_only && lanes[i]->lane->closed()) continue;
    const uint64_t load = lanes[i]->lane->load();
    if (best < 0 || load < best_load) {
      best = static_cast<Py_ssize_t>(i);
      best_load = load;
    }
  }
  return best;
}

// _C.Submitter(lanes, name): the hot path of Lane.submit (one lane) and
// Dispatcher.submit (the least busy of several), built once per lane or dispatcher. A
// vectorcall object that holds its lanes' native pointers, so a submit runs no Python
// frame, no argument re-packing and no pybind11 cast.
//
// It keeps its lanes open (Note [Lanes open while held], pydflash/lanes/lane.py) through
// `hold`, which each task keeps until it has run, and refers to the pydflash.Lane objects
// only weakly: a lane's own submitter is an attribute of that lane.
struct Submitter {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* natives;  // tuple of _C.Lane, kept alive for `lanes`
  PyObject* owners;   // tuple of weak references to pydflash.Lane: the futures' lane
  PyObject* name;     // str: what a submit after shutdown names (the Dispatcher or lane)
  PyObject* hold;     // what keeps the lanes open, or None
  std::vector<PyLane*> lanes;
};

PyObject* submit_with(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* s = reinterpret_cast<Submitter*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "submit() missing the callable to run");
    return nullptr;
  }
  if (s->lanes.empty()) {  // cleared by the garbage collector, and called from a finalizer
    PyErr_SetString(PyExc_RuntimeError, "submit() on a lane that is being collected");
    return nullptr;
  }
  auto submit_at = [&](Py_ssize_t i) {
    return submit_to(*s->lanes[i], PyTuple_GET_ITEM(s->owners, i), s->hold, args, nargs, kwnames);
  };
  const Py_ssize_t best = s->lanes.size() == 1 ? 0 : least_busy(s->lanes, /*open_only=*/false);
  PyObject* future = submit_at(best);
  if (future != nullptr || !s->lanes[best]->lane->closed()) return future;
  PyErr_Clear();
  // A lane shut down on its own is idle, so it looks least busy: try the open ones.
  const Py_ssize_t open = least_busy(s->lanes, /*open_only=*/true);
  if (open >= 0) return submit_at(open);
  // The stdlib's words, which callers match, naming what the caller submitted to.
  PyErr_Format(PyExc_RuntimeError, "cannot schedule new futures after shutdown of %U", s->name);
  return nullptr;
}

PyObject* submitter_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *lanes_arg, *name, *hold = Py_None;
  static const char* names[] = {"lanes", "name", "hold", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!U|O:Submitter", const_cast<char**>(names),
                                   &PyTuple_Type, &lanes_arg, &name, &hold))
    return nullptr;
  const py::tuple owners_tuple(PyTuple_GET_SIZE(lanes_arg));
  PyObject* owners = owners_tuple.ptr();
  const Py_ssize_t count = PyTuple_GET_SIZE(lanes_arg);
  if (count == 0) {
    PyErr_SetString(PyExc_ValueError, "expected at least one lane, got none");
    return nullptr;
  }
  py::tuple natives(count);
  std::vector<PyLane*> lanes;
  try {
    for (Py_ssize_t i = 0; i < count; ++i) {
      py::handle owner = PyTuple_GET_ITEM(lanes_arg, i);
      py::object native = py::getattr(owner, entry::kLaneCore.attr(), py::none());
      PYDFLASH_CHECK_TYPE(py::isinstance<PyLane>(native), "expected pydflash.Lane objects, got ",
                          Py_TYPE(owner.ptr())->tp_name);
      lanes.push_back(&native.cast<PyLane&>());
      natives[i] = std::move(native);
      PyObject* ref = PyWeakref_NewRef(owner.ptr(), nullptr);
      if (ref == nullptr) throw py::error_already_set();
      PyTuple_SET_ITEM(owners, i, ref);
    }
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  auto* s = reinterpret_cast<Submitter*>(type->tp_alloc(type, 0));
  if (s == nullptr) return nullptr;
  s->vectorcall = submit_with;
  new (&s->lanes) std::vector<PyLane*>(std::move(lanes));
  s->natives = natives.release().ptr();
  Py_INCREF(owners);
  s->owners = owners;
  Py_INCREF(name);
  s->name = name;
  Py_INCREF(hold);
  s->hold = hold;
  return reinterpret_cast<PyObject*>(s);
}

int submitter_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* s = reinterpret_cast<Submitter*>(self);
  Py_VISIT(s->natives);
  Py_VISIT(s->owners);
  Py_VISIT(s->hold);
  return 0;
}

int submitter_clear(PyObject* self) {
  auto* s = reinterpret_cast<Submitter*>(self);
  s->lanes.clear();  // the pointers die with `natives`
  Py_CLEAR(s->natives);
  Py_CLEAR(s->owners);
  Py_CLEAR(s->name);
  Py_CLEAR(s->hold);
  return 0;
}

void submitter_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  submitter_clear(self);
  reinterpret_cast<Submitter*>(self)->lanes.~vector();
  Py_TYPE(self)->tp_free(self);
}

PyTypeObject SubmitterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

void add_submitter_type(PyObject* module) {
  SubmitterType.tp_name = "pydflash._C.Submitter";
  SubmitterType.tp_basicsize = sizeof(Submitter);
  SubmitterType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  SubmitterType.tp_doc =
      "Submitter(lanes, name, hold=None)(fn, /, *args, **kwargs) -> Future: queues fn on the "
      "lane (or, with several, the least busy open lane); after shutdown the error names "
      "`name`. It and each task it queues keep `hold` alive.";
  SubmitterType.tp_new = submitter_new;
  SubmitterType.tp_dealloc = submitter_dealloc;
  SubmitterType.tp_traverse = submitter_traverse;
  SubmitterType.tp_clear = submitter_clear;
  SubmitterType.tp_vectorcall_offset = offsetof(Submitter, vectorcall);
  SubmitterType.tp_call = PyVectorcall_Call;
  if (PyType_Ready(&SubmitterType) < 0) throw py::error_already_set();
  Py_INCREF(&SubmitterType);
  if (PyModule_AddObject(module, "Submitter", reinterpret_cast<PyObject*>(&SubmitterType)) < 0)
    throw py::error_already_set();
}

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
  add_submitter_type(m.ptr());

  add_stream_op_types(m);
  m.def("stdlib_waiters_native", &stdlib_waiters_native);
  m.attr("MAX_SPIN_US") = kMaxSpinUs;
  m.def("torch_state_reader", [] {
    const char* reader = torch_state_reader();
    return reader ? py::object(py::str(reader)) : py::object(py::none());
  });

  py::class_<PyLane>(m, "Lane")
      .def(py::init([](int index, int device, std::string label, py::object future_type,
                       double spin_us) {
             LaneOptions options;
             options.spin_ns = spin_ns_from_us(spin_us);
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
      .def_property_readonly(
          "stream", [](const PyLane& l) { return reinterpret_cast<uintptr_t>(l.lane->stream()); })
      .def_property_readonly(
          "copy_stream",
          [](const PyLane& l) { return reinterpret_cast<uintptr_t>(l.lane->copy_stream()); })
      .def(
          "submit_graph",
          [](PyLane& l, uintptr_t graph_exec, py::object keepalive, py::handle owner) {
            PYDFLASH_CHECK_VALUE(l.lane->is_gpu(), "graphs run on GPU lanes; ", l.rt->label,
                                 " is a CPU lane");
            PYDFLASH_CHECK_VALUE(graph_exec != 0, "expected a captured graph, got a null handle");
            py::object future = make_python_future(*l.rt, l.lane->take_id(), owner);
            l.lane->submit(state_of(future.ptr()),
                           make_graph_task(*l.rt, graph_exec, std::move(keepalive), future));
            return future;
          },
          py::arg("graph_exec"), py::arg("keepalive"), py::arg("owner"))
      .def(
          "submit_program",
          [](PyLane& l, py::handle ops, py::object keepalive, py::object input, py::handle owner) {
            std::vector<StreamOp> program = stream_ops(ops);
            PYDFLASH_CHECK_TYPE(input.is_none() || as_future(input.ptr()) != nullptr,
                                "expected the input as a pydflash future or None, got ",
                                Py_TYPE(input.ptr())->tp_name);
            PYDFLASH_CHECK_VALUE(l.lane->is_gpu(), "stream programs run on GPU lanes; ",
                                 l.rt->label, " is a CPU lane");
            py::object future = make_python_future(*l.rt, l.lane->take_id(), owner);
            l.lane->submit(state_of(future.ptr()),
                           make_program_task(*l.rt, std::move(program), std::move(keepalive),
                                             std::move(input), future));
            return future;
          },
          py::arg("ops"), py::arg("keepalive"), py::arg("input"), py::arg("owner"))
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
             d["spin_us"] = s.spin_ns * 1e-3;
             // Note [Quiet device for capture]
             QuietStats q = l.lane->quiet_stats();
             d["pauses"] = q.pauses;
             d["paused_s"] = q.paused_ns * 1e-9;
             d["quiets"] = q.quiets;
             d["quiet_timeouts"] = q.quiet_timeouts;
             d["quiet_wait_s"] = q.quiet_wait_ns * 1e-9;
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
            return without_gil([&] { return l.lane->join(t); });
          },
          py::arg("timeout") = py::none())
      .def_property_readonly("closed", [](const PyLane& l) { return l.lane->closed(); })
      .def_property_readonly("exited", [](PyLane& l) { return l.lane->exited(); })
      .def_property_readonly("forked", [](const PyLane& l) { return l.lane->forked(); })
      .def(
          "quiesce",
          [](PyLane& l, py::object timeout) {
            const double t = parse_timeout(timeout.ptr());
            if (t == -2.0) throw py::error_already_set();
            // The other lanes need the GIL to finish their tasks.
            py::gil_scoped_release nogil;
            return l.lane->quiesce(t);
          },
          py::arg("timeout"))
      .def("resume", [](PyLane& l) { l.lane->resume(); })
      .def("set_tracing", [](PyLane& l, bool on) { l.lane->set_tracing(on); })
      .def("take_trace", [](PyLane& l) {
        // Off the hot path: waits for the GPU spans' events and converts them to
        // nanoseconds on the host clock, relative to the epoch taken at set_tracing. The
        // records destroy their events when `records` goes.
        auto records = l.lane->take_trace();
        py::list out;
        const int64_t epoch_ns = l.lane->trace_epoch_ns();
        void* epoch = l.lane->trace_epoch_event();
        for (auto& r : records) {
          py::object gpu = py::none();
          if (r.gpu_begin && r.gpu_end) {
            without_gil([&] { device::synchronize_event(r.gpu_end.get()); });
            const double begin_ms = device::elapsed_ms(epoch, r.gpu_begin.get());
            const double end_ms = device::elapsed_ms(epoch, r.gpu_end.get());
            gpu = py::make_tuple(epoch_ns + static_cast<int64_t>(begin_ms * 1e6),
                                 epoch_ns + static_cast<int64_t>(end_ms * 1e6));
          }
          out.append(py::make_tuple(r.id, r.label, r.submit_ns, r.start_ns, r.end_ns, gpu));
        }
        return out;
      });
}

}  // namespace pydflash::python
