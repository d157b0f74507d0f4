#!/usr/bin/env bash
# Regenerates the quantized test checkpoints under tests/data/quant/ (README.md there lists them):
# synthetic sources from `e4kv synth-checkpoint`, quantized and dequantized by
# scripts/quantize_checkpoint.py. The output is the same bytes on every run.
#
#   scripts/make_quant_test_data.sh [--e4kv PATH] [--out DIR] [--only CASE] [--check]
#
# --check regenerates into a temporary directory and compares with the checked-in files (exit 1
# on any difference, 77 when no python3 with numpy is found).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
e4kv="$root/build-cpu/e4kv"
out="$root/tests/data/quant"
only=""
check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --e4kv) e4kv="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --check) check=1; shift ;;
    *) echo "make_quant_test_data.sh: error: unknown argument $1" >&2; exit 2 ;;
  esac
done

# The first python3 that has numpy (a pyenv or venv python3 on PATH may lack it).
python=""
for candidate in "${PYTHON:-}" python3 /usr/bin/python3; do
  if [ -n "$candidate" ] && "$candidate" -c "import numpy" 2>/dev/null; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "SKIP: no python3 with numpy: install python3-numpy (scripts/setup.sh does)"
  exit 77
fi
if [ ! -x "$e4kv" ]; then
  echo "make_quant_test_data.sh: error: $e4kv is not an executable; build e4kv or pass --e4kv" >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
expected="$out"
if [ "$check" = 1 ]; then
  out="$work/regenerated"
fi

# name | synth-checkpoint flags | quantize_checkpoint.py flags. Attention heads of 64: the CUDA
# attention kernels' smallest (tests/cuda/test_quantized_checkpoints_cuda.cpp runs every case);
# blocks of 48 leave partial FP8 blocks in both dimensions of the Llama case.
cases=(
  "llama_awq_g128|--family llama --hidden-size 128 --heads 4 --kv-heads 2 --head-dim 64 --layers 1 --vocab 256 --tie-embeddings|--format awq --group-size 128"
  "llama_awq_g64_sym|--family llama --hidden-size 64 --heads 4 --kv-heads 2 --head-dim 64 --layers 1 --vocab 256 --tie-embeddings|--format awq --group-size 64 --no-zero-point"
  "llama_nvfp4|--family llama --hidden-size 64 --heads 4 --kv-heads 2 --head-dim 64 --layers 1 --vocab 256 --tie-embeddings|--format nvfp4"
  "llama_fp8_block|--family llama --hidden-size 64 --heads 4 --kv-heads 2 --head-dim 64 --layers 1 --vocab 256 --tie-embeddings|--format fp8-block --block 48"
  "qwen4exp_awq_g32|--family qwen4exp --layers 4 --hidden-size 32 --head-dim 64 --vocab 256|--format awq --group-size 32"
  "qwen4exp_nvfp4|--family qwen4exp --layers 4 --hidden-size 16 --head-dim 64 --vocab 256|--format nvfp4"
  "qwen4exp_fp8_block|--family qwen4exp --layers 4 --hidden-size 16 --head-dim 64 --vocab 256|--format fp8-block --block 32"
)

found=0
for spec in "${cases[@]}"; do
  IFS='|' read -r name synth_flags quant_flags <<<"$spec"
  if [ -n "$only" ] && [ "$only" != "$name" ]; then continue; fi
  found=1
  src="$work/src_$name"
  # shellcheck disable=SC2086  # the flag lists are word lists
  "$e4kv" synth-checkpoint "$src" $synth_flags >/dev/null
  rm -rf "${out:?}/$name"
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086
  "$python" "$root/scripts/quantize_checkpoint.py" "$src" "$out/$name/quantized" $quant_flags \
    --dequantized-out "$out/$name/dequantized"
  if [ "$check" = 1 ]; then
    # reference.json (transformers' logits, scripts/hf_reference_quant.py) is not regenerated here.
    if ! diff -r -x reference.json "$expected/$name" "$out/$name" >/dev/null; then
      echo "make_quant_test_data.sh: $name differs from $expected/$name:" >&2
      diff -r -x reference.json "$expected/$name" "$out/$name" >&2 || true
      exit 1
    fi
    echo "$name: the same bytes as $expected/$name"
  else
    echo "$name: $(du -sk "$out/$name" | cut -f1) KiB"
  fi
done
if [ "$found" = 0 ]; then
  echo "make_quant_test_data.sh: error: no case named $only" >&2
  exit 2
fi
