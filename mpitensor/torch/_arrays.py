"""NumPy views of CPU torch tensors, so that mpitensor's collectives read torch memory.

bfloat16 has no NumPy dtype of its own: its tensors are viewed through int16 as
``ml_dtypes.bfloat16``, which mpitensor reduces (in float32) like NumPy's own dtypes.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ALIGN", "flat_buffer", "host_view", "numpy_dtype", "torch_view"]

# Offsets of tensors packed into one byte buffer are rounded up to this, so that every
# view of the buffer is aligned for its dtype (complex128 is the widest).
ALIGN = 16


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype that holds `dtype`'s values (ml_dtypes' bfloat16 for bfloat16).

    Raises:
        TypeError: a torch dtype without a NumPy counterpart, or bfloat16 without ml_dtypes.
    """
    if dtype is torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                "bfloat16 tensors need the ml_dtypes package (pip install 'mpitensor[bf16]')"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise TypeError(f"torch dtype {dtype} has no NumPy counterpart mpitensor could send") from None


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing `tensor`'s memory (a contiguous CPU tensor; grad ignored).

    Raises:
        TypeError: `tensor` is not on the CPU or has no NumPy dtype.
    """
    if tensor.device.type != "cpu":
        raise TypeError(f"expected a CPU tensor, got one on {tensor.device}")
    tensor = tensor.detach()
    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype(torch.bfloat16))
    return tensor.numpy()


def flat_buffer(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A zeroed 1-D buffer: the torch tensor and a NumPy array over the same memory.

    The memory belongs to NumPy, so a collective reading the array protects it by making
    it read-only instead of copying it (it copies memory another library owns).
    """
    array = np.zeros(numel, dtype=numpy_dtype(dtype))
    return torch_view(array, dtype), array


def torch_view(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor of `dtype` over a writable NumPy array's memory (bfloat16 via int16)."""
    if dtype is torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
