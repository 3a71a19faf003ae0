"""GPU tests: they run only where a CUDA GPU is visible, and skip with the reason elsewhere.

Nothing here fakes a GPU. CuPy is imported only through the `cp` fixture, after the check,
so these modules collect on machines without CuPy. Run them on a GPU machine with
``scripts/gpu-check.sh`` (under ``mpiexec -n 1`` and ``-n 2``, the ranks sharing the GPU).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

import mpitensor as mt
from mpitensor._core.device import probe_gpus
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_spin import spin  # the kernel the GPU smoke test queues too

__all__ = ["spin"]

GPUS, NO_GPU_REASON = probe_gpus()


@pytest.fixture(autouse=True)
def _needs_a_gpu() -> None:
    if GPUS == 0:
        pytest.skip(f"no CUDA GPU visible: {NO_GPU_REASON}")


@pytest.fixture
def cp() -> ModuleType:
    """The CuPy module."""
    import cupy

    return cupy


@pytest.fixture
def gpu_ctx() -> Iterator[mt.DistributedContext]:
    """A context over every rank, each on its GPU; closed after the test."""
    context = mt.DistributedContext.init(config=mt.DistributedConfig(device="cuda"))
    yield context
    if not context.closed and not context.broken:
        context.close()


@pytest.fixture(scope="module")
def gpu_module_ctx() -> Iterator[mt.DistributedContext]:
    """One GPU context for a whole module of quick tests."""
    if GPUS == 0:
        pytest.skip(f"no CUDA GPU visible: {NO_GPU_REASON}")
    context = mt.DistributedContext.init(config=mt.DistributedConfig(device="cuda"))
    yield context
    if not context.closed and not context.broken:
        context.close()
