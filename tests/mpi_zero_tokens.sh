#!/usr/bin/env bash
# MPI property (issue 21 item 1): ranks holding zero tokens, in any position
# (the last ones included), on EP = 2 and EP = 4. Under mpirun every case
# must end as it ends in one process: the same exit status and, in the JSON
# reports, the same outcome, checks, notes and stage decisions (timings
# aside). A collective that never completes fails the property on its own
# (moeverify's collective timeout, then `timeout`), so a hang cannot pass.
#   mpi_zero_tokens.sh MPIEXEC MOEVERIFY [SEED...]
# The seeds draw the random token layouts; without any, a fixed list plus two
# fresh draws, each printed, so that a failure can be replayed by passing its
# seed. Fixed layouts (every single zero position, all-but-one zero, all
# zero) run once besides. The MPI environment (root, oversubscription,
# loopback) comes from ctest.
set -u
mpiexec=$1
bin=$2
shift 2
seeds=("$@")
if [ ${#seeds[@]} -eq 0 ]; then
  seeds=(11 12 13)
  for _ in 1 2; do seeds+=($(od -An -N3 -tu4 /dev/urandom | tr -d ' ')); done
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# case NAME EP TOKENS_PER_RANK EXPERTS TOP_K POLICY KIND
case_yaml() {
  echo "  - name: $1"
  echo "    ep: $2"
  echo "    shape: {tokens_per_rank: [$3], hidden: 8, ffn: 8, experts: $4, top_k: $5}"
  echo "    equal_split: {policy: $6}"
  echo "    experts: {kind: $7}"
}

header() {
  echo "defaults:"
  echo "  data: exact"
  echo "  seed: $1"
  echo "cases:"
}

# One random case for EP = $1 (bash's RANDOM, seeded by the caller): each
# rank's tokens are 0 with probability 1/2, else 1 to 3 (few tokens, so that
# often a rank neither sends nor receives a row), and the last rank is zero
# in half the cases besides, so that trailing zeros are drawn often.
random_case() {
  local R=$1 name=$2 t=() e k
  for ((r = 0; r < R; ++r)); do
    if ((RANDOM % 2)); then t+=(0); else t+=($((1 + RANDOM % 3))); fi
  done
  ((RANDOM % 2)) && t[R - 1]=0
  e=$((R * (1 + RANDOM % 2)))
  k=$((1 + RANDOM % 2))
  local policies=(off off force adaptive) kinds=(identity identity swiglu)
  case_yaml "$name" "$R" "$(IFS=,; echo "${t[*]}")" "$e" "$k" "${policies[RANDOM % 4]}" "${kinds[RANDOM % 3]}"
}

# Compares the in-process and the mpirun run of FILE on R ranks.
compare() {
  local file=$1 R=$2 label=$3
  timeout -k 5 120 "$bin" run "$file" --threads 1 --json "$tmp/local.json" >"$tmp/local.log" 2>&1
  local rc_local=$?
  timeout -k 5 120 "$mpiexec" -np "$R" "$bin" run "$file" --threads 1 --collective-timeout 30 \
    --json "$tmp/mpi.json" >"$tmp/mpi.log" 2>&1
  local rc_mpi=$?
  local why=""
  if grep -q "not complete after" "$tmp/mpi.log" || [ $rc_mpi -eq 124 ] || [ $rc_mpi -eq 137 ]; then
    why="a collective never completed under mpirun"
  elif [ $rc_local -ne $rc_mpi ]; then
    why="exit status $rc_local in one process, $rc_mpi under mpirun"
  else
    why=$(python3 - "$tmp/local.json" "$tmp/mpi.json" <<'EOF'
import json, sys

def strip(x):
    """The report without its timings."""
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "seconds" and not k.endswith("_seconds")}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x

try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except Exception as e:  # a report missing or unreadable is a difference too
    print(f"report unreadable: {e}")
    sys.exit()
ca, cb = a.get("cases", []), b.get("cases", [])
if len(ca) != len(cb):
    print(f"{len(ca)} cases in one process, {len(cb)} under mpirun")
for x, y in zip(ca, cb):
    sx, sy = strip(x), strip(y)
    for key in sorted(set(sx) | set(sy)):
        if sx.get(key) != sy.get(key):
            print(f"case {x.get('name')}: '{key}' differs ({str(sx.get(key))[:200]} vs {str(sy.get(key))[:200]})")
            break
EOF
)
  fi
  if [ -n "$why" ]; then
    echo "FAIL $label: $why"
    echo "--- $file"; cat "$file"
    echo "--- in one process (exit $rc_local)"; tail -15 "$tmp/local.log"
    echo "--- under mpirun -np $R (exit $rc_mpi)"; tail -15 "$tmp/mpi.log"
    failures=$((failures + 1))
  else
    echo "ok   $label: $(grep -c '^  - name:' "$file") cases, exit $rc_local in both"
  fi
}

# Fixed layouts: a zero in every position, every rank but one zero, all zero.
{
  header 5
  case_yaml z2_10 2 1,0 8 2 off identity
  case_yaml z2_20 2 2,0 8 2 off identity
  case_yaml z2_01 2 0,1 8 2 off identity
  case_yaml z2_00 2 0,0 8 2 off identity
  case_yaml z2_10_e2k1 2 1,0 2 1 off identity
  case_yaml z2_30_force 2 3,0 4 1 force swiglu
} >"$tmp/fixed2.yaml"
{
  header 5
  case_yaml z4_1000 4 1,0,0,0 8 2 off identity
  case_yaml z4_0100 4 0,1,0,0 8 2 off identity
  case_yaml z4_0010 4 0,0,1,0 8 2 off identity
  case_yaml z4_0001 4 0,0,0,1 8 2 off identity
  case_yaml z4_3120 4 3,1,2,0 4 1 off swiglu
  case_yaml z4_0000 4 0,0,0,0 8 2 off identity
  case_yaml z4_2003_adaptive 4 2,0,0,3 8 2 adaptive identity
} >"$tmp/fixed4.yaml"
compare "$tmp/fixed2.yaml" 2 "fixed layouts, EP = 2"
compare "$tmp/fixed4.yaml" 4 "fixed layouts, EP = 4"

for s in "${seeds[@]}"; do
  RANDOM=$s
  for R in 2 4; do
    {
      header "$s"
      for i in 1 2 3 4 5 6; do random_case "$R" "s${s}_ep${R}_$i"; done
    } >"$tmp/random.yaml"
    compare "$tmp/random.yaml" "$R" "seed $s, EP = $R"
  done
done

if [ $failures -ne 0 ]; then
  echo "$failures comparison(s) failed; replay with: mpi_zero_tokens.sh MPIEXEC MOEVERIFY SEED..."
  exit 1
fi
echo "all comparisons equal (seeds ${seeds[*]})"
