#include <cstdint>

#include "core/device_api.h"
#include "cuda/cuda_check.h"

namespace pydflash::device {
namespace {

__global__ void fill_i64_kernel(int64_t* dst, size_t count, int64_t value) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = value;
  }
}

}  // namespace

void fill_i64(void* dst, size_t count, int64_t value, Stream stream) {
  constexpr unsigned kThreads = 256;
  const size_t blocks = (count + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 1024 ? blocks : 1024);
  fill_i64_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int64_t*>(dst), count, value);
  PYDFLASH_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pydflash::device
