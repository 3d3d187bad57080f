#include "core/device_api.h"
#include "core/error.h"
#include "harness.h"

using namespace pydflash;

TEST_CASE("device: no devices and clear errors without CUDA") {
  if (device::compiled_with_cuda()) return;  // covered by the CUDA build's own tests
  CHECK(device::device_count() == 0);
  CHECK(device::unavailable_reason() == "pydflash was built without CUDA");
  CHECK_THROWS_AS(device::busy_wait(nullptr, 1000, 1), StateError);
  CHECK_THROWS_AS(device::create_stream(0, 0), StateError);
}
