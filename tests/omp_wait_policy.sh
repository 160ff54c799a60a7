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

OMP_WAIT_POLICY= OMP_DISPLAY_ENV=verbose "$bin" list > /dev/null 2> "$tmp/empty.txt"
[ "$(spincount "$tmp/empty.txt")" = 0 ] || { cat "$tmp/empty.txt"; fail "empty OMP_WAIT_POLICY: libgomp did not run passive"; }

# Started through the loader, a re-exec of /proc/self/exe (the loader) would
# lose the program: moeverify runs on with libgomp's default instead.
for ld in /lib64/ld-linux-x86-64.so.2 /lib/ld-linux-aarch64.so.1; do
  [ -x "$ld" ] || continue
  env -u OMP_WAIT_POLICY "$ld" "$bin" list > "$tmp/ld.txt" 2>&1 || { cat "$tmp/ld.txt"; fail "run through $ld failed"; }
done

OMP_WAIT_POLICY=active OMP_DISPLAY_ENV=verbose "$bin" list > /dev/null 2> "$tmp/active.txt"
[ "$(grep -c "GOMP_SPINCOUNT" "$tmp/active.txt")" -eq 1 ] || { cat "$tmp/active.txt"; fail "OMP_WAIT_POLICY=active: re-executed"; }
[ "$(spincount "$tmp/active.txt")" -gt 300000 ] || { cat "$tmp/active.txt"; fail "OMP_WAIT_POLICY=active was not kept"; }

# The bench JSON names the policy in effect.
env -u OMP_WAIT_POLICY "$bin" bench "$src/cases/basic.yaml" --case exact_fp32 --repeat 1 --warmup 0 \
  --json "$tmp/b.json" > /dev/null 2>&1 || fail "bench failed"
grep -q '"omp_wait_policy": "passive (moeverify'"'"'s default)"' "$tmp/b.json" || fail "bench JSON: $(grep omp_wait "$tmp/b.json")"

# A command moeverify starts sees the user's environment: no OMP_WAIT_POLICY
# (and no marker) when the user set none, the user's value when they did.
# The re-executed process keeps its name (pgrep, top, core files).
impl="env > $tmp/env.txt; cat /proc/\$PPID/comm > $tmp/comm.txt; echo {case} > /dev/null; exit 77"
env -u OMP_WAIT_POLICY "$bin" fuzz --impl "$impl" --iterations 1 --seed 1 > /dev/null 2>&1 || true
[ -s "$tmp/env.txt" ] || fail "the --impl command did not run"
grep -qx "$(basename "$bin")" "$tmp/comm.txt" || fail "the process is named $(cat "$tmp/comm.txt")"
! grep -qE "^(OMP_WAIT_POLICY|MOEVERIFY_SET_OMP_WAIT_POLICY)=" "$tmp/env.txt" || fail "--impl inherited moeverify's default: $(grep OMP "$tmp/env.txt")"
OMP_WAIT_POLICY=active "$bin" fuzz --impl "$impl" --iterations 1 --seed 1 > /dev/null 2>&1 || true
grep -qx "OMP_WAIT_POLICY=active" "$tmp/env.txt" || fail "--impl lost the user's OMP_WAIT_POLICY"
echo "ok: passive by default, the user's policy kept, children see the user's environment"
