#include "python/lane_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <new>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "cuda/device_api.h"
#include "python/bindings.h"
#include "python/future_object.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

// Note [Entering when the GIL is free]: a worker polls at most this long, and stops once
// the GIL's holder has been quiet (no submit, no `_condition` taken) for kQuietNs.
constexpr int64_t kEnterPollNs = 300'000;
constexpr int64_t kQuietNs = 10'000;

// Note [No static locals that call Python]: a function-local static is guarded by a
// C++ lock held during its initializer. If that initializer imports (and so lets the
// GIL go), a second thread can block on the guard while holding the GIL: deadlock.
// Python objects needed here are cached in plain globals set under the GIL instead; a
// lost race only imports twice.
PyObject* cached_attr(PyObject*& slot, const char* module, const char* name) {
  if (slot == nullptr) slot = py::object(py::module_::import(module).attr(name)).release().ptr();
  return slot;
}

PyObject* call_in_state_fn = nullptr;
PyObject* capture_fn = nullptr;
PyObject* init_thread_fn = nullptr;
PyObject* torch_name = nullptr;

bool call_bool(PyObject* fn, PyObject* arg = nullptr) {
  PyObject* r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
  if (r == nullptr) throw py::error_already_set();
  const bool value = (r == Py_True);
  Py_DECREF(r);
  return value;
}

// Note [Torch mid-import]: a module is in sys.modules from the moment its import
// starts, while its body still runs, for instance on another lane that let the GIL go
// to read a file. Read then, torch is half a module ("partially initialized module
// 'torch' has no attribute '_C'"), so until its import completes it counts as not
// imported here. The import system's own signal says when: `__spec__._initializing` is
// true while the body runs and cleared after it, by which time a failed import has left
// sys.modules (importlib._bootstrap._load_unlocked). CPython's `import` checks the same
// flag to decide whether to wait on the module's import lock, so a task that imports
// torch itself waits for the other import to finish. The lane does not wait: nothing can
// have set torch state through a module that has not finished importing.
bool still_importing(PyObject* module) {
  PyObject* spec = PyObject_GetAttrString(module, "__spec__");
  PyObject* flag = spec ? PyObject_GetAttrString(spec, "_initializing") : nullptr;
  Py_XDECREF(spec);
  const int importing = flag ? PyObject_IsTrue(flag) : 0;
  Py_XDECREF(flag);
  PyErr_Clear();  // no spec or no flag: a module made by hand, complete as it stands
  return importing == 1;
}

// Note [Torch state without Python calls]: grad mode, inference mode and autocast are
// thread-locals of libc10 and libtorch_cpu, and torch's Python getters and setters are
// thin wrappers of the functions below. Calling those directly takes three Python calls
// off every submit (a third of its cost). They are looked up in the libraries torch has
// already loaded, all or none; a build without them, or PYDFLASH_TORCH_STATE=python,
// uses the Python functions instead.
struct TorchTls {
  bool (*grad_enabled)() = nullptr;
  void (*set_grad_enabled)(bool) = nullptr;
  bool (*inference_mode_enabled)() = nullptr;
  bool (*autocast_enabled)(int8_t device_type) = nullptr;  // c10::DeviceType is an int8_t enum
  // From libc10_cuda, absent from CPU builds: lets a GPU lane see that its stream is
  // still torch's current one and skip selecting it again.
  CudaStreamAbi (*current_cuda_stream)(int8_t device_index) = nullptr;

  static constexpr int8_t kCpu = 0, kCuda = 1;  // c10::DeviceType, fixed by torch's ABI

  bool found() const { return grad_enabled != nullptr; }

  static TorchTls resolve(PyObject* torch) {
    const char* choice = std::getenv("PYDFLASH_TORCH_STATE");
    if (choice != nullptr && std::string(choice) == "python") return {};
    PyObject* file = PyObject_GetAttrString(torch, "__file__");
    if (file == nullptr || !PyUnicode_Check(file)) {
      PyErr_Clear();
      Py_XDECREF(file);
      return {};
    }
    std::string dir = PyUnicode_AsUTF8(file);
    Py_DECREF(file);
    dir = dir.substr(0, dir.rfind('/')) + "/lib/";
    // RTLD_NOLOAD: only libraries torch loaded; the handles are kept for the process.
    void* c10 = dlopen((dir + "libc10.so").c_str(), RTLD_NOW | RTLD_NOLOAD);
    void* cpu = dlopen((dir + "libtorch_cpu.so").c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (c10 == nullptr || cpu == nullptr) return {};
    TorchTls tls;
    tls.grad_enabled = reinterpret_cast<bool (*)()>(dlsym(c10, "_ZN3c108GradMode10is_enabledEv"));
    tls.set_grad_enabled =
        reinterpret_cast<void (*)(bool)>(dlsym(c10, "_ZN3c108GradMode11set_enabledEb"));
    tls.inference_mode_enabled =
        reinterpret_cast<bool (*)()>(dlsym(c10, "_ZN3c1013InferenceMode10is_enabledEv"));
    tls.autocast_enabled = reinterpret_cast<bool (*)(int8_t)>(
        dlsym(cpu, "_ZN2at8autocast19is_autocast_enabledEN3c1010DeviceTypeE"));
    if (!tls.grad_enabled || !tls.set_grad_enabled || !tls.inference_mode_enabled ||
        !tls.autocast_enabled)
      return {};
    if (void* cuda = dlopen((dir + "libc10_cuda.so").c_str(), RTLD_NOW | RTLD_NOLOAD))
      tls.current_cuda_stream = reinterpret_cast<CudaStreamAbi (*)(int8_t)>(
          dlsym(cuda, "_ZN3c104cuda20getCurrentCUDAStreamEa"));
    return tls;
  }
};

// Torch's thread-local state, read at submit and set on the worker; looked up once
// torch is imported. Leaked on purpose: it must outlive every lane, and torch outlives
// us anyway.
struct TorchApi {
  TorchTls tls;
  PyObject* is_grad_enabled;
  PyObject* set_grad_enabled;
  PyObject* is_inference_mode_enabled;
  PyObject* is_any_autocast_enabled;  // torch._C._is_any_autocast_enabled, or null
  PyObject* is_autocast_enabled;
  PyObject* str_cuda;
  PyObject* str_cpu;

  bool grad_enabled() const {
    return tls.found() ? tls.grad_enabled() : call_bool(is_grad_enabled);
  }

  void set_grad(bool on) const {
    if (tls.found()) return tls.set_grad_enabled(on);
    PyObject* r = PyObject_CallOneArg(set_grad_enabled, on ? Py_True : Py_False);
    if (r == nullptr) throw py::error_already_set();
    Py_DECREF(r);
  }

  bool inference_mode() const {
    return tls.found() ? tls.inference_mode_enabled() : call_bool(is_inference_mode_enabled);
  }

  /// Autocast on for a device type that pydflash._torch_state carries (cpu, cuda).
  bool any_autocast() const {
    if (tls.found())
      return tls.autocast_enabled(TorchTls::kCpu) || tls.autocast_enabled(TorchTls::kCuda);
    if (is_any_autocast_enabled != nullptr) return call_bool(is_any_autocast_enabled);
    return call_bool(is_autocast_enabled, str_cuda) || call_bool(is_autocast_enabled, str_cpu);
  }

  /// Null until torch's import has completed (Note [Torch mid-import]). Entered.
  static const TorchApi* get() {
    if (api != nullptr) return api;
    if (torch_name == nullptr) torch_name = PyUnicode_InternFromString("torch");
    PyObject* torch = PyDict_GetItem(PyImport_GetModuleDict(), torch_name);  // borrowed
    if (torch == nullptr || still_importing(torch)) return nullptr;
    auto attr = [](PyObject* obj, const char* name) {
      PyObject* value = PyObject_GetAttrString(obj, name);
      if (value == nullptr) throw py::error_already_set();
      return value;
    };
    PyObject* torch_c = attr(torch, "_C");
    PyObject* any_autocast = PyObject_GetAttrString(torch_c, "_is_any_autocast_enabled");
    if (any_autocast == nullptr) PyErr_Clear();  // older torch: ask per device type
    auto* fresh = new TorchApi{TorchTls::resolve(torch),
                               attr(torch, "is_grad_enabled"),
                               attr(torch_c, "_set_grad_enabled"),
                               attr(torch, "is_inference_mode_enabled"),
                               any_autocast,
                               attr(torch, "is_autocast_enabled"),
                               PyUnicode_InternFromString("cuda"),
                               PyUnicode_InternFromString("cpu")};
    Py_DECREF(torch_c);
    api = fresh;
    return api;
  }

 private:
  static TorchApi* api;  // see Note [No static locals that call Python]
};

TorchApi* TorchApi::api = nullptr;


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
  PythonTask(LaneRuntime& rt, py::object fn, py::tuple args, py::object kwargs,
             py::object future, TorchSnapshot torch, std::string label)
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
    if (torch_.captured) {
      const TorchApi* api = TorchApi::get();
      if (api->grad_enabled() != torch_.grad) api->set_grad(torch_.grad);
    }
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
  Lane* lane;  // alive: its worker waits for device work before it exits
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
  if (!error.empty()) done->state->set_native_error(NativeError::Cuda, error);
  done->observed = done->state->finish();
  done->state->publish();
  done->lane->post_internal(std::make_unique<GraphRelease>(done));
}

bool GraphTask::run(Lane& lane, FutureState* state) {
  try {
    device::launch_graph(exec_, lane.stream());
    lane.record_event(*state);
  } catch (const std::exception& e) {
    state->set_native_error(NativeError::Cuda, rt_.label + ": " + e.what());
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

TorchSnapshot TorchSnapshot::capture() {
  TorchSnapshot snap;
  const TorchApi* api = TorchApi::get();
  if (api == nullptr) return snap;
  snap.captured = true;
  snap.grad = api->grad_enabled();
  if (api->inference_mode() || api->any_autocast()) {
    PyObject* capture = cached_attr(capture_fn, "pydflash._torch_state", "capture");
    PyObject* state = PyObject_CallNoArgs(capture);
    if (state == nullptr) throw py::error_already_set();
    snap.special = py::reinterpret_steal<py::object>(state);
  }
  return snap;
}

LaneRuntime::LaneRuntime(std::string label_, py::object future_type)
    : label(std::move(label_)),
      interp_(PyInterpreterState_Get()),
      future_type_(future_type.release().ptr()) {}

LaneRuntime::~LaneRuntime() {
  // Python references were dropped entered in thread_exiting(); a lane whose worker
  // never ran leaks them rather than touching Python without the GIL.
}

void LaneRuntime::thread_started(Lane& lane) {
  lane_ = &lane;
  tstate_ = PyThreadState_New(interp_);
}

void LaneRuntime::enter() {
  // Note [Entering when the GIL is free].
  WaitingWithoutGil::worker_entering(1);
  auto activity = [&] { return lane_->submitted() + WaitingWithoutGil::preparations(); };
  const int64_t start = now_ns();
  int64_t last_active = start;
  uint64_t seen = activity();
  while (!WaitingWithoutGil::any()) {
    const int64_t now = now_ns();
    if (activity() != seen) {
      seen = activity();
      last_active = now;
    }
    if (now - start >= kEnterPollNs || now - last_active >= kQuietNs) break;
    std::this_thread::yield();
  }
  PyEval_RestoreThread(tstate_);
  WaitingWithoutGil::worker_entering(-1);
}

void LaneRuntime::leave() { PyEval_SaveThread(); }

void LaneRuntime::thread_exiting() {
  PyEval_RestoreThread(tstate_);
  Py_CLEAR(future_type_);
  Py_CLEAR(set_stream_);
  Py_CLEAR(set_stream_args_);
  PyThreadState_Clear(tstate_);
  PyThreadState_DeleteCurrent();
  tstate_ = nullptr;
}

void LaneRuntime::trust_stream_reading(const Lane& lane) {
  // init_thread has just made the lane's device and stream current: a reading that
  // says so shows the native getter is what CudaStreamAbi assumes.
  auto get = TorchApi::get()->tls.current_cuda_stream;
  PyObject* id = PyTuple_GetItem(set_stream_args_, 0);
  if (get == nullptr || id == nullptr) return PyErr_Clear();
  lane_stream_id_ = PyLong_AsLongLong(id);
  if (lane_stream_id_ == -1 && PyErr_Occurred()) return PyErr_Clear();
  const CudaStreamAbi now = get(-1);
  if (now.device_type == TorchTls::kCuda && now.device_index == lane.device() &&
      now.id == lane_stream_id_)
    current_cuda_stream_ = get;
}

bool LaneRuntime::lane_stream_is_current(const Lane& lane) const {
  if (current_cuda_stream_ == nullptr) return false;
  const CudaStreamAbi now = current_cuda_stream_(-1);  // -1: the current device's
  return now.device_index == lane.device() && now.id == lane_stream_id_;
}

void LaneRuntime::prepare_task(Lane& lane) {
  if (!torch_ready_) {
    if (TorchApi::get() == nullptr) return;
    // First task after torch was imported: per-thread torch setup (device, stream,
    // Triton allocator, registered hooks), returning how to re-select the stream.
    PyObject* init_thread = cached_attr(init_thread_fn, "pydflash._lane_runtime", "init_thread");
    PyObject* r = PyObject_CallFunction(init_thread, "iK", lane.device(),
                                        (unsigned long long)(uintptr_t)lane.stream());
    if (r == nullptr) throw py::error_already_set();
    if (r != Py_None) {
      set_stream_ = PySequence_GetItem(r, 0);
      set_stream_args_ = PySequence_GetItem(r, 1);
      trust_stream_reading(lane);
    }
    Py_DECREF(r);
    torch_ready_ = true;
  }
  if (set_stream_ != nullptr) {
    // A task may have switched streams or devices; every task starts on the lane's.
    if (lane_stream_is_current(lane)) return;
    PyObject* r = PyObject_Call(set_stream_, set_stream_args_, nullptr);
    if (r == nullptr) throw py::error_already_set();
    Py_DECREF(r);
  }
}

const char* torch_state_reader() {
  const TorchApi* api = TorchApi::get();
  if (api == nullptr) return nullptr;
  return api->tls.found() ? "native" : "python";
}

py::object make_python_future(LaneRuntime& rt, uint64_t id, py::handle lane) {
  PyObject* f = new_future(rt.future_type(), id, lane.ptr());
  if (f == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(f);
}

std::unique_ptr<TaskBody> make_python_task(LaneRuntime& rt, py::object fn,
                                           py::tuple args, py::object kwargs, py::object future,
                                           bool tracing) {
  std::string label;
  if (tracing) {
    py::object name = py::getattr(fn, "__qualname__", py::none());
    label = name.is_none() ? py::str(py::type::of(fn).attr("__name__")).cast<std::string>()
                           : name.cast<std::string>();
  }
  return std::make_unique<PythonTask>(rt, std::move(fn), std::move(args),
                                      std::move(kwargs), std::move(future),
                                      TorchSnapshot::capture(), std::move(label));
}

std::unique_ptr<TaskBody> make_graph_task(LaneRuntime& rt, uintptr_t graph_exec,
                                          py::object keepalive, py::object future) {
  return std::make_unique<GraphTask>(rt, graph_exec, std::move(keepalive),
                                     std::move(future));
}

}  // namespace pydflash::python
