#include "python/tasks.h"

#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/device_api.h"
#include "core/error.h"
#include "core/stream_program.h"
#include "python/bindings.h"
#include "python/entry_points.h"
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
             py::object hold, TorchSnapshot torch, std::string label)
      : rt_(rt),
        fn_(std::move(fn)),
        args_(std::move(args)),
        kwargs_(std::move(kwargs)),
        future_(std::move(future)),
        hold_(std::move(hold)),
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
      PyObject* call_in_state = cached_attr(call_in_state_fn, entry::kCallInTorchState);
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
  py::object hold_;  // keeps the lanes open until the task has run (pydflash/lanes/lane.py)
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

// Note [Program tasks]: a stream program (core/stream_program.h) issued without the GIL.
// Its future completes once the ops are issued, as a Python task's does once its Python
// returns, with an event after them; what the ops read (`keepalive`: host buffers, graphs)
// lives until the GPU has passed that event, like a graph task's graph. Without a
// keepalive the submitter keeps it, and the task's own references are buried (Note
// [Deferred decrefs], lane_runtime.h): no GIL on the worker at all. A program with
// an input first waits for that task's future (counting as paused for a quiet, Note
// [Quiet device for capture]) and fails when the input was cancelled or failed, issuing
// nothing. Once the ops are issued every Python reference moves on (to the release, or
// to the graveyard), so the worker finishes the future and drops the body without the
// GIL.
class ProgramTask final : public TaskBody {
 public:
  ProgramTask(LaneRuntime& rt, std::vector<StreamOp> ops, py::object keepalive, py::object input,
              py::object future)
      : rt_(rt),
        ops_(std::move(ops)),
        keepalive_(keepalive.is_none() ? nullptr : keepalive.release().ptr()),
        input_(input.is_none() ? nullptr : input.release().ptr()),
        future_(future.release().ptr()),
        observed_future_(future_) {}

  ~ProgramTask() override {
    // Only reached with references still held when entered (cancelled, or failed).
    Py_XDECREF(keepalive_);
    Py_XDECREF(input_);
    Py_XDECREF(future_);
  }

  bool needs_interpreter() const override { return false; }
  bool needs_interpreter_to_destroy() const override { return future_ != nullptr; }
  bool run(Lane& lane, FutureState* state) override;
  // The release or the graveyard keeps the future alive past this: this lane's worker
  // empties both, after the task.
  void notify(FutureState&) override { notify_future(observed_future_); }
  std::string label() const override { return "program"; }

 private:
  /// The input's event once it finished well; throws InputError when it did not.
  void* input_event();
  /// Hands every reference on: to a release posted once the GPU passes the future's
  /// event, or, without a keepalive, to the lane's graveyard.
  void hand_off_references(Lane& lane, FutureState* state);

  LaneRuntime& rt_;
  std::vector<StreamOp> ops_;
  PyObject* keepalive_;
  PyObject* input_;
  PyObject* future_;
  PyObject* const observed_future_;  // borrowed: `future_`, or whoever holds it after run()
};

// Drops a finished program's references under the GIL.
class ProgramRelease final : public TaskBody {
 public:
  explicit ProgramRelease(std::vector<PyObject*> refs) : refs_(std::move(refs)) {}
  bool needs_interpreter() const override { return true; }
  bool run(Lane& lane, FutureState*) override {
    for (PyObject* ref : refs_) Py_XDECREF(ref);
    refs_.clear();
    lane.device_work_done();
    return true;
  }

 private:
  std::vector<PyObject*> refs_;
};

void* ProgramTask::input_event() {
  if (input_ == nullptr) return nullptr;
  std::shared_ptr<FutureState> input = state_of(input_);
  input->wait(-1, 0, 1'000'000, nullptr);
  if (input->status() == FutureStatus::Cancelled) {
    throw InputError("its input task was cancelled");
  }
  // The worker that finished the input wrote its outcome before the transition that
  // done() read: plain reads are ordered after it.
  if (input->error() || as_future(input_)->exception != nullptr) {
    throw InputError("its input task failed");
  }
  return input->event();
}

void ProgramTask::hand_off_references(Lane& lane, FutureState* state) {
  if (keepalive_ == nullptr) {  // the submitter keeps what the GPU reads
    rt_.bury({std::exchange(input_, nullptr), std::exchange(future_, nullptr)});
    return;
  }
  std::vector<PyObject*> refs{std::exchange(keepalive_, nullptr), std::exchange(input_, nullptr),
                              std::exchange(future_, nullptr)};
  lane.device_work_started();
  // Nobody waits for the release: the watcher polls for it rather than spin.
  lane.when_passed(
      state->event(),
      [&lane, refs = std::move(refs)](const std::string&) mutable {
        lane.post_internal(std::make_unique<ProgramRelease>(std::move(refs)));
      },
      /*prompt=*/false);
}

bool ProgramTask::run(Lane& lane, FutureState* state) {
  size_t issued = 0;
  try {
    void* event = input_event();
    issue(ops_, lane.stream(), event, &issued);
    lane.record_event(*state);
  } catch (const InputError&) {
    state->set_error(std::current_exception());  // nothing issued yet
    return true;
  } catch (const std::exception& e) {
    state->set_error(std::make_exception_ptr(StateError(rt_.label + ": program: " + e.what())));
    if (issued == 0) return true;  // nothing reached the GPU: the body drops its references
    try {
      lane.record_event(*state);
    } catch (...) {
      // The device cannot say when the issued ops end: keep what they read forever.
      keepalive_ = input_ = future_ = nullptr;
      return true;
    }
  }
  hand_off_references(lane, state);
  return true;
}

}  // namespace

py::object make_python_future(LaneRuntime& rt, uint64_t id, py::handle lane) {
  PyObject* f = new_future(rt.future_type(), id, lane.ptr());
  if (f == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(f);
}

std::unique_ptr<TaskBody> make_python_task(LaneRuntime& rt, py::object fn, py::tuple args,
                                           py::object kwargs, py::object future, py::object hold,
                                           bool tracing) {
  std::string label;
  if (tracing) {
    py::object name = py::getattr(fn, "__qualname__", py::none());
    label = name.is_none() ? py::str(py::type::of(fn).attr("__name__")).cast<std::string>()
                           : name.cast<std::string>();
  }
  return std::make_unique<PythonTask>(rt, std::move(fn), std::move(args), std::move(kwargs),
                                      std::move(future), std::move(hold), TorchSnapshot::capture(),
                                      std::move(label));
}

std::unique_ptr<TaskBody> make_graph_task(LaneRuntime& rt, uintptr_t graph_exec,
                                          py::object keepalive, py::object future) {
  return std::make_unique<GraphTask>(rt, graph_exec, std::move(keepalive), std::move(future));
}

std::unique_ptr<TaskBody> make_program_task(LaneRuntime& rt, std::vector<StreamOp> ops,
                                            py::object keepalive, py::object input,
                                            py::object future) {
  return std::make_unique<ProgramTask>(rt, std::move(ops), std::move(keepalive), std::move(input),
                                       std::move(future));
}

}  // namespace pydflash::python
