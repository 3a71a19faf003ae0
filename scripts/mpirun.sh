#!/usr/bin/env bash
# Launch an mpitensor program with the MPI of a virtual environment, on this machine or on
# several hosts, with the same options for Open MPI and MPICH.
#
#   scripts/mpirun.sh [--venv DIR] [--hosts H1:N1,H2:N2 | --hostfile FILE] [--ssh PROG]
#                     -n N [mpiexec options...] program [args...]
#
# It runs DIR/bin/mpiexec (default DIR: $VENV, else .venv; else the mpiexec on PATH, e.g.
# from `module load`) and adds what each MPI needs on a workstation, a CI box or a set of
# hosts reached by ssh:
#   Open MPI  --oversubscribe: allow more ranks than cores (else Open MPI refuses to start
#             them; harmless when there are cores enough). With --hosts or --hostfile it is
#             --map-by slot:OVERSUBSCRIBE instead: Open MPI 5.0.11 given --oversubscribe
#             and a host list puts every rank on the first host;
#             OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when run as root (containers, CI), which
#             Open MPI otherwise refuses.
#   MPICH     nothing: Hydra's mpiexec oversubscribes and runs as root as it is.
# Options it translates for the MPI at hand:
#   --hosts H1:N1,...  where the ranks go, N ranks per host (Open MPI --host, MPICH -hosts)
#   --hostfile FILE    one host per line, "host slots=N" (Open MPI) or "host:N" (MPICH)
#   --ssh PROG         how to reach the other hosts, instead of ssh (Open MPI
#                      --prtemca plm_ssh_agent PROG, MPICH -launcher ssh -launcher-exec PROG)
# Anything else goes to mpiexec unchanged. Inside a Slurm allocation, prefer srun or
# scripts/slurm/mpitensor.sbatch (see README.md, "Running on a cluster").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
hosts="" hostfile="" agent=""
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=$2; shift 2 ;;
    --hosts) hosts=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --ssh) agent=$2; shift 2 ;;
    *) break ;;
  esac
done
mpiexec="$venv/bin/mpiexec"
[ -x "$mpiexec" ] || mpiexec=$(command -v mpiexec) || { echo "mpirun.sh: no mpiexec in $venv/bin or on PATH" >&2; exit 2; }

if "$mpiexec" --version 2>&1 | grep -qiE "open mpi|open-mpi|prte"; then
  if [ -n "$hosts$hostfile" ]; then
    extra=(--map-by slot:OVERSUBSCRIBE)
  else
    extra=(--oversubscribe)
  fi
  if [ "$(id -u)" = 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  [ -z "$hosts" ] || extra+=(--host "$hosts")
  [ -z "$hostfile" ] || extra+=(--hostfile "$hostfile")
  [ -z "$agent" ] || extra+=(--prtemca plm_ssh_agent "$agent")
else
  extra=()
  [ -z "$hosts" ] || extra+=(-hosts "$hosts")
  [ -z "$hostfile" ] || extra+=(-f "$hostfile")
  [ -z "$agent" ] || extra+=(-launcher ssh -launcher-exec "$agent")
fi
exec "$mpiexec" "${extra[@]}" "$@"
