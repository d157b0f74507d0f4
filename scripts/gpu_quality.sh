#!/usr/bin/env bash
# The quality suite's long version on the GPU: the embedded model calibrated on its whole
# calibration corpus, compare on the whole evaluation set and passkey prompts at 1K-8K.
# Usage: scripts/gpu_quality.sh E4KV MODEL DATA OUT (docs/quality.md)
set -euo pipefail
E4KV=$1 MODEL=$2 DATA=$3 OUT=$4
W=$(mktemp -d)
mkdir -p "$OUT"
"$E4KV" calibrate "$MODEL" --corpus "$DATA/calibration.jsonl" --out "$W/stats" --device cuda --no-progress
"$E4KV" summarize "$W/stats" --policy absmax --out "$OUT/scales.json" --report "$OUT/report"
"$E4KV" overlay "$MODEL" --scales "$OUT/scales.json" --out "$W/derived"
"$E4KV" verify "$W/derived"
"$E4KV" compare "$W/derived" --device cuda --prompts "$DATA/eval.jsonl" --max-tokens 16 \
  --with-unit-control --isolated --task passkey --context 1k,2k,4k,8k --depths 0,50,100 --passkey-trials 3 \
  --max-model-len 8320 --out "$OUT/compare"
