#!/usr/bin/env bash
# Run the whole test suite with the MPI of one virtual environment:
# once in a single process (every test, including those that launch their own child
# mpiexec), then under mpiexec at 2, 3 and 4 ranks (the tests marked mpi), oversubscribed.
#
#   scripts/run-tests.sh VENV [NP...]
#
# Every run has a hard time limit (RUN_TIMEOUT seconds, default 600), so a deadlock fails
# fast; a test still running after HANG_DUMP seconds (default 240) has the stacks of its
# threads written out (pytest's faulthandler_timeout), so a hang says where it is. Rank 0
# of each run writes to the terminal and to logs/<venv>/<run>/rank-0.log, the others to
# rank-K.log beside it; a failing run prints the others' last lines. The script ends with a
# recap of every run (the last lines of a long CI log are often all that is kept): its
# status, and the failed tests and dumped stacks of the runs that failed. After the runs at
# each size, one more at 2 ranks has the compiled lane switched off (MPITENSOR_NATIVE=0),
# then torch's own distributed suite runs on the "mpitensor" backend (scripts/torch_suite.py).
set -uo pipefail
venv=${1:?usage: run-tests.sh VENV [NP...]}
shift
sizes=("$@")
[ $# -gt 0 ] || sizes=(2 3 4)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py="$venv/bin/python"
limit=${RUN_TIMEOUT:-600}
dump=${HANG_DUMP:-240}
name=$(basename "$venv")
export MPITENSOR_TIMEOUT=${MPITENSOR_TIMEOUT:-120}
export PYTHONDONTWRITEBYTECODE=1
# With a C compiler the install built the compiled parts: the tests then insist that they are on.
command -v "${CC:-cc}" >/dev/null && export MPITENSOR_EXPECT_NATIVE=1
pytest_args=(tests -q --with-mpi -p no:cacheprovider -o "faulthandler_timeout=$dump")
status=0
recap=()

# what: the run's name; logs: its folder; then the command. Runs it, timed, and notes the outcome.
run() {
  local what=$1 logs=$2
  shift 2
  rm -rf "$logs"; mkdir -p "$logs"
  echo "=== $name: $what"
  local start rc
  start=$(date +%s)
  # tee has a limit too: a process that outlived the run could hold the pipe open.
  MPITENSOR_TEST_LOGS="$logs" timeout -k 10 "$limit" "$@" 2>&1 | timeout "$(( limit + 30 ))" tee "$logs/rank-0.log"
  rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - start ))
  if [ "$rc" -eq 0 ]; then
    recap+=("$what: passed in $took s")
  else
    status=1
    local why="exit status $rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="killed after the $limit s limit"
    recap+=("$what: FAILED ($why, after $took s); logs in $logs")
    echo "=== $name: $what FAILED; other ranks' output:"
    for f in "$logs"/rank-[1-9]*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 60 "$f"; }; done
  fi
  for f in "$logs"/rank-[1-9]*.log; do
    [ -f "$f" ] && echo "    $(basename "$f" .log): $(grep -aE '(passed|failed|error)' "$f" | tail -n 1)"
  done
  echo "=== $name: $what took $took s"
}

# The failed tests and the stacks of hung ones, from every rank's log of a failed run.
explain() {
  local logs=$1 f
  for f in "$logs"/rank-*.log; do
    [ -f "$f" ] || continue
    grep -aE '^(FAILED|ERROR) ' "$f" | head -n 20 | sed "s|^|    $(basename "$f" .log): |"
    # The dump's first line follows pytest's progress dots, on the same line.
    grep -aA 40 'Timeout ([0-9:]*)!' "$f" | sed -E 's/^.*(Timeout \()/\1/' \
      | grep -aE '^(Timeout|Thread|Current thread|  File)' | head -n 40 | sed "s|^|    $(basename "$f" .log): |"
  done
}

run "single process" "logs/$name/single" "$py" -m pytest "${pytest_args[@]}"
for n in "${sizes[@]}"; do
  run "mpiexec -n $n" "logs/$name/np$n" scripts/mpirun.sh --venv "$venv" -n "$n" \
    "$py" scripts/pytest_rank.py "${pytest_args[@]}" -m mpi
done
# The compiled lane switched off: the Python lanes and loops take every call they would take.
run "mpiexec -n 2, compiled lane off" "logs/$name/np2-python" env MPITENSOR_NATIVE=0 \
  scripts/mpirun.sh --venv "$venv" -n 2 "$py" scripts/pytest_rank.py "${pytest_args[@]}" -m mpi
# torch's own distributed suite on the "mpitensor" backend (where torch is installed): the
# tests torch runs for gloo at 2 and 3 ranks, and those it runs for its MPI backend at 3.
if "$py" -c "import torch.distributed" 2>/dev/null; then
  for n in 2 3; do
    run "torch's suite, gloo's tests, mpiexec -n $n" "logs/$name/torch-gloo-np$n" \
      scripts/mpirun.sh --venv "$venv" -n "$n" "$py" scripts/torch_suite.py --selection gloo
  done
  run "torch's suite, MPI's tests, mpiexec -n 3" "logs/$name/torch-mpi-np3" \
    scripts/mpirun.sh --venv "$venv" -n 3 "$py" scripts/torch_suite.py --selection mpi
fi

echo "=== $name: recap"
for line in "${recap[@]}"; do
  echo "  $line"
  case "$line" in
    *FAILED*) explain "${line##*logs in }" ;;
  esac
done
exit $status
