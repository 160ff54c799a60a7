#!/usr/bin/env bash
# `fuzz --impl` with a framework's adapter under its profile (issue 33):
# N random configurations must give no failure and judge some; then each bug
# planted into the framework at run time (tests/frameworks/planted.py) must
# be found, at its stage, and shrunk to at most 4 tokens per rank.
# Usage: frameworks_fuzz.sh MOEVERIFY SOURCE_DIR FRAMEWORK PROFILE N BUG:STAGE...
# Skipped (77) without MOEVERIFY_TORCH_PYTHON (a Python with torch and the
# framework), never passed.
# With MOEVERIFY_FUZZ_EP=R every configuration has R EP ranks, run as R
# processes by one torchrun worker (the profile's ep narrowed to R; one job).
set -u
bin=$1 src=$2 fw=$3 profile=$4 n=$5
shift 5
. "$src/tests/frameworks/env.sh"
fails=0
R=${MOEVERIFY_FUZZ_EP:-}
launch="$py -W ignore"
jobs=2
if [ -n "$R" ]; then
  sed -E "s/^  ep: .*/  ep: [$R]/" "$profile" > "$tmp/profile_ep$R.yaml"
  grep -q "^  ep: \[$R\]" "$tmp/profile_ep$R.yaml" || { echo "FAIL the profile has no ep line to narrow"; exit 1; }
  profile=$tmp/profile_ep$R.yaml
  launch="$py -W ignore -m torch.distributed.run --standalone --nproc-per-node $R"
  jobs=1
fi
"$bin" fuzz --impl "$launch -m moeverify.frameworks.$fw --serve" --worker --profile "$profile" \
  --iterations "$n" --seed 5 --jobs "$jobs" --out "$tmp/clean" --json "$tmp/clean.json" > "$tmp/clean.log" 2>&1
rc=$?
read -r judged failed crashed < <(/usr/bin/python3 -c '
import json, sys; d = json.load(open(sys.argv[1])); print(d["judged"], d["failed"], d["crashed"])' "$tmp/clean.json")
echo "clean: exit $rc, $n drawn, $judged judged, $failed failed, $crashed crashed"
if [ "$rc" != 0 ] || [ "$failed" != 0 ] || [ "$crashed" != 0 ] || [ "$judged" -lt 10 ]; then
  echo "FAIL the clean fuzz"; tail -30 "$tmp/clean.log"; fails=$((fails + 1))
fi
for planted in "$@"; do
  bug=${planted%%:*} stage=${planted#*:}
  "$bin" fuzz --impl "$launch $src/tests/frameworks/planted.py $fw $bug --serve" --worker \
    --profile "$profile" --iterations 400 --seed 3 --jobs "$jobs" --out "$tmp/$bug" --json "$tmp/$bug.json" > "$tmp/$bug.log" 2>&1
  rc=$?
  got=$(/usr/bin/python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
f = [x for x in d["failures"] if x["kind"] == "incorrect"]
print("%s %s" % (f[0]["check"].split("/")[0], f[0].get("shrunk_tokens")) if f else "none -")' "$tmp/$bug.json" 2>/dev/null)
  at=${got%% *} tokens=${got#* }
  echo "planted $bug: exit $rc, first failure at $at, shrunk to $tokens token(s) per rank (expected $stage, <= 4)"
  if [ "$rc" != 1 ] || [ "$at" != "$stage" ] || [ "$tokens" = - ] || [ "$tokens" -gt 4 ]; then
    echo "FAIL planted $bug"; tail -20 "$tmp/$bug.log"; fails=$((fails + 1))
  fi
done
[ "$fails" = 0 ]
