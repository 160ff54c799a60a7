#!/usr/bin/env bash
# The command-line contract: exit statuses, one-line errors for bad input,
# --json, --dump (loaded by NumPy), list/validate/--version, planted faults.
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
expect() {  # expect NAME STATUS COMMAND...
  local name=$1 want=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL $name: exit $got, expected $want"; cat "$tmp/out" "$tmp/err" | tail -20; fails=$((fails + 1))
  else
    echo "ok   $name (exit $got)"
  fi
}

expect version 0 "$bin" --version
grep -q "^moeverify [0-9]" "$tmp/out" || { echo "FAIL version text"; fails=$((fails + 1)); }
expect list 0 "$bin" list
grep -q "local_sort_gather" "$tmp/out" || { echo "FAIL list lacks local_sort_gather"; fails=$((fails + 1)); }
expect validate 0 "$bin" validate "$src"/cases/basic.yaml
expect validate-keys 0 "$bin" validate --keys

printf 'cases:\n  - name: a\n    shape: {experts: 4, top_k: 9}\n' >"$tmp/bad.yaml"
expect bad-case 2 "$bin" run "$tmp/bad.yaml"
[ "$(wc -l <"$tmp/err")" = 1 ] || { echo "FAIL bad input should print one line:"; cat "$tmp/err"; fails=$((fails + 1)); }
grep -q "bad.yaml:3:32: shape.top_k: top_k 9 exceeds experts 4; valid:" "$tmp/err" ||
  { echo "FAIL bad input line:"; cat "$tmp/err"; fails=$((fails + 1)); }
expect missing-file 2 "$bin" run "$tmp/none.yaml"
expect bad-flag 2 "$bin" run "$src"/cases/basic.yaml --threads 0
expect bad-fault 2 "$bin" run "$src"/cases/basic.yaml --fault no_such_fault
expect no-such-case 2 "$bin" run "$src"/cases/basic.yaml --case nope

expect planted-fault 1 "$bin" run "$src"/cases/edge.yaml --fault highest_id_tiebreak --case 'router_ties[router.score=softmax]'
grep -q "INCORRECT" "$tmp/out" || { echo "FAIL fault run shows no INCORRECT"; fails=$((fails + 1)); }

expect json-dump 0 "$bin" run "$src"/cases/basic.yaml --case realistic_bf16 --json "$tmp/r.json" --dump "$tmp/dump"
/usr/bin/python3 - "$tmp" <<'PY' || fails=$((fails + 1))
import json, sys, os
import numpy as np
tmp = sys.argv[1]
r = json.load(open(os.path.join(tmp, "r.json")))
assert r["outcome"] == "PASSED", r["outcome"]
case = r["cases"][0]
assert any(c["stage"] == "end_to_end" for c in case["checks"])
d = os.path.join(tmp, "dump", "realistic_bf16")
m = json.load(open(os.path.join(d, "manifest.json")))
seen = 0
for t in m["tensors"]:
    a = np.load(os.path.join(d, t["file"]))
    assert list(a.shape) == t["shape"], (t, a.shape)
    if t["dtype"] in ("bf16", "fp16"):
        assert a.dtype == np.uint16
    seen += 1
x = np.load(os.path.join(d, "input.x.npy")).astype(np.uint32) << 16
xf = x.view(np.float32)
assert np.isfinite(xf).all() and np.abs(xf).max() > 0
fast = np.load(os.path.join(d, "combine.out_of_place.out.fast.npy"))
ref = np.load(os.path.join(d, "combine.out_of_place.out.ref.npy"))
assert (fast == ref).all()
print("ok   dump: %d tensors load in NumPy; fast combine == reference bitwise" % seen)
PY

echo "cli contract: $fails failure(s)"
[ "$fails" = 0 ]
