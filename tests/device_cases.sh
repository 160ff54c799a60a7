#!/usr/bin/env bash
# Every case file on a device backend (issue 12): the device plumbing of
# kernels/device.h (uploads, poisoned outputs, pointer translation, residency,
# write-back, device-side input checks). On the emulated device (the default,
# so it runs in CI, which has no GPU) with the host executor's kernels; on
# cuda with the GPU's (tests/gpu/kit_run.sh). Every case must be PASSED
# (every stage variant has a device form), the planted faults must be caught
# there, and a fuzz budget drawn on the backend must find no failure.
# Usage: device_cases.sh MOEVERIFY SOURCE_DIR [BACKEND [FUZZ_ITERATIONS]]
# DEVICE_CASES_JOBS=N runs N case files at a time (default 1; the kit sets 4
# on a GPU machine's 16 cores: the files are small, so one process leaves
# the GPU mostly idle); the report keeps the files' order.
set -u
bin=$1 src=$2 backend=${3:-emulated} iterations=${4:-300}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0 passed=0
files=("$src"/cases/*.yaml "$src"/cases/regressions/*.yaml)
# one file: its log, JSON and "exit seconds" in $tmp, named by the file
run_file() {
  local n t0=$SECONDS
  n=$(basename "$1" .yaml)
  "$bin" run "$1" --backend "$backend" --threads 2 --json "$tmp/$n.json" > "$tmp/$n.log" 2>&1
  local rc=$?
  echo "$rc $((SECONDS - t0))" > "$tmp/$n.rc"
  [ "${DEVICE_CASES_JOBS:-1}" = 1 ] || echo "ran  $n (exit $rc, $((SECONDS - t0)) s)"  # progress, in finishing order
}
export -f run_file
export bin backend tmp
printf '%s\0' "${files[@]}" | xargs -0 -P "${DEVICE_CASES_JOBS:-1}" -I{} bash -c 'run_file "$1"' _ {}
for f in "${files[@]}"; do
  n=$(basename "$f" .yaml)
  read -r rc secs < "$tmp/$n.rc" || { rc=missing secs=0; }
  out=$(python3 - "$tmp/$n.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sum(c["outcome"] == "PASSED" for c in d["cases"]),
      "|".join(c["name"] + ": " + c["outcome"] for c in d["cases"] if c["outcome"] != "PASSED"))
PY
)
  ok=${out%% *} bad=${out#* }
  if [ "$rc" != 0 ] || [ -n "$bad" ]; then
    echo "FAIL $n (exit $rc): $bad"; tail -20 "$tmp/$n.log"; fails=$((fails + 1))
  else
    echo "ok   $n: $ok case(s) PASSED on $backend ($secs s)"
  fi
  passed=$((passed + ok))
done
[ "$passed" -ge 167 ] || { echo "FAIL only $passed cases PASSED on $backend (expected at least 167)"; fails=$((fails + 1)); }
want_device="emulated"
[ "$backend" = cuda ] && want_device="CUDA device"
grep -q "fast path on $want_device" "$tmp/basic.log" || { echo "FAIL the report does not name the device"; fails=$((fails + 1)); }
# The planted faults that a shipped case catches on the host, each with the
# first case of its file that catches it there: each must be INCORRECT (exit
# 1) on the device too (that case alone: the whole file under each fault took
# most of this test's time); a fault whose wrong splits the
# all-to-all itself refuses is ERROR (exit 3), as on the host. The others live
# in host code that both backends share and that only the selftest's probes
# reach (offsets_32bit: pad_layout; stale_weight_cache: the weight-cache key),
# or in the host's multi-chunk sort, which the device's radix sort replaces
# (sort_chunk_offset).
set -f  # the case names hold [...]: words, not file patterns
for fc in "highest_id_tiebreak edge router_ties[router.score=softmax]" \
          "softmax_no_max router softmax_large_logits" \
          "group_tie_higher router group_score_ties[router.score=softmax]" \
          "unstable_sort edge router_ties[router.score=softmax]" \
          "unordered_combine edge router_ties[router.score=softmax]" \
          "pointer_alias_guard inplace in_place_alias_x_offset[dtype=fp32]" \
          "pad_rows_first ep ep8_align16[empty_groups=zero]" \
          "direct_route_unguarded force_lb unguarded_shortcut_T6_E8_K2_R2" "silu_rounded basic realistic_bf16" \
          "sp_tail_pad_score sp b1_uneven[sp_padding=tail,dtype=fp32]" \
          "sp_b1_index sp batch_aware[sp_padding=virtual]" \
          "sp_even_combine sp b1_uneven[sp_padding=virtual,dtype=fp32]" \
          "bwd_unswapped_splits backward bwd_ep2_align8 3" "bwd_unordered_scatter backward bwd_local_fp32" \
          "bwd_score_grad_rounded backward bwd_bf16_realistic" "bwd_pad_grad_kept backward bwd_ep2_align8" \
          "capacity_overflow capacity drops[capacity.factor=0.5,capacity.policy=probs,capacity.pad_to_capacity=off]" \
          "capacity_tie_higher capacity exact_ties" "swiglu_bwd_silu_grad backward_swiglu bwd_swiglu_ep2_bf16" \
          "swiglu_bwd_fused_rounding backward_swiglu bwd_swiglu_torchtitan_bf16" \
          "swiglu_bwd_wgrad_fp32 backward_swiglu bwd_swiglu_torchtitan_bf16" \
          "pad_front equal_split equal_split_force" \
          "capacity_renormalize capacity drops[capacity.factor=0.5,capacity.policy=probs,capacity.pad_to_capacity=off]" \
          "direct_route_score_before force_lb direct_route_K_eq_El_score_before" \
          "overload_cum_final backward bwd_local_fp32" "overload_global_balanced ep4 ep4_hot_expert" \
          "unswapped_combine_splits ep ep2_basic[experts.kind=identity] 3" \
          "local_equal_split_decision equal_split equal_split_adaptive[equal_split.threshold=0.5] 3" \
          "scores_not_held conventions score_dtype_act[dtype=bf16,router.score=softmax,router.bias=off]" \
          "norm_sum_not_held conventions score_dtype_act[dtype=bf16,router.score=softmax,router.bias=off]" \
          "score_applied_twice conventions score_on_hidden[dtype=bf16]" \
          "hidden_grad_unscaled backward_swiglu bwd_score_on_hidden[dtype=bf16]" \
          "score_grad_scaled_hidden backward_swiglu bwd_score_on_hidden_capacity" \
          "router_bwd_norm_detached backward bwd_router_sigmoid_norm" \
          "router_bwd_softmax_diagonal backward bwd_router_softmax_norm_ep2"; do
  set -- $fc
  want=${4:-1} word=INCORRECT
  [ "$want" = 3 ] && word=ERROR
  "$bin" run "$src/cases/$2.yaml" --case "$3" --backend "$backend" --fault "$1" > "$tmp/fault.log" 2>&1
  rc=$?
  if [ "$rc" = "$want" ] && grep -q "$word" "$tmp/fault.log"; then echo "ok   fault $1 caught on $backend ($2.yaml)"
  else echo "FAIL fault $1 on $backend ($2.yaml): exit $rc, expected $want ($word)"; fails=$((fails + 1)); fi
done
set +f
# Random configurations of every key on the backend (the fuzz's generator).
"$bin" fuzz --backend "$backend" --iterations "$iterations" --seed 7 --out "$tmp/fuzz" > "$tmp/fuzz.log" 2>&1
rc=$?
if [ "$rc" = 0 ] && grep -q "failures *0$" "$tmp/fuzz.log" && grep -q "seed 7, $iterations configurations" "$tmp/fuzz.log"; then
  echo "ok   fuzz on $backend: $(grep -E "^   (PASSED|uninformative) " "$tmp/fuzz.log" | tr -s ' ' | tr '\n' ';')"
else echo "FAIL fuzz on $backend (exit $rc)"; tail -20 "$tmp/fuzz.log"; fails=$((fails + 1)); fi
echo "device cases: $passed case(s) PASSED on $backend, $fails failure(s)"
[ "$fails" = 0 ]
