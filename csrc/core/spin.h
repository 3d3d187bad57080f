// Polling instead of sleeping, only while a core is free for it.
#pragma once

#include <cstdint>

#include "core/clock.h"

namespace pydflash {

/// Note [Polling only on a free core]: a thread that polls instead of sleeping (a
/// future's waiter, an idle worker watching its queue, a worker waiting for the GIL)
/// saves a wake-up, a few µs, when a core is free for it. When none is, each
/// sched_yield hands the core to another process for its time slice (a millisecond or
/// more), while a thread asleep on a futex is run as soon as it is woken (the scheduler
/// favours woken sleepers): under K busy processes on 2 cores, a polling round trip cost
/// 8 to 40 times ThreadPoolExecutor's blocking one (issue 35). So every poll asks
/// cores_free() before each try, and sleeps as soon as it says no.
///
/// cores_free() reads how many threads the machine has runnable now (the kernel's count,
/// /proc/loadavg's fourth field, the polling thread included) against the cores this
/// process may run on, at most every kLoadReadNs, shared by every thread. A yield that
/// returns late (kLateYieldNs: another thread ran on this core meanwhile) says the cores
/// are busy until the next read. Where the count cannot be read, late yields alone decide.
bool cores_free();

/// std::this_thread::yield(), noting a late return (see above).
void yield_core();

/// Polls `ready` until it holds, now_ns() passes `until_ns`, or cores_free() says no,
/// yielding between tries; returns ready()'s last answer. Tries at least once.
template <typename Ready>
bool poll_while_cores_free(int64_t until_ns, Ready&& ready) {
  for (;;) {
    if (ready()) return true;
    if (now_ns() >= until_ns || !cores_free()) return false;
    yield_core();
  }
}

}  // namespace pydflash
