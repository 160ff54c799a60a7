#!/usr/bin/env bash
# Every Catch2 test case must be exactly one ctest entry, under its full name.
# ctest cuts a discovered name at ';' (a CMake list separator): the entry then
# matches no Catch2 test, and a check silently vanishes. This compares the
# Catch2 list with the ctest entries that run the unit_tests binary; those
# entries also run with `--warn NoTests`, so one that matches nothing fails.
set -u
unit=$1
build=$2
ctest --test-dir "$build" --show-only=json-v1 >"$build/ctest_list.json" || exit 1
"$unit" --list-test-names-only | python3 -c '
import json, os, sys
unit, listing = sys.argv[1], sys.argv[2]
catch = sorted(l.rstrip("\n") for l in sys.stdin if l.strip())
tests = json.load(open(listing))["tests"]
entries = sorted(t["name"] for t in tests
                 if t.get("command") and os.path.realpath(t["command"][0]) == os.path.realpath(unit))
print("Catch2 test cases: %d; ctest entries running %s: %d" % (len(catch), os.path.basename(unit), len(entries)))
if not catch:
    sys.exit("FAIL: no Catch2 test case listed")
if catch != entries:
    for n in sorted(set(catch) - set(entries)): print("  only in Catch2: " + n)
    for n in sorted(set(entries) - set(catch)): print("  only in ctest:  " + n)
    sys.exit("FAIL: the Catch2 test cases and the ctest entries differ")
print("ok: every Catch2 test case is one ctest entry")
' "$unit" "$build/ctest_list.json"
