#!/usr/bin/env bash
# The JSON reports against docs/json-schema.md (issue 24): real output of
# `run --json`, `check --json`, `bench --json` (on the host with --sweep and
# a peer, and on the emulated device) and `fuzz --json` (with and without
# --impl, each with a failure) holds every key the tables list, and no
# key the tables do not list, at each level (document, case, path, check; the
# bench's document, case, stage, part, sweep point, peer and peer stage).
# Usage: json_schema.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" run "$src/cases/ep4.yaml" --case ep4_hot_expert --json "$tmp/run.json" >/dev/null || { echo "run failed"; exit 1; }
# device_seconds: null on the host; on a device every taken variant's own
# device work, the in-process all-to-all's copies included
"$bin" run "$src/cases/ep4.yaml" --case ep4_hot_expert --backend emulated --json "$tmp/run_emulated.json" >/dev/null \
  || { echo "run on the emulated device failed"; exit 1; }
/usr/bin/python3 - "$tmp/run.json" "$tmp/run_emulated.json" <<'PY' || exit 1
import json, sys
host, emu = (json.load(open(p))["cases"][0]["paths"] for p in sys.argv[1:])
if any(p["device_seconds"] is not None for p in host): sys.exit("a host path has device_seconds")
a2a = [p for p in emu if p["taken"] and p["slot"] in ("ep_dispatch", "ep_combine")]
if len(a2a) < 2 or any(not p["device_seconds"] or p["device_seconds"] <= 0 for p in a2a):
    sys.exit(f"the emulated all-to-all's device_seconds: {[(p['slot'], p['variant'], p['device_seconds']) for p in a2a]}")
PY
"$bin" export "$src/cases/ep4.yaml" "$tmp/g" --case ep4_hot_expert >/dev/null || { echo "export failed"; exit 1; }
d="$tmp/g/ep4_hot_expert"
mkdir "$d/actual"
/usr/bin/python3 -c "
import numpy as np, sys
a = np.load('$d/dispatch.routed_input.rank1.npy'); np.save('$d/actual/dispatch.routed_input.rank1.npy', a[:-1])"
"$bin" check "$d" --json "$tmp/check.json" >/dev/null
[ $? -eq 1 ] || { echo "check of a short tensor did not exit 1"; exit 1; }
printf '%s\n' 'import json' 'print(json.dumps({"torch": "fake", "device": "cpu", "stages": {"routing": {"seconds": 0.5, "what": "x"}}}))' > "$tmp/peer.py"
"$bin" bench "$src/cases/ep4.yaml" --case ep4_hot_expert --threads 2 --repeat 1 --sweep \
  --peer "/usr/bin/python3 $tmp/peer.py {spec}" --json "$tmp/bench_host.json" >/dev/null 2>&1 || { echo "bench on the host failed"; exit 1; }
"$bin" bench "$src/cases/ep4.yaml" --case ep4_hot_expert --threads 2 --repeat 1 --backend emulated \
  --json "$tmp/bench_emulated.json" >/dev/null 2>&1 || { echo "bench on the emulated device failed"; exit 1; }
# fuzz: a planted fault found (a failure) and fuzz --impl over the NumPy
# example with a planted bug and a --set (a failure of each kind of record)
"$bin" fuzz --iterations 40 --seed 1 --fault unstable_sort --no-shrink --out "$tmp/ff" --json "$tmp/fuzz.json" \
  >/dev/null 2>&1
[ $? -eq 1 ] || { echo "fuzz --fault unstable_sort did not exit 1"; exit 1; }
"$bin" fuzz --impl "/usr/bin/python3 $src/examples/numpy_moe.py {case} --bug unstable_order" \
  --profile "$src/examples/numpy_moe.profile.yaml" --set combine.order=any --iterations 4 --seed 1 --no-shrink \
  --out "$tmp/ff" --json "$tmp/fuzz_impl.json" >/dev/null 2>&1
[ $? -eq 1 ] || { echo "fuzz --impl with a planted bug did not exit 1"; exit 1; }
/usr/bin/python3 - "$src/docs/json-schema.md" "$tmp/run.json" "$tmp/check.json" "$tmp/bench_host.json" "$tmp/bench_emulated.json" "$tmp/fuzz.json" "$tmp/fuzz_impl.json" <<'PY'
import json, re, sys
doc = open(sys.argv[1]).read()
tables, current = {}, None
for line in doc.splitlines():
    h = re.match(r"^## ([^(`]*)", line)  # "Path (`paths[]`)" is table path, "Bench peer stage ..." bench_peer_stage
    if h:
        current = "_".join(h.group(1).split()).lower()
        tables[current] = {}
        continue
    if current and line.startswith("| `"):
        cells = line.split("|")
        optional = "optional" in cells[2]
        for key in re.findall(r"`([a-z_]+)`", cells[1]):
            tables[current][key] = optional
            tables.setdefault(current + "_where", {})[key] = cells[2]  # the type cell: when a key is written
def check(obj, table, where):
    bad = []
    for k, optional in tables[table].items():
        if k not in obj and not optional: bad.append(f"{where}: key {k} listed but missing")
    for k in obj:
        if k not in tables[table]: bad.append(f"{where}: key {k} not in docs/json-schema.md ({table})")
    return bad
bad = []
for path, schema in [(sys.argv[2], "moeverify-run/1"), (sys.argv[3], "moeverify-check/1")]:
    j = json.load(open(path))
    if j["schema"] != schema: bad.append(f"{path}: schema {j['schema']}")
    bad += check(j, "document", path)
    for c in j["cases"]:
        bad += check(c, "case", path)
        for p in c["paths"]: bad += check(p, "path", path)
        for ch in c["checks"]: bad += check(ch, "check", path)
    if schema == "moeverify-check/1" and not any("rows" in ch for c in j["cases"] for ch in c["checks"]):
        bad.append("check: no rows object for the short tensor")
seen = {t: set() for t in tables}  # the keys the bench runs wrote, per table
def bench_check(obj, table, where):
    seen[table] |= set(obj)
    return check(obj, table, where)
for path, schema, table in [(sys.argv[6], "moeverify-fuzz/1", "fuzz"), (sys.argv[7], "moeverify-fuzz-impl/1", "fuzz_impl")]:
    j = json.load(open(path))
    if j["schema"] != schema: bad.append(f"{path}: schema {j['schema']}")
    bad += check(j, table + "_document", path)
    if not j["failures"]: bad.append(f"{path}: no failure recorded")
    for f in j["failures"]: bad += check(f, table + "_failure", path)
for path in sys.argv[4:6]:
    j = json.load(open(path))
    if j["schema"] != "moeverify-bench/1": bad.append(f"{path}: schema {j['schema']}")
    bad += bench_check(j, "bench_document", path)
    for c in j["cases"]:
        bad += bench_check(c, "bench_case", path)
        for s in c["stages"]:
            bad += bench_check(s, "bench_stage", path)
            # the keys a table marks "on a device" are never written on the host
            if c["backend"] == "host":
                for k in s:
                    if "on a device" in tables["bench_stage_where"].get(k, ""): bad.append(f"{path}: host stage has {k}")
            for p in s.get("device_parts", []): bad += bench_check(p, "bench_part", path)
        for p in c["sweep"]: bad += bench_check(p, "bench_sweep_point", path)
        if "peer" in c:
            bad += bench_check(c["peer"], "bench_peer", path)
            for p in c["peer"]["stages"]: bad += bench_check(p, "bench_peer_stage", path)
for t in [t for t in tables if t.startswith("bench") and not t.endswith("_where")]:
    for k, optional in tables[t].items():
        if optional and k not in seen[t] and k != "note": bad.append(f"bench: optional key {k} ({t}) never written")
for b in sorted(set(bad)): print("FAIL", b)
sys.exit(1 if bad else 0)
PY
rc=$?
[ $rc -eq 0 ] && echo "json schema: run, check, bench and fuzz reports match docs/json-schema.md"
exit $rc
