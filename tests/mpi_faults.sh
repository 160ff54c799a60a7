#!/usr/bin/env bash
# MPI fault tests (issue 11 §6), each bounded in time; a hang is a failure.
#   mpi_faults.sh MPIEXEC MOEVERIFY disagree seed|hidden|top_k|fewer_cases
#       MPMD launch, one rank per file; the second file differs from the
#       first in one way: every rank must refuse with exit 2, said once.
#   mpi_faults.sh MPIEXEC MOEVERIFY signal KILL|STOP
#       a 2-rank run; once rank 0 is past its first case, rank 1 gets the
#       signal: the job must end non-zero within the deadline, with mpirun's
#       note (KILL) or moeverify's collective timeout (STOP) on stderr.
#   mpi_faults.sh MPIEXEC MOEVERIFY stop_at
#       rank 1 stops itself at its 6th collective: rank 0 must name it.
#   mpi_faults.sh MPIEXEC MOEVERIFY stop_inside
#       3 ranks; rank 1 stops itself inside the dispatch all-to-all, after
#       its arrival notice: a live rank must name rank 1 (fallen silent),
#       and none the other live rank (it waits and beats).
#   mpi_faults.sh MPIEXEC MOEVERIFY branch CASEFILE (cases/equal_split.yaml)
#       --fault local_equal_split_decision on 4 ranks: ranks in different
#       collectives end the job at once, naming both (exit 3).
#   mpi_faults.sh MPIEXEC MOEVERIFY errors_once
#       a bad case file on 4 ranks is reported once (exit 2); a file missing
#       for rank 1 alone is reported by rank 1.
#   mpi_faults.sh MPIEXEC MOEVERIFY planted CASEFILE
#       --fault unswapped_combine_splits on 2 ranks: the split check against
#       the buffer sizes turns it into a clean ERROR naming the collective.
# The MPI environment (root, oversubscription, loopback) comes from ctest.
set -u
mpiexec=$1
bin=$2
mode=$3
arg=${4:-}
tmp=$(mktemp -d)
pids=()  # rank processes this script signalled or may have to clean up
cleanup() {
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null && { kill -CONT "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; }
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
fail() { echo "FAIL $mode $arg: $*"; for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -40 "$f"; }; done; exit 1; }

# A small EP = 2 case file; variants differ in one setting.
write_cases() {  # write_cases FILE SEED HIDDEN TOP_K NUM_CASES
  {
    echo "defaults:"
    echo "  data: exact"
    echo "  seed: $2"
    echo "  shape: {tokens: 24, hidden: $3, ffn: 16, experts: 8, top_k: $4}"
    echo "cases:"
    for i in $(seq 1 "$5"); do
      echo "  - name: c$i"
      echo "    ep: 2"
    done
  } >"$1"
}

case $mode in
disagree)
  write_cases "$tmp/a.yaml" 5 16 2 2
  case $arg in
  seed) write_cases "$tmp/b.yaml" 6 16 2 2; want="differs in seed=6 (rank 0: seed=5)" ;;
  hidden) write_cases "$tmp/b.yaml" 5 32 2 2; want="differs in D=32 (rank 0: D=16)" ;;
  top_k) write_cases "$tmp/b.yaml" 5 16 3 2; want="differs in K=3 (rank 0: K=2)" ;;
  fewer_cases) write_cases "$tmp/b.yaml" 5 16 2 1; want="ranks disagree on the number of cases to run: rank 0: 2; rank 1: 1" ;;
  *) echo "unknown variant $arg"; exit 2 ;;
  esac
  start=$(date +%s.%N)
  timeout -k 5 60 "$mpiexec" -np 1 "$bin" run "$tmp/a.yaml" --threads 1 --collective-timeout 10 : \
    -np 1 "$bin" run "$tmp/b.yaml" --threads 1 --collective-timeout 10 >"$tmp/run.log" 2>&1
  rc=$?
  echo "exit $rc after $(secs "$start" "$(date +%s.%N)") s"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && fail "hang: killed by timeout"
  [ "$rc" = 2 ] || fail "exit $rc, expected 2 (bad input on every rank)"
  [ "$arg" = fewer_cases ] || want2="ranks disagree on the configuration of case 'c1': rank 0: config hash"
  n=$(grep -o -F "$want" "$tmp/run.log" | wc -l)  # ranks share stderr: lines may join
  # (said once when mpirun ends the job within say_failure's 3 s; a loaded
  # machine may let rank 1 say it too)
  [ "$n" -ge 1 ] && [ "$n" -le 2 ] || fail "expected '$want' once or twice, found it $n time(s)"
  [ -z "${want2:-}" ] || grep -q -F "$want2" "$tmp/run.log" || fail "no '$want2'"
  grep -q "PASSED\|INCORRECT\|internal error" "$tmp/run.log" && fail "a case ran although the ranks disagree"
  echo "ok   disagree $arg: exit 2, said once: $want"
  ;;

signal)
  [ "$arg" = KILL ] || [ "$arg" = STOP ] || { echo "signal KILL or STOP"; exit 2; }
  write_cases "$tmp/long.yaml" 5 64 2 400  # far more than fits in the test's time: the signal lands mid-run
  start=$(date +%s.%N)
  "$mpiexec" -np 2 "$bin" run "$tmp/long.yaml" --threads 1 --collective-timeout 3 >"$tmp/out.log" 2>"$tmp/err.log" &
  mpirun_pid=$!
  target=""
  for _ in $(seq 1 300); do  # up to 30 s for rank 0 to start its second case
    if [ -z "$target" ]; then
      for p in $(pgrep -P "$mpirun_pid"); do
        tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1" && target=$p
      done
      [ -n "$target" ] && pids+=($(pgrep -P "$mpirun_pid"))  # both ranks, for the cleanup
    fi
    [ -n "$target" ] && grep -q "^\[2/400\]" "$tmp/err.log" && break
    kill -0 "$mpirun_pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$target" ] || { kill -KILL "$mpirun_pid" 2>/dev/null; fail "no rank 1 process under mpirun $mpirun_pid"; }
  grep -q "^\[2/400\]" "$tmp/err.log" || { kill -KILL "$mpirun_pid" 2>/dev/null; fail "rank 0 never reached its second case"; }
  sent=$(date +%s.%N)
  kill -"$arg" "$target"
  # The job must end by itself: 3 s collective deadline plus MPI_Abort's teardown.
  ended=""
  for _ in $(seq 1 300); do
    kill -0 "$mpirun_pid" 2>/dev/null || { ended=1; break; }
    sleep 0.1
  done
  if [ -z "$ended" ]; then
    kill -CONT "$target" 2>/dev/null
    kill -TERM "$mpirun_pid" 2>/dev/null
    sleep 2
    kill -KILL "$mpirun_pid" 2>/dev/null
    wait "$mpirun_pid" 2>/dev/null
    fail "hang: mpirun still running 30 s after SIG$arg to rank 1 (pid $target)"
  fi
  wait "$mpirun_pid"
  rc=$?
  now=$(date +%s.%N)
  echo "exit $rc, $(secs "$sent" "$now") s after SIG$arg to rank 1 (pid $target), $(secs "$start" "$now") s in all"
  [ "$rc" != 0 ] || fail "exit 0 although rank 1 was sent SIG$arg"
  if [ "$arg" = KILL ]; then
    grep -q "process rank 1 with PID [0-9]* on node .* exited on signal 9 (Killed)" "$tmp/err.log" ||
      fail "no note that rank 1 (pid $target) was killed"
  else
    # Rank 1 stopped at a random point: outside a collective (rank 0 names
    # it), or inside one after its arrival notice (rank 0 says every peer
    # reached it); stop_at below holds the naming to a fixed point.
    grep -q "moeverify: rank 0 (.*): collective .* not complete after [0-9.]* s (--collective-timeout); rank(s) 1 \(never reached it\|reached it, then fell silent\)" "$tmp/err.log" ||
      fail "no collective-timeout message from rank 0"
    [ "$rc" = 3 ] || fail "exit $rc, expected 3 (MPI_Abort with moeverify's ERROR status)"
  fi
  grep "moeverify:\|MPI_ABORT\|mpirun noticed" "$tmp/err.log" | sed 's/^/     /'
  for _ in $(seq 1 20); do kill -0 "$target" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$target" 2>/dev/null && fail "rank 1 (pid $target) outlived the job"
  echo "ok   signal $arg: job ended with exit $rc; $(grep -m1 -o "collective .* not complete after [0-9.]* s\|exited on signal 9 (Killed)" "$tmp/err.log")"
  ;;

stop_at)
  # Rank 1 stops itself (SIGSTOP, the test hook MOEVERIFY_TEST_STOP_AT) on
  # reaching its 6th collective: rank 0's timeout line must name it.
  write_cases "$tmp/long.yaml" 5 64 2 4
  MOEVERIFY_TEST_STOP_AT=1:6 timeout -s KILL 60 "$mpiexec" -x MOEVERIFY_TEST_STOP_AT -np 2 "$bin" run "$tmp/long.yaml" \
    --threads 1 --collective-timeout 3 >"$tmp/out.log" 2>"$tmp/err.log"
  rc=$?
  [ "$rc" = 137 ] && fail "hang: killed by timeout"
  [ "$rc" = 3 ] || fail "exit $rc, expected 3"
  grep -q "moeverify: rank 0 (.*): collective .* (.*, number 6) not complete after [0-9.]* s (--collective-timeout); rank(s) 1 never reached it" "$tmp/err.log" ||
    fail "rank 0's timeout line does not name rank 1 as never reaching collective 6"
  echo "ok   stop_at: exit 3; $(grep -m1 -o "collective .* never reached it" "$tmp/err.log")"
  ;;

stop_inside)
  # The dispatch all-to-all-v (collective 14 of this 3-rank case), rows of
  # 8 KiB: above the eager limit, so rank 1's rows move only as it makes
  # progress, and a live rank that receives them cannot complete.
  {
    echo "defaults:"
    echo "  data: exact"
    echo "  seed: 5"
    echo "  shape: {tokens: 24, hidden: 2048, ffn: 16, experts: 12, top_k: 2}"
    echo "cases:"
    echo "  - name: c1"
    echo "    ep: 3"
  } >"$tmp/three.yaml"
  MOEVERIFY_TEST_STOP_AT=1:14:inside timeout -s KILL 60 "$mpiexec" -x MOEVERIFY_TEST_STOP_AT -np 3 "$bin" run \
    "$tmp/three.yaml" --threads 1 --collective-timeout 3 >"$tmp/out.log" 2>"$tmp/err.log"
  rc=$?
  [ "$rc" = 137 ] && fail "hang: killed by timeout"
  [ "$rc" = 3 ] || fail "exit $rc, expected 3"
  # A live rank whose share had all arrived may complete it and time out at
  # the next collective, where rank 1 never arrived: at least one line must
  # name rank 1 inside collective 14, and no line may call a live rank silent.
  grep -q "moeverify: rank [02] (.*): collective token all-to-all (dispatch) (MPI_Ialltoallv, number 14) not complete after [0-9.]* s (--collective-timeout); rank(s) 1 reached it, then fell silent (no heartbeat for [0-9.]* s): stopped or dead inside it; aborting" "$tmp/err.log" ||
    fail "no timeout line names rank 1 alone as fallen silent inside collective 14"
  grep "fell silent" "$tmp/err.log" | grep -v -q "rank(s) 1 reached it, then fell silent" &&
    fail "a live rank was called silent"
  echo "ok   stop_inside: exit 3; $(grep -m1 -o "rank(s) 1 reached it, then .*inside it" "$tmp/err.log")"
  ;;

planted)
  timeout -k 5 120 "$mpiexec" -np 2 "$bin" run "$arg" --threads 1 --fault unswapped_combine_splits \
    --collective-timeout 10 >"$tmp/run.log" 2>&1
  rc=$?
  [ "$rc" = 3 ] || fail "exit $rc, expected 3 (ERROR at the combine all-to-all)"
  grep -q "ep_combine .* ERROR" "$tmp/run.log" || fail "no ERROR at ep_combine in the report"
  grep -q "collective token all-to-all (combine) on rank [01]: send splits sum to [0-9]* rows but the send buffer holds [0-9]* rows" \
    "$tmp/run.log" || fail "the report does not name the collective, rank and sizes"
  grep -q "the case stopped at stage ep_combine" "$tmp/run.log" || fail "no note that the pipeline stopped"
  grep -q "internal error\|Sanitizer\|runtime error" "$tmp/run.log" && fail "internal error or sanitizer report"
  echo "ok   planted unswapped_combine_splits under mpirun: exit 3, $(grep -m1 -o "send splits sum to [0-9]* rows but the send buffer holds [0-9]* rows" "$tmp/run.log")"
  ;;

branch)
  # --fault local_equal_split_decision: ranks decide the equal-split padding
  # each for itself, so rank 1 enters the padded all-to-all while the others
  # go on to the board exchange. MPI matched those two collectives and the
  # run used what they moved (it said "out of memory"); the arrival notices'
  # names now end the job at once, each rank naming both collectives.
  timeout -k 5 120 "$mpiexec" -np 4 "$bin" run "$arg" --case 'equal_split_adaptive[equal_split.threshold=0.5]' \
    --threads 1 --fault local_equal_split_decision --collective-timeout 20 >"$tmp/run.log" 2>&1
  rc=$?
  [ "$rc" = 3 ] || fail "exit $rc, expected 3 (the job aborted)"
  grep -q "rank 1 reached its collective number [0-9]* as equal-split all-to-all (dispatch); the ranks disagree on which collectives run; aborting the job" \
    "$tmp/run.log" || fail "no rank names rank 1's collective"
  grep -q "moeverify: rank 1 (.*): collective equal-split all-to-all (dispatch) (.*): rank [023] reached its collective number [0-9]* as board sizes; the ranks disagree" \
    "$tmp/run.log" || fail "rank 1 does not name its peers' collective"
  grep -q "out of memory\|not complete after" "$tmp/run.log" && fail "a misleading or late diagnosis"
  echo "ok   ranks on different branches under mpirun -np 4: exit 3, both collectives named"
  ;;

notes_once)
  # what every rank would say alike (a case --set leaves out) is said once,
  # by rank 0, not once a rank
  printf 'cases:\n  - name: per_rank\n    ep: 2\n    shape: {tokens_per_rank: [3, 0]}\n  - name: plain\n    ep: 2\n' \
    >"$tmp/n.yaml"
  timeout -k 5 120 "$mpiexec" -np 2 "$bin" run "$tmp/n.yaml" --threads 1 --set shape.tokens=4 >"$tmp/run.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || fail "exit $rc, expected 0"
  [ "$(grep -o "note: case per_rank left out" "$tmp/run.log" | wc -l)" = 1 ] ||
    { cat "$tmp/run.log"; fail "the left-out note is not said exactly once"; }
  echo "ok   a left-out case noted once under mpirun -np 2"
  # the cases of another ep are named as skipped, only those --case selects
  printf '  - name: wide\n    ep: 4\n  - name: wide2\n    ep: 4\n' >>"$tmp/n.yaml"
  timeout -k 5 120 "$mpiexec" -np 2 "$bin" run "$tmp/n.yaml" --threads 1 --case plain --case wide >"$tmp/run2.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] && grep -q "^skipped under mpirun -np 2 (ep must equal the process count): wide (ep 4)$" "$tmp/run2.log" ||
    { cat "$tmp/run2.log"; fail "exit $rc; the skipped line must name wide alone (wide2 is not selected)"; }
  echo "ok   the skipped cases named, those --case selects"
  ;;

errors_once)
  # a failure every rank meets alike (a bad case file) is said once, by rank
  # 0; a rank that fails alone (its file missing) says it, its rank named
  printf 'name: bad\ncases: []\n' >"$tmp/bad.yaml"
  timeout -k 5 60 "$mpiexec" -np 4 "$bin" run "$tmp/bad.yaml" >"$tmp/run.log" 2>&1
  rc=$?
  [ "$rc" = 2 ] || fail "exit $rc, expected 2 (bad input)"
  n=$(grep -o "bad.yaml:1:1: name: unknown top-level key" "$tmp/run.log" | wc -l)
  # once when mpirun ends the job within say_failure's 3 s (about 1 s here);
  # fewer than once per rank however loaded the machine
  [ "$n" -ge 1 ] && [ "$n" -lt 4 ] || fail "a bad case file on 4 ranks: the line came $n time(s), expected once"
  printf 'cases:\n  - name: c1\n    ep: 2\n' >"$tmp/good.yaml"
  timeout -k 5 60 "$mpiexec" -np 1 "$bin" run "$tmp/good.yaml" --threads 1 : \
    -np 1 "$bin" run "$tmp/missing.yaml" --threads 1 >"$tmp/run2.log" 2>&1
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && fail "hang: killed by timeout"
  [ "$rc" = 0 ] && fail "exit 0 with rank 1's case file missing"
  grep -q "moeverify: rank 1: .*missing.yaml" "$tmp/run2.log" ||
    { cat "$tmp/run2.log"; fail "rank 1, failing alone, did not say why"; }
  echo "ok   a failure of every rank said once; of one rank, by that rank"
  ;;

*) echo "usage: $0 MPIEXEC MOEVERIFY disagree|signal|stop_at|stop_inside|planted|branch|notes_once|errors_once ARG"; exit 2 ;;
esac
exit 0
