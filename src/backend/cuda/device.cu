#include "backend/cuda/device.h"

#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

int compute_capability(int device) {
  int major = 0;
  int minor = 0;
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  E4KV_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major * 10 + minor;
}

bool e4m3_native_available(int device) {
#if defined(E4KV_FORCE_SOFTWARE_E4M3)
  (void)device;
  return false;
#else
  const char* force = std::getenv("E4KV_FORCE_SOFTWARE_E4M3");
  if (force != nullptr && std::strcmp(force, "0") != 0 && force[0] != '\0') return false;
  return compute_capability(device) >= 89;
#endif
}

}  // namespace e4kv::cuda
