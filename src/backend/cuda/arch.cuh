// The architecture the device code is written for: E4KV_DEVICE_ARCH equals __CUDA_ARCH__ in the
// device pass, 0 in the host pass. In a build with E4KV_VOLTA_PATH (CMake option of that name) it
// is 700 on every target, so that an sm_75 or sm_90 build compiles exactly the code a V100 runs
// (no instruction newer than sm_70) and the H200 can test it; the host then dispatches as on a
// V100 too (compute_capability in device.h reports at most 70).
//
// Every instruction-set test in the CUDA backend goes through this macro; only resource limits of
// the real target (threads per SM) read __CUDA_ARCH__.
#pragma once

#if defined(__CUDA_ARCH__)
#if defined(E4KV_VOLTA_PATH)
#define E4KV_DEVICE_ARCH 700
#else
#define E4KV_DEVICE_ARCH __CUDA_ARCH__
#endif
#else
#define E4KV_DEVICE_ARCH 0
#endif
