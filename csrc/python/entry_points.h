// Note [Python entry points]: every name in pydflash's Python that the C++ looks up by
// attribute, in one list. A rename on the Python side must change it here; _C exports the
// list as PYTHON_ENTRY_POINTS and tests/test_entry_points.py resolves each entry, so a
// rename that misses this file fails there instead of at the first call.
#pragma once

#include <cstddef>

namespace pydflash::python {

/// One name the C++ uses: `name` in module `module`; "Class.method" for a method the C++
/// calls on instances of that class.
struct EntryPoint {
  const char* module;
  const char* name;

  /// The attribute looked up: the part of `name` after its last dot.
  constexpr const char* attr() const {
    const char* last = name;
    for (const char* p = name; *p != '\0'; ++p)
      if (*p == '.') last = p + 1;
    return last;
  }
};

namespace entry {

// The core's typed errors, raised as these (bind_errors.cpp).
inline constexpr EntryPoint kInputFailedError{"pydflash.errors", "InputFailedError"};
inline constexpr EntryPoint kCompileQueueTimeout{"pydflash.errors", "CompileQueueTimeout"};
inline constexpr EntryPoint kCudaError{"pydflash.errors", "CudaError"};
inline constexpr EntryPoint kInternalError{"pydflash.errors", "InternalError"};
// The caller's torch state, captured at submit and entered on the worker (torch_abi.cpp,
// tasks.cpp).
inline constexpr EntryPoint kCaptureTorchState{"pydflash.lanes._torch_state", "capture"};
inline constexpr EntryPoint kCallInTorchState{"pydflash.lanes._torch_state", "call_in_state"};
// A worker's first torch task sets its thread up (torch_abi.cpp).
inline constexpr EntryPoint kInitThread{"pydflash.lanes._lane_runtime", "init_thread"};
// pydflash.Future, the Python subclass of _C.FutureBase (future_object.cpp).
inline constexpr EntryPoint kFutureInvoke{"pydflash.lanes._future", "Future._invoke"};
inline constexpr EntryPoint kFutureInvokeOnLane{"pydflash.lanes._future", "Future._invoke_on_lane"};
inline constexpr EntryPoint kFutureRaiseFailure{"pydflash.lanes._future", "Future._raise_failure"};
// The lane a future names in its errors (future_object.cpp).
inline constexpr EntryPoint kLaneLabel{"pydflash.lanes.lane", "Lane.label"};
// A Lane's native half, read from the Lane objects a dispatcher's submit gets (bind_lane.cpp).
inline constexpr EntryPoint kLaneCore{"pydflash.lanes.lane", "Lane._core"};

inline constexpr EntryPoint kAll[] = {
    kInputFailedError,   kCompileQueueTimeout, kCudaError,  kInternalError,
    kCaptureTorchState,  kCallInTorchState,    kInitThread, kFutureInvoke,
    kFutureInvokeOnLane, kFutureRaiseFailure,  kLaneLabel,  kLaneCore,
};

}  // namespace entry
}  // namespace pydflash::python
