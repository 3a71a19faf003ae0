#!/usr/bin/env bash
# Launch an mpitensor program on this machine with the MPI of a virtual environment.
#
#   scripts/mpirun.sh [--venv DIR] -n N program [args...]
#
# It runs DIR/bin/mpiexec (default DIR: $VENV, else .venv) and adds what each MPI needs
# on a workstation or CI box:
#   Open MPI  --oversubscribe: allow more ranks than cores (else Open MPI refuses);
#             OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when run as root (containers, CI), which
#             Open MPI otherwise refuses.
#   MPICH     nothing: Hydra's mpiexec oversubscribes and runs as root as it is.
# On a cluster, use the site's mpirun or srun instead (see README, "Running on a cluster").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
if [ "${1:-}" = "--venv" ]; then venv=$2; shift 2; fi
mpiexec="$venv/bin/mpiexec"
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec) || { echo "mpirun.sh: no mpiexec in $venv/bin or on PATH" >&2; exit 2; }

if "$mpiexec" --version 2>&1 | grep -qiE "open mpi|open-mpi|prte"; then
  extra=(--oversubscribe)
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
else
  extra=()
fi
exec "$mpiexec" "${extra[@]}" "$@"
