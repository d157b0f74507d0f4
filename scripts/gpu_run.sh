#!/usr/bin/env bash
# One round on the GPU machine (see ../shared/GPU.md): configure, build for sm_75 (software E4M3
# path, proves it compiles) and sm_90, run every test (CUDA ones included), then the same CUDA tests
# in a build that forces the software decoder, and compute-sanitizer over the CUDA tests.
# Logs go to $OUT (or ./out). Usage: [PHASE=all|tests|bench] scripts/gpu_run.sh [extra ctest args]
# (one device call has a time limit: PHASE=tests then PHASE=bench on a warm machine splits a round).
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

PHASE=${PHASE:-all}
step configure cmake -S . -B build-gpu -G Ninja -DE4KV_WERROR=ON "-DCMAKE_CUDA_ARCHITECTURES=75;90" \
  -DCMAKE_BUILD_TYPE=Release
step build cmake --build build-gpu -j "$JOBS"
if [ "$PHASE" != bench ]; then
  step ctest ctest --test-dir build-gpu --output-on-failure -j 8 "$@"
  step cuda_tests build-gpu/tests/e4kv_cuda_tests
  E4KV_FORCE_SOFTWARE_E4M3=1 step cuda_tests_forced_software build-gpu/tests/e4kv_cuda_tests
  step sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
    build-gpu/tests/e4kv_cuda_tests --gtest_filter=-*AllFloats*
  step sanitizer_experimental compute-sanitizer --tool memcheck --error-exitcode 1 \
    build-gpu/bench/experimental/e4kv_experimental_tests --gtest_filter=-*MatchesCpuReference
  # The command-line program end to end on the GPU: a generated dense checkpoint, FP16 and E4M3.
  smoke() {
    local m
    m=$(mktemp -d)
    build-gpu/e4kv synth-checkpoint "$m/model" --family qwen3 --head-dim 64 --with-kv-scales &&
      build-gpu/e4kv generate "$m/model" --prompt "The cache" --max-tokens 16 --device cuda --json &&
      build-gpu/e4kv generate "$m/model" --prompt "The cache" --max-tokens 16 --device cuda \
        --kv-cache-dtype fp8_e4m3 --json &&
      build-gpu/e4kv logits "$m/model" --ids 1,2,3 --device cuda --json >"$m/logits.json" &&
      python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['logits']; print('logits', len(l), 'x', len(l[0]))" "$m/logits.json"
    local rc=$?
    rm -rf "$m"
    return $rc
  }
  step cli_smoke smoke
fi

if [ "$PHASE" != tests ] && [ -x bench/gpu_bench.sh ]; then
  step bench bench/gpu_bench.sh build-gpu "$OUT"; cat "$OUT/bench.log"
fi

echo "=== summary: $([ $status -eq 0 ] && echo ALL OK || echo FAILURES)"
exit $status
