#!/usr/bin/env bash
# The README's first two commands must stay true. Command 1 (set-up, build,
# run a case) runs here in a fresh copy of the tree; command 2 is the test
# suite itself, so it is checked to be exactly what .ci/run executes.
set -euo pipefail
src=$1
mapfile -t cmds < <(grep -E '^bash \.ci/setup-deps' "$src/README.md" | head -2)
[ "${#cmds[@]}" = 2 ] || { echo "README must start its code with two 'bash .ci/setup-deps ...' commands"; exit 1; }
grep -qxF "${cmds[1]}" "$src/.ci/run" || { echo "README command 2 is not what .ci/run runs: ${cmds[1]}"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$src" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$tmp")
cd "$tmp"
echo "running README command 1 in $tmp: ${cmds[0]}"
bash -c "${cmds[0]}" > out.txt 2>&1 || { tail -40 out.txt; echo "README command 1 failed"; exit 1; }
tail -5 out.txt
grep -q "overall PASSED" out.txt || { echo "README command 1 did not end with every case PASSED"; exit 1; }
echo "README command 1 ok; command 2 == .ci/run"
