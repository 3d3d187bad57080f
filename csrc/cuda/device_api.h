// The seam between the core and CUDA. No CUDA headers here: handles are opaque, and
// a build without a CUDA compiler links csrc/nocuda/device_none.cpp instead, whose
// functions report "no device" or throw StateError.
#pragma once

#include <cstdint>
#include <string>

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
/// are never destroyed (see Note [CUDA objects at exit] in device_cuda.cpp).
Stream create_stream(int device, int priority);
Event create_event(int device, bool timing);
void destroy_event(Event event);
void record_event(Event event, Stream stream);
bool query_event(Event event);
void synchronize_event(Event event);
void synchronize_stream(Stream stream);
void stream_wait_event(Stream stream, Event event);
float elapsed_ms(Event start, Event end);
/// Runs fn(arg) on a driver thread once the stream reaches this point. fn must not
/// call CUDA.
void launch_host_func(Stream stream, void (*fn)(void*), void* arg);
/// cudaGraphLaunch of a cudaGraphExec_t given as an integer (torch's raw_cuda_graph_exec()).
void launch_graph(uintptr_t graph_exec, Stream stream);
/// A kernel that keeps one thread block busy for `ns` nanoseconds: GPU work of known length.
void busy_wait(Stream stream, uint64_t ns, int blocks);

}  // namespace pydflash::device
