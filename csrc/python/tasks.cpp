#include "python/tasks.h"

#include <new>
#include <string>

#include "core/device_api.h"
#include "core/error.h"
#include "python/bindings.h"
#include "python/future_object.h"
#include "python/torch_abi.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

PyObject* call_in_state_fn = nullptr;

// Stores the task's outcome on the future: its result, or the exception with a note
// naming the lane. Entered; consumes `result` (null means an exception is set).
void store_outcome(FutureObject* future, PyObject* result, const std::string& label) {
  if (result != nullptr) {
    Py_XSETREF(future->result, result);
    return;
  }
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  const std::string note = "raised in pydflash " + label;
  PyObject* r = PyObject_CallMethod(value, "add_note", "s", note.c_str());
  if (r == nullptr) PyErr_Clear();
  Py_XDECREF(r);
  Py_XSETREF(future->exception, value);
  Py_XDECREF(type);
  Py_XDECREF(tb);
}

// A failure, or a result of a type that cannot hold a tensor: nothing a consumer stream
// would read, so its event can wait until asked for (Note [Deferred result events]).
bool holds_no_gpu_memory(PyObject* result) {
  return result == nullptr || result == Py_None || PyBool_Check(result) ||
         PyLong_CheckExact(result) || PyFloat_CheckExact(result) || PyUnicode_CheckExact(result) ||
         PyBytes_CheckExact(result);
}

class PythonTask final : public TaskBody {
 public:
  PythonTask(LaneRuntime& rt, py::object fn, py::tuple args, py::object kwargs, py::object future,
             TorchSnapshot torch, std::string label)
      : rt_(rt),
        fn_(std::move(fn)),
        args_(std::move(args)),
        kwargs_(std::move(kwargs)),
        future_(std::move(future)),
        torch_(std::move(torch)),
        label_(std::move(label)) {}

  bool needs_interpreter() const override { return true; }

  // Python's small-object allocator: made under the GIL by the submitter and, as a
  // body that needs the interpreter, destroyed under it by the worker. The system
  // allocator would hand each task across threads' caches and take an arena lock on
  // both sides.
  static void* operator new(std::size_t size) {
    void* p = PyObject_Malloc(size);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }
  static void operator delete(void* p) { PyObject_Free(p); }

  bool run(Lane& lane, FutureState* state) override {
    PyObject* result = nullptr;
    try {
      rt_.prepare_task(lane);
      result = call();
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const std::exception& e) {
      py::set_error(PyExc_RuntimeError, e.what());
    }
    if (lane.is_gpu()) {
      try {
        if (holds_no_gpu_memory(result)) {
          state->defer_event(lane.device(), lane.stream());  // Note [Deferred result events]
        } else {
          lane.record_event(*state);
        }
      } catch (...) {
        if (result != nullptr) {
          Py_CLEAR(result);
          set_python_error(std::current_exception());
        }
      }
    }
    store_outcome(as_future(future_.ptr()), result, rt_.label);
    return true;
  }

  void notify(FutureState&) override { notify_future(future_.ptr()); }
  std::string label() const override { return label_; }

 private:
  PyObject* call() {
    torch_.apply_grad_mode();
    if (torch_.special) {
      PyObject* call_in_state =
          cached_attr(call_in_state_fn, "pydflash._torch_state", "call_in_state");
      PyObject* kwargs = kwargs_.is_none() ? PyDict_New() : kwargs_.inc_ref().ptr();
      PyObject* r = PyObject_CallFunctionObjArgs(call_in_state, torch_.special.ptr(), fn_.ptr(),
                                                 args_.ptr(), kwargs, nullptr);
      Py_DECREF(kwargs);
      return r;
    }
    return PyObject_Call(fn_.ptr(), args_.ptr(), kwargs_.is_none() ? nullptr : kwargs_.ptr());
  }

  LaneRuntime& rt_;
  py::object fn_;
  py::tuple args_;
  py::object kwargs_;
  py::object future_;
  TorchSnapshot torch_;
  std::string label_;
};

// A captured CUDA graph, launched without the GIL. The future completes when the
// GPU reaches the end of the graph: the lane's device watcher finishes it, then posts
// a GraphRelease to drop the graph (and its memory pool) under the GIL.
class GraphTask final : public TaskBody {
 public:
  GraphTask(LaneRuntime& rt, uintptr_t exec, py::object keepalive, py::object future)
      : rt_(rt),
        exec_(exec),
        keepalive_(keepalive.release().ptr()),
        future_(future.release().ptr()) {}

  ~GraphTask() override {
    // Only reached with references still held when entered (cancelled, or failed).
    Py_XDECREF(keepalive_);
    Py_XDECREF(future_);
  }

  bool needs_interpreter() const override { return false; }
  bool needs_interpreter_to_destroy() const override { return future_ != nullptr; }

  bool run(Lane& lane, FutureState* state) override;
  void notify(FutureState&) override { notify_future(future_); }
  std::string label() const override { return "graph"; }

 private:
  friend struct GraphCompletion;
  LaneRuntime& rt_;
  uintptr_t exec_;
  PyObject* keepalive_;
  PyObject* future_;
};

struct GraphCompletion {
  Lane* lane;          // alive: its worker waits for device work before it exits
  FutureState* state;  // inside `future`, which this keeps alive
  PyObject* keepalive;
  PyObject* future;
  bool observed = false;
};

class GraphRelease final : public TaskBody {
 public:
  explicit GraphRelease(GraphCompletion* done) : done_(done) {}
  bool needs_interpreter() const override { return true; }
  bool run(Lane& lane, FutureState*) override {
    if (done_->observed) notify_future(done_->future);
    Py_XDECREF(done_->keepalive);
    Py_XDECREF(done_->future);
    lane.device_work_finished();
    return true;
  }

 private:
  std::unique_ptr<GraphCompletion> done_;
};

// Runs on the lane's device watcher: no GIL.
void on_graph_done(GraphCompletion* done, const std::string& error) {
  if (!error.empty()) done->state->set_error(std::make_exception_ptr(CudaError(error)));
  done->observed = done->state->finish();
  done->state->publish();
  done->lane->post_internal(std::make_unique<GraphRelease>(done));
}

bool GraphTask::run(Lane& lane, FutureState* state) {
  try {
    device::launch_graph(exec_, lane.stream());
    lane.record_event(*state);
  } catch (const std::exception& e) {
    state->set_error(std::make_exception_ptr(CudaError(rt_.label + ": " + e.what())));
    return true;  // nothing reached the GPU; the worker finishes the future
  }
  auto* done = new GraphCompletion{&lane, state, keepalive_, future_};
  keepalive_ = future_ = nullptr;
  lane.device_work_started();
  // Note [Completions off the stream] in csrc/core/device_watcher.h.
  lane.when_passed(state->event(), [done, label = rt_.label](const std::string& error) {
    on_graph_done(done, error.empty() ? error : label + ": " + error);
  });
  return false;
}

}  // namespace

py::object make_python_future(LaneRuntime& rt, uint64_t id, py::handle lane) {
  PyObject* f = new_future(rt.future_type(), id, lane.ptr());
  if (f == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(f);
}

std::unique_ptr<TaskBody> make_python_task(LaneRuntime& rt, py::object fn, py::tuple args,
                                           py::object kwargs, py::object future, bool tracing) {
  std::string label;
  if (tracing) {
    py::object name = py::getattr(fn, "__qualname__", py::none());
    label = name.is_none() ? py::str(py::type::of(fn).attr("__name__")).cast<std::string>()
                           : name.cast<std::string>();
  }
  return std::make_unique<PythonTask>(rt, std::move(fn), std::move(args), std::move(kwargs),
                                      std::move(future), TorchSnapshot::capture(),
                                      std::move(label));
}

std::unique_ptr<TaskBody> make_graph_task(LaneRuntime& rt, uintptr_t graph_exec,
                                          py::object keepalive, py::object future) {
  return std::make_unique<GraphTask>(rt, graph_exec, std::move(keepalive), std::move(future));
}

}  // namespace pydflash::python
