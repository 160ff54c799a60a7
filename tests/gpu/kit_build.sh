#!/usr/bin/env bash
# Builds the GPU kit on a CPU machine (issue 12 item 7): the
# tool and the gpu check binaries of a CUDA build tree, with every shared
# library they load except the C library, the NVIDIA driver, cuBLAS and NCCL
# (which the GPU machine has), into one folder that tests/gpu/kit_run.sh runs
# there. The GPU machines have nvcc, cuBLAS and NCCL but none of Debian's -dev
# packages (yaml-cpp, OpenMPI, ...) and no network, and what travels there is
# the working tree plus at most 64 MiB of ignored folders.
# Usage: kit_build.sh BUILD_DIR [KIT_DIR]   (KIT_DIR default: BUILD_DIR/gpu-kit)
# BUILD_DIR must be configured with the CUDA executor (nvcc on PATH).
set -euo pipefail
build="$(cd "$1" && pwd)"
kit="${2:-$build/gpu-kit}"
# gpu_check exists only in a tree configured with the CUDA executor.
cmake --build "$build" -j"${KIT_JOBS:-2}" --target moeverify gpu_check combine_probe ||
  { echo "kit_build: cannot build moeverify, gpu_check and combine_probe in $build (configured without nvcc on the PATH?)" >&2; exit 2; }
rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/lib"
cp "$build/moeverify" "$build/tests/gpu_check" "$build/tests/combine_probe" "$kit/bin/"
# The loader's closure of both binaries, less what the GPU machine provides
# (glibc's own libraries, the driver, cuBLAS, NCCL).
ldd "$kit/bin/"* | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u | while read -r name path; do
  case "$name" in
    linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libresolv.so*|libutil.so*) ;;
    libcuda.so*|libcublas*|libnccl*) ;;
    *) cp -L "$path" "$kit/lib/$name" ;;
  esac
done
strip --strip-unneeded "$kit/bin/"* "$kit/lib/"* 2>/dev/null || true
git -C "$build" rev-parse HEAD > "$kit/COMMIT" 2>/dev/null || echo unknown > "$kit/COMMIT"
size=$(du -sm "$kit" | cut -f1)
echo "kit_build: $kit: ${size} MiB, commit $(cat "$kit/COMMIT"), $(ls "$kit/lib" | wc -l) libraries carried"
[ "$size" -lt 64 ] || { echo "kit_build: ${size} MiB is over the 64 MiB that travels to a GPU machine" >&2; exit 1; }
