#!/usr/bin/env bash
# The memory estimate against the measured peak (issue 23 item 4): every
# shipped case (cases/*.yaml, cases/regressions/*.yaml; extra files may be
# given after the source folder, e.g. cases/slow/swiglu_ep8_t128.yaml; with
# --only first, just those: the slow DeepSeek-V3 test uses that) runs
# under `moeverify run`, whose report line per case reads "memory: estimated
# X MiB, measured peak Y MiB" (Y: the kernel's resident high-water mark,
# reset before each case). Each must satisfy Y <= X <= 1.5 Y: never below the
# peak (a case that fits is never refused for a low estimate), never so far
# above it that a case that fits is refused. Prints the table, then the
# failures. Skipped under sanitizers, whose shadow memory inflates Y.
set -uo pipefail
bin=$1
src=$2
shift 2
shipped=("$src"/cases/*.yaml "$src"/cases/regressions/*.yaml)
if [ "${1:-}" = "--only" ]; then shipped=(); shift; fi
if [ -n "${MOEVERIFY_SANITIZED:-}" ]; then echo "skip: sanitized build"; exit 0; fi
fails=0
rows=0
for f in "${shipped[@]}" "$@"; do
  [ -e "$f" ] || continue
  out=$("$bin" run "$f" --threads 2 2>/dev/null) || { echo "FAIL $f: run exited $?"; fails=$((fails + 1)); continue; }
  while read -r name est meas; do
    rows=$((rows + 1))
    verdict=$(awk -v e="$est" -v m="$meas" 'BEGIN { r = e / m; printf "%.3f %s", r, (e >= m && e <= 1.5 * m) ? "ok" : "FAIL" }')
    printf "%-60s estimated %9.1f MiB  peak %9.1f MiB  ratio %s\n" "$(basename "$f") $name" "$est" "$meas" "$verdict"
    case $verdict in *FAIL) fails=$((fails + 1)) ;; esac
  done < <(awk '/^== case/ { n = $3 } /memory: estimated/ { print n, $3, $7 }' <<<"$out")
done
echo "memory estimate: $rows case(s), $fails failure(s) (peak <= estimate <= 1.5 x peak)"
[ "$rows" -gt 0 ] && [ "$fails" = 0 ]
