// Torch's thread-local state read and set from C++: grad mode, inference mode and
// autocast through libc10's own functions, and the lane's CUDA stream kept current for
// torch (Note [Lane stream selection]). pydflash does not compile against torch: the
// functions are found with dlsym in the libraries torch has loaded.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "core/lane.h"

namespace pydflash::python {

/// The caller's thread-local torch state at submit, applied on the worker.
struct TorchSnapshot {
  bool captured = false;  // torch was imported at submit
  bool grad = true;
  // Inference mode or autocast on: rare, so carried as a Python tuple and applied by
  // pydflash.lanes._torch_state.call_in_state.
  pybind11::object special;

  /// Entered.
  static TorchSnapshot capture();
  /// Sets the worker's grad mode to the caller's. Entered.
  void apply_grad_mode() const;
};

/// Makes a lane's device and stream torch's current ones before each task, on the
/// lane's worker thread (Note [Lane stream selection]). Touched only by that thread.
class LaneStreamSelection {
 public:
  LaneStreamSelection() = default;
  LaneStreamSelection(const LaneStreamSelection&) = delete;
  LaneStreamSelection& operator=(const LaneStreamSelection&) = delete;

  /// Before each task. Entered; throws pybind11::error_already_set.
  void select(const Lane& lane);
  /// Drops the Python references. Entered, on the worker before it exits.
  void clear();

  struct CudaStreamAbi;  // c10::cuda::CUDAStream's layout, in torch_abi.cpp

 private:
  bool torch_ready_ = false;
  PyObject* set_stream_ = nullptr;  // owned: torch._C._cuda_setStream
  PyObject* set_stream_args_ = nullptr;
  // Torch's current-stream getter once a reading has matched (trust_stream_reading),
  // and the lane stream's torch id.
  CudaStreamAbi (*current_cuda_stream_)(int8_t) = nullptr;
  int64_t lane_stream_id_ = 0;

  void trust_stream_reading(const Lane& lane);
  bool lane_stream_is_current(const Lane& lane) const;
};

/// How the caller's torch state is read and set: "native" (Note [Torch state without
/// Python calls]), "python", or null before torch is imported. Entered.
const char* torch_state_reader();

}  // namespace pydflash::python
