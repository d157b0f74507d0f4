#!/usr/bin/env bash
# One round on the GPU machine (see ../shared/GPU.md): configure, build for sm_75 (software E4M3
# path, proves it compiles) and sm_90, run every test (CUDA ones included), then the same CUDA tests
# in a build that forces the software decoder, and compute-sanitizer over the CUDA tests.
# Logs go to $OUT (or ./out). Usage: scripts/gpu_run.sh [extra ctest args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
mkdir -p "$OUT"
JOBS=$(nproc)
status=0

{
  echo "date: $(date -u +%FT%TZ)"
  if [ -f COMMIT ]; then echo "commit: $(cat COMMIT) (snapshot)"; else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty)"; fi
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  nvcc --version | tail -1
} | tee "$OUT/env.txt"

step() {  # step NAME CMD...
  local name=$1; shift
  echo "=== $name"
  if ! "$@" >"$OUT/$name.log" 2>&1; then
    echo "!!! $name failed (log: $name.log)"; tail -40 "$OUT/$name.log"; status=1; return 1
  fi
  tail -5 "$OUT/$name.log"
}

step configure cmake -S . -B build-gpu -G Ninja -DE4KV_WERROR=ON "-DCMAKE_CUDA_ARCHITECTURES=75;90" \
  -DCMAKE_BUILD_TYPE=Release
step build cmake --build build-gpu -j "$JOBS"
step ctest ctest --test-dir build-gpu --output-on-failure -j 8 "$@"
step cuda_tests build-gpu/tests/e4kv_cuda_tests
E4KV_FORCE_SOFTWARE_E4M3=1 step cuda_tests_forced_software build-gpu/tests/e4kv_cuda_tests
step sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
  build-gpu/tests/e4kv_cuda_tests --gtest_filter=-*AllFloats*

if [ -x bench/gpu_bench.sh ]; then step bench bench/gpu_bench.sh build-gpu "$OUT"; cat "$OUT/bench.log"; fi

echo "=== summary: $([ $status -eq 0 ] && echo ALL OK || echo FAILURES)"
exit $status
