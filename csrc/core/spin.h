// Polling instead of sleeping, only while a core is free for it.
#pragma once

#include <cstdint>

#include "core/clock.h"

namespace pydflash {

/// Note [Polling only on a free core]: a thread that polls instead of sleeping (a
/// future's waiter, an idle worker watching its queue, a worker waiting for the GIL)
/// saves a wake-up, a few µs, when a core is free for it. When none is, each
/// sched_yield between tries hands the core to another process for its time slice
/// (milliseconds), while a thread asleep on a futex runs as soon as it is woken (the
/// scheduler favours woken sleepers): under 2 and 4 busy processes on 2 cores, a polling
/// round trip cost 5 and 15 ms where ThreadPoolExecutor's blocking one cost 21 and 27 µs
/// (issue 35).
///
/// A yield that returns late (after kLateYieldNs, half a millisecond: another thread had
/// this core for a time slice) is the sign, and the only cost is that one slice: from
/// then on every poll of the process sleeps at once for a back-off, which doubles from
/// kMinBackOffNs (1 ms) to kMaxBackOffNs (256 ms) with each late yield of the polls that
/// try again, and starts over after kPromptStreak prompt yields in a row: a lucky prompt
/// poll on a busy machine must not bring the polls, and their lost slices, back every
/// millisecond. A shorter threshold also caught yields to this process's own threads'
/// short bursts (a worker spinning while the caller ran ThreadPoolExecutor round trips),
/// and backed off on a quiet machine. The load average cannot say it either: it counts
/// threads runnable anywhere, while only those queued on the poller's own core take its
/// slice, and on a shared machine others' short bursts made it call a quiet one busy.
bool cores_free();

/// std::this_thread::yield(); false when it returned late, which starts a back-off.
bool yield_core();
/// Late yields so far in this process, for tests and stats.
uint64_t late_yields();

/// Polls `ready` until it holds, now_ns() passes `until_ns`, or cores_free() says no,
/// yielding between tries; returns ready()'s last answer. Tries at least once.
template <typename Ready>
bool poll_while_cores_free(int64_t until_ns, Ready&& ready) {
  for (;;) {
    if (ready()) return true;
    if (now_ns() >= until_ns || !cores_free() || !yield_core()) return false;
  }
}

}  // namespace pydflash
