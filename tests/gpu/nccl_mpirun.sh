#!/usr/bin/env bash
# [gpu] The NCCL communicator under mpirun (issue 12 item 4): one process per
# EP rank, one GPU each, the token rows over NCCL, on 2 ranks: the EP = 2
# cases of ep.yaml, two backward cases and the equal-split path, each PASSED and
# reporting NCCL. NCCL allows one rank of a communicator per GPU, so this
# needs two usable GPUs: with fewer it prints SKIPPED and exits 77 (ctest
# reports it skipped, never passed).
# Usage: nccl_mpirun.sh MPIEXEC MOEVERIFY SOURCE_DIR
set -u
mpiexec=$1 bin=$2 src=$3
n=$("$bin" list | sed -n 's/^CUDA executor: built, \([0-9]*\) usable device(s).*/\1/p')
if [ "${n:-0}" -lt 2 ]; then
  echo "SKIPPED: NCCL needs one GPU per rank; $("$bin" list | grep '^CUDA executor')"
  exit 77
fi
fails=0
for fc in "ep ep2_basic" "backward bwd_ep2_align8" "backward_swiglu bwd_swiglu_ep2_bf16" \
          "equal_split equal_split_force --set ep=2"; do
  set -- $fc
  f=$1 c=$2
  shift 2
  out=$(timeout 300 "$mpiexec" -np 2 "$bin" run "$src/cases/$f.yaml" --case "$c" "$@" --backend cuda --threads 1 2>&1)
  rc=$?
  if [ "$rc" = 0 ] && grep -q "token all-to-all: NCCL" <<<"$out"; then echo "ok   $f/$c $* on 2 GPUs over NCCL"
  else echo "FAIL $f/$c $* (exit $rc)"; tail -30 <<<"$out"; fails=$((fails + 1)); fi
done
[ "$fails" = 0 ]
