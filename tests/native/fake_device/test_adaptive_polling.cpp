// Note [Adaptive polling]: a GPU lane whose stream still has work queued sleeps when it
// goes idle instead of polling its queue, and a task waiting on a future there sleeps
// at once too.
#include <time.h>

#include <chrono>
#include <memory>
#include <thread>

#include "core/lane.h"
#include "core/spin.h"
#include "fake_device.h"
#include "harness.h"
#include "lane_parts.h"

using namespace pydflash;
using fake_device::NoInterpreter;
using fake_device::Nothing;

namespace {

class AskBusy final : public TaskBody {
 public:
  explicit AskBusy(bool& out) : out_(out) {}
  bool needs_interpreter() const override { return false; }
  bool run(Lane&, FutureState*) override {
    out_ = Lane::calling_worker_stream_busy();
    return true;
  }

 private:
  bool& out_;
};

double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// CPU seconds the process spends while a GPU lane with a 1 s poll window sits idle for
// 200 ms after a task, the fake stream busy or not.
double idle_cpu_s(bool busy) {
  fake_device::set_streams_busy(busy);
  LaneOptions options;
  options.spin_ns = 1'000'000'000;
  auto lane = std::make_shared<Lane>(0, 0, std::make_shared<NoInterpreter>(), options);
  lane->start();
  auto future = lane->new_future();
  lane->submit(future, std::make_unique<Nothing>());
  CHECK(future->wait(-1, 0, 1'000'000, nullptr));
  const double before = process_cpu_s();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double spent = process_cpu_s() - before;
  lane->shutdown(false);
  CHECK(lane->join(-1));
  fake_device::set_streams_busy(false);
  return spent;
}

}  // namespace

TEST_CASE("adaptive polling: an idle GPU lane polls while its stream is empty") {
  // The control: the window is spent polling, unless another thread took the lane's core
  // meanwhile (Note [Polling only on a free core]: then it sleeps, as it should).
  const uint64_t late = late_yields();
  CHECK(idle_cpu_s(false) > 0.1 || late_yields() != late);
}

TEST_CASE("adaptive polling: an idle GPU lane with work on its stream sleeps at once") {
  CHECK(idle_cpu_s(true) < 0.05);
}

TEST_CASE("adaptive polling: a task asks its own lane's stream; other threads get false") {
  fake_device::set_streams_busy(true);
  CHECK(!Lane::calling_worker_stream_busy());  // not a worker
  auto gpu = std::make_shared<Lane>(0, 0, std::make_shared<NoInterpreter>(), LaneOptions{});
  auto cpu = std::make_shared<Lane>(1, -1, std::make_shared<NoInterpreter>(), LaneOptions{});
  gpu->start();
  cpu->start();
  bool on_gpu = false, on_cpu = true;
  auto f1 = gpu->new_future();
  gpu->submit(f1, std::make_unique<AskBusy>(on_gpu));
  auto f2 = cpu->new_future();
  cpu->submit(f2, std::make_unique<AskBusy>(on_cpu));
  CHECK(f1->wait(-1, 0, 1'000'000, nullptr));
  CHECK(f2->wait(-1, 0, 1'000'000, nullptr));
  CHECK(on_gpu);
  CHECK(!on_cpu);
  fake_device::set_streams_busy(false);
  for (auto& lane : {gpu, cpu}) {
    lane->shutdown(false);
    CHECK(lane->join(-1));
  }
}
