// The device seam for builds without a CUDA compiler: no devices, and every call that
// would need one says so.
#include "core/device_api.h"
#include "core/error.h"

namespace pydflash::device {
namespace {
[[noreturn]] void no_cuda() {
  throw StateError("pydflash was built without CUDA (no CUDA compiler at build time); "
                   "reinstall with a CUDA toolkit on PATH or PYDFLASH_CUDA=ON");
}
}  // namespace

bool compiled_with_cuda() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return "pydflash was built without CUDA"; }
int runtime_version() { return 0; }
int driver_version() { return 0; }
void set_device(int) { no_cuda(); }
Stream create_stream(int, int) { no_cuda(); }
Event create_event(int, bool) { no_cuda(); }
void destroy_event(Event) {}
void record_event(Event, Stream) { no_cuda(); }
bool query_event(Event) { no_cuda(); }
bool stream_busy(Stream) { return false; }
void synchronize_event(Event) { no_cuda(); }
void synchronize_stream(Stream) { no_cuda(); }
void stream_wait_event(Stream, Event) { no_cuda(); }
float elapsed_ms(Event, Event) { no_cuda(); }
void launch_host_func(Stream, void (*)(void*), void*) { no_cuda(); }
void launch_graph(uintptr_t, Stream) { no_cuda(); }
void copy_2d(void*, size_t, const void*, size_t, size_t, size_t, Stream) { no_cuda(); }
void fill_2d(void*, size_t, int, size_t, size_t, Stream) { no_cuda(); }
void fill_i64(void*, size_t, int64_t, Stream) { no_cuda(); }
void busy_wait(Stream, uint64_t, int) { no_cuda(); }

}  // namespace pydflash::device
