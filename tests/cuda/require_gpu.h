// Skips the current test when the machine has no CUDA device (CUDA tests run everywhere a CUDA
// build is made, and pass as skipped without a GPU).
#pragma once

#include <gtest/gtest.h>

#include "backend/cuda/device.h"

#define E4KV_REQUIRE_GPU()                                                   \
  do {                                                                       \
    if (::e4kv::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
