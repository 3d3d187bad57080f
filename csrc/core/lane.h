// A lane: one native worker thread bound to one device (a GPU ordinal, or -1 for the
// CPU), its own streams, a FIFO of tasks, and counters. The core knows nothing about
// Python: tasks that need the interpreter say so, and the Interpreter hooks (the GIL,
// in csrc/python) are entered only while such tasks run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/device_api.h"
#include "core/device_quiet.h"
#include "core/device_watcher.h"
#include "core/future.h"
#include "core/task_queue.h"

namespace pydflash {

class Lane;

/// What a worker holds to run tasks that need it. Called only on the worker thread.
class Interpreter {
 public:
  virtual ~Interpreter() = default;
  /// First thing on the worker thread, before any task; not entered.
  virtual void thread_started(Lane&) {}
  virtual void enter() = 0;
  /// enter() for work that no thread waits on (an internal release): it may block on
  /// the interpreter at once rather than spend CPU to enter sooner.
  virtual void enter_unhurried() { enter(); }
  virtual void leave() = 0;
  /// Last thing on the worker thread; not entered.
  virtual void thread_exiting() {}
};

class TaskBody {
 public:
  virtual ~TaskBody() = default;
  virtual bool needs_interpreter() const = 0;
  /// Whether the body still holds interpreter objects, so must be destroyed entered.
  virtual bool needs_interpreter_to_destroy() const { return needs_interpreter(); }
  /// Runs the task and records its outcome; `future` is null for internal work.
  /// Returns true when the task is complete; false when its completion arrives later
  /// (work still on the GPU). Must not throw: failures are outcomes.
  virtual bool run(Lane& lane, FutureState* future) = 0;
  /// Entered; called once the finished future is observed (Note [Observed futures]).
  virtual void notify(FutureState&) {}
  /// Label for traces.
  virtual std::string label() const { return "task"; }
};

struct Task {
  std::shared_ptr<FutureState> future;  // null for internal work (completions)
  std::unique_ptr<TaskBody> body;
};

struct LaneOptions {
  int64_t spin_ns = 50'000;  // how long an idle worker polls before sleeping, at first
  int stream_priority = 0;
  /// The device whose quiets pause this lane (Note [Quiet device for capture]); the
  /// lane's own by default. Tests give CPU lanes others.
  std::optional<int> quiet_device;
};

/// The longest poll window a lane may be given (Note [Adaptive polling]): a second.
static constexpr double kMaxSpinUs = 1'000'000.0;
/// spin_us as LaneOptions::spin_ns. Throws ValueError outside [0, kMaxSpinUs] (NaN too).
int64_t spin_ns_from_us(double spin_us);

struct LaneStats {
  uint64_t submitted = 0;
  uint64_t completed = 0;
  uint64_t cancelled = 0;
  uint64_t queued = 0;
  uint64_t running = 0;
  uint64_t on_device = 0;
  int64_t busy_ns = 0;
  int64_t queue_wait_ns = 0;
  int64_t spin_ns = 0;  // the idle worker's poll window now (Note [Adaptive polling])
};

/// One task as the trace sees it: host times, and the lane-stream events around it
/// on GPU lanes (timing events, recorded only while tracing). The record owns its
/// events: whoever drops it destroys them (Note [CUDA objects at exit]).
struct TraceRecord {
  uint64_t id = 0;
  std::string label;
  int64_t submit_ns = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  device::OwnedEvent gpu_begin;
  device::OwnedEvent gpu_end;
};

class Lane : public std::enable_shared_from_this<Lane> {
 public:
  /// device: GPU ordinal, or -1 for a CPU lane. Creates the streams (GPU lanes) here,
  /// on the calling thread; start() launches the worker.
  Lane(int index, int device, std::shared_ptr<Interpreter> interpreter, LaneOptions options);
  ~Lane();
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  void start();
  int index() const { return index_; }
  int device() const { return device_; }
  bool is_gpu() const { return device_ >= 0; }
  void* stream() const { return stream_; }
  void* copy_stream() const { return copy_stream_; }

  /// The id for the next task's future (ids are per lane). Throws StateError after
  /// shutdown or in a forked child.
  uint64_t take_id();
  /// A future for the next task.
  std::shared_ptr<FutureState> new_future() { return std::make_shared<FutureState>(take_id()); }
  /// Queues a task. Throws StateError after shutdown or in a forked child. `future`
  /// may be non-owning when the body keeps its owner alive until destroyed: the worker
  /// does not touch it after destroying the body (Note [Finish, then publish]).
  void submit(std::shared_ptr<FutureState> future, std::unique_ptr<TaskBody> body);
  /// Queues internal work (a completion). Accepted during shutdown.
  void post_internal(std::unique_ptr<TaskBody> body);
  /// Work launched on the device whose completion will be posted later.
  void device_work_started() { on_device_.fetch_add(1); }
  /// The completion of device work: counts its task as completed, as device_work_done().
  void device_work_finished();
  /// Device work done whose task was counted when it finished (a program's release).
  void device_work_done();
  /// Calls `done` from another thread once `event`, recorded on the lane stream, has
  /// passed (Note [Completions off the stream]); `prompt` as for DeviceWatcher::watch.
  /// On the worker only.
  void when_passed(void* event, DeviceWatcher::Completion done, bool prompt = true);

  /// Closes the queue. With cancel, returns the queued tasks with their futures
  /// cancelled, all but the one an idle worker was woken for (Note [Taken is running]);
  /// the caller notifies observers and destroys them (it may hold the GIL).
  /// A task whose future was cancelled before comes back without it: its canceller
  /// has notified it, so it is only destroyed.
  std::vector<Task> shutdown(bool cancel);
  /// Waits for the worker to finish everything queued and exit. False on timeout
  /// (timeout_s < 0 waits forever).
  bool join(double timeout_s);
  bool closed() const { return queue_.closed(); }
  /// Whether the worker has run its last task and left (true when it never started).
  bool exited();
  bool forked() const;

  /// Whether the lane's stream still has queued work (false on CPU lanes): see Note
  /// [Adaptive polling]. Makes no CUDA call while a quiet is asked for on the device.
  bool stream_busy() const;
  /// stream_busy() of the lane whose worker calls it; false on any other thread.
  static bool calling_worker_stream_busy();
  /// Whether the calling thread is a lane's worker.
  static bool on_a_worker();

  /// Tasks submitted so far (a hint: relaxed).
  uint64_t submitted() const { return submitted_.load(std::memory_order_relaxed); }
  /// Queued plus running plus on the device: what least-busy placement compares.
  uint64_t load() const;
  LaneStats stats() const;

  /// Records a pooled event on the lane stream now and gives it to `future` (GPU lanes;
  /// nothing on CPU lanes), for results and handoffs. On the worker only.
  void record_event(FutureState& future);

  /// Note [Quiet device for capture]. From a task on this lane's worker (StateError
  /// otherwise): pauses every other lane of its device; see QuietDevice::quiesce.
  bool quiesce(double timeout_s);
  /// Ends a quiesce() that returned true; StateError when this lane holds no quiet.
  void resume();
  QuietStats quiet_stats() { return forked() ? QuietStats{} : quiet_.stats(quiet_member_); }
  int quiet_device() const { return quiet_.device(); }

  /// Turning tracing on drops the records gathered so far.
  void set_tracing(bool on);
  bool tracing() const { return tracing_.load(std::memory_order_relaxed); }
  /// Takes the records gathered so far, with the epoch they are relative to on the
  /// GPU: (host ns, event) recorded together when tracing started.
  std::vector<TraceRecord> take_trace();
  int64_t trace_epoch_ns() const { return trace_epoch_ns_; }
  void* trace_epoch_event() const { return trace_epoch_event_.get(); }

 private:
  void worker_main();
  void run_one(Task& task);
  /// Gives up the trace's events without destroying them (a forked child's ~Lane).
  void forget_trace_events();
  /// Enter or leave the interpreter; entered_ says which the worker is in.
  void enter(bool hurried = true);
  void leave();
  void pause_for_quiet();

  const int index_;
  const int device_;
  const int owner_pid_;
  const int fork_generation_;
  std::shared_ptr<Interpreter> interpreter_;
  const LaneOptions options_;
  void* stream_ = nullptr;
  void* copy_stream_ = nullptr;

  TaskQueue<Task> queue_;
  // Whether the worker holds the interpreter. Written by the worker only; futures' waiters
  // read it (Note [Finish, then publish]), also after the lane is gone: see in_interpreter_flag().
  std::atomic<bool>& in_interpreter_;
  std::vector<void*> events_;               // result events to reuse; the worker's only
  std::unique_ptr<DeviceWatcher> watcher_;  // made by the worker on first use
  bool entered_ = false;                    // the truth, on the worker thread only
  std::thread* thread_ = nullptr;  // leaked in a forked child: its thread does not exist there
  // Counters on three cache lines, by who writes them, so a submitting thread and the
  // worker do not take each other's line on every task.
  // Submitters. load() is submitted_ less completed_ and cancelled_.
  alignas(64) std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> submitted_{0};
  // The worker (completed_, busy_ns_ and queue_wait_ns_ only; device completions are
  // counted on it too):
  alignas(64) std::atomic<bool> running_task_{false};
  std::atomic<int64_t> on_device_{0};
  std::atomic<uint64_t> completed_{0}, cancelled_{0};
  std::atomic<int64_t> busy_ns_{0}, queue_wait_ns_{0};
  std::atomic<int64_t> spin_ns_;

  std::mutex exit_mutex_;
  std::condition_variable exit_cv_;
  bool exited_ = false;

  QuietDevice& quiet_;
  QuietMember quiet_member_;

  std::atomic<bool> tracing_{false};
  std::mutex trace_mutex_;
  std::vector<TraceRecord> trace_;
  int64_t trace_epoch_ns_ = 0;
  device::OwnedEvent trace_epoch_event_;
};

}  // namespace pydflash
