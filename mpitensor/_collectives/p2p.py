"""Point-to-point `send` and `recv` (``MPI_Isend`` / ``MPI_Irecv``).

Every message is a small header (dtype and shape) followed by the data, on the context's
own point-to-point communicator. The header lets `recv` size its buffer from what was sent
and, when the receiver names the shape and dtype it expects, lets it report a mismatch
naming both sides instead of truncating or reading garbage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.device import Device
from .._core.dtypes import mpi_datatype
from .._core.errors import CollectiveMismatchError
from .._core.interop import numpy_dtype
from .._core.tensor import Tensor
from .._runtime.check import dtype_code, dtype_from_code
from .._runtime.context import DistributedContext
from .._runtime.engine import Op
from .._transport import mpi
from .common import CollectiveTensor, Later, context_for, follow, result_device, root_rank, start, take_input
from .gpu_host import staged
from .gpu_staged import received_on_gpu
from .options import output_buffer, output_tensor, protect_output, refuse_on_gpu

__all__ = ["ANY_SOURCE", "ReceiveTensor", "recv", "send"]

ANY_SOURCE = -1  # `recv`'s source: whichever rank's message of the tag comes first
MAX_TAG = (1 << 14) - 1
MAX_DIMS = 8  # dimensions a point-to-point header describes
_HEADER = 2 + MAX_DIMS  # dtype code, ndim, dims


def _peer(ctx: DistributedContext, peer: Any, what: str, name: str) -> int:
    rank = root_rank(ctx, peer)
    if not 0 <= rank < ctx.size:
        raise ValueError(f"{what}: {name} {rank} is out of range for a context of {ctx.size} ranks")
    if rank == ctx.rank:
        raise ValueError(f"{what}: {name} {rank} is this rank; a rank cannot {what} to itself")
    return rank


def _tag(tag: Any) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"tag must be in 0..{MAX_TAG}, got {tag}")
    return int(tag)


def _header(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"send/recv carry tensors of up to {MAX_DIMS} dimensions, got {len(shape)}")
    header = np.zeros(_HEADER, np.int64)
    header[0] = dtype_code(dtype)
    header[1] = len(shape)
    header[2 : 2 + len(shape)] = shape
    return header


def _describe(header: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
    ndim = int(header[1])
    return dtype_from_code(int(header[0])), tuple(int(d) for d in header[2 : 2 + ndim])


def send(input: Any, dest: int | Device, *, tag: int = 0) -> CollectiveTensor:  # noqa: A002
    """Start sending a tensor to rank `dest` and return at once.

    Args:
        input: the tensor to send; it must not be written until the send resolves.
        dest: the receiving rank (in the context) or its `Device`.
        tag: tells apart messages between the same two ranks (0..16383).

    Returns:
        A `CollectiveTensor` resolving to None once the buffer may be reused.

    Raises:
        TypeError, ValueError: bad input, rank or tag.
    """
    ctx = context_for("send")
    peer = _peer(ctx, dest, "send", "dest")
    tag = _tag(tag)
    source = take_input(input, ctx, "send")
    if source.on_gpu:
        return staged(ctx, source, ctx.p2p_group, lambda host, _: send(host, peer, tag=tag))
    protections = source.guard(ctx)
    data = source.buffer
    header = _header(data.shape, data.dtype)
    channel, datatype = ctx.p2p_group, mpi_datatype(data.dtype)

    def post() -> list[Any]:
        return [mpi.send(channel, header, None, peer, 2 * tag),
                mpi.send(channel, data, datatype, peer, 2 * tag + 1)]

    op = Op(
        f"send to rank {peer}",
        ctx.p2p_group,
        data.nbytes,
        post,
        lambda: None,
        keep=(header, data),
        protections=protections,
    )
    return start(ctx, op, None)


class _Receive:
    """Receives the header, then the data into a buffer sized from it."""

    def __init__(self, ctx: DistributedContext, peer: int, tag: int, expect: tuple[Any, Any] | None,
                 device: Device, later: Later, out: Any = None, guard: Any = None) -> None:
        self.ctx, self.peer, self.tag, self.expect, self.device, self.later = ctx, peer, tag, expect, device, later
        self.out, self.guard = out, guard  # the caller's out=, and how to protect it once posted
        self.header = np.empty(_HEADER, np.int64)
        self.channel = ctx.p2p_group
        # From any rank: the header's status names the sender, whose data comes next.
        self.status = mpi.status() if peer == ANY_SOURCE else None
        self.header_req = mpi.recv(self.channel, self.header, None, mpi.any_source() if peer == ANY_SOURCE else peer,
                                   2 * tag)
        self.data_req: Any = None
        self.error: Exception | None = None
        self.data: np.ndarray | None = None

    def advance(self) -> bool:
        if self.data_req is None:
            if not (self.header_req.Test() if self.status is None else self.header_req.Test(self.status)):
                return False
            if self.status is not None:
                self.peer = self.status.Get_source()
            dtype, shape = _describe(self.header)
            if self.expect is not None and self.ctx.config.check:
                want_shape, want_dtype = self.expect
                if (tuple(want_shape), np.dtype(want_dtype)) != (shape, dtype):
                    self.error = CollectiveMismatchError(
                        f"Mismatched send/recv (tag {self.tag}): rank {self.peer} sent a tensor of shape "
                        f"{shape} and dtype {dtype}, but rank {self.ctx.rank} expects shape "
                        f"{tuple(want_shape)} and dtype {np.dtype(want_dtype)}"
                    )
            # The data is received in full even on a mismatch, so no message is left behind.
            target = self._target(shape, dtype)
            self.data = target if target is not None else self.ctx.pool.empty(shape, dtype)
            self.data_req = mpi.recv(self.channel, self.data, mpi_datatype(dtype), self.peer, 2 * self.tag + 1)
            if target is not None:
                self.guard(target)
            if self.error is None:
                self.later.value = output_tensor(self.out, self.data, self.device)
        return bool(self.data_req.Test())

    def _target(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """`out`'s array if the message fits it; else None (an error, if there is an `out`)."""
        if self.out is None:
            return None
        array = self.out.array if isinstance(self.out, Tensor) else self.out
        if (array.shape, array.dtype) == (shape, dtype):
            return array
        if self.error is None:
            self.error = ValueError(
                f"recv: rank {self.peer} sent a tensor of shape {shape} and dtype {dtype}, which does not fit "
                f"out= (shape {array.shape}, dtype {array.dtype})"
            )
        return None

    def finish(self) -> Tensor:
        if self.error is not None:
            raise self.error
        return self.later.value


def _expected(shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a receiver states it expects.

    Raises:
        TypeError: only one of them is given.
    """
    if shape is None or dtype is None:
        raise TypeError("recv: give both shape= and dtype= (or a template tensor)")
    return ((shape,) if isinstance(shape, int) else tuple(shape), numpy_dtype(dtype))


def _fits_out(ctx: DistributedContext, out: Any, expect: tuple[Any, Any] | None,
              template: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Check `out` for `recv`: what it expects (from `expect`, else `out` itself).

    Raises:
        TypeError, ValueError: as `output_buffer`, against the expected shape and dtype.
    """
    shape = tuple(getattr(out, "shape", ()))
    dtype = getattr(out, "dtype", None)
    if expect is not None:
        shape, dtype = tuple(expect[0]), np.dtype(expect[1])
    overlap = () if template is None else (template.array if isinstance(template, Tensor) else template,)
    output_buffer(ctx, out, shape, np.dtype(dtype) if dtype is not None else np.dtype(None), "recv", overlap)
    return shape, np.dtype(dtype)


def _recv_args(ctx: DistributedContext, template: Any, source: Any, tag: Any) -> tuple[Any, int, int]:
    """`recv`'s template, peer (`ANY_SOURCE`: any) and tag; an int where the template goes is the source.

    Raises:
        TypeError, ValueError: no source, or a bad rank or tag.
    """
    if source is None and isinstance(template, (int, np.integer, Device)) and not isinstance(template, bool):
        template, source = None, template
    if source is None:
        raise TypeError("recv needs source=, the rank to receive from (or ANY_SOURCE for any)")
    if isinstance(source, (int, np.integer)) and not isinstance(source, bool) and source == ANY_SOURCE:
        return template, ANY_SOURCE, _tag(tag)
    return template, _peer(ctx, source, "recv", "source"), _tag(tag)


class ReceiveTensor(CollectiveTensor):
    """The handle of a `recv`: a `CollectiveTensor` that also says which rank sent the message.

    `source` is the sending rank once the message has begun to arrive (at the latest when the
    handle is resolved): the rank given to `recv`, or for `ANY_SOURCE` the rank whose message
    was taken; None before.
    """

    __slots__ = ("_receive",)

    def __init__(self, op: Op, value: Any, ctx: DistributedContext, receive: list[_Receive]) -> None:
        super().__init__(op, value, ctx)
        self._receive = receive

    @property
    def source(self) -> int | None:
        """The sending rank (in the context), or None while it is not known yet."""
        if not self._receive:
            return None
        peer = self._receive[0].peer
        return None if peer == ANY_SOURCE else peer


def recv(
    input: Any = None,  # noqa: A002
    source: int | Device | None = None,
    *,
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
    tag: int = 0,
    out: Any = None,
) -> CollectiveTensor:
    """Start receiving a tensor from rank `source` and return at once.

    Shape and dtype come from the sender; when the receiver states what it expects (a
    template, `shape` and `dtype`, or `out`) and the check is on, a difference raises
    `CollectiveMismatchError` naming both.

    Args:
        input: an optional template tensor of the expected shape and dtype (not written).
            An int here is taken as `source`, so ``recv(0)`` receives from rank 0.
        source: the sending rank (in the context) or its `Device`; `ANY_SOURCE` for the first
            message of the tag from any rank (the handle's ``source`` then names its sender).
        shape: the expected shape (instead of a template).
        dtype: the expected dtype (instead of a template).
        tag: the tag the sender used (0..16383).
        out: a host Tensor or NumPy array to receive into (writable, C-contiguous; by
            default its shape and dtype are the expected ones); see docs/options.md.

    Returns:
        A `ReceiveTensor` (a `CollectiveTensor`) resolving to the received tensor (or to
        `out`), whose ``source`` is the sending rank.

    Raises:
        TypeError, ValueError: bad template, rank, tag or `out`; ValueError at resolve
            when what was sent does not fit `out` (with the check off).
        CollectiveMismatchError: (at resolve) the sender's shape or dtype differs from the
            expected one.
    """
    ctx = context_for("recv")
    input, peer, tag = _recv_args(ctx, input, source, tag)  # noqa: A001
    expect, device = None, ctx.cpu_device
    if input is not None:
        template = take_input(input, ctx, "recv", "the template")
        expect, device = (template.array.shape, template.buffer.dtype), result_device(ctx, template)
        if template.on_gpu:
            if peer == ANY_SOURCE:
                raise ValueError("recv: a GPU template takes a named source, not ANY_SOURCE")
            refuse_on_gpu("recv", out=out)
            inner = recv(None, peer, shape=expect[0], dtype=expect[1], tag=tag)
            return follow(received_on_gpu(ctx, inner), template.back)
    elif shape is not None or dtype is not None:
        expect = _expected(shape, dtype)
    expect = expect if out is None else _fits_out(ctx, out, expect, input)
    later = Later()
    receive: list[_Receive] = []

    def post() -> _Receive:
        receive.append(_Receive(ctx, peer, tag, expect, device, later, out, lambda a: protect_output(op, out, a)))
        return receive[0]

    # A lambda: the receive exists only once posted.
    sender = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
    op = Op(f"recv from {sender}", ctx.p2p_group, 0, post, lambda: receive[0].finish())  # noqa: PLW0108
    ctx.engine.submit(op)
    return follow(ReceiveTensor(op, later, ctx, receive), template.back if input is not None else None)
