// The CUDA events a GPU lane makes for its traces belong to the core: whatever drops
// the trace records (taking them, tracing afresh, the lane's end) destroys their events.
#include <memory>

#include "core/lane.h"
#include "fake_device.h"
#include "harness.h"
#include "lane_parts.h"

using namespace pydflash;
using fake_device::NoInterpreter;
using fake_device::Nothing;

namespace {

// A started GPU lane (device 0 of the fake) that traced `tasks` tasks, all run.
std::shared_ptr<Lane> traced_lane(int tasks) {
  auto lane = std::make_shared<Lane>(0, 0, std::make_shared<NoInterpreter>(), LaneOptions{});
  lane->start();
  lane->set_tracing(true);
  for (int i = 0; i < tasks; ++i) lane->submit(lane->new_future(), std::make_unique<Nothing>());
  lane->shutdown(false);
  CHECK(lane->join(-1));
  return lane;
}

}  // namespace

TEST_CASE("trace events: taken records destroy their events when dropped") {
  const int before = fake_device::live_events();
  auto lane = traced_lane(3);
  CHECK(fake_device::live_events() == before + 1 + 2 * 3);  // the epoch, two per task
  {
    auto records = lane->take_trace();
    CHECK(records.size() == 3);
  }
  CHECK(fake_device::live_events() == before + 1);
  lane.reset();
  CHECK(fake_device::live_events() == before);
}

TEST_CASE("trace events: tracing afresh destroys the dropped records' events") {
  const int before = fake_device::live_events();
  auto lane = traced_lane(3);
  lane->set_tracing(false);
  lane->set_tracing(true);  // drops the three records
  CHECK(fake_device::live_events() == before + 1);
  lane.reset();
  CHECK(fake_device::live_events() == before);
}

TEST_CASE("trace events: a lane's end destroys the records it still holds") {
  const int before = fake_device::live_events();
  traced_lane(3).reset();
  CHECK(fake_device::live_events() == before);
}
