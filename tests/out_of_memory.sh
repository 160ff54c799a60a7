#!/usr/bin/env bash
# Out of memory (issue 21 item 2): an allocation that fails, in any thread
# (the ranks' input generation and the stages run in OpenMP regions), ends the
# run with exit 3 and one line naming the case, the stage and, where known,
# the bytes asked for; never SIGABRT (134) or "terminate called".
#   out_of_memory.sh MOEVERIFY
# The address space is capped with `ulimit -v` below what the case needs;
# --max-memory lifts the estimate's refusal so that the case starts.
set -u
bin=$1
if ldd "$bin" 2>/dev/null | grep -q 'libasan'; then
  echo "skipped: AddressSanitizer reserves more address space than ulimit -v leaves"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# expect NAME ULIMIT_KB PATTERN: the run of $tmp/NAME.yaml must exit 3 with
# exactly one line of moeverify's on stderr, matching PATTERN (grep -E).
expect() {
  local name=$1 cap=$2 pattern=$3
  (ulimit -v "$cap" && exec "$bin" run "$tmp/$name.yaml" --threads 2 --max-memory 1T) >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local lines
  lines=$(grep -c '^moeverify: ' "$tmp/err")
  if [ $rc -ne 3 ] || [ "$lines" -ne 1 ] || ! grep -qE "$pattern" "$tmp/err" || grep -q 'terminate called' "$tmp/err"; then
    echo "FAIL $name: exit $rc (want 3), $lines line(s) of moeverify's (want 1) matching: $pattern"
    cat "$tmp/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: exit 3; $(grep '^moeverify: ' "$tmp/err" | cut -c1-160)"
  fi
}

# x of each rank is 2^20 x 1024 fp32 elements (4 GiB), generated on the
# run's two threads: the allocation fails inside the OpenMP region.
cat >"$tmp/inputs.yaml" <<'EOF'
cases:
  - name: big_inputs
    ep: 2
    shape: {tokens: 1048576, hidden: 1024, ffn: 8, experts: 8, top_k: 2}
EOF
expect inputs 2000000 \
  "^moeverify: out of memory in case 'big_inputs', stage input generation: an allocation of 4294967296 bytes \(4.00 GiB\) failed"

# The inputs fit (512 MiB of x a rank); a stage's buffers do not.
cat >"$tmp/stage.yaml" <<'EOF'
cases:
  - name: mid_stage
    ep: 2
    shape: {tokens: 131072, hidden: 1024, ffn: 8, experts: 8, top_k: 2}
EOF
expect stage 1500000 "^moeverify: out of memory in case 'mid_stage', stage [a-z_]+/[a-z0-9_]+: an allocation"

# Without --max-memory the default limit is what the process can get: under
# ulimit -v, 80% of it; with many ranks of an MPI job on this node (mpirun
# sets OMPI_COMM_WORLD_LOCAL_SIZE), the node's memory divided among them.
# Either refuses the case before it runs: exit 2, the bound named.
refused() {
  local name=$1 pattern=$2 rc
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if [ $rc -ne 2 ] || ! grep -qE "$pattern" "$tmp/err"; then
    echo "FAIL $name: exit $rc (want 2), stderr not matching: $pattern"
    cat "$tmp/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: exit 2; $(grep '^moeverify: ' "$tmp/err" | cut -c1-200)"
  fi
}
refused ulimit_default "exceeds the limit .* \(the default: 80% of the address-space limit \(ulimit -v\) 1.9 GiB; set it with --max-memory\)" \
  bash -c 'ulimit -v 2000000 && exec "$0" run "$1" --threads 2' "$bin" "$tmp/stage.yaml"
refused node_ranks "\(the default: 80% of (physical memory|the cgroup limit) .*, shared by 100000 ranks on this node; set it with --max-memory\)" \
  env OMPI_COMM_WORLD_LOCAL_SIZE=100000 "$bin" run "$tmp/stage.yaml" --threads 2

[ $failures -eq 0 ] || exit 1
