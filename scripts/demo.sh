#!/usr/bin/env bash
# The main job on the embedded default. Until the engine lands this is the checkpoint pipeline: make
# a small Qwen4Exp-shaped checkpoint (3 shards, QSA every 4th layer) and inspect it.
set -euo pipefail
BUILD=${1:-build}
E4KV="$BUILD/e4kv"
WORK="$BUILD/demo"
rm -rf "$WORK"
mkdir -p "$WORK"
"$E4KV" synth-checkpoint "$WORK/qwen4exp-tiny" --family qwen4exp --layers 8 --shards 3
echo
"$E4KV" inspect "$WORK/qwen4exp-tiny"
