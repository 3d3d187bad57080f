#include "core/device_watcher.h"

#ifdef __linux__
#include <pthread.h>
#endif

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>
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

void DeviceWatcher::watch(void* event, Completion done, bool prompt) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(Item{event, std::move(done), prompt});
  }
  cv_.notify_one();
}

void DeviceWatcher::main() {
#ifdef __linux__
  // Its own name (a thread inherits its creator's, a lane worker's): profiles and
  // per-thread CPU times tell the two apart.
  pthread_setname_np(pthread_self(),
                     ("pydflash-watch" + std::to_string(device_)).substr(0, 15).c_str());
#endif
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
        if (item.prompt) {
          device::synchronize_event(item.event);
        } else {
          for (auto pause = std::chrono::microseconds(50); !device::query_event(item.event);
               pause = std::min(2 * pause, std::chrono::microseconds(2000))) {
            std::this_thread::sleep_for(pause);
          }
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    item.done(error);
    lock.lock();
  }
}

}  // namespace pydflash
