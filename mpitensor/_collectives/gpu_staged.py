"""CuPy tensors in collectives: the GPU all-reduce, and results brought back to the GPU.

What is collective-level lives here: taking the input, the plan, the group, the op and the
handle. How the data moves is in `_transport/gpu/`: `data_path` says whether MPI takes this
rank's device buffers (`device_buffers.DeviceReduce` hands them over once the work making
them is done) or not (`staged.staged_all_reduce` copies them into pinned host memory and
runs the host transport `select` chooses on the copy, then copies the result back). Stream
order is the one `streams.GpuCall` captures at the call: the input must have been produced
on the stream current at the call, and the result is ordered on that stream.

The other collectives have no GPU path of their own yet: `StagedCollective` runs their host
implementation on staged copies and brings the results to the GPU in `resolve()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._core.backend import require_cupy
from .._core.config import ReduceOperation
from .._core.device import Device
from .._core.dtypes import ReducePlan, reduce_plan
from .._core.tensor import Tensor
from .._runtime.check import Record
from .._runtime.engine import Group, Op
from .._transport.gpu.data_path import device_buffers_ok
from .._transport.gpu.device_buffers import DeviceReduce
from .._transport.gpu.fix_up import FixUp
from .._transport.gpu.staged import StagedReduce, staged_all_reduce
from .._transport.gpu.staging import stage, upload
from .._transport.gpu.streams import GpuCall, gpu_call
from .common import CollectiveTensor, Input, check_record, start, take_input

if TYPE_CHECKING:
    from .._runtime.context import DistributedContext

__all__ = [
    "StagedCollective",
    "cuda_result_device",
    "gpu_all_reduce",
    "gpu_fused_all_reduce",
    "received_on_gpu",
]


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
    fix = FixUp(group.size if plan.divide else None, final, plan.codec)
    if direct:
        path: DeviceReduce | StagedReduce = DeviceReduce(call, group.comm, send, out, plan, ready, fix)
    else:
        path = staged_all_reduce(ctx, group, call, send, ready, plan, array.nbytes, out, fix)
    finish_path = path.finish

    def finish() -> Tensor:
        finish_path()
        return result

    record = check_record(ctx, group, Record("all_reduce", reduce_op, array.dtype, array.shape, -1, group.members))
    op = Op("all_reduce", group, array.nbytes, path.post, finish, record, (send, out, final, *path.keep),
            source.guard(ctx))
    return start(ctx, op, result)


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


# -- the other collectives: through their host implementations --------------------------------
#
# Until a collective has a GPU path of its own, its CuPy inputs are staged (synchronously),
# the host implementation runs on the pinned copies, and `resolve()` copies the results to
# the GPU, ordered on the caller's stream. Every rank then runs the host algorithm, whatever
# its inputs, so ranks with host and GPU inputs always agree.


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
    settles_later = False

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
        return Tensor(upload(self._call, value.array), self._device)


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
    staged = [stage(call, item.buffer, after=ready) if item.on_gpu else None for item in inputs]
    hosts = [s.wait() if s is not None else item.buffer for s, item in zip(staged, inputs)]
    if isinstance(structure, dict):
        host_structure: Any = dict(zip(keys, hosts))
    else:
        host_structure = type(structure)(hosts)
    return StagedCollective(ctx, run(host_structure), call, device, [item.on_gpu for item in inputs])
