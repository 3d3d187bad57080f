// What the fake-device tests need to run a lane: no interpreter, and a task that does
// nothing.
#pragma once

#include "core/lane.h"

namespace pydflash::fake_device {

class NoInterpreter final : public Interpreter {
 public:
  void enter() override {}
  void leave() override {}
};

class Nothing final : public TaskBody {
 public:
  bool needs_interpreter() const override { return false; }
  bool run(Lane&, FutureState*) override { return true; }
};

}  // namespace pydflash::fake_device
