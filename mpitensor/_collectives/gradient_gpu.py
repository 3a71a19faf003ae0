"""GPU gradients in `GradientSync`: staged through pinned buckets, results on their GPU.

A GPU gradient is copied on its own stream into a private device array in the bucket's
dtype (scaled there by the prescale factor), so the caller may overwrite the gradient at
once; that copy goes into the bucket's pinned host buffer on the copy stream. Nothing waits
at `submit`: the bucket's all-reduce is posted once every copy into it is done (see
`after_event.AllDone` and `fused.start_buckets`'s ``ready``), and `wait()` brings each result to the
GPU it came from, ordered on the stream current at its `submit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.device import Device
from .._core.tensor import Tensor
from .._transport.gpu.after_event import AllDone
from .._transport.gpu.pinned import PinnedBuffer, pinned_pool
from .._transport.gpu.staging import copy_to_host, upload
from .._transport.gpu.streams import GpuCall, gpu_call
from .common import Input
from .gpu_staged import cuda_result_device

if TYPE_CHECKING:
    from .._runtime.context import DistributedContext

__all__ = ["GpuBuckets"]


class GpuBuckets:
    """The GPU side of one `GradientSync` step: pinned bucket buffers, copies, results."""

    __slots__ = ("_calls", "_copies", "_keep", "_pinned")

    def __init__(self) -> None:
        self._pinned: dict[int, PinnedBuffer] = {}
        self._copies: dict[int, list[Any]] = {}
        self._keep: list[Any] = []
        self._calls: dict[str, tuple[GpuCall, Device]] = {}

    def send(self, index: int, host_send: np.ndarray) -> np.ndarray:
        """Bucket `index`'s send buffer in pinned memory (gradients already in `host_send` carried over)."""
        buffer = self._pinned.get(index)
        if buffer is None:
            buffer = pinned_pool().empty(tuple(host_send.shape), host_send.dtype)
            np.copyto(buffer.array, host_send)
            self._pinned[index] = buffer
        return buffer.array

    def stage(
        self, ctx: DistributedContext, name: str, index: int, source: Input, target: np.ndarray, pre: Any
    ) -> None:
        """Queue the copy of GPU gradient `source` into `target` (its place in the pinned bucket).

        Args:
            ctx: the context.
            name: the parameter's name (its result goes back to this gradient's GPU).
            index: the bucket.
            source: the checked gradient (``source.buffer``: a C-contiguous CuPy array).
            target: its slice of the bucket's pinned send buffer.
            pre: the prescale factor, or None.
        """
        call = gpu_call(source.buffer)
        with call.scope(), call.stream:
            # A private copy in the bucket's dtype, on the caller's stream: the caller may
            # write the gradient again at once, and the copy to the host reads only this.
            grad = source.buffer.reshape(-1).astype(target.dtype, copy=True)
            if pre is not None:
                call.cupy.multiply(grad, pre, out=grad, casting="unsafe")
        self._copies.setdefault(index, []).append(copy_to_host(call, grad, target, after=call.mark()))
        self._keep.append(grad)
        self._calls[name] = (call, cuda_result_device(ctx, source, call.device))

    def ready(self, index: int) -> AllDone | None:
        """What bucket `index`'s all-reduce waits for before MPI gets it; None when it holds no GPU gradient."""
        copies = self._copies.get(index)
        return AllDone(copies) if copies else None

    def on_gpu(self, name: str) -> bool:
        """Whether `name`'s gradient came from a GPU."""
        return name in self._calls

    def upload(self, name: str, result: Tensor) -> Tensor:
        """`name`'s reduced gradient on the GPU its gradient came from, ordered on the stream of its submit."""
        call, device = self._calls[name]
        return Tensor(upload(call, result.array), device)

    def release(self) -> None:
        """Give the pinned buffers back to the pool (every bucket's all-reduce is complete)."""
        for buffer in self._pinned.values():
            buffer.release()
        self._pinned.clear()
        self._keep.clear()
