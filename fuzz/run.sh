#!/usr/bin/env bash
# Runs the fuzzers for a bounded time: fuzz/run.sh BUILD_DIR SECONDS
# BUILD_DIR is the configured and built fuzz project (see fuzz/CMakeLists.txt). SECONDS is the total,
# split evenly between the two targets (the safetensors header; config.json / generation_config.json).
# Writes each target's seed corpus and dictionary into BUILD_DIR, then fuzzes; exits non-zero on any
# crash, leak, timeout or sanitizer report. Crash inputs land in BUILD_DIR/artifacts/.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
build=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
for exe in safetensors_header_fuzz safetensors_seed_writer config_json_fuzz; do
  if [ ! -x "$build/$exe" ]; then
    echo "fuzz/run.sh: $build/$exe not found; build the fuzz project first (make fuzz-smoke)" >&2
    exit 2
  fi
done
per_target=$((seconds / 2))
if [ "$per_target" -lt 1 ]; then per_target=1; fi

artifacts=$build/artifacts
mkdir -p "$artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# run_fuzzer NAME CORPUS DICT: fuzzes for $per_target seconds; the log is BUILD_DIR/NAME.log.
run_fuzzer() {
  local name=$1 corpus=$2 dict=$3
  local log=$build/$name.log
  local status=0
  "$build/$name" -max_total_time="$per_target" -rss_limit_mb=2048 -timeout=10 \
    -print_final_stats=1 -dict="$dict" -artifact_prefix="$artifacts/$name-" "$corpus" \
    > "$log" 2>&1 || status=$?
  local runs
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ "$status" -ne 0 ] ||
    grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error:|SUMMARY: ' "$log"; then
    tail -n 60 "$log" >&2
    echo "fuzz/run.sh: $name FAILED (exit $status); full log in $log, inputs in $artifacts/" >&2
    return 1
  fi
  echo "fuzz/run.sh: $name ok, ${runs:-?} executions in ${per_target}s, corpus" \
    "$(ls "$corpus" | wc -l) files (log: $log)"
}

# ---- safetensors header ----
st_corpus=$build/corpus
st_dict=$build/safetensors.dict
mkdir -p "$st_corpus"
"$build/safetensors_seed_writer" "$st_corpus"
# Tokens of the format, so mutations reach the layout checks instead of dying in the JSON parser.
printf '%s\n' \
  'kw_dtype="\"dtype\""' 'kw_shape="\"shape\""' 'kw_offsets="\"data_offsets\""' \
  'kw_meta="\"__metadata__\""' 'dt_f64="\"F64\""' 'dt_f32="\"F32\""' 'dt_f16="\"F16\""' \
  'dt_bf16="\"BF16\""' 'dt_e4m3="\"F8_E4M3\""' 'dt_e5m2="\"F8_E5M2\""' 'dt_i64="\"I64\""' \
  'dt_i32="\"I32\""' 'dt_i16="\"I16\""' 'dt_i8="\"I8\""' 'dt_u64="\"U64\""' 'dt_u32="\"U32\""' \
  'dt_u16="\"U16\""' 'dt_u8="\"U8\""' 'dt_bool="\"BOOL\""' 'big="18446744073709551615"' \
  'i64max="9223372036854775807"' 'neg="-1"' 'utf8="\xc3\xa9"' 'esc="\\u0000"' > "$st_dict"

# ---- config.json / generation_config.json ----
# Seeds: the reference models' configs (tests/data/hf) and hand-written ones (fuzz/seeds/config:
# a Qwen4Exp text_config with indexer_* fields and layer_types, sliding windows, per-layer-type
# RoPE, v4 rope_scaling, sizes at the limits).
cfg_corpus=$build/corpus-config
cfg_dict=$build/config.dict
mkdir -p "$cfg_corpus"
cp "$root"/fuzz/seeds/config/*.json "$cfg_corpus"/
for dir in "$root"/tests/data/hf/*/; do
  name=$(basename "$dir")
  for file in config.json generation_config.json; do
    if [ -f "$dir/$file" ]; then cp "$dir/$file" "$cfg_corpus/hf_${name}_$file"; fi
  done
done
keys=(architectures model_type text_config vocab_size hidden_size intermediate_size
  num_hidden_layers num_attention_heads num_key_value_heads head_dim rms_norm_eps
  max_position_embeddings tie_word_embeddings attention_bias dtype torch_dtype sliding_window
  use_sliding_window max_window_layers layer_types full_attention_interval rope_theta rope_scaling
  rope_parameters rope_type type factor low_freq_factor high_freq_factor
  original_max_position_embeddings beta_fast beta_slow attention_factor mscale mscale_all_dim
  truncate partial_rotary_factor full_attention indexer_n_heads indexer_kv_heads indexer_head_dim
  indexer_budget indexer_compress_ratio eos_token_id full_attention sliding_attention
  linear_attention qwen_sparse_attention qwen4_exp_text default linear dynamic llama3 yarn)
{
  for key in "${keys[@]}"; do printf 'k_%s="\\"%s\\""\n' "$key" "$key"; done
  printf '%s\n' 'null="null"' 'true="true"' 'false="false"' 'big="18446744073709551615"' \
    'i64max="9223372036854775807"' 'i32max="2147483647"' 'i32over="2147483648"' 'neg="-1"' \
    'float="1e308"' 'half="0.5"' 'zero="0"'
} > "$cfg_dict"

failed=0
run_fuzzer safetensors_header_fuzz "$st_corpus" "$st_dict" || failed=1
run_fuzzer config_json_fuzz "$cfg_corpus" "$cfg_dict" || failed=1
exit "$failed"
