"""What a compiled call site runs: the eager collective, its result written into XLA's buffer.

A runner gets NumPy views of XLA's buffers: the input read-only, the result writable. Types
NumPy lacks (bfloat16) come as bytes and are viewed in the call's dtype first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import mpitensor as mt

from .._collectives.all_reduce import all_reduce_held, held_lane
from .._collectives.held import HELD_KINDS, data_lane, held_call, reducible
from .._collectives.native import find_lane, wait_at_call

# A runner returns None, or for its site a fast path (ctx, run) (`_handler.run`).
Runner = Callable[[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], "tuple[Any, Any] | None"]

# From this size an all-reduce goes from XLA's input into XLA's result buffer by the held
# all-reduce (`all_reduce_held`, its compiled lane: the check, then MPI's blocking
# all-reduce); below it the compiled lane's result is copied in. Measured on 2 ranks, the
# check on: at 16 KiB 11.1 against 15.4 us on Open MPI, 12.6 against 12.3 on MPICH, 6.3
# against 6.7 on Intel MPI; at 64 KiB 12-23 against 13-38 us; at 256 B Open MPI's held call
# was already faster, MPICH's and Intel MPI's slower.
_HELD_FROM = 16 << 10


def make(kind: str, aval_in: Any, aval_out: Any, params: dict[str, Any]) -> Runner:
    """The runner of a call site: collective `kind` with `params`, on arrays of these avals."""
    dtype_in, shape_in = np.dtype(aval_in.dtype), tuple(aval_in.shape)
    dtype_out, shape_out = np.dtype(aval_out.dtype), tuple(aval_out.shape)
    if kind == "all_reduce":  # its result is of its input's shape and dtype
        make_all_reduce = _held_all_reduce if dtype_in.itemsize * int(np.prod(shape_in)) >= _HELD_FROM else _all_reduce
        return make_all_reduce(dtype_in, shape_in, params["op"], params["devices"])
    if kind in HELD_KINDS and params["devices"] is None and (kind != "reduce" or reducible(params["op"], dtype_in)):
        return _held_data(kind, (dtype_in, shape_in), (dtype_out, shape_out), params.get("root", -1), params.get("op"))
    start = _STARTS[kind]

    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> None:
        source = _typed(inputs[0], dtype_in, shape_in)
        out = _typed(results[0], dtype_out, shape_out)
        start(source, out, params)

    return runner


def _held_all_reduce(dtype: np.dtype, shape: tuple[int, ...], op: Any, devices: Any) -> Runner:
    """The runner of an all-reduce from `_HELD_FROM` bytes: the held all-reduce into XLA's buffer.

    MPI's blocking all-reduce from XLA's input straight into XLA's result buffer, once the
    check agreed. XLA's buffers are the call's own until it returns: the promise
    `all_reduce_held` asks for. A runner of its own, with nothing looked up per call: inside
    jax.jit every Python step costs several times what it costs in a loop of eager calls.
    """

    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> tuple[Any, Any] | None:
        source, out = inputs[0], results[0]
        native = source.dtype == dtype
        if not native:  # bytes (bfloat16)
            source, out = _typed(source, dtype, shape), _typed(out, dtype, shape)
        previous = wait_at_call(True)  # see _all_reduce
        try:
            result = all_reduce_held(source, op, devices, out=out).resolve().array
        finally:
            wait_at_call(previous)
        if result is not out:  # an input it takes another way
            np.copyto(out, result)
            return None
        # Later calls: the lane's run_held called by the handler itself, while this context
        # is open (inside jax.jit the Python around it cost 3-4 us per call).
        ctx = mt.current_context()
        lane = held_lane(ctx, source, op, True) if native and devices is None else None
        return None if lane is None else (ctx, lane.run_held)

    return runner


def _held_data(kind: str, aval_in: tuple[np.dtype, tuple[int, ...]], aval_out: tuple[np.dtype, tuple[int, ...]],
               root: int, op: Any) -> Runner:
    """The runner of a broadcast, all-gather, all-to-all, gather or reduce on the full group: MPI's blocking call.

    The held collective (`_collectives/held.py`): once the check agreed, MPI's blocking call
    from XLA's input straight into XLA's result buffer, which are the call's own until it
    returns; from the second call the handler calls the compiled lane's ``run_held`` itself
    (see `_held_all_reduce`). Through the general path, inside jax.jit on 2 Open MPI ranks,
    each call cost 30-85 us more than mpi4jax's (1.24-1.58x).
    """
    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> tuple[Any, Any] | None:
        source, out = _typed(inputs[0], *aval_in), _typed(results[0], *aval_out)
        previous = wait_at_call(True)  # see _all_reduce
        try:
            held_call(kind, source, out, root, op).resolve()
        finally:
            wait_at_call(previous)
        if source is not inputs[0] or out is not results[0]:  # bytes (bfloat16): no lane of views
            return None
        ctx = mt.current_context()
        lane = data_lane(ctx, kind, source, root, op)
        return None if lane is None else (ctx, lane.run_held)

    return runner


def _typed(array: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if array.dtype == dtype:
        return array
    return array.view(dtype).reshape(shape)


def _all_reduce(dtype: np.dtype, shape: tuple[int, ...], op: Any, devices: Any) -> Runner:
    """The runner of an all-reduce below `_HELD_FROM` bytes: the compiled lane's result copied into XLA's.

    The program waits for the result anyway: a late peer's check is waited for on the
    compiled lane, yielding the core (up to 2 ms), instead of in the engine's queue, whose
    steps are slower (8 B inside jax.jit on 2 Open MPI ranks: 1.01-1.04x mpi4jax's time,
    against 1.11-1.15x). The lane's fresh result (carried in the check up to 64 bytes) is
    copied into XLA's buffer: its array, not the Tensor, which NumPy would search for an
    array interface first.
    """

    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> tuple[Any, Any] | None:
        source, out = inputs[0], results[0]
        native = source.dtype == dtype
        if not native:  # bytes (bfloat16)
            source, out = _typed(source, dtype, shape), _typed(out, dtype, shape)
        previous = wait_at_call(True)
        try:
            np.copyto(out, mt.all_reduce(source, op, devices).resolve().array)
        finally:
            wait_at_call(previous)
        # Later calls: the lane's run_into called by the handler itself (see _held_all_reduce).
        ctx = mt.current_context()
        lane = find_lane(ctx, source, op) if native and devices is None else None
        return None if lane is None else (ctx, lane.run_into)

    return runner


def _broadcast(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.broadcast(source, root=params["root"], devices=params["devices"], out=out).resolve()


def _all_gather(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.all_gather(source, devices=params["devices"], out=out).resolve()


def _reduce_scatter(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.reduce_scatter(source, params["op"], devices=params["devices"], out=out).resolve()


def _all_to_all(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.all_to_all(source, devices=params["devices"], out=out).resolve()


def _reduce(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    root = params["root"]
    at_root = mt.current_context().rank == root
    mt.reduce(source, params["op"], root=root, devices=params["devices"], out=out if at_root else None).resolve()
    if not at_root:
        out[...] = source


def _gather(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    # Stacked on the root (each rank's array one row of a new first axis); the input elsewhere.
    gathered = mt.gather(source[None], params["root"], devices=params["devices"]).resolve()
    np.copyto(out, source if gathered is None else gathered.array)


def _scatter(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    root, devices = params["root"], params["devices"]
    if mt.current_context().rank == root:
        block = mt.scatter(source, root, devices=devices).resolve()
    else:
        size = len(devices) if devices is not None else mt.current_context().size
        block = mt.scatter(None, root, shape=(size, *out.shape), dtype=out.dtype, devices=devices).resolve()
    np.copyto(out, block.array.reshape(out.shape))


def _scan(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    start = mt.exscan if params["exclusive"] else mt.scan
    np.copyto(out, start(source, params["op"], devices=params["devices"]).resolve().array)


def _barrier(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.barrier(params["devices"])
    np.copyto(out, source)


def _sendrecv(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    if params["source"] == params["dest"] == mt.current_context().rank:
        # A rank's exchange with itself (a ring of one) is a copy, as MPI_Sendrecv's is.
        if source.shape != out.shape or source.dtype != out.dtype:
            raise ValueError(f"sendrecv with itself: sent {source.dtype}{list(source.shape)}, but the receive "
                             f"buffer is {out.dtype}{list(out.shape)}; give recvbuf the sent array's shape and dtype")
        np.copyto(out, source)
        return
    sent = mt.send(source, params["dest"], tag=params["tag"])
    mt.recv(source=params["source"], shape=out.shape, dtype=out.dtype, tag=params["tag"], out=out).resolve()
    sent.resolve()


_STARTS = {
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "scan": _scan,
    "barrier": _barrier,
    "sendrecv": _sendrecv,
}
