#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace pydflash {

// Note [Completions off the stream]: a graph task's future completes when the GPU has
// run the graph. A host function on the lane stream (cudaLaunchHostFunc) would say when,
// but the stream cannot start its next work until that function has returned, and CUDA
// runs the host functions of a device's streams on one thread of its own: every launch
// then waited for that thread to wake, and lanes waited for each other's callbacks.
// Instead a watcher thread per lane waits on each launch's event, in launch order, and
// finishes the futures; the stream never waits for the host.

/// Waits on events of one device in order and calls each one's completion. Calls come
/// from the watcher's own thread, which touches neither Python nor the lane's queue.
class DeviceWatcher {
 public:
  /// Called once the event has passed, with an empty string, or the CUDA error text.
  using Completion = std::function<void(const std::string& error)>;

  explicit DeviceWatcher(int device);
  /// Completes everything watched, then joins the thread.
  ~DeviceWatcher();
  DeviceWatcher(const DeviceWatcher&) = delete;
  DeviceWatcher& operator=(const DeviceWatcher&) = delete;

  /// Calls done() once `event` has passed. A prompt watch blocks in the event's
  /// synchronize, which spins under CUDA's default scheduling: a completion someone waits
  /// for. Otherwise the watcher polls the event with sleeps between queries (50 us
  /// growing to 2 ms): a release that may come late, at a small cost in CPU.
  void watch(void* event, Completion done, bool prompt = true);

 private:
  struct Item {
    void* event;
    Completion done;
    bool prompt;
  };
  void main();

  const int device_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Item> items_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pydflash
