#!/usr/bin/env bash
# The GPU check: the GPU smoke test, the GPU tests and the staged all-reduce benchmark, on a
# machine with one NVIDIA GPU and CuPy but no MPI runtime and no network (CI has no GPU; this
# is run by hand).
#
#   PYTHON=/path/to/python3 scripts/gpu-check.sh [openmpi|mpich]      (default: openmpi)
#
# PYTHON is the interpreter that holds CuPy and NumPy (default: /opt/torch/.venv/bin/python3
# where it exists, else python3). It runs itself: a virtual environment made from it would
# see its base interpreter's packages, not the ones of the environment it belongs to, and
# CuPy finds nvrtc and the CUDA headers through its own site-packages. What it lacks (the MPI
# runtime, mpi4py, pytest, ...) comes from the wheels carried in .wheels/ in the repository
# root, fetched beforehand on a machine with network access by `make gpu-wheels` (see
# mk/gpu.mk and docs/gpu.md; .wheels/ is git-ignored).
#
# What it does, each step under its own time limit, all of it within GPU_CHECK_BUDGET
# seconds (default 290, under 5 minutes):
#   1. checks that PYTHON imports CuPy, sees a GPU and compiles a kernel (nvrtc and the CUDA
#      headers present): if not, it FAILS (exit 1), since every GPU test would skip;
#   2. installs the MPI wheel, mpi4py, pytest and the test dependencies from .wheels only
#      (--no-index) under a prefix (GPU_CHECK_PREFIX, default /tmp/mpitensor-gpu-check-MPI),
#      with PYTHON's pip or, where PYTHON has none, the pip wheel carried in .wheels; then
#      runs PYTHON with PYTHONPATH (this checkout and the prefix's site-packages),
#      LD_LIBRARY_PATH (the MPI wheel's libraries: mpi4py loads libmpi.so.* by name) and
#      PATH (the MPI wheel's mpiexec) set;
#   3. runs the GPU smoke test (scripts/gpu_smoke.py) under mpiexec -n 2 (both ranks share
#      the GPU): every GPU code path once, one PASS/FAIL/SKIP line per check and a TOTAL
#      line, each check isolated and time-limited; without CuPy every check FAILS;
#   4. runs the GPU tests (tests/transport/gpu/on_gpu) under mpiexec -n 1, then -n 2;
#   5. prints `python -m mpitensor info` for 2 ranks;
#   6. prints the benchmark (scripts/gpu_bench.py): staged all-reduce of 1, 16 and 256 MiB
#      float32 against its floor measured in the same run, as ratios, one row at a time.
# Neither MPI wheel is CUDA-aware, so the staged path is what runs (the smoke test forces the
# CUDA-aware path once, on managed memory, which a host-only MPI can read).
# Exit status: non-zero if any step failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
mpi=${1:-openmpi}
case "$mpi" in openmpi|mpich) ;; *) echo "gpu-check.sh: MPI must be openmpi or mpich, not '$mpi'" >&2; exit 2 ;; esac
default_python=python3
[ -x /opt/torch/.venv/bin/python3 ] && default_python=/opt/torch/.venv/bin/python3
python=${PYTHON:-$default_python}
prefix=${GPU_CHECK_PREFIX:-/tmp/mpitensor-gpu-check-$mpi}
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
# Stop here: a check that cannot run fails, it never passes by skipping.
fail() { echo "gpu-check.sh: FAILED: $*" >&2; exit 1; }

say "machine ($python)"
command -v nvidia-smi >/dev/null && nvidia-smi -L
limited 120 "$python" - <<'PY' || fail "$python cannot use CuPy on a GPU (above: why); every GPU test would skip. Set PYTHON to the interpreter that holds CuPy."
import platform
import cupy
runtime = cupy.cuda.runtime
count = runtime.getDeviceCount()
name = runtime.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else name
# One kernel compiled here: nvrtc and the CUDA headers are found.
twice = cupy.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "mpitensor_gpu_check_twice")
assert float(twice(cupy.arange(4, dtype=cupy.float32)).sum()) == 12.0
print(f"Python {platform.python_version()}, CuPy {cupy.__version__}, CUDA runtime {runtime.runtimeGetVersion()}, "
      f"{count} GPU(s), cuda:0 is {name}; a kernel compiled and ran")
PY
[ -d "$wheels" ] || fail "no $wheels; fetch the wheels first: make gpu-wheels (see docs/gpu.md)"

say "packages ($mpi, from $wheels, under $prefix)"
# Each wheel without its dependencies (they are listed): NumPy and whatever else PYTHON
# holds stay as they are; --ignore-installed puts these under the prefix even where PYTHON
# has a version of its own (an mpi4py built for another MPI).
packages=("$mpi" mpi4py pytest pluggy iniconfig packaging pygments pytest-mpi hypothesis sortedcontainers ml_dtypes psutil)
if "$python" -m pip --version >/dev/null 2>&1; then
  pip=("$python" -m pip)
else
  pip_wheel=$(find "$wheels" -maxdepth 1 -name 'pip-*.whl' | sort -V | tail -n 1)
  [ -n "$pip_wheel" ] || fail "$python has no pip and $wheels holds no pip wheel (make gpu-wheels fetches one)"
  echo "($python has no pip: running $(basename "$pip_wheel"))"
  pip=("$python" "$pip_wheel/pip")
fi
rm -rf "$prefix"
limited 120 "${pip[@]}" install --isolated --prefix "$prefix" --no-index --find-links "$wheels" --no-deps \
    --ignore-installed --no-warn-script-location --disable-pip-version-check -q "${packages[@]}" \
  || fail "installing ${packages[*]} from $wheels under $prefix"
sites=$(find "$prefix" -type d -name '*-packages' -prune | sort | paste -sd :)
libdir=$(find "$prefix" -name 'libmpi.so*' -printf '%h\n' | sort -u | head -n 1)
[ -n "$sites" ] || fail "no site-packages under $prefix after installing"
[ -n "$libdir" ] || fail "no libmpi.so under $prefix: the $mpi wheel did not install its library"
[ -x "$prefix/bin/mpiexec" ] || fail "no $prefix/bin/mpiexec: the $mpi wheel did not install its launcher"
export PYTHONPATH="$root:$sites${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$prefix/bin:$PATH"
echo "PYTHONPATH=$PYTHONPATH"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export MPITENSOR_TIMEOUT=${MPITENSOR_TIMEOUT:-120}
# Only the plugins named below: the interpreter may carry other pytest plugins.
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
limited 60 "$python" - "$prefix" <<'PY' || fail "$python cannot import mpi4py from $prefix and mpitensor from this checkout (above: why)"
import os
import sys

import mpi4py
import pytest

import mpitensor
from mpitensor._core import mpi as _mpi  # noqa: F401 (imports mpi4py.MPI: libmpi is found)

prefix = os.path.realpath(sys.argv[1])
for module in (mpi4py, pytest):
    if not os.path.realpath(module.__file__).startswith(prefix + os.sep):
        raise SystemExit(f"{module.__name__} comes from {module.__file__}, not from {prefix}")
print("mpi4py", mpi4py.__version__, "from", os.path.dirname(mpi4py.__file__), "; mpitensor from", os.path.dirname(mpitensor.__file__))
PY

say "GPU smoke test, mpiexec -n 2 (the ranks share the GPU)"
mkdir -p logs/gpu-check
limited 150 scripts/mpirun.sh --venv "$prefix" -n 2 "$python" scripts/gpu_smoke.py 2>&1 | tee logs/gpu-check/smoke.txt
[ "${PIPESTATUS[0]}" = 0 ] || step_failed "GPU smoke test (logs/gpu-check/smoke.txt)"

pytest_args=(tests/transport/gpu/on_gpu -q --with-mpi -p pytest_mpi -p mpitensor._pytest_plugin -p no:cacheprovider -rs --color=no)
for n in 1 2; do
  say "GPU tests, mpiexec -n $n"
  logs="logs/gpu-check/np$n"
  rm -rf "$logs"; mkdir -p "$logs"
  if ! MPITENSOR_TEST_LOGS="$logs" limited 120 scripts/mpirun.sh --venv "$prefix" -n "$n" \
      "$python" scripts/pytest_rank.py "${pytest_args[@]}"; then
    step_failed "GPU tests at -n $n"
    for f in "$logs"/rank-*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 60 "$f"; }; done
  fi
  for f in "$logs"/rank-*.log; do
    [ -f "$f" ] && echo "    $(basename "$f" .log): $(grep -aE '(passed|failed|error|skipped)' "$f" | tail -n 1)"
  done
done

say "python -m mpitensor info, mpiexec -n 2"
limited 60 scripts/mpirun.sh --venv "$prefix" -n 2 "$python" -m mpitensor info || step_failed "info"

say "benchmark, mpiexec -n 2 (the ranks share the GPU)"
limited 150 scripts/mpirun.sh --venv "$prefix" -n 2 "$python" scripts/gpu_bench.py --json logs/gpu-check/bench.json \
  || step_failed "benchmark"

say "done in $(( ${GPU_CHECK_BUDGET:-290} - (deadline - $(date +%s)) )) s: $([ $status = 0 ] && echo OK || echo FAILED)"
exit $status
