#!/usr/bin/env bash
# The second device call of a round (after scripts/gpu_round_one_call.sh, on the same warm
# machine or a fresh one): the work that needs its own checkpoints, each part under its own cap,
# every output packed into $OUT/all.tgz at the end (a call brings back few files).
#   PART=peers      bench/decode_peers_gpu.sh: the dense Llama-3-8B shape, e4kv and gpt-fast side
#                   by side at batch 1, 4096, and e4kv alone at 8 x 32768 (FP16 against E4M3;
#                   CELLS / PEER_CELLS to change); then, time allowing, that shape's batch-1
#                   step kernel by kernel (bench/profile_step_gpu.sh BENCH=dense)
#   PART=prefill    e4kv_bench_qwen4exp with E4KV_BENCH_PREFILL_PROFILE: where a long prompt's
#                   prefill goes, by section (PREFILL_CONTEXT, default 16384; the benchmark
#                   checkpoint in /tmp/e4kv_q4e, written when absent)
#   PART=published  e4kv_bench_qwen4exp --published --quant awq-g32 (51.6 GB: AWQ routed experts,
#                   the rest FP16) written to /dev/shm and run at batch 1, 4096, FP16 cache
#                   (PUB_BATCHES, PUB_CONTEXTS, PUB_CACHE: fp16, e4m3 or both)
#   PART=all        peers, then published, then prefill, while time is left (the default)
# Environment: TOTAL_SECONDS (default 570).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((${TOTAL_SECONDS:-570} - ($(date +%s) - T0))); }
B=build-gpu90
[ -x $B/bench/e4kv_bench_qwen4exp ] || scripts/gpu_prebuilt.sh unpack >/dev/null || exit 1
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
PART=${PART:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/round_two_env.txt"
echo "binaries $(cat $B/COMMIT)" | tee -a "$OUT/round_two_env.txt"

if [ "$PART" = all ] || [ "$PART" = peers ]; then
  CELLS=${CELLS:-1x4096,8x32768} PEER_CELLS=${PEER_CELLS:-1x4096} LIMIT_E4KV=${LIMIT_E4KV:-240} \
    LIMIT_PEER=${LIMIT_PEER:-150} bench/decode_peers_gpu.sh >"$OUT/peers.txt" 2>&1
  echo "=== peers rc=$? at $(($(date +%s) - T0)) s"
  tail -30 "$OUT/peers.txt"
  if [ "$(left)" -gt 300 ]; then  # the dense step kernel by kernel, on the checkpoint just written
    BENCH=dense LIMIT=120 bench/profile_step_gpu.sh >"$OUT/dense_profile.txt" 2>&1
    echo "=== dense profile at $(($(date +%s) - T0)) s"
    head -25 "$OUT/step_kernels.txt" 2>/dev/null
  fi
  rm -rf "${E4KV_DENSE_CKPT:-/tmp/e4kv_dense8b}"  # its disk for the next part
fi

if { [ "$PART" = all ] || [ "$PART" = published ]; } && [ "$(left)" -gt 120 ]; then
  t=$(date +%s)
  free -g | tee "$OUT/published_mem.txt"
  df -h /dev/shm | tee -a "$OUT/published_mem.txt"
  timeout $(($(left) - 40)) $B/bench/e4kv_bench_qwen4exp "$OUT/published_awq.json" --published \
    --quant awq-g32 --keep-checkpoint /dev/shm/e4kv_q4e_awq --batches "${PUB_BATCHES:-1}" \
    --contexts "${PUB_CONTEXTS:-4096}" --cache "${PUB_CACHE:-fp16}" >"$OUT/published_awq.log" 2>&1
  echo "=== published rc=$? $(($(date +%s) - t)) s"
  grep -v "^    " "$OUT/published_awq.log" | tail -30
  grep -E "in place" "$OUT/published_awq.log" | tail -12
  rm -rf /dev/shm/e4kv_q4e_awq
fi

if { [ "$PART" = all ] || [ "$PART" = prefill ]; } && [ "$(left)" -gt 90 ]; then
  t=$(date +%s)
  E4KV_BENCH_PREFILL_PROFILE=1 timeout $(($(left) - 20)) $B/bench/e4kv_bench_qwen4exp \
    "$OUT/prefill_profile.json" --keep-checkpoint /tmp/e4kv_q4e --batches 1 \
    --contexts "${PREFILL_CONTEXT:-16384}" --cache fp16 >"$OUT/prefill_profile.log" 2>&1
  echo "=== prefill profile rc=$? $(($(date +%s) - t)) s"
  grep -E "prefill|tok" "$OUT/prefill_profile.log" | tail -6
  sed -n '/prefill, last chunk/,$p' "$OUT/prefill_profile.log"
fi
# Only the archive stays in $OUT: a call brings back its first few files, by name.
scripts/gpu_pack_out.sh "$OUT"
ls "$OUT"
