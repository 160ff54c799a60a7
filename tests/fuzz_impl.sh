#!/usr/bin/env bash
# `moeverify fuzz --impl` against examples/numpy_moe.py (NumPy only, no torch):
#   1. under its profile: every configuration judged and PASSED;
#      through the worker (--serve) too, and nothing left in TMPDIR or the
#      working folder;
#   2. planted bugs found, shrunk to at most 4 tokens per rank at the stage
#      they live in, and the repro line of the case file reproduces them;
#   3. an implementation that crashes, hangs, answers nonsense or exits 77 is
#      reported as such and never PASSED (exit 1, or NOT_VERIFIED's 4 when
#      nothing was judged);
#   4. bad command lines and profiles are exit 2 with what would be valid.
#
#   tests/fuzz_impl.sh MOEVERIFY SOURCE_DIR
set -u
bin=$1
src=$2
py=/usr/bin/python3
"$py" -c "import numpy" || { echo "numpy is not importable by $py (bash .ci/setup-deps installs python3-numpy)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tmp" "$work/cwd"
export TMPDIR=$work/tmp
cd "$work/cwd" || exit 1
numpy="$py $src/examples/numpy_moe.py"
profile=$src/examples/numpy_moe.profile.yaml
fail() { echo "FAIL: $*"; exit 1; }
# field JSON KEY: a top-level number of a fuzz --json summary
field() { "$py" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

echo "== 1. the example under its profile: one-shot, then worker"
"$bin" fuzz --impl "$numpy {case}" --profile "$profile" --iterations 20 --seed 7 --jobs 2 \
  --out "$work/out1" --json "$work/s1.json" >"$work/o1.txt" 2>&1
rc=$?
tail -n 12 "$work/o1.txt"
[ "$rc" -eq 0 ] || fail "exit $rc under the profile"
[ "$(field "$work/s1.json" judged)" -eq 20 ] && [ "$(field "$work/s1.json" passed)" -eq 20 ] || fail "not 20 of 20 PASSED"
[ "$(field "$work/s1.json" crashed)" -eq 0 ] && [ "$(field "$work/s1.json" failed)" -eq 0 ] || fail "failures or crashes"
"$bin" fuzz --impl "$numpy --serve" --worker --profile "$profile" --iterations 30 --seed 8 --jobs 2 \
  --out "$work/out1" --json "$work/s1w.json" >"$work/o1w.txt" 2>&1 || { tail "$work/o1w.txt"; fail "worker run"; }
[ "$(field "$work/s1w.json" passed)" -eq 30 ] || fail "worker: not 30 PASSED"
[ -z "$(ls -A "$work/tmp")" ] || fail "temporary folders left in TMPDIR: $(ls "$work/tmp")"
[ -z "$(ls -A "$work/cwd")" ] || fail "files written in the working folder: $(ls "$work/cwd")"
[ ! -e "$work/out1" ] || [ -z "$(ls -A "$work/out1")" ] || fail "--out holds files although nothing failed"
# --keep keeps them, and says where
"$bin" fuzz --impl "$numpy {case}" --profile "$profile" --iterations 2 --seed 7 --keep --out "$work/out1" \
  --json "$work/sk.json" >/dev/null 2>&1 || fail "--keep run"
kept=$(ls "$work/tmp")
[ -n "$kept" ] && ls "$work/tmp/$kept"/c0/manifest.json >/dev/null || fail "--keep: no case folder kept"
rm -rf "${work:?}/tmp/"*

echo "== 2. planted bugs: found, shrunk to <= 4 tokens per rank, reproduced"
# (source_major and score_in_bf16 are found and shrunk alike: issue 32's closing note;
# examples.numpy catches all four at their stage on fixed cases)
for spec in "unstable_order dispatch" "skip_last_source ep_dispatch"; do
  set -- $spec
  rm -rf "$work/out2"
  "$bin" fuzz --impl "$numpy {case} --bug $1" --profile "$profile" --iterations 6 --seed 1 --jobs 2 \
    --out "$work/out2" --json "$work/s2.json" >"$work/o2.txt" 2>&1
  rc=$?
  read -r check tokens file repro < <("$py" -c "
import json, sys
d = json.load(open(sys.argv[1]))
f = [f for f in d['failures'] if f['same_as'] is None][0]
print(f['check'], f['shrunk_tokens'], f['file'], f['repro'])" "$work/s2.json")
  echo "--bug $1: exit $rc, first failure at $check, shrunk to $tokens token(s) per rank"
  [ "$rc" -eq 1 ] || fail "--bug $1: exit $rc, not 1"
  [ "${check%%/*}" = "$2" ] || fail "--bug $1: failure at $check, not at stage $2"
  [ "$tokens" -le 4 ] || fail "--bug $1: shrunk to $tokens tokens per rank (more than 4)"
  [ -f "$file" ] || fail "--bug $1: no case file $file"
  (eval "$repro") >"$work/repro.txt" 2>&1
  rc=$?
  [ "$rc" -eq 1 ] && grep -qE "^   $2 +actual\*? +INCORRECT" "$work/repro.txt" ||
    { tail -n 20 "$work/repro.txt"; fail "--bug $1: the repro line gave exit $rc, not INCORRECT at $2"; }
done

echo "== 3. crash, hang, nonsense, exit 77: reported as such, never PASSED"
# a crash: exit 3 with a message on stderr
"$bin" fuzz --impl "echo 'boom: the kernel fell over' >&2; exit 3; : {case}" --iterations 3 --seed 1 \
  --shrink-budget 10 --out "$work/out3" --json "$work/s3.json" >"$work/o3.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && [ "$(field "$work/s3.json" crashed)" -eq 3 ] && [ "$(field "$work/s3.json" passed)" -eq 0 ] ||
  { cat "$work/o3.txt"; fail "crash: exit $rc"; }
grep -q "exit status 3" "$work/o3.txt" && grep -q "boom: the kernel fell over" "$work/o3.txt" ||
  fail "crash: the exit status or the stderr tail is missing from the report"
# two different crashes are two failures, each shrunk and saved (they were
# one: the second was only in the JSON, with no case file), and the later
# failures of each kind are one line under it. The lines are as
# moeverify.main writes them: "PROG: FOLDER: KeyError: ..." (the program's
# name first, the folder, which differs per configuration, next).
"$bin" fuzz --impl "if grep -q '\"dtype\": \"bf16\"' {case}/manifest.json; then echo \"impl.py: {case}: ValueError: bf16 path\" >&2; \
else echo \"impl.py: {case}: KeyError: 7\" >&2; fi; exit 1" --iterations 16 --seed 1 --shrink-budget 5 --out "$work/out3k" \
  --json "$work/s3k.json" >"$work/o3k.txt" 2>&1
rc=$?
kinds=$("$py" -c "
import json, sys
d = json.load(open(sys.argv[1]))
firsts = [f for f in d['failures'] if f['same_as'] is None]
print(len(firsts), sum(1 for f in firsts if f['file']), '|'.join(k for k in ('KeyError: 7', 'ValueError: bf16 path') if any(f['note'].endswith(k) for f in firsts)))" "$work/s3k.json")
[ "$rc" -eq 1 ] && [ "$kinds" = "2 2 KeyError: 7|ValueError: bf16 path" ] && grep -q "failed the same way: [0-9]* more" "$work/o3k.txt" &&
  [ "$(grep -c '^   FAIL' "$work/o3k.txt")" -eq 2 ] || { cat "$work/o3k.txt"; fail "two crash kinds: exit $rc, first failures: $kinds"; }
# a crash after writing a wrong stage names that stage, and its repro line
# still runs check, which judges what was written
"$bin" fuzz --impl "$numpy {case} --bug unstable_order; exit 1" --profile "$profile" --iterations 2 --seed 1 \
  --shrink-budget 5 --out "$work/out3w" --json "$work/s3w.json" >"$work/o3w.txt" 2>&1
rc=$?
grep -q "before it ended, it wrote INCORRECT outputs: dispatch/actual/" "$work/o3w.txt" ||
  { cat "$work/o3w.txt"; fail "a crash after a wrong stage: the stage is not named"; }
repro=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['failures'][0]['repro'])" "$work/s3w.json")
(eval "$repro") >"$work/repro3w.txt" 2>&1
[ $? -eq 1 ] && grep -qE "^   dispatch +actual\*? +INCORRECT" "$work/repro3w.txt" ||
  { tail -n 20 "$work/repro3w.txt"; fail "a crash's repro line does not judge what was written: $repro"; }
# --require and --strict-ties reach every judgement and the repro line: an
# implementation that writes nothing fails a required stage (it was
# NOT_VERIFIED, exit 4, without --require)
"$bin" fuzz --impl "true {case}" --require routing --strict-ties --iterations 2 --seed 1 --no-shrink \
  --out "$work/out3r" --json "$work/s3r.json" >"$work/o3r.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && grep -q "INCORRECT at routing/actual/" "$work/o3r.txt" && grep -q "check .* --require routing --strict-ties; }" "$work/o3r.txt" ||
  { cat "$work/o3r.txt"; fail "--require/--strict-ties: exit $rc"; }
# exact ties broken toward the highest expert id: accepted, and counted (the
# summary's ties line, the JSON's accepted_ties); under --strict-ties failed
printf 'fix:\n  shape.hidden: 2\n  data: exact\n  router.score: softmax\n  router.bias: "off"\n  router.groups: 1\n  router.force_load_balance: "off"\n  router.hot_expert: -1\n' >"$work/ties.yaml"
cat >"$work/tiebreak.py" <<EOF
import sys
sys.path.insert(0, "$src/python")
import moeverify
def fn(g):  # the K-th pick moved to the highest id among the unpicked experts tied with it
    for r in range(g.ranks):
        s, ids = g.expected("routing.scores", rank=r), g.expected("routing.ids", rank=r).copy()
        for t in range(len(ids)):
            tied = [e for e in range(s.shape[1]) if s[t, e] == s[t, ids[t, -1]] and e not in ids[t]]
            if tied and max(tied) > ids[t, -1]:
                ids[t, -1] = max(tied)
        g.write("routing.ids", ids, rank=r)
moeverify.main(fn)
EOF
"$bin" fuzz --impl "$py $work/tiebreak.py {case}" --profile "$work/ties.yaml" --iterations 6 --seed 2 \
  --out "$work/out_ties" --json "$work/s3ties.json" >"$work/o3ties.txt" 2>&1
rc=$?
ties=$(field "$work/s3ties.json" accepted_ties)
tied=$("$py" -c "import json, sys; print(', '.join(map(str, json.load(open(sys.argv[1]))['tie_configurations'])))" "$work/s3ties.json")
[ "$rc" -eq 0 ] && [ "$ties" -ge 3 ] && grep -q "^   ties *$ties  (configurations $tied: judged configurations where the implementation broke an exact tie" "$work/o3ties.txt" ||
  { cat "$work/o3ties.txt"; fail "accepted ties: exit $rc, accepted_ties $ties"; }
"$bin" fuzz --impl "$py $work/tiebreak.py {case}" --profile "$work/ties.yaml" --iterations 6 --seed 2 --strict-ties \
  --no-shrink --out "$work/out_ties" --json "$work/s3ts.json" >"$work/o3ts.txt" 2>&1
[ $? -eq 1 ] && [ "$(field "$work/s3ts.json" failed)" -eq "$ties" ] || { cat "$work/o3ts.txt"; fail "--strict-ties: the tied configurations not failed"; }
strict=$("$py" -c "import json, sys; print(', '.join(map(str, sorted(f['index'] for f in json.load(open(sys.argv[1]))['failures']))))" "$work/s3ts.json")
[ "$strict" = "$tied" ] || fail "the tie configurations ($tied) are not those --strict-ties fails ($strict)"

# a signal
"$bin" fuzz --impl "kill -SEGV \$\$; : {case}" --iterations 1 --seed 1 --no-shrink --out "$work/out3" >"$work/o3s.txt" 2>&1
[ $? -eq 1 ] && grep -q "killed by signal 11" "$work/o3s.txt" || { cat "$work/o3s.txt"; fail "signal not reported"; }
# a hang, past --impl-timeout (its child process ended with it)
"$bin" fuzz --impl "sleep 30; : {case}" --impl-timeout 0.5 --iterations 1 --seed 1 --no-shrink \
  --out "$work/out3" --json "$work/s3t.json" >"$work/o3t.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && grep -q "timed out after 0.5 s" "$work/o3t.txt" || { cat "$work/o3t.txt"; fail "timeout: exit $rc"; }
grep -q "repro: .* && { timeout 0.5 sh -c 'sleep 30; : " "$work/o3t.txt" ||
  { cat "$work/o3t.txt"; fail "a hang's repro line does not bound it by --impl-timeout"; }
# (out3 held the signal run's case file: said, and kept)
grep -q "^fuzz: --out $work/out3 already holds 1 case file(s) of earlier runs (fuzz_1_0.yaml), kept but for the 1 of seed 1 (fuzz_1_N.yaml): configuration N failing again replaces its file" "$work/o3t.txt" ||
  { cat "$work/o3t.txt"; ls "$work/out3"; fail "--out: an earlier run's case file not said"; }
# Skip reasons that differ only in a key's value are one line; a value the
# profile fixes in every configuration, refused, is named with the shipped
# profiles that fix the key otherwise.
"$bin" fuzz --impl "n=\$(cat $work/count 2>/dev/null || echo 0); echo \$((n + 1)) >$work/count; echo \"router.hot_expert: \$n; runs -1\" >&2; exit 77; : {case}" \
  --iterations 10 --seed 1 --jobs 1 >"$work/o3g.txt" 2>&1
grep -q "^      skipped 10: router.hot_expert: 10 values (0, 1, 2, 3, 4, 5, ...); runs -1$" "$work/o3g.txt" ||
  { cat "$work/o3g.txt"; fail "skip reasons differing in a value: not one line"; }
"$bin" fuzz --impl "echo 'router.gate_dtype: fp32; runs act' >&2; exit 77; : {case}" --profile torchtitan \
  --iterations 4 --seed 1 >"$work/o3p.txt" 2>&1
grep -q "the implementation refuses router.gate_dtype: fp32, which profile torchtitan fixes in every configuration .*: no configuration of this profile can run it; shipped profiles that fix router.gate_dtype otherwise: torchtitan-0.3 (act)" "$work/o3p.txt" ||
  { cat "$work/o3p.txt"; fail "a fixed key refused: not named"; }
# --set: a key fixed in every configuration (here alone and over a
# profile), in every exported case, on the replay line; a value the
# implementation refuses is named as the --set's; a key the profile fixes
# otherwise, or allows otherwise, refused.
"$bin" fuzz --impl "$py -c \"import json, sys; c = json.load(open(sys.argv[1] + '/manifest.json'))['case']; sys.exit(0 if c['combine.order'] == 'any' and c['dtype'] == 'bf16' else 9)\" {case}" \
  --set combine.order=any --set dtype=bf16 --iterations 6 --seed 2 --no-shrink --out "$work/out3s" \
  --json "$work/s3s.json" >"$work/o3s.txt" 2>&1
[ "$(field "$work/s3s.json" judged)" -eq 6 ] && [ "$(field "$work/s3s.json" crashed)" -eq 0 ] ||
  { cat "$work/o3s.txt"; fail "--set: a configuration without combine.order: any and dtype: bf16"; }
grep -q "(replay: .* --set combine.order=any --set dtype=bf16)" "$work/o3s.txt" && grep -q "^   --set combine.order=any dtype=bf16  (in every configuration)" "$work/o3s.txt" ||
  { cat "$work/o3s.txt"; fail "--set: not on the replay line and the summary"; }
"$bin" fuzz --impl "$numpy {case}" --profile "$profile" --set combine.order=any --iterations 8 --seed 3 --jobs 2 \
  --out "$work/out3s" --json "$work/s3s2.json" >"$work/o3s2.txt" 2>&1 || { cat "$work/o3s2.txt"; fail "--set over a profile: exit $?"; }
[ "$(field "$work/s3s2.json" passed)" -eq 8 ] || { cat "$work/o3s2.txt"; fail "--set over a profile: not 8 PASSED"; }
"$bin" fuzz --impl "echo 'combine.order: any; runs ascending' >&2; exit 77; : {case}" --set combine.order=any \
  --iterations 3 --seed 1 >"$work/o3sr.txt" 2>&1
grep -q "the implementation refuses combine.order: any, which --set combine.order=any fixes in every configuration" "$work/o3sr.txt" ||
  { cat "$work/o3sr.txt"; fail "a --set value refused: not named as the --set's"; }
for bad in "experts.rounding=fp32|profile torchtitan fixes experts.rounding to torchtitan" \
           "ep=16|profile torchtitan allows ep only in {1, 2, 4, 8}" "seed=3|not a case key the fuzz can fix" \
           "backend=cuda|valid: --backend cuda"; do
  "$bin" fuzz --impl "true {case}" --profile torchtitan --set "${bad%%|*}" --iterations 1 >"$work/o3b.txt" 2>&1
  rc=$?
  [ "$rc" -eq 2 ] && grep -qF -- "${bad#*|}" "$work/o3b.txt" || { cat "$work/o3b.txt"; fail "--set ${bad%%|*}: exit $rc"; }
done
# (named in counting order: 2 before 10)
mkdir -p "$work/out3n" && touch "$work/out3n/fuzz_7_10.yaml" "$work/out3n/fuzz_7_2.yaml" "$work/out3n/fuzz_7_9.yaml"
"$bin" fuzz --impl "true {case}" --iterations 1 --seed 1 --no-shrink --out "$work/out3n" >"$work/o3n.txt" 2>&1
grep -q "already holds 3 case file(s) of earlier runs (fuzz_7_2.yaml, fuzz_7_9.yaml, fuzz_7_10.yaml)" "$work/o3n.txt" ||
  { cat "$work/o3n.txt"; fail "--out: earlier case files not in counting order"; }
# ... a worker's too, its command run as the fuzz ran it (sh -c: VAR=value,
# a leading parenthesis or a # stay inside it), and the line runs as printed
"$bin" fuzz --impl "X=1 sleep 30 # a worker" --worker --impl-timeout 0.5 --iterations 1 --seed 1 --no-shrink \
  --out "$work/out3h" --json "$work/s3h.json" >"$work/o3h.txt" 2>&1
repro=$("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['failures'][0]['repro'])" "$work/s3h.json")
case $repro in *"| timeout 0.5 sh -c 'X=1 sleep 30 # a worker'; "*) ;; *) fail "a hung worker's repro line: $repro" ;; esac
(eval "$repro") >"$work/repro3h.txt" 2>&1
rc=$?
[ "$rc" -eq 4 ] && ! grep -q "failed to run command\|syntax error" "$work/repro3h.txt" ||
  { cat "$work/repro3h.txt"; fail "a hung worker's repro line does not run as printed: exit $rc"; }
# shrinking a hang stops at --shrink-seconds (each candidate that still hangs
# costs the whole --impl-timeout)
start=$(date +%s)
"$bin" fuzz --impl "sleep 30; : {case}" --impl-timeout 0.3 --shrink-seconds 1 --iterations 1 --seed 1 \
  --out "$work/out3l" --json "$work/s3l.json" >"$work/o3l.txt" 2>&1
took=$(( $(date +%s) - start ))
grep -q "shrinking stopped at --shrink-seconds 1" "$work/o3l.txt" && [ "$took" -le 10 ] ||
  { cat "$work/o3l.txt"; fail "--shrink-seconds 1: took $took s, or the stop is not said"; }
pgrep -f "^sleep 30$" >/dev/null && fail "the timed-out command's process was left running"
# exit 77 on everything: counted skipped, nothing PASSED: NOT_VERIFIED (exit 4)
"$bin" fuzz --impl "echo 'no EP here' >&2; exit 77; : {case}" --iterations 4 --seed 1 --json "$work/s3u.json" \
  --out "$work/out3" >"$work/o3u.txt" 2>&1
rc=$?
[ "$rc" -eq 4 ] && [ "$(field "$work/s3u.json" skipped)" -eq 4 ] && [ "$(field "$work/s3u.json" passed)" -eq 0 ] ||
  { cat "$work/o3u.txt"; fail "exit 77: exit $rc"; }
grep -q "skipped 4: no EP here" "$work/o3u.txt" || fail "exit 77: the reason is not shown"
# exit 0 without writing anything: NOT_VERIFIED, not PASSED
"$bin" fuzz --impl "true {case}" --iterations 2 --seed 1 --json "$work/s3n.json" --out "$work/out3" >"$work/o3n.txt" 2>&1
rc=$?
[ "$rc" -eq 4 ] && [ "$(field "$work/s3n.json" not_verified)" -eq 2 ] || fail "nothing written: exit $rc"
# ... and what they checked nothing of is listed (text and JSON)
grep -q "NOT_VERIFIED 2: no actual/ folder: nothing written" "$work/o3n.txt" &&
  "$py" -c "import json, sys; assert json.load(open(sys.argv[1]))['not_verified_checks'] == {'-/actual/-': 2}" "$work/s3n.json" ||
  { cat "$work/o3n.txt"; fail "nothing written: the NOT_VERIFIED reasons are not listed"; }
# a worker that answers nonsense, and one that dies on its second request
"$bin" fuzz --impl "while read d; do echo maybe; done" --worker --iterations 2 --seed 1 --no-shrink \
  --out "$work/out3" >"$work/o3p.txt" 2>&1
[ $? -eq 1 ] && grep -q "answered 'maybe'" "$work/o3p.txt" || { cat "$work/o3p.txt"; fail "protocol error"; }
# a worker that prints a banner on stdout at start-up: said so, and not shrunk
# (no configuration causes it; it once cost some 30 runs)
"$bin" fuzz --impl "echo loading my_moe; while read d; do $numpy \"\$d\" >/dev/null; echo done; done" --worker \
  --profile "$profile" --iterations 2 --seed 1 --out "$work/out3" --json "$work/s3b.json" >"$work/o3b.txt" 2>&1
[ $? -eq 1 ] && grep -q "answered 'loading my_moe'.*it was the new worker's first line: printed at start-up?" "$work/o3b.txt" &&
  grep -q "not shrunk: a protocol error is not the configuration's" "$work/o3b.txt" &&
  "$py" -c "import json, sys; f = json.load(open(sys.argv[1]))['failures']; assert f and all(x['shrunk'] == x['drawn'] for x in f)" "$work/s3b.json" ||
  { cat "$work/o3b.txt"; fail "a start-up banner: not said, or shrunk"; }
cat >"$work/flaky.py" <<EOF
import os, sys
sys.path.insert(0, "$src/examples")
import numpy_moe, moeverify
n = [0]
def once(g):
    n[0] += 1
    if n[0] == 2:
        os._exit(9)  # the worker process dies mid-run
    numpy_moe.implement(g)
moeverify.serve(once)
EOF
"$bin" fuzz --impl "$py $work/flaky.py" --worker --profile "$profile" --iterations 6 --seed 3 --no-shrink \
  --out "$work/out3" --json "$work/s3f.json" >"$work/o3f.txt" 2>&1
[ "$(field "$work/s3f.json" crashed)" -ge 1 ] && [ "$(field "$work/s3f.json" passed)" -ge 3 ] ||
  { cat "$work/o3f.txt"; fail "a dying worker: not reported as crashed, or not restarted"; }
# control sequences on the implementation's stderr reach the report escaped
# (they once cleared the terminal), and --keep names the folder it keeps
"$bin" fuzz --impl "printf 'boom\\033[2J\\007\\n' >&2; exit 1; : {case}" --iterations 1 --seed 1 --no-shrink --keep \
  --out "$work/out3" >"$work/o3e.txt" 2>"$work/o3e.err"
kept=$(sed -n 's/^fuzz --impl: --keep: the case folders stay in //p' "$work/o3e.err")
! grep -q $'\033' "$work/o3e.txt" && grep -q 'boom\\x1b\[2J\\x07' "$work/o3e.txt" && [ -n "$kept" ] && [ -d "$kept" ] ||
  { cat "$work/o3e.txt" "$work/o3e.err"; fail "stderr control sequences not escaped, or --keep's folder not named"; }
rm -rf "$kept"
# a second interrupt ends a hung implementation now (its process group is its
# own: the terminal's Ctrl-C never reaches it), instead of at --impl-timeout
"$bin" fuzz --impl "sleep 600; : {case}" --seconds 600 --seed 1 --no-shrink --out "$work/out3" >"$work/o3i.txt" 2>&1 &
fz=$!
sleep 2; kill -INT $fz; sleep 1; kill -INT $fz
for _ in $(seq 100); do kill -0 $fz 2>/dev/null || break; sleep 0.2; done
if kill -0 $fz 2>/dev/null; then kill -KILL $fz; fail "two interrupts did not end a hung implementation within 20 s"; fi
wait $fz
echo $? >"$work/o3i.rc"
# (its command line names its case folder, under this test's TMPDIR)
grep -q "interrupted again; ending the implementation's processes" "$work/o3i.txt" &&
  grep -q "^   interrupted: the draws (and any shrinking) ended early on SIGINT (exit 130: a run cut short is not a pass)" "$work/o3i.txt" && ! pgrep -f "sleep 600; : .*$TMPDIR" >/dev/null ||
  { cat "$work/o3i.txt"; fail "second interrupt: not said, or the implementation left running"; }
[ "$(cat "$work/o3i.rc")" -eq 130 ] || { cat "$work/o3i.txt"; fail "interrupted: exit $(cat "$work/o3i.rc"), not 130"; }
# a run cut short by SIGTERM (a CI step's timeout) after some configurations
# PASSED is not a pass: exit 143
"$bin" fuzz --impl "$numpy --serve" --worker --profile "$profile" --seconds 600 --seed 9 \
  --out "$work/out3" --json "$work/s3g.json" >"$work/o3g.txt" 2>&1 &
fz=$!
for _ in $(seq 150); do grep -q "PASSED" "$work/o3g.txt" 2>/dev/null && break; sleep 0.2; done
kill -TERM $fz
wait $fz
rc=$?
[ "$rc" -eq 143 ] && [ "$(field "$work/s3g.json" passed)" -ge 1 ] && [ "$(field "$work/s3g.json" interrupted)" = True ] ||
  { cat "$work/o3g.txt"; fail "SIGTERM after PASSED configurations: exit $rc, not 143 (or nothing PASSED first)"; }
# a worker that answers twice per folder: the second answer once stood for the
# next folder, judged before it was written (NOT_VERIFIED, exit 0)
cat >"$work/twice.py" <<EOF
import subprocess, sys
for line in sys.stdin:
    subprocess.run(["$py", "$src/examples/numpy_moe.py", line.strip()], stdout=subprocess.DEVNULL)
    print("done\\ndone", flush=True)
EOF
"$bin" fuzz --impl "$py $work/twice.py" --worker --profile "$profile" --iterations 4 --seed 5 --no-shrink \
  --out "$work/out3" --json "$work/s3d.json" >"$work/o3d.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && [ "$(field "$work/s3d.json" not_verified)" -eq 0 ] && grep -q "beyond its one answer line" "$work/o3d.txt" ||
  { cat "$work/o3d.txt"; fail "a worker answering twice: exit $rc, not a protocol error"; }
# an implementation that rewrites the manifest (its conventions changed to fit
# its outputs) is not judged on the rewritten one
cat >"$work/tamper.sh" <<EOF
$numpy "\$1" >/dev/null && sed -i 's/"seed": /"seed": 1/' "\$1/manifest.json"
EOF
"$bin" fuzz --impl "bash $work/tamper.sh {case}" --profile "$profile" --iterations 2 --seed 1 --no-shrink \
  --out "$work/out3" >"$work/o3m.txt" 2>&1
rc=$?
[ "$rc" -eq 1 ] && grep -q "ERROR at impl/manifest" "$work/o3m.txt" ||
  { cat "$work/o3m.txt"; fail "a rewritten manifest: exit $rc, not reported"; }

echo "== 4. bad input: exit 2 with what would be valid"
expect2() {
  local what=$1 want=$2; shift 2
  "$@" >"$work/o4.txt" 2>&1
  local rc=$?
  [ "$rc" -eq 2 ] && grep -q "$want" "$work/o4.txt" || { cat "$work/o4.txt"; fail "$what: exit $rc"; }
}
expect2 "no {case}" "no {case} in the command" "$bin" fuzz --impl "$numpy" --iterations 1
expect2 "{case} with --worker" "the worker reads case folders on stdin" "$bin" fuzz --impl "x {case}" --worker --iterations 1
expect2 "--worker without --impl" "go with --impl" "$bin" fuzz --worker --iterations 1
expect2 "--strict-ties without --impl" "go with --impl" "$bin" fuzz --strict-ties --iterations 1
expect2 "--require: no such stage" "'routng' is not a stage; valid: all, stage names" "$bin" fuzz --impl "x {case}" --require routng --iterations 1
expect2 "--emit without --iterations" "writes --iterations N configurations" "$bin" fuzz --emit "$work/e.yaml" --seconds 1
# A profile whose fixed keys need its one-value allow rules (megatron-0.16's
# score_on_hidden needs the swiglu experts it allows alone): every seed finds
# configurations. Seed 37 found none in 200 draws when the draws were loaded
# with the fixes alone (exit 2); an implementation that writes nothing is
# NOT_VERIFIED, exit 4.
for seed in 4 37 39; do
  "$bin" fuzz --impl "true {case}" --profile megatron-0.16 --iterations 2 --seed $seed >"$work/pin.txt" 2>&1
  rc=$?
  [ "$rc" -eq 4 ] || { cat "$work/pin.txt"; fail "megatron-0.16, seed $seed: exit $rc, expected 4 (configurations drawn, none passed)"; }
done
# fuzz --emit (plain fuzz, no --impl): the configurations inside the profile
# as a case file that loads, every case with the profile's fixed keys.
"$bin" fuzz --emit "$work/e.yaml" --iterations 30 --seed 3 --profile torchtitan >/dev/null || fail "fuzz --emit: exit $?"
"$bin" validate "$work/e.yaml" --profile torchtitan >"$work/e.txt" 2>&1 || { cat "$work/e.txt"; fail "emitted cases do not validate"; }
grep -q "30 of 30 case(s) inside the profile" "$work/e.txt" || { cat "$work/e.txt"; fail "emitted cases outside the profile"; }
expect2 "unknown profile" "valid: megatron, megatron-0.16, megatron-0.16-probs-on-input, torchtitan, torchtitan-0.3" "$bin" fuzz --impl "x {case}" --profile nosuch --iterations 1
printf 'fix:\n  experts.rounding: fused\nallow:\n  ep: [1, 2]\n  combine.acumulate: [per_add]\n' >"$work/p.yaml"
expect2 "a profile with an unknown key" "p.yaml:5:3: allow: 'combine.acumulate' is not a case key" \
  "$bin" validate --profile "$work/p.yaml"
printf 'allow:\n  ep: [1, 2]\n  dtype: [fp64]\n' >"$work/p.yaml"
expect2 "a profile with a bad value" "p.yaml:3:11: allow dtype: .*valid: fp32 | bf16 | fp16" \
  "$bin" validate --profile "$work/p.yaml"
printf 'allow:\n  sp: [2]\n  router.force_load_balance: ["on"]\n' >"$work/p.yaml"
expect2 "a profile nothing fits" "no configuration in 200 draws lies inside it" \
  "$bin" fuzz --impl "x {case}" --profile "$work/p.yaml" --iterations 1
# the same refused by validate and by fuzz without --impl (which once wrote
# "ERROR at generator" failures with empty cases)
printf 'allow:\n  shape.experts: [3]\n  ep: [2]\n' >"$work/p.yaml"
expect2 "validate: a profile nothing fits" "no configuration in 200 draws lies inside it" \
  "$bin" validate --profile "$work/p.yaml"
expect2 "fuzz: a profile nothing fits" "no configuration in 200 draws lies inside it" \
  "$bin" fuzz --profile "$work/p.yaml" --iterations 2 --out "$work/out4"
echo "fuzz --impl: every check passed"
