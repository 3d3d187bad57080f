#include "core/stream_program.h"

#include <initializer_list>

#include "core/error.h"

namespace pydflash {
namespace {

// Field indices in kStreamOpFields order; bit i of a mask: field i is read.
enum Field : unsigned { kDst = 1, kSrc, kDpitch, kSpitch, kWidth, kHeight, kValue };
constexpr unsigned bits(std::initializer_list<Field> fields) {
  unsigned mask = 0;
  for (Field f : fields) mask |= 1u << f;
  return mask;
}

// The fields each kind reads, in Kind order (as StreamOp's comments say).
constexpr unsigned kReads[] = {
    bits({kDst, kDpitch, kSrc, kSpitch, kWidth, kHeight}),  // Copy
    bits({kDst, kDpitch, kValue, kWidth, kHeight}),         // Fill
    bits({kDst, kWidth, kValue}),                           // FillI64
    bits({kSrc}),                                           // Graph
    0,                                                      // WaitInput
    bits({kDst}),                                           // Record
};
static_assert(sizeof(kReads) / sizeof(kReads[0]) == kStreamOpKindCount);

// A field the op's kind does not read must be left at 0: a value there was meant for
// another kind, or put in the wrong field.
void check_unread_fields(const StreamOp& op) {
  const auto kind = static_cast<size_t>(op.kind);
  if (kind >= kStreamOpKindCount) return;  // check_op refuses it
  const uint64_t values[] = {0,         op.dst,   op.src,    op.dpitch,
                             op.spitch, op.width, op.height, static_cast<uint64_t>(op.value)};
  static_assert(sizeof(values) / sizeof(values[0]) == kStreamOpFieldCount);
  for (size_t i = 1; i < kStreamOpFieldCount; ++i) {
    PYDFLASH_CHECK_VALUE(values[i] == 0 || (kReads[kind] >> i & 1u), "expected a ",
                         kStreamOpKinds[kind], " op to leave ", kStreamOpFields[i], " at 0, got ",
                         static_cast<int64_t>(values[i]));
  }
}

}  // namespace

void check_op(const StreamOp& op) {
  using Kind = StreamOp::Kind;
  check_unread_fields(op);
  switch (op.kind) {
    case Kind::Copy:
      PYDFLASH_CHECK_VALUE(op.src != 0, "expected a source address for a copy, got 0");
      PYDFLASH_CHECK_VALUE(op.spitch >= op.width, "expected a copy's source pitch ", op.spitch,
                           " to be at least its row of ", op.width, " bytes");
      [[fallthrough]];
    case Kind::Fill:
      PYDFLASH_CHECK_VALUE(op.dst != 0, "expected a destination address, got 0");
      PYDFLASH_CHECK_VALUE(op.dpitch >= op.width, "expected a pitch of ", op.dpitch,
                           " to be at least its row of ", op.width, " bytes");
      PYDFLASH_CHECK_VALUE(op.kind != Kind::Fill || (op.value >= 0 && op.value <= 255),
                           "expected a fill byte in [0, 255], got ", op.value);
      return;
    case Kind::FillI64:
      PYDFLASH_CHECK_VALUE(op.dst != 0 && op.dst % alignof(int64_t) == 0,
                           "expected an aligned int64 address, got ", op.dst);
      return;
    case Kind::Graph:
      PYDFLASH_CHECK_VALUE(op.src != 0, "expected a captured graph, got a null handle");
      return;
    case Kind::Record:
      PYDFLASH_CHECK_VALUE(op.dst != 0, "expected an event to record, got a null handle");
      return;
    case Kind::WaitInput:
      return;
  }
  throw ValueError("expected a stream op kind from 0 to 5, got " +
                   std::to_string(static_cast<int>(op.kind)));
}

void issue(const std::vector<StreamOp>& ops, device::Stream stream, device::Event input_event,
           size_t* issued) {
  using Kind = StreamOp::Kind;
  *issued = 0;
  for (const StreamOp& op : ops) {
    auto* dst = reinterpret_cast<void*>(op.dst);
    switch (op.kind) {
      case Kind::Copy:
        if (op.width > 0 && op.height > 0) {
          device::copy_2d(dst, op.dpitch, reinterpret_cast<const void*>(op.src), op.spitch,
                          op.width, op.height, stream);
        }
        break;
      case Kind::Fill:
        if (op.width > 0 && op.height > 0) {
          device::fill_2d(dst, op.dpitch, static_cast<int>(op.value), op.width, op.height, stream);
        }
        break;
      case Kind::FillI64:
        if (op.width > 0) device::fill_i64(dst, op.width, op.value, stream);
        break;
      case Kind::Graph:
        device::launch_graph(op.src, stream);
        break;
      case Kind::WaitInput:
        if (input_event != nullptr) device::stream_wait_event(stream, input_event);
        break;
      case Kind::Record:
        device::record_event(dst, stream);
        break;
    }
    ++*issued;
  }
}

}  // namespace pydflash
