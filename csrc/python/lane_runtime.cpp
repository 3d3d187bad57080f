#include "python/lane_runtime.h"

#include "core/clock.h"
#include "core/spin.h"
#include "python/gil.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

// The poll's bounds (Note [Entering when the GIL is free], lane_runtime.h).
constexpr int64_t kEnterPollNs = 300'000;
constexpr int64_t kQuietNs = 10'000;
// References buried before an internal task releases them (Note [Deferred decrefs]).
constexpr size_t kBuriedMax = 64;

}  // namespace

// Releases what tasks buried, for a lane that has not left the interpreter for a while.
class GraveyardDrain final : public TaskBody {
 public:
  explicit GraveyardDrain(LaneRuntime& rt) : rt_(rt) {}
  bool needs_interpreter() const override { return true; }
  bool run(Lane&, FutureState*) override {
    rt_.drain_graveyard();
    return true;
  }

 private:
  LaneRuntime& rt_;
};

void LaneRuntime::bury(std::initializer_list<PyObject*> refs) {
  for (PyObject* ref : refs) {
    if (ref != nullptr) graveyard_.push_back(ref);
  }
  if (graveyard_.size() >= kBuriedMax && !drain_posted_) {
    drain_posted_ = true;
    lane_->post_internal(std::make_unique<GraveyardDrain>(*this));
  }
}

void LaneRuntime::drain_graveyard() {
  // Swapped out first: the decrefs may run finalizers, which must not see it half-walked.
  std::vector<PyObject*> refs;
  refs.swap(graveyard_);
  drain_posted_ = false;
  for (PyObject* ref : refs) Py_DECREF(ref);
}

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
  // Note [Polling only on a free core] (core/spin.h): poll_while_cores_free stops at once
  // when none is free, and the worker blocks on the GIL, to be woken when it is let go.
  poll_while_cores_free(start + kEnterPollNs, [&] {
    if (WaitingWithoutGil::any()) return true;
    const int64_t now = now_ns();
    if (activity() != seen) {
      seen = activity();
      last_active = now;
    }
    return now - last_active >= kQuietNs;
  });
  restore_gil(tstate_);  // Note [Never retaking the GIL at exit]
  WaitingWithoutGil::worker_entering(-1);
}

// No poll for internal work (a graph's completion, a program's release): their futures
// are published without the GIL already, so only a graph future's done callbacks wait
// for it. Polling here cost a worker up to kEnterPollNs per completion while the
// driving thread kept submitting.
void LaneRuntime::enter_unhurried() { restore_gil(tstate_); }

void LaneRuntime::leave() {
  if (!graveyard_.empty()) drain_graveyard();
  PyEval_SaveThread();
}

void LaneRuntime::thread_exiting() {
  restore_gil(tstate_);
  drain_graveyard();
  Py_CLEAR(future_type_);
  streams_.clear();
  PyThreadState_Clear(tstate_);
  PyThreadState_DeleteCurrent();
  tstate_ = nullptr;
}

}  // namespace pydflash::python
