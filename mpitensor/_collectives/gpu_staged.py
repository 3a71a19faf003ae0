"""CuPy tensors in collectives: the two data paths, and the pieces both are built from.

A rank's GPU buffers reach MPI one of two ways (`data_path`):

- **cuda-aware**: MPI was detected or declared CUDA-aware (see `_cuda_aware`), so device
  buffers go to MPI as they are, once the work that produced them has finished (MPI does
  not know CUDA streams; without that wait it would read stale data).
- **staged**: the input is copied to a pooled pinned host buffer on a copy stream, MPI
  works on host memory, and the result is copied back into a fresh device array.

Stream order. A collective captures the stream that is current on its device when it is
called (the *caller's stream*) in a `GpuCall`. Its inputs must have been produced by work
queued on that stream (or be complete). Its result is ordered on that stream: work queued
there after `resolve()` returns sees the data, with no host synchronization. Copies run
on a separate non-blocking *copy stream* per device, so they overlap the caller's kernels,
and the engine may finish an op on any thread: every CuPy call here selects the device
itself and names its stream explicitly, never relying on the thread's current stream.

Reusable pieces (`gpu_all_reduce` is built from them; a GPU path for another collective
follows the same recipe; until it has one, `StagedCollective` runs its host implementation
on staged copies):

1. At the call: ``call = gpu_call(array)``; allocate results with ``call.empty`` (on the
   caller's stream); ``ready = call.mark()`` after the last work the op depends on.
2. cuda-aware (`device_buffers_ok`): ``post()`` returns ``AfterEvent(ready, start)``,
   which hands the CuPy arrays to MPI once ``ready`` is done (polled, never waited for:
   the call returns at once). In ``finish()``, device-side fix-ups go on the caller's
   stream (``call.finish_on_device``).
3. staged: ``staged = call.stage(send, after=ready)`` at the call; ``post()`` returns
   ``AfterEvent(staged.done, start)``, whose ``start`` gives ``staged.buffer.array`` to
   MPI; receive-only host buffers come from `host_empty`. In ``finish()``,
   ``call.unstage(buffer, out)`` copies back (and divides), makes the caller's stream wait
   for it, and returns the buffer to the pool.
4. Every rank of a group must run the same algorithm: where ranks with host inputs could
   take another one (the shared-memory all-reduce), stage and offer it the host copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.backend import require_cupy
from .._core.config import ReduceOperation
from .._core.device import Device
from .._core.dtypes import ReducePlan, reduce_plan
from .._core.mpi import MPI
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.engine import Group, Op
from .._transport.base import PrivateCopy, ReduceCall
from .._transport.gpu.after_event import AfterEvent
from .._transport.gpu.cuda_aware import NONBLOCKING, CudaAwareness, detect
from .._transport.gpu.pinned import PinnedBuffer, pinned_pool
from .._transport.select import SHARED_MEMORY
from .common import CollectiveTensor, Input, check_record, start, take_input

if TYPE_CHECKING:
    from .._runtime.context import DistributedContext

__all__ = [
    "GpuCall",
    "Staged",
    "StagedCollective",
    "copy_stream",
    "cuda_awareness",
    "cuda_result_device",
    "data_path",
    "data_path_name",
    "device_buffers_ok",
    "gpu_all_reduce",
    "gpu_call",
    "gpu_fused_all_reduce",
    "received_on_gpu",
    "host_empty",
    "stage_now",
]

# -- which path -----------------------------------------------------------------------------

_decisions: weakref.WeakKeyDictionary[Any, CudaAwareness] = weakref.WeakKeyDictionary()
_decisions_lock = threading.Lock()


def cuda_awareness(ctx: DistributedContext) -> CudaAwareness:
    """Whether MPI takes this rank's device buffers, and why (decided once per context).

    Args:
        ctx: an open context (its ``config.cuda_aware`` is the declaration).

    Returns:
        The decision (see `_cuda_aware.detect`).

    Raises:
        ValueError: ``MPITENSOR_CUDA_AWARE`` is set to something other than 0, 1 or auto.
    """
    with _decisions_lock:
        found = _decisions.get(ctx)
        if found is None:
            found = detect(ctx.config.cuda_aware)
            _decisions[ctx] = found
        return found


def data_path(ctx: DistributedContext) -> str:
    """How this rank's GPU tensors reach MPI: ``"cuda-aware"``, ``"staged"``, or in which calls.

    Args:
        ctx: an open context.

    Returns:
        ``"cuda-aware"`` when device buffers go to MPI in every kind of call, ``"staged"``
        when in none, else e.g. ``"cuda-aware p2p,blocking"`` (see `CudaAwareness.path`).
    """
    return cuda_awareness(ctx).path


def data_path_name(ctx: DistributedContext) -> str:
    """The "path" column of ``python -m mpitensor info`` for a CUDA rank (`data_path`)."""
    return data_path(ctx)


def device_buffers_ok(ctx: DistributedContext, mpi_op: Any = None, operation: str = NONBLOCKING) -> bool:
    """Whether an operation may hand device buffers to MPI.

    Args:
        ctx: an open context.
        mpi_op: the reduction's MPI op, or None for data movement. A user-defined op
            (complex MAX/MIN, bfloat16) is NumPy code that MPI calls on the buffers, so it
            can only run on host memory.
        operation: the kind of MPI call (`cuda_aware.OPERATIONS`): mpitensor's collectives
            post non-blocking ones.

    Returns:
        True where this MPI takes device buffers in that kind of call (see
        `cuda_aware.vendor_scope`) and the op is predefined; False means stage.
    """
    if not cuda_awareness(ctx).takes(operation):
        return False
    return mpi_op is None or bool(mpi_op.is_predefined)


# -- streams, staging and copying back -----------------------------------------------------

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


def host_empty(shape: tuple[int, ...], dtype: Any) -> PinnedBuffer:
    """A pooled pinned host buffer for MPI to write into (a staged receive).

    Call ``buffer.release()`` (or `GpuCall.unstage`, which does) when done with it.

    Args:
        shape: the array's shape.
        dtype: the array's dtype.

    Returns:
        The buffer; ``buffer.array`` is the NumPy array.
    """
    return pinned_pool().empty(shape, dtype)


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

    def _event_on(self, stream: Any) -> Any:
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
            return self._event_on(self.stream)

    def stage(self, array: Any, *, after: Any = None) -> Staged:
        """Copy a C-contiguous device array to a pooled pinned host buffer, asynchronously.

        Args:
            array: the device array (on the call's device).
            after: an event the copy waits for (`mark()`); None copies at once.

        Returns:
            The staged copy; ``wait()`` gives the host array once the copy is done.
        """
        if not array.flags.c_contiguous:
            raise ValueError("stage() needs a C-contiguous device array")
        buffer = pinned_pool().empty(tuple(array.shape), array.dtype)
        runtime = self.cupy.cuda.runtime
        with self.scope():
            if after is not None:
                self.copies.wait_event(after)
            if array.nbytes:
                runtime.memcpyAsync(
                    buffer.ptr, array.data.ptr, array.nbytes, runtime.memcpyDeviceToHost, self.copies.ptr
                )
            done = self._event_on(self.copies)
        buffer.after(done)
        return Staged(buffer, done)

    def copy_to_host(self, array: Any, host: np.ndarray, *, after: Any = None) -> Any:
        """Copy a C-contiguous device array into pinned host memory, asynchronously.

        Args:
            array: the device array (on the call's device).
            host: a C-contiguous array over pinned memory, of the same number of bytes
                (a slice of a `PinnedBuffer`'s array).
            after: an event the copy waits for (`mark()`); None copies at once.

        Returns:
            The event recorded on the copy stream after the copy.

        Raises:
            ValueError: the sizes differ.
        """
        if array.nbytes != host.nbytes:
            raise ValueError(f"copy_to_host: device array has {array.nbytes} bytes, host array {host.nbytes}")
        runtime = self.cupy.cuda.runtime
        with self.scope():
            if after is not None:
                self.copies.wait_event(after)
            if array.nbytes:
                runtime.memcpyAsync(
                    host.ctypes.data, array.data.ptr, array.nbytes, runtime.memcpyDeviceToHost, self.copies.ptr
                )
            return self._event_on(self.copies)

    def unstage(
        self,
        host: PinnedBuffer | np.ndarray,
        out: Any,
        *,
        after: Any = None,
        divide_by: int | None = None,
        into: Any = None,
        decode: Any = None,
    ) -> Any:
        """Copy a host result into a device array, ordered before the caller's later work.

        The copy (and the division and rounding, if any) runs on the copy stream; the
        caller's stream then waits for it on the GPU (the host does not block). A
        `PinnedBuffer` goes back to the pool, reusable once the copy is done.

        Args:
            host: the host result (same number of bytes as `out`).
            out: the device array to fill, from `empty()` before the last `mark()`.
            after: an event the copy waits for first, when `out` was allocated after the
                event the copy stream last waited for (e.g. a receive with no `stage`).
            divide_by: divide the result by this on the device (``MEAN``).
            into: a device array (from `empty()`, like `out`) to convert the result into,
                when the result's dtype differs from the one MPI reduced in (half
                precision is reduced in float32 and rounded back once).
            decode: the plan's codec when the result holds MAX/MIN keys of floats
                (`OrderedKeys`), to turn back into floats on the device.

        Returns:
            The event recorded after the copy (and division).

        Raises:
            ValueError: `host` and `out` differ in size.
        """
        buffer = host if isinstance(host, PinnedBuffer) else None
        array = host.array if isinstance(host, PinnedBuffer) else host
        if array.nbytes != out.nbytes:
            raise ValueError(f"unstage: host result has {array.nbytes} bytes, device array {out.nbytes}")
        runtime = self.cupy.cuda.runtime
        with self.scope():
            if after is not None:
                self.copies.wait_event(after)
            if out.nbytes:
                runtime.memcpyAsync(
                    out.data.ptr, array.ctypes.data, out.nbytes, runtime.memcpyHostToDevice, self.copies.ptr
                )
            with self.copies:
                self._fix_up(out, divide_by, into, decode)
            done = self._event_on(self.copies)
            self.stream.wait_event(done)
        if buffer is not None:
            buffer.release(done)
        return done

    def finish_on_device(
        self, out: Any, *, divide_by: int | None = None, into: Any = None, decode: Any = None
    ) -> None:
        """Divide, decode and round a result that MPI wrote to the device, on the caller's stream.

        Args:
            out: the device array MPI reduced into.
            divide_by: divide it in place by this (``MEAN``).
            into: a device array to convert the result into (see `unstage`).
            decode: the codec of a MAX/MIN result (see `unstage`).
        """
        with self.scope(), self.stream:
            self._fix_up(out, divide_by, into, decode)

    def _fix_up(self, out: Any, divide_by: int | None, into: Any, decode: Any = None) -> None:
        # Runs on the current stream, which the caller has selected.
        if divide_by is not None:
            self.cupy.true_divide(out, divide_by, out=out)
        if decode is not None:
            decode.decode(out, xp=self.cupy)
        if into is not None and into is not out:
            self.cupy.copyto(into, out, casting="unsafe")


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


def cuda_result_device(ctx: DistributedContext, source: Input, device: int) -> Device:
    """The device a GPU result goes to: the input tensor's, else this rank's GPU `device`."""
    if source.tensor is not None:
        return source.tensor.device
    return Device("cuda", device, ctx.device.rank)


# -- all_reduce -----------------------------------------------------------------------------


def gpu_all_reduce(
    ctx: DistributedContext, source: Input, reduce_op: ReduceOperation, group: Group
) -> CollectiveTensor:
    """Start an all-reduce of a CuPy input on the data path of this rank (see `data_path`).

    The result is a fresh `Tensor` on the input's device, ordered on the stream current
    at the call. ``MEAN`` divides on the device.

    Every rank of a group must run the same algorithm. Ranks with host inputs use the
    shared-memory all-reduce for large messages within a node (`_transport/shm/`), so a
    staged input is offered to it too, and in a group that has CPU ranks the input is
    staged even on a CUDA-aware MPI. (There, host and GPU arrays mixed in one GPU-only
    context disagree at shared-memory sizes: pass one kind, or ``shared_memory=False``.)

    Args:
        ctx: the open context.
        source: the checked input (`take_input`); ``source.buffer`` is C-contiguous.
        reduce_op: the reduction.
        group: the group to reduce over.

    Returns:
        The handle; `resolve()` gives the result.

    Raises:
        TypeError: the dtype cannot be reduced.
        CollectiveMismatchError: ranks disagree (from the consistency check).
    """
    array = source.array
    plan = reduce_plan(reduce_op, source.buffer.dtype)
    call = gpu_call(source.buffer)
    has_cpu_ranks = any(ctx.devices[m].kind != "cuda" for m in group.members)
    direct = device_buffers_ok(ctx, plan.mpi_op) and not has_cpu_ranks
    send = _device_send(call, source, plan, direct)
    out = call.empty(tuple(array.shape), plan.work_dtype)
    # Half precision is reduced in float32 and rounded back into the result once.
    final = call.empty(tuple(array.shape), plan.out_dtype) if plan.rounds_back else out
    ready = call.mark()
    result = Tensor(final, cuda_result_device(ctx, source, call.device))
    fix = _FixUp(group.size if plan.divide else None, final, plan.codec)
    if direct:
        steps = _reduce_device_buffers(call, group, plan, send, out, ready, fix)
    else:
        steps = _staged_steps(ctx, call, group, plan, call.stage(send, after=ready), out, fix, array.nbytes)
    post, finish_copy, keep = steps

    def finish() -> Tensor:
        finish_copy()
        return result

    record = check_record(ctx, group, Record("all_reduce", reduce_op, array.dtype, array.shape, -1, group.members))
    op = Op("all_reduce", group, array.nbytes, post, finish, record, (send, out, final, *keep), source.guard(ctx))
    return start(ctx, op, result)


_Steps = tuple[Callable[[], Any], Callable[[], None], tuple[Any, ...]]


def _device_send(call: GpuCall, source: Input, plan: ReducePlan, direct: bool) -> Any:
    """What a GPU all-reduce sends: the input, in the work dtype (as keys for float MAX/MIN on a CUDA-aware MPI)."""
    with call.scope(), call.stream:
        if plan.codec is not None and direct:
            # Float MAX/MIN: MPI reduces the keys (see _dtypes), encoded on the device.
            send = call.cupy.empty_like(source.buffer)
            plan.codec.encode(source.buffer, send, xp=call.cupy)
            source.copied = True
        elif plan.work_dtype != source.buffer.dtype:
            send = source.buffer.astype(plan.work_dtype)
            source.copied = True
        else:
            send = source.buffer
    return send


def _staged_steps(ctx: DistributedContext, call: GpuCall, group: Group, plan: ReducePlan, staged: Staged, out: Any,
                  fix: _FixUp, nbytes: int) -> _Steps:
    """The staged all-reduce: through the shared-memory transport where it applies, else MPI.

    `nbytes` is the input's size, which host ranks decide by too.
    """
    # Ranks with host inputs take the shared-memory all-reduce where it applies (large
    # messages within a node); its decision depends only on what every rank agrees on,
    # so offering it the staged buffer keeps every rank on the same algorithm. The
    # staged copy holds the floats: the shared-memory path reduces float MAX/MIN as
    # they are, MPI reduces their keys (encoded on the host, decoded on the device).
    host_call = ReduceCall(ctx, group, PrivateCopy(staged.buffer.array), plan, nbytes)
    if SHARED_MEMORY.applies(host_call):
        SHARED_MEMORY.prepare(host_call)
        return _reduce_staged_shared(call, host_call, staged, out, _FixUp(fix.divide_by, fix.into))
    return _reduce_staged(call, group, plan, staged, out, fix)


@dataclass(frozen=True)
class _FixUp:
    """What happens on the device once MPI is done: MEAN's division, decoding, rounding back.

    ``decode`` is the plan's codec for MAX/MIN of floats (the result holds keys), else None.
    """

    divide_by: int | None
    into: Any
    decode: Any = None


def _reduce_device_buffers(
    call: GpuCall, group: Group, plan: ReducePlan, send: Any, out: Any, ready: Any, fix: _FixUp
) -> _Steps:
    """cuda-aware: MPI reduces the device buffers once the work producing them is done."""
    comm, datatype, mpi_op = group.comm, plan.datatype, plan.mpi_op

    def post() -> AfterEvent:
        # MPI knows no streams: it gets the device buffers once the work making them is done.
        return AfterEvent(ready, lambda: [comm.Iallreduce([send, datatype], [out, datatype], mpi_op)])

    def finish() -> None:
        call.finish_on_device(out, divide_by=fix.divide_by, into=fix.into, decode=fix.decode)

    return post, finish, ()


def _reduce_staged(call: GpuCall, group: Group, plan: ReducePlan, staged: Staged, out: Any, fix: _FixUp) -> _Steps:
    """staged: MPI reduces the pinned copy in place; the result is copied back.

    For float MAX/MIN the pinned copy holds the floats: they become keys there (a private
    buffer), and the result is decoded on the device.
    """
    comm, datatype, mpi_op, codec = group.comm, plan.datatype, plan.mpi_op, plan.codec

    def start_reduction() -> list[Any]:
        host = staged.buffer.array  # the copy into it is done
        if codec is not None:
            codec.encode(host, host)
        return [comm.Iallreduce(MPI.IN_PLACE, [host, datatype], mpi_op)]

    def post() -> AfterEvent:
        return AfterEvent(staged.done, start_reduction)

    def finish() -> None:
        call.unstage(staged.buffer, out, divide_by=fix.divide_by, into=fix.into, decode=fix.decode)

    return post, finish, (staged.buffer,)


def _reduce_staged_shared(call: GpuCall, host_call: ReduceCall, staged: Staged, out: Any, fix: _FixUp) -> _Steps:
    """staged, through the shared-memory all-reduce (the result comes from its memory)."""

    def post() -> AfterEvent:
        return AfterEvent(staged.done, lambda: SHARED_MEMORY.start(host_call))

    def finish() -> None:
        call.unstage(host_call.out, out, divide_by=fix.divide_by, into=fix.into)
        staged.buffer.release()

    return post, finish, (staged.buffer, host_call)


# -- the other collectives: through their host implementations --------------------------------
#
# Until a collective has a GPU path of its own, its CuPy inputs are staged (synchronously),
# the host implementation runs on the pinned copies, and `resolve()` copies the results to
# the GPU, ordered on the caller's stream. Every rank then runs the host algorithm, whatever
# its inputs, so ranks with host and GPU inputs always agree.


def stage_now(call: GpuCall, array: Any) -> np.ndarray:
    """Copy a C-contiguous device array to a pooled pinned host array and wait for it.

    The copy waits for the work queued on the caller's stream so far. The pinned block
    goes back to the pool when the returned array (and every view of it) is gone.

    Args:
        call: the call (`gpu_call`).
        array: the device array.

    Returns:
        The host copy.
    """
    return call.stage(array, after=call.mark()).wait()


class StagedCollective(CollectiveTensor):
    """A host collective on staged copies of GPU inputs; `resolve()` gives GPU results.

    Args:
        ctx: the context.
        inner: the host collective's handle.
        call: the GPU side of the call (device and caller's stream).
        device: the device the results go to.
        on_gpu: which leaves of the result go to the GPU (None: all of them).
    """

    __slots__ = ("_call", "_converted", "_device", "_inner", "_on_gpu")

    def __init__(
        self,
        ctx: DistributedContext,
        inner: CollectiveTensor,
        call: GpuCall,
        device: Device,
        on_gpu: list[bool] | None = None,
    ) -> None:
        # A handle of its own kind over the op of the handle it wraps: the one read of a
        # CollectiveTensor's private slot outside its class, by a subclass, which shares it.
        super().__init__(inner._op, None, ctx)
        self._inner = inner
        self._call = call
        self._device = device
        self._on_gpu = on_gpu
        self._converted: list[Any] = []

    def resolve(self, timeout: float | None = None) -> Any:
        """Wait for the collective and return its result on the GPU (the same object again).

        Args:
            timeout: as for `CollectiveTensor.resolve`.

        Raises:
            As `CollectiveTensor.resolve`.
        """
        host = self._inner.resolve(timeout)
        if not self._converted:
            self._converted.append(self._to_device(host))
        self._resolved = True
        return self._converted[0]

    def assume_resolved(self) -> Any:
        """The result, only once the collective is complete (it reaches the GPU in `resolve`).

        Raises:
            NotImplementedError: the collective is still in flight.
        """
        if self.test():
            return self.resolve()
        raise NotImplementedError(
            f"assume_resolved() of {self._op.describe()} on CUDA tensors: its result reaches the GPU "
            "only in resolve(); call resolve()"
        )

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, dict):
            keys = list(value)
            flags = self._on_gpu or [True] * len(keys)
            return {k: self._leaf(value[k], flag) for k, flag in zip(keys, flags)}
        if isinstance(value, (list, tuple)):
            flags = self._on_gpu or [True] * len(value)
            return type(value)(self._leaf(v, flag) for v, flag in zip(value, flags))
        return self._leaf(value, True)

    def _leaf(self, value: Any, to_gpu: bool) -> Any:
        if not to_gpu or not isinstance(value, Tensor):
            return value
        call = self._call
        with call.scope(), call.stream:
            # On the caller's stream: later work there sees it; the host source may be
            # reused as soon as this returns (CUDA takes pageable data at once).
            array = call.cupy.asarray(value.array)
        return Tensor(array, self._device)


def received_on_gpu(ctx: DistributedContext, inner: CollectiveTensor) -> CollectiveTensor:
    """A host `recv` whose template was a CUDA tensor: `resolve()` brings the result to this rank's GPU.

    Args:
        ctx: the context.
        inner: the host receive's handle.

    Returns:
        The handle; `resolve()` gives the received tensor on the GPU.
    """
    cupy = require_cupy()
    index = ctx.device.index if ctx.device.kind == "cuda" else int(cupy.cuda.runtime.getDevice())
    return StagedCollective(ctx, inner, gpu_call(index), Device("cuda", index, ctx.device.rank))


def gpu_fused_all_reduce(
    ctx: DistributedContext, structure: Any, kind: str, run: Callable[[Any], CollectiveTensor]
) -> CollectiveTensor:
    """The fused all-reduce of a structure with CuPy leaves, through host memory.

    GPU leaves are staged, the host fused all-reduce runs on the whole structure, and the
    results of GPU leaves go back to the GPU (host leaves stay on the host).

    Args:
        ctx: the context.
        structure: a list, tuple or dict of tensors, some of them CUDA tensors.
        kind: the operation's name in messages.
        run: ``run(host_structure)`` starts the host fused all-reduce.

    Returns:
        The handle; `resolve()` gives the same structure of results.
    """
    keys = list(structure) if isinstance(structure, dict) else list(range(len(structure)))
    values = [structure[k] for k in keys]
    inputs = [take_input(v, ctx, kind) for v in values]
    gpu = [item for item in inputs if item.on_gpu]
    call = gpu_call(gpu[0].buffer)
    device = cuda_result_device(ctx, gpu[0], call.device)
    ready = call.mark()
    staged = [call.stage(item.buffer, after=ready) if item.on_gpu else None for item in inputs]
    hosts = [s.wait() if s is not None else item.buffer for s, item in zip(staged, inputs)]
    if isinstance(structure, dict):
        host_structure: Any = dict(zip(keys, hosts))
    else:
        host_structure = type(structure)(hosts)
    return StagedCollective(ctx, run(host_structure), call, device, [item.on_gpu for item in inputs])
