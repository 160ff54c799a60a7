#!/usr/bin/env bash
# Behaviour snapshot (issue 22 item 5): runs every shipped case file
# (cases/*.yaml, cases/regressions/*.yaml; not cases/slow) with --json and
# --dump, and writes into OUTDIR, per case file:
#   NAME.txt     the text report (stdout; --verbose), timings and memory lines normalised, and the exit status
#   NAME.json    the JSON report with timing keys removed (seconds, *_seconds,
#                memory and peak RSS keys, tool.commit), keys sorted
#   NAME.dump    sha256 of every file under the --dump folder (relative paths)
# so that two builds can be compared with `diff -r OUTDIR_A OUTDIR_B`.
#
#   tests/behaviour_snapshot.sh BIN SRC OUTDIR
#
# Example (before/after a refactor):
#   tests/behaviour_snapshot.sh /tmp/base/build/moeverify . /tmp/snap-before
#   tests/behaviour_snapshot.sh build/moeverify . /tmp/snap-after
#   diff -r /tmp/snap-before /tmp/snap-after && echo identical
set -u
bin=$(realpath "$1")
src=$2
mkdir -p "$3"
out=$(realpath "$3")
py=/usr/bin/python3
[ -x "$py" ] || py=python3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Text report: per-variant times ("0.123 s"), the memory line's measured peak
# and estimates depend on the machine and the run, not on behaviour.
norm_text() {
  sed -E 's/[0-9]+\.[0-9]+ s\b/<t> s/g; s/measured peak [0-9.]+ [KMG]iB/measured peak <m>/g; s/^(\s*memory:).*/\1 <normalised>/'
}

# Case files by their path relative to SRC, so that reports naming the file
# agree between two checkouts.
cd "$src" || exit 2
for f in cases/*.yaml cases/regressions/*.yaml; do
  rel=${f#cases/}
  name=${rel//\//__}
  name=${name%.yaml}
  rm -rf "$work/dump" "$work/run.json"
  "$bin" run "$f" --threads 2 --verbose --json "$work/run.json" --dump "$work/dump" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  {
    norm_text <"$work/stdout"
    echo "--- stderr"
    norm_text <"$work/stderr"
    echo "--- exit $rc"
  } >"$out/$name.txt"
  # the default (summary) table as well: it is rendered by other code
  "$bin" run "$f" --threads 2 2>/dev/null | norm_text >"$out/$name.summary.txt"
  if [ -f "$work/run.json" ]; then
    "$py" - "$work/run.json" >"$out/$name.json" <<'EOF'
import json, sys
def strip(v):
    if isinstance(v, dict):
        o = {}
        for k, x in v.items():
            if k == "seconds" or k.endswith("_seconds") or "memory" in k or "rss" in k.lower():
                continue
            o[k] = strip(x)
        return o
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v
d = strip(json.load(open(sys.argv[1])))
if isinstance(d.get("tool"), dict):
    d["tool"].pop("commit", None)
print(json.dumps(d, indent=1, sort_keys=True))
EOF
  else
    echo "no JSON" >"$out/$name.json"
  fi
  if [ -d "$work/dump" ]; then
    (cd "$work/dump" && find . -type f -print0 | sort -z | xargs -0 -r sha256sum) >"$out/$name.dump"
  else
    echo "no dump" >"$out/$name.dump"
  fi
  echo "$name: exit $rc"
done
