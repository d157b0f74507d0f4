#!/usr/bin/env bash
# The main job on the embedded default, models/tiny-qwen4exp: a small Qwen4Exp model trained for
# this repository (QSA + GatedDeltaNet layers, MoE, hyper-connections, PLE; its card says how),
# through the whole K/V scale workflow on real forwards:
#   calibrate (two shards, FP16-KV forwards over data/tiny/calibration.jsonl) -> summarize (report
#   with SVG) -> overlay (a derived checkpoint beside the untouched model) -> verify (the start-up
#   gate) -> capacity -> generate with an FP16 and an E4M3 cache -> compare (FP16 vs calibrated E4M3
#   vs unit-scale E4M3 on held-out documents and passkey prompts). Subsets keep it near a minute
#   on two cores; docs/quality.md has the full runs.
set -euo pipefail
BUILD=${1:-build}
E4KV="$BUILD/e4kv"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODEL="$ROOT/models/tiny-qwen4exp"
DATA="$ROOT/data/tiny"
WORK="$BUILD/demo"
rm -rf "$WORK"
mkdir -p "$WORK"
DERIVED="$WORK/tiny-qwen4exp-kvscales"
PROMPT="In Python, a list comprehension"

step() { printf '\n== %s\n' "$*"; }

step "1. the embedded model (trained; read-only: every output goes to $WORK)"
"$E4KV" inspect "$MODEL" | sed -n '1,12p'

step "2. the model has no K/V scales: fp8_e4m3 start-up is refused (fail closed)"
if "$E4KV" verify "$MODEL"; then
  echo "demo: expected the gate to refuse the model without scales" >&2
  exit 1
fi

step "3. calibrate: FP16-KV forwards over held-out documents, in two shards"
for shard in 0/2 1/2; do
  "$E4KV" calibrate "$MODEL" --corpus "$DATA/calibration.jsonl" --out "$WORK/stats" \
    --shard "$shard" --max-documents 8 --generate-tokens 8 --no-progress
done

step "4. summarize the shards into scales.json and a report (JSON, Markdown, SVG)"
"$E4KV" summarize "$WORK/stats" --policy absmax --out "$WORK/scales.json" --report "$WORK/report"
sed -n '1,20p' "$WORK/report/report.md"

step "5. overlay: a derived checkpoint beside the untouched model"
"$E4KV" overlay "$MODEL" --scales "$WORK/scales.json" --out "$DERIVED"

step "6. verify: provenance against the model and the start-up gate"
"$E4KV" verify "$DERIVED"

step "7. KV cache capacity at 1 GiB, FP16 vs E4M3"
"$E4KV" capacity "$DERIVED" --budget-gib 1 --request-tokens 8192

step "8. generate: FP16 cache, then E4M3 through the gate"
"$E4KV" generate "$DERIVED" --prompt "$PROMPT" --max-tokens 40 --repetition-penalty 1.3
echo
"$E4KV" generate "$DERIVED" --prompt "$PROMPT" --max-tokens 40 --repetition-penalty 1.3 \
  --kv-cache-dtype fp8_e4m3
echo

step "9. compare FP16 KV, calibrated E4M3 KV and unit-scale E4M3 (the negative control)"
head -n 4 "$DATA/eval.jsonl" >"$WORK/eval4.jsonl"
"$E4KV" compare "$DERIVED" --prompts "$WORK/eval4.jsonl" --max-tokens 16 --with-unit-control \
  --task passkey --context 1k --depths 0,50,100 --out "$WORK/compare"

printf '\ndemo: done; files in %s (report: %s, compare: %s)\n' "$WORK" \
  "$WORK/report/report.svg" "$WORK/compare/compare.md"
