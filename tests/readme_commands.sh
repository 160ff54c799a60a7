#!/usr/bin/env bash
# The README's first two commands must stay true. Command 1 (set-up, build,
# run a case) runs here; command 2 is the test suite itself, so it is checked
# to be exactly what .ci/run executes.
set -euo pipefail
src=$1
mapfile -t cmds < <(grep -E '^bash \.ci/setup-deps' "$src/README.md" | head -2)
[ "${#cmds[@]}" = 2 ] || { echo "README must start its code with two 'bash .ci/setup-deps ...' commands"; exit 1; }
grep -qxF "${cmds[1]}" "$src/.ci/run" || { echo "README command 2 is not what .ci/run runs: ${cmds[1]}"; exit 1; }
# Command 1 runs from the source root exactly as written. Its set-up and build
# are the first half of command 2, which .ci/run executes on a clean clone, so
# the build from nothing is already proven by the time this test runs; here
# the build is up to date, and what command 1 adds, the run of the case, is
# checked. (Building a second copy of the tree here doubled CI's build time.)
cd "$src"
echo "running README command 1 in $src: ${cmds[0]}"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
bash -c "${cmds[0]}" >"$out" 2>&1 || { tail -40 "$out"; echo "README command 1 failed"; exit 1; }
tail -5 "$out"
grep -q "overall PASSED" "$out" || { echo "README command 1 did not end with every case PASSED"; exit 1; }
echo "README command 1 ok; command 2 == .ci/run"
