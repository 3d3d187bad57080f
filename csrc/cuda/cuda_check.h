#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

/// Checks a CUDA runtime call; throws pydflash::CudaError with the call, file and line.
#define PYDFLASH_CUDA_CHECK(expr)                                                               \
  do {                                                                                          \
    cudaError_t pydflash_err_ = (expr);                                                         \
    if (pydflash_err_ != cudaSuccess) {                                                         \
      (void)cudaGetLastError(); /* clear sticky-free errors so the next call is clean */        \
      throw ::pydflash::CudaError(::pydflash::detail::str(                                      \
          "CUDA error: ", cudaGetErrorString(pydflash_err_), " (",                              \
          cudaGetErrorName(pydflash_err_), ") from ", #expr, " at ", __FILE__, ":", __LINE__)); \
    }                                                                                           \
  } while (0)
