// A quiet device: while one lane captures a CUDA graph, every other lane of the same
// device, in any Dispatcher of the process, finishes its current task and waits before
// its next one. One QuietDevice per device (the CPU is -1) in a process-wide registry;
// lanes are its members from start() until their worker exits.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pydflash {

// Note [Quiet device for capture]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A CUDA graph capture records every call made on the capturing stream, and CUDA
// refuses, or silently breaks the capture on, calls that synchronise with it. With
// capture_error_mode="thread_local" CUDA only checks the capturing thread, but the
// libraries underneath keep state per device or per process, not per thread: cuDNN's
// execution plans and their workspaces, cuBLAS's workspaces, the caching allocator's
// pools, Triton's autotuner (which calls torch.cuda.synchronize() while benchmarking).
// A task on another lane of the same device that runs cuDNN attention, autotunes, or
// synchronises the device while a capture is open makes the capture fail ("operation not
// permitted when stream is capturing", cuDNN's execute() returning an error), or fails
// itself. Captures are rare (once per bucket and lane), so the capture takes the device:
//
//   1. The capturer, a task on lane L, calls quiesce(L). Every other member of L's
//      device finishes the task it is running and pauses before its next one, Python
//      tasks, graph launches and internal completions alike, without the GIL.
//   2. Once all have paused, the capturer captures. Nothing else of pydflash's runs on
//      the device: no task, no launch, no copy on a lane's copy stream (copies are
//      issued by tasks).
//   3. resume(L) lets the paused lanes go on.
//
// What pydflash cannot pause, and a capture therefore requires of the rest of the
// process: threads that are not lane workers (the training thread, autograd's device
// threads, a DataLoader's pin-memory thread, NCCL's watchdog) must not synchronise the
// device, allocate through cudaMalloc outside the caching allocator, or query or wait on
// events recorded on the capturing stream while the capture is open; and the capture
// itself must not wait for work of another lane of its device (that lane is paused: the
// capture would wait until the timeout of nothing, forever), that lane's current task
// included (a task blocked in a future wait counts as paused, below). The lanes' device
// watcher threads keep waiting on the events of graph launches made before the quiet;
// those events are on other lanes' streams and are never captured, which CUDA allows beside a
// thread_local capture (a "global" one forbids them: use thread_local).
//
// Waits are safe points: a lane whose task is blocked in a wait on a pydflash future
// (FutureState::wait: Future.result(), exception(), wait_all, everything that waits
// natively) counts as paused while it waits (QuietWait). A waiting thread makes no CUDA
// call and holds no GIL; what it waits for is another lane's task, which the quiet orders
// like any other. Without this, a task waiting for the capturer's own work (a drafter
// waiting for its target's microbatch while the target lane captures a bucket) would hold
// the capturer until its timeout, and the capture would never happen. When such a wait
// ends while another lane holds the quiet, the waiter pauses there, without the GIL,
// before it returns to its task, as it would between tasks. A wait that needs no blocking
// (the future is done) does not touch the quiet; one on a thread that is no lane's worker
// costs one thread-local read. Waits in Python (threading, concurrent.futures.wait) are
// not seen: such a lane is busy, as in any other task.
//
// Why this is enough: the failures above come from two host threads using one device's
// shared library state at once. With every lane paused between tasks or in a wait, the
// capturing task is the only pydflash code using the device; work already queued on the
// GPU by earlier tasks keeps running, which a capture does not mind (it records calls,
// not execution).
//
// Deadlock freedom:
//   - A lane waiting to quiesce while another holds the device counts as paused (it runs
//     nothing while it waits), so two capturers never wait for each other: one goes
//     first, the other once it has ended. The waiting one cannot give up early: it would
//     go on running work beside the other's capture.
//   - A lane blocked in a future wait counts as paused, so a task that waits for the
//     capturer's work (a future queued behind the capture on its lane) does not hold
//     the capturer. The waiter marks itself blocked and then checks for a quiet; the
//     holder marks the quiet and then checks the members (all seq_cst): one sees the
//     other, so a waiter either counts as paused or is waited for like a running task,
//     and one that wakes inside a quiet pauses before running anything. It pauses holding
//     no lock and no GIL, like a paused lane; the holder's own waits never pause.
//   - The holder gives up when the others have not all paused within its timeout, and
//     lets go of those that had: a lane whose current task is busy otherwise (computing,
//     or waiting on something that is not a pydflash future) holds the capturer only that
//     long.
//   - A paused lane holds no GIL and no lock. Shut down while paused, it stays paused
//     until the quiet ends, then goes on as shutdown asked (its queued tasks cancelled,
//     or run as an executor runs them) and exits: the quiet lasts as long as the capture's
//     task, and waiting for it is waiting for that task. Interpreter exit waits for it
//     no longer than for any running task (PYDFLASH_EXIT_TIMEOUT); a paused thread it
//     leaves behind holds nothing the exit needs. A lane whose worker exits leaves its
//     device, and a quiet still held by a lane's task ends before that lane's next task.
//   - A forked child starts with a fresh registry: nothing a parent's lane held or waited
//     for is seen there, and its one thread (the forking one, maybe a lane's worker in
//     the parent) is no lane's worker: its future waits do not touch the quiet.
//
// Cost when nobody quiesces: one relaxed load of requested() per task in the worker
// loop, and per blocking future wait on a worker two stores and two loads of atomics. A lane asleep
// on an empty queue is woken by a pause check posted to its queue, whose pop orders the request
// before the worker's load (the queue's mutex).

/// A lane's membership of its device's QuietDevice. The fields are guarded by the
/// device's mutex, except `worker`.
struct QuietMember {
  /// Wakes the member's worker, wherever it waits, so that it reaches its pause check.
  std::function<void()> poke;
  std::atomic<std::thread::id> worker{};  // set once the worker thread runs
  bool paused = false;                    // in pause(): runs nothing until the quiet ends
  bool waiting = false;                   // in quiesce(), waiting for another quiet to end
  /// In a future wait (QuietWait): counts as paused. Written by the worker without the
  /// device's mutex (see QuietWait).
  std::atomic<bool> blocked{false};
  // Stats.
  uint64_t pauses = 0;
  int64_t paused_ns = 0;
  uint64_t quiets = 0;          // quiesce() that returned true
  uint64_t quiet_timeouts = 0;  // quiesce() that returned false
  int64_t quiet_wait_ns = 0;    // time spent in quiesce()
};

struct QuietStats {
  uint64_t pauses = 0;
  int64_t paused_ns = 0;
  uint64_t quiets = 0;
  uint64_t quiet_timeouts = 0;
  int64_t quiet_wait_ns = 0;
};

/// Note [Quiet device for capture].
class QuietDevice {
 public:
  /// The process's QuietDevice for `device` (-1: the CPU). Never destroyed; a forked
  /// child gets fresh ones.
  static QuietDevice& of(int device);

  explicit QuietDevice(int device) : device_(device) {}
  QuietDevice(const QuietDevice&) = delete;
  QuietDevice& operator=(const QuietDevice&) = delete;

  int device() const { return device_; }

  /// Registers `member`, which must stay alive until leave().
  void join(QuietMember& member);
  /// Unregisters `member`; ends its quiet if it held one.
  void leave(QuietMember& member);

  /// Whether a quiet may be in progress: the hot path's one relaxed load. A worker that
  /// sees true calls pause() before its next task.
  bool requested() const { return requested_.load(std::memory_order_relaxed); }
  /// On `member`'s worker, between tasks and without the interpreter: returns at once
  /// unless another member holds the device quiet; else waits until that quiet ends.
  void pause(QuietMember& member);

  /// On `member`'s worker, inside a task: waits (counting as paused) until no other
  /// member holds the quiet, then takes it and waits for every other member to pause.
  /// True once all have; false when `timeout_s` (from taking it; < 0: forever) passes
  /// first, and then nothing stays paused for this call. Nests: a holder's further
  /// calls return true and need their own resume().
  bool quiesce(QuietMember& member, double timeout_s);
  /// Ends a quiesce() that returned true. False when `member` holds no quiet.
  bool resume(QuietMember& member);

  /// Makes the calling thread `member`'s worker for QuietWait (null: none). Called by
  /// the worker itself as it starts and before it leaves the device.
  static void bind_thread(QuietDevice* device, QuietMember* member);

  QuietStats stats(const QuietMember& member);
  /// Who holds the quiet now (tests).
  bool held_by(const QuietMember& member);

 private:
  friend class QuietWait;
  bool others_paused(const QuietMember& holder) const;  // locked
  void end_locked();
  void begin_wait(QuietMember& member);
  void end_wait(QuietMember& member);

  const int device_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<QuietMember*> members_;
  QuietMember* holder_ = nullptr;
  int depth_ = 0;  // nested quiesce() calls of the holder
  // holder_ != nullptr; written under mutex_. Read by every worker of the device before
  // each task (relaxed), and by QuietWait (seq_cst, against `blocked`): on a line of its
  // own, which only a quiet's start and end write.
  alignas(64) std::atomic<bool> requested_{false};
};

/// Note [Quiet device for capture]: a future wait is a safe point. Held around a
/// blocking wait (FutureState::wait): on a lane's worker, the lane counts as paused for
/// its device's quiets while the wait lasts; when it ends while another lane holds the
/// quiet, the destructor pauses until that quiet ends, as a worker pauses between tasks.
/// On any other thread it does nothing beyond one thread-local read.
class QuietWait {
 public:
  QuietWait();
  ~QuietWait();
  QuietWait(const QuietWait&) = delete;
  QuietWait& operator=(const QuietWait&) = delete;

 private:
  QuietDevice* const device_;
  QuietMember* const member_;
};

}  // namespace pydflash
