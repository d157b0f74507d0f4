#!/usr/bin/env bash
# The serving benchmarks of the engine on the GPU machine, on the Qwen4Exp benchmark checkpoint
# (bench/cuda/bench_qwen4exp.cpp's synthetic model: 48 layers, 64 experts top-10, ~13B FP16
# parameters), in phases that each fit one device call. Every phase builds what it needs (sm_90,
# a no-op when built before on the same machine) and writes the checkpoint once (kept in
# $E4KV_BENCH_CKPT, default /tmp/e4kv_q4e). E4M3 runs with unit scales: a speed measure only.
#   PHASE=setup     build and write the checkpoint
#   PHASE=matrix    e4kv bench: CONCURRENCY x CONTEXT cells, FP16 and E4M3 at KV_BYTES (default
#                   8.2 GB; the per-sequence state of the widest concurrency comes out of it first:
#                   77 MB a sequence on this checkpoint) and
#                   MAX_MODEL_LEN (default 16640: a 16K prompt and 256 tokens). The 16K cells'
#                   prefill took more than 230 s for concurrency 1 and 8 on an H100 (2026-12-07).
#   PHASE=workload  64 requests of 16K-token prompts, 256 output tokens, FP16 then E4M3 at WL_BYTES
#   PHASE=serve     e4kv serve (E4M3, SERVE_BLOCKS blocks: small enough to preempt) under
#                   bench/serve_load.py: 64 clients for LOAD_SECONDS, token-id prompts
# BENCH_FLAGS / SERVE_FLAGS: more `e4kv bench` / `e4kv serve` flags (--enforce-eager: no
# decode-step graphs).
# Results (bench.json/md/svg per run, logs) go to $OUT. Usage: PHASE=... bench/serving_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
CKPT=${E4KV_BENCH_CKPT:-/tmp/e4kv_q4e}
B=build-gpu90
{
  echo "date: $(date -u +%FT%TZ)"
  if [ -f COMMIT ]; then echo "commit: $(cat COMMIT) (snapshot)"; else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty)"; fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} | tee -a "$OUT/env.txt"

t0=$(date +%s)
if [ ! -d $B ] && [ -f out/gpubin.tar.xz ]; then
  scripts/gpu_prebuilt.sh unpack
  source scripts/gpu_env.sh
elif [ -f $B/COMMIT ] && [ ! -f $B/build.ninja ]; then
  # Unpacked binaries (scripts/gpu_prebuilt.sh): building here would replace them with ones that
  # lack what the image does not have (cpp-httplib: no `serve`).
  :
elif [ ! -f $B/build.ninja ]; then
  cmake -S . -B $B -G Ninja -DE4KV_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
fi
if [ -f $B/build.ninja ]; then
  cmake --build $B -j "$(nproc)" --target e4kv e4kv_bench_qwen4exp ${EXTRA_TARGETS:-} \
    >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build: $(($(date +%s) - t0)) s"
if [ ! -f "$CKPT/config.json" ]; then
  t0=$(date +%s)
  $B/bench/e4kv_bench_qwen4exp --keep-checkpoint "$CKPT" --checkpoint-only 2>&1 | tail -3
  echo "checkpoint: $(($(date +%s) - t0)) s"
fi

bench() {  # bench NAME LIMIT_S ARGS...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$limit" $B/e4kv bench "$CKPT" --device cuda --kv-scales unit --no-progress \
    --out "$OUT/$name" ${BENCH_FLAGS:-} "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $(($(date +%s) - t0)) s"
  cat "$OUT/$name.log"
}

case "${PHASE:-setup}" in
  setup) ;;
  matrix)
    bench "matrix${TAG:-}" "${LIMIT:-520}" --kv-cache-dtype fp16,fp8_e4m3 \
      --kv-cache-memory-bytes "${KV_BYTES:-8200000000}" --concurrency "${CONCURRENCY:-1,4,8}" \
      --context "${CONTEXT:-1k,16k}" --output-tokens 256 --repeats "${REPEATS:-1}" \
      --max-model-len "${MAX_MODEL_LEN:-16640}" ;;
  workload)
    for dt in ${WL_DTYPES:-fp8_e4m3 fp16}; do
      bench "workload_$dt" "${LIMIT:-280}" --kv-cache-dtype "$dt" \
        --kv-cache-memory-bytes "${WL_BYTES:-11700000000}" --concurrency 64 --context 16k \
        --output-tokens 256 --repeats 1
    done ;;
  serve)
    $B/e4kv serve "$CKPT" --device cuda --kv-scales unit --kv-cache-dtype fp8_e4m3 --port 0 \
      --num-gpu-blocks-override "${SERVE_BLOCKS:-96}" --max-num-seqs 64 ${SERVE_FLAGS:-} >"$OUT/serve.out" \
      2>"$OUT/serve.err" &
    pid=$!
    port=""
    for _ in $(seq 600); do
      port=$(grep -o 'listening on http://[0-9.]*:[0-9]*' "$OUT/serve.out" 2>/dev/null | sed 's/.*://')
      [ -n "$port" ] && break
      kill -0 $pid 2>/dev/null || break
      sleep 0.5
    done
    if [ -z "$port" ]; then echo "serve did not start"; cat "$OUT/serve.err"; kill $pid; exit 1; fi
    python3 bench/serve_load.py --url "http://127.0.0.1:$port" --clients 64 --wait-ready 300 \
      --seconds "${LOAD_SECONDS:-60}" --token-prompts 100,1000 --prompt-words 64,512 \
      --max-tokens 16,256 --stream-logprobs | tee "$OUT/serve_load.json"
    echo "load rc=${PIPESTATUS[0]}"
    kill -TERM $pid
    wait $pid
    echo "serve exit code $?"
    tail -5 "$OUT/serve.err" ;;
  *) echo "PHASE=${PHASE}: expected setup, matrix, workload or serve" >&2; exit 2 ;;
esac
