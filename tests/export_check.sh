#!/usr/bin/env bash
# export / check (issue 9 §6): a copy of the expected outputs passes; one
# flipped element in any expected tensor is INCORRECT, naming its stage and
# MoE coordinates; a routing that picks another member of an exact tie
# passes (and a non-tied one fails); a dispatch that breaks the ascending
# token order inside an expert fails; broken, mistyped or misshapen files are
# exit 2 with one line on stderr.
# Usage: export_check.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1
src=$2
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

expect_rc() {  # expect_rc WANT LOG -- command...
  local want=$1 log=$2
  shift 3
  "$@" >"$log" 2>"$log.err"
  local rc=$?
  [ "$rc" -eq "$want" ] || { fail "exit $rc, wanted $want: $*"; tail -n 5 "$log" "$log.err"; return 1; }
}

# --- 1. export, copy expected to actual, check passes --------------------------
"$bin" export "$src/cases/basic.yaml" "$tmp/g" --case exact_fp32 >/dev/null || fail "export exact_fp32"
"$bin" export "$src/cases/basic.yaml" "$tmp/g" --case realistic_bf16 >/dev/null || fail "export realistic_bf16"
"$bin" export "$src/cases/ep4.yaml" "$tmp/g" --case ep4_hot_expert >/dev/null || fail "export ep4_hot_expert"
"$bin" export "$src/cases/edge.yaml" "$tmp/ties" --case "router_ties[router.score=softmax]" >/dev/null ||
  fail "export router_ties"
for d in "$tmp"/g/*/; do
  mkdir -p "$d/actual"
  cp "$d"/*.npy "$d/actual/"
done
expect_rc 0 "$tmp/copy.log" -- "$bin" check "$tmp/g" --json "$tmp/copy.json"
grep -q '"outcome": "PASSED"' "$tmp/copy.json" || fail "check --json does not say PASSED"
"$py" - "$tmp/g" <<'PY' || fail "manifest format"
import json, sys, os
for d in sorted(os.listdir(sys.argv[1])):
    m = json.load(open(os.path.join(sys.argv[1], d, "manifest.json")))
    assert m["format"] == "moeverify-golden/1", m["format"]
    assert m["ranks"] == m["case"]["ep"]
    roles = {t["role"] for t in m["tensors"]}
    assert roles == {"input", "expected"}, roles
    for t in m["tensors"]:
        assert set(t) == {"name", "stage", "role", "rank", "file", "dtype", "shape", "layout"}, t
        assert os.path.exists(os.path.join(sys.argv[1], d, t["file"])), t["file"]
    stages = {t["stage"] for t in m["tensors"]}
    for s in ["router_logits", "routing", "dispatch", "ep_dispatch", "ep_permute", "align_pad", "experts", "combine"]:
        assert s in stages, (d, s)
PY

# --- 2. one flipped element in any tensor: INCORRECT at its stage --------------
flip() {  # flip FILE DTYPE: change the middle element
  "$py" - "$1" "$2" <<'PY'
import sys, numpy as np
p, dt = sys.argv[1], sys.argv[2]
a = np.load(p)
i = a.size // 2
f = a.reshape(-1)
if dt in ("bfloat16", "float16"):
    f[i] ^= np.uint16(0x4000)      # the top exponent bit: 0 becomes 2, 1 becomes ~2^128
elif dt == "float32":
    f[i] = f[i] + (abs(f[i]) + np.float32(1))
else:
    f[i] += 1
np.save(p, a)
PY
}
for d in "$tmp"/g/*/; do
  case_name=$(basename "$d")
  n=0
  while IFS=' ' read -r file stage dtype; do
    n=$((n + 1))
    rm -rf "$d/actual" && mkdir "$d/actual" && cp "$d"/*.npy "$d/actual/"
    flip "$d/actual/$file" "$dtype"
    "$bin" check "$d" >"$tmp/flip.log" 2>"$tmp/flip.err"
    rc=$?
    if [ "$rc" -ne 1 ]; then
      fail "$case_name: flipping $file gave exit $rc, wanted 1 (INCORRECT)"
      head -3 "$tmp/flip.err"
      continue
    fi
    first=$(grep -m1 -E '^   [a-z_]+ +actual .*INCORRECT' "$tmp/flip.log" | awk '{print $1}')
    [ "$first" = "$stage" ] || fail "$case_name: flipping $file ($stage) made '$first' the first INCORRECT stage"
    grep -q -E 'mismatch \((rank [0-9]+, )?(token|expert|index|from rank)' "$tmp/flip.log" ||
      fail "$case_name: flipping $file: no mismatch named in MoE coordinates"
  done < <("$py" -c '
import json, sys
m = json.load(open(sys.argv[1]))
for t in m["tensors"]:
    if t["role"] == "expected" and 0 not in t["shape"]:
        print(t["file"], t["stage"], t["dtype"])' "$d/manifest.json")
  [ "$n" -ge 15 ] || fail "$case_name: only $n expected tensors were flipped"
  echo "flipped one element in each of $n expected tensors of $case_name"
done

# --- 3. routing: another member of an exact tie passes, a non-tied one fails ---
td=$(ls -d "$tmp"/ties/*/ | head -1)
mkdir -p "$td/actual"
"$py" - "$td" <<'PY' || fail "no exact tie at the K-th place in router_ties"
import sys, numpy as np, os
d = sys.argv[1]
s, ids = np.load(d + "/scores.npy"), np.load(d + "/ids.npy")
T, K = ids.shape
E = s.shape[1]
for t in range(T):
    kth = s[t, ids[t, K - 1]]
    others = [e for e in range(E) if e not in ids[t] and s[t, e] == kth]
    if others:
        new = ids.copy()
        new[t, K - 1] = others[0]
        # the implementation returns its K ids unsorted (CONTRACT §14): reverse them
        new[t] = new[t][::-1]
        break
else:
    sys.exit(1)
np.save(d + "/actual/scores.npy", s)
np.save(d + "/actual/ids.npy", new)
np.save(d + "/actual/topk_scores.npy", np.take_along_axis(s, new.astype(np.int64), 1).astype(np.float32))
np.save(d + "/actual/counts.npy", np.bincount(new.reshape(-1), minlength=E).astype(np.int64))
PY
expect_rc 0 "$tmp/tie.log" -- "$bin" check "$td" && grep -q "another member of an exact tie" "$tmp/tie.log" ||
  fail "an exact-tie alternative was not accepted and reported"
grep -q "not checked" "$tmp/tie.log" || fail "stages without actual files are not listed as not checked"
rm -rf "$td/actual" && mkdir -p "$td/actual"
"$py" - "$td" notie <<'PY' || fail "router_ties: no non-tied alternative"
import sys, numpy as np
d = sys.argv[1]
s, ids = np.load(d + "/scores.npy"), np.load(d + "/ids.npy")
T, K = ids.shape
E = s.shape[1]
new = ids.copy()
for t in range(T):
    below = [e for e in range(E) if e not in ids[t] and s[t, e] < s[t, ids[t, K - 1]]]
    if below:
        new[t, 0] = below[0]
        break
np.save(d + "/actual/ids.npy", new)
PY
expect_rc 1 "$tmp/notie.log" -- "$bin" check "$td" && grep -q -E 'routing +actual +ids .*INCORRECT' "$tmp/notie.log" ||
  fail "a non-tied routing alternative was not INCORRECT at routing/ids"

# --- 4. dispatch breaking the ascending-token order inside an expert fails -----
bd="$tmp/g/realistic_bf16"
rm -rf "$bd/actual"
"$py" "$src/examples/numpy_moe.py" "$bd" >/dev/null || fail "numpy_moe.py"
expect_rc 0 "$tmp/np.log" -- "$bin" check "$bd"
"$py" "$src/examples/numpy_moe.py" "$bd" --bug unstable_order >/dev/null
expect_rc 1 "$tmp/order.log" -- "$bin" check "$bd" &&
  grep -q -E 'dispatch +actual +routed_input .*INCORRECT' "$tmp/order.log" ||
  fail "a dispatch with descending tokens inside an expert was not INCORRECT at dispatch"

# --- 5. broken, mistyped, misshapen files and manifests: exit 2, one line ------
one_line() {  # one_line LOG WHAT
  [ "$(wc -l <"$1.err")" -eq 1 ] || fail "$2: stderr is not one line"
  grep -q -e "$3" "$1.err" || { fail "$2: stderr does not mention '$3'"; cat "$1.err"; }
}
ed="$tmp/g/exact_fp32"
rm -rf "$ed/actual" && mkdir "$ed/actual" && cp "$ed"/*.npy "$ed/actual/"
head -c 20 "$ed/ids.npy" >"$ed/actual/ids.npy"
expect_rc 2 "$tmp/b1.log" -- "$bin" check "$ed" && one_line "$tmp/b1.log" "truncated npy" "ids.npy"
"$py" -c "import numpy as np; np.save('$ed/actual/ids.npy', np.load('$ed/ids.npy').astype(np.int64))"
expect_rc 2 "$tmp/b2.log" -- "$bin" check "$ed" && one_line "$tmp/b2.log" "int64 ids" "int32"
"$py" -c "import numpy as np; np.save('$ed/actual/ids.npy', np.load('$ed/ids.npy')[:-1])"
expect_rc 2 "$tmp/b3.log" -- "$bin" check "$ed" && one_line "$tmp/b3.log" "short ids" "shape"
cp "$ed/ids.npy" "$ed/actual/ids.npy"
cp "$ed/manifest.json" "$tmp/manifest.bak"
echo '{"format": "other"}' >"$ed/manifest.json"
expect_rc 2 "$tmp/b4.log" -- "$bin" check "$ed" && one_line "$tmp/b4.log" "wrong format" "moeverify-golden/1"
cp "$tmp/manifest.bak" "$ed/manifest.json"
expect_rc 2 "$tmp/b5.log" -- "$bin" check "$tmp/nonexistent" && one_line "$tmp/b5.log" "missing folder" "manifest"
expect_rc 2 "$tmp/b7.log" -- "$bin" check "$ed" --actual "$tmp/no_such_folder" && one_line "$tmp/b7.log" "missing --actual" "--actual"
# nothing written (an empty or a missing actual/): NOT_VERIFIED, never PASSED
rm -rf "$ed/actual" && mkdir "$ed/actual"
expect_rc 4 "$tmp/b6.log" -- "$bin" check "$ed"
rm -rf "$ed/actual"
expect_rc 4 "$tmp/b8.log" -- "$bin" check "$ed"

[ "$fails" -eq 0 ] && echo "export_check: all passed"
exit $((fails > 0))
