#!/usr/bin/env bash
# Binaries built here for the GPU machine, so that a device call spends its minutes running rather
# than compiling (a full sm_90 build there takes several of them).
#   scripts/gpu_prebuilt.sh pack     here: build e4kv, the benchmark model writer, the CUDA tests and
#                                    the host benchmarks for sm_90 in build-gpu90 (no ICU: the GPU
#                                    image has another version), strip them and pack them with
#                                    Google Benchmark's library into out/gpubin.tar.xz (ignored by
#                                    git; carry it with .deps.tar.xz)
#   scripts/gpu_prebuilt.sh unpack   there: unpack into build-gpu90 and link the source path the
#                                    tests were compiled with (their data files) to this tree
#   scripts/gpu_prebuilt.sh tests    there: unpack when needed, run the CUDA tests (also with the
#                                    software E4M3 decoder forced) and the engine's host-cost
#                                    benchmarks; logs in $OUT [extra gtest args]
# bench/serving_gpu.sh unpacks by itself when the pack is there and build-gpu90 is not.
set -euo pipefail
cd "$(dirname "$0")/.."
B=build-gpu90
PACK=out/gpubin.tar.xz
BINS=(e4kv bench/e4kv_bench_qwen4exp tests/e4kv_cuda_tests bench/e4kv_bench bench/e4kv_bench_quant_linear
  bench/e4kv_bench_dense_decode)

case "${1:-}" in
  pack)
    if [ ! -f $B/build.ninja ]; then
      cmake -S . -B $B -G Ninja -DE4KV_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DE4KV_WERROR=ON -DE4KV_BUILD_BENCH=ON -DE4KV_USE_ICU=OFF -DCMAKE_BUILD_TYPE=Release
    fi
    cmake --build $B -j "$(nproc)" --target e4kv e4kv_bench_qwen4exp e4kv_cuda_tests e4kv_bench \
      e4kv_bench_quant_linear e4kv_bench_dense_decode
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    for b in "${BINS[@]}"; do
      mkdir -p "$stage/$(dirname "$b")"
      strip -o "$stage/$b" "$B/$b"
    done
    mkdir -p "$stage/lib"
    # Google Benchmark, cpp-httplib and brotli (cpp-httplib's) are not in the GPU image.
    for l in libbenchmark.so.1debian libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 \
      libbrotlicommon.so.1; do
      cp -L "$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')" "$stage/lib/"
    done
    { git rev-parse --short HEAD; git diff --quiet || echo dirty; } | paste -sd+ >"$stage/COMMIT"
    pwd >"$stage/SOURCE_DIR"
    mkdir -p out
    # xz -9e: its 64 MiB dictionary spans the binaries, whose device code is mostly the same
    # library (a third of the default level's size).
    XZ_OPT=-9e tar -C "$stage" -cJf "$PACK" .
    ls -la "$PACK"
    ;;
  unpack)
    [ -f "$PACK" ] || { echo "$PACK: not here; run 'scripts/gpu_prebuilt.sh pack' first" >&2; exit 1; }
    mkdir -p $B
    tar -C $B -xJf "$PACK"
    src=$(cat $B/SOURCE_DIR)
    if [ "$src" != "$PWD" ]; then
      if [ -e "$src" ] && [ ! -L "$src" ]; then
        echo "$src exists and is not a link: the tests' data paths would not reach this tree" >&2
        exit 1
      fi
      mkdir -p "$(dirname "$src")"
      ln -sfn "$PWD" "$src"
    fi
    echo "prebuilt at $(cat $B/COMMIT), source path $src"
    ;;
  tests)
    [ -x $B/tests/e4kv_cuda_tests ] || "$0" unpack
    OUT=${OUT:-$PWD/out}
    mkdir -p "$OUT"
    # shellcheck source=scripts/gpu_env.sh
    source scripts/gpu_env.sh
    shift
    status=0
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
    echo "prebuilt: $(cat $B/COMMIT)" | tee -a "$OUT/env.txt"
    run() {  # run NAME CMD...
      local name=$1; shift
      local t0; t0=$(date +%s)
      if "$@" >"$OUT/$name.log" 2>&1; then echo "=== $name ok $(($(date +%s) - t0)) s"; else
        status=1; echo "!!! $name failed $(($(date +%s) - t0)) s"; grep -E '^\[  FAILED|Failure|error' \
          "$OUT/$name.log" | head -40; fi
      tail -3 "$OUT/$name.log"
    }
    run cuda_tests $B/tests/e4kv_cuda_tests "$@"
    E4KV_FORCE_SOFTWARE_E4M3=1 run cuda_tests_forced_software $B/tests/e4kv_cuda_tests "$@"
    run host_cost $B/bench/e4kv_bench \
      --benchmark_filter='EngineDecodeStepHost|StepContextBuild|OutputProcessorStep' \
      --benchmark_out="$OUT/host_cost.json" --benchmark_out_format=json
    exit $status
    ;;
  *) echo "usage: scripts/gpu_prebuilt.sh pack|unpack|tests" >&2; exit 2 ;;
esac
