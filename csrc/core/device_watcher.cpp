#include "core/device_watcher.h"

#include <exception>
#include <utility>

#include "core/device_api.h"

namespace pydflash {

DeviceWatcher::DeviceWatcher(int device) : device_(device), thread_([this] { main(); }) {}

DeviceWatcher::~DeviceWatcher() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void DeviceWatcher::watch(void* event, Completion done) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(Item{event, std::move(done)});
  }
  cv_.notify_one();
}

void DeviceWatcher::main() {
  // Without the device every wait fails alike: each completion is told why.
  std::string device_error;
  try {
    device::set_device(device_);
  } catch (const std::exception& e) {
    device_error = e.what();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !items_.empty(); });
    if (items_.empty()) return;  // stopping, and everything watched is complete
    Item item = std::move(items_.front());
    items_.pop_front();
    lock.unlock();
    std::string error = device_error;
    if (error.empty()) {
      try {
        device::synchronize_event(item.event);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    item.done(error);
    lock.lock();
  }
}

}  // namespace pydflash
