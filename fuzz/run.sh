#!/usr/bin/env bash
# Runs the safetensors header fuzzer for a bounded time: fuzz/run.sh BUILD_DIR SECONDS
# BUILD_DIR is the configured and built fuzz project (see fuzz/CMakeLists.txt). Writes the seed
# corpus and a dictionary into BUILD_DIR, then fuzzes; exits non-zero on any crash, leak, timeout
# or sanitizer report. Crash inputs land in BUILD_DIR/artifacts/.
set -euo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
build=$1
seconds=$2
fuzzer=$build/safetensors_header_fuzz
seed_writer=$build/safetensors_seed_writer
for exe in "$fuzzer" "$seed_writer"; do
  if [ ! -x "$exe" ]; then
    echo "fuzz/run.sh: $exe not found; build the fuzz project first (make fuzz-smoke)" >&2
    exit 2
  fi
done

corpus=$build/corpus
artifacts=$build/artifacts
dict=$build/safetensors.dict
log=$build/fuzz.log
mkdir -p "$corpus" "$artifacts"
"$seed_writer" "$corpus"

# Tokens of the format, so mutations reach the layout checks instead of dying in the JSON parser.
printf '%s\n' \
  'kw_dtype="\"dtype\""' 'kw_shape="\"shape\""' 'kw_offsets="\"data_offsets\""' \
  'kw_meta="\"__metadata__\""' 'dt_f64="\"F64\""' 'dt_f32="\"F32\""' 'dt_f16="\"F16\""' \
  'dt_bf16="\"BF16\""' 'dt_e4m3="\"F8_E4M3\""' 'dt_e5m2="\"F8_E5M2\""' 'dt_i64="\"I64\""' \
  'dt_i32="\"I32\""' 'dt_i16="\"I16\""' 'dt_i8="\"I8\""' 'dt_u64="\"U64\""' 'dt_u32="\"U32\""' \
  'dt_u16="\"U16\""' 'dt_u8="\"U8\""' 'dt_bool="\"BOOL\""' 'big="18446744073709551615"' \
  'i64max="9223372036854775807"' 'neg="-1"' 'utf8="\xc3\xa9"' 'esc="\\u0000"' > "$dict"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

set +e
"$fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  -dict="$dict" -artifact_prefix="$artifacts/" "$corpus" > "$log" 2>&1
status=$?
set -e

runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
if [ "$status" -ne 0 ] ||
  grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|libFuzzer)|runtime error:|SUMMARY: ' "$log"; then
  tail -n 60 "$log" >&2
  echo "fuzz/run.sh: FAILED (exit $status); full log in $log, inputs in $artifacts/" >&2
  exit 1
fi
echo "fuzz/run.sh: ok, ${runs:-?} executions in ${seconds}s, corpus $(ls "$corpus" | wc -l) files (log: $log)"
