#!/usr/bin/env bash
# ctest kit.build: builds the GPU kit from this build tree, then checks it on
# this machine: the kit's binaries resolve every carried library from the kit
# (cuBLAS and NCCL aside), `list` runs, and `run --backend cuda` is one
# NOT_SUPPORTED line per case with exit 5 where no device is usable.
# Usage: kit_check.sh BUILD_DIR SOURCE_DIR
set -u
build=$1 src=$2
kit="$build/gpu-kit"
bash "$src/tests/gpu/kit_build.sh" "$build" "$kit" || exit 1
export LD_LIBRARY_PATH="$kit/lib"
for b in "$kit/bin/"*; do
  for lib in libyaml-cpp libstdc++ libgomp libcudart libmpi.so; do
    ldd "$b" | grep -q "$lib" || continue
    ldd "$b" | grep "$lib" | grep -q "$kit/lib/" || { echo "FAIL $(basename "$b"): $lib not taken from the kit"; exit 1; }
  done
done
"$kit/bin/moeverify" list > /dev/null || { echo "FAIL the kit's moeverify list"; exit 1; }
out=$("$kit/bin/moeverify" run "$src/cases/edge.yaml" --backend cuda 2>/dev/null)
rc=$?
"$kit/bin/combine_probe" --tokens 64 > /dev/null 2>&1
probe_rc=$?
"$kit/bin/gpu_check" > /dev/null 2>&1
case $? in
  77) [ "$probe_rc" = 77 ] || { echo "FAIL the kit's combine_probe without a device: exit $probe_rc, expected 77"; exit 1; } ;;
  0) echo "kit.build: a CUDA device is usable here; the no-device checks do not apply (gpu.kit_run runs the GPU checks)"
     exit 0 ;;
  *) echo "FAIL the kit's gpu_check failed on a usable device"; exit 1 ;;
esac
[ "$rc" = 5 ] || { echo "FAIL run --backend cuda without a device: exit $rc, expected 5"; exit 1; }
n=$(grep -c "^== case" <<<"$out")
[ "$n" -gt 0 ] && [ "$(grep -c "=> NOT_SUPPORTED: --backend cuda: no usable CUDA device" <<<"$out")" = "$n" ] ||
  { echo "FAIL run --backend cuda: every case must be one NOT_SUPPORTED line naming the missing device"; echo "$out" | head; exit 1; }
echo "kit.build: kit at $kit; $n cases NOT_SUPPORTED without a device, exit 5"
