"""A CUDA kernel that keeps the GPU busy for a given time: the checks of stream order use it.

Shared by the GPU smoke test (`gpu_smoke.py`) and the GPU tests (``tests/transport/gpu/on_gpu``),
which import it from this folder. CuPy is passed in, so importing this module needs no GPU.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["SPIN_SOURCE", "spin", "spin_kernel"]

SPIN_SOURCE = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


@functools.cache
def spin_kernel(cupy: Any) -> Any:
    """The kernel, compiled once (at the first call: not inside a timed section).

    Args:
        cupy: the CuPy module.

    Returns:
        The compiled ``cupy.RawKernel``.
    """
    kernel = cupy.RawKernel(SPIN_SOURCE, "spin")
    kernel.compile()
    return kernel


def spin(cupy: Any, seconds: float, stream: Any = None) -> None:
    """Queue a kernel that keeps the GPU busy for `seconds` on `stream` (default: the current one).

    Args:
        cupy: the CuPy module.
        seconds: how long the kernel runs.
        stream: the CuPy stream to queue it on; None for the current stream.
    """
    kernel = spin_kernel(cupy)
    with stream if stream is not None else cupy.cuda.get_current_stream():
        kernel((1,), (1,), (cupy.uint64(int(seconds * 1e9)),))
