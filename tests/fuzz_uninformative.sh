#!/usr/bin/env bash
# fuzz names the configurations it found NOT_VERIFIED (text and JSON), and
# each can be looked at: `--emit` writes configuration i as case
# fuzz_SEED_i, and running that case gives NOT_VERIFIED at the same check.
# The draws: held fp16 router backward, where route_scale 1e6 takes the
# gradients past 65504 (docs/contract.md §13).
# Usage: fuzz_uninformative.sh MOEVERIFY
set -u
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(--set backward=on --set router.score_dtype=act --set dtype=fp16 --iterations 60 --seed 5)
"$bin" fuzz "${flags[@]}" --jobs 2 --json "$tmp/f.json" > "$tmp/f.txt" 2>&1
rc=$?
[ "$rc" = 0 ] || { echo "FAIL fuzz exit $rc"; tail -20 "$tmp/f.txt"; exit 1; }
read -r check index n < <(/usr/bin/python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
at = {c: i for c, i in d["uninformative_configurations"].items() if not c.startswith("layer")}
assert sum(len(i) for i in d["uninformative_configurations"].values()) == d["uninformative"], "indices != count"
c = sorted(at)[0] if at else "- -1"
print(c, at[c][0] if at else -1, d["uninformative"])' "$tmp/f.json")
echo "NOT_VERIFIED: $n configuration(s); first check $check at configuration $index"
[ "$index" -ge 0 ] || { echo "FAIL no NOT_VERIFIED configuration to look at"; exit 1; }
grep -qE "uninformative at $check: [0-9]+ \(configurations? ([0-9]+, )*$index[,)]" "$tmp/f.txt" ||
  { echo "FAIL the text does not list configuration $index at $check"; grep uninformative "$tmp/f.txt"; exit 1; }
"$bin" fuzz "${flags[@]}" --emit "$tmp/e.yaml" > /dev/null 2>&1 || { echo "FAIL --emit"; exit 1; }
"$bin" run "$tmp/e.yaml" --case "fuzz_5_$index" --verbose > "$tmp/r.txt" 2>&1
rc=$?
IFS=/ read -r stage variant output <<< "$check"
[ "$rc" = 4 ] || { echo "FAIL the emitted case exits $rc, not 4 (NOT_VERIFIED)"; tail -20 "$tmp/r.txt"; exit 1; }
grep -qE "^ +$stage +$variant +$output(@[0-9]+)? +.* NOT_VERIFIED" "$tmp/r.txt" ||
  { echo "FAIL the emitted case is not NOT_VERIFIED at $check"; grep NOT_VERIFIED "$tmp/r.txt"; exit 1; }
echo "ok: configuration $index, emitted and run, is NOT_VERIFIED at $check"
