#!/usr/bin/env bash
# OpenMP's wait policy (docs/guide.md, "Threads and the OpenMP wait policy"):
# without OMP_WAIT_POLICY, moeverify re-executes itself with the passive
# policy, so its idle OpenMP threads sleep instead of spinning on cores that
# other threads need. What libgomp actually took is read from libgomp itself
# (OMP_DISPLAY_ENV=verbose prints its settings as it loads: GOMP_SPINCOUNT 0
# is passive, 300000 its default, 30000000000 active). The user's own choice
# is kept, and the commands moeverify starts (--impl) see the user's
# environment, not moeverify's default.
set -euo pipefail
bin=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# The last GOMP_SPINCOUNT libgomp printed: the settings of the process that ran.
spincount() { grep -E "^ *GOMP_SPINCOUNT = " "$1" | tail -n 1 | sed -E "s/.*= '([0-9]+)'.*/\1/"; }

env -u OMP_WAIT_POLICY OMP_DISPLAY_ENV=verbose "$bin" list > /dev/null 2> "$tmp/default.txt"
[ "$(spincount "$tmp/default.txt")" = 0 ] || { cat "$tmp/default.txt"; fail "no OMP_WAIT_POLICY: libgomp did not run passive"; }

OMP_WAIT_POLICY=active OMP_DISPLAY_ENV=verbose "$bin" list > /dev/null 2> "$tmp/active.txt"
[ "$(grep -c "GOMP_SPINCOUNT" "$tmp/active.txt")" -eq 1 ] || { cat "$tmp/active.txt"; fail "OMP_WAIT_POLICY=active: re-executed"; }
[ "$(spincount "$tmp/active.txt")" -gt 300000 ] || { cat "$tmp/active.txt"; fail "OMP_WAIT_POLICY=active was not kept"; }

# The bench JSON names the policy in effect.
env -u OMP_WAIT_POLICY "$bin" bench "$src/cases/basic.yaml" --case exact_fp32 --repeat 1 --warmup 0 \
  --json "$tmp/b.json" > /dev/null 2>&1 || fail "bench failed"
grep -q '"omp_wait_policy": "passive (moeverify'"'"'s default)"' "$tmp/b.json" || fail "bench JSON: $(grep omp_wait "$tmp/b.json")"

# A command moeverify starts sees the user's environment: no OMP_WAIT_POLICY
# (and no marker) when the user set none, the user's value when they did.
impl="env > $tmp/env.txt; echo {case} > /dev/null; exit 77"
env -u OMP_WAIT_POLICY "$bin" fuzz --impl "$impl" --iterations 1 --seed 1 > /dev/null 2>&1 || true
[ -s "$tmp/env.txt" ] || fail "the --impl command did not run"
! grep -qE "^(OMP_WAIT_POLICY|MOEVERIFY_SET_OMP_WAIT_POLICY)=" "$tmp/env.txt" || fail "--impl inherited moeverify's default: $(grep OMP "$tmp/env.txt")"
OMP_WAIT_POLICY=active "$bin" fuzz --impl "$impl" --iterations 1 --seed 1 > /dev/null 2>&1 || true
grep -qx "OMP_WAIT_POLICY=active" "$tmp/env.txt" || fail "--impl lost the user's OMP_WAIT_POLICY"
echo "ok: passive by default, the user's policy kept, children see the user's environment"
