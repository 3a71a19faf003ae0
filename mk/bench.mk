# The benchmark (see BENCHMARKS.md): `make bench` builds .venv-bench-$(MPI) (mpitensor,
# matplotlib and a CPU torch for the gloo column) and runs the full sweep, the overlap and
# the fused benchmarks at 2 and 4 ranks (4 oversubscribe a 2-core machine), the 8-byte rows
# at 8 ranks; results land in $(BENCH_OUT)/<mpi>-np<N>.{json,md,png}, then the targets table
# is printed.
#   make bench MPI=mpich              the same with MPICH
#   make bench BENCH_ARGS=--quick     a short sanity run
#   make bench BENCH_TORCH=           no torch (the gloo column is skipped, with a note)
# torch==2.13.0 matches the CPU wheel this project is measured with; from PyPI other
# platforms may fetch a CUDA build of it (large). Any torch version works for the baseline.
.PHONY: bench bench-venv bench-report bench-doc bench-jax bench-tracing

BENCH_VENV ?= .venv-bench-$(MPI)
BENCH_OUT ?= bench-results
BENCH_NP ?= 2 4
# The small-message rows again on many oversubscribed ranks, where every round trip waits for a core.
BENCH_MANY_NP ?= 8
BENCH_ARGS ?=
BENCH_TORCH ?= torch==2.13.0

bench-venv:
	@scripts/make-venv.sh $(BENCH_VENV) $(MPI) test,plot
	@if [ -n "$(BENCH_TORCH)" ] && ! $(BENCH_VENV)/bin/python -c "import torch" 2>/dev/null; then \
	  $(BENCH_VENV)/bin/python -m pip install -q "$(BENCH_TORCH)" || \
	    echo "bench: could not install $(BENCH_TORCH); the gloo column will be skipped"; \
	fi

bench: bench-venv
	@set -e; for n in $(BENCH_NP); do \
	  timeout -k 10 3600 scripts/mpirun.sh --venv $(BENCH_VENV) -n $$n \
	    $(BENCH_VENV)/bin/python -m mpitensor.bench all --out $(BENCH_OUT) $(BENCH_ARGS); \
	done
	@for n in $(BENCH_MANY_NP); do \
	  timeout -k 10 1200 scripts/mpirun.sh --venv $(BENCH_VENV) -n $$n \
	    $(BENCH_VENV)/bin/python -m mpitensor.bench sweep --sizes 8 --variants raw,mt,mt_checked \
	    --out $(BENCH_OUT) $(BENCH_ARGS); \
	done
	@$(MAKE) --no-print-directory bench-report

bench-report:
	$(BENCH_VENV)/bin/python -m mpitensor.bench report $(BENCH_OUT)/*.json

# The body of BENCHMARKS.md: the targets, then every run's machine, tables and plots (the
# plots are drawn from the JSON into docs/benchmarks/).
bench-doc:
	$(BENCH_VENV)/bin/python -m mpitensor.bench report $(BENCH_OUT)/*.json --plots docs/benchmarks \
	  -o $(BENCH_OUT)/BENCHMARKS-body.md

# mpitensor.jax inside jax.jit against mpi4jax at 2 ranks. mpi4jax builds from source against
# the venv's mpicc; PATH keeps only the venv and the system's compilers, since an nvcc found
# elsewhere on PATH makes its build look for CUDA headers.
bench-jax: bench-venv
	@if ! $(BENCH_VENV)/bin/python -c "import mpi4jax" 2>/dev/null; then \
	  export PATH="$(CURDIR)/$(BENCH_VENV)/bin:/usr/bin:/bin"; \
	  { $(BENCH_VENV)/bin/python -m pip install -q nanobind && \
	    $(BENCH_VENV)/bin/python -m pip install -q --no-build-isolation mpi4jax; } || \
	    echo "bench-jax: could not build mpi4jax; its column will be missing"; \
	fi
	timeout -k 10 1800 scripts/mpirun.sh --venv $(BENCH_VENV) -n 2 \
	  $(BENCH_VENV)/bin/python -m mpitensor.bench jax --out $(BENCH_OUT) $(BENCH_ARGS)

# Tracing's cost: a checked all-reduce traced against untraced, alternated, at 2 and 4 ranks.
bench-tracing: bench-venv
	for np in 2 4; do \
	  timeout -k 10 900 scripts/mpirun.sh --venv $(BENCH_VENV) -n $$np \
	    $(BENCH_VENV)/bin/python -m mpitensor.bench tracing --out $(BENCH_OUT) $(BENCH_ARGS) || exit 1; \
	done
