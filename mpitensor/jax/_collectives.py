"""The collectives of mpitensor.jax: functions on JAX arrays, usable under every transformation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np

import mpitensor as mt

from .. import integration
from . import _handler, _primitives, _rules

Devices = Sequence[int] | None
F = TypeVar("F", bound=Callable[..., Any])

_DIFFERENTIABLE = ("sum", "mean")


def _same(shape: tuple[int, ...], **params: Any) -> tuple[int, ...]:
    return shape


def _gathered(shape: tuple[int, ...], *, devices: tuple[int, ...] | None) -> tuple[int, ...]:
    size = _rules.size(devices)
    return (size,) if not shape else (size * shape[0], *shape[1:])


def _cut(shape: tuple[int, ...], kind: str, devices: tuple[int, ...] | None) -> int:
    size = _rules.size(devices)
    if not shape or shape[0] % size:
        raise ValueError(
            f"mpitensor.jax.{kind} cuts its input's first axis into {size} equal blocks (one per rank), "
            f"but the input's shape is {shape}: give it a first axis of a multiple of {size}"
        )
    return shape[0] // size


def _scattered(shape: tuple[int, ...], *, op: str, devices: tuple[int, ...] | None) -> tuple[int, ...]:
    return (_cut(shape, "reduce_scatter", devices), *shape[1:])


def _exchanged(shape: tuple[int, ...], *, devices: tuple[int, ...] | None) -> tuple[int, ...]:
    _cut(shape, "all_to_all", devices)
    return shape


def _gathered_at_root(shape: tuple[int, ...], *, root: int, devices: tuple[int, ...] | None) -> tuple[int, ...]:
    return (_rules.size(devices), *shape) if _rules.rank() == root else shape


def _scattered_from_root(shape: tuple[int, ...], *, root: int, devices: tuple[int, ...] | None) -> tuple[int, ...]:
    if _rules.rank() != root:
        return shape
    size = _rules.size(devices)
    if not shape or shape[0] != size:
        raise ValueError(
            f"mpitensor.jax.scatter: the root's input has one row per rank along its first axis, so a first "
            f"axis of {size}, but its shape is {shape}"
        )
    return shape[1:]


def _received(shape: tuple[int, ...], *, recv_shape: tuple[int, ...], **params: Any) -> tuple[int, ...]:
    return recv_shape


all_reduce_p = _primitives.make("all_reduce", _same)
broadcast_p = _primitives.make("broadcast", _same)
reduce_p = _primitives.make("reduce", _same)
all_gather_p = _primitives.make("all_gather", _gathered)
reduce_scatter_p = _primitives.make("reduce_scatter", _scattered)
all_to_all_p = _primitives.make("all_to_all", _exchanged)
gather_p = _primitives.make("gather", _gathered_at_root)
scatter_p = _primitives.make("scatter", _scattered_from_root)
scan_p = _primitives.make("scan", _same)
barrier_p = _primitives.make("barrier", _same)
sendrecv_p = _primitives.make("sendrecv", _received)


def _all_reduce_transpose(ct: Any, shape: tuple[int, ...], *, op: str, devices: Any, adjoint: bool) -> Any:
    if op == "mean":  # one value held by every rank, 1/size of each rank's input
        return ct / _rules.size(devices)
    return all_reduce_p.bind(ct, op=op, devices=devices, adjoint=not adjoint)


def _broadcast_transpose(ct: Any, shape: tuple[int, ...], *, root: int, devices: Any) -> Any:
    summed = reduce_p.bind(ct, op="sum", root=root, devices=devices)
    return summed if _rules.rank() == root else jnp.zeros_like(ct)


def _reduce_transpose(ct: Any, shape: tuple[int, ...], *, op: str, root: int, devices: Any) -> Any:
    spread = broadcast_p.bind(ct, root=root, devices=devices)
    return spread if _rules.rank() == root else spread + ct


def _all_gather_transpose(ct: Any, shape: tuple[int, ...], *, devices: Any) -> Any:
    return reduce_scatter_p.bind(ct, op="sum", devices=devices).reshape(shape)


def _reduce_scatter_transpose(ct: Any, shape: tuple[int, ...], *, op: str, devices: Any) -> Any:
    return all_gather_p.bind(ct, devices=devices)


def _all_to_all_transpose(ct: Any, shape: tuple[int, ...], *, devices: Any) -> Any:
    return all_to_all_p.bind(ct, devices=devices)


def _sendrecv_transpose(ct: Any, shape: tuple[int, ...], *, recv_shape: Any, recv_dtype: Any, source: int, dest: int,
                        tag: int) -> Any:
    # What came from `source` carries its cotangent back there; this rank's sent data gets
    # the cotangent of what `dest` received.
    return sendrecv_p.bind(ct, recv_shape=shape, recv_dtype=ct.dtype, source=dest, dest=source, tag=tag)


_rules.linear(all_reduce_p, _all_reduce_transpose, ops=_DIFFERENTIABLE)
_rules.linear(sendrecv_p, _sendrecv_transpose)
_rules.linear(broadcast_p, _broadcast_transpose)
_rules.linear(reduce_p, _reduce_transpose, ops=("sum",))
_rules.linear(all_gather_p, _all_gather_transpose)
_rules.linear(reduce_scatter_p, _reduce_scatter_transpose, ops=("sum",))
_rules.linear(all_to_all_p, _all_to_all_transpose)
for _primitive in (all_reduce_p, broadcast_p, reduce_p, scan_p):
    _rules.elementwise_batching(_primitive)
_rules.received_batching(sendrecv_p)
for _primitive in (all_gather_p, reduce_scatter_p, all_to_all_p):
    _rules.first_axis_batching(_primitive)


def _door(kind: str) -> Callable[[F], F]:
    """Run a collective's function (its tracing, under a transformation) inside its door (`mt.collective_call`).

    An error raised while a rank traces or checks its call (a shape its group cannot cut, a
    dtype the collective cannot move) takes that call's turn on its group: the peers, whose
    compiled programs run the call, raise `CollectiveMismatchError` naming this rank,
    instead of pairing with its next call.
    """

    def wrap(function: F) -> F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            with mt.collective_call(kind, kwargs.get("devices")):
                return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


def _op(op: mt.ReduceOperation | str) -> str:
    # The name, not the enum member, is the primitive's parameter: JAX hashes and prints it.
    return integration.reduce_operation(op).value


def _devices(devices: Devices) -> tuple[int, ...] | None:
    if devices is None:
        return None
    return tuple(int(getattr(device, "rank", device)) for device in devices)


def _root(root: Any) -> int:
    return int(getattr(root, "rank", root))


def _array(x: Any) -> Any:
    _handler.register()
    return jnp.asarray(x)


@_door("all_reduce")
def all_reduce(x: Any, op: mt.ReduceOperation | str = "sum", *, devices: Devices = None) -> Any:
    """All-reduce a JAX array: every rank gets the element-wise reduction of all ranks' `x`.

    Works eagerly and inside ``jax.jit``, ``grad``/``vjp`` (``sum`` and ``mean``), ``jvp``
    and ``vmap``; the call is checked against the other ranks' calls as every mpitensor
    collective is.

    Args:
        x: the array (or anything ``jnp.asarray`` takes).
        op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"``, ``"prod"``, ``"band"``, ``"bor"``,
            ``"bxor"`` or a `mpitensor.ReduceOperation`.
        devices: the group: ranks (or `Device`s) of the open context; None for all.

    Returns:
        A JAX array of `x`'s shape and dtype.

    Raises:
        ValueError: `op` is not a reduction.
        TypeError: ``mean`` of an integer array, a bitwise op of a floating one, or a dtype the
            collective cannot communicate (packed sub-byte, float8, float0: see docs/jax.md),
            raised as the call is traced.
        NoContextError: no context is open.
    """
    return all_reduce_p.bind(_array(x), op=_op(op), devices=_devices(devices), adjoint=False)


@_door("broadcast")
def broadcast(x: Any, root: Any = 0, *, devices: Devices = None) -> Any:
    """Broadcast the root's `x` to every rank (every rank passes an array of its shape and dtype).

    Args:
        x: the array; on ranks other than the root only its shape and dtype count.
        root: the sending rank (of the open context, a member of the group) or its `Device`.
        devices: the group; None for every rank.

    Returns:
        The root's array, on every rank.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        NoContextError: no context is open.
    """
    return broadcast_p.bind(_array(x), root=_root(root), devices=_devices(devices))


@_door("reduce")
def reduce(x: Any, op: mt.ReduceOperation | str = "sum", root: Any = 0, *, devices: Devices = None) -> Any:
    """Reduce every rank's `x` to the root.

    Args:
        x: the array.
        op: the reduction (as for `all_reduce`).
        root: the rank (or `Device`) that gets the result.
        devices: the group; None for every rank.

    Returns:
        The reduction on the root; `x` unchanged on the other ranks (a compiled program's
        result has one shape on every rank).

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        ValueError: `op` is not a reduction.
        NoContextError: no context is open.
    """
    return reduce_p.bind(_array(x), op=_op(op), root=_root(root), devices=_devices(devices))


@_door("all_gather")
def all_gather(x: Any, *, tiled: bool = False, devices: Devices = None) -> Any:
    """Gather every rank's `x` on every rank, in rank order.

    Args:
        x: the array; every rank passes the same shape.
        tiled: False (as ``jax.lax.all_gather`` and mpi4jax): the arrays are stacked along a
            new first axis, ``result[k]`` being rank k's; True: they are concatenated along
            the first axis (as `mpitensor.all_gather`; a 0-d array counts as one element).
        devices: the group; None for every rank.

    Returns:
        An array of shape ``(size, *x.shape)``, or ``(size * x.shape[0], *x.shape[1:])`` tiled.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        NoContextError: no context is open.
    """
    x = _array(x)
    return all_gather_p.bind(x if tiled else x[None], devices=_devices(devices))


@_door("reduce_scatter")
def reduce_scatter(x: Any, op: mt.ReduceOperation | str = "sum", *, devices: Devices = None) -> Any:
    """Reduce every rank's `x` element-wise and give rank k the k-th block of the first axis.

    Args:
        x: the array; its first axis a multiple of the group's size.
        op: the reduction (as for `all_reduce`; ``sum`` for derivatives).
        devices: the group; None for every rank.

    Returns:
        This rank's block: ``x.shape[0] // size`` rows.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        ValueError: `op` is not a reduction, or the first axis does not divide.
        NoContextError: no context is open.
    """
    return reduce_scatter_p.bind(_array(x), op=_op(op), devices=_devices(devices))


@_door("all_to_all")
def all_to_all(x: Any, *, devices: Devices = None) -> Any:
    """Send block k of `x`'s first axis to rank k; the result is the blocks received, in rank order.

    Args:
        x: the array; its first axis a multiple of the group's size.
        devices: the group; None for every rank.

    Returns:
        An array of `x`'s shape.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        ValueError: the first axis does not divide by the group's size.
        NoContextError: no context is open.
    """
    return all_to_all_p.bind(_array(x), devices=_devices(devices))


@_door("gather")
def gather(x: Any, root: Any = 0, *, devices: Devices = None) -> Any:
    """Gather every rank's `x` on the root, stacked along a new first axis (as mpi4jax's).

    Args:
        x: the array; every rank passes the same shape.
        root: the rank (or `Device`) that gets the result.
        devices: the group; None for every rank.

    Returns:
        On the root, ``(size, *x.shape)``, row k being rank k's `x`; elsewhere `x` unchanged
        (a compiled program's result has one shape per rank).

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        NoContextError: no context is open.
    """
    return gather_p.bind(_array(x), root=_root(root), devices=_devices(devices))


@_door("scatter")
def scatter(x: Any, root: Any = 0, *, devices: Devices = None) -> Any:
    """Give rank k row k of the root's `x` (as mpi4jax's).

    Args:
        x: on the root, an array of ``(size, *shape)``; elsewhere an array of ``shape`` and the
            root's dtype (only its shape and dtype count).
        root: the sending rank (or `Device`).
        devices: the group; None for every rank.

    Returns:
        This rank's row, of ``shape``.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        ValueError: the root's first axis is not the group's size.
        NoContextError: no context is open.
    """
    return scatter_p.bind(_array(x), root=_root(root), devices=_devices(devices))


@_door("scan")
def scan(x: Any, op: mt.ReduceOperation | str = "sum", *, exclusive: bool = False, devices: Devices = None) -> Any:
    """Prefix reduction in rank order: rank k gets the reduction of ranks 0..k's `x`.

    Args:
        x: the array; the same shape on every rank.
        op: the reduction (as for `all_reduce`).
        exclusive: reduce ranks 0..k-1 instead (`mpitensor.exscan`; rank 0 gets the op's identity).
        devices: the group; None for every rank.

    Returns:
        An array of `x`'s shape and dtype.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        ValueError: `op` is not a reduction.
        NoContextError: no context is open.
    """
    return scan_p.bind(_array(x), op=_op(op), exclusive=bool(exclusive), devices=_devices(devices))


@_door("barrier")
def barrier(*, devices: Devices = None) -> None:
    """Wait until every rank of the group arrives; inside ``jax.jit`` it keeps its place in the program order.

    Args:
        devices: the group; None for every rank.

    Raises:
        NoContextError: no context is open.
    """
    barrier_p.bind(_array(np.int32(0)), devices=_devices(devices))


def sendrecv(sendbuf: Any, recvbuf: Any, source: Any, dest: Any, *, tag: int = 0) -> Any:
    """Send `sendbuf` to `dest` and receive from `source` at once (as mpi4py's and mpi4jax's ``sendrecv``).

    Both sides of an exchange call it, so a ring or a halo exchange cannot deadlock. Under
    ``grad`` the cotangent of what was received goes back to `source`.

    Args:
        sendbuf: the array to send.
        recvbuf: an array of the shape and dtype to receive (only those count).
        source: the rank (or `Device`) to receive from.
        dest: the rank (or `Device`) to send to.
        tag: tells apart messages between the same two ranks (0..16383).

    Returns:
        A new array: what `source` sent.

    Raises:
        TypeError: a dtype the collective cannot communicate (packed sub-byte, float8, float0:
            see docs/jax.md), raised as the call is traced.
        NoContextError: no context is open.
    """
    template = jnp.asarray(recvbuf)
    return sendrecv_p.bind(_array(sendbuf), recv_shape=tuple(template.shape), recv_dtype=np.dtype(template.dtype),
                           source=_root(source), dest=_root(dest), tag=int(tag))
