#!/usr/bin/env bash
# Packs everything under the given $OUT into $OUT/all.tgz and leaves only that file: a device call
# brings back its first 8 files by name, each at most 16 MiB. Files over 2 MiB (profiler reports,
# large logs) are left out and named, so the archive always fits and the figures come back.
set -uo pipefail
OUT=$1
big=$(find "$OUT" -type f -size +2M ! -name all.tgz)
if [ -n "$big" ]; then
  echo "left out of all.tgz (over 2 MiB):"
  ls -la $big
fi
find "$OUT" -type f -size +2M ! -name all.tgz -delete
tar -C "$OUT" --exclude=all.tgz -czf /tmp/all.tgz . && find "$OUT" -mindepth 1 -delete &&
  mv /tmp/all.tgz "$OUT/all.tgz"
ls -la "$OUT"
