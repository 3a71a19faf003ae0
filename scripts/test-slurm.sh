#!/usr/bin/env bash
# The Slurm test: a real single-node Slurm cluster (munged, slurmctld, slurmd from Debian's
# packages) started on this machine for the test, and mpitensor jobs submitted to it with
# scripts/slurm/mpitensor.sbatch, the batch script users copy.
#
#   scripts/test-slurm.sh            (as root; `make test-slurm`)
#
# Why: srun and mpiexec inside an allocation start ranks differently (PMI-2 or PMIx from
# slurmd, or the MPI's daemons through srun), set different variables, and bind GPUs
# differently. Only a real Slurm shows that mpitensor gets the rank, local rank and device
# right under each, and that a failing rank fails the job.
#
# What it does:
#   1. installs slurmctld, slurmd, slurm-client, munge and libpmix-dev with apt-get if
#      missing (libpmix-dev: srun --mpi=pmix, which Open MPI 5 needs, dlopens libpmix.so),
#      and the two venvs with scripts/make-venv.sh;
#   2. starts munged (own key and socket), slurmctld and slurmd (free, non-default ports,
#      state in a temp dir) with a slurm.conf written for this host: the node from
#      `slurmd -C`, ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, and four
#      placeholder GPUs (gres.conf File= character devices made with mknod), so the
#      script's --gpus-per-task=1 is honoured and Slurm binds a GPU per task;
#   3. submits, all at once with `sbatch --wait --overcommit --exclusive` (the node is one
#      job's at a time, so the jobs run one after another, as on a busy cluster):
#      cluster_check.py (scripts/cluster) for MPICH and Open MPI, each via srun
#      (--mpi=pmi2 / --mpi=pmix) and via the MPI's mpiexec inside the allocation; a job
#      whose rank 2 raises, per MPI via srun, which must fail within FAILFAST_LIMIT s with
#      that rank's traceback; and the data-parallel demo per MPI when examples/ has it;
#   4. checks every job's exit code and output, then stops the jobs and the daemons it
#      started, by pid (trap on exit, failure and interrupt included), and removes the
#      temp dir. Job outputs and daemon logs stay in logs/cluster/slurm.
# Slurm 22.05 refuses --ntasks-per-node above a node's CPUs even with --overcommit, so on a
# machine with fewer than 4 CPUs the node is declared with 4 (SlurmdParameters=
# config_overrides, a setting made for such test set-ups); the ranks still share the real CPUs.
# It skips (exit 0, one line) without root or mknod, or without Slurm and apt-get to install it.
# Settings: MPT_MPIS="mpich openmpi", JOB_LIMIT=240 (s for all jobs), FAILFAST_LIMIT=20.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
started=$(date +%s)
mpis=${MPT_MPIS:-mpich openmpi}
job_limit=${JOB_LIMIT:-240}
failfast_limit=${FAILFAST_LIMIT:-20}
ntasks=4
logs=logs/cluster/slurm

skip() { echo "test-slurm: SKIP: $*"; exit 0; }
say() { echo "test-slurm: $*"; }

[ "$(uname -s)" = Linux ] || skip "needs Linux"
[ "$(id -u)" = 0 ] || skip "needs root (it starts munged, slurmctld and slurmd)"
probe=$(mktemp -d /tmp/mpt-probe.XXXXXX)
probe_ok=1
mknod "$probe/gpu" c 1 3 2>/dev/null || probe_ok=0
rm -rf "$probe"
[ "$probe_ok" = 1 ] || skip "mknod is not permitted here (a container without CAP_MKNOD?): no placeholder GPUs"
packages=(slurmctld slurmd slurm-client munge libpmix-dev)
if ! command -v dpkg >/dev/null || ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  command -v apt-get >/dev/null ||
    skip "no Slurm here and no apt-get to install it (Debian/Ubuntu packages: ${packages[*]})"
  say "installing ${packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null
  }
fi
for mpi in $mpis; do
  scripts/make-venv.sh ".venv-$mpi" "$mpi"
done

# -- the cluster ----------------------------------------------------------------------------
tmp=$(mktemp -d /tmp/mpt-slurm.XXXXXX)
chmod 755 "$tmp"  # munged wants every directory above its socket searchable by all
pids=()

# The processes of this cluster's jobs: slurmstepd and the tasks. slurmd daemonizes its
# steps, so they are not its children; they are found by the SLURM_CONF they inherit,
# which names this run's temp dir, together with a job id (the test's own shells have none).
job_processes() {
  local dir pid env
  for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    env=$(tr '\0' '\n' 2>/dev/null < "$dir/environ") || continue
    grep -qxF "SLURM_CONF=$SLURM_CONF" <<< "$env" || continue
    if grep -q '^SLURM_JOB_ID=' <<< "$env" || [ "$(cat "$dir/comm" 2>/dev/null)" = slurmstepd ]; then
      echo "$pid"
    fi
  done
}

# True while `pid` runs (a zombie, exited but not yet reaped, does not count).
running() {
  [ -e "/proc/$1" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# TERM, up to 10 s of grace, then KILL; reap those that are this shell's children.
stop_pids() {
  local pid
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 20); do
    for pid in "$@"; do
      if running "$pid"; then sleep 0.5; continue 2; fi
    done
    break
  done
  kill -KILL "$@" 2>/dev/null || true
  wait "$@" 2>/dev/null || true
}

cleanup() {
  local status=$? jobs left
  trap - EXIT INT TERM
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ]; then
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086 # one job id per word
      timeout 10 scancel $jobs 2>/dev/null || true
      for _ in $(seq 30); do
        [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
      done
    fi
    mapfile -t left < <(job_processes)
    if [ ${#left[@]} -gt 0 ]; then
      echo "test-slurm: cleanup: stopping leftover job processes: ${left[*]}" >&2
      stop_pids "${left[@]}"
    fi
  fi
  stop_pids "${pids[@]}"
  if [ -d "$tmp" ]; then
    mkdir -p "$logs"
    cp "$tmp"/log/* "$logs"/ 2>/dev/null || true
    rm -rf "$tmp"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$tmp/munge" "$tmp/state" "$tmp/spool" "$tmp/log" "$tmp/dev" "$tmp/out"
chmod 755 "$tmp/munge"
head -c 1024 /dev/urandom > "$tmp/munge/munge.key"
chmod 400 "$tmp/munge/munge.key"
socket="$tmp/munge/munge.sock"
munged -F --socket="$socket" --key-file="$tmp/munge/munge.key" --pid-file="$tmp/munge/munged.pid" \
  --seed-file="$tmp/munge/munged.seed" --log-file="$tmp/log/munged.log" > "$tmp/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$socket" ] && break; sleep 0.2; done
[ -S "$socket" ] || { cat "$tmp/log/munged.out"; say "FAIL munged did not start"; exit 1; }

read -r ctld_port slurmd_port < <(python3 -c '
import socket
found = []
for _ in range(2):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    found.append(s)
print(*(s.getsockname()[1] for s in found))
')

# Job ids unique to this run: MPICH names its shared memory after the PMI job (under srun,
# job id and step), and a job that aborts leaves its segments in /dev/shm, so a later job with
# the same id on this machine (another run of this test) would attach to stale memory.
first_job_id=$(( ((RANDOM << 15) | RANDOM) % 60000000 + 1000 ))
node_line=$(slurmd -C | head -n 1)
node=$(sed -E 's/^NodeName=([^ ]+).*/\1/' <<< "$node_line")
cpus=$(sed -E 's/.* CPUs=([0-9]+).*/\1/' <<< "$node_line")
memory=$(sed -E 's/.* RealMemory=([0-9]+).*/\1/' <<< "$node_line")
overrides=""
if [ "$cpus" -lt "$ntasks" ]; then
  node_line="NodeName=$node CPUs=$ntasks Boards=1 SocketsPerBoard=1 CoresPerSocket=$ntasks ThreadsPerCore=1 RealMemory=$memory"
  overrides="SlurmdParameters=config_overrides"
fi
# Placeholder GPUs: character devices (the numbers of /dev/null) that gres.conf can list.
for i in 0 1 2 3; do mknod "$tmp/dev/mptgpu$i" c 1 3; done
cat > "$tmp/gres.conf" <<EOF
NodeName=$node Name=gpu File=$tmp/dev/mptgpu[0-3]
EOF
cat > "$tmp/slurm.conf" <<EOF
# Written by scripts/test-slurm.sh for one test run; removed when it ends.
ClusterName=mpt$$
FirstJobId=$first_job_id
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
PlugStackConfig=$tmp/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
$overrides
$node_line NodeAddr=127.0.0.1 Gres=gpu:4 State=UNKNOWN
PartitionName=mpt Nodes=$node Default=YES MaxTime=30 State=UP
EOF
touch "$tmp/plugstack.conf"
export SLURM_CONF="$tmp/slurm.conf"
slurmctld -D -f "$SLURM_CONF" > "$tmp/log/slurmctld.log" 2>&1 &
pids+=($!)
slurmd -D -f "$SLURM_CONF" -N "$node" > "$tmp/log/slurmd.log" 2>&1 &
pids+=($!)
state=""
for _ in $(seq 60); do
  state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.5
done
if [ "$state" != idle ]; then
  tail -n 20 "$tmp/log/slurmctld.log" "$tmp/log/slurmd.log"
  say "FAIL the node did not come up (state '$state')"
  exit 1
fi
say "Slurm $(sinfo -V | cut -d' ' -f2) up: node $node ($cpus CPU(s) here, $(sed -E 's/.* CPUs=([0-9]+).*/\1/' <<< "$node_line") declared), 4 placeholder GPUs, ports $ctld_port/$slurmd_port"

# -- the jobs -------------------------------------------------------------------------------
# name | venv | launcher | expected outcome (pass, failfast, demo) | program and arguments
jobs=()
for mpi in $mpis; do
  for launch in srun mpiexec; do
    jobs+=("$mpi-$launch|$mpi|$launch|pass|scripts/cluster/cluster_check.py --slurm --launcher $launch --gpus-per-task 1")
  done
  jobs+=("$mpi-failfast|$mpi|srun|failfast|scripts/cluster/cluster_check.py --fail-on-rank 2")
  if [ -f examples/data_parallel.py ]; then
    jobs+=("$mpi-demo|$mpi|srun|demo|")
  fi
done

submit() {
  local name=$1 mpi=$2 launch=$3 program=$4 mpiexec_args=""
  # Open MPI binds each rank to a core by default, and there are fewer cores than ranks here.
  [ "$mpi" != openmpi ] || mpiexec_args="--bind-to none"
  # shellcheck disable=SC2086 # the program and its arguments are word-split on purpose
  MPITENSOR_VENV="$root/.venv-$mpi" MPITENSOR_LAUNCH="$launch" MPITENSOR_MPIEXEC_ARGS="$mpiexec_args" \
    MPITENSOR_TIMEOUT=60 timeout -k 5 "$job_limit" \
    sbatch --wait --overcommit --exclusive --time=3 --job-name="mpt-$name" --output="$tmp/out/$name.out" \
    scripts/slurm/mpitensor.sbatch $program > "$tmp/out/$name.sbatch" 2>&1
}

waiters=()
for spec in "${jobs[@]}"; do
  IFS='|' read -r name mpi launch _ program <<< "$spec"
  ( if submit "$name" "$mpi" "$launch" "$program"; then echo 0; else echo $?; fi > "$tmp/out/$name.rc" ) &
  waiters+=($!)
done
say "submitted ${#jobs[@]} job(s) with sbatch --wait; waiting"
wait "${waiters[@]}" || true

# -- the verdicts ---------------------------------------------------------------------------
if grep -qx 124 "$tmp"/out/*.rc; then
  # A job outlived its limit: show what its processes were doing before cleanup ends them.
  say "jobs still queued or running after $job_limit s:"
  timeout 10 squeue -o '%.6i %.20j %.9T %.10M %R' || true
  mapfile -t left < <(job_processes)
  [ ${#left[@]} -eq 0 ] || ps -o pid,ppid,stat,etime,wchan:20,args -p "$(IFS=,; echo "${left[*]}")" || true
fi
mkdir -p "$logs"
rm -f "$logs"/*.out
failures=()
fail() { failures+=("$1"); say "FAIL $1"; }
for spec in "${jobs[@]}"; do
  IFS='|' read -r name mpi launch expect _ <<< "$spec"
  out="$tmp/out/$name.out"
  rc=$(cat "$tmp/out/$name.rc" 2>/dev/null || echo "?")
  job=$(sed -nE 's/^Submitted batch job ([0-9]+).*/\1/p' "$tmp/out/$name.sbatch")
  runtime=$(scontrol show job "${job:-0}" 2>/dev/null | sed -nE 's/.*RunTime=([0-9:-]+).*/\1/p' | head -n 1)
  [ -f "$out" ] && cp "$out" "$logs/$name.out"
  case "$expect" in
    pass)
      grep -E '^(PASS|FAIL|cluster_check)' "$out" 2>/dev/null | sed 's/^/    /' || true
      if [ "$rc" = 0 ] && grep -q "cluster_check: all .* checks passed" "$out"; then
        say "$name: job $job passed (sbatch exit 0, run time $runtime)"
      else
        fail "$name: job ${job:-?} sbatch exit $rc (log $logs/$name.out)"
        tail -n 30 "$out" "$tmp/out/$name.sbatch" 2>/dev/null || true
      fi
      ;;
    failfast)
      seconds=$(awk -F: '{ print $(NF-2) * 3600 + $(NF-1) * 60 + $NF }' <<< "${runtime:-99:99:99}")
      # No exit code means "failed" here: sbatch returns the job's (srun's 137 when
      # MPI_Abort made it kill the step); a hang shows as a run time over the limit.
      if [ "$rc" = 0 ] || [ -z "$runtime" ]; then
        fail "$name: job ${job:-?} sbatch exit $rc, run time '${runtime:-unknown}'; expected the job to fail"
        tail -n 30 "$out" 2>/dev/null || true
      elif ! grep -q "\[rank 2\].*deliberate failure on rank 2" "$out"; then
        fail "$name: no traceback of rank 2 in $logs/$name.out"
        tail -n 30 "$out" 2>/dev/null || true
      elif [ "$seconds" -gt "$failfast_limit" ]; then
        fail "$name: the failing job ran $runtime, more than $failfast_limit s"
      else
        say "$name: job $job failed as it must (rank 2 raised; sbatch exit $rc, run time $runtime)"
      fi
      ;;
    demo)
      tail -n 5 "$out" 2>/dev/null | sed 's/^/    /' || true
      if [ "$rc" = 0 ]; then
        say "$name: job $job passed (examples/data_parallel.py, run time $runtime)"
      else
        fail "$name: job ${job:-?} (examples/data_parallel.py) sbatch exit $rc (log $logs/$name.out)"
      fi
      ;;
  esac
done
[ -f examples/data_parallel.py ] || say "demo: skipped, examples/data_parallel.py is not there"

took=$(( $(date +%s) - started ))
if [ ${#failures[@]} -gt 0 ]; then
  say "FAILED (${#failures[@]}) after $took s:"
  for f in "${failures[@]}"; do say "  $f"; done
  exit 1
fi
say "passed in $took s ($mpis)"
