#include <cstdint>

#include "core/device_api.h"
#include "cuda/cuda_check.h"

namespace pydflash::device {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread per block spins on the global timer: the block holds one SM slot for
// `ns` nanoseconds and does nothing else, so N lanes running it can overlap fully.
__global__ void busy_wait_kernel(uint64_t ns) {
  if (threadIdx.x != 0) return;
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < ns) {
  }
}

}  // namespace

void busy_wait(Stream stream, uint64_t ns, int blocks) {
  PYDFLASH_CHECK_VALUE(blocks > 0, "expected at least one block, got ", blocks);
  busy_wait_kernel<<<blocks, 32, 0, static_cast<cudaStream_t>(stream)>>>(ns);
  PYDFLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pydflash::device
