#!/usr/bin/env bash
# The main job on the embedded default: the K/V scale pipeline on a small Qwen4Exp-shaped checkpoint
# that e4kv generates itself (8 layers, QSA every 4th layer, 3 shards).
#
# Until the model runtime lands, the calibration statistics are SYNTHETIC (Gaussian K/V rows with
# outlier channels, rounded to FP16, from `e4kv synth-stats`); every later step is the real one:
# summarize -> overlay -> verify (the start-up gate) -> inspect -> capacity -> generate on the
# overlay with an FP16 and an E4M3 cache. Then the dense runtime does the same on a Llama-shaped
# checkpoint.
set -euo pipefail
BUILD=${1:-build}
E4KV="$BUILD/e4kv"
WORK="$BUILD/demo"
rm -rf "$WORK"
mkdir -p "$WORK"
BASE="$WORK/qwen4exp-tiny"
DERIVED="$WORK/qwen4exp-tiny-kvscales"

step() { printf '\n== %s\n' "$*"; }

step "1. make a checkpoint"
"$E4KV" synth-checkpoint "$BASE" --family qwen4exp --layers 8 --shards 3

step "2. the base has no K/V scales: fp8_e4m3 start-up is refused (fail closed)"
if "$E4KV" verify "$BASE"; then
  echo "demo: expected the gate to refuse the base checkpoint" >&2
  exit 1
fi

step "3. calibration statistics from two shards (synthetic until the runtime exists)"
"$E4KV" synth-stats "$BASE" --out "$WORK/stats-0.jsonl" --shard 0 --seed 1
"$E4KV" synth-stats "$BASE" --out "$WORK/stats-1.jsonl" --shard 1 --seed 2

step "4. summarize into scales.json and a report (JSON, Markdown, SVG)"
"$E4KV" summarize "$WORK/stats-0.jsonl" "$WORK/stats-1.jsonl" --policy absmax \
  --out "$WORK/scales.json" --report "$WORK/report"
sed -n '1,20p' "$WORK/report/report.md"

step "5. overlay: a derived checkpoint beside the untouched base"
"$E4KV" overlay "$BASE" --scales "$WORK/scales.json" --out "$DERIVED"

step "6. verify: provenance against the base and the start-up gate"
"$E4KV" verify "$DERIVED"

step "7. inspect the derived checkpoint"
"$E4KV" inspect "$DERIVED"

step "8. KV cache capacity at 1 GiB, FP16 vs E4M3"
"$E4KV" capacity "$DERIVED" --budget-gib 1 --request-tokens 4096

step "9. the Qwen4Exp runtime on the overlay: FP16 cache, then E4M3 through the gate (random weights)"
"$E4KV" generate "$DERIVED" --prompt "The cache" --max-tokens 12 --json
"$E4KV" generate "$DERIVED" --prompt "The cache" --max-tokens 12 --kv-cache-dtype fp8_e4m3 --json

step "10. the dense runtime: a Llama-shaped checkpoint with random weights and a tokenizer"
DENSE="$WORK/llama-tiny"
"$E4KV" synth-checkpoint "$DENSE" --family llama --head-dim 64 --with-kv-scales
echo "-- FP16 cache"
"$E4KV" generate "$DENSE" --prompt "The cache" --max-tokens 12 --json
echo "-- E4M3 cache, the checkpoint's per-layer scales through the gate (random weights, so the"
echo "   scales are synthetic too)"
"$E4KV" generate "$DENSE" --prompt "The cache" --max-tokens 12 --kv-cache-dtype fp8_e4m3 --json

printf '\ndemo: done; files in %s (report: %s)\n' "$WORK" "$WORK/report/report.svg"
