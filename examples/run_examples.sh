#!/usr/bin/env bash
# Runs an example implementation on exported golden folders and checks it.
#   run_examples.sh numpy MOEVERIFY SOURCE_DIR   every case of cases/basic.yaml
#   run_examples.sh torch MOEVERIFY SOURCE_DIR   exits 77 (skipped) without torch
set -u
mode=$1
bin=$2
src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case "$mode" in
  numpy)
    py=/usr/bin/python3
    "$py" -c "import numpy" || { echo "numpy is not importable by $py (bash .ci/setup-deps installs python3-numpy)"; exit 1; }
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" >/dev/null || exit 1
    for d in "$tmp"/golden/*/; do "$py" "$src/examples/numpy_moe.py" "$d" >/dev/null || exit 1; done
    "$bin" check "$tmp/golden" >"$tmp/report.txt"
    rc=$?
    tail -3 "$tmp/report.txt"
    [ "$rc" -eq 0 ] || { grep -E "INCORRECT|ERROR" "$tmp/report.txt" | head; exit 1; }
    n=$(grep -c -E '^   dispatch +actual +routed_input .*PASSED' "$tmp/report.txt")
    [ "$n" -eq "$(ls -d "$tmp"/golden/*/ | wc -l)" ] || { echo "dispatch was not checked in every case"; exit 1; }
    ;;
  torch)
    py=""
    for p in python3 /usr/bin/python3; do
      if command -v "$p" >/dev/null && "$p" -c "import torch, numpy" 2>/dev/null; then py=$p; break; fi
    done
    [ -n "$py" ] || { echo "torch is not importable: examples.torch skipped"; exit 77; }
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" --case exact_fp32 >/dev/null || exit 1
    "$bin" export "$src/cases/basic.yaml" "$tmp/golden" \
      --case "realistic_swiglu[dtype=bf16,experts.impl=loop,combine.accumulate=fp32_accumulate]" >/dev/null || exit 1
    for d in "$tmp"/golden/*/; do "$py" "$src/examples/torch_check.py" "$d" || exit 1; done
    "$bin" check "$tmp/golden" >"$tmp/report.txt"
    rc=$?
    tail -3 "$tmp/report.txt"
    [ "$rc" -eq 0 ] || { grep -E "INCORRECT|ERROR" "$tmp/report.txt" | head; exit 1; }
    ;;
  *) echo "usage: run_examples.sh numpy|torch MOEVERIFY SOURCE_DIR"; exit 2 ;;
esac
