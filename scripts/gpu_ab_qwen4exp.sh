#!/usr/bin/env bash
# A/B on one GPU in one call: the Qwen4Exp decode benchmark of an earlier commit (out/base.tar.xz:
# its stripped e4kv_bench_qwen4exp and e4kv_bench_quant_linear with COMMIT, packed on the
# development machine from a worktree build) and of this tree's prebuilt pack, alternating
# base, new, base, new on the same checkpoint, then bench/profile_step_gpu.sh (ncu, per kernel)
# on the new binary. Logs and JSON in $OUT (ab_*.log / .json).
# Environment: BATCHES (default 1,8), CONTEXTS (default 4096), ROUNDS (default 1: base then new),
# SKIP_BASE=1 (the new binary and its variant only), VARIANT_ENV (VAR=VALUE ...: also the new
# binary under these, e.g.
# E4KV_HC_MIX_KERNELS=load-first), PROFILE (default 1), E4KV_BENCH_CKPT (default /tmp/e4kv_q4e).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/e4kv_base
B=build-gpu90
[ -x $B/bench/e4kv_bench_qwen4exp ] || scripts/gpu_prebuilt.sh unpack >/dev/null || exit 1
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
tar -C /tmp/e4kv_base -xJf out/base.tar.xz || exit 1
CKPT=${E4KV_BENCH_CKPT:-/tmp/e4kv_q4e}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/ab_env.txt"
echo "base $(cat /tmp/e4kv_base/COMMIT), new $(cat $B/COMMIT)" | tee -a "$OUT/ab_env.txt"
run() {  # run NAME BINARY [VAR=VALUE ...]
  local t=$(date +%s) name=$1 bin=$2
  shift 2
  timeout "${LIMIT_EACH:-200}" env "$@" "$bin" "$OUT/ab_$name.json" --keep-checkpoint "$CKPT" \
    --batches "${BATCHES:-1,8}" --contexts "${CONTEXTS:-4096}" --cache fp16 >"$OUT/ab_$name.log" 2>&1
  echo "=== $name rc=$? $(($(date +%s) - t)) s"
  grep -E "in_place|in place|total|x[0-9]+ +host|^fp16|step" "$OUT/ab_$name.log" | tail -40
}
for r in $(seq 1 "${ROUNDS:-1}"); do
  [ "${SKIP_BASE:-0}" = 1 ] || run "base_$r" /tmp/e4kv_base/e4kv_bench_qwen4exp
  run "new_$r" $B/bench/e4kv_bench_qwen4exp
  # VARIANT_ENV: the new binary again under these settings (e.g. E4KV_HC_MIX_KERNELS=load-first).
  if [ -n "${VARIANT_ENV:-}" ]; then
    # shellcheck disable=SC2086
    run "variant_$r" $B/bench/e4kv_bench_qwen4exp $VARIANT_ENV
  fi
done
if [ "${PROFILE:-1}" = 1 ]; then LIMIT=${PROFILE_LIMIT:-200} bench/profile_step_gpu.sh; fi
