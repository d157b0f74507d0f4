#!/usr/bin/env bash
# One round on the GPU machine (see ../shared/GPU.md), in phases that each fit one device call:
#   PHASE=build      configure and build for sm_75 (the software E4M3 path, proves it compiles) and
#                    sm_90 (warnings are errors)
#   PHASE=tests      every test (CUDA ones included), the CUDA tests again with the software decoder
#                    forced, the command-line program end to end on the GPU
#   PHASE=sanitizer  compute-sanitizer memcheck over the CUDA tests and the experimental kernels
#   PHASE=bench      bench/gpu_bench.sh
#   PHASE=all        all four (the default; for a machine without a per-call limit)
# Every phase builds first (a no-op when PHASE=build ran before on the same machine). Logs go to
# $OUT (or ./out). Usage: [PHASE=...] scripts/gpu_run.sh [extra ctest args]
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
case "$PHASE" in all | build | tests | sanitizer | bench) ;; *)
  echo "PHASE=$PHASE: expected all, build, tests, sanitizer or bench" >&2; exit 2 ;;
esac
runs() { [ "$PHASE" = all ] || [ "$PHASE" = "$1" ]; }

if [ -f build-gpu/build.ninja ]; then echo "=== configure (kept: build-gpu exists)"; else
  step configure cmake -S . -B build-gpu -G Ninja -DE4KV_WERROR=ON \
    "-DCMAKE_CUDA_ARCHITECTURES=75;90" -DCMAKE_BUILD_TYPE=Release
fi
step build cmake --build build-gpu -j "$JOBS" || { echo "=== summary: FAILURES"; exit 1; }
if runs sanitizer; then
  step sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
    build-gpu/tests/e4kv_cuda_tests --gtest_filter=-*AllFloats*
  step sanitizer_experimental compute-sanitizer --tool memcheck --error-exitcode 1 \
    build-gpu/bench/experimental/e4kv_experimental_tests --gtest_filter=-*MatchesCpuReference
fi
if runs tests; then
  step ctest ctest --test-dir build-gpu --output-on-failure -j 8 "$@"
  step cuda_tests build-gpu/tests/e4kv_cuda_tests
  E4KV_FORCE_SOFTWARE_E4M3=1 step cuda_tests_forced_software build-gpu/tests/e4kv_cuda_tests
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
  # The scale workflow ending in the E4M3 cache on the GPU: statistics (synthetic), summarize,
  # overlay, verify, generate on the overlay.
  overlay_smoke() {
    local m
    m=$(mktemp -d)
    build-gpu/e4kv synth-checkpoint "$m/model" --family llama --head-dim 64 &&
      build-gpu/e4kv synth-stats "$m/model" --out "$m/stats.jsonl" &&
      build-gpu/e4kv summarize "$m/stats.jsonl" --out "$m/scales.json" --report "$m/report" &&
      build-gpu/e4kv overlay "$m/model" --scales "$m/scales.json" --out "$m/model-kvscales" &&
      build-gpu/e4kv verify "$m/model-kvscales" &&
      build-gpu/e4kv generate "$m/model-kvscales" --prompt "The cache" --max-tokens 16 \
        --device cuda --kv-cache-dtype fp8_e4m3 --json
    local rc=$?
    rm -rf "$m"
    return $rc
  }
  step cli_overlay_smoke overlay_smoke
fi

if runs bench && [ -x bench/gpu_bench.sh ]; then
  step bench bench/gpu_bench.sh build-gpu "$OUT"; cat "$OUT/bench.log"
fi

echo "=== summary: $([ $status -eq 0 ] && echo ALL OK || echo FAILURES)"
exit $status
