#!/usr/bin/env bash
# Installs the Debian packages e4kv builds and tests with. Does nothing when they are all present.
set -euo pipefail

packages=(
  cmake ninja-build g++ make pkg-config
  nlohmann-json3-dev libcli11-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev      # the tokenizer's pre-tokenizer regexes
  libopenblas-dev   # the CPU backend's GEMMs
  libicu-dev        # the tokenizer's Unicode normalizers (NFC, ...)
  libcpp-httplib-dev  # `e4kv serve`
  clang libclang-rt-dev  # libFuzzer and sanitizers for the safetensors header fuzzer
  chromium          # the chat page's test (tests/serve_js) drives it headless; no browser download
  python3-numpy     # scripts/quantize_checkpoint.py and its tests (tests/scripts)
)
# tests/serve_js runs on Node.js; Debian's only when no node (e.g. NodeSource's) is installed.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "e4kv setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
