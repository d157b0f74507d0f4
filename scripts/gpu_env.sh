# Sourced by the GPU-machine scripts: when the Debian packages the build needs (PCRE2, OpenBLAS,
# pkgconf) are carried unpacked in .deps/root (see scripts/gpu_deps.sh), point pkg-config, CMake
# and the loader at them. The GPU image has neither package and nothing can be installed there.
E4KV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
E4KV_DEPS="$E4KV_ROOT/.deps/root"
# Carried packed (.deps.tar.xz, scripts/gpu_deps.sh): unpack once.
if [ ! -d "$E4KV_DEPS" ] && [ -f "$E4KV_ROOT/.deps.tar.xz" ]; then
  mkdir -p "$E4KV_ROOT/.deps"
  tar -C "$E4KV_ROOT/.deps" -xJf "$E4KV_ROOT/.deps.tar.xz" ||
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$E4KV_ROOT/.deps.tar.xz" "$E4KV_ROOT/.deps"
fi
if [ -d "$E4KV_DEPS" ]; then
  E4KV_LIB="$E4KV_DEPS/usr/lib/x86_64-linux-gnu"
  export LD_LIBRARY_PATH="$E4KV_LIB:$E4KV_LIB/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! command -v pkg-config >/dev/null 2>&1; then
    export PKG_CONFIG="$E4KV_DEPS/usr/bin/pkgconf"
  fi
  export PKG_CONFIG_SYSROOT_DIR="$E4KV_DEPS"
  export PKG_CONFIG_LIBDIR="$E4KV_LIB/pkgconfig:$E4KV_LIB/openblas-pthread/pkgconfig"
fi
# Libraries packed with the prebuilt binaries (scripts/gpu_prebuilt.sh).
if [ -d "$E4KV_ROOT/build-gpu90/lib" ]; then
  export LD_LIBRARY_PATH="$E4KV_ROOT/build-gpu90/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
