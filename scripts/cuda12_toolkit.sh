#!/usr/bin/env bash
# A CUDA 12 toolkit for a V100 (sm_70) build on a Debian machine, without installing anything:
# CUDA 13 (/usr/local/cuda here) cannot target sm_70, and Debian 12 has no CUDA 12. Downloads
# Debian 13's non-free CUDA 12.4 packages (nvidia-cuda-toolkit, its headers from nvidia-cuda-dev,
# libnvvm4, libcudart12, libcu++/cub/thrust headers; about 1 GB, NVIDIA's licence, Debian's
# packaging) with a private apt list, unpacks what a build needs into .cuda12/ (ignored by git;
# about 300 MB: nvcc, ptxas, cuobjdump, headers, cudart, and cuBLAS *link stubs*, so programs built
# with it link but cannot run cuBLAS here), and makes nvcc relocatable. Then:
#   cmake -S . -B build-sm70 -G Ninja -DCMAKE_CUDA_COMPILER=$PWD/.cuda12/usr/bin/nvcc \
#     -DCUDAToolkit_ROOT=$PWD/.cuda12/usr -DCMAKE_CUDA_ARCHITECTURES=70 -DE4KV_WERROR=ON
# For a V100 that runs, use NVIDIA's CUDA 12.x installer there instead (real cuBLAS).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=$PWD/.cuda12
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs"
echo "deb http://deb.debian.org/debian trixie main contrib non-free" >"$WORK/sources.list"
APT=(-o Dir::Etc::sourcelist="$WORK/sources.list" -o Dir::Etc::sourceparts=/dev/null
     -o Dir::State::Lists="$WORK/lists" -o Dir::Cache="$WORK/cache")
apt-get "${APT[@]}" update >/dev/null
(cd "$WORK/debs" && apt-get "${APT[@]}" download nvidia-cuda-toolkit nvidia-cuda-dev libnvvm4 \
  libcudart12 libcu++-dev libcub-dev libthrust-dev)
rm -rf "$DEST" && mkdir -p "$DEST"
for deb in "$WORK"/debs/*.deb; do
  case "$(basename "$deb")" in
    nvidia-cuda-dev_*)  # headers, cudart, the device runtime and the link stubs only
      dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$DEST" --wildcards './usr/include/*' \
        './usr/lib/x86_64-linux-gnu/libcudart*' './usr/lib/x86_64-linux-gnu/libcudadevrt*' \
        './usr/lib/x86_64-linux-gnu/libculibos*' './usr/lib/x86_64-linux-gnu/stubs/*' \
        './usr/lib/x86_64-linux-gnu/libcublas.so' './usr/lib/x86_64-linux-gnu/libcublasLt.so' ;;
    *) dpkg -x "$deb" "$DEST" ;;
  esac
done
lib=$DEST/usr/lib/x86_64-linux-gnu
cp "$lib/stubs/libcublas.so" "$lib/libcublas.so.12"
cp "$lib/stubs/libcublasLt.so" "$lib/libcublasLt.so.12"
# CMake finds the device library through a path that ends in nvvm/libdevice.
mkdir -p "$DEST/usr/lib/cuda/nvvm"
ln -sfn ../../nvidia-cuda-toolkit/libdevice "$DEST/usr/lib/cuda/nvvm/libdevice"
# Debian's nvcc wrapper and profile use absolute /usr paths: make both relative to where they are.
cat >"$DEST/usr/bin/nvcc" <<'EOF'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")
exec "$here/../lib/nvidia-cuda-toolkit/bin/nvcc" "$@"
EOF
chmod +x "$DEST/usr/bin/nvcc"
profile=$DEST/usr/lib/nvidia-cuda-toolkit/bin/nvcc.profile
rm -f "$profile"
cat >"$profile" <<'EOF'
TOP = $(_HERE_)/../../..
NVVMIR_LIBRARY_DIR = $(TOP)/lib/cuda/nvvm/libdevice
PATH		+= $(_HERE_):$(TOP)/bin:
INCLUDES	+= "-I$(TOP)/include" $(_SPACE_)
LIBRARIES	=+ $(_SPACE_) -L$(TOP)/lib/x86_64-linux-gnu
EOF
"$DEST/usr/bin/nvcc" --version | tail -1
du -sh "$DEST"
echo "nvcc: $DEST/usr/bin/nvcc"
