#include "python/torch_abi.h"

#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "python/bindings.h"
#include "python/entry_points.h"

namespace py = pybind11;

namespace pydflash::python {

/// c10::cuda::CUDAStream as returned by value: {Device{type, index}, StreamId}. Trivially
/// copyable, so it comes back in two registers; a reading is checked against the stream
/// just set before the getter is trusted (Note [Lane stream selection]).
struct LaneStreamSelection::CudaStreamAbi {
  int8_t device_type;
  int8_t device_index;
  int64_t id;
};

namespace {

using CudaStreamAbi = LaneStreamSelection::CudaStreamAbi;

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

  /// Autocast on for a device type that pydflash.lanes._torch_state carries (cpu, cuda).
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

}  // namespace

TorchSnapshot TorchSnapshot::capture() {
  TorchSnapshot snap;
  const TorchApi* api = TorchApi::get();
  if (api == nullptr) return snap;
  snap.captured = true;
  snap.grad = api->grad_enabled();
  if (api->inference_mode() || api->any_autocast()) {
    PyObject* capture = cached_attr(capture_fn, entry::kCaptureTorchState);
    PyObject* state = PyObject_CallNoArgs(capture);
    if (state == nullptr) throw py::error_already_set();
    snap.special = py::reinterpret_steal<py::object>(state);
  }
  return snap;
}

void TorchSnapshot::apply_grad_mode() const {
  if (!captured) return;
  const TorchApi* api = TorchApi::get();
  if (api->grad_enabled() != grad) api->set_grad(grad);
}

// Note [Lane stream selection]: inside every task of a GPU lane, the lane's device is
// current and its compute stream is torch's current stream. Torch keeps both per
// thread, and a native worker starts with neither, so the worker selects them:
//  1. Once, at its first task after torch's import has completed (Note [Torch
//     mid-import]), it calls pydflash/lanes/_lane_runtime.py's init_thread. That sets the
//     device, makes the lane's cudaStream_t current as a torch.cuda.ExternalStream, runs
//     the hooks other parts register (the Triton guard's allocator), and returns the
//     cheapest call that selects the stream again: torch._C._cuda_setStream and its
//     (stream id, device index, device type).
//  2. Before each later task, it asks whether the stream is still current: a task may
//     have switched stream or device and left it so. It asks c10's
//     getCurrentCUDAStream, found with dlsym in libc10_cuda (TorchTls), with no Python
//     call. That returns a CUDAStream by value, whose layout CudaStreamAbi copies, so a
//     reading is trusted only once it has matched the stream init_thread just set
//     (trust_stream_reading); a torch that moved the layout fails that check.
//  3. When the stream is not current, or the getter is missing or untrusted (CPU torch,
//     PYDFLASH_TORCH_STATE=python), it calls the saved _cuda_setStream.
void LaneStreamSelection::trust_stream_reading(const Lane& lane) {
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

bool LaneStreamSelection::lane_stream_is_current(const Lane& lane) const {
  if (current_cuda_stream_ == nullptr) return false;
  const CudaStreamAbi now = current_cuda_stream_(-1);  // -1: the current device's
  return now.device_index == lane.device() && now.id == lane_stream_id_;
}

void LaneStreamSelection::select(const Lane& lane) {
  if (!torch_ready_) {
    if (TorchApi::get() == nullptr) return;
    // Step 1; a CPU lane gets None back, after the thread hooks have run.
    PyObject* init_thread = cached_attr(init_thread_fn, entry::kInitThread);
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
  if (set_stream_ == nullptr || lane_stream_is_current(lane)) return;   // step 2
  PyObject* r = PyObject_Call(set_stream_, set_stream_args_, nullptr);  // step 3
  if (r == nullptr) throw py::error_already_set();
  Py_DECREF(r);
}

void LaneStreamSelection::clear() {
  Py_CLEAR(set_stream_);
  Py_CLEAR(set_stream_args_);
}

const char* torch_state_reader() {
  const TorchApi* api = TorchApi::get();
  if (api == nullptr) return nullptr;
  return api->tls.found() ? "native" : "python";
}

}  // namespace pydflash::python
