# Sourced by the GPU-machine scripts: when the Debian packages the build needs (PCRE2, OpenBLAS,
# pkgconf) are carried unpacked in .deps/root (see scripts/gpu_deps.sh), point pkg-config, CMake
# and the loader at them. The GPU image has neither package and nothing can be installed there.
E4KV_DEPS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.deps/root"
if [ -d "$E4KV_DEPS" ]; then
  E4KV_LIB="$E4KV_DEPS/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$E4KV_LIB:$E4KV_LIB/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! command -v pkg-config >/dev/null 2>&1; then
    export PKG_CONFIG="$E4KV_DEPS/usr/bin/pkgconf"
  fi
  export PKG_CONFIG_SYSROOT_DIR="$E4KV_DEPS"
  export PKG_CONFIG_LIBDIR="$E4KV_LIB/pkgconfig:$E4KV_LIB/openblas-pthread/pkgconfig"
fi
