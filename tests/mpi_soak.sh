#!/usr/bin/env bash
# MPI soak (issue 35): the fuzz's random valid configurations, drawn on
# EP = 2 and EP = 4 (`fuzz --emit` inside a profile that allows one ep; the
# draws hold zero-token ranks in every position), run under mpirun, one
# process per rank. Every case must end PASSED or NOT_VERIFIED: an
# INCORRECT or ERROR on a valid configuration is a false alarm, and a
# collective that never completes fails too (the timeout, then `timeout`).
#   mpi_soak.sh MPIEXEC MOEVERIFY N SEED
# N configurations per EP size; the case files and reports are kept in
# $MOEVERIFY_SOAK_KEEP when it is set. The MPI environment (root,
# oversubscription, loopback) comes from ctest.
set -u
mpiexec=$1
bin=$2
n=$3
seed=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
out=${MOEVERIFY_SOAK_KEEP:-$tmp}
mkdir -p "$out"
fails=0
for R in 2 4; do
  printf 'profile: ep%s\nabout: every drawn configuration on %s EP ranks\nallow:\n  ep: [%s]\n' "$R" "$R" "$R" >"$tmp/ep$R.yaml"
  "$bin" fuzz --emit "$out/soak_ep$R.yaml" --iterations "$n" --seed "$seed" --profile "$tmp/ep$R.yaml" >/dev/null || exit 1
  zeros=$(grep -c "tokens_per_rank: \[[^]]*\b0\b" "$out/soak_ep$R.yaml")
  start=$SECONDS
  timeout -k 5 1200 "$mpiexec" -np "$R" "$bin" run "$out/soak_ep$R.yaml" --threads 1 --collective-timeout 60 \
    --json "$out/soak_ep$R.json" >"$out/soak_ep$R.log" 2>&1
  rc=$?
  summary=$(/usr/bin/python3 - "$out/soak_ep$R.json" "$n" <<'PY'
import collections, json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("BAD report unreadable: %s" % e)
    sys.exit()
c = collections.Counter(x.get("outcome") for x in r["cases"])
bad = [x["name"] + " " + x.get("outcome", "?") for x in r["cases"] if x.get("outcome") not in ("PASSED", "NOT_VERIFIED")]
text = ", ".join("%s %d" % kv for kv in sorted(c.items()))
if bad or len(r["cases"]) != int(sys.argv[2]):
    print("BAD %d of %s cases in the report (%s); not PASSED or NOT_VERIFIED: %s" % (len(r["cases"]), sys.argv[2], text, "; ".join(bad[:10])))
else:
    print(text)
PY
)
  if [ "$rc" = 124 ] || [ "$rc" = 137 ] || grep -q "not complete after" "$out/soak_ep$R.log" || [[ "$summary" == BAD* ]] ||
     { [ "$rc" != 0 ] && [ "$rc" != 4 ]; }; then
    echo "FAIL EP = $R, seed $seed: exit $rc; $summary"
    grep -E "INCORRECT|ERROR|not complete|internal error" "$out/soak_ep$R.log" | head -20
    fails=$((fails + 1))
  else
    echo "ok   EP = $R, seed $seed: $n configurations ($zeros with a zero-token rank) under mpirun -np $R in $((SECONDS - start)) s, exit $rc: $summary"
  fi
done
[ "$fails" = 0 ] || { echo "replay: moeverify fuzz --emit F --iterations $n --seed $seed --profile P, then mpirun -np R moeverify run F"; exit 1; }
