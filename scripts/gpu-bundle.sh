#!/usr/bin/env bash
# Packs psflow's executables and the shared libraries they need into one
# tarball for a GPU machine that has an NVIDIA driver, cuDNN 9, cuBLAS 13 and
# NCCL 2 (a CUDA 13 install, or PyTorch's nvidia-* wheels) but not psflow's other
# dependencies (gRPC, protobuf, Abseil, oneDNN):
#   scripts/gpu-bundle.sh [build] [out.tar.xz]
# On the GPU machine:
#   mkdir psflow && tar -xJf psflow-gpu.tar.xz -C psflow
#   export LD_LIBRARY_PATH=$PWD/psflow/lib:<dirs of libcudnn.so.9, libcublas.so.13, libnccl.so.2>
#   psflow/bin/psflow-worker --device=cuda:0 ...
# With GPU_TESTS=1 the GPU test binaries (build/tests/*cuda*, *gpu*) come too,
# under tests/.
# glibc, libstdc++ and the CUDA, cuDNN, cuBLAS and NCCL libraries are left out: the
# target machine brings its own (its glibc must be 2.36 or newer). The CUDA
# runtime is linked statically.
set -euo pipefail
build=${1:-build}
out=${2:-psflow-gpu.tar.xz}
[ -x "$build/bin/psflow-worker" ] || { echo "no $build/bin/psflow-worker: build first" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
for f in "$build"/bin/psflow-*; do
  [ -f "$f" ] || continue
  strip -o "$stage/bin/$(basename "$f")" "$f"
done
if [ "${GPU_TESTS:-0}" = 1 ]; then
  mkdir -p "$stage/tests"
  for f in "$build"/tests/*cuda* "$build"/tests/*gpu*; do
    [ -f "$f" ] && [ -x "$f" ] && strip -o "$stage/tests/$(basename "$f")" "$f"
  done
fi
# Everything the executables load, less what the target machine provides.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudnn|libcublas|libnccl|libnvidia)'
for f in "$stage"/bin/* "$stage"/tests/*; do
  [ -f "$f" ] || continue
  ldd "$f" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if ! [[ $name =~ $skip ]]; then cp -L "$path" "$stage/lib/$name"; strip "$stage/lib/$name" 2>/dev/null || true; fi
done
tar -C "$stage" -cJf "$out" $(cd "$stage" && ls)
echo "$out: $(du -h "$out" | cut -f1) ($(ls "$stage/bin" | wc -l) executables, $(ls "$stage/lib" | wc -l) libraries)"
