// Device capabilities the launchers need. Host-only header: no CUDA include.
#pragma once

namespace e4kv::cuda {

// Number of CUDA devices; 0 when there is no device or no driver.
int device_count();

// Compute capability as major * 10 + minor: what every host dispatch decides on. A build with
// E4KV_VOLTA_PATH (arch.cuh) reports at most 70, so that the host takes the paths a V100 takes.
int compute_capability(int device);

// True when `device` has the native E4M3 conversion (sm_89+), the build did not set
// E4KV_FORCE_SOFTWARE_E4M3, and the environment variable E4KV_FORCE_SOFTWARE_E4M3 is unset or "0".
bool e4m3_native_available(int device);

// True when kernels launched through launch_kernel (launch.cuh) on the current device go out as
// programmatic dependents: an sm_90+ device, set_programmatic_launch has not turned it off, and
// the environment variable E4KV_DISABLE_PDL is unset or "0" (read once).
bool programmatic_launch_enabled();

// Process-wide switch for programmatic dependent launch (default on), for side-by-side
// measurements. Not meant to be flipped while other threads launch.
void set_programmatic_launch(bool enabled);

// True unless set_cluster_merge(false) or the environment variable E4KV_DISABLE_CLUSTER_MERGE
// (read once) turned off decode attention's cluster merge (decode_attention_cluster_merge
// then reports none, so the planners pick the split merged by a second kernel).
bool cluster_merge_enabled();
void set_cluster_merge(bool enabled);

}  // namespace e4kv::cuda
