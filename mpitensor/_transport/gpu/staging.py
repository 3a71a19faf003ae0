"""Copies between a device and pooled pinned host memory, on the device's copy stream.

Nothing here blocks the host except `Staged.wait` and `stage_now`: a copy is queued on the
copy stream after an event (usually `GpuCall.mark()` on the caller's stream), and an event
recorded after it says when it is done. A copy back makes the caller's stream wait for it
on the GPU, so the caller's later work sees the result with no host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .fix_up import FixUp, apply
from .pinned import PinnedBuffer, pinned_pool
from .streams import GpuCall

__all__ = ["Staged", "copy_to_host", "host_empty", "stage", "stage_now", "unstage", "upload"]


@dataclass
class Staged:
    """A device array's copy on its way to a pinned host buffer.

    Attributes:
        buffer: the pooled pinned buffer the copy lands in.
        done: the event recorded on the copy stream after the copy.
    """

    buffer: PinnedBuffer
    done: Any

    def wait(self) -> np.ndarray:
        """Block until the copy is complete; return the host array."""
        self.done.synchronize()
        return self.buffer.array


def host_empty(shape: tuple[int, ...], dtype: Any) -> PinnedBuffer:
    """A pooled pinned host buffer for MPI to write into (a staged receive).

    Call ``buffer.release()`` (or `unstage`, which does) when done with it.

    Args:
        shape: the array's shape.
        dtype: the array's dtype.

    Returns:
        The buffer; ``buffer.array`` is the NumPy array.
    """
    return pinned_pool().empty(shape, dtype)


def _to_host(call: GpuCall, array: Any, host_ptr: int, after: Any) -> Any:
    """Queue the copy of `array` to `host_ptr` on the copy stream after `after`; its done event."""
    runtime = call.cupy.cuda.runtime
    with call.scope():
        if after is not None:
            call.copies.wait_event(after)
        if array.nbytes:
            runtime.memcpyAsync(host_ptr, array.data.ptr, array.nbytes, runtime.memcpyDeviceToHost, call.copies.ptr)
        return call.event_on(call.copies)


def stage(call: GpuCall, array: Any, *, after: Any = None) -> Staged:
    """Copy a C-contiguous device array to a pooled pinned host buffer, asynchronously.

    Args:
        call: the call (`streams.gpu_call`).
        array: the device array (on the call's device).
        after: an event the copy waits for (`GpuCall.mark()`); None copies at once.

    Returns:
        The staged copy; ``wait()`` gives the host array once the copy is done.

    Raises:
        ValueError: `array` is not C-contiguous.
    """
    if not array.flags.c_contiguous:
        raise ValueError("stage() needs a C-contiguous device array")
    buffer = pinned_pool().empty(tuple(array.shape), array.dtype)
    done = _to_host(call, array, buffer.ptr, after)
    buffer.after(done)
    return Staged(buffer, done)


def stage_now(call: GpuCall, array: Any) -> np.ndarray:
    """Copy a C-contiguous device array to a pooled pinned host array and wait for it.

    The copy waits for the work queued on the caller's stream so far. The pinned block
    goes back to the pool when the returned array (and every view of it) is gone.

    Args:
        call: the call (`streams.gpu_call`).
        array: the device array.

    Returns:
        The host copy.
    """
    return stage(call, array, after=call.mark()).wait()


def copy_to_host(call: GpuCall, array: Any, host: np.ndarray, *, after: Any = None) -> Any:
    """Copy a C-contiguous device array into pinned host memory, asynchronously.

    Args:
        call: the call (`streams.gpu_call`).
        array: the device array (on the call's device).
        host: a C-contiguous array over pinned memory, of the same number of bytes (a
            slice of a `PinnedBuffer`'s array).
        after: an event the copy waits for (`GpuCall.mark()`); None copies at once.

    Returns:
        The event recorded on the copy stream after the copy.

    Raises:
        ValueError: the sizes differ.
    """
    if array.nbytes != host.nbytes:
        raise ValueError(f"copy_to_host: device array has {array.nbytes} bytes, host array {host.nbytes}")
    return _to_host(call, array, host.ctypes.data, after)


def unstage(call: GpuCall, host: PinnedBuffer | np.ndarray, out: Any, *, after: Any = None,
            fix: FixUp | None = None) -> Any:
    """Copy a host result into a device array, ordered before the caller's later work.

    The copy (and the `fix` steps, if any) runs on the copy stream; the caller's stream
    then waits for it on the GPU (the host does not block). A `PinnedBuffer` goes back to
    the pool, reusable once the copy is done.

    Args:
        call: the call (`streams.gpu_call`).
        host: the host result (same number of bytes as `out`); pinned memory for the copy
            to be asynchronous.
        out: the device array to fill, from `GpuCall.empty()` before the last `mark()`.
        after: an event the copy waits for first, when `out` was allocated after the event
            the copy stream last waited for (e.g. a receive with no `stage`).
        fix: the division, decoding and rounding back to run on the device after the copy.

    Returns:
        The event recorded after the copy (and the fix-up).

    Raises:
        ValueError: `host` and `out` differ in size.
    """
    buffer = host if isinstance(host, PinnedBuffer) else None
    array = host.array if isinstance(host, PinnedBuffer) else host
    if array.nbytes != out.nbytes:
        raise ValueError(f"unstage: host result has {array.nbytes} bytes, device array {out.nbytes}")
    runtime = call.cupy.cuda.runtime
    with call.scope():
        if after is not None:
            call.copies.wait_event(after)
        if out.nbytes:
            runtime.memcpyAsync(
                out.data.ptr, array.ctypes.data, out.nbytes, runtime.memcpyHostToDevice, call.copies.ptr
            )
        if fix is not None:
            with call.copies:
                apply(call.cupy, out, fix)
        done = call.event_on(call.copies)
        call.stream.wait_event(done)
    if buffer is not None:
        buffer.release(done)
    return done


def upload(call: GpuCall, host: np.ndarray) -> Any:
    """A new device array holding `host`, ordered on the caller's stream.

    Later work on the caller's stream sees it; `host` may be reused as soon as this
    returns (CUDA takes pageable data at once).

    Args:
        call: the call (its device and the caller's stream).
        host: the host array.

    Returns:
        The CuPy array on the call's device.
    """
    with call.scope(), call.stream:
        return call.cupy.asarray(host)
