#!/usr/bin/env bash
# GPU benchmarks in one go (called by scripts/gpu_run.sh): e4kv decode attention and the PyTorch
# SDPA peer on the same shapes, then the CPU micro-benchmarks. Usage: bench/gpu_bench.sh BUILD OUT
set -uo pipefail
BUILD=$1
OUT=$2
status=0
"$BUILD/bench/e4kv_bench_decode_attention" "$OUT/decode_attention.json" || status=1
"$BUILD/bench/e4kv_bench_cache_write" "$OUT/cache_write.json" || status=1
"$BUILD/bench/e4kv_bench_qsa_indexer" "$OUT/qsa_indexer.json" || status=1
"$BUILD/bench/e4kv_bench_prefill_attention" "$OUT/prefill_attention.json" || status=1
"$BUILD/bench/e4kv_bench_qsa_decode" "$OUT/qsa_decode.json" || status=1
"$BUILD/bench/e4kv_bench_quant_linear" "$OUT/quant_linear.json" || status=1
"$BUILD/bench/e4kv_bench_model_decode" "$OUT/model_decode.json" || status=1
python3 bench/peer_sdpa.py "$OUT/peer_sdpa.json" || status=1
if [ -x "$BUILD/bench/e4kv_bench" ]; then
  "$BUILD/bench/e4kv_bench" --benchmark_min_time=0.2 --benchmark_format=console \
    --benchmark_out="$OUT/cpu_bench.json" --benchmark_out_format=json || status=1
fi
exit $status
