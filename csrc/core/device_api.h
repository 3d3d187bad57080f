// The seam between the core and CUDA. No CUDA headers here: handles are opaque, and
// the core depends on nothing else of CUDA's. csrc/cuda/device_cuda.cpp implements it;
// a build without a CUDA compiler links csrc/nocuda/device_none.cpp instead, whose
// functions report "no device" or throw StateError.
//
// Note [CUDA objects at exit]: lane streams are created once and never destroyed, and
// pooled result events (core/event_pool.h) live as long as the process. Destroying CUDA
// objects from static destructors races the driver's own teardown at process exit (c10
// leaks its stream pools for the same reason). Events the core makes for one use (the
// trace's, core/lane.h) are owned by an `OwnedEvent` and destroyed with it; a forked
// child leaks them instead, as they are the parent's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace pydflash::device {

using Stream = void*;  // cudaStream_t
using Event = void*;   // cudaEvent_t

bool compiled_with_cuda();
/// Visible devices; 0 (never an exception) when there is no driver or no device.
int device_count();
/// Why device_count() is 0, or "" when it is not.
std::string unavailable_reason();
int runtime_version();  // e.g. 13000; 0 when unknown
int driver_version();   // 0 without a driver

void set_device(int device);
/// A non-blocking stream on `device`. Lane streams live as long as the process: they
/// are never destroyed (Note [CUDA objects at exit]).
Stream create_stream(int device, int priority);
Event create_event(int device, bool timing);
void destroy_event(Event event);
void record_event(Event event, Stream stream);
bool query_event(Event event);
/// Whether `stream` still has queued work: true while it is capturing a graph too (its
/// work is then unknown, and a query would end the capture). Never throws: a failed
/// query reads as false.
bool stream_busy(Stream stream);
void synchronize_event(Event event);
void synchronize_stream(Stream stream);
void stream_wait_event(Stream stream, Event event);
float elapsed_ms(Event start, Event end);
/// Runs fn(arg) on a driver thread once the stream reaches this point. fn must not
/// call CUDA.
void launch_host_func(Stream stream, void (*fn)(void*), void* arg);
/// cudaGraphLaunch of a cudaGraphExec_t given as an integer (torch's raw_cuda_graph_exec()).
void launch_graph(uintptr_t graph_exec, Stream stream);
/// cudaMemcpy2DAsync (any direction, by address): `height` rows of `width` bytes,
/// `spitch` apart at `src` and `dpitch` apart at `dst`.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Stream stream);
/// cudaMemset2DAsync: `height` rows of `width` bytes, `pitch` apart, set to byte `value`.
void fill_2d(void* dst, size_t pitch, int value, size_t width, size_t height, Stream stream);
/// `count` int64s at `dst` set to `value` (a kernel).
void fill_i64(void* dst, size_t count, int64_t value, Stream stream);
/// A kernel that keeps one thread block busy for `ns` nanoseconds: GPU work of known length.
void busy_wait(Stream stream, uint64_t ns, int blocks);

/// An event that is not pooled, destroyed with its owner (move-only). Note [CUDA objects
/// at exit]: an owner that may outlive the process's CUDA, or lives in a forked child,
/// calls release() and leaks it.
class OwnedEvent {
 public:
  OwnedEvent() = default;
  explicit OwnedEvent(Event event) : event_(event) {}
  OwnedEvent(OwnedEvent&& other) noexcept : event_(other.release()) {}
  OwnedEvent& operator=(OwnedEvent&& other) noexcept {
    if (this != &other) {
      reset();
      event_ = other.release();
    }
    return *this;
  }
  OwnedEvent(const OwnedEvent&) = delete;
  OwnedEvent& operator=(const OwnedEvent&) = delete;
  ~OwnedEvent() { reset(); }

  Event get() const { return event_; }
  explicit operator bool() const { return event_ != nullptr; }
  /// Destroys the event now.
  void reset() {
    if (event_ != nullptr) destroy_event(std::exchange(event_, nullptr));
  }
  /// Gives the event up without destroying it.
  Event release() { return std::exchange(event_, nullptr); }

 private:
  Event event_ = nullptr;
};

}  // namespace pydflash::device
