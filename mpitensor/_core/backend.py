"""The array modules behind tensors: NumPy on CPU devices, CuPy (imported lazily) on GPUs."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

import numpy as np

from .errors import DeviceError

__all__ = [
    "array_module",
    "cupy_available",
    "is_cupy_array",
    "is_supported_array",
    "require_cuda_device",
    "require_cupy",
]


def cupy_available() -> bool:
    """True if CuPy is installed (without importing it)."""
    return importlib.util.find_spec("cupy") is not None


def require_cupy() -> ModuleType:
    """Import CuPy, or explain how to get it.

    Raises:
        DeviceError: CuPy is not installed or cannot load its CUDA libraries.
    """
    if not cupy_available():
        raise DeviceError(
            "a CUDA device needs CuPy, which is not installed: pip install 'mpitensor[cuda]' "
            "(it installs cupy-cuda12x; use cupy-cuda11x or cupy-cuda13x for other CUDA major "
            "versions)"
        )
    try:
        import cupy
    except Exception as exc:
        raise DeviceError(f"CuPy is installed but failed to import: {exc}") from exc
    return cupy


def require_cuda_device(index: int) -> ModuleType:
    """Import CuPy and check that this process sees GPU `index`.

    Args:
        index: the GPU number (after ``CUDA_VISIBLE_DEVICES``).

    Returns:
        The CuPy module.

    Raises:
        DeviceError: CuPy is missing, no GPU is visible, or there is no GPU `index`.
    """
    from .device import plan_device, probe_gpus

    cupy = require_cupy()
    count, reason = probe_gpus()
    plan_device(0, count, kind="cuda", index=index, reason=reason)
    return cupy


def is_cupy_array(obj: Any) -> bool:
    """True if `obj` is a CuPy ndarray (without importing CuPy)."""
    return type(obj).__module__.startswith("cupy") and hasattr(obj, "__cuda_array_interface__")


def is_supported_array(obj: Any) -> bool:
    """True for NumPy and CuPy ndarrays."""
    return isinstance(obj, np.ndarray) or is_cupy_array(obj)


def array_module(kind: str) -> ModuleType:
    """NumPy for ``"cpu"``, CuPy for ``"cuda"``.

    Raises:
        DeviceError: CuPy is needed but missing.
    """
    return np if kind == "cpu" else require_cupy()
