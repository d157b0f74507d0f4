#!/usr/bin/env bash
# Decode steps of the dense Llama-3-8B shape on the GPU machine, e4kv and its gpt-fast peer, in one
# device call or in two (PHASE):
#   PHASE=e4kv  e4kv_bench_dense_decode (eager and step graphs, FP16 and E4M3 caches, CELLS) ->
#               $OUT/dense_decode.json, .log; the checkpoint is written once and kept in
#               $E4KV_DENSE_CKPT (default /tmp/e4kv_dense8b) for later calls on the same machine
#   PHASE=peer  bench/peer_gpt_fast.py for each of PEER_CELLS (BATCHxCONTEXT) ->
#               $OUT/gpt_fast_BATCHxCONTEXT.json, .log; needs peers/gpt-fast
#               (scripts/fetch_peers.sh here; carry peers/gpt-fast)
#   PHASE=all   both, e4kv first (the default)
# The binary comes from the prebuilt pack (scripts/gpu_prebuilt.sh pack; carry out/gpubin.tar.xz)
# or is built here. Each run is under `timeout`: LIMIT_E4KV (default 300 s), LIMIT_PEER (default
# 240 s a cell). CELLS: e4kv's --cells (default 1x4096,8x32768); PEER_CELLS: space-separated
# (default "1x4096 8x32768"); E4KV_FLAGS / PEER_FLAGS: more flags (e.g. PEER_FLAGS=--eager).
# Usage: PHASE=... bench/decode_peers_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh
CKPT=${E4KV_DENSE_CKPT:-/tmp/e4kv_dense8b}
B=build-gpu90
BIN=$B/bench/e4kv_bench_dense_decode
PHASE=${PHASE:-all}
case "$PHASE" in
  all | e4kv | peer) ;;
  *) echo "PHASE=$PHASE: expected all, e4kv or peer" >&2; exit 2 ;;
esac
{
  echo "date: $(date -u +%FT%TZ)"
  if [ -f COMMIT ]; then echo "commit: $(cat COMMIT) (snapshot)"; else
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo +dirty)"; fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} | tee -a "$OUT/env.txt"
status=0

if [ "$PHASE" != peer ]; then
  t0=$(date +%s)
  if [ ! -x $BIN ] && [ -f out/gpubin.tar.xz ]; then
    scripts/gpu_prebuilt.sh unpack
    source scripts/gpu_env.sh
  fi
  if [ ! -x $BIN ]; then
    if [ ! -f $B/build.ninja ]; then
      cmake -S . -B $B -G Ninja -DE4KV_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
    fi
    cmake --build $B -j "$(nproc)" --target e4kv_bench_dense_decode >"$OUT/build.log" 2>&1 ||
      { tail -40 "$OUT/build.log"; exit 1; }
  fi
  echo "build: $(($(date +%s) - t0)) s"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # E4KV_FLAGS is a list of flags
  timeout "${LIMIT_E4KV:-300}" $BIN "$OUT/dense_decode.json" --keep-checkpoint "$CKPT" \
    --cells "${CELLS:-1x4096,8x32768}" ${E4KV_FLAGS:-} >"$OUT/dense_decode.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "=== e4kv_bench_dense_decode rc=$rc $(($(date +%s) - t0)) s"
  cat "$OUT/dense_decode.log"
fi

if [ "$PHASE" != e4kv ]; then
  if [ ! -f peers/gpt-fast/model.py ]; then
    echo "peers/gpt-fast/model.py is missing: run scripts/fetch_peers.sh before the device call" \
      "and carry peers/gpt-fast" >&2
    exit 1
  fi
  for cell in ${PEER_CELLS:-1x4096 8x32768}; do
    batch=${cell%x*}
    context=${cell#*x}
    t0=$(date +%s)
    # shellcheck disable=SC2086  # PEER_FLAGS is a list of flags
    timeout "${LIMIT_PEER:-240}" python3 bench/peer_gpt_fast.py --batch "$batch" --context "$context" \
      --out "$OUT/gpt_fast_$cell.json" ${PEER_FLAGS:-} >"$OUT/gpt_fast_$cell.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "=== gpt-fast $cell rc=$rc $(($(date +%s) - t0)) s"
    tail -5 "$OUT/gpt_fast_$cell.log"
  done
fi
exit $status
