#!/usr/bin/env bash
# Runs the fuzzers for a bounded time: fuzz/run.sh BUILD_DIR SECONDS
# BUILD_DIR is the configured and built fuzz project (see fuzz/CMakeLists.txt). SECONDS is the total,
# split evenly between the three targets (the safetensors header; config.json /
# generation_config.json; corpus lines, tokenizer.json, statistics lines and scales.json).
# Writes each target's seed corpus and dictionary into BUILD_DIR, first runs each target once on
# its regression inputs (100,000 levels of nesting: too large to keep in a corpus that mutations
# start from), then fuzzes; exits non-zero on any crash, leak, timeout or sanitizer report. Crash
# inputs land in BUILD_DIR/artifacts/.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
build=$1
seconds=$2
root=$(cd "$(dirname "$0")/.." && pwd)
for exe in safetensors_header_fuzz safetensors_seed_writer config_json_fuzz json_readers_fuzz; do
  if [ ! -x "$build/$exe" ]; then
    echo "fuzz/run.sh: $build/$exe not found; build the fuzz project first (make fuzz-smoke)" >&2
    exit 2
  fi
done
per_target=$((seconds / 3))
if [ "$per_target" -lt 1 ]; then per_target=1; fi

artifacts=$build/artifacts
mkdir -p "$artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# nested LEVELS: LEVELS arrays inside one another, "[[[...]]]".
nested() {
  head -c "$1" /dev/zero | tr '\0' '['
  head -c "$1" /dev/zero | tr '\0' ']'
}

# run_regressions NAME DIR: runs NAME once on each file of DIR, whole (libFuzzer does not cut a
# file named on its command line to -max_len); the log is BUILD_DIR/NAME-regressions.log.
run_regressions() {
  local name=$1 dir=$2
  local log=$build/$name-regressions.log
  local status=0
  "$build/$name" -rss_limit_mb=2048 -timeout=10 "$dir"/* > "$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ] ||
    grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error:|SUMMARY: ' "$log"; then
    tail -n 60 "$log" >&2
    echo "fuzz/run.sh: $name FAILED on a regression input in $dir (exit $status); log in $log" >&2
    return 1
  fi
  echo "fuzz/run.sh: $name ok on $(ls "$dir" | wc -l) regression inputs"
}

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
st_regress=$build/regress-safetensors
mkdir -p "$st_corpus" "$st_regress"
"$build/safetensors_seed_writer" "$st_corpus" "$st_regress"
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
cfg_regress=$build/regress-config
mkdir -p "$cfg_corpus" "$cfg_regress"
cp "$root"/fuzz/seeds/config/*.json "$cfg_corpus"/
# Nesting just past the limit (256 levels), in a field the reader reads and as the eos ids;
# 100,000 levels as regression inputs.
{ printf '{"vocab_size": 8, "model_type": '; nested 300; printf '}'; } > "$cfg_corpus/deep_field.json"
{ printf '{"eos_token_id": '; nested 257; printf '}'; } > "$cfg_corpus/deep_eos.json"
{ printf '{"vocab_size": 8, "model_type": '; nested 100000; printf '}'; } \
  > "$cfg_regress/deep_field.json"
{ printf '{"eos_token_id": '; nested 100000; printf '}'; } > "$cfg_regress/deep_eos.json"
nested 100000 > "$cfg_regress/deep_root.json"
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

# ---- corpus lines, tokenizer.json, statistics lines, scales.json ----
# Seeds: fuzz/seeds/json (a corpus with each kind of line, a small tokenizer.json, a statistics file
# of two layers, a scales.json) and the same shapes nested just past the limit.
json_corpus=$build/corpus-json
json_dict=$build/json.dict
json_regress=$build/regress-json
mkdir -p "$json_corpus" "$json_regress"
cp "$root"/fuzz/seeds/json/* "$json_corpus"/
for levels in 257 300; do
  { printf '{"text": "a"}\n{"messages": [{"role": "user", "content": '; nested "$levels"
    printf '}]}\n'; } > "$json_corpus/deep_messages_$levels.jsonl"
  { printf '{"token_ids": '; nested "$levels"; printf '}\n'; } > "$json_corpus/deep_ids_$levels.jsonl"
  { printf '{"version": "1.0", "normalizer": '; nested "$levels"; printf '}'; } \
    > "$json_corpus/deep_tokenizer_$levels.json"
  { printf '{"format": '; nested "$levels"; printf '}\n'; } > "$json_corpus/deep_stats_$levels.jsonl"
done
{ printf '{"messages": [{"role": "user", "content": '; nested 100000; printf '}]}\n'; } \
  > "$json_regress/deep_messages.jsonl"
{ printf '{"token_ids": '; nested 100000; printf '}\n'; } > "$json_regress/deep_ids.jsonl"
{ printf '{"model": '; nested 100000; printf '}'; } > "$json_regress/deep_tokenizer.json"
{ printf '{"format": "e4kv-kv-stats/1", "model": '; nested 100000; printf '}\n'; } \
  > "$json_regress/deep_stats.jsonl"
{ printf '{"format": '; nested 100000; printf ', "scales": {}}'; } > "$json_regress/deep_scales.json"
json_keys=(text token_ids messages role content format model prefix n_layers kv_layers shard tokens
  source histogram min_log2 max_log2 bins_per_octave layer tensor key count nonzero non_finite
  underflow overflow absmax hist scales policy version normalizer pre_tokenizer post_processor
  decoder added_tokens type vocab merges id special byte_fallback ignore_merges unk_token)
{
  for key in "${json_keys[@]}"; do printf 'k_%s="\\"%s\\""\n' "$key" "$key"; done
  printf '%s\n' 'null="null"' 'true="true"' 'false="false"' 'nl="\x0a"' 'open="[["' \
    'stats="\"e4kv-kv-stats/1\""' 'scales="\"e4kv-kv-scales/1\""' 'bpe="\"BPE\""' \
    'bytelevel="\"ByteLevel\""' 'big="18446744073709551615"' 'neg="-1"' 'half="0.5"'
} > "$json_dict"

failed=0
run_regressions safetensors_header_fuzz "$st_regress" || failed=1
run_regressions config_json_fuzz "$cfg_regress" || failed=1
run_regressions json_readers_fuzz "$json_regress" || failed=1
run_fuzzer safetensors_header_fuzz "$st_corpus" "$st_dict" || failed=1
run_fuzzer config_json_fuzz "$cfg_corpus" "$cfg_dict" || failed=1
run_fuzzer json_readers_fuzz "$json_corpus" "$json_dict" || failed=1
exit "$failed"
