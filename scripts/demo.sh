#!/usr/bin/env bash
# The main job on the embedded default: the whole K/V scale workflow on real forwards of a small
# Qwen4Exp checkpoint (8 layers, QSA every 4th layer, MoE, hyper-connections, PLE; 3 shards; a
# ChatML chat template) that e4kv generates with RANDOM weights until the trained model of issue 24
# lands:
#   calibrate (two shards, FP16-KV forwards over data/demo/calibration.jsonl) -> summarize (report
#   with SVG) -> overlay -> verify (the start-up gate) -> inspect -> capacity -> generate with an
#   E4M3 cache -> compare (FP16 vs calibrated E4M3 vs unit-scale E4M3, passkey prompts).
# Then the dense runtime runs the same workflow on a Llama-shaped checkpoint.
set -euo pipefail
BUILD=${1:-build}
E4KV="$BUILD/e4kv"
DATA="$(cd "$(dirname "$0")/.." && pwd)/data/demo"
WORK="$BUILD/demo"
rm -rf "$WORK"
mkdir -p "$WORK"
BASE="$WORK/qwen4exp-tiny"
DERIVED="$WORK/qwen4exp-tiny-kvscales"

step() { printf '\n== %s\n' "$*"; }

step "1. make a checkpoint (RANDOM weights: the figures below show the workflow, not a model's quality)"
"$E4KV" synth-checkpoint "$BASE" --family qwen4exp --layers 8 --shards 3

step "2. the base has no K/V scales: fp8_e4m3 start-up is refused (fail closed)"
if "$E4KV" verify "$BASE"; then
  echo "demo: expected the gate to refuse the base checkpoint" >&2
  exit 1
fi

step "3. calibrate: FP16-KV forwards over the corpus, in two shards"
for shard in 0/2 1/2; do
  "$E4KV" calibrate "$BASE" --corpus "$DATA/calibration.jsonl" --out "$WORK/stats" \
    --shard "$shard" --generate-tokens 8
done

step "4. summarize the shards into scales.json and a report (JSON, Markdown, SVG)"
"$E4KV" summarize "$WORK/stats" --policy absmax --out "$WORK/scales.json" --report "$WORK/report"
sed -n '1,20p' "$WORK/report/report.md"

step "5. overlay: a derived checkpoint beside the untouched base"
"$E4KV" overlay "$BASE" --scales "$WORK/scales.json" --out "$DERIVED"

step "6. verify: provenance against the base and the start-up gate"
"$E4KV" verify "$DERIVED"

step "7. inspect the derived checkpoint"
"$E4KV" inspect "$DERIVED"

step "8. KV cache capacity at 1 GiB, FP16 vs E4M3"
"$E4KV" capacity "$DERIVED" --budget-gib 1 --request-tokens 4096

step "9. generate on the overlay: FP16 cache, then E4M3 through the gate"
"$E4KV" generate "$DERIVED" --prompt "The cache" --max-tokens 12 --json
"$E4KV" generate "$DERIVED" --prompt "The cache" --max-tokens 12 --kv-cache-dtype fp8_e4m3 --json

step "10. compare FP16 KV, calibrated E4M3 KV and unit-scale E4M3 (the negative control)"
"$E4KV" compare "$DERIVED" --prompts "$DATA/prompts.jsonl" --max-tokens 16 --with-unit-control \
  --task passkey --context 512 --depths 0,50,100 --out "$WORK/compare"

step "11. the dense runtime: a Llama-shaped checkpoint (RANDOM weights), the same workflow"
DENSE="$WORK/llama-tiny"
"$E4KV" synth-checkpoint "$DENSE" --family llama --head-dim 64
"$E4KV" calibrate "$DENSE" --corpus "$DATA/calibration.jsonl" --out "$WORK/dense-stats" \
  --max-documents 6
"$E4KV" summarize "$WORK/dense-stats" --out "$WORK/dense-scales.json" --report "$WORK/dense-report"
"$E4KV" overlay "$DENSE" --scales "$WORK/dense-scales.json" --out "$DENSE-kvscales"
"$E4KV" generate "$DENSE-kvscales" --prompt "The cache" --max-tokens 12 --kv-cache-dtype fp8_e4m3 \
  --json

printf '\ndemo: done; files in %s (report: %s, compare: %s)\n' "$WORK" \
  "$WORK/report/report.svg" "$WORK/compare/compare.md"
