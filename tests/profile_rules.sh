#!/usr/bin/env bash
# A profile's allow rules hold on keys a case's JSON leaves out at their
# default (grad_accumulate as_combine; the per-rank token list of an ep 1
# case): `validate --profile` counts such cases outside, as it counts any
# case whose value the rule does not list. (Until 2026-11-28 no rule on
# those keys was ever enforced.)
# Usage: profile_rules.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
expect() {  # expect PROFILE_TEXT CASE_FILE FRAGMENT: validate's output holds FRAGMENT
  printf '%b' "$1" > "$tmp/p.yaml"
  "$bin" validate --profile "$tmp/p.yaml" "$2" > "$tmp/out" 2>&1
  grep -qF -- "$3" "$tmp/out" || { cat "$tmp/out"; echo "FAIL: no '$3'"; fail=1; }
}
expect 'profile: x\nallow: {grad_accumulate: [per_add]}\n' "$src/cases/backward.yaml" \
  'outside: grad_accumulate is "as_combine", outside the profile'"'"'s {per_add}'
expect 'profile: x\nallow: {grad_accumulate: [as_combine, per_add]}\n' "$src/cases/backward.yaml" \
  "case(s) inside the profile"
! grep -q "outside: grad_accumulate" "$tmp/out" || { cat "$tmp/out"; echo "FAIL: as_combine allowed yet outside"; fail=1; }
expect 'profile: x\nallow: {shape.tokens_per_rank: [[4]], ep: [1]}\n' "$src/cases/basic.yaml" \
  "outside: shape.tokens_per_rank is [64], outside the profile's {[4]}"
# fuzz --help names every shipped profile (the list is written out there)
"$bin" fuzz --help | tr -s ' \n' ' ' > "$tmp/help"
for f in "$src"/cases/profiles/*.yaml; do
  n=$(basename "$f" .yaml)
  grep -qE "[ (]$n[;,)]" "$tmp/help" || { echo "FAIL: fuzz --help does not name the shipped profile $n"; fail=1; }
done
[ "$fail" = 0 ] && echo "profile rules ok"
