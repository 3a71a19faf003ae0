"""The GPU side of one call: its device, the caller's stream, and the copy stream of the device.

A collective captures the stream current on its device when it is called (the *caller's
stream*) in a `GpuCall`. Its inputs must have been produced by work queued on that stream
(or be complete), and its result is ordered on that stream. Staging copies run on a
separate non-blocking *copy stream* per device, so they overlap the caller's kernels, and
the engine may finish an op on any thread: every CuPy call selects the device itself and
names its stream explicitly, never relying on the thread's current stream.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

from ..._core.backend import require_cupy

__all__ = ["GpuCall", "copy_stream", "gpu_call"]

_copy_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def copy_stream(device: int) -> Any:
    """The non-blocking stream staging copies of `device` run on (one per device).

    Args:
        device: the CUDA device number.

    Returns:
        A ``cupy.cuda.Stream`` created on `device`.
    """
    with _streams_lock:
        stream = _copy_streams.get(device)
        if stream is None:
            cupy = require_cupy()
            with cupy.cuda.Device(device):
                # Non-blocking: no implicit ordering with the legacy default stream; every
                # dependency is an explicit event.
                stream = cupy.cuda.Stream(non_blocking=True)
            _copy_streams[device] = stream
        return stream


class GpuCall:
    """The GPU side of one collective call: the device, the caller's stream, the copy stream.

    Build it with `gpu_call` in the calling thread, at the call. Its methods may run on any
    thread later (the engine may finish ops from another thread).

    Args:
        device: the CUDA device number of the tensors.
        stream: the caller's stream (current on `device` at the call).
        copies: the stream staging copies run on.
    """

    __slots__ = ("copies", "cupy", "device", "stream")

    def __init__(self, device: int, stream: Any, copies: Any) -> None:
        self.cupy = require_cupy()
        self.device = device
        self.stream = stream
        self.copies = copies

    def scope(self) -> AbstractContextManager[Any]:
        """A ``with`` block in which `device` is the current device."""
        return self.cupy.cuda.Device(self.device)

    def event_on(self, stream: Any) -> Any:
        """A new event recorded on `stream` now (call it inside `scope()`)."""
        event = self.cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A new device array on the call's device, allocated in the caller's stream order.

        Allocate results with it before `mark()`, so the copy stream's work is ordered
        after whatever last used that memory.
        """
        with self.scope(), self.stream:
            return self.cupy.empty(shape, dtype)

    def mark(self) -> Any:
        """An event on the caller's stream after everything queued on it so far.

        ``mark().synchronize()`` is what makes a device buffer safe to hand to MPI.
        """
        with self.scope():
            return self.event_on(self.stream)


def gpu_call(array: Any) -> GpuCall:
    """Capture the GPU side of a collective called now on `array`.

    Args:
        array: a CuPy array (its device is the call's device), or a device number.

    Returns:
        The call, with the stream current on that device in this thread.
    """
    cupy = require_cupy()
    device = array if isinstance(array, int) else int(array.device.id)
    return GpuCall(device, cupy.cuda.get_current_stream(device), copy_stream(device))
