#!/usr/bin/env bash
# A key that has no effect in its case is named by `validate` and `run`
# (FILE:LINE, the key, why), and the claim is true: for each rule of
# key_without_effect (src/config/case_validate.cpp) the case is run with two
# values of the key, and every dumped tensor, input and output, fast and
# reference, and the report (times aside) are identical. Where the key does
# matter, nothing is said. Also: notes only about the cases --case selects,
# and a case a profile leaves out named as left out by it, not by --set.
# Usage: inert_keys.sh MOEVERIFY
set -uo pipefail
bin=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL $1"; fails=$((fails + 1)); }

# case_file DIR KEYS: DIR/case.yaml holding one case (name c) with KEYS, one
# "key: value" per argument.
case_file() {
  local dir=$1
  shift
  mkdir -p "$dir"
  { printf 'cases:\n  - name: c\n'; for kv in "$@"; do printf '    %s\n' "$kv"; done; } >"$dir/case.yaml"
}

# inert LABEL KEY V1 V2 BASE...: KEY is named as without effect in the case
# BASE + KEY: V1, and V1 and V2 give the same dumps and report.
inert() {
  local label=$1 key=$2 v1=$3 v2=$4
  shift 4
  local a="$work/$label/a" b="$work/$label/b"
  case_file "$a" "$@" "$key: $v1"
  case_file "$b" "$@" "$key: $v2"
  (cd "$a" && "$bin" validate case.yaml >/dev/null 2>validate.err) || { cat "$a/validate.err"; fail "$label: validate"; return; }
  grep -q "^moeverify: note: case.yaml:[0-9]*:[0-9]*: $key has no effect in case c: " "$a/validate.err" ||
    { cat "$a/validate.err"; fail "$label: validate does not name $key"; }
  for d in "$a" "$b"; do
    (cd "$d" && "$bin" run case.yaml --threads 2 --dump dump >run.txt 2>run.err) ||
      { cat "$d/run.txt" "$d/run.err"; fail "$label: run $d"; return; }
    sed -E 's/\([0-9.]+ s\)//; s/ in [0-9.]+ s//; s/measured peak .*//' "$d/run.txt" >"$d/run.cmp"
  done
  grep -q "$key has no effect" "$a/run.err" || { cat "$a/run.err"; fail "$label: run does not name $key"; }
  diff -r "$a/dump" "$b/dump" >/dev/null || fail "$label: $key $v1 and $v2 dump different tensors"
  diff "$a/run.cmp" "$b/run.cmp" >/dev/null || { diff "$a/run.cmp" "$b/run.cmp" | head; fail "$label: reports differ"; }
  [ "$(find "$a/dump" -name '*.npy' | wc -l)" -gt 10 ] || fail "$label: nothing dumped"
}

shape='shape: {tokens: 24, hidden: 16, ffn: 8, experts: 8, top_k: 2}'
swiglu='experts: {kind: swiglu}'
inert alias_offset combine.alias_offset 3 17 "$shape" "combine.buffer: fresh"
inert threshold equal_split.threshold 0 3 "$shape" "ep: 2" "equal_split.policy: force"
inert cap_policy capacity.policy probs position "$shape" "ep: 2"
inert cap_pad capacity.pad_to_capacity off on "$shape" "$swiglu"
inert fp8_block dispatch.block 4 16 "$shape" "ep: 2"
inert fp8_scale dispatch.scale fp32 ue8m0 "$shape"
inert fp8_quotient dispatch.quotient reciprocal divide "$shape" "ep: 2"
inert fp8_clamp dispatch.amax_clamp 1e-4 1e-8 "$shape"
inert sp_padding sp_padding virtual tail "$shape" "ep: 2"
inert grad_accumulate grad_accumulate per_add fp32_accumulate "$shape" "$swiglu"
inert impl experts.impl loop batched "$shape" "ep: 2" "align: 4"
inert compute_dtype experts.compute_dtype act bf16 "$shape" "dtype: bf16" "backward: on"
inert weights experts.weights held streamed "$shape"
inert rounding experts.rounding fused torchtitan "$shape" "dtype: bf16" "shared_experts.kind: identity" "backward: on"
inert w13_fused experts.w13_fused off on "$shape" "backward: on"

# Where the key matters, or is inert in one point of a sweep only, nothing is said.
quiet() {
  local label=$1
  shift
  case_file "$work/$label" "$@"
  (cd "$work/$label" && "$bin" validate case.yaml >/dev/null 2>validate.err) || { cat "$work/$label/validate.err"; fail "$label: validate"; }
  ! grep -q "has no effect" "$work/$label/validate.err" || { cat "$work/$label/validate.err"; fail "$label: a note where the key matters"; }
}
quiet q_alias "$shape" "shared_experts: {kind: identity, order: init_with_shared}" "combine: {buffer: alias_x_offset, alias_offset: 3}"
quiet q_threshold "$shape" "ep: 2" "equal_split: {policy: adaptive, threshold: 3}"
quiet q_rounding "$shape" "shared_experts.kind: swiglu" "experts.rounding: torchtitan" "dtype: bf16"
quiet q_sweep "$shape" "shared_experts.kind: identity" "combine.alias_offset: 3" "sweep: {combine.buffer: [fresh, alias_x_offset]}" \
  "shared_experts.order: init_with_shared"

# Under defaults: named once for the file, where no case reads it.
mkdir -p "$work/defaults"
printf 'defaults: {capacity.policy: position}\ncases:\n  - {name: a, %s}\n  - {name: b, ep: 2, %s}\n' "$shape" "$shape" \
  >"$work/defaults/case.yaml"
(cd "$work/defaults" && "$bin" validate case.yaml >/dev/null 2>validate.err)
[ "$(grep -c "defaults: capacity.policy has no effect in any case of the file: capacity.factor is 0" "$work/defaults/validate.err")" = 1 ] ||
  { cat "$work/defaults/validate.err"; fail "defaults: not named once"; }

# Only about the cases --case selects (run and export); a case a profile
# leaves out is said to be left out by the profile, not by --set.
mkdir -p "$work/sel"
printf 'cases:\n  - {name: a, combine.alias_offset: 3}\n  - {name: b}\n' >"$work/sel/case.yaml"
(cd "$work/sel" && "$bin" run case.yaml --case b >/dev/null 2>run_b.err && "$bin" export case.yaml g --case b >/dev/null 2>export_b.err &&
  "$bin" export case.yaml g2 --case a >/dev/null 2>export_a.err) || fail "selection: run or export failed"
! grep -q "has no effect" "$work/sel/run_b.err" "$work/sel/export_b.err" || fail "a note about a case --case did not select"
grep -q "combine.alias_offset has no effect in case a" "$work/sel/export_a.err" || fail "export --case a: no note"
src=$(dirname "$(realpath "$0")")/..
"$bin" export "$src/cases/edge.yaml" "$work/prof" --case no_tokens --profile megatron-0.16 >/dev/null 2>"$work/prof.err" ||
  fail "export --profile megatron-0.16: exit $?"
grep -q "^moeverify: note: case no_tokens\[experts.kind=identity\] left out (the profile's fixed keys do not fit it): " "$work/prof.err" &&
  ! grep -q "router_ties\|--set" "$work/prof.err" || { cat "$work/prof.err"; fail "export --profile: the left-out notes"; }

# A key the file writes that a profile's fixed keys replace with another value
# is named where it is written (compared as the case holds it: 1.0 is 1); a
# key under defaults: once for the cases it reaches; a replaced sweep against
# its values; nothing for a --set (the user's own) or an equal value.
mkdir -p "$work/repl"
printf 'fix:\n  combine.accumulate: fp32_accumulate\n  router.route_scale: 1\n  align: 8\n' >"$work/repl/p.yaml"
printf 'defaults: {align: 4}\ncases:\n  - {name: a, %s, combine.accumulate: per_add, seed: 3}\n  - {name: b, %s, combine.accumulate: fp32_accumulate, router.route_scale: 1.0}\n  - {name: c, %s, sweep: {combine.accumulate: [per_add, fp32_accumulate]}}\n' \
  "$shape" "$shape" "$shape" >"$work/repl/case.yaml"
(cd "$work/repl" && "$bin" export case.yaml g --profile p.yaml >/dev/null 2>all.err &&
  "$bin" export case.yaml g2 --profile p.yaml --case b >/dev/null 2>b.err &&
  "$bin" export case.yaml g3 --set combine.accumulate=fp32_accumulate >/dev/null 2>set_only.err &&
  "$bin" export case.yaml g4 --profile p.yaml --set seed=5 >/dev/null 2>set.err &&
  "$bin" validate --profile p.yaml case.yaml >validate.out 2>&1) || fail "replaced keys: export or validate failed"
want_lines=(
  "moeverify: note: case.yaml:1:19: align: 4 is replaced by 8, which profile p fixes (3 cases: a, b, c)"
  "moeverify: note: case.yaml:3:.*: combine.accumulate: per_add is replaced by fp32_accumulate, which profile p fixes (case a)"
  "moeverify: note: case.yaml:5:.*: combine.accumulate: sweep \[per_add, fp32_accumulate\] is replaced by fp32_accumulate, which profile p fixes (case c)")
for w in "${want_lines[@]}"; do
  grep -q "^$w\$" "$work/repl/all.err" || { cat "$work/repl/all.err"; fail "replaced keys: missing '$w'"; }
done
[ "$(grep -c "is replaced by" "$work/repl/all.err")" = 3 ] || { cat "$work/repl/all.err"; fail "replaced keys: not 3 notes"; }
grep -q "align: 4 is replaced by 8, which profile p fixes (case b)" "$work/repl/b.err" &&
  [ "$(grep -c "is replaced by" "$work/repl/b.err")" = 1 ] || { cat "$work/repl/b.err"; fail "replaced keys: --case b"; }
! grep -q "seed: 3 is replaced" "$work/repl/set.err" && ! grep -q "replaced" "$work/repl/set_only.err" ||
  { cat "$work/repl/set.err"; fail "replaced keys: a --set named"; }
[ "$(grep -c "is replaced by" "$work/repl/validate.out")" = 3 ] || { cat "$work/repl/validate.out"; fail "replaced keys: validate --profile"; }
# Not named: a sweep of the fixed value alone, a defaults key under a case's
# own sweep (the sweep's note says it), a case the profile leaves out. A
# malformed value is refused though a fixed key replaces it; a --set of a
# fixed key is dropped at the profile's value and refused at another.
printf 'fix:\n  combine.accumulate: fp32_accumulate\nallow:\n  ep: [1]\n' >"$work/repl/q.yaml"
printf 'defaults: {combine.accumulate: per_add}\ncases:\n  - {name: a, %s}\n  - {name: s, %s, sweep: {combine.accumulate: [fp32_accumulate]}}\n  - {name: t, %s, sweep: {combine.accumulate: [per_add]}}\n  - {name: out, %s, ep: 2}\n' \
  "$shape" "$shape" "$shape" "$shape" >"$work/repl/case2.yaml"
(cd "$work/repl" && "$bin" export case2.yaml h --profile q.yaml >/dev/null 2>case2.err) || fail "replaced keys: case2 export failed"
[ "$(grep -c "is replaced by" "$work/repl/case2.err")" = 2 ] &&
  grep -q "case2.yaml:1:32: combine.accumulate: per_add is replaced by fp32_accumulate, which profile q fixes (case a)$" "$work/repl/case2.err" &&
  grep -q "combine.accumulate: sweep \[per_add\] is replaced by fp32_accumulate, which profile q fixes (case t)$" "$work/repl/case2.err" ||
  { cat "$work/repl/case2.err"; fail "replaced keys: a note for an equal sweep, a swept case or a case left out"; }
printf 'cases:\n  - {name: a, %s, combine.accumulate: banana}\n' "$shape" >"$work/repl/bad.yaml"
(cd "$work/repl" && "$bin" export bad.yaml i --profile q.yaml >/dev/null 2>bad.err)
[ $? = 2 ] && grep -q "^moeverify: bad.yaml:2:.*combine.accumulate" "$work/repl/bad.err" ||
  { cat "$work/repl/bad.err"; fail "replaced keys: a malformed value hidden by the profile"; }
(cd "$work/repl" && "$bin" export case2.yaml j --profile q.yaml --set combine.accumulate=fp32_accumulate >/dev/null 2>same.err &&
  ! "$bin" export case2.yaml k --profile q.yaml --set combine.accumulate=per_add >/dev/null 2>other.err) &&
  grep -q "^moeverify: --set combine.accumulate=per_add: profile q fixes combine.accumulate to fp32_accumulate" "$work/repl/other.err" ||
  { cat "$work/repl/same.err" "$work/repl/other.err"; fail "replaced keys: --set of a fixed key"; }

[ "$fails" = 0 ] && echo "inert keys: 15 keys, each with two values alike; 4 cases where the key matters quiet; replaced keys named"
exit $((fails > 0))
