// CUDA error checks: every runtime call goes through E4KV_CUDA_CHECK, every launch is followed by
// E4KV_CUDA_CHECK_LAUNCH. A failure is an internal error with the file, line and CUDA's message.
#pragma once

#include <cuda_runtime_api.h>

#include "core/check.h"

#define E4KV_CUDA_CHECK(expr)                                                               \
  do {                                                                                      \
    cudaError_t e4kv_cuda_status_ = (expr);                                                 \
    if (e4kv_cuda_status_ != cudaSuccess) {                                                 \
      ::e4kv::detail::assert_fail(#expr, __FILE__, __LINE__,                                \
                                  std::string(cudaGetErrorName(e4kv_cuda_status_)) + ": " + \
                                      cudaGetErrorString(e4kv_cuda_status_));               \
    }                                                                                       \
  } while (0)

#define E4KV_CUDA_CHECK_LAUNCH() E4KV_CUDA_CHECK(cudaGetLastError())
