#!/usr/bin/env bash
# Every shipped case file a framework can express, through its adapter and
# `check` (issue 33): exported under the framework's profile, run by
# `python -m moeverify.frameworks.FW` (exit 77: a configuration the framework
# cannot express, counted as skipped), then judged. Any non-PASS fails, and so
# does a run in which nothing was judged. Prints one line per case and the
# totals: cases judged and case-stages checked, forward and backward.
# Usage: frameworks_cases.sh MOEVERIFY SOURCE_DIR FRAMEWORK PROFILE [CASE_FILE...]
# Needs MOEVERIFY_TORCH_PYTHON: a Python with torch and the framework; without
# it the test is skipped (77), never passed.
set -u
bin=$1 src=$2 fw=$3 profile=$4
shift 4
. "$src/tests/frameworks/env.sh"
mkdir -p "$tmp/golden"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=("$src"/cases/*.yaml "$src"/cases/regressions/*.yaml)
for f in "${files[@]}"; do
  "$bin" export "$f" "$tmp/golden/$(basename "$f" .yaml)" --profile "$profile" > /dev/null 2> "$tmp/export.err" ||
    grep -q "lies outside the profile" "$tmp/export.err" || { echo "FAIL export $f: $(tail -1 "$tmp/export.err")"; exit 1; }
done
# One adapter process for every folder (torch imported once): the worker
# protocol of `fuzz --impl --worker`, one answer line per folder.
ls -d "$tmp"/golden/*/*/ 2>/dev/null > "$tmp/folders"
"$py" -W ignore -m "moeverify.frameworks.$fw" --serve < "$tmp/folders" > "$tmp/answers" 2> "$tmp/adapter.log"
[ "$(wc -l < "$tmp/answers")" = "$(wc -l < "$tmp/folders")" ] ||
  { echo "FAIL the adapter answered $(wc -l < "$tmp/answers") of $(wc -l < "$tmp/folders") folders"; tail -20 "$tmp/adapter.log"; exit 1; }
passed=0 skipped=0 failed=0 stages=0 bwd=0
while IFS= read -r d <&3 && IFS= read -r answer <&4; do
  n="$(basename "$(dirname "$d")")/$(basename "$d")"
  case $answer in
    skip*) skipped=$((skipped + 1)); echo "skip $n: ${answer#skip }"; continue ;;
    done) ;;
    *) failed=$((failed + 1)); echo "FAIL $n: adapter: $answer"; continue ;;
  esac
  "$bin" check "$d" --json "$tmp/check.json" > "$tmp/check.log" 2>&1
  rc=$?
  read -r outcome ns nb < <(/usr/bin/python3 - "$tmp/check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
st = {(c["stage"]) for case in d["cases"] for c in case["checks"]}
print(d["outcome"], len(st), sum(s.endswith("_bwd") for s in st))
PY
)
  if [ $rc = 0 ] && [ "$outcome" = PASSED ]; then
    passed=$((passed + 1)) stages=$((stages + ns)) bwd=$((bwd + nb))
    echo "ok   $n: PASSED, $ns stages ($nb backward)"
  else
    failed=$((failed + 1)); echo "FAIL $n: check exit $rc, $outcome"; grep -E "INCORRECT|ERROR|missing" "$tmp/check.log" | head -8
  fi
done 3< "$tmp/folders" 4< "$tmp/answers"
echo "$fw: $passed case(s) PASSED ($stages case-stages checked, $bwd of them backward), $skipped skipped" \
     "(not expressible), $failed failed"
[ "$failed" = 0 ] && [ "$passed" -gt 0 ]
