// CUDA events for task results, pooled per device for the whole process: a future gives
// its event back when it dies, which may be after its lane is gone. The pools are never
// destroyed (Note [CUDA objects at exit]).
#pragma once

namespace pydflash::event_pool {

/// An event of `device` (created when the pool is empty); no timing, for ordering only.
void* take(int device);
void give(int device, void* event);

}  // namespace pydflash::event_pool
