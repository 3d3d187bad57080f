// A watch that is not prompt (DeviceWatcher::watch, prompt=false) polls its event with
// sleeps instead of synchronizing on it: it completes once the event passes, not before,
// and in order with the prompt watches queued behind it.
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/device_watcher.h"
#include "fake_device.h"
#include "harness.h"

using namespace pydflash;

TEST_CASE("polled watch: completes once its event passes, before the watches behind it") {
  fake_device::set_events_pending(true);
  std::atomic<int> done{0};
  std::vector<int> order;
  {
    DeviceWatcher watcher(0);
    int event = 0;
    watcher.watch(
        &event,
        [&](const std::string& error) {
          CHECK(error.empty());
          order.push_back(1);
          done.fetch_add(1);
        },
        /*prompt=*/false);
    watcher.watch(&event, [&](const std::string&) {
      order.push_back(2);
      done.fetch_add(1);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(done.load() == 0);  // still pending: polled, not given up on
    fake_device::set_events_pending(false);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (done.load() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  CHECK(done.load() == 2);
  CHECK(order == (std::vector<int>{1, 2}));
}
