#!/usr/bin/env bash
# Everything owed in one device call, for when machine starts are scarce (each start can fail and
# cost minutes): the short round (every CUDA test, the quantized cases' transformers references,
# the quantized-linear benchmark, `e4kv serve` under load), then the Qwen4Exp decode A/B against
# out/base.tar.xz (scripts/gpu_ab_qwen4exp.sh, batch 1), then the per-kernel profile if time is
# left; every output packed into $OUT/all.tgz at the end (a call brings back few files).
# Environment: TOTAL_SECONDS (default 560).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${TOTAL_SECONDS:-560} - ($(date +%s) - T0))); }
ROUND_SECONDS=${ROUND_SECONDS:-290} TESTS_SECONDS=${TESTS_SECONDS:-150} \
  QUANT_BENCH_SECONDS=${QUANT_BENCH_SECONDS:-40} LOAD_SECONDS=${LOAD_SECONDS:-30} \
  scripts/gpu_short_round.sh >"$OUT/short_round.txt" 2>&1
echo "=== short round done at $(($(date +%s) - T0)) s"
grep -E "^=== |PASSED|FAILED|rc=" "$OUT/short_round.txt" | head -30
tail -25 "$OUT/short_round.txt"
echo "--- serve load:"; cat "$OUT/serve_load.json" 2>/dev/null
if [ "$(left)" -gt 150 ]; then
  # base (unless SKIP_BASE=1), new and the variant (VARIANT_ENV)
  runs=$((1 + $([ "${SKIP_BASE:-0}" = 1 ] && echo 0 || echo 1) + $([ -n "${VARIANT_ENV:-}" ] && echo 1 || echo 0)))
  PROFILE=0 BATCHES=${AB_BATCHES:-1} LIMIT_EACH=$((($(left) - 20) / runs)) scripts/gpu_ab_qwen4exp.sh \
    >"$OUT/ab.txt" 2>&1
  echo "=== A/B done at $(($(date +%s) - T0)) s"
  cat "$OUT/ab.txt" | tail -60
fi
if [ "$(left)" -gt 100 ]; then
  LIMIT=$(($(left) - 15)) bench/profile_step_gpu.sh >"$OUT/profile.txt" 2>&1
  echo "=== profile done at $(($(date +%s) - T0)) s"
  head -30 "$OUT/step_kernels.txt" 2>/dev/null
fi
# Only the archive stays in $OUT: a call brings back its first few files, by name.
scripts/gpu_pack_out.sh "$OUT"
ls "$OUT"
