#!/usr/bin/env bash
# The Volta path (arch.cuh) on the GPU machine, next to the normal build, in one device call:
#   - the PTX check (scripts/check_volta_ptx.py: no instruction newer than sm_70), and the decode
#     kernels' loop counts in the SASS of sm_75 builds with and without the Volta path;
#   - build-gpu (sm_90, the normal path) and build-volta (sm_90 with E4KV_VOLTA_PATH: the code a
#     V100 runs, dispatched as on a V100), built side by side;
#   - the warp-matrix tests in both builds, then every CUDA test through the Volta path;
#   - the decode attention benchmark from both builds, one after the other (two shapes);
#   - ncu warp-instruction and DRAM-byte counts of one decode kernel launch per shape and cache
#     type from both builds (ops per byte = 32 x warp instructions / KV bytes).
# Steps start only while BUDGET_S (default 560) seconds have not passed; AFTER_BUILD, when set, is
# a command run once both builds are done (with build-gpu/e4kv available); TESTS_ONLY=1 skips the
# benchmark and ncu steps and runs every CUDA test of the normal build instead. Logs and JSON go to
# $OUT (or ./out), packed into $OUT/volta_round.tgz at the end.
# Usage: [BUDGET_S=...] [AFTER_BUILD=...] scripts/gpu_volta.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
BUDGET_S=${BUDGET_S:-560}
T0=$(date +%s)
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
mkdir -p "$OUT"
JOBS=$(nproc)
status=0

left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
step() {  # step NAME SECONDS CMD...: runs CMD with a time limit when that much budget is left
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt "$limit" ]; then echo "--- $name skipped ($(left) s left)"; return 0; fi
  echo "=== $name ($(( $(date +%s) - T0 )) s)"
  local run=(timeout "$limit")
  declare -F "$1" >/dev/null && run=()  # a shell function: no time limit
  if ! "${run[@]}" "$@" >"$OUT/$name.log" 2>&1; then
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

configure() {  # configure DIR EXTRA...
  local dir=$1; shift
  [ -f "$dir/build.ninja" ] || cmake -S . -B "$dir" -G Ninja -DE4KV_WERROR=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release "$@"
}
step configure_gpu 60 configure build-gpu
step configure_volta 60 configure build-volta -DE4KV_VOLTA_PATH=ON
echo "=== builds and PTX check, side by side ($(( $(date +%s) - T0 )) s)"
cmake --build build-gpu -j "$JOBS" --target e4kv e4kv_cuda_tests e4kv_bench_decode_attention \
  >"$OUT/build_gpu.log" 2>&1 &
gpu_pid=$!
cmake --build build-volta -j "$JOBS" --target e4kv_cuda_tests e4kv_bench_decode_attention \
  >"$OUT/build_volta.log" 2>&1 &
volta_pid=$!
# The decode kernels' SASS for sm_75, with and without the Volta path (the V100 estimate's counts).
sass() {  # sass NAME EXTRA_FLAGS...
  local name=$1; shift
  nvcc -cubin -arch=sm_75 -std=c++20 --expt-relaxed-constexpr -O3 -DNDEBUG -Iinclude -Isrc "$@" \
    src/backend/cuda/paged_decode_attention.cu -o "build/decode_$name.cubin" &&
    cuobjdump -sass "build/decode_$name.cubin" >"build/decode_$name.sass" &&
    gzip -c "build/decode_$name.sass" >"$OUT/decode_$name.sass.gz" &&
    for kernel in ILi128ENS0_7ElemF16ELi1ELb0ELi4ELi0E ILi256ENS0_7ElemF16ELi1ELb0ELi4ELi0E \
      ILi128ENS0_8ElemE4m3ILNS0_10E4m3DecodeE0EEELi1ELb0ELi4ELi0E \
      ILi256ENS0_8ElemE4m3ILNS0_10E4m3DecodeE0EEELi1ELb0ELi4ELi0E; do
      python3 scripts/sass_loop_counts.py "build/decode_$name.sass" "$kernel"
    done
}
mkdir -p build
sass sm75 >"$OUT/sass_sm75.log" 2>&1 &
sass volta_sm75 -DE4KV_VOLTA_PATH=1 >"$OUT/sass_volta_sm75.log" 2>&1 &
python3 scripts/check_volta_ptx.py --self-test --jobs 4 --out "$PWD/build/volta-ptx" \
  >"$OUT/ptx_check.log" 2>&1
ptx_rc=$?
wait $gpu_pid; gpu_rc=$?
wait $volta_pid; volta_rc=$?
wait  # the SASS counts
tail -3 "$OUT/ptx_check.log"
cat "$OUT/sass_sm75.log" "$OUT/sass_volta_sm75.log"
for b in gpu volta; do
  rc_var=${b}_rc
  if [ "${!rc_var}" -ne 0 ]; then echo "!!! build_$b failed"; grep -m 20 -B2 -A8 "error" "$OUT/build_$b.log"; status=1; fi
done
[ $ptx_rc -eq 0 ] || { echo "!!! ptx_check failed"; status=1; }
echo "=== builds done ($(( $(date +%s) - T0 )) s)"

if [ -n "${AFTER_BUILD:-}" ] && [ "$gpu_rc" -eq 0 ]; then
  step after_build 150 bash -c "$AFTER_BUILD"
fi

if [ "$volta_rc" -eq 0 ]; then
  step warp_matrix_gpu 30 build-gpu/tests/e4kv_cuda_tests --gtest_filter='WarpMatrix.*'
  step warp_matrix_volta 30 build-volta/tests/e4kv_cuda_tests --gtest_filter='WarpMatrix.*'
  step cuda_tests_volta 200 build-volta/tests/e4kv_cuda_tests
fi
if [ -n "${TESTS_ONLY:-}" ] && [ "$gpu_rc" -eq 0 ]; then
  step cuda_tests_gpu 200 build-gpu/tests/e4kv_cuda_tests
fi
if [ "$volta_rc" -eq 0 ] && [ -z "${TESTS_ONLY:-}" ]; then
  for shape in b8_h32_kv8_d128_32k b4_h16_kv2_d256_128k; do
    for b in gpu volta; do
      step "decode_${b}_$shape" 40 "build-$b/bench/e4kv_bench_decode_attention" \
        "$OUT/decode_${b}_$shape.json" "$shape" "" "$([ "$b" = volta ] && echo best || echo both)"
    done
  done
  for b in gpu volta; do
    for shape in b8_h32_kv8_d128_32k b4_h16_kv2_d256_128k; do
      for kv in fp16 e4m3-soft; do
        step "ncu_${b}_${shape}_$kv" 40 ncu --metrics smsp__inst_executed.sum,dram__bytes_read.sum \
          -k regex:paged_decode_attention_kernel -s 3 -c 1 --csv \
          "build-$b/bench/e4kv_bench_decode_attention" "$OUT/ncu_tmp.json" "$shape" "$kv" best
      done
    done
  done
fi

echo "=== summary ($(( $(date +%s) - T0 )) s): $([ $status -eq 0 ] && echo OK || echo FAILURES)"
# A device call brings back only a few files: everything goes home as one archive.
pack=$(mktemp -d)/volta_round.tgz
tar czf "$pack" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$pack" "$OUT/"
exit $status
