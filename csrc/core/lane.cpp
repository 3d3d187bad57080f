#include "core/lane.h"

#include <unistd.h>
#ifdef __linux__
#include <pthread.h>
#endif

#include <algorithm>
#include <chrono>

#include "core/clock.h"
#include "core/device_api.h"
#include "core/error.h"
#include "core/event_pool.h"
#include "core/fork.h"

namespace pydflash {

namespace {

// For counters only the worker writes: a plain load and store instead of a locked
// read-modify-write, which readers on other threads still see whole. Release: see load().
template <typename T>
void add_single_writer(std::atomic<T>& counter, T delta) {
  counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_release);
}

// A lane's "holds the interpreter" flag, from a pool that lives for the process: a
// future's waiter may read it after the lane is gone, and a future stores a plain
// pointer, so a submit touches no reference count. Lanes beyond the pool share flags,
// which costs a waiter at most a bounded poll.
std::atomic<bool>& in_interpreter_flag() {
  struct alignas(64) Flag {
    std::atomic<bool> value{false};
  };
  static Flag flags[256];
  static std::atomic<unsigned> next{0};
  return flags[next.fetch_add(1, std::memory_order_relaxed) % 256].value;
}

// Note [Adaptive polling]: an idle worker polls its queue before it sleeps, because
// waking a sleeping thread costs the submitter a system call (several µs in a VM) and
// the task a wake-up. The window starts at spin_ns; each time the worker slept and work
// came back within kBurstGapNs it doubles, up to kMaxSpinNs, and a longer gap puts it
// back. Workers fed in frequent bursts stay awake between them; workers fed once per
// training step do not keep a core busy waiting. A window of zero stays zero.
//
// Polling only shortens the time from a submit to the task's launch on the GPU, which
// matters only when the GPU would otherwise wait. A GPU lane whose stream still holds
// queued work when it goes idle sleeps at once (one cudaStreamQuery): the GPU has work
// to run meanwhile, and a host that polls there only burns a core, which a pipeline of
// graph replays is short of. A task waiting on a pydflash future in that state sleeps at
// once too (`Lane::calling_worker_stream_busy`).
constexpr int64_t kBurstGapNs = 2'000'000;
constexpr int64_t kMaxSpinNs = 1'000'000;

int64_t next_spin_ns(int64_t now_spin, int64_t base, bool slept, int64_t idle_ns) {
  if (!slept) return now_spin;
  if (idle_ns >= kBurstGapNs) return base;
  return std::min(std::max(now_spin * 2, base), std::max(base, kMaxSpinNs));
}

// Posted by a quiesce to each lane of the device: popping it brings a worker asleep on
// an empty queue to its pause check (Note [Quiet device for capture]).
class QuietCheck final : public TaskBody {
 public:
  bool needs_interpreter() const override { return false; }
  bool run(Lane&, FutureState*) override { return true; }
  std::string label() const override { return "quiet check"; }
};

thread_local Lane* worker_lane = nullptr;  // the lane whose worker this thread is

}  // namespace

bool Lane::stream_busy() const {
  // While a capture is asked for or open on the device, no CUDA call: one from the
  // capturing thread (a wait inside the captured function) would end its capture.
  if (!is_gpu()) return false;
  return quiet_.requested() || device::stream_busy(stream_);
}

bool Lane::calling_worker_stream_busy() {
  return worker_lane != nullptr && worker_lane->stream_busy();
}

bool Lane::on_a_worker() { return worker_lane != nullptr; }

int64_t spin_ns_from_us(double spin_us) {
  PYDFLASH_CHECK_VALUE(spin_us >= 0 && spin_us <= kMaxSpinUs, "expected spin_us in [0, ",
                       kMaxSpinUs, "] (microseconds), got ", spin_us);
  return static_cast<int64_t>(spin_us * 1000);
}

Lane::Lane(int index, int device, std::shared_ptr<Interpreter> interpreter, LaneOptions options)
    : index_(index),
      device_(device),
      owner_pid_(static_cast<int>(getpid())),
      fork_generation_(fork_generation()),
      interpreter_(std::move(interpreter)),
      options_(options),
      in_interpreter_(in_interpreter_flag()),
      quiet_(QuietDevice::of(options.quiet_device.value_or(device))) {
  PYDFLASH_INTERNAL_ASSERT(interpreter_ != nullptr);
  spin_ns_.store(options.spin_ns, std::memory_order_relaxed);
  if (is_gpu()) {
    // Note [CUDA objects at exit]: created once, never destroyed.
    stream_ = device::create_stream(device, options.stream_priority);
    copy_stream_ = device::create_stream(device, options.stream_priority);
  }
}

Lane::~Lane() {
  // Once the worker is done with them (a forked child's events are the parent's).
  auto give_back_events = [&] {
    for (void* event : events_) event_pool::give(device_, event);
  };
  if (forked()) forget_trace_events();  // the rest are destroyed with their records
  if (thread_ == nullptr) {
    give_back_events();
    return;
  }
  // A forked child's watcher thread is the parent's: leaked, like the worker.
  if (forked()) (void)watcher_.release();
  if (forked() || thread_->get_id() == std::this_thread::get_id()) {
    // In a forked child the thread never existed; on the worker itself it cannot be
    // joined. Either way the std::thread is leaked rather than destroyed joinable.
    if (!forked()) {
      thread_->detach();
      delete thread_;
      give_back_events();
    }
    return;
  }
  queue_.close();
  if (thread_->joinable()) thread_->join();
  delete thread_;
  give_back_events();
}

bool Lane::forked() const { return fork_generation() != fork_generation_; }

void Lane::start() {
  PYDFLASH_INTERNAL_ASSERT(thread_ == nullptr);
  // The worker keeps the lane alive until it exits.
  auto self = shared_from_this();
  // A member before its first task: a quiesce from now on waits for this lane too.
  quiet_member_.poke = [this] { post_internal(std::make_unique<QuietCheck>()); };
  quiet_.join(quiet_member_);
  try {
    thread_ = new std::thread([self] { self->worker_main(); });
  } catch (...) {
    quiet_.leave(quiet_member_);
    throw;
  }
}

uint64_t Lane::take_id() {
  PYDFLASH_CHECK_STATE(!forked(), "this dispatcher was created in process ", owner_pid_,
                       " and cannot be used in a forked child (pid ", getpid(),
                       "); create a new Dispatcher in the child");
  PYDFLASH_CHECK_STATE(!queue_.closed(), "cannot schedule new futures after shutdown of lane ",
                       index_);
  return next_id_.fetch_add(1, std::memory_order_relaxed);
}

void Lane::submit(std::shared_ptr<FutureState> future, std::unique_ptr<TaskBody> body) {
  future->submit_ns = now_ns();
  future->set_producer_in_interpreter(&in_interpreter_);
  submitted_.fetch_add(1, std::memory_order_relaxed);
  if (!queue_.push(Task{std::move(future), std::move(body)})) {
    submitted_.fetch_sub(1, std::memory_order_relaxed);
    throw StateError(detail::str("cannot schedule new futures after shutdown of lane ", index_));
  }
}

void Lane::post_internal(std::unique_ptr<TaskBody> body) {
  queue_.push_internal(Task{nullptr, std::move(body)});
}

void Lane::when_passed(void* event, DeviceWatcher::Completion done, bool prompt) {
  if (!watcher_) watcher_ = std::make_unique<DeviceWatcher>(device_);
  watcher_->watch(event, std::move(done), prompt);
}

void Lane::device_work_finished() {
  add_single_writer<uint64_t>(completed_, 1);
  device_work_done();
}

void Lane::device_work_done() {
  if (on_device_.fetch_sub(1) == 1) queue_.wake();
}

std::vector<Task> Lane::shutdown(bool cancel) {
  queue_.close();
  if (!cancel) return {};
  // Note [Taken is running]: an idle worker already woken for the first task keeps it.
  std::vector<Task> taken = queue_.take_all(/*spare_awaited=*/true);
  std::vector<Task> cancelled;
  for (auto& task : taken) {
    if (!task.future) {
      // A completion that must still run: put it back for the worker.
      queue_.push_internal(std::move(task));
      continue;
    }
    // Queued futures are pending or already cancelled; only the ones cancelled here
    // are left for the caller to notify.
    if (!task.future->try_cancel()) task.future.reset();
    cancelled_.fetch_add(1, std::memory_order_release);
    cancelled.push_back(std::move(task));
  }
  return cancelled;
}

bool Lane::join(double timeout_s) {
  if (thread_ == nullptr) return true;
  PYDFLASH_CHECK_STATE(!forked(), "cannot join lane ", index_, " in a forked child");
  // Joined under the lock: a second joiner (two shutdowns, or one at exit) must not
  // join the same thread again, which blocks forever, nor read its id meanwhile.
  std::unique_lock<std::mutex> lock(exit_mutex_);
  PYDFLASH_CHECK_STATE(thread_->get_id() != std::this_thread::get_id(),
                       "a task cannot wait for its own lane to shut down (lane ", index_, ")");
  const int64_t deadline = timeout_s < 0 ? INT64_MAX : deadline_after(now_ns(), timeout_s);
  if (deadline == INT64_MAX) {
    exit_cv_.wait(lock, [&] { return exited_; });
  } else if (!exit_cv_.wait_until(
                 lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline)),
                 [&] { return exited_; })) {
    return false;
  }
  if (thread_->joinable()) thread_->join();  // the worker has left exit_mutex_ for good
  return true;
}

bool Lane::exited() {
  if (thread_ == nullptr) return true;
  std::lock_guard<std::mutex> lock(exit_mutex_);
  return exited_;
}

uint64_t Lane::load() const {
  // Finished first: a task counts as submitted before it can finish, so this never
  // goes below zero.
  const uint64_t ended =
      completed_.load(std::memory_order_acquire) + cancelled_.load(std::memory_order_acquire);
  const uint64_t submitted = submitted_.load(std::memory_order_relaxed);
  return submitted > ended ? submitted - ended : 0;
}

LaneStats Lane::stats() const {
  LaneStats s;
  s.submitted = submitted_.load();
  s.completed = completed_.load();
  s.cancelled = cancelled_.load();
  s.queued = queue_.size();
  s.running = running_task_.load() ? 1 : 0;
  s.on_device = static_cast<uint64_t>(on_device_.load());
  s.busy_ns = busy_ns_.load();
  s.queue_wait_ns = queue_wait_ns_.load();
  s.spin_ns = spin_ns_.load();
  return s;
}

void Lane::record_event(FutureState& future) {
  if (!is_gpu()) return;
  if (events_.empty()) event_pool::take_all(device_, events_);
  void* event = nullptr;
  if (events_.empty()) {
    event = device::create_event(device_, /*timing=*/false);
  } else {
    event = events_.back();
    events_.pop_back();
  }
  event_pool::record(device_, event, stream_);
  future.set_event(device_, event);
}

bool Lane::quiesce(double timeout_s) {
  PYDFLASH_CHECK_STATE(!forked(), "cannot quiet the device of lane ", index_, " in a forked child");
  PYDFLASH_CHECK_STATE(quiet_member_.worker.load() == std::this_thread::get_id(),
                       "expected a call from a task running on lane ", index_,
                       ", got one from another thread");
  return quiet_.quiesce(quiet_member_, timeout_s);
}

void Lane::resume() {
  PYDFLASH_CHECK_STATE(!forked(), "cannot quiet the device of lane ", index_, " in a forked child");
  PYDFLASH_CHECK_STATE(quiet_.resume(quiet_member_), "expected lane ", index_,
                       " to hold its device quiet, but it holds none");
}

void Lane::pause_for_quiet() {
  leave();  // paused lanes hold no GIL
  quiet_.pause(quiet_member_);
}

void Lane::set_tracing(bool on) {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  if (on && !tracing_.load()) {
    trace_.clear();
    if (is_gpu()) {
      if (!trace_epoch_event_)
        trace_epoch_event_ = device::OwnedEvent(device::create_event(device_, /*timing=*/true));
      device::record_event(trace_epoch_event_.get(), stream_);
      device::synchronize_event(trace_epoch_event_.get());
    }
    trace_epoch_ns_ = now_ns();
  }
  tracing_.store(on);
}

void Lane::forget_trace_events() {
  // Note [CUDA objects at exit]: a forked child's events are the parent's.
  std::lock_guard<std::mutex> lock(trace_mutex_);
  for (auto& record : trace_) {
    (void)record.gpu_begin.release();
    (void)record.gpu_end.release();
  }
  (void)trace_epoch_event_.release();
}

std::vector<TraceRecord> Lane::take_trace() {
  std::lock_guard<std::mutex> lock(trace_mutex_);
  std::vector<TraceRecord> out;
  out.swap(trace_);
  return out;
}

void Lane::enter(bool hurried) {
  if (!entered_) {
    if (hurried) {
      interpreter_->enter();
    } else {
      interpreter_->enter_unhurried();
    }
    entered_ = true;
    in_interpreter_.store(true, std::memory_order_release);
  }
}

void Lane::leave() {
  if (entered_) {
    entered_ = false;
    in_interpreter_.store(false, std::memory_order_release);
    interpreter_->leave();
  }
}

void Lane::worker_main() {
#ifdef __linux__
  // Named for profilers, top -H and /proc/self/task/*/comm (15 characters at most).
  pthread_setname_np(pthread_self(),
                     ("pydflash-lane" + std::to_string(index_)).substr(0, 15).c_str());
#endif
  if (is_gpu()) device::set_device(device_);
  interpreter_->thread_started(*this);
  quiet_member_.worker.store(std::this_thread::get_id());
  worker_lane = this;
  QuietDevice::bind_thread(&quiet_, &quiet_member_);  // its future waits pause for quiets
  // Leaves the device however the loop ends, also when this thread is ended at exit.
  struct LeaveQuiet {
    Lane& lane;
    ~LeaveQuiet() {
      worker_lane = nullptr;
      QuietDevice::bind_thread(nullptr, nullptr);
      lane.quiet_.leave(lane.quiet_member_);
    }
  } leave_quiet{*this};
  Task task;
  int64_t spin_ns = options_.spin_ns;
  for (;;) {
    if (!queue_.try_pop(task)) {
      // Idle: give the interpreter back before polling and sleeping.
      leave();
      const int64_t idle_since = now_ns();
      bool slept = false;
      // Note [Adaptive polling]: a lane whose GPU is still busy with its work sleeps at once.
      const bool backlog = stream_busy();
      if (!queue_.pop_wait(
              task, backlog ? 0 : spin_ns, [&] { return on_device_.load() == 0; }, &slept))
        break;
      if (!backlog) {
        spin_ns = next_spin_ns(spin_ns, options_.spin_ns, slept, now_ns() - idle_since);
        spin_ns_.store(spin_ns, std::memory_order_relaxed);
      }
    }
    // Note [Quiet device for capture]: the one check on the hot path.
    if (quiet_.requested()) pause_for_quiet();
    try {
      run_one(task);
    } catch (...) {
      // Note [Threads ended at exit]: a finalizing Python interpreter ends any thread
      // that tries to take the GIL (PyThread_exit_thread), unwinding these frames. The
      // task's body holds interpreter objects that cannot be released without the GIL,
      // during finalization: leak it rather than destroy it.
      (void)task.body.release();
      throw;
    }
    task.future.reset();
  }
  QuietDevice::bind_thread(nullptr, nullptr);
  quiet_.leave(quiet_member_);  // before exited_: a joiner finds the lane off its device
  leave();
  interpreter_->thread_exiting();
  {
    std::lock_guard<std::mutex> lock(exit_mutex_);
    exited_ = true;
  }
  exit_cv_.notify_all();
}

// Note [Taken is running]: a task has started once its worker takes it from the queue,
// before the worker has the GIL, as a ThreadPoolExecutor thread's task has once the
// thread took it: cancel() returns False for it from then on. A cancelling shutdown
// also leaves an idle lane's first task to its worker, which a submit has already
// woken for it: a ThreadPoolExecutor's idle threads likewise take the first tasks of
// a burst as they come, so shutdown(cancel_futures=True) right after submitting still
// runs one task per idle worker. Tasks queued behind a busy worker are cancelled.
void Lane::run_one(Task& task) {
  // Left in `task`, so the worker can leak the body if this thread is ended midway.
  std::shared_ptr<FutureState>& future = task.future;
  std::unique_ptr<TaskBody>& body = task.body;
  auto destroy = [&] {
    if (body->needs_interpreter_to_destroy()) enter();
    body.reset();
  };
  // Note [Taken is running]: the task starts when the worker takes it, before the GIL.
  if (future && !future->try_start()) {
    // Cancelled while queued; whoever cancelled it published and notified.
    cancelled_.fetch_add(1, std::memory_order_release);
    destroy();
    return;
  }
  if (body->needs_interpreter()) {
    enter(/*hurried=*/future != nullptr);
  } else {
    leave();
  }
  if (!future) {  // internal work: a completion of device work
    body->run(*this, nullptr);
    destroy();
    return;
  }
  const bool trace = tracing();
  TraceRecord record;
  if (trace && is_gpu()) {
    record.gpu_begin = device::OwnedEvent(device::create_event(device_, /*timing=*/true));
    device::record_event(record.gpu_begin.get(), stream_);
  }
  running_task_.store(true, std::memory_order_relaxed);
  future->start_ns = now_ns();
  add_single_writer(queue_wait_ns_, future->start_ns - future->submit_ns);
  const bool complete = body->run(*this, future.get());
  const int64_t end = now_ns();
  add_single_writer(busy_ns_, end - future->start_ns);
  running_task_.store(false, std::memory_order_relaxed);
  if (trace) {
    if (is_gpu()) {
      record.gpu_end = device::OwnedEvent(device::create_event(device_, /*timing=*/true));
      device::record_event(record.gpu_end.get(), stream_);
    }
    record.id = future->id();
    record.label = body->label();
    record.submit_ns = future->submit_ns;
    record.start_ns = future->start_ns;
    record.end_ns = end;
    std::lock_guard<std::mutex> lock(trace_mutex_);
    trace_.push_back(std::move(record));
  }
  if (!complete) {
    destroy();  // device work: the body handed what it must keep to its completion
    return;
  }
  add_single_writer<uint64_t>(completed_, 1);
  const bool observed = future->finish();
  // Note [Finish, then publish]. The body may hold the future's only owner: it goes last.
  future->publish();
  if (observed) {
    enter();
    body->notify(*future);
  }
  destroy();
  if (queue_.size() == 0) leave();
}

}  // namespace pydflash
