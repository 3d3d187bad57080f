// The task bodies a lane runs for Python: a Python call, with the caller's torch state,
// and a captured CUDA graph launched without the GIL. Each stores its outcome on the
// task's Python future (python/future_object.h).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/lane.h"
#include "core/stream_program.h"
#include "python/lane_runtime.h"

namespace pydflash::python {

/// Creates the Python future for task `id` of `lane` (a pydflash.Lane, or a weak
/// reference to one: the future keeps only that).
pybind11::object make_python_future(LaneRuntime& rt, uint64_t id, pybind11::handle lane);

// Task bodies refer to their lane's runtime without owning it: the lane owns it and
// outlives every task it queues, and an atomic reference count per task is a cache
// line shared by the submitting thread and the worker.

/// fn(*args, **kwargs) (kwargs may be None), under the torch state read now. Entered.
/// `hold` (or None) lives until the task has run: Note [Lanes open while held] in
/// pydflash/lanes/lane.py.
std::unique_ptr<TaskBody> make_python_task(LaneRuntime& rt, pybind11::object fn,
                                           pybind11::tuple args, pybind11::object kwargs,
                                           pybind11::object future, pybind11::object hold,
                                           bool tracing);

/// Launches `graph_exec` (a cudaGraphExec_t); `keepalive` lives until the GPU is done.
std::unique_ptr<TaskBody> make_graph_task(LaneRuntime& rt, uintptr_t graph_exec,
                                          pybind11::object keepalive, pybind11::object future);

/// Issues `ops` on the lane's stream after `input` (a future, or None) finished well;
/// `keepalive` lives until the GPU has passed them. Note [Program tasks] in tasks.cpp.
std::unique_ptr<TaskBody> make_program_task(LaneRuntime& rt, std::vector<StreamOp> ops,
                                            pybind11::object keepalive, pybind11::object input,
                                            pybind11::object future);

}  // namespace pydflash::python
