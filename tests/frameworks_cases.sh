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
judge() {  # judge FOLDER ANSWER: one line, the totals updated
  local d=$1 answer=$2 n rc outcome ns nb
  n="$(basename "$(dirname "$d")")/$(basename "$d")"
  case $answer in
    skip*) skipped=$((skipped + 1)); echo "skip $n: ${answer#skip }"; return ;;
    done) ;;
    *) failed=$((failed + 1)); echo "FAIL $n: adapter: $answer"; return ;;
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
}
# EP > 1 where the adapter runs one process per rank under torchrun: the
# folders it skipped for their ep go to a torchrun worker of that many ranks
# (MOEVERIFY_FRAMEWORKS_EP, default "2 4 8": R torch processes share the cores).
eps=${MOEVERIFY_FRAMEWORKS_EP-2 4 8}
: > "$tmp/ep_folders"
while IFS= read -r d <&3 && IFS= read -r answer <&4; do
  if [[ $answer =~ ^skip\ ep:\ ([0-9]+)\;\ this\ adapter\ runs\ as ]] && [[ " $eps " == *" ${BASH_REMATCH[1]} "* ]]; then
    echo "${BASH_REMATCH[1]} $d" >> "$tmp/ep_folders"
  else
    judge "$d" "$answer"
  fi
done 3< "$tmp/folders" 4< "$tmp/answers"
for R in $eps; do
  grep "^$R " "$tmp/ep_folders" | cut -d' ' -f2- > "$tmp/folders_ep"
  [ -s "$tmp/folders_ep" ] || continue
  start=$SECONDS
  "$py" -W ignore -m torch.distributed.run --standalone --nproc-per-node "$R" -m "moeverify.frameworks.$fw" --serve \
    < "$tmp/folders_ep" > "$tmp/answers_ep" 2> "$tmp/adapter_ep.log"
  [ "$(wc -l < "$tmp/answers_ep")" = "$(wc -l < "$tmp/folders_ep")" ] ||
    { echo "FAIL the EP $R adapter answered $(wc -l < "$tmp/answers_ep") of $(wc -l < "$tmp/folders_ep") folders"
      grep -v "^W1\|warn" "$tmp/adapter_ep.log" | tail -20; exit 1; }
  echo "     EP $R: $(wc -l < "$tmp/folders_ep") folder(s) through torchrun, $R processes, $((SECONDS - start)) s"
  while IFS= read -r d <&3 && IFS= read -r answer <&4; do judge "$d" "$answer"; done 3< "$tmp/folders_ep" 4< "$tmp/answers_ep"
done
echo "$fw: $passed case(s) PASSED ($stages case-stages checked, $bwd of them backward), $skipped skipped" \
     "(not expressible), $failed failed"
[ "$failed" = 0 ] && [ "$passed" -gt 0 ]
