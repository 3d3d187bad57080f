// CUDA events for task results, pooled per device for the whole process: a future gives
// its event back when it dies, which may be after its lane is gone. The pools are never
// destroyed (Note [CUDA objects at exit]).
#pragma once

#include <vector>

namespace pydflash::event_pool {

/// One event of `device`, created when none is free.
void* take(int device);
/// Moves the events given back so far for `device` into `into` (one lock for many: a
/// lane keeps its own cache and refills it from here).
void take_all(int device, std::vector<void*>& into);
void give(int device, void* event);
/// Records `event`, taken from the pool of `device`, on `stream`; gives it back and
/// rethrows when recording fails.
void record(int device, void* event, void* stream);

}  // namespace pydflash::event_pool
