// A fake of the device seam (csrc/core/device_api.h) for tests of what the core does
// with CUDA objects: GPU lanes without a GPU. Streams are dummies, events are counted
// heap objects, and work "on the device" is done at once.
#pragma once

namespace pydflash::fake_device {

/// Events created and not yet destroyed.
int live_events();
/// What device::stream_busy answers for every stream (false at first).
void set_streams_busy(bool busy);
/// Whether device::query_event answers "not yet" for every event (false at first).
void set_events_pending(bool pending);

}  // namespace pydflash::fake_device
