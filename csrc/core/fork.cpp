#include "core/fork.h"

#include <pthread.h>

#include <atomic>

namespace pydflash {
namespace {

std::atomic<int> generation{0};

}  // namespace

int fork_generation() {
  static const bool registered = [] {
    pthread_atfork(nullptr, nullptr, [] { generation.fetch_add(1); });
    return true;
  }();
  (void)registered;
  return generation.load(std::memory_order_relaxed);
}

}  // namespace pydflash
