#include "fake_device.h"

#include <atomic>

#include "core/device_api.h"

namespace pydflash::fake_device {
namespace {

struct FakeEvent {
  bool recorded = false;
};

std::atomic<int> live{0};
std::atomic<bool> streams_busy{false};
char streams[64];  // distinct non-null handles

}  // namespace

int live_events() { return live.load(); }
void set_streams_busy(bool busy) { streams_busy.store(busy); }

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
bool query_event(Event) { return true; }
bool stream_busy(Stream) { return fake_device::streams_busy.load(); }
void synchronize_event(Event) {}
void synchronize_stream(Stream) {}
void stream_wait_event(Stream, Event) {}
float elapsed_ms(Event, Event) { return 0.0f; }
void launch_host_func(Stream, void (*fn)(void*), void* arg) { fn(arg); }
void launch_graph(uintptr_t, Stream) {}
void busy_wait(Stream, uint64_t, int) {}

}  // namespace pydflash::device
