#!/usr/bin/env bash
# The figure of `fuzz --impl` through PyTorch (issue 32's target: 30 judged
# configurations a minute on 2 cores): examples/torch_moe.py (dispatch,
# SwiGLU experts, combine) for SECONDS (default 30) as a worker (torch
# imported once per job) and as one process per configuration, both under
# examples/torch_moe.profile.yaml with 2 jobs. Prints judged/min of each; fails
# on any failure or crash. Exits 77 (skipped) without a Python with torch.
#
#   tests/fuzz_impl_torch.sh MOEVERIFY SOURCE_DIR [SECONDS]
set -u
bin=$1
src=$2
secs=${3:-30}
py=""
for p in ${MOEVERIFY_TORCH_PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$p" >/dev/null && "$p" -c "import torch, numpy" 2>/dev/null; then py=$p; break; fi
done
[ -n "$py" ] || { echo "torch is not importable (set MOEVERIFY_TORCH_PYTHON): skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch $("$py" -c 'import torch; print(torch.__version__)') ($py), $(nproc) cores, $secs s each"
for mode in worker one-shot; do
  if [ "$mode" = worker ]; then impl=("$py $src/examples/torch_moe.py --serve" --worker)
  else impl=("$py $src/examples/torch_moe.py {case}"); fi
  "$bin" fuzz --impl "${impl[@]}" --profile "$src/examples/torch_moe.profile.yaml" --seconds "$secs" --seed 1 \
    --jobs 2 --out "$work/out" --json "$work/$mode.json" >"$work/$mode.txt" 2>&1
  rc=$?
  "$py" - "$work/$mode.json" "$mode" "$rc" <<'PY' || { tail -n 30 "$work/$mode.txt"; exit 1; }
import json, sys
d = json.load(open(sys.argv[1]))
rate = 60.0 * d["judged"] / d["seconds"]
print("%-8s %5d judged in %.1f s: %.0f judged/min (%d PASSED, %d failed, %d crashed, %d skipped)" % (
    sys.argv[2], d["judged"], d["seconds"], rate, d["passed"], d["failed"], d["crashed"], d["skipped"]))
sys.exit(0 if sys.argv[3] == "0" and d["failed"] == 0 and d["crashed"] == 0 else 1)
PY
done
