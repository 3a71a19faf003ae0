#!/usr/bin/env bash
# Launch an mpitensor program with the MPI of a virtual environment, on this machine or on
# several hosts, with the same options for Open MPI and MPICH.
#
#   scripts/mpirun.sh [--venv DIR] [--hosts H1:N1,H2:N2 | --hostfile FILE] [--ssh PROG]
#                     [--fault-tolerant] -n N [mpiexec options...] program [args...]
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
#   --fault-tolerant   the job survives the loss of a rank, for programs that open their
#                      context with DistributedConfig(on_rank_failure="raise"): Open MPI
#                      --with-ft ulfm (its fault tolerance; mpitensor then keeps Open MPI on
#                      its transports that detect a dead peer). MPICH's and Intel MPI's
#                      mpiexec have none that mpitensor uses: the job is launched as usual,
#                      fail-fast, with a note saying so.
# Anything else goes to mpiexec unchanged. Inside a Slurm allocation, prefer srun or
# scripts/slurm/mpitensor.sbatch (see README.md, "Running on a cluster").
#
# Files a failed job leaves: MPICH keeps its shared memory in /dev/shm/mpich_shm_* (and
# mpich_vci_*), Hydra its topology in /tmp/hydra_hwloc_xmlfile_*, and they remove them when
# the job ends normally, not when a rank is killed by a signal or calls MPI_Abort (Open MPI
# cleans up then, unless its prterun is killed outright). So mpiexec runs as a child of
# this script, which passes SIGTERM, SIGINT and SIGHUP on to it, and once it has ended
# removes the files of those kinds that appeared meanwhile and that no live process maps or
# holds open (a concurrent job's files are in use: they stay), then exits with mpiexec's
# status (or by the signal that ended mpiexec, when this script got that signal too).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
hosts="" hostfile="" agent="" fault_tolerant=0 watch_outlived=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) venv=$2; shift 2 ;;
    --fault-tolerant) fault_tolerant=1; shift ;;
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
  [ "$fault_tolerant" = 0 ] || extra+=(--with-ft ulfm) watch_outlived=1
else
  extra=()
  [ -z "$hosts" ] || extra+=(-hosts "$hosts")
  [ -z "$hostfile" ] || extra+=(-f "$hostfile")
  [ -z "$agent" ] || extra+=(-launcher ssh -launcher-exec "$agent")
  if [ "$fault_tolerant" = 1 ]; then
    echo "mpirun.sh: --fault-tolerant: this MPI's mpiexec has no fault tolerance that mpitensor uses;" \
      "launching as usual (a rank that dies ends the job)" >&2
  fi
fi

# -- leftovers ------------------------------------------------------------------------------
# The files of the kinds MPI leaves that this user owns, one per line: MPICH's shared memory
# and Hydra's topology file; Open MPI's shared memory (sm_segment, vader_segment in 4.x),
# which prterun removes unless it is killed outright (SIGKILL), and then its session
# directory stays too (see remove_leftovers).
leftovers() {
  local f
  for f in /dev/shm/mpich_shm_* /dev/shm/mpich_vci_* /tmp/hydra_hwloc_xmlfile_* \
      /dev/shm/sm_segment.* /dev/shm/vader_segment.*; do
    if [ -O "$f" ]; then printf '%s\n' "$f"; fi
  done
}

# Every file that a live process maps or holds open, one per line.
files_in_use() {
  {
    # maps: address perms offset device inode path; the path is the first " /" on.
    cat /proc/[0-9]*/maps 2>/dev/null | awk '{ i = index($0, " /"); if (i) print substr($0, i + 1) }' || true
    # shellcheck disable=SC2012 # ls -l shows where the fd links point, with any ls
    ls -l /proc/[0-9]*/fd/ 2>/dev/null | awk '{ i = index($0, " -> "); if (i) print substr($0, i + 4) }' || true
  } | sort -u
}

# Remove the leftovers that were not there before the job and that no live process uses
# (in use after a failure, they are retried for up to 2 s while the last ranks die).
remove_leftovers() {
  local fresh left in_use f tries=0
  fresh=$(comm -13 <(printf '%s\n' "$before" | sort) <(leftovers | sort))
  # prterun's session directory, named after its pid, which was mpiexec's.
  f="${TMPDIR:-${TEMP:-${TMP:-/tmp}}}/ompi.$child"
  if [ -d "$f" ] && [ -O "$f" ]; then fresh+=${fresh:+$'\n'}$f; fi
  while [ -n "$fresh" ]; do
    in_use=$(files_in_use)
    left=""
    while IFS= read -r f; do
      if grep -qxF -- "$f" <<< "$in_use" || grep -qF -- "$f/" <<< "$in_use"; then
        left+=${left:+$'\n'}$f
      else
        rm -rf -- "$f" 2>/dev/null || true
      fi
    done <<< "$fresh"
    fresh=$left
    if [ -z "$fresh" ] || [ "$status" = 0 ] || [ "$tries" -ge 20 ]; then break; fi
    tries=$((tries + 1))
    sleep 0.1
  done
}

# -- signals --------------------------------------------------------------------------------
# Whether this script is in the foreground process group of a terminal.
# shellcheck disable=SC2329 # called from forward, a trap
in_terminal_foreground() {
  local stat pgrp tty tpgid
  if [ -r /proc/$$/stat ]; then
    stat=$(< /proc/$$/stat)
    read -r _ _ pgrp _ tty tpgid _ <<< "${stat##*) }"
    [ "$tty" != 0 ] && [ "$pgrp" = "$tpgid" ]
  else
    read -r pgrp tpgid <<< "$(ps -o pgid= -o tpgid= -p $$ 2>/dev/null)" || return 1
    [ "${tpgid:--1}" != -1 ] && [ "$pgrp" = "$tpgid" ]
  fi
}

# Pass signal $1 on to mpiexec, exactly once. Where mpiexec has a process group of its own
# (below), nothing sent to this script's group reaches it, so every signal is passed on.
# Where it shares this script's group and that group is a terminal's foreground, what the
# terminal sends (Ctrl-C, hang-up) reaches it directly: passed on too, a second SIGINT would
# make Hydra kill the job at once, exit 0 and lose the ranks' tracebacks.
# shellcheck disable=SC2329 # called from a trap
forward() {
  caught=$1 ncaught=$((ncaught + 1))
  if [ -z "$child" ]; then early=$1; return 0; fi
  if [ "$own_group" = 0 ] && [ "$1" != TERM ] && in_terminal_foreground; then
    return 0
  fi
  kill -s "$1" "$child" 2>/dev/null || true
}

# -- the job --------------------------------------------------------------------------------
cleanup=0
[ -r /proc/self/maps ] && cleanup=1  # without /proc, nobody's use of a file can be checked
before=""
[ "$cleanup" = 0 ] || before=$(leftovers)
# setpriv: mpiexec dies with this script (SIGKILL included), as when this script exec'd it.
pdeath=()
if setpriv --help 2>/dev/null | grep -q -- --pdeathsig; then
  pdeath=(setpriv --pdeathsig KILL --)
fi
# A process group of its own for mpiexec (set -m) when no terminal is its input (a terminal
# lets only its foreground group read) and when it cannot outlive this script.
own_group=0
if [ ! -t 0 ] && [ ${#pdeath[@]} -gt 0 ]; then own_group=1; fi

child="" caught="" early="" ncaught=0
for sig in TERM INT HUP; do
  # shellcheck disable=SC2064 # the signal's name is fixed here on purpose
  trap "forward $sig" "$sig"
done
[ "$own_group" = 0 ] || set -m
# In the background, a command starts with SIGINT and SIGQUIT ignored and reads /dev/null:
# `trap -` and `<&0` give mpiexec what it had in the foreground.
( trap - INT QUIT; exec "${pdeath[@]}" "$mpiexec" "${extra[@]}" "$@" ) <&0 &
child=$!
set +m
# A signal that came before mpiexec existed.
[ -z "$early" ] || kill -s "$early" "$child" 2>/dev/null || true
# Open MPI's launcher under --with-ft ulfm now and then stays up after every rank has ended (seen
# after an MPI_Abort that followed a rank's death: prterun stuck on a lock of its own, its ranks
# left unreaped): once it has had no live child process (its ranks, or the agents that reach other
# hosts) for 5 s after it had some, it is ended, status 1. It looks 5 times a second: ranks that
# fail at once (a death, then the abort, within a second of the start) live longer than that.
watchdog="" outlived="${TMPDIR:-/tmp}/mpirun.sh.$$.outlived"
if [ "$watch_outlived" = 1 ] && ps -o stat= --ppid $$ >/dev/null 2>&1; then
  (
    trap - TERM INT HUP
    had=0 idle=0
    while kill -0 "$child" 2>/dev/null; do
      # Zombies (ended, not reaped) do not count.
      if ps -o stat= --ppid "$child" 2>/dev/null | grep -qv '^Z'; then had=1 idle=0
      elif [ "$had" = 1 ]; then idle=$((idle + 1))
      fi
      if [ "$idle" -ge 25 ]; then
        : > "$outlived"
        kill -TERM "$child" 2>/dev/null || true
        sleep 2
        kill -KILL "$child" 2>/dev/null || true
        break
      fi
      sleep 0.2
    done
  ) &
  watchdog=$!
fi
while :; do
  seen=$ncaught
  # 2>/dev/null: no "Killed" notice from bash; mpiexec reports how the job ended.
  if wait "$child" 2>/dev/null; then status=0; else status=$?; fi
  # A signal ends `wait` early (status > 128) while mpiexec runs on: wait again. Once
  # mpiexec has ended, bash keeps its status for the next `wait`.
  [ "$ncaught" != "$seen" ] || break
done
trap - TERM INT HUP
if [ -n "$watchdog" ]; then
  kill "$watchdog" 2>/dev/null || true
  wait "$watchdog" 2>/dev/null || true
fi
if [ -f "$outlived" ]; then
  rm -f "$outlived"
  echo "mpirun.sh: mpiexec was still up 5 s after its last rank ended (Open MPI's launcher under" \
    "--with-ft ulfm, after an abort); ended it" >&2
  status=1
fi
[ "$cleanup" = 0 ] || remove_leftovers
# mpiexec ended by the signal this script got: end by it too, as mpiexec did.
if [ -n "$caught" ] && [ "$status" = $((128 + $(kill -l "$caught"))) ]; then
  kill -s "$caught" $$
fi
exit "$status"
