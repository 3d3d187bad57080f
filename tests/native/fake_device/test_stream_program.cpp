// Stream programs (core/stream_program.h) against the fake device, whose copies and
// fills act on host memory at once: what each op writes, and which ops are refused.
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/stream_program.h"
#include "harness.h"

using namespace pydflash;
using Kind = StreamOp::Kind;

namespace {

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

StreamOp copy(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
              size_t height) {
  StreamOp op;
  op.kind = Kind::Copy;
  op.dst = address(dst), op.dpitch = dpitch, op.src = address(src), op.spitch = spitch;
  op.width = width, op.height = height;
  return op;
}

StreamOp fill(void* dst, size_t pitch, int64_t value, size_t width, size_t height) {
  StreamOp op;
  op.kind = Kind::Fill;
  op.dst = address(dst), op.dpitch = pitch, op.value = value, op.width = width;
  op.height = height;
  return op;
}

bool refused(const StreamOp& op) {
  try {
    check_op(op);
  } catch (const ValueError&) {
    return true;
  }
  return false;
}

}  // namespace

TEST_CASE("stream program: a padded 2-D copy writes the real corner and fills the rest") {
  // A [2, 3] batch of bytes into a [3, 5] static buffer: rows 3 apart into rows 5 apart,
  // the two columns right of each real row and the third row filled with zeros.
  const std::vector<uint8_t> src = {1, 2, 3, 4, 5, 6};
  std::vector<uint8_t> dst(15, 0xAB);
  std::vector<StreamOp> ops = {copy(dst.data(), 5, src.data(), 3, 3, 2),
                               fill(dst.data() + 3, 5, 0, 2, 2), fill(dst.data() + 10, 5, 0, 5, 1)};
  for (const StreamOp& op : ops) check_op(op);
  size_t issued = 0;
  issue(ops, nullptr, nullptr, &issued);
  CHECK(issued == 3);
  const std::vector<uint8_t> want = {1, 2, 3, 0, 0, 4, 5, 6, 0, 0, 0, 0, 0, 0, 0};
  CHECK(dst == want);
}

TEST_CASE("stream program: an int64 fill writes lengths; empty ops write nothing") {
  std::vector<int64_t> lengths(4, -1);
  StreamOp real;
  real.kind = Kind::FillI64;
  real.dst = address(lengths.data()), real.width = 3, real.value = 1000;
  StreamOp pad = real;
  pad.dst = address(lengths.data() + 3), pad.width = 1, pad.value = 0;
  StreamOp none = copy(lengths.data(), 8, lengths.data() + 1, 8, 0, 1);  // zero width
  size_t issued = 0;
  issue({real, pad, none}, nullptr, nullptr, &issued);
  CHECK(issued == 3);
  CHECK(lengths == (std::vector<int64_t>{1000, 1000, 1000, 0}));
}

TEST_CASE("stream program: ops no device call would take are refused") {
  char buffer[16];
  CHECK(refused(copy(buffer, 8, nullptr, 8, 8, 1)));      // no source
  CHECK(refused(copy(nullptr, 8, buffer, 8, 8, 1)));      // no destination
  CHECK(refused(copy(buffer, 8, buffer, 4, 8, 2)));       // source rows overlap
  CHECK(refused(copy(buffer, 4, buffer, 8, 8, 2)));       // destination rows overlap
  CHECK(!refused(copy(buffer, 8, buffer + 8, 8, 8, 1)));  // pitches as wide as a row
  CHECK(refused(fill(buffer, 8, 256, 8, 1)));             // not a byte
  CHECK(refused(fill(buffer, 8, -1, 8, 1)));
  StreamOp odd;
  odd.kind = Kind::FillI64;
  odd.dst = address(buffer) | 1;  // misaligned
  CHECK(refused(odd));
  StreamOp graph;
  graph.kind = Kind::Graph;
  CHECK(refused(graph));
  StreamOp record;
  record.kind = Kind::Record;
  CHECK(refused(record));
  StreamOp unknown;
  unknown.kind = static_cast<Kind>(9);
  CHECK(refused(unknown));
}

TEST_CASE("stream program: a field the op's kind does not read must stay 0") {
  char buffer[16];
  StreamOp graph;
  graph.kind = Kind::Graph;
  graph.src = address(buffer);
  CHECK(!refused(graph));
  graph.dst = address(buffer);  // meant for a Record, say
  CHECK(refused(graph));
  StreamOp padded = fill(buffer, 8, 0, 8, 1);
  CHECK(!refused(padded));
  padded.src = address(buffer);  // a fill reads no source
  CHECK(refused(padded));
  StreamOp wait;
  wait.kind = Kind::WaitInput;
  CHECK(!refused(wait));
  wait.height = 1;
  CHECK(refused(wait));
}
