#!/usr/bin/env bash
# `bench --peer` with PyTorch's peer (python/moeverify/peer.py) on the host:
# ep4.yaml's hot-expert case (sigmoid + bias, SwiGLU experts, EP 4) and
# router.yaml's group-limited case; every slot the peer times (routing,
# dispatch, combine; the experts only on a GPU) gets a positive time and a
# ratio beside moeverify's. Exits 77 (skipped) without MOEVERIFY_TORCH_PYTHON naming
# a Python with torch.
#
#   tests/bench_peer_torch.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1 src=$2 fw=torch
. "$src/tests/frameworks/env.sh"  # $py (MOEVERIFY_TORCH_PYTHON), PYTHONPATH, $tmp
for spec in "ep4.yaml ep4_hot_expert" "router.yaml bias_group_limited"; do
  set -- $spec
  "$bin" bench "$src/cases/$1" --case "$2" --threads 2 --repeat 2 --peer "$py -m moeverify.peer {spec}" \
    --json "$tmp/$2.json" > "$tmp/$2.txt" 2>&1 || { cat "$tmp/$2.txt"; echo "bench --peer on $2 failed"; exit 1; }
  grep -A4 "^  peer (" "$tmp/$2.txt"
  /usr/bin/python3 - "$tmp/$2.json" <<'PY' || exit 1
import json, math, sys
c = json.load(open(sys.argv[1]))["cases"][0]
p = c["peer"]
if p["note"]: sys.exit(f"{c['name']}: the peer did not run: {p['note']}")
slots = sorted(s["slot"] for s in p["stages"])
if slots != ["combine", "dispatch", "routing"]: sys.exit(f"{c['name']}: peer slots {slots}")
for s in p["stages"]:
    for k in ["peer_seconds", "seconds", "ratio"]:
        if not (math.isfinite(s[k]) and s[k] > 0): sys.exit(f"{c['name']} {s['slot']}: {k} = {s[k]}")
print(f"{c['name']}: peer {p['name']}, {len(slots)} slots ok")
PY
done
