#include "fake_device.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/device_api.h"

namespace pydflash::fake_device {
namespace {

struct FakeEvent {
  bool recorded = false;
};

std::atomic<int> live{0};
std::atomic<bool> streams_busy{false};
std::atomic<bool> events_pending{false};
char streams[64];  // distinct non-null handles

}  // namespace

int live_events() { return live.load(); }
void set_streams_busy(bool busy) { streams_busy.store(busy); }
void set_events_pending(bool pending) { events_pending.store(pending); }

}  // namespace pydflash::fake_device

namespace pydflash::device {

using fake_device::FakeEvent;

bool compiled_with_cuda() { return true; }
int device_count() { return 1; }
std::string unavailable_reason() { return ""; }
int runtime_version() { return 0; }
int driver_version() { return 0; }
void set_device(int) {}
Stream create_stream(int, int) {
  static std::atomic<int> next{0};
  return &fake_device::streams[next.fetch_add(1) % 64];
}
Event create_event(int, bool) {
  fake_device::live.fetch_add(1);
  return new FakeEvent;
}
void destroy_event(Event event) {
  if (event == nullptr) return;
  fake_device::live.fetch_sub(1);
  delete static_cast<FakeEvent*>(event);
}
void record_event(Event event, Stream) { static_cast<FakeEvent*>(event)->recorded = true; }
bool query_event(Event) { return !fake_device::events_pending.load(); }
bool stream_busy(Stream) { return fake_device::streams_busy.load(); }
void synchronize_event(Event) {}
void synchronize_stream(Stream) {}
void stream_wait_event(Stream, Event) {}
float elapsed_ms(Event, Event) { return 0.0f; }
void launch_host_func(Stream, void (*fn)(void*), void* arg) { fn(arg); }
void launch_graph(uintptr_t, Stream) {}
// Copies and fills act on host memory at once: tests pass host buffers as "device" ones.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Stream) {
  for (size_t row = 0; row < height; ++row) {
    std::memcpy(static_cast<char*>(dst) + row * dpitch,
                static_cast<const char*>(src) + row * spitch, width);
  }
}
void fill_2d(void* dst, size_t pitch, int value, size_t width, size_t height, Stream) {
  for (size_t row = 0; row < height; ++row) {
    std::memset(static_cast<char*>(dst) + row * pitch, value, width);
  }
}
void fill_i64(void* dst, size_t count, int64_t value, Stream) {
  std::fill_n(static_cast<int64_t*>(dst), count, value);
}
void busy_wait(Stream, uint64_t, int) {}

}  // namespace pydflash::device
