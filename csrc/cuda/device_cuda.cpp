#include <cuda_runtime.h>
#include <dlfcn.h>

#include "core/device_api.h"
#include "cuda/cuda_check.h"

// The CUDA side of the device seam, core/device_api.h (Note [CUDA objects at exit] there).

namespace pydflash::device {
namespace {

cudaError_t count_devices(int* count) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *count = 0;
  }
  return err;
}

// Why the CUDA driver library cannot be loaded, or "" when it can.
std::string driver_library_error() {
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) {
    const char* why = dlerror();
    return why != nullptr ? why : "libcuda.so.1 could not be loaded";
  }
  dlclose(driver);
  return "";
}

// The driver's cuEventRecord, which the runtime's cudaEventRecord wraps: a result event
// is recorded after every task on a GPU lane, and the wrapper's checks are a good part
// of that call's cost. Null when the driver does not offer it.
using EventRecordFn = int (*)(void* event, void* stream);  // CUresult(CUevent, CUstream)

EventRecordFn driver_event_record() {
  static const EventRecordFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuEventRecord", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return EventRecordFn{nullptr};
    }
    return reinterpret_cast<EventRecordFn>(p);
  }();
  return fn;
}

// Makes `device` current for one creation call and then restores the caller's: lanes and
// result events are created on threads (the user's) whose current device torch relies on.
template <typename Fn>
void on_device(int device, Fn fn) {
  int previous = 0;
  PYDFLASH_CUDA_CHECK(cudaGetDevice(&previous));
  PYDFLASH_CUDA_CHECK(cudaSetDevice(device));
  const cudaError_t err = fn();
  if (previous != device) (void)cudaSetDevice(previous);
  PYDFLASH_CUDA_CHECK(err);
}

}  // namespace

bool compiled_with_cuda() { return true; }

int device_count() {
  int count = 0;
  count_devices(&count);
  return count;
}

std::string unavailable_reason() {
  int count = 0;
  cudaError_t err = count_devices(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    // Without the driver library the runtime answers as if the driver were too old, or
    // saw no device: say what is missing instead.
    const std::string missing = driver_library_error();
    if (!missing.empty()) return "no CUDA driver was found: " + missing;
  }
  if (err != cudaSuccess) return cudaGetErrorString(err);
  return count == 0 ? "no CUDA device is visible" : "";
}

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return v;
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) (void)cudaGetLastError();
  return v;
}

void set_device(int device) { PYDFLASH_CUDA_CHECK(cudaSetDevice(device)); }

Stream create_stream(int device, int priority) {
  cudaStream_t stream = nullptr;
  on_device(device,
            [&] { return cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority); });
  return stream;
}

Event create_event(int device, bool timing) {
  cudaEvent_t event = nullptr;
  on_device(device, [&] {
    return cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming);
  });
  return event;
}

void destroy_event(Event event) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

void record_event(Event event, Stream stream) {
  const EventRecordFn record = driver_event_record();
  if (record != nullptr && record(event, stream) == 0) return;
  // No driver entry point, or a failure: the runtime call reports it in its own words.
  PYDFLASH_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

bool query_event(Event event) {
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) return false;
  PYDFLASH_CUDA_CHECK(err);
  return true;
}

bool stream_busy(Stream stream) {
  auto* s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (capture != cudaStreamCaptureStatusNone) return true;
  const cudaError_t err = cudaStreamQuery(s);
  if (err == cudaErrorNotReady) return true;
  if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky: the next call reports it
  return false;
}

void synchronize_event(Event event) {
  PYDFLASH_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

void synchronize_stream(Stream stream) {
  PYDFLASH_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void stream_wait_event(Stream stream, Event event) {
  PYDFLASH_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

float elapsed_ms(Event start, Event end) {
  float ms = 0;
  PYDFLASH_CUDA_CHECK(
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end)));
  return ms;
}

void launch_host_func(Stream stream, void (*fn)(void*), void* arg) {
  PYDFLASH_CUDA_CHECK(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, arg));
}

void launch_graph(uintptr_t graph_exec, Stream stream) {
  PYDFLASH_CHECK_VALUE(graph_exec != 0, "expected a captured CUDA graph, got a null handle");
  PYDFLASH_CUDA_CHECK(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(graph_exec),
                                      static_cast<cudaStream_t>(stream)));
}

void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Stream stream) {
  PYDFLASH_CUDA_CHECK(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault,
                                        static_cast<cudaStream_t>(stream)));
}

void fill_2d(void* dst, size_t pitch, int value, size_t width, size_t height, Stream stream) {
  PYDFLASH_CUDA_CHECK(
      cudaMemset2DAsync(dst, pitch, value, width, height, static_cast<cudaStream_t>(stream)));
}

}  // namespace pydflash::device
