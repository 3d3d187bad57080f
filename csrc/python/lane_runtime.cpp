#include "python/lane_runtime.h"

#include <thread>

#include "core/clock.h"
#include "python/gil.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

// The poll's bounds (Note [Entering when the GIL is free], lane_runtime.h).
constexpr int64_t kEnterPollNs = 300'000;
constexpr int64_t kQuietNs = 10'000;

}  // namespace

LaneRuntime::LaneRuntime(std::string label_, py::object future_type)
    : label(std::move(label_)),
      interp_(PyInterpreterState_Get()),
      future_type_(future_type.release().ptr()) {}

LaneRuntime::~LaneRuntime() {
  // Python references were dropped entered in thread_exiting(); a lane whose worker
  // never ran leaks them rather than touching Python without the GIL.
}

void LaneRuntime::thread_started(Lane& lane) {
  lane_ = &lane;
  tstate_ = PyThreadState_New(interp_);
}

void LaneRuntime::enter() {
  // Note [Entering when the GIL is free].
  WaitingWithoutGil::worker_entering(1);
  auto activity = [&] { return lane_->submitted() + WaitingWithoutGil::preparations(); };
  const int64_t start = now_ns();
  int64_t last_active = start;
  uint64_t seen = activity();
  while (!WaitingWithoutGil::any()) {
    const int64_t now = now_ns();
    if (activity() != seen) {
      seen = activity();
      last_active = now;
    }
    if (now - start >= kEnterPollNs || now - last_active >= kQuietNs) break;
    std::this_thread::yield();
  }
  restore_gil(tstate_);  // Note [Never retaking the GIL at exit]
  WaitingWithoutGil::worker_entering(-1);
}

// No poll for internal work (a graph's completion, a program's release): their futures
// are published without the GIL already, so only a graph future's done callbacks wait
// for it. Polling here cost a worker up to kEnterPollNs per completion while the
// driving thread kept submitting.
void LaneRuntime::enter_unhurried() { restore_gil(tstate_); }

void LaneRuntime::leave() { PyEval_SaveThread(); }

void LaneRuntime::thread_exiting() {
  restore_gil(tstate_);
  Py_CLEAR(future_type_);
  streams_.clear();
  PyThreadState_Clear(tstate_);
  PyThreadState_DeleteCurrent();
  tstate_ = nullptr;
}

}  // namespace pydflash::python
