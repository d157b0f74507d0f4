#!/usr/bin/env bash
# The smallest GPU round worth a machine start, for when only a few device minutes are left: the
# prebuilt CUDA tests (out/gpubin.tar.xz, scripts/gpu_prebuilt.sh; the quantized-weight kernels'
# included) while the Qwen4Exp benchmark checkpoint is written beside them, the W4A16 / NVFP4 /
# FP8-block linear against cuBLAS FP16, then `e4kv serve` on that checkpoint under
# bench/serve_load.py for LOAD_SECONDS. Each part has its own time cap so the whole ends inside ROUND_SECONDS and what
# finished is in $OUT even when a later part is cut off. Carry .deps.tar.xz and out/gpubin.tar.xz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${ROUND_SECONDS:-180} - ($(date +%s) - T0))); }
scripts/gpu_prebuilt.sh unpack | tee "$OUT/unpack.txt"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
B=build-gpu90
CKPT=${E4KV_BENCH_CKPT:-/tmp/e4kv_q4e}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
echo "prebuilt: $(cat $B/COMMIT)" | tee -a "$OUT/env.txt"

rm -rf "$CKPT"
(
  t=$(date +%s)
  $B/bench/e4kv_bench_qwen4exp --keep-checkpoint "$CKPT" --checkpoint-only >"$OUT/checkpoint.log" 2>&1
  echo "checkpoint rc=$? $(($(date +%s) - t)) s" >>"$OUT/checkpoint.log"
) &
writer=$!

t=$(date +%s)
timeout "${TESTS_SECONDS:-80}" $B/tests/e4kv_cuda_tests --gtest_brief=1 >"$OUT/cuda_tests.log" 2>&1
echo "=== cuda_tests rc=$? $(($(date +%s) - t)) s"
grep -E '^\[  FAILED|Failure|PASSED|FAILED TEST' "$OUT/cuda_tests.log" | head -40
# The opt-in paths (E4KV_MOE_SHARED_EXPERT=fused, E4KV_W4_MMA=on) under the model and quantized
# tests: their defaults flip once these pass (SWITCHED_TESTS_SECONDS=0 skips).
t=$(date +%s)
E4KV_MOE_SHARED_EXPERT=fused E4KV_W4_MMA=on timeout "${SWITCHED_TESTS_SECONDS:-60}" \
  $B/tests/e4kv_cuda_tests --gtest_brief=1 \
  --gtest_filter='*Qwen4Exp*:*Quantized*:*QuantLinear*:*MoeFfn*:*Engine*' \
  >"$OUT/cuda_tests_switched.log" 2>&1
echo "=== cuda_tests (fused shared expert, W4 mma on) rc=$? $(($(date +%s) - t)) s"
grep -E '^\[  FAILED|Failure|PASSED|FAILED TEST' "$OUT/cuda_tests_switched.log" | head -20

# transformers on the quantized cases' dequantized checkpoints (CPU; unpack OUT/quant_refs.tgz and
# copy quant_refs/CASE/reference.json into tests/data/quant/CASE/ afterwards).
# Committed since 2026-12-07: QUANT_REFS=1 regenerates them.
if [ "${QUANT_REFS:-0}" = 1 ]; then
  timeout 60 python3 scripts/hf_reference_quant.py --out "$OUT/quant_refs" >"$OUT/quant_refs.log" 2>&1
  echo "=== quant references rc=$?"; tail -8 "$OUT/quant_refs.log"
  # A call brings back a limited number of files: the references travel as one archive.
  tar -C "$OUT" -czf "$OUT/quant_refs.tgz" quant_refs quant_refs.log && rm -rf "$OUT/quant_refs" \
    "$OUT/quant_refs.log"
fi

t=$(date +%s)
timeout "${QUANT_BENCH_SECONDS:-40}" $B/bench/e4kv_bench_quant_linear "$OUT/quant_linear.json" \
  >"$OUT/quant_linear.log" 2>&1
echo "=== quant_linear bench rc=$? $(($(date +%s) - t)) s"
grep -E "awq|device" "$OUT/quant_linear.log" | cut -c1-250

wait $writer
tail -2 "$OUT/checkpoint.log"
[ -f "$CKPT/config.json" ] || { echo "no checkpoint"; exit 1; }
budget=$(($(left) - 10))
[ "$budget" -gt 40 ] || { echo "no time left for the serve run ($budget s)"; exit 0; }
LOAD_SECONDS=${LOAD_SECONDS:-30} PHASE=serve timeout "$budget" bench/serving_gpu.sh
echo "=== serve rc=$? after $(($(date +%s) - T0)) s"
