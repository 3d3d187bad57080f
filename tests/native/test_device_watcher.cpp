#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/device_api.h"
#include "core/device_watcher.h"
#include "harness.h"

using namespace pydflash;

// Without CUDA every wait fails, which exercises the watcher's threading alone: order,
// hand-off between threads, and draining what is queued at destruction.
TEST_CASE("device watcher: completions in watch order, all before destruction") {
  if (device::compiled_with_cuda()) return;  // the GPU tests cover a real device
  constexpr int kThreads = 4, kPerThread = 500;
  std::mutex mutex;
  std::vector<int> order;
  std::atomic<int> completed{0}, with_error{0};
  {
    DeviceWatcher watcher(0);
    std::vector<std::thread> producers;
    for (int t = 0; t < kThreads; ++t) {
      producers.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) {
          watcher.watch(nullptr, [&, t, i](const std::string& error) {
            if (!error.empty()) with_error.fetch_add(1);
            std::lock_guard<std::mutex> lock(mutex);
            order.push_back(t * kPerThread + i);
            completed.fetch_add(1);
          });
        }
      });
    }
    for (auto& p : producers) p.join();
  }  // destruction waits for every completion
  CHECK(completed.load() == kThreads * kPerThread);
  CHECK(with_error.load() == kThreads * kPerThread);
  // Each producer's items complete in the order it watched them.
  std::vector<int> last(kThreads, -1);
  for (int id : order) {
    const int t = id / kPerThread, i = id % kPerThread;
    CHECK(i > last[t]);
    last[t] = i;
  }
}
