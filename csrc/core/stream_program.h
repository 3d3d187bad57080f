// A stream program: a short list of copies, fills, graph launches and waits that a lane
// worker issues on its stream without the GIL. pydflash/pipeline/native_microbatch.py builds one
// per stage of a microbatch (Note [Native microbatch] there); csrc/python/tasks.cpp runs it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device_api.h"

namespace pydflash {

/// One op. Python builds it as pydflash._C.StreamOp, a named tuple of these fields in
/// this order (kStreamOpFields), and names the kinds with _C.StreamOpKind (kStreamOpKinds):
/// both are made from the tables below, the one list of either.
struct StreamOp {
  enum class Kind : int {
    Copy = 0,       // height rows of width bytes from src (spitch apart) to dst (dpitch apart)
    Fill = 1,       // height rows of width bytes at dst (dpitch apart) set to the byte `value`
    FillI64 = 2,    // width int64s at dst set to `value`
    Graph = 3,      // launches the cudaGraphExec_t in `src`
    WaitInput = 4,  // the stream waits for the program's input task's GPU work
    Record = 5,     // records the cudaEvent_t in `dst`
  };
  Kind kind = Kind::Copy;
  uintptr_t dst = 0;
  uintptr_t src = 0;
  size_t dpitch = 0;
  size_t spitch = 0;
  size_t width = 0;
  size_t height = 0;
  int64_t value = 0;
};

/// The kinds' names, in Kind order.
inline constexpr const char* kStreamOpKinds[] = {"COPY",  "FILL",       "FILL_I64",
                                                 "GRAPH", "WAIT_INPUT", "RECORD"};
/// StreamOp's fields, in the order the named tuple holds them.
inline constexpr const char* kStreamOpFields[] = {"kind",   "dst",   "src",    "dpitch",
                                                  "spitch", "width", "height", "value"};
inline constexpr size_t kStreamOpKindCount = sizeof(kStreamOpKinds) / sizeof(kStreamOpKinds[0]);
inline constexpr size_t kStreamOpFieldCount = sizeof(kStreamOpFields) / sizeof(kStreamOpFields[0]);

/// Throws ValueError for an op no device call would accept (a null pointer, a pitch
/// narrower than its rows, even for one row, as cudaMemcpy2D has it; a fill value that is
/// not a byte), or one that sets a field its kind does not read.
void check_op(const StreamOp& op);

/// Issues `ops` in order on `stream`. WaitInput waits on `input_event` (nothing when it
/// is null: the input left no GPU work). Throws CudaError from the first failing call;
/// `issued` then counts the ops that reached the stream before it.
void issue(const std::vector<StreamOp>& ops, device::Stream stream, device::Event input_event,
           size_t* issued);

}  // namespace pydflash
