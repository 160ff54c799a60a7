#!/usr/bin/env bash
# Reports must be identical run to run, times aside (issue 11 §7): runs each
# given case file several times and compares the reports with the times
# (every "1.234 s" of the per-variant columns and the per-case total) removed.
set -u
bin=$1
shift
fails=0
for f in "$@"; do
  first=""
  bad=0
  for i in 1 2 3 4; do
    out=$("$bin" run "$f" --threads 2 2>/dev/null | sed -E 's/[0-9]+\.[0-9]+ s\b//g; s/measured peak [0-9.]+ MiB//')
    if [ -z "$first" ]; then
      first=$out
    elif [ "$out" != "$first" ]; then
      echo "FAIL $(basename "$f"): run $i differs from run 1:"
      diff <(printf '%s\n' "$first") <(printf '%s\n' "$out") | head -20
      bad=1
      break
    fi
  done
  [ -n "$first" ] || { echo "FAIL $(basename "$f"): no report"; bad=1; }
  if [ "$bad" = 0 ]; then echo "ok   $(basename "$f"): 4 identical reports"; else fails=$((fails + 1)); fi
done
[ "$fails" = 0 ]
