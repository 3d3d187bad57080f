#include "core/event_pool.h"

#include <mutex>
#include <vector>

#include "core/device_api.h"
#include "core/error.h"

namespace pydflash::event_pool {
namespace {

constexpr int kMaxDevices = 64;

struct Pool {
  std::mutex mutex;
  std::vector<void*> free;
};

Pool& pool(int device) {
  PYDFLASH_INTERNAL_ASSERT(device >= 0 && device < kMaxDevices);
  static Pool* pools = new Pool[kMaxDevices];  // leaked: futures may die during exit
  return pools[device];
}

}  // namespace

void* take(int device) {
  Pool& p = pool(device);
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    if (!p.free.empty()) {
      void* e = p.free.back();
      p.free.pop_back();
      return e;
    }
  }
  return device::create_event(device, /*timing=*/false);
}

void take_all(int device, std::vector<void*>& into) {
  Pool& p = pool(device);
  std::lock_guard<std::mutex> lock(p.mutex);
  into.insert(into.end(), p.free.begin(), p.free.end());
  p.free.clear();
}

void give(int device, void* event) {
  Pool& p = pool(device);
  std::lock_guard<std::mutex> lock(p.mutex);
  p.free.push_back(event);
}

void record(int device, void* event, void* stream) {
  try {
    device::record_event(event, stream);
  } catch (...) {
    give(device, event);
    throw;
  }
}

}  // namespace pydflash::event_pool
