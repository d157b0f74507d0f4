#!/usr/bin/env bash
# The Volta path (arch.cuh) on the GPU machine, next to the normal build, in one device call:
#   - the PTX check (scripts/check_volta_ptx.py: no instruction newer than sm_70);
#   - build-gpu (sm_90, the normal path) and build-volta (sm_90 with E4KV_VOLTA_PATH: the code a
#     V100 runs, dispatched as on a V100);
#   - every CUDA test through the Volta path, and the warp-matrix tests in both builds;
#   - decode, prefill and QSA-step benchmarks from both builds, one after the other;
#   - ncu instruction and DRAM byte counts of the decode kernels from both builds (ops per byte).
# Logs and JSON go to $OUT (or ./out). Usage: [SKIP_BENCH=1] scripts/gpu_volta.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
mkdir -p "$OUT"
JOBS=$(nproc)
status=0

step() {  # step NAME CMD...
  local name=$1; shift
  echo "=== $name ($(date +%T))"
  if ! "$@" >"$OUT/$name.log" 2>&1; then
    echo "!!! $name failed (log: $name.log)"; tail -30 "$OUT/$name.log"; status=1; return 1
  fi
  tail -4 "$OUT/$name.log"
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  nvcc --version | tail -1
} | tee "$OUT/env.txt"

step ptx_check python3 scripts/check_volta_ptx.py --self-test --out "$OUT/volta-ptx-build"
rm -rf "$OUT/volta-ptx-build"

TARGETS=(e4kv_cuda_tests e4kv_bench_decode_attention e4kv_bench_prefill_attention e4kv_bench_qsa_decode)
configure() {  # configure DIR EXTRA...
  local dir=$1; shift
  [ -f "$dir/build.ninja" ] || cmake -S . -B "$dir" -G Ninja -DE4KV_WERROR=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release "$@"
}
step configure_volta configure build-volta -DE4KV_VOLTA_PATH=ON
step configure_gpu configure build-gpu
step build_volta cmake --build build-volta -j "$JOBS" --target "${TARGETS[@]}" ||
  { echo "=== summary: FAILURES"; exit 1; }
step build_gpu cmake --build build-gpu -j "$JOBS" --target "${TARGETS[@]}"

step warp_matrix_gpu build-gpu/tests/e4kv_cuda_tests --gtest_filter='WarpMatrix.*'
step warp_matrix_volta build-volta/tests/e4kv_cuda_tests --gtest_filter='WarpMatrix.*'
step cuda_tests_volta build-volta/tests/e4kv_cuda_tests

if [ -z "${SKIP_BENCH:-}" ]; then
  for b in gpu volta; do
    step "decode_$b" "build-$b/bench/e4kv_bench_decode_attention" "$OUT/decode_attention_$b.json"
  done
  for b in gpu volta; do
    step "prefill_$b" "build-$b/bench/e4kv_bench_prefill_attention" "$OUT/prefill_attention_$b.json"
  done
  for b in gpu volta; do
    step "qsa_$b" "build-$b/bench/e4kv_bench_qsa_decode" "$OUT/qsa_decode_$b.json"
  done
  # Warp instructions executed and DRAM bytes read by one decode kernel launch per shape and cache
  # type (the device's best load path): ops per byte = 32 x warp instructions / KV bytes.
  for b in gpu volta; do
    for shape in b8_h32_kv8_d128_32k b4_h16_kv2_d256_128k; do
      for kv in fp16 e4m3-soft; do
        step "ncu_${b}_${shape}_$kv" ncu --metrics \
          smsp__inst_executed.sum,dram__bytes_read.sum \
          -k regex:paged_decode_attention_kernel -s 3 -c 1 --csv \
          "build-$b/bench/e4kv_bench_decode_attention" "$OUT/ncu_tmp.json" "$shape" "$kv" best
      done
    done
  done
fi

echo "=== summary: $([ $status -eq 0 ] && echo OK || echo FAILURES)"
exit $status
