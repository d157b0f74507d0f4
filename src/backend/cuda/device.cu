#include "backend/cuda/device.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_check.h"

namespace e4kv::cuda {
namespace {

// True when the environment variable `name` is set to something other than "" or "0".
bool env_flag_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

}  // namespace

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
#if defined(E4KV_VOLTA_PATH)
  return std::min(major * 10 + minor, 70);
#else
  return major * 10 + minor;
#endif
}

bool e4m3_native_available(int device) {
#if defined(E4KV_FORCE_SOFTWARE_E4M3)
  (void)device;
  return false;
#else
  if (env_flag_set("E4KV_FORCE_SOFTWARE_E4M3")) return false;
  return compute_capability(device) >= 89;
#endif
}

namespace {

std::atomic<bool> g_programmatic_launch{true};

bool env_disables_programmatic_launch() {
  static const bool disabled = env_flag_set("E4KV_DISABLE_PDL");
  return disabled;
}

}  // namespace

bool programmatic_launch_enabled() {
  if (!g_programmatic_launch.load(std::memory_order_relaxed) ||
      env_disables_programmatic_launch()) {
    return false;
  }
  // Compute capability per device, memoised (0 = not yet asked).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> capability[kMaxDevices]{};
  int device = 0;
  E4KV_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return compute_capability(device) >= 90;
  int cc = capability[device].load(std::memory_order_relaxed);
  if (cc == 0) {
    cc = compute_capability(device);
    capability[device].store(cc, std::memory_order_relaxed);
  }
  return cc >= 90;
}

void set_programmatic_launch(bool enabled) {
  g_programmatic_launch.store(enabled, std::memory_order_relaxed);
}

namespace {
std::atomic<bool> g_cluster_merge{true};
}  // namespace

bool cluster_merge_enabled() {
  static const bool disabled = env_flag_set("E4KV_DISABLE_CLUSTER_MERGE");
  return !disabled && g_cluster_merge.load(std::memory_order_relaxed);
}

void set_cluster_merge(bool enabled) {
  g_cluster_merge.store(enabled, std::memory_order_relaxed);
}

}  // namespace e4kv::cuda
