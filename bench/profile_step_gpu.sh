#!/usr/bin/env bash
# Where one decode step's device time goes, kernel by kernel: ncu times every kernel of one eager
# decode step of the Qwen4Exp benchmark checkpoint (or of the dense 8B shape: BENCH=dense) (e4kv_bench_qwen4exp with
# E4KV_BENCH_PROFILER_STEP: the step between cudaProfilerStart and Stop, run under
# `ncu --profile-from-start off`), then the kernels are summed by name. ncu serialises the
# kernels and times each alone, so the sum is the step's kernel time without launch gaps or
# overlap (the bench's own figures give those).
#   $OUT/step_kernels.csv   ncu's raw CSV (gpu__time_duration.sum per kernel launch)
#   $OUT/step_kernels.txt   per kernel name: launches, total us, share; the largest first
# Environment: BATCH (default 1), CONTEXT (default 4096), LIMIT seconds (default 300),
# E4KV_BENCH_CKPT (default /tmp/e4kv_q4e: written when missing, reused otherwise);
# BENCH=dense: the dense Llama-3-8B shape instead (e4kv_bench_dense_decode, FP16 cache, its
# checkpoint in E4KV_DENSE_CKPT, default /tmp/e4kv_dense8b).
# Binaries: the prebuilt pack (scripts/gpu_prebuilt.sh) or a build in build-gpu90.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
B=build-gpu90
if [ ! -x $B/bench/e4kv_bench_qwen4exp ]; then scripts/gpu_prebuilt.sh unpack >/dev/null || exit 1; fi
CKPT=${E4KV_BENCH_CKPT:-/tmp/e4kv_q4e}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -n "$NCU" ] || { echo "profile_step_gpu.sh: no ncu on this machine" >&2; exit 1; }
if [ "${BENCH:-qwen4exp}" = dense ]; then
  BENCH_CMD=($B/bench/e4kv_bench_dense_decode "$OUT/profiled_bench.json" --keep-checkpoint
    "${E4KV_DENSE_CKPT:-/tmp/e4kv_dense8b}" --cells "${BATCH:-1}x${CONTEXT:-4096}" --cache fp16)
else
  BENCH_CMD=($B/bench/e4kv_bench_qwen4exp "$OUT/profiled_bench.json" --keep-checkpoint "$CKPT"
    --batches "${BATCH:-1}" --contexts "${CONTEXT:-4096}" --cache fp16)
fi
E4KV_BENCH_PROFILER_STEP=1 timeout "${LIMIT:-300}" "$NCU" --profile-from-start off \
  --metrics gpu__time_duration.sum --csv --log-file "$OUT/step_kernels.csv" \
  "${BENCH_CMD[@]}" >"$OUT/profile_bench.log" 2>&1
echo "ncu rc=$?"
python3 - "$OUT/step_kernels.csv" >"$OUT/step_kernels.txt" <<'PY'
import csv, collections, re, sys
rows = []
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "s": 1e6, "second": 1e6}[r["Metric Unit"]]
    value = float(r["Metric Value"].replace(",", "")) * scale
    name = re.sub(r"\(.*", "", r["Kernel Name"]).strip()
    rows.append((name, value))
total = sum(v for _, v in rows)
by = collections.defaultdict(lambda: [0, 0.0])
for name, v in rows:
    by[name][0] += 1
    by[name][1] += v
print(f"{len(rows)} kernels, {total:.1f} us of kernel time")
for name, (n, v) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{v:10.1f} us {100 * v / total:5.1f}% {n:5d} x {v / n:8.2f} us  {name}")
PY
head -40 "$OUT/step_kernels.txt"
