// Device capabilities the launchers need. Host-only header: no CUDA include.
#pragma once

namespace e4kv::cuda {

// Number of CUDA devices; 0 when there is no device or no driver.
int device_count();

// Compute capability as major * 10 + minor.
int compute_capability(int device);

// True when `device` has the native E4M3 conversion (sm_89+), the build did not set
// E4KV_FORCE_SOFTWARE_E4M3, and the environment variable E4KV_FORCE_SOFTWARE_E4M3 is unset or "0".
bool e4m3_native_available(int device);

}  // namespace e4kv::cuda
