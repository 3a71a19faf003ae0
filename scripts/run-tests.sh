#!/usr/bin/env bash
# Run the whole test suite with the MPI of one virtual environment:
# once in a single process (every test, including those that launch their own child
# mpiexec), then under mpiexec at 2, 3 and 4 ranks (the tests marked mpi), oversubscribed.
#
#   scripts/run-tests.sh VENV [NP...]
#
# Every run has a hard time limit (RUN_TIMEOUT seconds, default 600), so a deadlock fails
# fast. Ranks other than 0 log to logs/<venv>/np<N>/rank-K.log; a failing run prints them.
set -uo pipefail
venv=${1:?usage: run-tests.sh VENV [NP...]}
shift
sizes=("${@:-2 3 4}")
[ $# -gt 0 ] || sizes=(2 3 4)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py="$venv/bin/python"
limit=${RUN_TIMEOUT:-600}
name=$(basename "$venv")
export MPITENSOR_TIMEOUT=${MPITENSOR_TIMEOUT:-120}
export PYTHONDONTWRITEBYTECODE=1
status=0

echo "=== $name: single process"
start=$(date +%s)
timeout -k 10 "$limit" "$py" -m pytest tests -q --with-mpi -p no:cacheprovider || status=1
echo "=== $name: single process took $(( $(date +%s) - start )) s"

for n in "${sizes[@]}"; do
  logs="logs/$name/np$n"
  rm -rf "$logs"; mkdir -p "$logs"
  echo "=== $name: mpiexec -n $n"
  start=$(date +%s)
  if ! MPITENSOR_TEST_LOGS="$logs" timeout -k 10 "$limit" scripts/mpirun.sh --venv "$venv" -n "$n" \
      "$py" scripts/pytest_rank.py tests -q --with-mpi -m mpi -p no:cacheprovider; then
    status=1
    echo "=== $name: -n $n FAILED; other ranks' output:"
    for f in "$logs"/rank-*.log; do echo "--- $f"; tail -n 60 "$f"; done
  fi
  for f in "$logs"/rank-*.log; do
    [ -f "$f" ] && echo "    $(basename "$f" .log): $(grep -aE '(passed|failed|error)' "$f" | tail -n 1)"
  done
  echo "=== $name: -n $n took $(( $(date +%s) - start )) s"
done
exit $status
