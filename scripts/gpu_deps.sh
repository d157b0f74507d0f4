#!/usr/bin/env bash
# Run here (a Debian machine), not on the GPU machine: downloads the Debian packages the build
# needs that the GPU image lacks (PCRE2, OpenBLAS and its Fortran runtime, pkgconf), unpacks them
# into .deps/root (ignored by git), drops what the build does not use and replaces symlinks by
# files (about 40 MB), then packs it into .deps.tar.xz (about 6 MB; ignored too): carry that to the
# GPU machine, where scripts/gpu_env.sh unpacks it (the working tree that travels is limited).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs .deps/root
(cd .deps/debs && apt-get download libpcre2-dev libpcre2-8-0 libopenblas-dev \
  libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0 pkgconf pkgconf-bin \
  libpkgconf3)
for f in .deps/debs/*.deb; do dpkg -x "$f" .deps/root; done
rm -rf .deps/debs .deps/root/usr/share
find .deps/root -name '*.a' -delete
lib=.deps/root/usr/lib/x86_64-linux-gnu
rm -f "$lib"/openblas-pthread/liblapack.so* "$lib"/openblas-pthread/libblas.so* \
  "$lib"/libpcre2-16* "$lib"/libpcre2-32* "$lib"/libpcre2-posix*
# Keep one copy per library (its soname); linker names become linker scripts.
for l in $(find .deps/root -type l); do t=$(readlink -f "$l"); rm "$l"; cp "$t" "$l"; done
rm -f "$lib"/libgfortran.so.5.* "$lib"/libquadmath.so.0.* "$lib"/libpcre2-8.so.0.* \
  "$lib"/libpkgconf.so.3.* "$lib"/openblas-pthread/libopenblasp-r*.so
echo "INPUT(libpcre2-8.so.0)" >"$lib/libpcre2-8.so"
echo "INPUT(libopenblas.so.0)" >"$lib/openblas-pthread/libopenblas.so"
du -sh .deps
tar -C .deps -cJf .deps.tar.xz root
ls -la .deps.tar.xz
